"""The fork server's loop: take a worker's request, fork its child, report the child's exit.

One thread, one selector: accept, fork on a request (or hand it to a spare,
polyserve.deploy.forkspares), report each child's exit (a pidfd per child). It never
blocks on a client, so a client that connects and says nothing delays no one. The server
itself never runs tenant code: it only forks, reaps and reports exit statuses, and kills
what a validation left behind when its keeper was killed first (it is the subreaper of
its children's orphans). A worker that hangs up first (its deploy timed out or was
cancelled) gets its validation ended: SIGTERM to the keeper, its group killed if it has
not exited within _END_S.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable

from polyserve import procs
from polyserve.deploy import child, forkspares
from polyserve.deploy.forkclient import MAX_MESSAGE, peer

_END_S = 5.0  # how long an ended validation's keeper has to clean up before it is killed
_PARENT_CHECK_S = 1.0  # how long an orphaned server may outlive its master

log = logging.getLogger("polyserve.deploy.forkserver")


class Server:
    """The loop, its clients and its children: those forked for a request (`children`),
    the spares (`spares`), and the strays it kills (`strays`)."""

    def __init__(
        self,
        listener: socket.socket,
        master: int,
        preload: tuple[str, ...] = (),
        spares: int = 0,  # how many to keep forked ahead (the server's main() keeps SPARES)
        namespaces: bool = False,
    ) -> None:
        self.listener = listener
        self.master = master
        self.namespaces = namespaces  # each validation in namespaces of its own, if it may
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (client, pidfd)
        self.waiting: set[socket.socket] = set()  # clients that have not asked yet
        # Children to kill with their group at a time (monotonic s): a spare that has not
        # taken its request, a keeper that was told to end its validation.
        self.kill_due: dict[int, float] = {}
        self.spares = forkspares.Spares(self.selector, self.kill_due, spares, preload, namespaces)
        self.strays = _Strays(self.selector)

    def run(self) -> None:
        """Serve until the master is gone. PR_SET_PDEATHSIG's SIGTERM alone is not enough:
        one that lands while the warm-up imports C extensions can be swallowed with the
        import's error (an orphaned server then served forever), so the loop also looks
        at its parent between selects."""
        self.spares.fill(self._fork)
        while os.getppid() == self.master:
            timeout = _PARENT_CHECK_S
            for due in (self.spares.due, *self.kill_due.values()):
                if due is not None:
                    timeout = min(timeout, max(due - time.monotonic(), 0))
            self.step(timeout)
            self.kill_overdue()
            self.spares.kill_stopped()
            if self.spares.due_now() and not self.children:
                self.spares.fill(self._fork)

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
                self.strays.reap(key.data[1])
                self._kill_strays()  # what it left in turn
            elif key.data[0] == "spare":
                self.spares.says(key.fileobj, key.data[1])  # type: ignore[arg-type]
            else:  # a client whose child runs: it hung up, or sent out of turn
                self._hung_up(key.fileobj, key.data[1])  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except BlockingIOError:
            return
        if peer(client)[1] != os.getuid():  # see polyserve.deploy.forkclient
            client.close()
            return
        client.setblocking(False)
        self.waiting.add(client)
        self.selector.register(client, selectors.EVENT_READ, "request")

    def _request(self, client: socket.socket) -> None:
        self.selector.unregister(client)
        self.waiting.discard(client)
        if (request := _read(client)) is None:
            return
        argv, env, fds = request
        handed = self.spares.hand(argv, env, fds)
        if handed is not None:
            pid, pidfd = handed
        else:
            run = functools.partial(child.forked, self.namespaces, argv, env, fds)
            forked = self._fork("a validation", client, run)
            if forked is None:  # this worker spawns instead
                _close(client, fds)
                return
            pid, pidfd = forked, os.pidfd_open(forked)
            self.selector.register(pidfd, selectors.EVENT_READ, pid)
        for fd in fds:
            os.close(fd)  # the child's pipes must end when the child's copies do
        self.children[pid] = (client, pidfd)
        self.selector.register(client, selectors.EVENT_READ, ("running", pid))
        _send(client, {"pid": pid})

    def _fork(self, what: str, ours: socket.socket, run: Callable[[], None]) -> int | None:
        """Fork a child that leaves the server behind (its session, its descriptors and
        `ours`) and runs `run()`: its pid, or None when no process can be forked."""
        for stream in (sys.stdout, sys.stderr):  # nothing buffered may reach a child
            with contextlib.suppress(Exception):
                stream.flush()
        server = os.getpid()  # read before the fork: the child's getppid() may
        # already name the reaper if this process dies in between
        try:
            pid = os.fork()
        except OSError as exc:  # no memory or process left
            log.warning("fork server: cannot fork %s: %s", what, exc)
            return None
        if pid == 0:
            child.in_child(self._leave, server, ours, run)
        return pid

    def _leave(self, server: int, ours: socket.socket, run: Callable[[], None]) -> None:
        """In a child just forked: detach, close what is the server's, and run."""
        child.detach(server)
        ours.close()
        # None of the server's sockets may reach tenant code.
        for client, pidfd in self.children.values():
            client.close()
            os.close(pidfd)
        for client in self.waiting:
            client.close()
        self.spares.close()
        self.strays.close()
        self.selector.close()
        self.listener.close()
        run()

    def _hung_up(self, client: socket.socket, pid: int) -> None:
        with contextlib.suppress(OSError):
            if client.recv(MAX_MESSAGE):
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
        if os.WIFSIGNALED(status) or os.waitstatus_to_exitcode(status) == child.EXIT_CHILD_FAILED:
            self._kill_strays()
        if self.spares.died_waiting(pid):
            return
        took = self.spares.took(pid)
        client, pidfd = self.children.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(KeyError):
            self.selector.unregister(client)
        if took:
            _send(client, {"returncode": os.waitstatus_to_exitcode(status)})
        client.close()
        if not self.children:
            self.spares.idle()

    def _kill_strays(self) -> None:
        self.strays.kill(lambda pid: pid in self.children or pid in self.spares.ahead)

    def stop(self) -> None:
        """At exit: each keeper ends its validation (SIGTERM) and cleans up after it; a
        keeper still there after _END_S is killed with its group, then what it left."""
        pidfds = {pid: fd for pid, (_, fd) in self.children.items()}
        pidfds |= {pid: spare.pidfd for pid, spare in self.spares.ahead.items()}
        for pid in pidfds:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        waiting, deadline = set(pidfds.values()), time.monotonic() + _END_S
        while waiting and (left := deadline - time.monotonic()) > 0:
            waiting -= set(select.select(list(waiting), [], [], left)[0])
        for pid in pidfds:
            procs.kill_group(pid, denied_ok=True)
        for pid in procs.children(os.getpid()):
            if pid not in pidfds:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


