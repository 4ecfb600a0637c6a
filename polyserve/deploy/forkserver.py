"""The fork server: one warm interpreter that forks each deploy's validation child.

A validation spawned as a new interpreter pays for importing onnxruntime and numpy
before the tenant's own code runs, ~100 ms of a ~140 ms deploy. The master instead starts
one fork server (`python -m polyserve.deploy.forkserver NAME MASTER_PID PRELOAD NAMESPACES`), a
fresh interpreter with the environment a validation gets (no host secrets: the stdlib's
forkserver would pass the caller's whole environment, and would not outlive gunicorn's
fork of workers), which imports POLYSERVE_PRELOAD's modules once and waits. A worker's
`fork()` asks it over a Unix socket for a child and passes the child's stdout and stderr
pipes with SCM_RIGHTS; the child takes the same limits a spawned validator does (new
session, RLIMIT_AS, polyserve.deploy.sandbox: it is the keeper of a validation it forks, in
namespaces of its own where the host may make them) and runs exactly that validator's
code, `polyserve.deploy.validate.child`. The server itself never runs tenant code: it only
forks, reaps and reports exit statuses, and kills what a validation left behind when its
keeper was killed first (the server is the subreaper of its children's orphans).

It forks children ahead of their requests: two spares, forked at the start and half a
second after the last validation ended. Each detaches, warms up as a worker does at boot
(polyserve.serve.warmup.in_worker) on the event loop and worker thread a validation uses, says
"ready" on a socket of its own, and waits there for the request the server passes on,
which it acknowledges ("took"); a request that finds no ready spare (warming, in use,
killed, or stopped) gets a child forked for it. A spare found stopped is killed and
forked again; one that has not taken its request after _TAKE_S is killed, and its
worker validates in a new interpreter.

The socket is in Linux's abstract namespace, named at random per master: no path to
clean up after a master killed with -9, none longer than sun_path's 108 bytes under a
deep data directory. Abstract sockets have no file permissions, so the server accepts
only peers of its own uid (SO_PEERCRED), the uid workers and tenant code already run as.

Protocol (SOCK_SEQPACKET, one JSON message each): the worker sends {"argv", "env"} with
two fds; the server answers {"pid"} (the keeper's) once forked and {"returncode"} once
the child is reaped (negative: the signal that ended it, as subprocess reports). A worker
that hangs up first (its deploy timed out or was cancelled) gets its validation ended:
SIGTERM to the keeper, its group killed if it has not exited within _END_S. The master
sends {"ping": true} and expects {"pong": true}: a server that is stopped, or that does
not answer in _HANDSHAKE_S, is killed and started again; a worker that finds the server
stopped does not wait for it and spawns its validator.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import json
import logging
import os
import secrets
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from polyserve import procs
from polyserve.deploy import sandbox
from polyserve.serve import warmup

_MAX_MESSAGE = 1 << 20  # a request carries the environment: a few KiB
_HANDSHAKE_S = 5.0  # a live server forks at once; past this, spawn instead
_STOP_S = 5.0
_END_S = 5.0  # how long an ended validation's keeper has to clean up before it is killed
# A warm spare reads its request at once: one that has not in this long is stopped, or
# so starved that a new interpreter will validate sooner.
_TAKE_S = 1.0
_PARENT_CHECK_S = 1.0  # how long an orphaned server may outlive its master
# How long after the last validation ends the next spare is forked: a deploy's publish
# and its first loads in the workers come right after, and the spare's fork and warm-up
# beside them made those slower (two cores here).
_SPARE_DELAY_S = 0.5
SPARES = 2  # children kept forked ahead of their requests, ~4 MiB of its own each
EXIT_CHILD_FAILED = 70  # EX_SOFTWARE: the child failed before validate.child took over
# What a validation child uses on top of the preloaded modules: imported once here, so
# the import time a validation reports is the tenant module's own, as in a worker.
_WARM = (
    "compileall",
    "polyserve.deploy.validate",
    "polyserve.serve.loader",
    "polyserve.models",  # what model spaces load with (docs/models.md), ~6 ms
    "anyio.to_thread",
    "anyio._backends._asyncio",  # imported at anyio's first use in a loop, ~25 ms
)
_OPTIONAL_WARM = ("uvloop", "starlette.applications")

log = logging.getLogger("polyserve.deploy.forkserver")


def new_name() -> str:
    """A fresh abstract socket name for one master's fork server."""
    return f"polyserve-validate-{os.getpid()}-{secrets.token_hex(8)}"


