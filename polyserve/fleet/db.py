"""The fleet's database: commit a change, read the changes, fetch a version, hosts and usage."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

import anyio
import anyio.to_thread
import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import Jsonb

from polyserve.errors import ClientError
from polyserve.fleet.schema import CHANGE_LOCK, migrate
from polyserve.names import DEFAULT_POOL
from polyserve.state.history import describe, rollback_target
from polyserve.usage.meter import BILLED_NAMES

_T = TypeVar("_T")
CHANNEL = "polyserve_changes"
CONNECT_TIMEOUT_S = 5
TCP_USER_TIMEOUT_MS = 10_000  # unacknowledged data this long: the link is gone
TIMEOUT_S = 10.0  # POLYSERVE_FLEET_TIMEOUT_S's default, for callers without settings
CHUNK = 1 << 20  # an upload moves to and from the database in slices this long
# A host that heartbeats, has neither left nor is draining: the one `live` of the fleet.
LIVE = "left_at IS NULL AND draining_at IS NULL AND last_seen > now() - make_interval(secs => %s)"


class Unreachable(ClientError):
    """The fleet's database did not answer: writes wait, serving goes on."""

    def __init__(self) -> None:
        super().__init__(
            503,
            "the fleet store (PostgreSQL at POLYSERVE_DATABASE_URL) is unreachable: this host"
            " keeps serving what it has; retry the write when the database is back",
        )


@dataclass(frozen=True)
class Change:
    id: int
    space: str
    kind: str  # deploy, delete, release
    version: int | None
    token: str | None = None  # random at its commit: tells this change from a reused id


@dataclass(frozen=True)
class Stored:
    """A version as the fleet keeps it."""

    number: int
    sha256: str
    meta: dict[str, Any]
    size: int | None  # the upload's bytes (download()); None: another pool's, not read


@dataclass(frozen=True)
class Fit:
    """What a deploy must fit before it is committed: every live host's limits (and the
    receiving host's, live or not), as that host would check the upload itself."""

    host: str  # the receiving host
    live_s: float  # POLYSERVE_FLEET_LIVE_S
    unpacked: int  # what the upload unpacks to, as the unpacked cap counts it


USAGE_COLUMNS = BILLED_NAMES  # the ledger's columns are the meter's billing totals
Totals = dict[str, tuple[int, ...]]  # per space, in USAGE_COLUMNS order


@dataclass(frozen=True)
class Boot:
    """One run of a host's master, as its follower joins the fleet with it."""

    id: str
    lineage: str  # the data directory's id: its boots continue one another's ledger
    start: Totals  # the host's local totals when this boot began
    # Whether `start` is all that earlier runs will ever add (restored from a checkpoint),
    # rather than a killed master's segment whose workers may still count into it.
    settled: bool


