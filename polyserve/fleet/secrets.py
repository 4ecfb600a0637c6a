"""The fleet's secrets: stored once in PostgreSQL, each change logged for every host to apply.

One row per secret in `polyserve_secrets` (migration 6). A write commits the row and a
change of kind 'secrets' (no value in it) under CHANGE_LOCK; each host's follower then
writes the space's whole set from here into its local file and releases the space
(polyserve.fleet.catchup). A delete of the space drops its rows (ChangeLog.delete).
"""

from __future__ import annotations

from typing import Any

import psycopg

from polyserve.fleet.changes import Change, log_change
from polyserve.fleet.connection import Connection
from polyserve.fleet.schema import CHANGE_LOCK
from polyserve.state.secrets import entry, unknown_secret


class SecretRows(Connection):
    """The secrets' rows, and the changes that tell the hosts."""

    def secret_names(self, space: str) -> list[dict[str, object]] | None:
        """Each secret's name and when it was set (never a value); None when the space
        is not deployed."""
        with self.session() as conn, conn.transaction():
            if _current(conn, space) is None:
                return None
            rows = conn.execute(
                "SELECT name, extract(epoch FROM updated_at)::float8 FROM polyserve_secrets"
                " WHERE space = %s ORDER BY name",
                (space,),
            ).fetchall()
        return [{"name": name, "updated_at": at} for name, at in rows]

    def set_secret(self, space: str, name: str, value: str) -> Change | None:
        """Store (or replace) a secret of a deployed space and log the change; None when
        the space is not deployed."""
        with self.session() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (CHANGE_LOCK,))
            current = _current(conn, space)
            if current is None:
                return None
            conn.execute(
                "INSERT INTO polyserve_secrets (space, name, value) VALUES (%s, %s, %s)"
                " ON CONFLICT (space, name) DO UPDATE"
                " SET value = excluded.value, updated_at = now()",
                (space, name, value.encode()),
            )
            return log_change(conn, space, "secrets", current)

    def unset_secret(self, space: str, name: str) -> Change | None:
        """Remove a secret and log the change; None when the space is not deployed.
        ClientError 404 when it has no secret by that name."""
        with self.session() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (CHANGE_LOCK,))
            current = _current(conn, space)
            if current is None:
                return None
            gone = conn.execute(
                "DELETE FROM polyserve_secrets WHERE space = %s AND name = %s RETURNING name",
                (space, name),
            ).fetchone()
            if gone is None:
                raise unknown_secret(space, name)
            return log_change(conn, space, "secrets", current)

    def secrets(self, space: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
        """Every space's secrets (or one space's), as a host's files hold them: space ->
        name -> {"value", "updated_at"}."""
        where, args = ("WHERE space = %s", (space,)) if space is not None else ("", ())
        with self.session() as conn:
            rows = conn.execute(
                "SELECT space, name, value, extract(epoch FROM updated_at)::float8"
                f" FROM polyserve_secrets {where}",
                args,
            ).fetchall()
        found: dict[str, dict[str, dict[str, Any]]] = {}
        for owner, name, value, at in rows:
            found.setdefault(owner, {})[name] = entry(value, at)
        return found


def _current(conn: psycopg.Connection, space: str) -> int | None:
    row = conn.execute(
        "SELECT current_version FROM polyserve_spaces WHERE name = %s", (space,)
    ).fetchone()
    return row[0] if row else None