class _Strays:
    """The children the server did not fork: what a validation left when its keeper was
    killed first (the server is their subreaper). Each is killed, then reaped when its
    pidfd says it has exited."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self.selector = selector
        self.pidfds: dict[int, int] = {}

    def kill(self, forked: Callable[[int], bool]) -> None:
        """Kill every child of this process that is not `forked` by it, nor killed yet."""
        for pid in procs.children(os.getpid()):
            if forked(pid) or pid in self.pidfds:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:  # reaped already
                continue
            self.pidfds[pid] = pidfd
            self.selector.register(pidfd, selectors.EVENT_READ, ("stray", pid))

    def reap(self, pid: int) -> None:
        pidfd = self.pidfds.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    def close(self) -> None:
        """In a child: none of these descriptors may reach tenant code."""
        for pidfd in self.pidfds.values():
            os.close(pidfd)


def _read(client: socket.socket) -> tuple[list[str], dict[str, str] | None, list[int]] | None:
    """A worker's request on `client`: the child's argv and environment, and its stdout
    and stderr (and its stdin, holding the space's secrets). None for the master's ping,
    answered here, and for anything else, which is dropped: `client` and the fds it sent
    are closed."""
    fds: list[int] = []
    try:
        message, fds, _, _ = socket.recv_fds(client, MAX_MESSAGE, 3)
        request = json.loads(message)
        if request.get("ping") is True and not fds:  # the master: is it answering?
            _send(client, {"pong": True})
            client.close()
            return None
        argv, env = [str(a) for a in request["argv"]], request.get("env")
        if len(fds) not in (2, 3):
            raise ValueError("expected the child's stdout and stderr (and its stdin)")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        _close(client, fds)
        return None
    return argv, env, fds


def _close(client: socket.socket, fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    client.close()


def _send(client: socket.socket, message: dict[str, object]) -> None:
    with contextlib.suppress(OSError):  # a client that hung up gets nothing
        client.send(json.dumps(message).encode())
