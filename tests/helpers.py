"""Plain helpers the tests share: build tars, wait for a condition, and run a real gunicorn
host on a free loopback port. Fixtures live in conftest.py; tests import from here."""

from __future__ import annotations

import contextlib
import io
import os
import platform
import signal
import socket
import subprocess
import sys
import tarfile
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polyserve.deploy.forkserver import SPARES, ForkServer
from polyserve.deploy.forkserver import listening as forkserver_listening
from polyserve.settings import scrubbed_environ

REPO = Path(__file__).resolve().parent.parent

T = TypeVar("T")


class Ballast:
    """Pretend memory for the registry's memory cap in-process: a space holds one at
    module level, and it counts until the space's modules are collected."""

    live: ClassVar[weakref.WeakSet[Ballast]] = weakref.WeakSet()
    peak: ClassVar[int] = 0  # the most held at once, in bytes: a test resets it

    def __init__(self, mib: int) -> None:
        self.mib = mib
        Ballast.live.add(self)
        Ballast.peak = max(Ballast.peak, Ballast.held())

    @staticmethod
    def held() -> int:
        """Bytes held by every Ballast still alive: the registry's `memory` in tests."""
        return sum(b.mib for b in Ballast.live) << 20


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


def metrics_histogram(host: HostProcess, name: str, space: str) -> dict[str, float]:
    """A space's histogram from the host's /metrics: its cumulative buckets by `le`, and
    its `count` and `sum`."""
    (family,) = [
        f for f in text_string_to_metric_families(host.get("/metrics").text) if f.name == name
    ]
    assert family.type == "histogram"
    found: dict[str, float] = {}
    for sample in family.samples:
        if sample.labels["space"] == space:
            key = sample.labels.get("le") or sample.name.rsplit("_", 1)[1]
            found[key] = sample.value
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(predicate: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    """Poll until predicate() is truthy and return it; tests never sleep a fixed time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def children(pid: int) -> dict[int, str]:
    """Process `pid`'s children: pid -> its ps line (pid and command line)."""
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return {int(line.split()[0]): line for line in out.splitlines() if line.strip()}


# recvmsg(2)'s number: a fork server's spare validation reads its request with it once
# warm (until then it waits on its event loop, in epoll, while its worker thread warms up).
RECVMSG = {"x86_64": 47, "aarch64": 212}[platform.machine()]


def descendants(pid: int) -> set[int]:
    """Process `pid`'s children, theirs, and so on."""
    found = set(children(pid))
    for child in list(found):
        found |= descendants(child)
    return found


def warm_spares(server: int) -> set[int]:
    """A fork server's spare validations, once as many as it keeps are warm (in the read
    of their request): its children, or (with polyserve.deploy.sandbox) its children's."""

    def reading() -> set[int]:
        found = set()
        for pid in descendants(server):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/syscall").read_text().split()[0] == str(RECVMSG):
                    found.add(pid)
        return found if len(found) == SPARES else set()

    return until(reading, what="the fork server's spares to be warm")


def parent(pid: int) -> int:
    """Process `pid`'s parent (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return 0
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def holders(path: Path) -> set[int]:
    """The processes that have `path` open: how a test finds the process a module runs
    in from outside, where the module cannot tell (a validation in a PID namespace of
    its own knows only its pid there)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # gone, or not ours to look into
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                        found.add(int(pid))
    return found


def alive(pid: int) -> bool:
    """Whether process `pid` is running (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"


FOLLOWER = "polyserve.fleet.follower"  # in the follower process's command line
FORKSERVER = "polyserve.deploy.forkserver"  # in the validation fork server's


class HostProcess:
    """`gunicorn -c gunicorn.conf.py` started by a test, stopped by its PID."""

    # Set by conftest while a test without the `gunicorn` mark runs: starting a host then
    # fails, so `pytest -m "not gunicorn"` never starts one unnoticed.
    unmarked_test: str | None = None

    def __init__(
        self,
        data_dir: Path,
        workers: int = 2,
        args: tuple[str, ...] = (),
        session: bool = False,
        **env: str,
    ) -> None:
        self.data_dir = data_dir
        self.workers = workers
        self.args = args  # extra gunicorn command-line options
        # A session (and process group) of its own, which os.killpg can end at once.
        self.session = session
        self.extra_env = env
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"{data_dir.name}-gunicorn.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, port: int) -> None:
        assert HostProcess.unmarked_test is None, (
            f"{HostProcess.unmarked_test} starts gunicorn: mark it @pytest.mark.gunicorn"
        )
        self.port = port
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
                start_new_session=self.session,
            )

    def start(self) -> HostProcess:
        self._spawn(free_port())
        self.wait_ready()
        return self

    def start_expecting_exit(self, port: int = 0, timeout: float = 60) -> tuple[int, str]:
        """Start a master that must fail to start (on `port`, or a free one), and wait for
        it to exit by itself: its exit status, and what this start logged."""
        logged = self.log.stat().st_size if self.log.exists() else 0
        self._spawn(port or free_port())
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        with open(self.log, "rb") as log:
            log.seek(logged)
            return code, log.read().decode(errors="replace")

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

    def _children(self) -> dict[int, str]:
        return children(self.proc.pid)

    def worker_pids(self) -> set[int]:
        """The master's children but its fleet follower and its validation fork server
        (processes of their own)."""
        return {
            pid
            for pid, args in self._children().items()
            if FOLLOWER not in args and FORKSERVER not in args
        }

    def forkserver_pid(self, timeout: float = 30.0) -> int:
        """The master's validation fork server, once it listens (it starts beside the
        workers and warms up before it binds its socket)."""

        def listening() -> int | None:
            found = [pid for pid, args in self._children().items() if FORKSERVER in args]
            return found[0] if len(found) == 1 and forkserver_listening(found[0]) else None

        return until(listening, timeout, "the validation fork server to listen")

    def follower_pid(self) -> int:
        """The master's fleet follower (a host with POLYSERVE_DATABASE_URL)."""
        (pid,) = [pid for pid, args in self._children().items() if FOLLOWER in args]
        return pid

    def hup(self) -> None:
        """HUP the master, and wait until every worker is a new one."""
        old = self.worker_pids()
        self.proc.send_signal(signal.SIGHUP)
        until(
            lambda: self.worker_pids().isdisjoint(old) and len(self.worker_pids()) == self.workers,
            what="HUP to replace every worker",
        )

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


