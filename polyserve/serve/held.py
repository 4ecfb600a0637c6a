"""The versions a worker holds: each one's record, the holds that keep its files from
being pruned, and how a version is let go (retired, drained, stopped, collected)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.to_thread

from polyserve.serve import heap, loader
from polyserve.state import budget
from polyserve.state.broadcast import Broadcast
from polyserve.state.store import Store, Version
from polyserve.usage.meter import Meter

COLLECT_INTERVAL_S = 1.0


@dataclass(eq=False)
class Active:
    """One version this worker holds: the one serving, or a retired one still draining.
    `key` is its name in the map of what serves: the space's for its current version, and
    `owner/name@N` for kept version N called by name (polyserve/serve/registry.py)."""

    imported: loader.Imported
    version: Version
    slot: int
    generation: int  # the space's generation word when this was found current (or kept)
    releases: int  # the space's release word when this was loaded
    last_used: float
    inflight: int = 0
    retired: bool = False
    key: str = ""  # "": the space's name
    label: str = field(init=False)  # the version's number as a URL names it, `@N`
    # Keep drop tasks referenced until they finish (asyncio holds tasks only weakly).
    _dropping: asyncio.Task[None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.imported.space
        self.label = str(self.version.number)


class Held:
    """The versions this worker holds, by space, and the path by which each is let go."""

    def __init__(
        self,
        store: Store,
        broadcast: Broadcast,
        meter: Meter,
        start_timeout: float,
        host_limiter: anyio.CapacityLimiter | None = None,
    ) -> None:
        self.store = store
        self.broadcast = broadcast
        self.meter = meter
        self.start_timeout = start_timeout  # a version's lifespan startup, and its shutdown
        self.host_limiter = host_limiter
        # The version serving each space, and each kept version called by name (its key
        # `owner/name@N`).
        self.active: dict[str, Active] = {}
        # Told before memory may be freed under the loads being measured (MemoryCap).
        self.freeing: Callable[[], None] = lambda: None
        # Told after each collection (a GPU worker's device memory: polyserve.serve.devcap).
        self.collected: Callable[[], None] = lambda: None
        # Version numbers held per space (draining and loading ones included); the
        # oldest of each slot is written in the shared table (Broadcast.hold).
        self._held: dict[str, list[int]] = {}
        self._slot: dict[str, int] = {}  # the slot each space's holds are in
        heap.settle()  # what a collection frees must leave the RSS, whoever allocated it
        self._collect_at: asyncio.TimerHandle | None = None
        self._collected = 0.0  # loop time of the last collection
        self._trimming: asyncio.Task[None] | None = None  # a disk budget's pass (trim_soon)

    # -- the holds --------------------------------------------------------------------

    def current(self, space: str, slot: int) -> Version | None:
        """The current version, held (Broadcast.hold) before any of its files is read.
        Held, then read again: a version still current after the hold is visible can no
        longer be pruned, since pruning reads the holds after it moves `current`."""
        version = self.store.current(space)
        while version is not None:
            self._hold(space, slot, version.number)
            again = self.store.current(space)
            if again == version:
                return version
            self.unhold(space, slot, version.number)
            version = again
        return None

    async def kept(self, space: str, slot: int, number: int) -> Version | None:
        """Kept version `number`, held before any of its files is read; None when the
        space is not deployed or does not keep it. Read again under the store lock,
        which every prune holds while it reads the holds and removes files: a version
        found there after the hold stays."""
        if self.store.meta(space, number) is None:  # an unknown version takes no lock
            return None
        self._hold(space, slot, number)
        version = await anyio.to_thread.run_sync(
            self._kept_locked, space, number, limiter=self.host_limiter
        )
        if version is None:
            self.unhold(space, slot, number)
        return version

    def _kept_locked(self, space: str, number: int) -> Version | None:
        with self.store.locked():
            if self.store.current(space) is None:  # deleted: its versions go too
                return None
            return self.store.version(space, number)

    def _hold(self, space: str, slot: int, number: int) -> None:
        held = self._held.setdefault(space, [])
        held.append(number)
        self._slot[space] = slot
        self._write_hold(slot)

    def unhold(self, space: str, slot: int, number: int) -> None:
        held = self._held[space]
        if held == [number] and not self._others_in(space, slot):
            # The last version held: this ends the stretch (a swap keeps it going; one
            # whose old version went first, then failed, ends it here). Folded before
            # the hold is dropped: a slot nobody holds may be handed to another space.
            self.meter.released(slot)
        held.remove(number)
        if not held:
            del self._held[space], self._slot[space]
        self._write_hold(slot)

    def _others_in(self, space: str, slot: int) -> bool:
        return any(s != space and at == slot for s, at in self._slot.items())

    def _write_hold(self, slot: int) -> None:
        """The oldest version this worker holds in the slot, into the table. Two spaces
        share a slot here only for a moment: a fleet host's slot handed over while this
        worker held its old owner's version, which the load then lets go (Loads._load)."""
        oldest = [min(self._held[s]) for s, at in self._slot.items() if at == slot]
        self.broadcast.hold(slot, min(oldest, default=0))

    # -- letting a version go -----------------------------------------------------------

    def retire(self, active: Active) -> asyncio.Task[None] | None:
        """Stop serving `active`; its drop task if it was dropped at once (idle)."""
        self.freeing()  # what it frees would make the loads being measured look smaller
        if self.active.get(active.key) is active:
            del self.active[active.key]
        active.retired = True
        if active.inflight == 0:
            self.drop(active)
        return active._dropping

    def drop(self, active: Active) -> None:
        if active._dropping is not None:
            return
        space = active.imported.space
        self.unhold(space, active.slot, active.version.number)
        active._dropping = asyncio.create_task(self._stop(active))

    async def _stop(self, active: Active) -> None:
        await loader.stop(active.imported, self.start_timeout)
        # The version may have been the last thing keeping older ones on disk. (Not the
        # Active itself to the thread: an idle worker thread keeps its last arguments.)
        space, slot = active.imported.space, active.slot
        await anyio.to_thread.run_sync(self._prune, space, slot, limiter=self.host_limiter)
        self._collect_soon()  # last: until this task ends, it holds the version

    def _prune(self, space: str, slot: int) -> None:
        with self.store.locked():
            self.store.prune(space, self.broadcast.oldest_held(slot))
        self.trim()  # what it held may be what stood over the disk budget

    def trim(self) -> None:
        """Under a disk budget (a fleet host's), remove the cold versions' files past it.
        On a thread: it lists the data directory."""
        if self.store.disk_budget:
            budget.trim(self.store, self.broadcast, self.store.disk_budget)

    def trim_soon(self) -> None:
        """After a fetch added files: a disk budget's pass, off the request's path (its
        listing grows with the spaces this host knows); none while one is under way."""
        if self.store.disk_budget and self._trimming is None:
            self._trimming = asyncio.create_task(self._trim())

    async def _trim(self) -> None:
        try:
            await anyio.to_thread.run_sync(self.trim, limiter=self.host_limiter)
        finally:
            self._trimming = None

    @staticmethod
    async def wait_dropped(actives: list[Active]) -> None:
        tasks = [a._dropping for a in actives if a._dropping is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- the heap's collection ------------------------------------------------------------

    @property
    def collect_pending(self) -> bool:
        """Whether drops wait for a collection: their memory is not back yet."""
        return self._collect_at is not None

    def collect_later(self) -> None:
        """A collection soon (at most one a second), for what waits on one to decide."""
        self._collect_soon()

    def _collect_soon(self) -> None:
        """A dropped version's modules are reference cycles (functions hold their module's
        globals), which only the cycle collector frees: run it after drops, at most once a
        second, from the loop rather than in a request's path."""
        if self._collect_at is not None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._collected + COLLECT_INTERVAL_S - loop.time())
        self._collect_at = loop.call_later(delay, self._collect)

    async def collect_after(self, dropping: list[asyncio.Task[None]]) -> None:
        """Wait for dropped spaces to stop, then collect at once: freed memory leaves the
        RSS only after the cycle collector and malloc_trim, and the cap reads the RSS."""
        if dropping:
            await asyncio.gather(*dropping, return_exceptions=True)
        if self._collect_at is not None:
            self._collect_at.cancel()
        self._collect()

    def _collect(self) -> None:
        self._collect_at = None
        self.freeing()
        heap.collect()  # so that RSS falls too
        self._collected = asyncio.get_running_loop().time()
        self.collected()

    def cancel_collection(self) -> None:
        """At shutdown: no collection is left pending on the loop."""
        if self._collect_at is not None:
            self._collect_at.cancel()
            self._collect_at = None
