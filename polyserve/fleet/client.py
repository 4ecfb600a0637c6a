"""A worker's side of the fleet: commit a write, wait until every live host applied it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

import anyio
import anyio.to_thread

from polyserve.errors import ClientError
from polyserve.fleet.catchup import APPLIED, read_applied
from polyserve.fleet.changes import Change, Fit
from polyserve.fleet.connection import Unreachable, threaded
from polyserve.fleet.db import FleetDB
from polyserve.fleet.fetch import fetch_version
from polyserve.fleet.ledger import USAGE_COLUMNS
from polyserve.fleet.rollouts import reporter
from polyserve.settings import Settings
from polyserve.state.shm import Table
from polyserve.state.store import Store, Version

_T = TypeVar("_T")
# How often a waiting deploy reads the hosts' acknowledgements: soon after the commit
# (a host applies a change in milliseconds), then less often, up to the longest wait.
WAIT_POLL_FIRST_S = 0.002
WAIT_POLL_S = 0.02
# Threads a worker gives the fleet's database calls: their own, so a database that stops
# answering ties up none of the host's (imports, stagings) and no space waits on it.
DB_THREADS = 4
HOSTS_UNKNOWN = (
    "the change is committed, but the fleet store became unreachable before this host"
    " could read which live hosts applied it: do not repeat the write; GET"
    " /_polyserve/fleet shows each host's `applied` once the database is back"
)


class FleetClient:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.db_limiter = anyio.CapacityLimiter(DB_THREADS)
        # Connects on first use, in a thread; each call within POLYSERVE_FLEET_TIMEOUT_S.
        self.db = FleetDB(settings.database_url, settings.fleet_timeout_s)

    async def run(self, func: Callable[..., _T], *args: object) -> _T:
        """Database work on the fleet's own threads, in bounded time (see threaded)."""
        return await threaded(self.db_limiter, self.settings.fleet_timeout_s, func, *args)

    async def applied(self, change: Change) -> tuple[int, dict[str, object]]:
        """Wait until every live host, this one included, has applied the committed
        change (or skipped it: it could not), or POLYSERVE_DEPLOY_WAIT_S has passed: (200,
        or 202 when some host lags or skipped it; the `hosts` part of the answer). The
        change is committed whatever the database does now: a read of the hosts that
        fails is tried again until the deadline, and a deadline met without one is a 202
        whose hosts are unknown, never a 503 (whose "retry" would commit the change
        twice)."""
        s = self.settings
        deadline = time.monotonic() + s.deploy_wait_s
        poll = WAIT_POLL_FIRST_S
        while True:
            try:
                hosts = await self.run(self.db.hosts, s.fleet_live_s)
                skips = await self.run(self.db.skipped, change)
            except Unreachable:
                hosts = None  # a restart, a stall: read again until the deadline
            if hosts is not None:
                # What each live host acknowledged (only a change whose token it applied).
                live = {h["id"]: h["applied"] for h in hosts if h["live"]}
                skipped = {h: skips[h][0]["error"] for h in skips if h in live or h == s.host_id}
                lagging = [h for h, applied in live.items() if applied < change.id]
                if s.host_id not in live:
                    lagging.append(s.host_id)  # not following the fleet right now: say so
                lagging = [h for h in lagging if h not in skipped]
                if not lagging:
                    break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(poll)
            poll = min(poll * 2, WAIT_POLL_S)
        if hosts is None:
            return 202, {"unknown": True, "error": HOSTS_UNKNOWN}
        done = [h for h, applied in live.items() if applied >= change.id and h not in skipped]
        body: dict[str, object] = {"applied": len(done), "live": len(live)}
        if lagging:
            body["lagging"] = sorted(lagging)
        if skipped:
            body["skipped"] = skipped
        return (202 if lagging or skipped else 200), body

    def deploy(
        self,
        space: str,
        upload: BinaryIO,
        sha256: str,
        meta: dict[str, Any],
        unpacked: int,
        current: bool = True,
    ) -> Change:
        """Commit a validated upload, streamed from its file, unless some live host could
        not apply it (ClientError 507 or 413: nothing is committed). On the fleet's
        threads (run)."""
        s = self.settings
        fit = Fit(s.host_id, s.fleet_live_s, unpacked)
        return self.db.deploy(space, upload, sha256, meta, fit, current)

    async def fetch(self, version: Version) -> None:
        """A version this host knows only by its pointer: its files, on first use, and
        its dependency set if this host lacks it (it took the version while in another
        pool, whose versions come with neither)."""
        if version.deps is not None and not version.deps.is_dir():
            await self._install_set(version)
        limit = self.settings.max_unpacked_mb << 20
        await self.run(fetch_version, self.db, self.store, version, limit)

    async def _install_set(self, version: Version) -> None:
        """The pins the version's metadata carries, installed here as a follower would."""
        from polyserve.deploy import deps  # uv and packaging: only a host that installs pays

        meta = await anyio.to_thread.run_sync(self.store.meta, version.space, version.number)
        declared = (meta or {}).get("dependencies")
        if not isinstance(declared, dict):
            return
        installed = await deps.install_pins(declared, self.store.root, self.settings)
        if installed.site != version.deps:
            raise ClientError(
                500,
                f"{version.space} v{version.number} names the dependency set {declared.get('set')},"
                f" which this host's Python installs as {installed.digest}: run the Python of"
                " the host that took the deploy, or deploy it again through this host",
            )

    async def usage(self) -> dict[str, Any]:
        """The fleet's ledger, rendered like a host's usage: per space, then each host's
        totals over its spaces."""
        found = await self.run(self.db.usage, self.settings.fleet_live_s)
        zero = (0,) * len(USAGE_COLUMNS)
        loaded = found.workers_loaded
        spaces = {}
        for space in found.spaces.keys() | loaded.keys():
            fields = _render(found.spaces.get(space, zero))
            fields["loaded"] = space in loaded
            fields["workers_loaded"] = loaded.get(space, 0)
            spaces[space] = fields
        return {
            "spaces": spaces,
            "hosts": {host: _render(values) for host, values in found.hosts.items()},
        }

    async def lag(self) -> tuple[int, int]:
        """(The last change this host applied, the fleet's last change)."""
        applied = read_applied(self.store.root / APPLIED)
        return applied, await self.run(self.db.last_change)

    async def rollout_others(
        self, space: str, state: dict[str, Any], table: Table
    ) -> dict[str, Any] | None:
        """The other hosts' counts of a live rollout's step under way, as they last
        reported them (None: the fleet store is unreachable)."""
        try:
            me = reporter(self.settings.host_id, table)
            return await self.run(self.db.rollout_others, space, state, me)
        except Unreachable:
            return None

    async def view(self) -> dict[str, Any]:
        """The fleet's hosts, live or not, and what each has applied."""
        hosts = await self.run(self.db.hosts, self.settings.fleet_live_s)
        last = await self.run(self.db.last_change)
        skipped = await self.run(self.db.skipped)
        for host in hosts:
            host["skipped"] = skipped.get(host["id"], [])  # what it could not apply, and why
        return {"last_change": last, "hosts": hosts}


def _render(values: tuple[int, ...]) -> dict[str, object]:
    requests, errors, busy_us, resident_us, loads, _ = values
    return {
        "requests": requests,
        "busy_ms": busy_us // 1000,
        "warm_s": resident_us // 1_000_000,
        "errors": errors,
        "cold_starts": loads,
    }