@contextlib.contextmanager
def running_forkserver(preload: tuple[str, ...] = ("numpy", "onnxruntime")) -> Iterator[ForkServer]:
    """A validation fork server started as a master starts one, once it listens."""
    server = ForkServer(preload, scrubbed_environ())
    server.ensure()
    try:
        until(lambda: forkserver_listening(server.proc.pid), what="the fork server to listen")
        yield server
    finally:
        server.stop()


# Fixtures that start a real host: conftest marks every test that uses one `gunicorn`.
HOST_FIXTURES = {"host_factory"}


def module_host(name: str, **kw: Any) -> Any:
    """A module-scoped fixture called `name`: one host started with `kw` (HostProcess's
    arguments) and shared by a module's tests, each using its own space names."""
    HOST_FIXTURES.add(name)

    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostProcess]:
        host = HostProcess(tmp_path_factory.mktemp(name) / "data", **kw)
        try:
            yield host.start()
        finally:
            host.stop()

    fixture.__doc__ = f"One host, HostProcess(data_dir, **{kw!r}), for a module's tests."
    return pytest.fixture(fixture, scope="module", name=name)


# -- tar payloads built header by header, so a test never holds the 64 MiB they expand to --

BIG = 64 << 20  # what the hostile payloads would unpack to without the caps
MAIN = b"def handle(request):\n    return 'ok'\n"


class GzipWriter:
    def __init__(self, path: Path) -> None:
        self.out = path.open("wb")
        self.zip = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: gzip framing
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)
        self.out.write(self.zip.compress(data))

    def repeat(self, byte: bytes, count: int) -> None:
        chunk = byte * (1 << 20)
        while count > 0:
            self.write(chunk[:count])
            count -= len(chunk)

    def pad(self) -> None:
        self.write(b"\0" * (-self.written % tarfile.BLOCKSIZE))

    def close(self) -> None:
        self.write(b"\0" * 2 * tarfile.BLOCKSIZE)
        self.out.write(self.zip.flush())
        self.out.close()


def tar_header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(tarfile.GNU_FORMAT)


def long_name_tgz(path: Path, size: int = BIG) -> Path:
    """A GNU long-name (`L`) header whose name is `size` bytes, then a member it names."""
    out = GzipWriter(path)
    out.write(tar_header("././@LongLink", size + 1, tarfile.GNUTYPE_LONGNAME))
    out.repeat(b"a", size)
    out.write(b"\0")
    out.pad()
    out.write(tar_header("x", 0))
    out.close()
    return path


def dot_entries_tgz(path: Path, count: int = 50_001) -> Path:
    """`count` directory entries named `./` (what `tar -C dir .` starts with), then main.py."""
    out = GzipWriter(path)
    dot = tar_header("./", 0, tarfile.DIRTYPE)
    for _ in range(count):
        out.write(dot)
    out.write(tar_header("./main.py", len(MAIN)) + MAIN)
    out.pad()
    out.close()
    return path
