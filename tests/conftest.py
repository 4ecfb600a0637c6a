"""Fixtures: real gunicorn hosts on free loopback ports (the helpers are in helpers.py)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from polyserve import devices
from polyserve.state.shm import segment_name
from tests.haproxy import INSTALL_HINT as HAPROXY_HINT
from tests.haproxy import find_haproxy
from tests.helpers import HOST_FIXTURES, HostProcess, module_host
from tests.postgres import INSTALL_HINT, PostgresServer, find_bindir

# Fixtures that need a real PostgreSQL server: conftest marks their tests `postgres`.
POSTGRES_FIXTURES = {"postgres", "fleet_db", "own_postgres"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses a host fixture, even through another fixture, starts gunicorn.
    Tests that start one themselves carry @pytest.mark.gunicorn."""
    for item in items:
        if HOST_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gunicorn)
        if POSTGRES_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture starts: a host started by an unmarked test fails it.
    marked = item.get_closest_marker("gunicorn") is not None
    HostProcess.unmarked_test = None if marked else item.nodeid
    if item.get_closest_marker("gpu") is not None and not _gpus():
        pytest.skip(GPU_HINT)


GPU_HINT = (
    "needs an NVIDIA GPU seen through NVML (the driver's libnvidia-ml and nvidia-ml-py,"
    " `pip install nvidia-ml-py`): run `make gpu-check` or `pytest -m gpu` on a GPU"
    " machine (docs/gpu.md)"
)


@functools.cache
def _gpus() -> tuple[int, ...]:
    return devices.detected()


@pytest.fixture
def host_factory(tmp_path: Path) -> Iterator[callable]:
    started: list[HostProcess] = []

    def start(name: str = "data", **kw: object) -> HostProcess:
        host = HostProcess(tmp_path / name, **kw)
        started.append(host)
        return host.start()

    yield start
    for host in started:
        host.stop()
        # A test that failed between killing a master and restarting it leaves the
        # segment behind; the passing path never does (tests assert that).
        Path("/dev/shm", segment_name(str(host.data_dir))).unlink(missing_ok=True)


# One 2-worker host shared by a module's tests; each test uses its own space names.
host = module_host("host")


# -- a real PostgreSQL (tests/postgres.py): skipped, saying how to install it, if missing --


def _postgres_bindir() -> Path:
    bindir = find_bindir()
    if bindir is None:
        pytest.skip(INSTALL_HINT)
    return bindir


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session; each test takes a database of its own."""
    server = PostgresServer(_postgres_bindir())
    try:
        yield server.start()
    finally:
        server.destroy()


@pytest.fixture
def fleet_db(postgres: PostgresServer) -> str:
    """A fresh database on the session's server (a fleet of its own): its URL."""
    return postgres.create_database()


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A server of the test's own, which it may stop and start (the shared one must not)."""
    server = PostgresServer(_postgres_bindir())
    try:
        yield server.start()
    finally:
        server.destroy()


@pytest.fixture
def haproxy_binary() -> str:
    """Debian's haproxy, or the test skips saying how to install it."""
    found = find_haproxy()
    if found is None:
        pytest.skip(HAPROXY_HINT)
    return found
