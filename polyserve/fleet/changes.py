"""The fleet's change log: commit deploys, rollbacks, deletes, releases, access; read them back.

A secret's change is committed by polyserve.fleet.secrets, through `log_change`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import psycopg

from polyserve.errors import ClientError
from polyserve.fleet.connection import CHANNEL, Connection
from polyserve.fleet.hosts import LIVE
from polyserve.fleet.schema import CHANGE_LOCK
from polyserve.fleet.uploads import copy_version
from polyserve.state import rollouts
from polyserve.state.access import Access
from polyserve.state.history import rollback_target, version_summary

# What a change does, as the change log's CHECK constraint says (a rollback is a deploy
# of an older number).
# A rollout's change carries its new version: every host keeps it (fleet/rollouts.py).
ChangeKind = Literal["deploy", "delete", "release", "access", "secrets", "rollout"]


@dataclass(frozen=True)
class Change:
    """One entry of the fleet's change log."""

    id: int
    space: str
    kind: ChangeKind
    version: int | None
    token: str | None = None  # random at its commit: tells this change from a reused id


@dataclass(frozen=True)
class Fit:
    """What a deploy must fit before it is committed: every live host's limits (and the
    receiving host's, live or not), as that host would check the upload itself."""

    host: str  # the receiving host
    live_s: float  # POLYSERVE_FLEET_LIVE_S
    unpacked: int  # what the upload unpacks to, as the unpacked cap counts it


class ChangeLog(Connection):
    """Commits to the change log, each under CHANGE_LOCK, and its reads."""

    @contextlib.contextmanager
    def _changing(self) -> Iterator[psycopg.Connection]:
        """A transaction that may append to the change log: it holds CHANGE_LOCK, so
        change ids commit in the order they are assigned and no follower skips one."""
        with self.session() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (CHANGE_LOCK,))
            yield conn

    def deploy(
        self,
        space: str,
        upload: BinaryIO,
        sha256: str,
        meta: dict[str, Any],
        fit: Fit,
        current: bool = True,
    ) -> Change:
        """Store a version under the space's next number, make it current, log the change.
        The upload is streamed from its file, never read whole. Refused (ClientError 507
        or 413, nothing committed) when a live host could not apply it. current=False
        keeps it beside the current one (logged as kind `rollout`: every host keeps it)."""
        size = upload.seek(0, 2)
        with self._changing() as conn:
            if not current and _current(conn, space) is None:
                raise ClientError(
                    409,
                    f"space {space} is not deployed: deploy it first without current=false",
                    space=space,
                )
            _refuse_unfit(conn, space, size, fit)
            conn.execute(
                "INSERT INTO polyserve_spaces (name) VALUES (%s) ON CONFLICT DO NOTHING", (space,)
            )
            # What this version replaces: a rollback without a number goes back to it.
            before = conn.execute(
                "SELECT current_version FROM polyserve_spaces WHERE name = %s", (space,)
            ).fetchone()
            moved = ", current_version = last_version + 1" if current else ""
            row = conn.execute(
                f"UPDATE polyserve_spaces SET last_version = last_version + 1{moved}"
                " WHERE name = %s RETURNING last_version",
                (space,),
            ).fetchone()
            assert row is not None
            number = row[0]
            meta = {**meta, "version": number, "replaced": before[0] if before else None}
            copy_version(conn, (space, number, sha256, meta), upload, size)
            change = _log(conn, space, "deploy" if current else "rollout", number)
            if current:
                _interrupt_rollout(conn, space, number)
            return change

    def rollback(self, space: str, asked: int | None) -> tuple[Change, int, dict[str, Any]]:
        """Make a stored version current again, logged as a deploy of that (older)
        number: every follower applies it as it applies a deploy, fetching the bytes
        it no longer has. Returns (the change, the version it replaced, its metadata);
        ClientError 404 when the space is not deployed or does not keep such a version
        (kept_versions: one from before its delete is not; the error lists the kept)."""
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
            kept = kept_versions(conn, space)
            number = rollback_target(space, current, current_meta, kept, asked)
            conn.execute(
                "UPDATE polyserve_spaces SET current_version = %s WHERE name = %s",
                (number, space),
            )
            change = _log(conn, space, "deploy", number)
            _interrupt_rollout(conn, space, number)
            return change, current, metas[number]

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
            # A host's history tells what each version served: a change of the space's
            # secrets moves no version, and is not in it there either.
            changes = conn.execute(
                "SELECT kind, version, extract(epoch FROM at)::float8 FROM polyserve_changes"
                # Access and secrets changes move no version: not events of the history.
                " WHERE space = %s AND kind NOT IN ('access', 'secrets') ORDER BY id",
                (space,),
            ).fetchall()
        versions = [version_summary(meta, number, current) for number, meta in stored]
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
        """Undeploy everywhere, its secrets with it; None when the space is not deployed."""
        with self._changing() as conn:
            row = conn.execute(
                "UPDATE polyserve_spaces SET current_version = NULL"
                " WHERE name = %s AND current_version IS NOT NULL RETURNING name",
                (space,),
            ).fetchone()
            if row is None:
                return None
            # A space deployed again under the name starts public, as on a single host.
            conn.execute("DELETE FROM polyserve_access WHERE space = %s", (space,))
            conn.execute("DELETE FROM polyserve_secrets WHERE space = %s", (space,))
            change = _log(conn, space, "delete", None)
            _interrupt_rollout(conn, space, None)
            return change

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

    def access(self, space: str, edit: Callable[[Access], Access]) -> Change | None:
        """Replace a deployed space's access by `edit` of the fleet's, and log it: every
        host applies it as a deploy (polyserve.fleet.catchup). None when the space is not
        deployed; an edit's ClientError commits nothing."""
        with self._changing() as conn:
            if _current(conn, space) is None:
                return None
            after = edit(_access_row(conn, space))
            conn.execute(
                "INSERT INTO polyserve_access (space, private, keys) VALUES (%s, %s, %s::jsonb)"
                " ON CONFLICT (space) DO UPDATE SET private = EXCLUDED.private,"
                " keys = EXCLUDED.keys",
                (space, after.private, json.dumps(after.to_json(local=False)["keys"])),
            )
            return _log(conn, space, "access", None)

    def access_of(self, space: str, deployed: bool = False) -> Access | None:
        """The fleet's access of a space (public when it has no row); with `deployed`,
        None when the space is not deployed."""
        with self.session() as conn:
            if deployed and _current(conn, space) is None:
                return None
            return _access_row(conn, space)

    def accesses(self) -> dict[str, Access]:
        """Every space's access row, for a host that takes the fleet's pointers."""
        with self.session() as conn:
            rows = conn.execute("SELECT space, private, keys FROM polyserve_access").fetchall()
        return {space: Access(private, list(keys)) for space, private, keys in rows}

    def changes_since(self, after: int, limit: int) -> tuple[str | None, list[Change]]:
        """(The token of change `after` as the fleet has it, None when it has none: its
        database went back to before it; the next `limit` changes after it), in one
        round trip: a follower makes this call on every poll."""
        with self.session() as conn:
            rows = conn.execute(
                "SELECT id, space, kind, version, token::text FROM polyserve_changes"
                " WHERE id >= %s ORDER BY id LIMIT %s",
                (after, limit + 1),
            ).fetchall()
        changes = [Change(*row) for row in rows]
        if changes and changes[0].id == after:
            return changes[0].token, changes[1:]
        return None, changes[:limit]

    def pointers(self) -> tuple[Change | None, dict[str, tuple[int, dict[str, Any]] | None]]:
        """What a joining host needs: the last change (None for none), and each space's
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
        return (Change(*last) if last else None), pointers

    def last_change(self) -> int:
        with self.session() as conn:
            row = conn.execute("SELECT coalesce(max(id), 0) FROM polyserve_changes").fetchone()
        return row[0] if row else 0


def _refuse_unfit(conn: psycopg.Connection, space: str, size: int, fit: Fit) -> None:
    """ClientError when a live host (or the receiving one) could not apply this deploy:
    its table would hold more spaces than its slots, or the upload is larger than its
    caps. Refused before the commit, the fleet never has a change a host cannot take."""
    hosts = conn.execute(
        f"SELECT id, max_spaces, max_upload_mb, max_unpacked_mb FROM polyserve_hosts"
        f" WHERE left_at IS NULL AND ({LIVE} OR id = %s) ORDER BY id",
        (fit.live_s, fit.host),
    ).fetchall()
    spaces = 0
    # Counted only when a host takes a slot for every space as it arrives
    # (POLYSERVE_FLEET_FILES=all): one that serves what it is asked writes no limit, and
    # the count's cost grows with the fleet (docs/fleet.md, "How big a fleet gets").
    if any(h[1] is not None for h in hosts):
        row = conn.execute(
            "SELECT count(*) FROM polyserve_spaces"
            " WHERE current_version IS NOT NULL AND name <> %s",
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


def _current(conn: psycopg.Connection, space: str) -> int | None:
    row = conn.execute(
        "SELECT current_version FROM polyserve_spaces WHERE name = %s", (space,)
    ).fetchone()
    return row[0] if row else None


def kept_versions(conn: psycopg.Connection, space: str) -> list[int]:
    """The stored versions the space keeps: those deployed (or made current again) since
    its last delete. The fleet store prunes no version, but one from before a delete is
    another life's, as a single host (which dropped its files) answers too."""
    rows = conn.execute(
        "SELECT DISTINCT c.version FROM polyserve_changes c"
        " JOIN polyserve_versions v ON v.space = c.space AND v.number = c.version"
        " WHERE c.space = %s AND c.kind IN ('deploy', 'rollout') AND c.id > coalesce("
        "(SELECT max(id) FROM polyserve_changes WHERE space = %s AND kind = 'delete'), 0)"
        " ORDER BY c.version",
        (space, space),
    ).fetchall()
    return [int(r[0]) for r in rows]


