"""Loading one version of a space at a time: which version, its files, its import on a
thread, its start, its room under the memory cap, and the switch to it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial

import anyio
import anyio.to_thread

from polyserve.errors import ClientError
from polyserve.names import parse_space
from polyserve.serve import heap, loader
from polyserve.serve.devcap import DeviceMemory
from polyserve.serve.held import Active, Held
from polyserve.serve.memcap import MemoryCap, NoRoom
from polyserve.state import budget, rollouts
from polyserve.state.apply import Changes
from polyserve.state.broadcast import Broadcast
from polyserve.state.layout import current_number
from polyserve.state.store import Store, Version
from polyserve.usage.meter import Cell, Meter, anon_bytes

log = logging.getLogger("polyserve")


class NotDeployed(Exception):
    """No version of this space is published (never deployed, deleted, or a bad name)."""


class TableFull(Exception):
    """A fleet host's first request for a space, with every slot of the table held by a
    space some worker has loaded: answered 503 with Retry-After, counted nowhere."""

    def __init__(self, space: str, slots: int) -> None:
        super().__init__(
            f"space {space} has no slot on this host: each of its table's {slots} slots"
            " (POLYSERVE_MAX_SPACES) is held by a space a worker has loaded; retry once one"
            " is released (POLYSERVE_IDLE_TTL), or raise POLYSERVE_MAX_SPACES"
        )


class NotKept(Exception):
    """A version called by name (`owner/name@N`) that the space does not keep: never
    published, pruned, or its space deleted. `kept` lists the ones it keeps."""

    def __init__(self, space: str, version: str, kept: list[int]) -> None:
        super().__init__(f"space {space} keeps no version {version[:40]!r}")
        self.space = space
        self.version = version
        self.kept = kept


def callable_versions(store: Store, space: str) -> list[int]:
    """The versions a request may call by name: those kept, none once deleted."""
    return store.kept(space) if store.current(space) is not None else []


def split_key(key: str) -> tuple[str, int | None]:
    """A load's key: the space (its current version) or `owner/name@N` (kept version N)."""
    space, at, number = key.partition("@")
    return space, int(number) if at else None


class OtherPool(Exception):
    """The space's current version runs in another pool than this fleet host's: it is
    neither imported nor fetched here."""

    def __init__(self, space: str, pool: str, host_pool: str) -> None:
        super().__init__(f"{space} runs in pool {pool}, this host in pool {host_pool}")
        self.space = space
        self.pool = pool
        self.host_pool = host_pool


