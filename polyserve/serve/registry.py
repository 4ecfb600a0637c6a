"""The per-worker registry: which version of a space serves a request, loaded on demand
and swapped when a deploy moves the space's generation, and the idle release."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import anyio

from polyserve.serve import loader
from polyserve.serve.devcap import DeviceMemory, recycle_worker
from polyserve.serve.held import Active, Held
from polyserve.serve.loading import Loads, NotDeployed, NotKept, OtherPool, callable_versions
from polyserve.serve.memcap import ROOM_WAIT_S, MemoryCap, NoRoom
from polyserve.state.broadcast import Broadcast
from polyserve.state.store import Store, Version
from polyserve.usage.meter import Cell, Meter, anon_bytes

# What a caller of the registry catches, with the record of a leased version.
__all__ = ["Active", "NoRoom", "NotDeployed", "NotKept", "OtherPool", "Registry"]


class Registry:
    """One worker's spaces: `held` the versions it holds, `loads` the loads under way,
    `cap` its memory cap (memory_cap bytes of anonymous RSS, 0: none)."""

    def __init__(
        self,
        store: Store,
        broadcast: Broadcast,
        meter: Meter,
        idle_ttl: float,
        start_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        space_threads: int = loader.DEFAULT_THREADS,
        host_limiter: anyio.CapacityLimiter | None = None,
        fetch: Callable[[Version], Awaitable[None]] | None = None,
        pool: str | None = None,
        memory_cap: int = 0,
        memory: Callable[[], int] = anon_bytes,
        room_wait_s: float = ROOM_WAIT_S,
        device_cap: int | None = None,
        device_memory: Callable[[], int | None] | None = None,
        recycle: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.broadcast = broadcast
        self.meter = meter
        self.idle_ttl = idle_ttl
        self.clock = clock
        self.held = Held(store, broadcast, meter, start_timeout, host_limiter)
        self.active = self.held.active  # the version serving each space
        # The requests waiting for a load, which keep the space they wait for from being
        # released for room before they lease it.
        self._waiting: dict[str, int] = {}
        self.cap = MemoryCap(self.held, meter, self._awaited, memory_cap, memory, room_wait_s)
        # What a release frees would make the loads being measured look smaller.
        self.held.freeing = self.cap.estimates.disturb
        # On a GPU worker (device_cap not None, 0 for no cap): its device memory.
        self.device: DeviceMemory | None = None
        if device_cap is not None:
            self.device = DeviceMemory(
                self.held,
                meter,
                self._awaited,
                device_cap,
                device_memory,
                recycle or recycle_worker,
            )
            self.held.collected = self.device.collected
        self.loads = Loads(
            self.held,
            self.cap,
            store,
            broadcast,
            meter,
            clock,
            space_threads,
            host_limiter,
            fetch,
            pool,
            self.device,
        )

    # -- the request path -----------------------------------------------------------

    def lease_current(self, space: str) -> Active | None:
        """lease() when it need not wait, the warm request (a call, not a coroutine):
        the version held is current. None otherwise."""
        active = self.active.get(space)
        if active is not None and active.generation == self.broadcast.generation(active.slot):
            active.inflight += 1
            return active
        return None

    async def lease(self, space: str) -> Active:
        """The version to serve this request with, leased until end_lease()."""
        while True:
            active = self.lease_current(space)
            if active is not None:
                return active
            await self._wait(space)  # stale or absent: wait for a load, and look again

    def lease_named(self, space: str, version: str) -> Active | None:
        """lease_version() when it need not wait, the warm request for `owner/name@N`:
        kept version N held under its key, else the current version when it is N (the
        same Active as a plain request's). None otherwise. A name costs one dict lookup
        more than lease_current (bench/NOTES.md, "A version by name")."""
        active = self.active.get(f"{space}@{version}")
        if active is None:
            active = self.active.get(space)
            if active is None or active.label != version:
                return None
        if active.generation == self.broadcast.generation(active.slot):
            active.inflight += 1
            return active
        return None

    async def lease_version(self, space: str, version: str) -> Active:
        """Kept version `version` (as the URL gave it) to serve this request with, leased
        until end_lease(). Raises NotKept for a version the space does not keep."""
        if not (version.isascii() and version.isdigit()) or str(int(version)) != version:
            raise NotKept(space, version, callable_versions(self.store, space))
        key = f"{space}@{version}"
        while True:
            active = self.lease_named(space, version)
            if active is not None:
                return active
            # The current version is loaded as the space's own (no second import);
            # any other under its key, beside it.
            current = self.store.current(space)
            await self._wait(space if current and current.number == int(version) else key)

    async def _wait(self, key: str) -> None:
        task = self.loads.for_request(key)
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            await asyncio.shield(task)  # a caller that gives up must not cancel the load
        finally:
            if self._waiting[key] == 1:
                del self._waiting[key]
            else:
                self._waiting[key] -= 1

    def end_lease(self, active: Active) -> None:
        active.inflight -= 1
        active.last_used = self.clock()  # the idle clock starts when a request ends
        if active.retired and active.inflight == 0:
            self.held.drop(active)

    def slot_of(self, space: str) -> int | None:
        """The space's slot, if this worker has looked it up (for `owner/name@N` too)."""
        return self.loads.slots.get(space)

    def _awaited(self, space: str) -> bool:
        """Whether the memory cap must not release the space: loading, or waited for."""
        return space in self.loads.tasks or space in self._waiting

    # -- broadcast signal and idle release ------------------------------------------------

    def refresh(self) -> None:
        """On the broadcast signal: drop every held space released on demand, and start
        loading every other one whose generation moved, so a swap happens before the
        next request asks for it."""
        for space, active in list(self.active.items()):
            slot = self.loads.slots[space]
            generation = self.broadcast.generation(slot)
            if generation == active.generation or space in self.loads.tasks:
                continue
            if self.broadcast.releases(slot) != active.releases:
                # Released on demand: the next request imports it.
                self.meter.count_release(slot, Cell.RELEASED_DEMAND)
                self.held.retire(active)
            else:
                # A failure is logged; the next request retries and reports it.
                self.loads.start(space, slot, generation)

    async def reap(self) -> list[str]:
        """Release every space idle for idle_ttl; returns their keys once dropped (a
        kept version by name: `owner/name@N`)."""
        now = self.clock()
        idle = [
            a
            for a in self.active.values()
            if a.inflight == 0 and now - a.last_used >= self.idle_ttl
        ]
        for active in idle:
            self.meter.count_release(active.slot, Cell.RELEASED_IDLE)
            self.held.retire(active)
        await self.held.wait_dropped(idle)
        return [a.key for a in idle]

    async def reaper(self) -> None:
        """Run reap() forever, often enough that a space outlives its TTL by at most 25%."""
        interval = min(max(self.idle_ttl / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            await self.reap()

    async def close(self) -> None:
        """Worker shutdown: release everything, running each app's lifespan shutdown."""
        for task in list(self.loads.tasks.values()):
            task.cancel()
        held = list(self.active.values())
        for active in held:
            self.held.retire(active)
        await self.held.wait_dropped(held)
        self.held.cancel_collection()