def _address(name: str) -> str:
    return "\0" + name  # the abstract namespace: nothing on disk


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


# -- the master's side -------------------------------------------------------------------


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
            s.settimeout(_HANDSHAKE_S)
            try:
                s.connect(_address(self.name))
            except (ConnectionRefusedError, FileNotFoundError):
                return True  # not listening yet
            except OSError:
                return False
            try:
                s.send(json.dumps({"ping": True}).encode())
                return json.loads(s.recv(_MAX_MESSAGE)).get("pong") is True
            except (OSError, ValueError, AttributeError):
                return False

    def stop(self) -> None:
        """At exit: SIGTERM, on which it kills its children's groups; SIGKILL if slow."""
        if self.proc is not None:
            procs.stop_child(self.proc, _STOP_S)


# -- the server --------------------------------------------------------------------------


@dataclass
class _Spare:
    """A child forked ahead of its request, as the server sees it."""

    sock: socket.socket  # the server's end of the spare's own socket
    pidfd: int
    warm: bool = False  # it said "ready": only then is it handed a request
    child: int = 0  # the validation its keeper forked, once the keeper said so

    def stopped(self, pid: int) -> bool:
        """Whether the spare's keeper `pid` or its validation is stopped: it would take
        no request, or never report its exit."""
        return sandbox.stopped(pid) or (self.child != 0 and sandbox.stopped(self.child))


