"""The fleet's hosts: each one's boot joins, heartbeats with what it applied, drains and leaves."""

from __future__ import annotations

from typing import Any

from psycopg.types.json import Jsonb

from polyserve.fleet.connection import Connection
from polyserve.fleet.ledger import USAGE_COLUMNS, Boot, Totals, continued, stored_totals

# A host that heartbeats, has neither left nor is draining: the one `live` of the fleet.
LIVE = "left_at IS NULL AND draining_at IS NULL AND last_seen > now() - make_interval(secs => %s)"


class Hosts(Connection):
    """Each host's row: its boot, URL, pool, limits, heartbeat and what it applied."""

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
                return boot.start if row[2] is None else stored_totals(row[2])
            if row is not None and not takeover:
                return None
            baseline = boot.start
            if row is not None and boot.lineage and row[1] == boot.lineage and row[2] is not None:
                billed = conn.execute(
                    f"SELECT space, {', '.join(USAGE_COLUMNS)} FROM polyserve_usage"
                    " WHERE host = %s AND boot = %s",
                    (host, row[0]),
                ).fetchall()
                baseline = continued(stored_totals(row[2]), billed, boot)
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

    def limits(
        self, host: str, boot: str, spaces: int | None, upload_mb: int, unpacked_mb: int
    ) -> None:
        """This boot's POLYSERVE_MAX_SPACES, _MAX_UPLOAD_MB and _MAX_UNPACKED_MB, which a
        deploy must fit while this host is live; `spaces` None for a host whose slots go
        to what it serves (Settings.lazy_slots): the fleet's count of spaces is no limit
        of its."""
        with self.session() as conn:
            conn.execute(
                "UPDATE polyserve_hosts SET max_spaces = %s, max_upload_mb = %s,"
                " max_unpacked_mb = %s WHERE id = %s AND boot = %s",
                (spaces, upload_mb, unpacked_mb, host, boot),
            )

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
