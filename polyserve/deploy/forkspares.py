"""Spares: validation children the fork server forks and warms ahead of their requests.

The server (polyserve.deploy.forkloop) keeps a few spares forked ahead: at its start, and
_DELAY_S after the last validation ended. Each detaches, warms up as a worker does at boot
(polyserve.serve.warmup.in_worker) on the event loop and worker thread a validation uses,
says "ready" on a socket of its own, and waits there for the request the server passes on,
which it acknowledges ("took"); its keeper says "child PID" once it has forked the
validation. A deploy then waits neither for the fork nor for the warm-up (the first
writes to the server's pages, which a fork copies: bench/NOTES.md, "Copy-on-write at a
fork's first use"). There are two, so that a deploy right after another (a script
deploying a few spaces) finds one too.

A request that finds no ready spare (warming, in use, killed, or stopped) gets a child
forked for it. A spare found stopped is killed and forked again; one that has not taken
its request after _TAKE_S is killed, and its worker validates in a new interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from polyserve import procs
from polyserve.deploy import child, sandbox
from polyserve.deploy.forkclient import MAX_MESSAGE
from polyserve.serve import warmup

# A warm spare reads its request at once: one that has not in this long is stopped, or
# so starved that a new interpreter will validate sooner.
_TAKE_S = 1.0
# How long after the last validation ends the next spare is forked: a deploy's publish
# and its first loads in the workers come right after, and the spare's fork and warm-up
# beside them made those slower (two cores here).
_DELAY_S = 0.5
# The server's fork: (what, its end of the child's socket, what the child runs) -> the
# child's pid, or None when none could be forked.
Fork = Callable[[str, socket.socket, Callable[[], None]], int | None]


@dataclass
class Spare:
    """A child forked ahead of its request, as the server sees it."""

    sock: socket.socket  # the server's end of the spare's own socket
    pidfd: int
    warm: bool = False  # it said "ready": only then is it handed a request
    child: int = 0  # the validation its keeper forked, once the keeper said so

    def stopped(self, pid: int) -> bool:
        """Whether the spare's keeper `pid` or its validation is stopped: it would take
        no request, or never report its exit."""
        return sandbox.stopped(pid) or (self.child != 0 and sandbox.stopped(self.child))


class Spares:
    """The server's spares: forked and waiting (`ahead`), or handed a request they have
    not yet said they took (`untaken`). The server forks and reaps them; this hands them
    requests, kills those that will not take one, and says when to fork more."""

    def __init__(
        self,
        selector: selectors.BaseSelector,
        kill_due: dict[int, float],
        count: int,
        preload: tuple[str, ...] = (),
        namespaces: bool = False,
    ) -> None:
        self.selector = selector
        self.kill_due = kill_due  # the server's: when to kill which child, with its group
        self.count = count  # how many to keep forked ahead
        self.preload = preload  # what each warms up (warmup.in_worker)
        self.namespaces = namespaces  # each validation in namespaces of its own, if it may
        self.ahead: dict[int, Spare] = {}
        self.untaken: dict[int, socket.socket] = {}
        self.due: float | None = None  # when to fork the next ones (monotonic s)

    def wanted(self) -> bool:
        """Whether fewer than `count` spares wait."""
        return len(self.ahead) < self.count

    def fill(self, fork: Fork) -> None:
        """Fork spares up to `count` with the server's `fork`: at the start, and a little
        after the last validation has ended."""
        while self.wanted():
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = fork(
                "a spare validation child",
                ours,
                functools.partial(run, theirs, self.preload, self.namespaces),
            )
            theirs.close()
            if pid is None:
                ours.close()
                return
            self._add(pid, ours, os.pidfd_open(pid))

    def _add(self, pid: int, ours: socket.socket, pidfd: int) -> None:
        """Watch a spare just forked: its exit, and what it says on `ours`."""
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        ours.setblocking(False)
        self.selector.register(ours, selectors.EVENT_READ, ("spare", pid))
        self.ahead[pid] = Spare(ours, pidfd)

    def says(self, ours: socket.socket, pid: int) -> None:
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

    def hand(
        self, argv: list[str], env: dict[str, str] | None, fds: list[int]
    ) -> tuple[int, int] | None:
        """Pass a request on to a warm spare, if there is one: its (pid, pidfd), or None.
        Until it says it took the request, it is watched: dying before that is the
        server's failure, not the tenant's (see took())."""
        self.kill_stopped()
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

    def kill_stopped(self) -> None:
        """A spare that is stopped (a validation that can see it, without namespaces, may
        have stopped it) takes no request: kill it; it is forked again once no validation
        runs."""
        for pid, spare in self.ahead.items():
            if spare.stopped(pid):
                spare.warm = False  # never handed a request: reaped when its pidfd says
                procs.kill_group(pid, denied_ok=True)

    def died_waiting(self, pid: int) -> bool:
        """Whether the child `pid` the server reaped was a spare that had no request yet
        (it was killed); if so, forget it. It is forked again once no validation runs."""
        spare = self.ahead.pop(pid, None)
        if spare is None:
            return False
        self._drop(spare.sock)
        self.selector.unregister(spare.pidfd)
        os.close(spare.pidfd)
        return True

    def took(self, pid: int) -> bool:
        """Whether the child `pid` the server reaped ran its request: one forked for the
        request did; a former spare did only if it said "took" (which may come in the
        same select as its exit, after it). Else, as when the server dies, its worker
        gets no exit status, and validates in a new interpreter instead of blaming the
        tenant's code."""
        untaken = self.untaken.pop(pid, None)
        if untaken is None:
            return True
        took = False
        with contextlib.suppress(OSError):
            took = untaken.recv(16) == b"took"
        self._drop(untaken)
        return took

    def idle(self) -> None:
        """No validation runs: fork the missing spares a little later (_DELAY_S). Only
        then, because a spare's fork and warm-up beside a validation took it longer than
        the spare saved."""
        if self.wanted():
            self.due = time.monotonic() + _DELAY_S

    def due_now(self) -> bool:
        """Whether the time to fork more spares has come (said once, then cleared)."""
        if self.due is None or time.monotonic() < self.due:
            return False
        self.due = None
        return True

    def close(self) -> None:
        """In a child: none of the spares' descriptors may reach tenant code."""
        for spare in self.ahead.values():
            spare.sock.close()
            os.close(spare.pidfd)
        for ours in self.untaken.values():
            ours.close()

    def _drop(self, ours: socket.socket) -> None:
        with contextlib.suppress(KeyError):  # unregistered already if it said nothing
            self.selector.unregister(ours)
        ours.close()


def run(theirs: socket.socket, preload: tuple[str, ...], namespaces: bool) -> None:
    """In a spare, detached from the server: split into a keeper and the validation, which
    runs the request the server passes on (its argv and environment, and the fds the
    worker sent) on the event loop it warmed up on."""
    sandbox.contain(namespaces, lambda pid: theirs.send(b"child %d" % pid))
    child.runner().run(_wait(theirs, preload))


async def _wait(theirs: socket.socket, preload: tuple[str, ...]) -> None:
    import anyio.to_thread

    # On the worker thread that will import the version: its paths are warmed too, and
    # the loop and the thread a validation would start first are there already.
    await anyio.to_thread.run_sync(warmup.in_worker, preload)
    theirs.send(b"ready")
    # Blocking the loop: nothing else runs on it yet.
    message, fds, _, _ = socket.recv_fds(theirs, MAX_MESSAGE, 3)
    theirs.send(b"took")
    theirs.close()
    request = json.loads(message)
    child.become(request["argv"], request.get("env"), fds)
    await child.run(request["argv"])