class _Server:
    """One thread, one selector: accept, fork on a request, report each child's exit
    (a pidfd per child). It never blocks on a client, so a client that connects and says
    nothing delays no one."""

    def __init__(
        self,
        listener: socket.socket,
        master: int,
        preload: tuple[str, ...] = (),
        spares: int = 0,
        namespaces: bool = False,
    ) -> None:
        self.listener = listener
        self.master = master
        self.preload = preload
        self.namespaces = namespaces  # each validation in namespaces of its own, if it may
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (client, pidfd)
        self.waiting: set[socket.socket] = set()  # clients that have not asked yet
        self.ahead: dict[int, _Spare] = {}  # children forked ahead of their request
        self.untaken: dict[int, socket.socket] = {}  # former spares yet to say they took it
        self.spares = spares  # how many to keep forked ahead: the server's loop (main) does
        self.spare_due: float | None = None  # when to fork the next spares (monotonic s)
        # Children to kill with their group at a time (monotonic s): a spare that has not
        # taken its request, a keeper that was told to end its validation.
        self.kill_due: dict[int, float] = {}
        self.strays: dict[int, int] = {}  # pid -> pidfd: children it did not fork, killed

    def run(self) -> None:
        """Serve until the master is gone. PR_SET_PDEATHSIG's SIGTERM alone is not enough:
        one that lands while the warm-up imports C extensions can be swallowed with the
        import's error (an orphaned server then served forever), so the loop also looks
        at its parent between selects."""
        self._fork_spares()
        while os.getppid() == self.master:
            timeout = _PARENT_CHECK_S
            for due in (self.spare_due, *self.kill_due.values()):
                if due is not None:
                    timeout = min(timeout, max(due - time.monotonic(), 0))
            self.step(timeout)
            self.kill_overdue()
            self._kill_stopped_spares()
            if self.spare_due is not None and time.monotonic() >= self.spare_due:
                self.spare_due = None
                if not self.children:
                    self._fork_spares()

    def kill_overdue(self) -> None:
        """Kill, with their groups, the children whose time in kill_due has come; each is
        reaped when its pidfd's event comes."""
        now = time.monotonic()
        for pid in [pid for pid, due in self.kill_due.items() if now >= due]:
            del self.kill_due[pid]
            procs.kill_group(pid, denied_ok=True)

    def step(self, timeout: float | None = None) -> None:
        """One select and what it found."""
        for key, _ in self.selector.select(timeout):
            # An earlier event of the same select may have ended this one: a child's exit
            # reaped and closed its client, whose hang-up is in the list too.
            if self.selector.get_map().get(key.fd) is not key:
                continue
            if key.fileobj is self.listener:
                self._accept()
            elif isinstance(key.data, int):
                self._reap(key.data)
            elif key.data == "request":
                self._request(key.fileobj)  # type: ignore[arg-type]
            elif key.data[0] == "stray":
                self._reap_stray(key.data[1])
            elif key.data[0] == "spare":
                self._spare_says(key.fileobj, key.data[1])  # type: ignore[arg-type]
            else:  # a client whose child runs: it hung up, or sent out of turn
                self._hung_up(key.fileobj, key.data[1])  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except BlockingIOError:
            return
        cred = client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", cred)[1] != os.getuid():  # see the module docstring
            client.close()
            return
        client.setblocking(False)
        self.waiting.add(client)
        self.selector.register(client, selectors.EVENT_READ, "request")

    def _request(self, client: socket.socket) -> None:
        self.selector.unregister(client)
        self.waiting.discard(client)
        fds: list[int] = []
        try:
            message, fds, _, _ = socket.recv_fds(client, _MAX_MESSAGE, 2)
            request = json.loads(message)
            if request.get("ping") is True and not fds:  # the master: is it answering?
                _send(client, {"pong": True})
                client.close()
                return
            argv, env = [str(a) for a in request["argv"]], request.get("env")
            if len(fds) != 2:
                raise ValueError("expected the child's stdout and stderr")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            for fd in fds:
                os.close(fd)
            client.close()
            return
        handed = self._hand_to_spare(argv, env, fds)
        if handed is not None:
            pid, pidfd = handed
        else:
            _flush()  # nothing buffered here may reach the child
            server = os.getpid()  # read before the fork: the child's getppid() may
            # already name the reaper if this process dies in between
            try:
                pid = os.fork()
            except OSError as exc:  # no memory or process left: this worker spawns instead
                log.warning("fork server: cannot fork a validation: %s", exc)
                for fd in fds:
                    os.close(fd)
                client.close()
                return
            if pid == 0:
                _in_child(self._child, server, client, argv, env, fds)
            pidfd = os.pidfd_open(pid)
            self.selector.register(pidfd, selectors.EVENT_READ, pid)
        for fd in fds:
            os.close(fd)  # the child's pipes must end when the child's copies do
        self.children[pid] = (client, pidfd)
        self.selector.register(client, selectors.EVENT_READ, ("running", pid))
        _send(client, {"pid": pid})

    # -- the spare: the next child, forked and set up ahead of its request ------------

    def _fork_spares(self) -> None:
        """Fork validation children ahead of their requests, up to `spares`: at the start,
        and a little after the last validation has ended. Each detaches and warms what a
        validation would pay for first (warmup.in_worker: a fork's first writes to the
        server's pages copy them), then waits for its request: a deploy waits neither for
        the fork (page tables for ~200 MiB, ~6 ms here) nor for that. Two, so that a
        deploy right after another (a script deploying a few spaces) finds one too.
        Without a warm spare (warming, in use, or killed), a request forks its own child."""
        while len(self.ahead) < self.spares and self._fork_spare():
            pass

    def _fork_spare(self) -> bool:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _flush()
        server = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            log.warning("fork server: cannot fork a spare validation child: %s", exc)
            ours.close()
            theirs.close()
            return False
        if pid == 0:
            ours.close()
            _in_child(self._spare_child, server, theirs)
        theirs.close()
        pidfd = os.pidfd_open(pid)
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        ours.setblocking(False)
        self.selector.register(ours, selectors.EVENT_READ, ("spare", pid))
        self.ahead[pid] = _Spare(ours, pidfd)
        return True

    def _spare_says(self, ours: socket.socket, pid: int) -> None:
        """What the spare says: "ready" once warm, "took" once it has read its request,
        and nothing (the end of its socket) once dead."""
        try:
            said = ours.recv(16)
        except BlockingIOError:
            return
        except OSError:
            said = b""
        if said == b"ready" and pid in self.ahead:
            self.ahead[pid].warm = True
        elif said.startswith(b"child ") and pid in self.ahead:  # from its keeper
            with contextlib.suppress(ValueError):
                self.ahead[pid].child = int(said[len(b"child ") :])
        elif said == b"took" and pid in self.untaken:
            self.selector.unregister(ours)
            self.untaken.pop(pid).close()
            self.kill_due.pop(pid, None)
        elif not said:  # it died: its pidfd's event reaps it (and closes this)
            self.selector.unregister(ours)

    def _hand_to_spare(
        self, argv: list[str], env: dict[str, str] | None, fds: list[int]
    ) -> tuple[int, int] | None:
        """Pass a request on to a warm spare, if there is one: its (pid, pidfd), or None.
        Until it says it took the request, it is watched: dying before that is the
        server's failure, not the tenant's (see _reap)."""
        self._kill_stopped_spares()
        # A request handed to a warming spare would wait for its warm-up.
        pid = next((pid for pid, spare in self.ahead.items() if spare.warm), None)
        if pid is None:
            return None
        spare = self.ahead[pid]
        try:
            socket.send_fds(spare.sock, [json.dumps({"argv": argv, "env": env}).encode()], fds)
        except OSError:  # it died since: reaped when its pidfd's event comes
            return None
        del self.ahead[pid]
        self.untaken[pid] = spare.sock
        self.kill_due[pid] = time.monotonic() + _TAKE_S  # cleared when it takes it
        return pid, spare.pidfd

    def _kill_stopped_spares(self) -> None:
        """A spare that is stopped (a validation that can see it, without namespaces, may
        have stopped it) takes no request: kill it; it is forked again once no validation
        runs."""
        for pid, spare in self.ahead.items():
            if spare.stopped(pid):
                spare.warm = False  # never handed a request: reaped when its pidfd says
                procs.kill_group(pid, denied_ok=True)

    def _spare_child(self, server: int, theirs: socket.socket) -> None:
        """In the spare: detach and split into a keeper and the validation, which runs
        the request the server passes on (its argv and environment, and the fds the
        worker sent) on the event loop it warmed up on."""
        self._detach(server)
        sandbox.contain(self.namespaces, lambda pid: theirs.send(b"child %d" % pid))
        from polyserve.deploy import validate

        validate.runner().run(self._spare(theirs))

    async def _spare(self, theirs: socket.socket) -> None:
        import anyio.to_thread

        from polyserve.deploy import validate

        # On the worker thread that will import the version: its paths are warmed too,
        # and the loop and the thread a validation would start first are there already.
        await anyio.to_thread.run_sync(warmup.in_worker, self.preload)
        theirs.send(b"ready")
        # Blocking the loop: nothing else runs on it yet.
        message, fds, _, _ = socket.recv_fds(theirs, _MAX_MESSAGE, 2)
        theirs.send(b"took")
        theirs.close()
        request = json.loads(message)
        self._become(request["argv"], request.get("env"), fds)
        await validate.child(request["argv"])

    def _hung_up(self, client: socket.socket, pid: int) -> None:
        with contextlib.suppress(OSError):
            if client.recv(_MAX_MESSAGE):
                return  # out of turn: ignored
        # The worker is gone or gave up (timeout, cancelled deploy): leave nothing running.
        # The keeper kills the validation and what it left; its group goes if it is slow.
        self.selector.unregister(client)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        self.kill_due.setdefault(pid, time.monotonic() + _END_S)

    def _reap(self, pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        # What the import left behind, as a spawned validator's parent kills it.
        procs.kill_group(pid, denied_ok=True)
        self.kill_due.pop(pid, None)
        # A keeper killed, or failed, before it could clean up after its validation.
        if os.WIFSIGNALED(status) or os.waitstatus_to_exitcode(status) == EXIT_CHILD_FAILED:
            self._strays()
        if pid in self.ahead:  # died waiting: killed
            spare = self.ahead.pop(pid)
            self._drop(spare.sock)
            self.selector.unregister(spare.pidfd)
            os.close(spare.pidfd)
            return  # forked again once no validation runs
        untaken, took = self.untaken.pop(pid, None), False
        if untaken is not None:  # its "took" may be in this same select, after the exit
            with contextlib.suppress(OSError):
                took = untaken.recv(16) == b"took"
            self._drop(untaken)
        client, pidfd = self.children.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(KeyError):
            self.selector.unregister(client)
        if untaken is None or took:
            _send(client, {"returncode": os.waitstatus_to_exitcode(status)})
        # Else a former spare died before it read its request: no exit status, as when the
        # server dies, so the worker validates in a new interpreter instead of blaming the
        # tenant's code.
        client.close()
        if not self.children and len(self.ahead) < self.spares:
            # Only once no validation runs, and a little later (_SPARE_DELAY_S): a
            # spare's fork and warm-up beside a validation took it longer than the
            # spare saved.
            self.spare_due = time.monotonic() + _SPARE_DELAY_S

    def _strays(self) -> None:
        """Kill the children this server did not fork: what a validation left when its
        keeper was killed first (this process is their subreaper). Each one's exit looks
        again, for what it leaves in turn."""
        for pid in sandbox.children(os.getpid()):
            if pid in self.children or pid in self.ahead or pid in self.strays:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:  # reaped already
                continue
            self.strays[pid] = pidfd
            self.selector.register(pidfd, selectors.EVENT_READ, ("stray", pid))

    def _reap_stray(self, pid: int) -> None:
        pidfd = self.strays.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        self._strays()

    def _drop(self, ours: socket.socket) -> None:
        with contextlib.suppress(KeyError):  # unregistered already if it said nothing
            self.selector.unregister(ours)
        ours.close()

    def _child(
        self,
        server: int,
        asked: socket.socket,
        argv: list[str],
        env: dict[str, str] | None,
        fds: list[int],
    ) -> None:
        """In a child forked for a request: become what a spawned validator is, and run."""
        self._detach(server)
        asked.close()
        sandbox.contain(self.namespaces)
        self._become(argv, env, fds)
        from polyserve.deploy import validate

        validate.main(argv)  # ends with os._exit

    def _detach(self, server: int) -> None:
        """In a child: its own session and death signal, none of the server's sockets."""
        os.setsid()  # its own group: the timeout kills whatever the import spawned
        # Nothing outlives the server (the master stops it, or it dies with it).
        procs.die_with_parent(signal.SIGKILL)
        if os.getppid() != server:
            os._exit(EXIT_CHILD_FAILED)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        # None of the server's sockets may reach tenant code.
        for client, pidfd in self.children.values():
            client.close()
            os.close(pidfd)
        for client in self.waiting:
            client.close()
        for spare in self.ahead.values():
            spare.sock.close()
            os.close(spare.pidfd)
        for ours in self.untaken.values():
            ours.close()
        for pidfd in self.strays.values():
            os.close(pidfd)
        self.selector.close()
        self.listener.close()

    def _become(self, argv: list[str], env: dict[str, str] | None, fds: list[int]) -> None:
        """Take the request's pipes, environment and argv, as a spawned validator has them."""
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        from polyserve.deploy import validate

        sys.argv = [validate.__file__, *argv]

    def stop(self) -> None:
        """At exit: each keeper ends its validation (SIGTERM) and cleans up after it; a
        keeper still there after _END_S is killed with its group, then what it left."""
        pidfds = {pid: fd for pid, (_, fd) in self.children.items()}
        pidfds |= {pid: spare.pidfd for pid, spare in self.ahead.items()}
        for pid in pidfds:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        waiting, deadline = set(pidfds.values()), time.monotonic() + _END_S
        while waiting and (left := deadline - time.monotonic()) > 0:
            waiting -= set(select.select(list(waiting), [], [], left)[0])
        for pid in pidfds:
            procs.kill_group(pid, denied_ok=True)
        for pid in sandbox.children(os.getpid()):
            if pid not in pidfds:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _in_child(run: Callable[..., None], *args: Any) -> NoReturn:
    """Run a forked child's code. Whatever happens, never return into the server's loop,
    and never run the exit handlers of what the server loaded: onnxruntime's hang in a
    forked child (see hooks.worker_exit)."""
    try:
        run(*args)  # a validation ends with os._exit
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
            sys.stderr.flush()
    os._exit(EXIT_CHILD_FAILED)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):  # nothing buffered may reach a child
        with contextlib.suppress(Exception):
            stream.flush()


