"""The fork server's process: the master starts, pings and stops it; it warms up and serves.

A validation spawned as a new interpreter pays for importing onnxruntime and numpy
before the tenant's own code runs, most of a deploy's time (bench/NOTES.md, "Figures
moved out of code comments (issue 26)"). The master instead starts one fork server (`python -m
polyserve.deploy.forkserver NAME MASTER_PID PRELOAD NAMESPACES`), a fresh interpreter
with the environment a validation gets (no host secrets: the stdlib's forkserver would
pass the caller's whole environment, and would not outlive gunicorn's fork of workers),
which imports POLYSERVE_PRELOAD's modules once, binds its socket and serves
(polyserve.deploy.forkloop). A worker asks it for a child (polyserve.deploy.forkclient);
the child takes the same limits a spawned validator does (new session, RLIMIT_AS,
polyserve.deploy.sandbox: it is the keeper of a validation it forks, in namespaces of its
own where the host may make them) and runs exactly that validator's code,
polyserve.deploy.child. The server keeps SPARES children forked and warmed ahead of
their requests (polyserve.deploy.forkspares).

The master pings it: a server that is stopped, or that does not answer in
forkclient.HANDSHAKE_S, is killed and started again.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from polyserve import procs
from polyserve.deploy import forkclient, sandbox
from polyserve.deploy.forkloop import Server
from polyserve.serve import warmup

_STOP_S = 5.0
# Children kept forked ahead of their requests (what each holds: bench/NOTES.md,
# "Figures moved out of code comments (issue 26)").
SPARES = 2
# What a validation child uses on top of the preloaded modules: imported once here, so
# the import time a validation reports is the tenant module's own, as in a worker (what
# each costs: bench/NOTES.md, "Figures moved out of code comments (issue 26)").
_WARM = (
    "compileall",
    "polyserve.serve.loader",
    "polyserve.models",  # what model spaces load with (docs/models.md)
    "anyio.to_thread",
    "anyio._backends._asyncio",  # imported at anyio's first use in a loop
)
_OPTIONAL_WARM = ("uvloop", "starlette.applications")

log = logging.getLogger("polyserve.deploy.forkserver")


def new_name() -> str:
    """A fresh abstract socket name for one master's fork server."""
    return f"polyserve-validate-{os.getpid()}-{secrets.token_hex(8)}"


def listening(pid: int) -> bool:
    """Whether process `pid` (a fork server, seen from outside: tests, benchmarks) has a
    listening Unix socket, which it binds once warm."""
    try:
        fds = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except FileNotFoundError:  # it exited
        return False
    inodes = {fd[len("socket:[") : -1] for fd in fds if fd.startswith("socket:[")}
    # /proc/net/unix: Num RefCount Protocol Flags Type St Inode [Path]; __SO_ACCEPTCON
    rows = [row.split() for row in Path("/proc/net/unix").read_text().splitlines()[1:]]
    return any(row[3] == "00010000" and row[6] in inodes for row in rows)


class ForkServer:
    """The master's handle on its fork server: start it, start it again if it died, stop
    it. Workers only need `name` (they inherit this object with the master's memory)."""

    def __init__(
        self, preload: tuple[str, ...], env: Mapping[str, str], namespaces: bool = True
    ) -> None:
        self.name = new_name()
        self.preload = preload
        self.env = dict(env)
        self.namespaces = namespaces
        self.proc: subprocess.Popen[bytes] | None = None

    def ensure(self) -> str | None:
        """Start the server if it is not running, or replace it if it does not answer;
        None if it runs, else why this call started one ("started", "exited",
        "stopped answering"). Until it has imported the preloaded modules and listens,
        workers spawn validators."""
        if self.proc is None:
            why = "started"
        elif self.proc.poll() is not None:
            why = "exited"
        elif self.answering():
            return None
        else:  # a SIGKILL ends a stopped process too; its children die with it
            why = "stopped answering"
            self.proc.kill()
            self.proc.wait()
        argv = [sys.executable, "-m", "polyserve.deploy.forkserver", self.name, str(os.getpid())]
        # A session of its own: a terminal's Ctrl-C is the master's to handle, which
        # stops this server after its workers (and PR_SET_PDEATHSIG if it dies).
        self.proc = subprocess.Popen(
            [*argv, ",".join(self.preload), "1" if self.namespaces else "0"],
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return why

    def answering(self) -> bool:
        """Whether the running server answers a ping; True while it warms up (it binds
        its socket only once warm). False if it is stopped: a validation that can see it
        (without namespaces) may have sent it SIGSTOP."""
        assert self.proc is not None
        if sandbox.stopped(self.proc.pid):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(forkclient.HANDSHAKE_S)
            try:
                s.connect(forkclient.address(self.name))
            except (ConnectionRefusedError, FileNotFoundError):
                return True  # not listening yet
            except OSError:
                return False
            try:
                s.send(json.dumps({"ping": True}).encode())
                return json.loads(s.recv(forkclient.MAX_MESSAGE)).get("pong") is True
            except (OSError, ValueError, AttributeError):
                return False

    def stop(self) -> None:
        """At exit: SIGTERM, on which it kills its children's groups; SIGKILL if slow."""
        if self.proc is not None:
            procs.stop_child(self.proc, _STOP_S)


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _warm(preload: list[str]) -> None:
    """Import what every validation would import first. A preloaded module that fails
    here is skipped: the master already refused to start for one that cannot import."""
    for name in [*preload, *_WARM, *_OPTIONAL_WARM]:
        try:
            importlib.import_module(name)
            if name in warmup.WARMUPS:
                warmup.WARMUPS[name]()
        except Exception as exc:
            if name not in _OPTIONAL_WARM:
                log.warning("fork server: cannot import %s: %s", name, exc)
    # Nothing here is collected again: children then never write these objects' headers
    # (each write would copy a shared page), as pre_fork does for workers.
    gc.freeze()


def main(argv: list[str]) -> None:
    name, master, preload = argv[0], int(argv[1]), [m for m in argv[2].split(",") if m]
    namespaces = len(argv) < 4 or argv[3] == "1"
    logging.basicConfig(format="[%(process)d] %(message)s")
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # SIGTERM (and so the cleanup below) when the master dies, even of a SIGKILL.
    procs.die_with_parent(signal.SIGTERM)
    if os.getppid() != master:
        os._exit(0)
    sandbox.subreaper()  # what a killed keeper's validation leaves comes here: see forkloop._Strays
    server = None
    try:
        _warm(preload)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Bound only once warm: until then a worker's connect fails and it spawns.
        listener.bind(forkclient.address(name))
        listener.listen(64)
        listener.setblocking(False)
        server = Server(listener, master, tuple(preload), SPARES, namespaces)
        server.run()
    except SystemExit:
        pass
    except BaseException:  # a bug of ours: said in the master's log, then the master restarts it
        log.exception("the validation fork server failed")
    finally:
        if server is not None:
            server.stop()
        # The server loaded onnxruntime: skip the C exit handlers it has no use for.
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