class FleetDB:
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

    # -- changes -------------------------------------------------------------------

    @contextlib.contextmanager
    def _changing(self) -> Iterator[psycopg.Connection]:
        """A transaction that may append to the change log: it holds CHANGE_LOCK, so
        change ids commit in the order they are assigned and no follower skips one."""
        with self.session() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (CHANGE_LOCK,))
            yield conn

    def deploy(
        self, space: str, upload: BinaryIO, sha256: str, meta: dict[str, Any], fit: Fit
    ) -> Change:
        """Store a version under the space's next number, make it current, log the change.
        The upload is streamed from its file, never read whole. Refused (ClientError 507
        or 413, nothing committed) when a live host could not apply it."""
        size = upload.seek(0, 2)
        with self._changing() as conn:
            _refuse_unfit(conn, space, size, fit)
            conn.execute(
                "INSERT INTO polyserve_spaces (name) VALUES (%s) ON CONFLICT DO NOTHING", (space,)
            )
            # What this version replaces: a rollback without a number goes back to it.
            before = conn.execute(
                "SELECT current_version FROM polyserve_spaces WHERE name = %s", (space,)
            ).fetchone()
            row = conn.execute(
                "UPDATE polyserve_spaces SET last_version = last_version + 1,"
                " current_version = last_version + 1 WHERE name = %s RETURNING last_version",
                (space,),
            ).fetchone()
            assert row is not None
            number = row[0]
            meta = {**meta, "version": number, "replaced": before[0] if before else None}
            _copy_version(conn, (space, number, sha256, meta), upload, size)
            return _log(conn, space, "deploy", number)

    def rollback(self, space: str, asked: int | None) -> tuple[Change, int, dict[str, Any]]:
        """Make a stored version current again, logged as a deploy of that (older)
        number: every follower applies it as it applies a deploy, fetching the bytes
        it no longer has. Returns (the change, the version it replaced, its metadata);
        ClientError 404 when the space is not deployed or the fleet stores no such
        version (the error lists the stored ones)."""
        with self._changing() as conn:
            row = conn.execute(
                "SELECT s.current_version, v.meta FROM polyserve_spaces s"
                " JOIN polyserve_versions v ON v.space = s.name AND v.number = s.current_version"
                " WHERE s.name = %s",
                (space,),
            ).fetchone()
            if row is None:
                raise ClientError(
                    404, f"space {space} is not deployed: deploy it, then roll back", space=space
                )
            current, current_meta = row
            stored = conn.execute(
                "SELECT number, meta FROM polyserve_versions WHERE space = %s ORDER BY number",
                (space,),
            ).fetchall()
            metas = dict(stored)
            number = rollback_target(space, current, current_meta, list(metas), asked)
            conn.execute(
                "UPDATE polyserve_spaces SET current_version = %s WHERE name = %s",
                (number, space),
            )
            return _log(conn, space, "deploy", number), current, metas[number]

    def versions(
        self, space: str, limit: int
    ) -> tuple[int | None, list[dict[str, Any]], list[dict[str, Any]]]:
        """(The current version, every stored version's metadata, the last `limit`
        events of the space's history) as the fleet has them, in one snapshot. The
        history is the change log: a deploy of a number deployed before is a rollback."""
        with self.session() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            row = conn.execute(
                "SELECT current_version FROM polyserve_spaces WHERE name = %s", (space,)
            ).fetchone()
            current = row[0] if row else None
            stored = conn.execute(
                "SELECT number, meta FROM polyserve_versions WHERE space = %s ORDER BY number",
                (space,),
            ).fetchall()
            changes = conn.execute(
                "SELECT kind, version, extract(epoch FROM at)::float8 FROM polyserve_changes"
                " WHERE space = %s ORDER BY id",
                (space,),
            ).fetchall()
        versions = [describe(meta, number, current) for number, meta in stored]
        history: list[dict[str, Any]] = []
        deployed: set[int] = set()
        now: int | None = None  # the version current after each change, replayed
        for kind, number, at in changes:
            event = kind
            if kind == "deploy":
                event = "rollback" if number in deployed else "deploy"
                deployed.add(number)
            history.append({"event": event, "version": number, "previous": now, "at": at})
            now = None if kind == "delete" else number
        return current, versions, history[-limit:]

    def delete(self, space: str) -> Change | None:
        """Undeploy everywhere; None when the space is not deployed."""
        with self._changing() as conn:
            row = conn.execute(
                "UPDATE polyserve_spaces SET current_version = NULL"
                " WHERE name = %s AND current_version IS NOT NULL RETURNING name",
                (space,),
            ).fetchone()
            return None if row is None else _log(conn, space, "delete", None)

    def release(self, space: str) -> Change | None:
        """Release everywhere (each host's workers import it afresh); None when the
        space is not deployed."""
        with self._changing() as conn:
            row = conn.execute(
                "SELECT current_version FROM polyserve_spaces"
                " WHERE name = %s AND current_version IS NOT NULL",
                (space,),
            ).fetchone()
            return None if row is None else _log(conn, space, "release", row[0])

    def changes_since(self, after: int, limit: int) -> list[Change]:
        with self.session() as conn:
            rows = conn.execute(
                "SELECT id, space, kind, version, token::text FROM polyserve_changes"
                " WHERE id > %s ORDER BY id LIMIT %s",
                (after, limit),
            ).fetchall()
        return [Change(*row) for row in rows]

    def token(self, change_id: int) -> str | None:
        """The token of the change with this id; None when the fleet has none (its
        database went back to before it)."""
        with self.session() as conn:
            row = conn.execute(
                "SELECT token::text FROM polyserve_changes WHERE id = %s", (change_id,)
            ).fetchone()
        return row[0] if row else None

    def pointers(self) -> tuple[Change, dict[str, tuple[int, dict[str, Any]] | None]]:
        """What a joining host needs: the last change (id 0 for none), and each space's
        current version with its metadata (None: deleted), read in one snapshot; no
        upload bytes."""
        with self.session() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            last = conn.execute(
                "SELECT id, space, kind, version, token::text FROM polyserve_changes"
                " ORDER BY id DESC LIMIT 1"
            ).fetchone()
            rows = conn.execute(
                "SELECT s.name, s.current_version, v.meta FROM polyserve_spaces s"
                " LEFT JOIN polyserve_versions v"
                " ON v.space = s.name AND v.number = s.current_version"
            ).fetchall()
        pointers = {name: None if n is None else (n, meta) for name, n, meta in rows}
        return (Change(*last) if last else Change(0, "", "none", None)), pointers

    def last_change(self) -> int:
        with self.session() as conn:
            row = conn.execute("SELECT coalesce(max(id), 0) FROM polyserve_changes").fetchone()
        return row[0] if row else 0

    def fetch(self, space: str, number: int, pool: str | None = None) -> Stored | None:
        """A version and the size of its bytes; with `pool`, the size only if the version
        runs in that pool (a host does not download what it will never import)."""
        with self.session() as conn:
            row = conn.execute(
                "SELECT number, sha256, meta, CASE WHEN %s::text IS NULL"
                " OR coalesce(meta->>'pool', %s) = %s THEN length(data) END"
                " FROM polyserve_versions WHERE space = %s AND number = %s",
                (pool, DEFAULT_POOL, pool, space, number),
            ).fetchone()
        return None if row is None else Stored(*row)

    def download(self, space: str, stored: Stored, out: BinaryIO) -> str:
        """Write a version's bytes to `out`, CHUNK at a time (the process never holds the
        whole upload, nor the server's hex of it), and return their sha256."""
        digest = hashlib.sha256()
        with self.session() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            for start in range(0, stored.size or 0, CHUNK):
                row = conn.execute(
                    "SELECT substring(data FROM %s FOR %s) FROM polyserve_versions"
                    " WHERE space = %s AND number = %s",
                    (start + 1, CHUNK, space, stored.number),
                    binary=True,
                ).fetchone()
                if row is None:
                    break  # gone since fetch(): the sha256 check refuses what was read
                digest.update(row[0])
                out.write(row[0])
        return digest.hexdigest()

    # -- hosts -----------------------------------------------------------------------

    def join(
        self, host: str, url: str, pool: str, boot: str | Boot, takeover: bool = True
    ) -> Totals | None:
        """Register this boot of the host; returns the totals its ledger rows leave out
        (its baseline), or None when another boot has replaced it (a restart).

        The boot is not live until its first heartbeat, which follows its catch-up: a
        load balancer (or a deploy) that reads the fleet never sends it a space it has
        not applied. A boot that is already the host's (a follower that reconnects, or
        one its master started again) keeps everything: its baseline, its heartbeat and
        a drain mark. `takeover` False (a reconnect) refuses to replace another boot.

        A new boot of the same data directory (lineage) takes over where the boot it
        replaces stopped billing: its baseline is that boot's baseline plus what that
        boot's rows hold, so whatever the host counted that no row has yet (the last
        interval before a kill -9, the late answers of a killed master's workers) is
        billed by this boot, and only by it. Read under the host row's lock, which a
        usage write holds too: the boot replaced writes nothing after that.
        """
        if isinstance(boot, str):  # a boot without local totals (tests, tools)
            boot = Boot(boot, "", {}, True)
        with self.session() as conn, conn.transaction():
            row = conn.execute(
                "SELECT boot, lineage, baseline FROM polyserve_hosts WHERE id = %s FOR UPDATE",
                (host,),
            ).fetchone()
            if row is not None and row[0] == boot.id:
                conn.execute(
                    "UPDATE polyserve_hosts SET url = %s, pool = %s WHERE id = %s",
                    (url, pool, host),
                )
                return boot.start if row[2] is None else _totals(row[2])
            if row is not None and not takeover:
                return None
            baseline = boot.start
            if row is not None and boot.lineage and row[1] == boot.lineage and row[2] is not None:
                billed = conn.execute(
                    f"SELECT space, {', '.join(USAGE_COLUMNS)} FROM polyserve_usage"
                    " WHERE host = %s AND boot = %s",
                    (host, row[0]),
                ).fetchall()
                baseline = _continued(_totals(row[2]), billed, boot)
            conn.execute(
                "INSERT INTO polyserve_hosts (id, url, pool, boot, started_at, last_seen,"
                " lineage, baseline) VALUES (%s, %s, %s, %s, now(), to_timestamp(0), %s, %s)"
                " ON CONFLICT (id) DO UPDATE SET url = excluded.url, pool = excluded.pool,"
                " boot = excluded.boot, started_at = now(), last_seen = to_timestamp(0),"
                " left_at = NULL, draining_at = NULL, lineage = excluded.lineage,"
                " baseline = excluded.baseline",
                (host, url, pool, boot.id, boot.lineage, Jsonb(baseline)),
            )
            return baseline

    def heartbeat(
        self, host: str, boot: str, workers: int, applied: int, token: str | None = None
    ) -> bool:
        """Alive, and the last change applied; False when this boot is no longer the
        host's (another boot replaced it). The acknowledgement counts only if the
        fleet's change of that id is the one applied (its token): a database that went
        back in time keeps what it knew, and no deploy takes this host's word for a
        change id it reused."""
        with self.session() as conn:
            cur = conn.execute(
                "UPDATE polyserve_hosts SET last_seen = now(), workers = %s,"
                " applied = CASE WHEN %s::uuid IS NULL OR EXISTS (SELECT FROM"
                " polyserve_changes WHERE id = %s AND token = %s::uuid) THEN %s ELSE applied END"
                " WHERE id = %s AND boot = %s",
                (workers, token, applied, token, applied, host, boot),
            )
            return cur.rowcount == 1

    def limits(self, host: str, boot: str, spaces: int, upload_mb: int, unpacked_mb: int) -> None:
        """This boot's POLYSERVE_MAX_SPACES, _MAX_UPLOAD_MB and _MAX_UNPACKED_MB, which a
        deploy must fit while this host is live."""
        with self.session() as conn:
            conn.execute(
                "UPDATE polyserve_hosts SET max_spaces = %s, max_upload_mb = %s,"
                " max_unpacked_mb = %s WHERE id = %s AND boot = %s",
                (spaces, upload_mb, unpacked_mb, host, boot),
            )

    # -- changes a host skipped --------------------------------------------------------

    def skip(self, host: str, change: Change, error: str) -> None:
        """Record that this host could not apply a change (it goes on with the next)."""
        with self.session() as conn:
            conn.execute(
                "INSERT INTO polyserve_skipped (host, space, change_id, version, error)"
                " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (host, space) DO UPDATE SET"
                " change_id = excluded.change_id, version = excluded.version,"
                " error = excluded.error, at = now()",
                (host, change.space, change.id, change.version, error),
            )

    def unskip(self, host: str, space: str) -> None:
        """A later change of the space applied: what this host skipped of it is past."""
        with self.session() as conn:
            conn.execute(
                "DELETE FROM polyserve_skipped WHERE host = %s AND space = %s", (host, space)
            )

    def skipped(self, change: Change | None = None) -> dict[str, list[dict[str, Any]]]:
        """Per host, what it skipped and why; given a change, only the skips of its space
        from that change on (such a host serves neither it nor a later version)."""
        space, since = (change.space, change.id) if change else (None, 0)
        with self.session() as conn:
            rows = conn.execute(
                "SELECT host, space, change_id, version, error, extract(epoch FROM at)::float8"
                " FROM polyserve_skipped WHERE (%s::text IS NULL OR space = %s)"
                " AND change_id >= %s ORDER BY host, change_id",
                (space, space, since),
            ).fetchall()
        found: dict[str, list[dict[str, Any]]] = {}
        keys = ("space", "change", "version", "error", "at")
        for host, *values in rows:
            found.setdefault(host, []).append(dict(zip(keys, values, strict=True)))
        return found

    def leave(self, host: str, boot: str) -> None:
        """A stop: no deploy waits for this boot of the host any more (a boot that
        already replaced it, after a restart, stays)."""
        with self.session() as conn:
            conn.execute(
                "UPDATE polyserve_hosts SET left_at = now() WHERE id = %s AND boot = %s",
                (host, boot),
            )

    def drain(self, host: str) -> None:
        """Take a host out of the fleet before it stops (the autoscaler): no deploy waits
        for it and it is no longer listed as live, though it keeps serving and applying
        changes until it stops. Only its next boot (a join after a restart) clears
        this: a follower that reconnects keeps it."""
        with self.session() as conn:
            conn.execute(
                "UPDATE polyserve_hosts SET draining_at = coalesce(draining_at, now())"
                " WHERE id = %s",
                (host,),
            )

    def hosts(self, live_s: float) -> list[dict[str, Any]]:
        """Every host the fleet has seen, newest first, each with `live` (heartbeating,
        neither left nor draining), `draining` and `left`."""
        with self.session() as conn:
            rows = conn.execute(
                "SELECT id, url, pool, boot, workers, applied,"
                f" extract(epoch FROM last_seen)::float8, {LIVE},"
                " draining_at IS NOT NULL, left_at IS NOT NULL"
                " FROM polyserve_hosts ORDER BY started_at DESC",
                (live_s,),
            ).fetchall()
        keys = (
            "id", "url", "pool", "boot", "workers", "applied", "last_seen", "live",
            "draining", "left",
        )  # fmt: skip
        return [dict(zip(keys, row, strict=True)) for row in rows]

    # -- demand ----------------------------------------------------------------------

    def record_demand(self, pool: str, space: str) -> None:
        """A request for a space of `pool` that no live host of that pool could take."""
        with self.session() as conn:
            conn.execute(
                "INSERT INTO polyserve_demand (pool, space, requests, last_at)"
                " VALUES (%s, %s, 1, now()) ON CONFLICT (pool, space) DO UPDATE SET"
                " requests = polyserve_demand.requests + 1, last_at = now()",
                (pool, space),
            )

    def demand(self, within_s: float) -> dict[str, list[str]]:
        """Per pool, the spaces whose requests found no host of it in the last
        `within_s` seconds."""
        with self.session() as conn:
            rows = conn.execute(
                "SELECT pool, space FROM polyserve_demand"
                " WHERE last_at > now() - make_interval(secs => %s) ORDER BY pool, space",
                (within_s,),
            ).fetchall()
        found: dict[str, list[str]] = {}
        for pool, space in rows:
            found.setdefault(pool, []).append(space)
        return found

    # -- usage -----------------------------------------------------------------------

    def write_usage(self, host: str, boot: str, totals: Totals) -> bool:
        """This boot's absolute totals per space (USAGE_COLUMNS order): a retry rewrites
        the same numbers. Written only while this boot is the host's, checked under the
        host row's lock in the same transaction: False, and nothing written, once a new
        boot has taken over (join), which bills from where this boot's rows stopped."""
        with self.session() as conn, conn.transaction():
            row = conn.execute(
                "SELECT boot FROM polyserve_hosts WHERE id = %s FOR KEY SHARE", (host,)
            ).fetchone()
            if row is None or row[0] != boot:
                return False
            if totals:
                with conn.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO polyserve_usage (host, boot, space, requests, errors,"
                        " busy_us, resident_us, loads, import_us)"
                        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
                        " ON CONFLICT (host, boot, space) DO UPDATE SET"
                        " requests = excluded.requests, errors = excluded.errors,"
                        " busy_us = excluded.busy_us, resident_us = excluded.resident_us,"
                        " loads = excluded.loads, import_us = excluded.import_us,"
                        " updated_at = now()",
                        [(host, boot, space, *values) for space, values in totals.items()],
                    )
            return True

    def usage(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """The ledger summed over every host and boot: per space, and per host."""
        sums = ", ".join(f"sum({c})::bigint" for c in USAGE_COLUMNS)
        with self.session() as conn:
            spaces = conn.execute(
                f"SELECT space, {sums} FROM polyserve_usage GROUP BY space"
            ).fetchall()
            hosts = conn.execute(f"SELECT host, {sums} FROM polyserve_usage GROUP BY host")
            per_host = hosts.fetchall()
        return (
            {space: tuple(values) for space, *values in spaces},
            {host: tuple(values) for host, *values in per_host},
        )


async def threaded(
    threads: anyio.CapacityLimiter | None, timeout_s: float, func: Callable[..., _T], *args: Any
) -> _T:
    """A FleetDB call from an event loop, on `threads` (the fleet's own, never the
    host's): a call that gets no thread within `timeout_s` (the database stalled and
    every thread waits on it) is Unreachable at once; one that got a thread ends within
    that time too (FleetDB's deadline). So a 503 comes in bounded time."""
    with anyio.move_on_after(timeout_s):
        return await anyio.to_thread.run_sync(func, *args, limiter=threads)
    raise Unreachable()


def connect(
    url: str, timeout_s: float = TIMEOUT_S, within_s: float | None = None
) -> psycopg.Connection:
    """An autocommit connection (libpq reads PG* variables for what the URL leaves out).

    Keepalives and a TCP user timeout make a link that silently drops packets fail
    within seconds, not after the kernel's quarter of an hour of retries. The server
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
    the server had closed the connection. Its timer takes the lock before it touches
    the connection, and the caller stops watching before it closes one, so a file
    descriptor the kernel reused is never touched."""

    def __init__(self, end: float) -> None:
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(end - time.monotonic(), 0.0), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, conn: psycopg.Connection | None) -> None:
        with self._lock:
            self._conn = conn

    def _expire(self) -> None:
        with self._lock:
            if self._conn is None:
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
        self._timer.cancel()
        self.watch(None)


