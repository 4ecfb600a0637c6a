"""What hosts report beside their heartbeat: the changes they skipped, demand no host served."""

from __future__ import annotations

from typing import Any

from polyserve.fleet.changes import Change
from polyserve.fleet.connection import Connection


class Reports(Connection):
    """Skipped changes per host, and requests no live host of their pool could take."""

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
