"""A worker's side of the fleet: commit a write, wait until every live host applied it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

import anyio
import anyio.to_thread

from polyserve.fleet.db import Change, Fit, FleetDB
from polyserve.fleet.follower import APPLIED, fetch_version, read_applied
from polyserve.settings import Settings
from polyserve.store import Store, Version

_T = TypeVar("_T")
WAIT_POLL_S = 0.02  # how often a waiting deploy reads the hosts' acknowledgements


class FleetClient:
    def __init__(
        self, settings: Settings, store: Store, threads: anyio.CapacityLimiter | None
    ) -> None:
        self.settings = settings
        self.store = store
        self.threads = threads
        self.db = FleetDB(settings.database_url)  # connects on first use, in a thread

    async def run(self, func: Callable[..., _T], *args: object) -> _T:
        """Database work on the host's threads: the event loop never waits on it."""
        return await anyio.to_thread.run_sync(func, *args, limiter=self.threads)

    async def applied(self, change: Change) -> tuple[int, dict[str, object]]:
        """Wait until every live host, this one included, has applied the change (or
        skipped it: it could not), or POLYSERVE_DEPLOY_WAIT_S has passed: (200, or 202
        when some host lags or skipped it; the `hosts` part of the answer)."""
        s = self.settings
        deadline = time.monotonic() + s.deploy_wait_s
        while True:
            hosts = await self.run(self.db.hosts, s.fleet_live_s)
            live = {h["id"]: h["applied"] for h in hosts if h["live"]}
            skips = await self.run(self.db.skipped, change)
            skipped = {h: skips[h][0]["error"] for h in skips if h in live or h == s.host_id}
            lagging = [h for h, applied in live.items() if applied < change.id]
            if s.host_id not in live:
                lagging.append(s.host_id)  # not following the fleet right now: say so
            lagging = [h for h in lagging if h not in skipped]
            if not lagging or time.monotonic() > deadline:
                break
            await asyncio.sleep(WAIT_POLL_S)
        done = [h for h, applied in live.items() if applied >= change.id and h not in skipped]
        body: dict[str, object] = {"applied": len(done), "live": len(live)}
        if lagging:
            body["lagging"] = sorted(lagging)
        if skipped:
            body["skipped"] = skipped
        return (202 if lagging or skipped else 200), body

    def deploy(
        self, space: str, upload: BinaryIO, sha256: str, meta: dict[str, Any], unpacked: int
    ) -> Change:
        """Commit a validated upload, streamed from its file, unless some live host could
        not apply it (ClientError 507 or 413: nothing is committed)."""
        s = self.settings
        fit = Fit(s.host_id, s.fleet_live_s, unpacked)
        return self.db.deploy(space, upload, sha256, meta, fit)

    def fetch(self, version: Version) -> None:
        """A version this host knows only by its pointer: its files, on first use."""
        fetch_version(self.db, self.store, version, self.settings.max_unpacked_mb << 20)

    async def usage(self) -> dict[str, Any]:
        """The fleet's ledger, rendered like a host's usage: per space, then each host's
        totals over its spaces."""
        spaces, hosts = await self.run(self.db.usage)
        return {
            "spaces": {space: _render(values) for space, values in spaces.items()},
            "hosts": {host: _render(values) for host, values in hosts.items()},
        }

    async def lag(self) -> tuple[int, int]:
        """(The last change this host applied, the fleet's last change)."""
        applied = read_applied(self.store.root / APPLIED)
        return applied, await self.run(self.db.last_change)

    async def view(self) -> dict[str, Any]:
        """The fleet's hosts, live or not, and what each has applied."""
        hosts = await self.run(self.db.hosts, self.settings.fleet_live_s)
        last = await self.run(self.db.last_change)
        skipped = await self.run(self.db.skipped)
        for host in hosts:
            host["skipped"] = skipped.get(host["id"], [])  # what it could not apply, and why
        return {"last_change": last, "hosts": hosts}


def _render(values: tuple[int, ...]) -> dict[str, int]:
    requests, errors, busy_us, resident_us, loads, _ = values
    return {
        "requests": requests,
        "busy_ms": busy_us // 1000,
        "warm_s": resident_us // 1_000_000,
        "errors": errors,
        "cold_starts": loads,
    }