def _totals(stored: dict[str, list[int]] | None) -> Totals:
    return {space: tuple(values) for space, values in (stored or {}).items()}


def _continued(before: Totals, billed: list[tuple[Any, ...]], boot: Boot) -> Totals:
    """A new boot's baseline from the boot it replaces: that boot's baseline plus what
    its rows bill, per space. Restored from a checkpoint (settled), the host's totals
    may be behind what was billed (a machine restart loses /dev/shm, and with it what
    came after the last checkpoint): then they are the baseline, so what the host
    counts from now on is billed and nothing twice. From a killed master's segment
    they may still grow by its workers' late answers, which the rows may already
    hold: never lower then."""
    zero = (0,) * len(USAGE_COLUMNS)
    reached = {space: tuple(values) for space, *values in billed}
    baseline = {}
    for space in before.keys() | reached.keys():
        total = [
            a + b for a, b in zip(before.get(space, zero), reached.get(space, zero), strict=True)
        ]
        if boot.settled:
            start = boot.start.get(space, zero)
            total = [min(t, s) for t, s in zip(total, start, strict=True)]
        if any(total):
            baseline[space] = tuple(total)
    return baseline


def _alive(conn: psycopg.Connection) -> bool:
    """Whether a connection kept from an earlier call still works. A connection the
    server dropped looks open until it is used: one round trip tells."""
    if conn.closed:
        return False
    try:
        conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return False
    return True


