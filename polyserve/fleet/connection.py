"""The fleet's database connection: one per process, shared by its threads, each call bounded."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import psycopg
from psycopg.conninfo import conninfo_to_dict

from polyserve.errors import ClientError
from polyserve.fleet.schema import migrate

_T = TypeVar("_T")
CHANNEL = "polyserve_changes"
CONNECT_TIMEOUT_S = 5
TCP_USER_TIMEOUT_MS = 10_000  # unacknowledged data this long: the link is gone
TIMEOUT_S = 10.0  # POLYSERVE_FLEET_TIMEOUT_S's default, for callers without settings
WATCH_SLACK_S = 0.05  # how late past its deadline a call's connection may be broken


class Unreachable(ClientError):
    """The fleet's database did not answer: writes wait, serving goes on."""

    def __init__(self) -> None:
        super().__init__(
            503,
            "the fleet store (PostgreSQL at POLYSERVE_DATABASE_URL) is unreachable: this host"
            " keeps serving what it has; retry the write when the database is back",
        )


class Connection:
    """One process's connection to the fleet's database, shared by its threads (psycopg
    connections are thread-safe; a lock keeps each transaction to one thread).

    Every call is bounded by `timeout_s`, waiting for the lock included: the server
    enforces it on each statement and lock wait, and a server that stops answering
    without closing the connection (stopped, hung, its machine frozen) has its
    connection broken here when the call outlives it. Either way the call is
    Unreachable (503), never a thread held for good.
    """

    def __init__(self, url: str, timeout_s: float = TIMEOUT_S) -> None:
        self.url = url  # never logged: it may hold a password
        self.timeout_s = timeout_s
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()
        self._migrated = False  # once per process: whoever connects first creates the schema

    @contextlib.contextmanager
    def session(self) -> Iterator[psycopg.Connection]:
        """The connection, reconnected if it was lost; a failure to reach the database,
        or a call that outlives timeout_s, is Unreachable (503), and the broken
        connection is dropped for the next caller."""
        end = time.monotonic() + self.timeout_s
        if not self._lock.acquire(timeout=self.timeout_s):
            raise Unreachable()  # the call before this one is still waiting on the server
        try:
            with _Deadline(end) as deadline:
                try:
                    if self._conn is not None:
                        deadline.watch(self._conn)
                        if not _alive(self._conn):  # the server restarted, the link broke
                            deadline.watch(None)
                            self.close()
                    if self._conn is None:
                        self._conn = connect(self.url, self.timeout_s, end - time.monotonic())
                        deadline.watch(self._conn)
                    if not self._migrated:
                        migrate(self._conn)
                        self._migrated = True
                    yield self._conn
                except psycopg.OperationalError:
                    deadline.watch(None)
                    self.close()
                    raise Unreachable() from None
        finally:
            self._lock.release()

    def listen(self) -> psycopg.Connection:
        """A connection of its own that LISTENs for changes (the follower's), set up
        within timeout_s like any call."""
        with _Deadline(time.monotonic() + self.timeout_s) as deadline:
            try:
                conn = connect(self.url, self.timeout_s)
            except psycopg.OperationalError:
                raise Unreachable() from None
            deadline.watch(conn)
            try:
                conn.execute(f"LISTEN {CHANNEL}")
            except psycopg.OperationalError:
                deadline.watch(None)
                conn.close()
                raise Unreachable() from None
        return conn

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None


async def threaded(
    limiter: anyio.CapacityLimiter | None, timeout_s: float, func: Callable[..., _T], *args: Any
) -> _T:
    """A FleetDB call from an event loop, on `limiter` (the fleet's own, never the
    host's): a call that gets no thread within `timeout_s` (the database stalled and
    every thread waits on it) is Unreachable at once; one that got a thread ends within
    that time too (FleetDB's deadline). So a 503 comes in bounded time."""
    with anyio.move_on_after(timeout_s):
        return await anyio.to_thread.run_sync(func, *args, limiter=limiter)
    raise Unreachable()


