"""The worker's memory cap: a load is let in only while it fits, the least recently used
idle spaces are released to make room, and a refusal says what holds the memory.

The cap bounds anonymous RSS, read only around loads, never on a warm request.
Anonymous, because without swap that is what runs a host out of memory: file-backed
pages (libraries, a model mapped from its file, shared by every worker) the kernel can
drop. What a load adds is measured around its import, and estimates its next load.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import IntEnum

from polyserve.serve.held import Held
from polyserve.usage.meter import Cell, Meter, anon_bytes

# Releasing for memory frees down to this much below the cap, so that the synchronous
# collection it needs runs once per few loads rather than at every one.
HEADROOM = 0.05
NO_ROOM_RETRY_S = 1  # a busy space's requests end soon; then its memory can be let go
# A load short of room waits this long for other spaces' requests to end (their ends are
# not signalled: end_lease is the warm path), checking every ROOM_POLL_S.
ROOM_WAIT_S = 1.0
ROOM_POLL_S = 0.01


class Beside(IntEnum):
    """What a load's memory is measured beside: nothing, spaces held, or a disturbance
    (another load, or a space released meanwhile, whose memory lands in the measure)."""

    ALONE = 0
    SPACES = 1
    DISTURBED = 2


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


class Estimates:
    """What each space's last measured load added: the estimate of its next one, with
    what it was measured beside.

    An estimate is certain only when measured alone (else the measure may include other
    spaces' memory): only a certain estimate refuses a load on its own. A load disturbed
    by another, or by a release, measures both, or misses its own memory behind what was
    freed: it replaces only an estimate as disturbed, and refuses nothing."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.beside: dict[str, Beside] = {}
        # Loads being measured, each with what it is measured beside; and each load's
        # measure until its check is done, for what a refusal says.
        self._measuring: dict[str, Beside] = {}
        self._measured: dict[str, tuple[int, Beside]] = {}

    def begin(self, space: str, beside_spaces: bool) -> None:
        """Start measuring a load: beside the spaces held, if any; it and every load it
        overlaps are disturbed."""
        others = bool(self._measuring)
        self.disturb()
        self._measuring[space] = (
            Beside.DISTURBED if others else Beside.SPACES if beside_spaces else Beside.ALONE
        )

    def disturb(self) -> None:
        for name in self._measuring:
            self._measuring[name] = Beside.DISTURBED

    def end(self, space: str, added: int) -> None:
        beside = self._measuring.pop(space)
        self._measured[space] = (added, beside)
        disturbed = Beside.DISTURBED  # a disturbed measure replaces only a disturbed one
        if beside < disturbed or self.beside.get(space, disturbed) == disturbed:
            self.sizes[space], self.beside[space] = added, beside

    def abandon(self, space: str) -> None:
        self._measuring.pop(space, None)

    def checked(self, space: str) -> None:
        self._measured.pop(space, None)

    def trusted(self, space: str, waited: bool) -> bool:
        """Whether the estimate may refuse a load on its own: if measured alone; after a
        wait, also if measured beside other spaces. Else it may be far off."""
        beside = self.beside.get(space, Beside.DISTURBED)
        return beside == Beside.ALONE or (waited and beside == Beside.SPACES)

    def took(self, space: str, imported: bool) -> tuple[int, str]:
        """The size a refusal counts the space at, and where it says that comes from."""
        if imported and space in self._measured:
            size, beside = self._measured[space]
            took = f"this load added {size >> 20} MiB"
        elif space in self.sizes:
            size, beside = self.sizes[space], self.beside[space]
            took = f"the space's last measured load took {size >> 20} MiB"
        else:
            size, beside, took = 0, Beside.ALONE, "the space has not been measured here yet"
        if beside != Beside.ALONE:
            took += f", measured beside other {'spaces' if beside == Beside.SPACES else 'work'}"
        return size, took


class MemoryCap:
    """The bytes of anonymous RSS a worker keeps under (`limit`, 0: no cap), and the
    loads it lets in; `awaited` says which spaces are never released for room (one
    loading, or one a request waits for)."""

    def __init__(
        self,
        held: Held,
        meter: Meter,
        awaited: Callable[[str], bool],
        limit: int = 0,
        memory: Callable[[], int] = anon_bytes,
        room_wait_s: float = ROOM_WAIT_S,
    ) -> None:
        self.held = held
        self.meter = meter
        self.awaited = awaited
        self.limit = limit
        self.memory = memory  # how it reads the memory it bounds
        self.room_wait_s = room_wait_s
        self.estimates = Estimates()
        # Loads let in that are importing, with the memory they are expected to add (not
        # yet in the measure), and loads imported and being checked against the cap.
        # One room check at a time: two releasing at once would each release what the
        # other's collection was about to free.
        self._reserved: dict[str, int] = {}
        self._checking: dict[str, int] = {}  # each with its turn: the later decides first
        self._turns = itertools.count(1)
        self._room: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        # The least memory measured holding nothing: the worker's own, as far as it knows.
        self._floor: int | None = None

    # -- a load's steps -------------------------------------------------------------------

    async def admit(self, space: str) -> int:
        """Before a load's import: room for its estimate, the load let in with it, and
        its measure started. Returns the memory the measure starts from."""
        await self._make_room(space, self.estimates.sizes.get(space, 0), imported=False)
        before = self.memory()
        self.estimates.begin(space, any(name != space for name in self.held.active))
        return before

    def abandon(self, space: str) -> None:
        """A load that failed, or was cancelled, before its import ended."""
        self.estimates.abandon(space)
        self._reserved.pop(space, None)

    @contextmanager
    def checking(self, space: str, before: int) -> Iterator[None]:
        """After a load's import: what it added is in the measure now (from `before`),
        and the load has its turn at its check (fit) until the block ends."""
        self.estimates.end(space, max(self.memory() - before, 0))
        self._reserved.pop(space, None)
        self._checking[space] = next(self._turns)
        try:
            yield
        finally:
            del self._checking[space]
            self.estimates.checked(space)

    async def fit(self, space: str) -> None:
        """After the import, in its turn: room for what the load took, or NoRoom (the
        estimate was only that: the load may have taken more)."""
        await self._make_room(space, 0, imported=True)

    def floor(self) -> int | None:
        """The least memory this worker was measured at holding nothing, measured now if
        it holds nothing and was not yet (None: it holds spaces and was never empty)."""
        if self._floor is None and not (self.held.active or self._reserved or self._checking):
            self._floor = self.memory()
        return self._floor

    # -- making room -------------------------------------------------------------------

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
        cap = self.limit
        collected = False
        busy_since: float | None = None
        waited_for: set[str] = set()
        loads_since = 0.0
        loop = asyncio.get_running_loop()
        held = self.held
        while True:
            async with self._room_lock():
                memory = self.memory()
                if not (imported or held.active or self._reserved or self._checking):
                    self._floor = memory if self._floor is None else min(self._floor, memory)
                coming = sum(n for name, n in self._reserved.items() if name != space)
                if memory + coming + need <= cap:
                    if not imported:
                        self._reserved[space] = need
                    return
                if held.collect_pending:  # drops whose memory is not back yet
                    await held.collect_after([])
                    continue
                excess = memory + coming + need - int(cap * (1 - HEADROOM))
                dropping = self._release(space, excess)
                if dropping or not collected:
                    await held.collect_after(dropping)
                    collected = True
                    continue
            old = held.active.get(space)
            draining = old is not None and old.inflight > 0
            del old  # a reference here would keep a dropped version from the collection
            busy = [name for name in held.active if name != space]  # none of them idle
            checked = self._checking.get(space, 0)
            if imported:
                loads = [name for name in self._reserved if name != space]
                loads += [name for name, n in self._checking.items() if n > checked]
            else:
                loads = [*self._reserved, *self._checking]
            refuse, waited = False, True  # waited: for what holds the room, in vain
            if loads:
                # A load takes as long as its import may (a hung one must not hold
                # every other load back for ever), counted from the last that ended.
                if set(loads) != waited_for:
                    waited_for, loads_since = set(loads), loop.time()
                refuse = loop.time() - loads_since >= held.start_timeout
                holders = (len(busy), draining, len(loads))
            elif busy or draining:
                busy_since = loop.time() if busy_since is None else busy_since
                refuse = loop.time() - busy_since >= self.room_wait_s
                holders = (len(busy), draining, 0)
            else:
                others = len(self._checking) - (space in self._checking)  # checked before
                refuse, waited, holders = True, False, (0, False, others)
            if refuse:
                # An estimate refuses on its own only if measured alone; after a wait,
                # also one measured beside other spaces. Else it may be far off: import
                # and see, and let the check after the import refuse if need be.
                if imported or memory > cap or self.estimates.trusted(space, waited):
                    raise self._no_room(space, memory, imported, *holders)
                self._reserved[space] = need
                return
            await asyncio.sleep(ROOM_POLL_S)

    def _no_room(
        self, space: str, memory: int, imported: bool, busy: int, draining: bool, loads: int
    ) -> NoRoom:
        """NoRoom, saying what holds the memory that keeps the space out: `busy` other
        spaces in flight, its own old version `draining`, `loads` other loads."""
        size, took = self.estimates.took(space, imported)
        own = memory - (size if imported else 0)  # the worker's, without the space
        floor = own if self._floor is None else min(self._floor, own)
        why = _why(busy, draining, loads, own, floor, size, self.limit)
        return NoRoom(space, memory, self.limit, f"{took}, and {why}")

    def _room_lock(self) -> asyncio.Lock:
        """The room check's lock, for the running loop (an asyncio lock is bound to one)."""
        loop = asyncio.get_running_loop()
        if self._room is None or self._room[0] is not loop:
            self._room = (loop, asyncio.Lock())
        return self._room[1]

    def _release(self, space: str, excess: int) -> list[asyncio.Task[None]]:
        """Drop tasks of what _make_room lets go: the space's own idle old version, else
        idle spaces (_release_lru)."""
        old = self.held.active.get(space)
        if old is not None and old.inflight == 0:
            dropping = [self.held.retire(old)]  # a swap: not a release, so not counted
        else:
            dropping = self._release_lru(space, excess)
        del old
        return [t for t in dropping if t is not None]

    def _release_lru(self, space: str, excess: int) -> list[asyncio.Task[None] | None]:
        """Retire idle spaces, least recently used first, as many as their last loads
        say it takes to free `excess` bytes (at least one: a size measured while other
        loads ran may be 0). Returns their drop tasks, not them: a reference left to a
        dropped space would keep its memory from the collection."""
        idle = [
            a
            for name, a in self.held.active.items()
            if a.inflight == 0 and name != space and not self.awaited(name)
        ]
        idle.sort(key=lambda a: a.last_used)
        dropping = []
        for active in idle:
            self.meter.count_release(active.slot, Cell.RELEASED_MEMORY)
            dropping.append(self.held.retire(active))
            excess -= self.estimates.sizes.get(active.key, 0)
            if excess <= 0:
                break
        return dropping


def _why(busy: int, draining: bool, loads: int, own: int, floor: int, size: int, limit: int) -> str:
    """What keeps a space out: what holds the memory, else the space itself, else memory
    that no space holds (`own`: the worker's without the space, `floor`: its least)."""
    holding = [f"the {busy} other spaces it holds have requests in flight"] if busy else []
    if draining:
        holding.append("its old version still has requests in flight (draining)")
    if loads:
        holding.append(f"{loads} other loads in flight take memory too")
    if holding:
        return f"{' and '.join(holding)}; retry in {NO_ROOM_RETRY_S} s"
    if floor + size > limit:
        return "it holds no other space and loads none: this space alone takes it over the cap"
    return (
        f"it holds no other space and loads none, yet memory no space holds keeps it"
        f" over the cap: {(own - floor) >> 20} MiB more than it had holding nothing"
    )