def _refuse_unfit(conn: psycopg.Connection, space: str, size: int, fit: Fit) -> None:
    """ClientError when a live host (or the receiving one) could not apply this deploy:
    its table would hold more spaces than its slots, or the upload is larger than its
    caps. Refused before the commit, the fleet never has a change a host cannot take."""
    hosts = conn.execute(
        f"SELECT id, max_spaces, max_upload_mb, max_unpacked_mb FROM polyserve_hosts"
        f" WHERE left_at IS NULL AND ({LIVE} OR id = %s) ORDER BY id",
        (fit.live_s, fit.host),
    ).fetchall()
    row = conn.execute(
        "SELECT count(*) FROM polyserve_spaces WHERE current_version IS NOT NULL AND name <> %s",
        (space,),
    ).fetchone()
    spaces = (row[0] if row else 0) + 1

    def over(column: int, amount: int, unit: int) -> list[tuple[str, int]]:
        """The hosts whose limit in `column` (in `unit`s) is below `amount`, and it."""
        limits = [(h[0], h[column]) for h in hosts if h[column] is not None]
        return [(host, limit) for host, limit in limits if amount > limit * unit]

    mib = 1 << 20
    refusals = (
        (507, over(1, spaces, 1), "space table is full on host {} (POLYSERVE_MAX_SPACES={}),"
            f" and this deploy would make {spaces} spaces deployed in the fleet: raise it on"
            " every host, or delete a space"),
        (413, over(2, size, mib), f"the upload is {size / mib:.1f} MiB, more than host {{}}"
            " takes (POLYSERVE_MAX_UPLOAD_MB={}): raise it there, or make the space smaller"),
        (413, over(3, fit.unpacked, mib), f"the upload unpacks to {fit.unpacked / mib:.1f} MiB,"
            " more than host {} takes (POLYSERVE_MAX_UNPACKED_MB={}): raise it there, or make"
            " the space smaller"),
    )  # fmt: skip
    for status, unfit, error in refusals:
        if unfit:
            hosts_unfit = [h for h, _ in unfit]
            raise ClientError(status, error.format(*unfit[0]), space=space, hosts=hosts_unfit)


