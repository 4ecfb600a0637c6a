"""Shared test helpers: build tars, and run a real gunicorn host on a free loopback port."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from polyserve.shm import segment_name

REPO = Path(__file__).resolve().parent.parent


def make_tar(files: dict[str, str | bytes], gzip: bool = False) -> bytes:
    """A tar of {name: content}, written like `tar -cf x.tar -C dir .` (./-prefixed)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gzip else "w") as tar:
        for name, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HostProcess:
    """`gunicorn -c gunicorn.conf.py` started by a test, stopped by its PID."""

    def __init__(
        self, data_dir: Path, workers: int = 2, args: tuple[str, ...] = (), **env: str
    ) -> None:
        self.data_dir = data_dir
        self.workers = workers
        self.args = args  # extra gunicorn command-line options
        self.extra_env = env
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"{data_dir.name}-gunicorn.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HostProcess:
        self.port = free_port()
        env = {
            **os.environ,
            "POLYSERVE_BIND": f"127.0.0.1:{self.port}",
            "POLYSERVE_WORKERS": str(self.workers),
            "POLYSERVE_DATA_DIR": str(self.data_dir),
            **self.extra_env,
        }
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", *self.args],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=log,
            )
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Poll until every worker answers (never a fixed sleep)."""
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.tail()
            with contextlib.suppress(httpx.TransportError):
                seen.add(self.get("/_polyserve/health").json()["pid"])
            if len(seen) >= self.workers:
                return
            time.sleep(0.02)
        raise AssertionError(f"host not ready in {timeout} s:\n{self.tail()}")

    def get(self, path: str, **kw: object) -> httpx.Response:
        # A fresh connection per call, so calls spread over the workers.
        return httpx.get(self.url + path, headers={"Connection": "close"}, timeout=30, **kw)

    def deploy(
        self, space: str, content: str | bytes, filename: str = "main.py", **kw: object
    ) -> httpx.Response:
        data = content.encode() if isinstance(content, str) else content
        return httpx.post(
            self.url + "/_polyserve/deploy",
            data={"space": space},
            files={"module": (filename, data)},
            timeout=60,
            **kw,
        )

    def worker_pids(self) -> set[int]:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True
        ).stdout
        return {int(p) for p in out.split()}

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostProcess]:
    """One 2-worker host shared by a module's tests; each test uses its own space names."""
    h = HostProcess(tmp_path_factory.mktemp("host") / "data").start()
    yield h
    h.stop()
