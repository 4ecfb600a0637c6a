"""Benchmark plumbing: start servers on free loopback ports, run wrk, summarize rounds."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2

REPO = Path(__file__).resolve().parent.parent
APPS = REPO / "bench" / "apps"
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# On a small machine the load generator and the servers fight over the same cores, and
# where the scheduler happens to put them moves a round's result by 2x either way. So
# servers are pinned to SERVER_CPUS and wrk to the rest (when there is a rest).
_CPUS = sorted(os.sched_getaffinity(0))
WRK_CPUS = _CPUS[:1] if len(_CPUS) > 1 else _CPUS
SERVER_CPUS = _CPUS[1:] if len(_CPUS) > 1 else _CPUS


def pinned(argv: list[str], cpus: list[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cpus)), *argv] if shutil.which("taskset") else argv


class Server:
    """A server process we started, reachable at `url`, stopped by its PID."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        env: dict[str, str] | None = None,
        ready: str = "/",
        cpus: list[int] | None = None,
    ) -> None:
        argv = pinned(argv, cpus or SERVER_CPUS)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        fd, self.log = tempfile.mkstemp(prefix="bench-", suffix=".log")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env={**os.environ, **(env or {})}, stdout=fd, stderr=fd
        )
        os.close(fd)  # the server holds its own copy
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv} exited: {Path(self.log).read_text()[-2000:]}")
            try:
                httpx2.get(self.url + ready, timeout=2)
                return
            except httpx2.TransportError:
                time.sleep(0.05)
        raise RuntimeError(f"{argv} not ready: {Path(self.log).read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def polyserve(workers: int, data_dir: Path, cpus: list[int] | None = None, **env: str) -> Server:
    port = free_port()
    return Server(
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py"],
        port,
        env={
            "POLYSERVE_BIND": f"127.0.0.1:{port}",
            "POLYSERVE_WORKERS": str(workers),
            "POLYSERVE_DATA_DIR": str(data_dir),
            **env,
        },
        ready="/_polyserve/health",
        cpus=cpus,
    )


def bare_gunicorn(app: str, workers: int, **env: str) -> Server:
    """A plain ASGI app on gunicorn with the same worker class, loop and parser."""
    port = free_port()
    return Server(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",  # not the repository's gunicorn.conf.py: polyserve's hooks and settings
            str(APPS / "bare.conf.py"),
            "-k",
            "uvicorn_worker.UvicornWorker",
            "-w",
            str(workers),
            "-b",
            f"127.0.0.1:{port}",
            "--no-control-socket",
            "--pythonpath",
            str(APPS),
            app,
        ],
        port,
        env=env,
    )


def uvicorn_server(app: str, workers: int) -> Server:
    port = free_port()
    return Server(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            str(APPS),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            "--no-access-log",
            app,
        ],
        port,
    )


# One client for every deploy: httpx2.post builds a client per call (its TLS context
# above all), ~50 ms that a deploy's own time would otherwise carry.
_client = httpx2.Client()


def deploy(url: str, space: str, filename: str, content: bytes) -> dict:
    r = _client.post(
        url + "/_polyserve/deploy",
        data={"space": space},
        files={"module": (filename, content)},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()


def forkserver_pid(server: Server, timeout: float = 60) -> int:
    """The host's validation fork server, once it listens (it warms up after the start)."""
    from polyserve.deploy.forkserver import listening

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["ps", "-o", "pid=,args=", "--ppid", str(server.proc.pid)],
            capture_output=True,
            text=True,
        ).stdout.splitlines()
        found = [int(line.split()[0]) for line in out if "polyserve.deploy.forkserver" in line]
        if found and listening(found[0]):
            return found[0]
        time.sleep(0.05)
    raise RuntimeError("the fork server did not start listening")


def wrk_path() -> str:
    found = shutil.which("wrk")
    if found is None:
        sys.exit(
            "wrk is missing: install it with `apt-get install wrk` (Debian/Ubuntu)"
            " or your system's package manager, then run `make bench` again"
        )
    return found


def wrk(url: str, connections: int, seconds: int, script: Path | None = None) -> dict[str, float]:
    """One wrk run: requests/s and latency percentiles (ms); `script` is a Lua file
    that sets the method, body and headers (a POST), else each request is a GET."""
    out = subprocess.run(
        pinned(
            [
                wrk_path(),
                "-t",
                "1",
                "-c",
                str(connections),
                "-d",
                f"{int(seconds)}s",
                "--latency",
                *(["-s", str(script)] if script else []),
                url,
            ],
            WRK_CPUS,
        ),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1])}
    for pct in ("50", "99"):
        value, unit = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        result[f"p{pct}_ms"] = float(value) * _UNITS[unit]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    result["non_2xx"] = int(errors[1]) if errors else 0
    socket_errors = re.search(r"Socket errors: (.*)", out)
    result["socket_errors"] = socket_errors[1] if socket_errors else ""
    return result


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


# -- in-process: a store and one worker's registry, without HTTP -------------------------


def publish_example(data_dir: Path, space: str, max_spaces: int = 16) -> None:
    """Publish examples/python-onnx-tiny as `space` the way a deploy does (minus HTTP and
    the validator subprocess, whose byte-compilation is done here)."""
    import compileall
    import io
    import tarfile

    from polyserve.state.store import Store

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(REPO / "examples" / "python-onnx-tiny", arcname=".")
    store = Store(data_dir, max_spaces)
    staged = store.stage(buf, "onnx-tiny.tar", 64 << 20)
    compileall.compile_dir(str(staged.dir), quiet=2)
    with store.locked():
        store.publish(space, staged, {"kind": "handle", "import_ms": 0})


def registry(data_dir: Path, clock, max_spaces: int = 16):
    """One worker's registry over a private table, as a worker builds it."""
    from polyserve.serve.registry import Registry
    from polyserve.state.broadcast import Broadcast
    from polyserve.state.shm import Table
    from polyserve.state.store import Store
    from polyserve.usage.meter import CELLS, Meter

    table = Table.anonymous(1, max_spaces, CELLS)
    return Registry(
        Store(data_dir, max_spaces),
        Broadcast(table, 0),
        Meter(table, 0),
        idle_ttl=1.0,
        start_timeout=30.0,
        clock=clock,
    )