def _copy_version(
    conn: psycopg.Connection, row: tuple[str, int, str, dict[str, Any]], upload: BinaryIO, size: int
) -> None:
    """Insert a version with one binary COPY whose last field, the upload, is read from
    its file CHUNK at a time: a parameter would hold it whole, and its encoding again."""
    space, number, sha256, meta = row
    # jsonb's binary form is a version byte, 1, then the text.
    jsonb = b"\x01" + json.dumps(meta).encode()
    fields = (space.encode(), struct.pack("!i", number), sha256.encode(), jsonb)
    head = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!iih", 0, 0, 5)
    head += b"".join(struct.pack("!i", len(f)) + f for f in fields) + struct.pack("!i", size)
    upload.seek(0)
    with (
        conn.cursor() as cur,
        cur.copy(
            "COPY polyserve_versions (space, number, sha256, meta, data) FROM STDIN (FORMAT binary)"
        ) as copy,
    ):
        copy.write(head)
        sent = 0
        while chunk := upload.read(CHUNK):
            copy.write(chunk)
            sent += len(chunk)
        if sent != size:  # the file changed under us: the server would take a short row
            raise RuntimeError(f"the upload was {size} bytes, then {sent}")
        copy.write(struct.pack("!h", -1))


def _log(conn: psycopg.Connection, space: str, kind: str, version: int | None) -> Change:
    """Append a change under CHANGE_LOCK (held by the caller's transaction) and notify."""
    row = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM polyserve_changes").fetchone()
    assert row is not None
    token = conn.execute(
        "INSERT INTO polyserve_changes (id, space, kind, version) VALUES (%s, %s, %s, %s)"
        " RETURNING token::text",
        (row[0], space, kind, version),
    ).fetchone()
    change = Change(row[0], space, kind, version, token[0] if token else None)
    # Delivered at commit, to every host listening then; the others poll.
    conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, json.dumps(change.id)))
    return change
