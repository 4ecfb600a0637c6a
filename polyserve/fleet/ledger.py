"""The fleet's usage ledger: absolute totals per host boot and space, so no retry counts twice."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polyserve.fleet.connection import Connection
from polyserve.usage.meter import BILLED_NAMES

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


@dataclass(frozen=True)
class FleetUsage:
    """The ledger's sums: per space and per host (USAGE_COLUMNS order), and per space
    the workers that hold it now, over the live hosts."""

    spaces: dict[str, tuple[int, ...]]
    hosts: dict[str, tuple[int, ...]]
    workers_loaded: dict[str, int]


class UsageLedger(Connection):
    """Writes of each boot's totals, and the ledger's sums."""

    def write_usage(
        self, host: str, boot: str, totals: Totals, loaded: Mapping[str, int] | None = None
    ) -> bool:
        """This boot's absolute totals per space (USAGE_COLUMNS order): a retry rewrites
        the same numbers. Written only while this boot is the host's, checked under the
        host row's lock in the same transaction: False, and nothing written, once a new
        boot has taken over (join), which bills from where this boot's rows stopped.

        `loaded`, the spaces the host's workers hold now and how many workers hold each,
        replaces what the host wrote before (None leaves it)."""
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
            if loaded is not None:
                conn.execute("DELETE FROM polyserve_loaded WHERE host = %s", (host,))
                if loaded:
                    with conn.cursor() as cur:
                        cur.executemany(
                            "INSERT INTO polyserve_loaded (host, boot, space, workers)"
                            " VALUES (%s, %s, %s, %s)",
                            [(host, boot, space, n) for space, n in loaded.items()],
                        )
            return True

    def usage(self, live_s: float) -> FleetUsage:
        """The ledger summed over every host and boot, per space and per host, and the
        workers holding each space now on the hosts that heartbeat (within `live_s`)."""
        sums = ", ".join(f"sum({c})::bigint" for c in USAGE_COLUMNS)
        with self.session() as conn:
            spaces = conn.execute(
                f"SELECT space, {sums} FROM polyserve_usage GROUP BY space"
            ).fetchall()
            hosts = conn.execute(f"SELECT host, {sums} FROM polyserve_usage GROUP BY host")
            per_host = hosts.fetchall()
            # A host that left, or stopped heartbeating (killed), holds nothing; draining
            # hosts still serve what they hold.
            loaded = conn.execute(
                "SELECT l.space, sum(l.workers)::bigint FROM polyserve_loaded l"
                " JOIN polyserve_hosts h ON h.id = l.host AND h.boot = l.boot"
                " WHERE h.left_at IS NULL"
                " AND h.last_seen > now() - make_interval(secs => %s)"
                " GROUP BY l.space",
                (live_s,),
            ).fetchall()
        return FleetUsage(
            {space: tuple(values) for space, *values in spaces},
            {host: tuple(values) for host, *values in per_host},
            dict(loaded),
        )


def stored_totals(stored: dict[str, list[int]] | None) -> Totals:
    return {space: tuple(values) for space, values in (stored or {}).items()}


def continued(before: Totals, billed: list[tuple[Any, ...]], boot: Boot) -> Totals:
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