def _interrupt_rollout(conn: psycopg.Connection, space: str, current: int | None) -> None:
    """After a move of the space's `current` to `current` (None: deleted), logged: end its
    live rollout if the move ends it (rollouts.interrupted), with a change of its own, so
    every host takes the ended state. Each host ends its own copy already when it
    applies the move (Changes.moved): no request after the move goes to the new version.
    A move to the rollout's new version (completed by hand) is the one a host leaves to
    this change: every request gets that version already."""
    row = conn.execute(
        "SELECT state FROM polyserve_rollouts WHERE space = %s FOR UPDATE", (space,)
    ).fetchone()
    state = dict(row[0]) if row else None
    ended = None if state is None else rollouts.interrupted(state, current)
    if state is None or ended is None:
        return
    rollouts.over(state, *ended, time.time())
    conn.execute(
        "UPDATE polyserve_rollouts SET state = %s::jsonb, updated_at = now() WHERE space = %s",
        (json.dumps(state), space),
    )
    _log(conn, space, "rollout", None)  # None: no version to keep (the space may be gone)


def _access_row(conn: psycopg.Connection, space: str) -> Access:
    row = conn.execute(
        "SELECT private, keys FROM polyserve_access WHERE space = %s", (space,)
    ).fetchone()
    return Access(row[0], list(row[1])) if row else Access()


def _log(conn: psycopg.Connection, space: str, kind: ChangeKind, version: int | None) -> Change:
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


log_change = _log  # for the kinds committed by modules of their own (fleet/secrets.py)
