"""A GPU worker's device memory: what each load added, a cap that releases the least
recently used idle GPU spaces, and the recycle when a release does not give it back.

The figure is NVML's for this worker's process (polyserve.devices.process_memory): its
CUDA context, opened at boot (polyserve.serve.warmup), plus what its spaces' sessions
and frameworks hold. It is read only around loads and after collections, never on a
warm request. Frameworks keep pools of device memory past the end of what used them
(torch's cache is emptied after each collection here; onnxruntime's arenas go with
their sessions); where the figure still stays up once the worker holds no GPU space,
only ending the process gives the memory back: the worker then asks gunicorn to
recycle it, as `max_requests` does, and its spaces load again on demand in its
replacement, which gets the same GPU.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import weakref
from collections.abc import Callable

from polyserve import devices
from polyserve.serve import gpu
from polyserve.serve.held import COLLECT_INTERVAL_S, Active, Held
from polyserve.serve.memcap import NO_ROOM_RETRY_S, NoRoom
from polyserve.usage.meter import Cell, Meter

log = logging.getLogger("polyserve")

# Holding no GPU space, the worker is recycled when its device memory is this share
# above what it held at boot (the goal: back within 5% of the baseline).
RECYCLE_SLACK = 0.05
RECHECKS = 10  # collections (about a second apart) a released version may outlive


class DeviceNoRoom(NoRoom):
    """A load would take the worker over its device memory cap even with every idle GPU
    space released: answered 503 with Retry-After, as the memory cap's refusal."""

    def __init__(self, space: str, memory: int, cap: int) -> None:
        Exception.__init__(
            self,
            f"space {space} does not fit in this worker's device memory now: it is at"
            f" {memory >> 20} MiB of its {cap >> 20} MiB cap (POLYSERVE_WORKER_GPU_MEMORY_MB),"
            f" and no idle space holds device memory to release; retry in {NO_ROOM_RETRY_S} s",
        )
        self.space = space


def recycle_worker() -> None:
    """End this worker gracefully (gunicorn's SIGTERM: it answers what it accepted), as
    max_requests does; the master forks its replacement on the same GPU."""
    os.kill(os.getpid(), signal.SIGTERM)


class DeviceMemory:
    """One GPU worker's device memory, measured around loads and bounded by `limit`
    bytes (0: no cap)."""

    def __init__(
        self,
        held: Held,
        meter: Meter,
        awaited: Callable[[str], bool],
        limit: int = 0,
        read: Callable[[], int | None] | None = None,
        recycle: Callable[[], None] = recycle_worker,
    ) -> None:
        self.held = held
        self.meter = meter
        self.awaited = awaited
        self.limit = limit
        index = devices.assigned()
        self.read = read or (lambda: devices.process_memory(index if index is not None else 0))
        self.recycle = recycle
        self.sizes: dict[str, int] = {}  # what each space's last load added, in bytes
        # The GPU spaces loaded since the last check: their slots, and their versions
        # (weakly: what a release frees is back only once the version is collected).
        self._slots: dict[str, int] = {}
        self._versions: dict[str, weakref.ref[Active]] = {}
        self.baseline: int | None = None  # the worker's, holding no GPU space
        self.loading: set[str] = set()  # loads between admit and their switch (or failure)
        self.recycling = False
        self.recycles = 0
        self._rechecks = 0  # collections waited for a released version to be collected

    def memory(self) -> int:
        return self.read() or 0

    def _holding(self) -> bool:
        return any(self.sizes.get(name, 0) > 0 for name in self.held.active)

    async def admit(self, space: str) -> int:
        """Before a load's import: room for what the space took last time; returns the
        figure its measure starts from."""
        if self.baseline is None and not self._holding() and not self.loading:
            self.baseline = self.memory()
        self.loading.add(space)
        if self.limit:
            await self._make_room(space, self.sizes.get(space, 0))
        return self.memory()

    def done(self, space: str) -> None:
        """The load admitted has switched, or failed: it no longer holds recycles back."""
        self.loading.discard(space)

    def added(self, space: str, slot: int, before: int) -> int:
        """After the import: what the load added (its estimate next time)."""
        grew = max(self.memory() - before, 0)
        self.sizes[space] = grew
        if grew:
            self._slots[space] = slot
        return grew

    def track(self, space: str, active: Active) -> None:
        """The version a load that added device memory made (see collected)."""
        if space in self._slots:
            self._versions[space] = weakref.ref(active)

    async def fit(self, space: str) -> None:
        """After the import: room for what the load took, releasing other idle GPU spaces
        least recently used first; DeviceNoRoom if it alone is over the cap."""
        if self.limit:
            await self._make_room(space, 0)

    async def _make_room(self, space: str, need: int) -> None:
        while (memory := self.memory()) + need > self.limit:
            # Its own old version too (a swap's: no request can lease it any more), but
            # no other space a request waits for.
            idle = [
                a
                for name, a in self.held.active.items()
                if a.inflight == 0
                and self.sizes.get(name, 0) > 0
                and (name == space or not self.awaited(name))
            ]
            if not idle:
                raise DeviceNoRoom(space, memory, self.limit)
            oldest = min(idle, key=lambda a: (a.key != space, a.last_used))
            if oldest.key != space:  # a swap is not a release
                self.meter.count_release(oldest.slot, Cell.RELEASED_MEMORY)
            dropping = self.held.retire(oldest)
            del oldest, idle  # a reference here would keep it from the collection
            await self.held.collect_after([dropping] if dropping is not None else [])

    def collected(self) -> None:
        """After each collection of dropped spaces: torch's cache back to the driver,
        then, holding no GPU space, the recycle if the device memory stayed up."""
        gpu.empty_cache()
        if self.recycling or self.baseline is None or self._holding() or self.loading:
            return  # a load's memory, or a space's, is not memory left behind
        released = {s: n for s, n in self._slots.items() if s not in self.held.active}
        if not released:
            return
        alive = any((r := self._versions.get(s)) is not None and r() is not None for s in released)
        if alive and self._rechecks < RECHECKS:
            # Still referenced (the reaper's list of what it let go, a request's frame):
            # its memory is not free yet. Look again at a later collection; one kept
            # past RECHECKS of them is memory only the recycle gives back.
            self._rechecks += 1
            asyncio.get_running_loop().call_later(COLLECT_INTERVAL_S, self.held.collect_later)
            return
        self._rechecks = 0
        self._slots.clear()
        self._versions.clear()
        now = self.memory()
        if now <= self.baseline * (1 + RECYCLE_SLACK):
            return
        self.recycling = True
        self.recycles += 1
        for slot in released.values():
            self.meter.count_release(slot, Cell.RECYCLED)
        log.warning(
            "device memory stayed at %d MiB after releasing %s (%d MiB at boot): recycling"
            " this worker to give it back",
            now >> 20,
            ", ".join(released),
            self.baseline >> 20,
        )
        self.recycle()
