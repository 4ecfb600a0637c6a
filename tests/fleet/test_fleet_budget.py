"""A fleet host's disk budget (POLYSERVE_DISK_BUDGET_MB): real gunicorn hosts sharing a
real PostgreSQL. A host that served more spaces than its budget holds removes the
coldest ones' files (never their metadata) and fetches them again on their next
request; a version a worker holds stays, whatever the budget says."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx2 as httpx
import pytest

# _client: test_fleet's module-wide HTTP client, which its helpers use (an autouse fixture)
from tests.fleet.test_fleet import _client, files_here, get, start_fleet  # noqa: F401
from tests.helpers import HostProcess, make_tar, until

pytestmark = pytest.mark.postgres

KIB = 1024
PAD = 400 * KIB  # each space's files; the budget holds two of them, not three
BUDGET = {"POLYSERVE_DISK_BUDGET_MB": "1", "POLYSERVE_IDLE_TTL": "0.3"}


def deploy_padded(host: HostProcess, space: str, source: str) -> None:
    """Deploy `source` with PAD bytes of files that do not compress beside it."""
    tar = make_tar({"main.py": source, "pad.bin": os.urandom(PAD)}, gzip=True)
    r = host.deploy(space, tar, "space.tar")
    assert r.status_code == 200, r.text
    assert r.json()["hosts"] == {"applied": 2, "live": 2}, r.json()


def answer(host: HostProcess, space: str) -> str:
    r = get(host, f"/s/{space}/")
    assert r.status_code == 200, r.text
    return r.json()["space"]


def disk_bytes(host: HostProcess) -> int:
    """The bytes of every version's files in the host's data directory."""
    spaces = host.data_dir / "spaces"
    return sum(p.stat().st_size for p in spaces.glob("*/*/versions/*/**/*") if p.is_file())


def metadata_here(host: HostProcess, space: str) -> bool:
    return (host.data_dir / "spaces" / space / "versions" / "1.json").is_file()


NAMED = "def handle(request):\n    return {{'space': {space!r}}}\n"


def test_a_host_over_its_disk_budget_removes_the_cold_files_and_fetches_them_again(
    host_factory, fleet_db
):
    """Four spaces of 400 KiB served in turn by a host with a 1 MiB budget: once its
    workers let them go, the files of the two served first are gone, the metadata of
    all four stays, and the first one served again is fetched again (then the coldest
    of the others goes in its place)."""
    a, b = start_fleet(host_factory, fleet_db, "ab", **BUDGET)
    spaces = [f"u/s{i}" for i in range(4)]
    for space in spaces:
        deploy_padded(a, space, NAMED.format(space=space))
    for space in spaces:
        assert answer(b, space) == space

    def trimmed() -> bool:
        return [files_here(b, s) for s in spaces] == [[], [], [1], [1]]

    until(trimmed, what="the files of u/s0 and u/s1 to be removed")
    assert disk_bytes(b) <= 1 << 20
    assert all(metadata_here(b, s) for s in spaces)
    assert answer(b, "u/s0") == "u/s0"  # fetched again
    assert files_here(b, "u/s0") == [1]
    until(lambda: files_here(b, "u/s2") == [], what="u/s2, now the coldest, to be removed")
    assert [files_here(b, s) for s in spaces] == [[1], [], [], [1]]
    assert files_here(a, "u/s0") == []  # a never served them: it holds none of their files
    log = b.log.read_text()
    assert "disk budget: removed the files of u/s0 v1" in log, log[-3000:]


# Waits for the test's gate file to exist, so the test decides when the request ends.
WAITING = """
import asyncio, os

async def handle(request):
    for _ in range(3000):  # bounded: a test that never opens the gate fails, it does not hang
        if os.path.exists({gate!r}):
            return {{'space': 'u/slow'}}
        await asyncio.sleep(0.02)
    return {{'space': 'the gate never opened'}}
"""


def test_a_version_a_worker_holds_is_never_removed_over_the_budget(
    host_factory, fleet_db, tmp_path: Path
):
    """The coldest space's files stay while a request to it is in flight, though the
    host is over its budget: newer spaces' files go instead; the request then ends
    with the version it started on."""
    a, b = start_fleet(host_factory, fleet_db, "ab", **BUDGET)
    gate = tmp_path / "gate"
    deploy_padded(a, "u/slow", WAITING.format(gate=str(gate)))
    others = [f"u/f{i}" for i in range(3)]
    for space in others:
        deploy_padded(a, space, NAMED.format(space=space))
    slow: list[httpx.Response] = []
    request = threading.Thread(target=lambda: slow.append(get(b, "/s/u/slow/")))
    request.start()
    try:
        until(lambda: files_here(b, "u/slow") == [1], what="u/slow's files on b")
        for space in others:
            assert answer(b, space) == space

        def trimmed() -> bool:
            return [files_here(b, s) for s in others] == [[], [], [1]]

        until(trimmed, what="the files of u/f0 and u/f1, newer than u/slow's, to be removed")
        assert files_here(b, "u/slow") == [1]  # the coldest, but held
        assert not slow  # still in flight
    finally:
        gate.touch()
        request.join()
    assert slow[0].status_code == 200 and slow[0].json() == {"space": "u/slow"}, slow[0].text
    assert disk_bytes(b) <= 1 << 20