class Loads:
    """One worker's loads: one per key at a time, however many requests and signals ask
    for it, each ending in the switch to the version it loaded. A key is a space (its
    current version) or `owner/name@N` (kept version N, called by name: loaded beside
    the current one, in the same slot, and never swapped by a deploy)."""

    def __init__(
        self,
        held: Held,
        cap: MemoryCap,
        store: Store,
        broadcast: Broadcast,
        meter: Meter,
        clock: Callable[[], float],
        space_threads: int = loader.DEFAULT_THREADS,
        host_limiter: anyio.CapacityLimiter | None = None,
        fetch: Callable[[Version], Awaitable[None]] | None = None,
        pool: str | None = None,
        device: DeviceMemory | None = None,
    ) -> None:
        self.held = held
        self.cap = cap
        self.store = store
        self.broadcast = broadcast
        self.meter = meter
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
        # A GPU worker's device memory: measured around each load, under its own cap.
        self.device = device
        self.changes = Changes(store, broadcast)  # a slot claimed on a first request
        self.tasks: dict[str, asyncio.Task[Active]] = {}  # the load under way, by space
        # A slot changes only when it is handed over (a deleted space's, or on a
        # lazy_slots host an unheld one's); a load checks, and every hand-over bumps the
        # slot's generation, which forces one.
        self.slots: dict[str, int] = {}
        # Another pool's spaces, with the generation at which that was found: until the
        # word moves (a deploy or a delete), a request for one is sent elsewhere at once.
        self._other_pool: dict[str, tuple[int, str]] = {}

    def for_request(self, key: str) -> asyncio.Task[Active]:
        """The load a request waits for when the space's version here is stale or absent:
        the one under way, else a new one. A load started for an older generation may
        finish with an older version: the request looks again once it is done."""
        slot = self.slots.get(key)
        if slot is None:
            slot = self._find_slot(key)
            if slot is None:  # deployed, with no slot here yet: the load claims one
                return self.tasks.get(key) or self.start(key, None, 0)
        generation = self.broadcast.generation(slot)
        other = self._other_pool.get(key)
        if other is not None and other[0] == generation and self.pool is not None:
            raise OtherPool(split_key(key)[0], other[1], self.pool)
        return self.tasks.get(key) or self.start(key, slot, generation)

    def _find_slot(self, key: str) -> int | None:
        """The key's slot, or None for a deployed space without one here (a fleet
        host's, until its first request claims one)."""
        space = split_key(key)[0]
        try:
            parse_space(space)
        except ClientError:
            raise NotDeployed(space) from None
        slot = self.store.slots.slot(space)
        if slot is None:
            # Read before any thread or lock is taken: a request for a space that is
            # not deployed costs what it did.
            if current_number(self.store.space_dir(space)) is None:
                raise NotDeployed(space)
            return None
        return self._slot_found(key, slot)

    def _slot_found(self, key: str, slot: int) -> int:
        if slot >= self.broadcast.table.space_slots:
            raise loader.LoadError(
                f"space slot {slot} is outside the shared table: raise POLYSERVE_MAX_SPACES"
            )
        self.slots[key] = slot
        return slot

    def _check_pool(self, space: str) -> None:
        """Another pool's space is sent elsewhere before it takes a slot here."""
        found = self.store.current(space) if self.pool is not None else None
        if found is not None and found.pool != self.pool:
            raise OtherPool(space, found.pool, str(self.pool))

    async def _claimed(self, key: str) -> int:
        """The key's slot, claimed under the store lock if the space has none here."""
        space = split_key(key)[0]
        then = partial(rollouts.claimed, self.store, self.broadcast.table, space)
        try:
            slot = await anyio.to_thread.run_sync(
                self.changes.claim, space, then, limiter=self.host_limiter
            )
        except ClientError as exc:
            if exc.status != 507:
                raise
            raise TableFull(space, self.store.max_spaces) from None
        if slot is None:
            raise NotDeployed(space)
        return self._slot_found(key, slot)

    async def _still_owned(self, space: str, slot: int) -> bool:
        """Whether the slot is still the space's, read under the store lock once this
        worker holds a version in it: a hand-over (which reads the holds under that
        lock) either came before and is seen here, or comes after and sees the hold."""

        def owned() -> bool:
            with self.store.locked():
                return self.store.slots.slot(space) == slot

        return await anyio.to_thread.run_sync(owned, limiter=self.host_limiter)

    def start(self, key: str, slot: int | None, generation: int) -> asyncio.Task[Active]:
        """Load once per key at a time, however many requests and signals ask for it."""
        task = asyncio.create_task(self._load_once(key, slot, generation))
        self.tasks[key] = task
        # A load started by refresh() may have no awaiter: mark its error as seen (it is
        # logged in _load_once) so asyncio does not report it again at collection.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _load_once(self, key: str, slot: int | None, generation: int) -> Active:
        try:
            return await self._load(key, slot, generation)
        except (loader.LoadError, NoRoom) as exc:
            log.warning("loading %s failed: %s", key, exc)
            raise
        finally:
            # Unregister before the task is done: a done task left in tasks would let
            # lease() await it without yielding, in a loop that never ends.
            del self.tasks[key]

    async def _load(self, key: str, slot: int | None, generation: int) -> Active:
        held = self.held
        space, number = split_key(key)
        current = held.active.get(key)
        if slot is not None:
            self.store.slots.refresh()
        if slot is None or self.store.slots.slot(space) != slot:
            # No slot here yet, or it was handed over (the space deleted, or released
            # here on a lazy_slots host): found again, or claimed.
            if current is not None:
                held.retire(current)
                current = None
            self.slots.pop(key, None)  # lease() looks it up again
            slot = self._find_slot(key)
            if slot is None:
                self._check_pool(space)
                slot = await self._claimed(key)
            generation = self.broadcast.generation(slot)
        if number is None:
            version = held.current(space, slot)
        else:
            # A kept version is found again at each bump: a deploy leaves it serving,
            # a delete (or a prune, once unheld) ends it.
            version = await held.kept(space, slot, number)
            if version is None:
                if current is not None:
                    held.retire(current)
                raise NotKept(space, str(number), callable_versions(self.store, space))
        if version is None:
            if current is not None:
                held.retire(current)
            raise NotDeployed(space)
        if current is None and self.store.lazy_slots and not await self._still_owned(space, slot):
            # Handed over before the hold: this space claims a slot again.
            held.unhold(space, slot, version.number)
            self.slots.pop(key, None)
            return await self._load(key, None, 0)
        if self.pool is not None and version.pool != self.pool:
            # Checked on the cold path only: a loaded space costs its requests nothing.
            held.unhold(space, slot, version.number)
            if current is not None:  # redeployed into another pool
                held.retire(current)
            self._other_pool[key] = (generation, version.pool)
            raise OtherPool(space, version.pool, self.pool)
        releases = self.broadcast.releases(slot)
        if current is not None and current.version == version and current.releases == releases:
            held.unhold(space, slot, version.number)  # the Active holds it already
            current.generation = generation  # a bump that did not change the version
            return current
        if current is not None and current.releases != releases:
            # Released on demand while this worker missed the signal: re-imported below.
            self.meter.count_release(slot, Cell.RELEASED_DEMAND)
        # Not kept across the awaits: a stale version held by this frame could not be
        # collected when it is dropped for room. It serves nobody new (lease checks the
        # generation); it is retired at the switch, or before, by the memory cap.
        del current
        active, took_ms = await self._import(key, version, slot, generation, releases)
        # The switch: from here on new requests get the new version.
        current = held.active.get(key)  # not if the reaper or the cap retired it
        held.active[key] = active
        if current is not None:
            held.retire(current)
        log.info(
            "loaded %s v%d (%s) in %.1f ms", key, version.number, active.imported.kind, took_ms
        )
        return active

    async def _import(
        self, key: str, version: Version, slot: int, generation: int, releases: int
    ) -> tuple[Active, float]:
        """`version` (held by the caller, let go here if this fails) imported and started,
        with room for it under the cap; and the milliseconds it took, room-making left
        out."""
        try:
            return await self._measured(key, version, slot, generation, releases)
        finally:
            # No await between this and the switch: a recycle cannot come between.
            if self.device is not None:
                self.device.done(key)

    async def _measured(
        self, space: str, version: Version, slot: int, generation: int, releases: int
    ) -> tuple[Active, float]:
        """_import's work; `space` is the load's key, under which the caps know it."""
        cap, device = self.cap, self.device
        memory_before = device_before = 0
        try:
            if cap.limit:
                memory_before = await cap.admit(space)
            if device is not None:
                device_before = await device.admit(space)
            # Taken after making room: other tenants' shutdowns are not this load's time.
            started, started_us, anon_before = self.clock(), self.meter.clock(), anon_bytes()
            imported = await self._read(version)
            await loader.start(imported, self.held.start_timeout)
        except BaseException:
            cap.abandon(space)
            self.held.unhold(version.space, slot, version.number)
            raise
        # Memory the load added: approximate when other work runs at the same time.
        device_added = device.added(space, slot, device_before) if device is not None else 0
        self.meter.loaded(slot, started_us, anon_bytes() - anon_before, device_added)
        now = self.clock()
        active = Active(imported, version, slot, generation, releases, last_used=now, key=space)
        if device is not None:
            device.track(space, active)
        if device is not None and device.limit:
            try:
                await device.fit(space)
            except BaseException:
                dropping = [self.held.retire(active)]  # never leased: dropped at once
                del active, imported
                await self.held.collect_after([t for t in dropping if t is not None])
                raise
        if cap.limit:
            # Checked before the switch, so that no request leases a version that may be
            # refused: until then they wait for this load.
            with cap.checking(space, memory_before):
                try:
                    await cap.fit(space)
                except BaseException:
                    dropping = [self.held.retire(active)]  # never leased: dropped at once
                    del active, imported  # nothing may keep them from the collection
                    await self.held.collect_after([t for t in dropping if t is not None])
                    raise
        return active, (now - started) * 1000

    async def _read(self, version: Version) -> loader.Imported:
        """Import the (held) version's files: fetched first when they are not here, and
        once more when a fleet host's disk budget removed them between the look and the
        import's lock (polyserve/state/budget.py); held, they stay from then on."""
        for attempt in range(2):
            if attempt or not version.dir.is_dir():
                await self._fetch(version)
                self.held.trim_soon()  # the files it added may pass a disk budget
            try:
                return await anyio.to_thread.run_sync(
                    _import_version,
                    self.store,
                    version,
                    self.space_threads,
                    limiter=self.host_limiter,
                )
            except budget.Pruned:
                pass
        raise loader.FilesAway(
            f"the files of {version.space} v{version.number} went from this host while it"
            " loaded them: try again"
        )

    async def _fetch(self, version: Version) -> None:
        if self.fetch is None:
            raise loader.LoadError(
                f"the files of {version.space} v{version.number} are missing from the data"
                " directory"
            )
        try:
            await self.fetch(version)
        except ClientError as exc:
            if exc.status == 503:  # the fleet's database is away: it may be back soon
                raise loader.FilesAway(
                    f"the files of {version.space} v{version.number} are not on this host"
                    f" yet, and fetching them failed: {exc.error}"
                ) from exc
            raise loader.LoadError(exc.error) from exc


def _import_version(store: Store, version: Version, threads: int) -> loader.Imported:
    """loader.import_version, with the heap's thresholds of a load (heap.loading), under
    the read lock of a disk budget (budget.reading), and with the space's secrets, read
    once for this load: a change to them releases the space after its file is written,
    so a load that read the old ones serves no request."""
    space, number = version.space, version.number
    values = store.secrets.values(space)
    with heap.loading(), budget.reading(store, space, number):
        return loader.import_version(
            space, number, version.dir, version.entry, threads, version.deps, values
        )