def _send(client: socket.socket, message: dict[str, object]) -> None:
    with contextlib.suppress(OSError):  # a client that hung up gets nothing
        client.send(json.dumps(message).encode())


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
    sandbox.subreaper()  # what a killed keeper's validation leaves comes here: see _strays
    server = None
    try:
        _warm(preload)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Bound only once warm: until then a worker's connect fails and it spawns.
        listener.bind(_address(name))
        listener.listen(64)
        listener.setblocking(False)
        server = _Server(listener, master, tuple(preload), SPARES, namespaces)
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


# -- a worker's side ---------------------------------------------------------------------


class Forked:
    """A validation child forked by the server, shaped as asyncio's Process is for the
    spawned validator: pid (its process group too), stdout, stderr, wait()."""

    def __init__(
        self,
        pid: int,
        client: socket.socket,
        pipes: list[tuple[asyncio.BaseTransport, asyncio.StreamReader]],
    ) -> None:
        self.pid = pid
        self.client = client
        self.pipes = pipes
        self.stdout, self.stderr = pipes[0][1], pipes[1][1]
        self.returncode: int | None = None
        self.server_gone = False  # the server ended before reporting the exit status

    async def wait(self) -> int | None:
        """The child's exit status; None if the fork server died first (its children
        die with it: PR_SET_PDEATHSIG)."""
        if self.client.fileno() == -1:  # already reported (or closed)
            return self.returncode
        loop = asyncio.get_running_loop()
        try:
            reply = await loop.sock_recv(self.client, _MAX_MESSAGE)
            self.returncode = int(json.loads(reply)["returncode"])
        except (OSError, ValueError, KeyError, TypeError):
            self.server_gone = True
        self.client.close()
        return self.returncode

    def close(self) -> None:
        self.client.close()  # a server still running the child then kills its group
        for transport, _ in self.pipes:
            transport.close()


