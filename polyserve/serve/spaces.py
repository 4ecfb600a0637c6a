"""The per-worker registry: load spaces on demand, hot swap, drain in-flight, release (idle
TTL, least recently used under the worker's memory cap, on demand)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio.to_thread

from polyserve.errors import ClientError
from polyserve.names import parse_space
from polyserve.serve import heap, loader
from polyserve.state.broadcast import Broadcast
from polyserve.state.store import Store, Version
from polyserve.usage.meter import Cell, Meter, anon_bytes

log = logging.getLogger("polyserve")
COLLECT_INTERVAL_S = 1.0
# Evicting for memory frees down to this much below the cap, so that the synchronous
# collection it needs runs once per few loads rather than at every one.
HEADROOM = 0.05
NO_ROOM_RETRY_S = 1  # a busy space's requests end soon; then its memory can be let go
# A load short of room waits this long for other spaces' requests to end (their ends are
# not signalled: end_lease is the warm path), checking every ROOM_POLL_S.
ROOM_WAIT_S = 1.0
ROOM_POLL_S = 0.01
# What a load's memory is measured beside: nothing, spaces held, or a disturbance
# (another load, or a space released meanwhile, whose memory lands in the measure).
ALONE, BESIDE_SPACES, DISTURBED = 0, 1, 2


class NotDeployed(Exception):
    """No version of this space is published (never deployed, deleted, or a bad name)."""


class OtherPool(Exception):
    """The space's current version runs in another pool than this fleet host's: it is
    neither imported nor fetched here."""

    def __init__(self, space: str, pool: str, host_pool: str) -> None:
        super().__init__(f"{space} runs in pool {pool}, this host in pool {host_pool}")
        self.space = space
        self.pool = pool
        self.host_pool = host_pool


class NoRoom(Exception):
    """A load would take the worker over its memory cap even with every idle space
    released and the heap collected; `why` says what holds the memory (other spaces'
    requests, its own draining old version, other loads, or the space itself)."""

    def __init__(self, space: str, memory: int, cap: int, why: str) -> None:
        super().__init__(
            f"space {space} does not fit in this worker's memory now: it is at"
            f" {memory >> 20} MiB of its {cap >> 20} MiB cap (POLYSERVE_WORKER_MEMORY_MB), {why}"
        )
        self.space = space


@dataclass(eq=False)
class Active:
    """One version this worker holds: the one serving, or a retired one still draining."""

    imported: loader.Imported
    version: Version
    slot: int
    generation: int  # the space's generation word when this was found current
    releases: int  # the space's release word when this was loaded
    last_used: float
    inflight: int = 0
    retired: bool = False
    # Keep drop tasks referenced until they finish (asyncio holds tasks only weakly).
    _dropping: asyncio.Task[None] | None = field(default=None, repr=False)


class Registry:
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
    ) -> None:
        self.store = store
        self.broadcast = broadcast
        self.meter = meter
        self.idle_ttl = idle_ttl
        self.start_timeout = start_timeout
        self.clock = clock
        self.space_threads = space_threads
        # Imports run on threads no tenant's sync handlers can take (see HandleApp).
        self.host_limiter = host_limiter
        # In a fleet: put a version's files in place, for one this host knows only by
        # its pointer (a host that joined, or caught up far behind, fetches on first use),
        # on the fleet's threads: a stalled database holds none of the import threads.
        self.fetch = fetch
        # In a fleet, the only pool whose spaces this worker imports; None (a single
        # host) imports every space whatever its pool.
        self.pool = pool
        # Bytes of anonymous RSS this worker keeps under (0: no cap), and how it reads
        # them: only around loads, never on a warm request. Anonymous, because without
        # swap that is what runs a host out of memory: file-backed pages (libraries, a
        # model mapped from its file, shared by every worker) the kernel can drop.
        self.memory_cap = memory_cap
        self.memory = memory
        heap.settle()  # what a collection frees must leave the RSS, whoever allocated it
        # What each space's last measured load added: the estimate of its next one,
        # with what it was measured beside. Certain only when measured alone (else the
        # measure may include other spaces' memory): only a certain estimate refuses a
        # load on its own. A load disturbed by another, or by a release, measures both,
        # or misses its own memory behind what was freed: it replaces only an estimate
        # as disturbed, and refuses nothing.
        self._sizes: dict[str, int] = {}
        self._beside: dict[str, int] = {}
        # Loads being measured, each with what it is measured beside; and each load's
        # measure until its check is done, for what a refusal says.
        self._measuring: dict[str, int] = {}
        self._measured: dict[str, tuple[int, int]] = {}
        # Loads let in that are importing, with the memory they are expected to add (not
        # yet in the measure); loads imported and being checked against the cap; the
        # requests waiting for a load, which keep the space they wait for from being
        # released before they lease it. One room check at a time: two evicting at once
        # would each release what the other's collection was about to free.
        self._reserved: dict[str, int] = {}
        self._checking: dict[str, int] = {}  # each with its turn: the later decides first
        self._turns = itertools.count(1)
        self._waiting: dict[str, int] = {}
        self._room: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        # The least memory measured holding nothing: the worker's own, as far as it knows.
        self._floor: int | None = None
        self.room_wait_s = room_wait_s
        # Another pool's spaces, with the generation at which that was found: until the
        # word moves (a deploy or a delete), a request for one is sent elsewhere at once.
        self._other_pool: dict[str, tuple[int, str]] = {}
        self._collect_at: asyncio.TimerHandle | None = None
        self._collected = 0.0  # loop time of the last collection
        self.active: dict[str, Active] = {}
        # A slot changes only when a deleted space's slot is handed over; a load
        # checks, and every hand-over bumps the slot's generation, which forces one.
        self._slots: dict[str, int] = {}
        self._loading: dict[str, asyncio.Task[Active]] = {}
        # Version numbers held per space (draining and loading ones included); the
        # oldest is published in the shared table (Broadcast.hold).
        self._held: dict[str, list[int]] = {}

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
            slot = self._slots.get(space)
            if slot is None:
                slot = self._find_slot(space)
            generation = self.broadcast.generation(slot)
            other = self._other_pool.get(space)
            if other is not None and other[0] == generation and self.pool is not None:
                raise OtherPool(space, other[1], self.pool)
            # Stale or absent. A load started for an older generation may finish with
            # an older version, so wait for it and look again rather than trust it.
            task = self._loading.get(space) or self._start_load(space, slot, generation)
            self._waiting[space] = self._waiting.get(space, 0) + 1
            try:
                await asyncio.shield(task)  # a caller that gives up must not cancel the load
            finally:
                if self._waiting[space] == 1:
                    del self._waiting[space]
                else:
                    self._waiting[space] -= 1

    def end_lease(self, active: Active) -> None:
        active.inflight -= 1
        active.last_used = self.clock()  # the idle clock starts when a request ends
        if active.retired and active.inflight == 0:
            self._drop(active)

    def slot_of(self, space: str) -> int | None:
        return self._slots.get(space)

    def _find_slot(self, space: str) -> int:
        try:
            parse_space(space)
        except ClientError:
            raise NotDeployed(space) from None
        slot = self.store.slots.slot(space)
        if slot is None:
            raise NotDeployed(space)
        if slot >= self.broadcast.table.space_slots:
            raise loader.LoadError(
                f"space slot {slot} is outside the shared table: raise POLYSERVE_MAX_SPACES"
            )
        self._slots[space] = slot
        return slot

    # -- loading and swapping ---------------------------------------------------------

    def _start_load(self, space: str, slot: int, generation: int) -> asyncio.Task[Active]:
        """Load once per space at a time, however many requests and signals ask for it."""
        task = asyncio.create_task(self._load_once(space, slot, generation))
        self._loading[space] = task
        # A load started by refresh() may have no awaiter: mark its error as seen (it is
        # logged in _load_once) so asyncio does not report it again at collection.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _load_once(self, space: str, slot: int, generation: int) -> Active:
        try:
            return await self._load(space, slot, generation)
        except (loader.LoadError, NoRoom) as exc:
            log.warning("loading %s failed: %s", space, exc)
            raise
        finally:
            # Unregister before the task is done: a done task left in _loading would
            # let lease() await it without yielding, in a loop that never ends.
            del self._loading[space]

    async def _load(self, space: str, slot: int, generation: int) -> Active:
        current = self.active.get(space)
        self.store.slots.refresh()
        if self.store.slots.slot(space) != slot:  # the space was deleted and its slot handed over
            if current is not None:
                self._retire(current)
            self._slots.pop(space, None)  # lease() looks it up again
            slot = self._find_slot(space)
            generation = self.broadcast.generation(slot)
        version = self._hold_current(space, slot)
        if version is None:
            if current is not None:
                self._retire(current)
            raise NotDeployed(space)
        if self.pool is not None and version.pool != self.pool:
            # Checked on the cold path only: a loaded space costs its requests nothing.
            self._unhold(space, slot, version.number)
            if current is not None:  # redeployed into another pool
                self._retire(current)
            self._other_pool[space] = (generation, version.pool)
            raise OtherPool(space, version.pool, self.pool)
        releases = self.broadcast.releases(slot)
        if current is not None and current.version == version and current.releases == releases:
            self._unhold(space, slot, version.number)  # the Active holds it already
            current.generation = generation  # a bump that did not change the version
            return current
        if current is not None and current.releases != releases:
            # Released on demand while this worker missed the signal: re-imported below.
            self.meter.evicted(slot, Cell.EVICTED_DEMAND)
        # Not kept across the awaits: a stale version held by this frame could not be
        # collected when it is dropped for room. It serves nobody new (lease checks the
        # generation); it is retired at the switch, or before, by _make_room.
        del current
        memory_before = 0
        try:
            if self.memory_cap:
                await self._make_room(space, self._sizes.get(space, 0), imported=False)
                memory_before = self.memory()
                self._measure(space)
            # Taken after making room: other tenants' shutdowns are not this load's time.
            started, started_us, anon_before = self.clock(), self.meter.clock(), anon_bytes()
            if not version.dir.is_dir():
                await self._fetch(version)
            imported = await anyio.to_thread.run_sync(
                loader.import_version,
                space,
                version.number,
                version.dir,
                version.entry,
                self.space_threads,
                version.deps,
                limiter=self.host_limiter,
            )
            await loader.start(imported, self.start_timeout)
        except BaseException:
            self._measuring.pop(space, None)
            self._reserved.pop(space, None)
            self._unhold(space, slot, version.number)
            raise
        # Memory the load added: approximate when other work runs at the same time.
        self.meter.loaded(slot, started_us, anon_bytes() - anon_before)
        if self.memory_cap:
            beside = self._measuring.pop(space)
            added = max(self.memory() - memory_before, 0)
            self._measured[space] = (added, beside)
            if beside < DISTURBED or self._beside.get(space, DISTURBED) == DISTURBED:
                self._sizes[space], self._beside[space] = added, beside
            self._reserved.pop(space, None)  # what it added is in the measure now
        now = self.clock()
        active = Active(imported, version, slot, generation, releases, last_used=now)
        if self.memory_cap:
            # Checked before the switch, so that no request leases a version that may be
            # refused: until then they wait for this load.
            self._checking[space] = next(self._turns)
            try:  # the estimate was only that: the load may have taken more
                await self._make_room(space, 0, imported=True)
            except BaseException:
                dropping = [self._retire(active)]  # never leased: dropped at once
                del active, imported  # nothing may keep them from the collection
                await self._collect_after([t for t in dropping if t is not None])
                raise
            finally:
                del self._checking[space]
                self._measured.pop(space, None)
        # The switch: from here on new requests get the new version.
        current = self.active.get(space)  # not if the reaper or _make_room retired it
        self.active[space] = active
        if current is not None:
            self._retire(current)
        log.info(
            "loaded %s v%d (%s) in %.1f ms",
            space,
            version.number,
            imported.kind,
            (now - started) * 1000,
        )
        return active

    def _measure(self, space: str) -> None:
        """Start measuring a load: beside the spaces held; it and every load it overlaps
        are disturbed."""
        others = bool(self._measuring)
        self._disturb()
        spaces = any(name != space for name in self.active)
        self._measuring[space] = DISTURBED if others else BESIDE_SPACES if spaces else ALONE

    def _disturb(self) -> None:
        for name in self._measuring:
            self._measuring[name] = DISTURBED

    async def _make_room(self, space: str, need: int, imported: bool) -> None:
        """Room for `space` under the cap: memory, plus what the loads let in are still
        to import, plus `need`. Before the import `need` is the estimate, and the load
        is let in with it; after, the load's memory is in the measure and `need` is 0.

        Short of room, it first collects a heap with drops not yet collected, then
        releases the space's own old version if idle (a swap's: no request can lease it
        any more), then the least recently used idle spaces (never one loading, in
        flight or waited for) down to HEADROOM under the cap, and collects. Then it
        waits for what will free memory: the loads let in (after its own import, only
        those still importing, and those checked after it, which decide first: so no
        two loads wait for each other), up to start_timeout after the last of them
        ended, and other spaces' requests, up to room_wait_s. NoRoom when they do not
        let it go in time, or there is nothing to wait for; before the import, only if
        memory alone is over the cap or the estimate can be trusted (else it imports
        and sees)."""
        cap = self.memory_cap
        collected = False
        busy_since: float | None = None
        waited_for: set[str] = set()
        loads_since = 0.0
        loop = asyncio.get_running_loop()
        while True:
            async with self._room_lock():
                memory = self.memory()
                if not (imported or self.active or self._reserved or self._checking):
                    self._floor = memory if self._floor is None else min(self._floor, memory)
                coming = sum(n for name, n in self._reserved.items() if name != space)
                if memory + coming + need <= cap:
                    if not imported:
                        self._reserved[space] = need
                    return
                if self._collect_at is not None:  # drops whose memory is not back yet
                    await self._collect_after([])
                    continue
                dropping = self._release(space, memory + coming + need - int(cap * (1 - HEADROOM)))
                if dropping or not collected:
                    await self._collect_after(dropping)
                    collected = True
                    continue
            old = self.active.get(space)
            draining = old is not None and old.inflight > 0
            del old  # a reference here would keep a dropped version from the collection
            busy = [name for name in self.active if name != space]  # none of them idle
            checked = self._checking.get(space, 0)
            if imported:
                loads = [name for name in self._reserved if name != space]
                loads += [name for name, n in self._checking.items() if n > checked]
            else:
                loads = [*self._reserved, *self._checking]
            refusal: NoRoom | None = None
            waited = True  # what holds the room was waited for, and did not let it go
            if loads:
                # A load takes as long as its import may (a hung one must not hold
                # every other load back for ever), counted from the last that ended.
                if set(loads) != waited_for:
                    waited_for, loads_since = set(loads), loop.time()
                if loop.time() - loads_since >= self.start_timeout:
                    refusal = self._no_room(space, memory, imported, busy, draining, len(loads))
            elif busy or draining:
                busy_since = loop.time() if busy_since is None else busy_since
                if loop.time() - busy_since >= self.room_wait_s:
                    refusal = self._no_room(space, memory, imported, busy, draining, 0)
            else:
                others = len(self._checking) - (space in self._checking)  # checked before
                refusal = self._no_room(space, memory, imported, [], False, others)
                waited = False
            if refusal is not None:
                # An estimate refuses on its own only if measured alone; after a wait,
                # also one measured beside other spaces. Else it may be far off: import
                # and see, and let the check after the import refuse if need be.
                beside = self._beside.get(space, DISTURBED)
                trusted = beside == ALONE or (waited and beside == BESIDE_SPACES)
                if imported or memory > cap or trusted:
                    raise refusal
                self._reserved[space] = need
                return
            await asyncio.sleep(ROOM_POLL_S)

    def _no_room(
        self,
        space: str,
        memory: int,
        imported: bool,
        busy: list[str],
        draining: bool,
        loads: int,
    ) -> NoRoom:
        """NoRoom, saying what holds the memory that keeps the space out."""
        if imported and space in self._measured:
            size, beside = self._measured[space]
            took = f"this load added {size >> 20} MiB"
        elif space in self._sizes:
            size, beside = self._sizes[space], self._beside[space]
            took = f"the space's last measured load took {size >> 20} MiB"
        else:
            size, beside, took = 0, ALONE, "the space has not been measured here yet"
        if beside != ALONE:
            took += f", measured beside other {'spaces' if beside == BESIDE_SPACES else 'work'}"
        holding = [f"the {len(busy)} other spaces it holds have requests in flight"] if busy else []
        if draining:
            holding.append("its old version still has requests in flight (draining)")
        if loads:
            holding.append(f"{loads} other loads in flight take memory too")
        own = memory - (size if imported else 0)  # the worker's, without the space
        floor = own if self._floor is None else min(self._floor, own)
        if holding:
            why = f"{' and '.join(holding)}; retry in {NO_ROOM_RETRY_S} s"
        elif floor + size > self.memory_cap:
            why = "it holds no other space and loads none: this space alone takes it over the cap"
        else:
            why = (
                f"it holds no other space and loads none, yet memory no space holds keeps it"
                f" over the cap: {(own - floor) >> 20} MiB more than it had holding nothing"
            )
        return NoRoom(space, memory, self.memory_cap, f"{took}, and {why}")

    def floor(self) -> int | None:
        """The least memory this worker was measured at holding nothing, measured now if
        it holds nothing and was not yet (None: it holds spaces and was never empty)."""
        if self._floor is None and not (self.active or self._reserved or self._checking):
            self._floor = self.memory()
        return self._floor

    def _room_lock(self) -> asyncio.Lock:
        """The room check's lock, for the running loop (an asyncio lock is bound to one)."""
        loop = asyncio.get_running_loop()
        if self._room is None or self._room[0] is not loop:
            self._room = (loop, asyncio.Lock())
        return self._room[1]

    def _release(self, space: str, excess: int) -> list[asyncio.Task[None]]:
        """Drop tasks of what _make_room lets go: the space's own idle old version, else
        idle spaces (_evict)."""
        old = self.active.get(space)
        if old is not None and old.inflight == 0:
            dropping = [self._retire(old)]  # a swap: not an eviction, nor a release
        else:
            dropping = self._evict(space, excess)
        del old
        return [t for t in dropping if t is not None]

    def _evict(self, space: str, excess: int) -> list[asyncio.Task[None] | None]:
        """Retire idle spaces, least recently used first, as many as their last loads
        say it takes to free `excess` bytes (at least one: a size measured while other
        loads ran may be 0). Returns their drop tasks, not them: a reference left to a
        dropped space would keep its memory from the collection."""
        idle = [
            a
            for name, a in self.active.items()
            if a.inflight == 0
            and name != space
            and name not in self._loading
            and name not in self._waiting
        ]
        idle.sort(key=lambda a: a.last_used)
        dropping = []
        for active in idle:
            self.meter.evicted(active.slot, Cell.EVICTED_MEMORY)
            dropping.append(self._retire(active))
            excess -= self._sizes.get(active.imported.space, 0)
            if excess <= 0:
                break
        return dropping

    async def _collect_after(self, dropping: list[asyncio.Task[None]]) -> None:
        """Wait for dropped spaces to stop, then collect at once: freed memory leaves the
        RSS only after the cycle collector and malloc_trim, and the cap reads the RSS."""
        if dropping:
            await asyncio.gather(*dropping, return_exceptions=True)
        if self._collect_at is not None:
            self._collect_at.cancel()
        self._collect()

    async def _fetch(self, version: Version) -> None:
        if self.fetch is None:
            raise loader.LoadError(
                f"the files of {version.space} v{version.number} are missing from the data"
                " directory"
            )
        try:
            await self.fetch(version)
        except ClientError as exc:
            raise loader.LoadError(exc.error) from exc

    def _hold_current(self, space: str, slot: int) -> Version | None:
        """The current version, held (Broadcast.hold) before any of its files is read.
        Held, then read again: a version still current after the hold is visible can no
        longer be pruned, since pruning reads the holds after it moves `current`."""
        version = self.store.current(space)
        while version is not None:
            self._hold(space, slot, version.number)
            again = self.store.current(space)
            if again == version:
                return version
            self._unhold(space, slot, version.number)
            version = again
        return None

    def _hold(self, space: str, slot: int, number: int) -> None:
        held = self._held.setdefault(space, [])
        held.append(number)
        self.broadcast.hold(slot, min(held))

    def _unhold(self, space: str, slot: int, number: int) -> None:
        held = self._held[space]
        if held == [number]:
            # The last version held: this ends the stretch (a swap keeps it going; one
            # whose old version went first, then failed, ends it here). Folded before
            # the hold is dropped: a slot nobody holds may be handed to another space.
            self.meter.released(slot)
        held.remove(number)
        if not held:
            del self._held[space]
        self.broadcast.hold(slot, min(held, default=0))

    def _retire(self, active: Active) -> asyncio.Task[None] | None:
        """Stop serving `active`; its drop task if it was dropped at once (idle)."""
        self._disturb()  # what it frees would make the loads being measured look smaller
        if self.active.get(active.imported.space) is active:
            del self.active[active.imported.space]
        active.retired = True
        if active.inflight == 0:
            self._drop(active)
        return active._dropping

    def _drop(self, active: Active) -> None:
        if active._dropping is not None:
            return
        space = active.imported.space
        self._unhold(space, active.slot, active.version.number)
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

    def _collect_soon(self) -> None:
        """A dropped version's modules are reference cycles (functions hold their module's
        globals), which only the cycle collector frees: run it after drops, at most once a
        second, from the loop rather than in a request's path."""
        if self._collect_at is not None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._collected + COLLECT_INTERVAL_S - loop.time())
        self._collect_at = loop.call_later(delay, self._collect)

    def _collect(self) -> None:
        self._collect_at = None
        self._disturb()
        heap.collect()  # so that RSS falls too
        self._collected = asyncio.get_running_loop().time()

    # -- broadcast signal and idle release ------------------------------------------------

    def refresh(self) -> None:
        """On the broadcast signal: drop every held space released on demand, and start
        loading every other one whose generation moved, so a swap happens before the
        next request asks for it."""
        for space, active in list(self.active.items()):
            slot = self._slots[space]
            generation = self.broadcast.generation(slot)
            if generation == active.generation or space in self._loading:
                continue
            if self.broadcast.releases(slot) != active.releases:
                # Released on demand: the next request imports it.
                self.meter.evicted(slot, Cell.EVICTED_DEMAND)
                self._retire(active)
            else:
                # A failure is logged; the next request retries and reports it.
                self._start_load(space, slot, generation)

    async def reap(self) -> list[str]:
        """Release every space idle for idle_ttl; returns their names once dropped."""
        now = self.clock()
        idle = [
            a
            for a in self.active.values()
            if a.inflight == 0 and now - a.last_used >= self.idle_ttl
        ]
        for active in idle:
            self.meter.evicted(active.slot, Cell.EVICTED_IDLE)
            self._retire(active)
        await self._wait_dropped(idle)
        return [a.imported.space for a in idle]

    async def reaper(self) -> None:
        """Run reap() forever, often enough that a space outlives its TTL by at most 25%."""
        interval = min(max(self.idle_ttl / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            await self.reap()

    async def close(self) -> None:
        """Worker shutdown: release everything, running each app's lifespan shutdown."""
        for task in list(self._loading.values()):
            task.cancel()
        held = list(self.active.values())
        for active in held:
            self._retire(active)
        await self._wait_dropped(held)
        if self._collect_at is not None:
            self._collect_at.cancel()
            self._collect_at = None

    @staticmethod
    async def _wait_dropped(actives: list[Active]) -> None:
        tasks = [a._dropping for a in actives if a._dropping is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