def connect(
    url: str, timeout_s: float = TIMEOUT_S, within_s: float | None = None
) -> psycopg.Connection:
    """An autocommit connection (libpq reads PG* variables for what the URL leaves out).

    Keepalives and a TCP user timeout make a link that silently drops packets fail
    within seconds, not after the kernel's long run of retries (bench/NOTES.md, "Figures
    moved out of code comments"). The server
    ends any statement, lock wait or transaction left idle that outlives `timeout_s`,
    so no call waits on a lock another host's stalled transaction holds. A server that
    stops answering altogether is FleetDB's deadline's to break: nothing in TCP ends it.
    `within_s`: what is left of the caller's own time, for the connection itself.
    """
    within_s = timeout_s if within_s is None else within_s
    if within_s <= 0:
        raise psycopg.OperationalError("no time left to connect")
    ms = max(int(timeout_s * 1000), 1)
    limits = (
        f"-c statement_timeout={ms} -c lock_timeout={ms}"
        f" -c idle_in_transaction_session_timeout={ms}"
    )
    given = conninfo_to_dict(url).get("options")  # the URL's own come first
    return psycopg.connect(
        url,
        autocommit=True,
        connect_timeout=max(min(CONNECT_TIMEOUT_S, int(within_s)), 1),
        options=f"{given} {limits}" if given else limits,
        keepalives=1,
        keepalives_idle=5,
        keepalives_interval=2,
        keepalives_count=3,
        tcp_user_timeout=TCP_USER_TIMEOUT_MS,
    )


class _Deadline:
    """Breaks the socket of the connection it watches once `end` (monotonic) passes,
    unless the call it bounds ended first: a blocked read then fails at once, as if
    the server had closed the connection. The watchdog takes the deadline's lock before
    it touches the connection, and the caller stops watching before it closes one, so a
    file descriptor the kernel reused is never touched."""

    def __init__(self, end: float) -> None:
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()
        self.done = False
        _WATCHDOG.arm(end, self)

    def watch(self, conn: psycopg.Connection | None) -> None:
        with self._lock:
            self._conn = conn

    def expire(self) -> None:
        with self._lock:
            if self._conn is None or self.done:
                return
            try:
                fd = os.dup(self._conn.fileno())
            except (OSError, psycopg.Error):  # closed meanwhile: nothing left to break
                return
            # shutdown() on a duplicate reaches the one socket both descriptors name.
            with socket.socket(fileno=fd) as sock, contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> _Deadline:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.done, self._conn = True, None


class _Watchdog:
    """One thread per process that expires the deadlines of every call in turn.

    A thread per call (a threading.Timer) cost each call more than its statement did;
    the calls of one process share this one, which sleeps until the earliest deadline.
    A call that ended is dropped when its deadline comes up (`done`), not searched for.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Deadline]] = []
        self._ready = threading.Condition()
        self._count = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, end: float, deadline: _Deadline) -> None:
        with self._ready:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="polyserve-fleet-deadlines", daemon=True
                )
                self._thread.start()
            earliest = self._heap[0][0] if self._heap else None
            heapq.heappush(self._heap, (end, next(self._count), deadline))
            if earliest is None or end < earliest:
                self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    # A little late on purpose: one wake-up takes every deadline that
                    # came up meanwhile, not one wake-up per call of a busy process.
                    wait = (
                        self._heap[0][0] - time.monotonic() + WATCH_SLACK_S if self._heap else None
                    )
                    self._ready.wait(wait)
                now, due = time.monotonic(), []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
            for deadline in due:
                if not deadline.done:
                    deadline.expire()


_WATCHDOG = _Watchdog()


def _forked() -> None:
    """A forked child (a gunicorn worker) has no watchdog thread and may have copied its
    lock held: it starts afresh, with none of its parent's calls."""
    global _WATCHDOG
    _WATCHDOG = _Watchdog()


os.register_at_fork(after_in_child=_forked)


def _alive(conn: psycopg.Connection) -> bool:
    """Whether a connection kept from an earlier call still works. A connection the
    server closed (a restart) looks open until it is used, but its socket is readable:
    between calls the server sends nothing unasked but its goodbye. Only then does a
    round trip tell; a readable socket is rare, a round trip on every call is not."""
    if conn.closed:
        return False
    try:
        poll = select.poll()  # not select(): a busy host's descriptors pass 1024
        poll.register(conn.fileno(), select.POLLIN)
        if not poll.poll(0):
            return True
    except (OSError, psycopg.Error):
        return False
    try:
        conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return False
    return True