async def fork(name: str, argv: list[str], env: Mapping[str, str] | None) -> Forked | None:
    """Ask the fork server `name` for a validation child running `argv`; None when no
    server answers (not listening yet, or dead): the caller spawns one instead."""
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.setblocking(False)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pipes: list[tuple[asyncio.BaseTransport, asyncio.StreamReader]] = []
    try:
        try:
            await asyncio.wait_for(loop.sock_connect(client, _address(name)), _HANDSHAKE_S)
            if _peer_stopped(client):  # it would answer nothing: the master replaces it
                raise TimeoutError
            request = {"argv": argv, "env": None if env is None else dict(env)}
            socket.send_fds(client, [json.dumps(request).encode()], [out_w, err_w])
            reply = await asyncio.wait_for(loop.sock_recv(client, _MAX_MESSAGE), _HANDSHAKE_S)
            pid = int(json.loads(reply)["pid"])
        finally:
            os.close(out_w)  # the child holds the only write ends now
            os.close(err_w)
        # _reader owns each read end from its call on, failing or not.
        fd, out_r = out_r, -1
        pipes.append(await _reader(fd))
        fd, err_r = err_r, -1
        pipes.append(await _reader(fd))
    except BaseException as exc:
        # Cancelled (a deploy given up) included: nothing of this attempt may stay open.
        client.close()  # a server that forked after all kills that child on the hang-up
        for transport, _ in pipes:
            transport.close()
        for fd in (out_r, err_r):
            if fd != -1:
                os.close(fd)
        if isinstance(exc, (OSError, ValueError, KeyError, TypeError, TimeoutError)):
            return None
        raise
    return Forked(pid, client, pipes)


def _peer_stopped(client: socket.socket) -> bool:
    """Whether the process that listens on the socket `client` connected to is stopped."""
    cred = client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return sandbox.stopped(struct.unpack("3i", cred)[0])


async def _reader(fd: int) -> tuple[asyncio.BaseTransport, asyncio.StreamReader]:
    """A stream reading the pipe `fd`, which it owns: closed here if that fails."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
    except BaseException:
        pipe.close()
        raise
    return transport, reader


if __name__ == "__main__":
    main(sys.argv[1:])
