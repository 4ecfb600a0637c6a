"""Another pool's spaces, from a worker's cold path: a live host of that pool, or demand."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import TypeVar

import anyio

from polyserve.fleet.connection import Unreachable, threaded
from polyserve.fleet.db import FleetDB

_T = TypeVar("_T")
# A burst of requests for other pools' spaces reads the fleet's hosts once per this many
# seconds, per worker; a host that left is redirected to for at most that long.
HOSTS_TTL_S = 1.0
DEMAND_EVERY_S = 1.0  # at most one demand write per (pool, space) per worker per this
DEMAND_KEYS = 1024  # past this many remembered writes, the stale ones are forgotten


class PoolRouter:
    """Where a worker sends a request for a space of another pool than its host's.

    Every database call runs on the fleet's threads (`db_limiter`), never on the event
    loop nor the host's import threads, and fails within the database's timeout; the
    hosts' table is read at most once per HOSTS_TTL_S whatever the burst (one lookup at
    a time, the others wait for its answer), and an unreachable database is remembered
    as long.
    """

    def __init__(
        self,
        db: FleetDB,
        live_s: float,
        retry_after_s: int,
        db_limiter: anyio.CapacityLimiter | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.live_s = live_s
        self.retry_after_s = retry_after_s  # what a 503 tells its caller to wait
        self.db_limiter = db_limiter
        self.clock = clock
        self._lock = asyncio.Lock()
        # (when it expires, each pool's live hosts' URLs, or None: the database is away)
        self._hosts: tuple[float, dict[str, list[str]] | None] | None = None
        self._demanded: dict[tuple[str, str], float] = {}

    async def host_of(self, pool: str) -> str | None:
        """The URL of a live host of `pool` (one at random, so a burst spreads over
        them), or None when it has none. Raises Unreachable when the database is away."""
        urls = (await self._live()).get(pool)
        return random.choice(urls) if urls else None

    async def _live(self) -> dict[str, list[str]]:
        async with self._lock:
            if self._hosts is None or self.clock() >= self._hosts[0]:
                found: dict[str, list[str]] = {}
                try:
                    for host in await self._run(self.db.hosts, self.live_s):
                        if host["live"]:
                            found.setdefault(host["pool"], []).append(host["url"])
                    self._hosts = (self.clock() + HOSTS_TTL_S, found)
                except Unreachable:
                    self._hosts = (self.clock() + HOSTS_TTL_S, None)
            live = self._hosts[1]
        if live is None:
            raise Unreachable()  # a fresh one: a kept exception would grow its traceback
        return live

    async def demand(self, pool: str, space: str) -> None:
        """Record that a request for `space` found no live host of `pool`, at most once
        per DEMAND_EVERY_S: the autoscaler reads demand, not a count of requests."""
        key, now = (pool, space), self.clock()
        if now - self._demanded.get(key, float("-inf")) < DEMAND_EVERY_S:
            return
        if len(self._demanded) >= DEMAND_KEYS:
            stale = [k for k, at in self._demanded.items() if now - at >= DEMAND_EVERY_S]
            for k in stale:
                del self._demanded[k]
        self._demanded[key] = now  # before the write: a burst waits for none
        try:
            await self._run(self.db.record_demand, pool, space)
        except BaseException:
            self._demanded.pop(key, None)  # not recorded: the next request tries again
            raise

    async def _run(self, func: Callable[..., _T], *args: object) -> _T:
        return await threaded(self.db_limiter, self.db.timeout_s, func, *args)
