"""Unit tests of polyserve.serve.registry and what it holds (held, loading, memcap):
on-demand load, hot swap with drain, idle release, the memory cap.

The clock is injected and the shared table is anonymous, so nothing sleeps or forks.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import shutil
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from polyserve.serve import loader
from polyserve.serve.loading import TableFull
from polyserve.serve.registry import NoRoom, NotDeployed, NotKept, OtherPool, Registry
from polyserve.state import budget
from polyserve.state.apply import Changes
from polyserve.state.broadcast import Broadcast
from polyserve.state.shm import Table
from polyserve.state.store import Store, Version
from polyserve.usage.meter import CELLS, Cell, Meter, totals_by_name
from tests.helpers import Ballast, make_tar

TTL = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class World:
    """A store, a table and one worker's registry."""

    def __init__(self, tmp_path: Path, slots: int = 8, lazy_slots: bool = False) -> None:
        self.store = Store(tmp_path / "data", max_spaces=slots, lazy_slots=lazy_slots)
        self.table = Table.anonymous(1, slots, CELLS)
        self.broadcast = Broadcast(self.table, row=0)
        self.clock = Clock()
        self.meter = Meter(self.table, 0, clock=lambda: int(self.clock.now * 1_000_000))
        self.registry = Registry(self.store, self.broadcast, self.meter, TTL, 5.0, clock=self.clock)
        # Changes as a deploy makes them, without the signal: tests call refresh() where
        # a signal would arrive.
        self.changes = Changes(self.store, self.broadcast)

    async def reap_at(self, now: float) -> list[str]:
        self.clock.now = now
        return await self.registry.reap()

    def cell(self, space: str, cell: Cell) -> int:
        return int(self.table.cell_array()[0, self.store.slots.slot(space), cell])

    def deploy(self, space: str, source: str, pool: str | None = None) -> int:
        files = {"main.py": source}
        if pool is not None:
            files["polyserve.toml"] = f'pool = "{pool}"\n'
        staged = self.store.stage(io.BytesIO(make_tar(files)), "s.tar", 1 << 20)
        return self.changes.publish(space, staged, {"kind": "?", "import_ms": 0})

    def delete(self, space: str) -> None:
        assert self.changes.delete(space)

    async def call(self, space: str):
        active = await self.registry.lease(space)
        try:
            return active.imported.module.VERSION
        finally:
            self.registry.end_lease(active)

    async def call_named(self, space: str, version: str):
        """A request for `space@version`, as dispatch leases it: (VERSION, the Active)."""
        registry = self.registry
        active = registry.lease_named(space, version) or await registry.lease_version(
            space, version
        )
        try:
            return active.imported.module.VERSION, active
        finally:
            registry.end_lease(active)


def version(n: int, extra: str = "") -> str:
    return f"VERSION = {n}\n{extra}def handle(request):\n    return VERSION\n"


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def run(coro):
    return asyncio.run(coro)


def count_imports(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = loader.import_version

    def counting(space, *args):
        calls.append(space)
        return real(space, *args)

    monkeypatch.setattr(loader, "import_version", counting)
    return calls


def test_concurrent_first_requests_load_once(world, monkeypatch):
    calls = count_imports(monkeypatch)
    world.deploy("o/s", version(1))

    async def main():
        return await asyncio.gather(*(world.call("o/s") for _ in range(20)))

    assert run(main()) == [1] * 20
    assert calls == ["o/s"]


def test_nothing_is_imported_before_the_first_request(world, monkeypatch):
    calls = count_imports(monkeypatch)
    world.deploy("o/s", version(1))
    assert calls == [] and world.registry.active == {}


def racing_budget(world: World, monkeypatch, removals: int) -> list[int]:
    """A fleet worker whose disk budget wins the race `removals` times: the version's
    files go after the load saw them, just before its read lock (budget.reading); its
    fetch puts them back, as the fleet's would. Returns the versions it fetched."""
    world.deploy("o/s", version(1))
    files = world.store.version("o/s", 1).dir
    fleet = world.store.root.parent / "fleet-copy"
    shutil.copytree(files, fleet)
    fetched: list[int] = []

    async def fetch(found: Version) -> None:
        fetched.append(found.number)
        shutil.copytree(fleet, found.dir)

    real = budget.reading

    @contextlib.contextmanager
    def raced(layout, space, number):
        if len(fetched) < removals:
            shutil.rmtree(files)
        with real(layout, space, number):
            yield

    monkeypatch.setattr(budget, "reading", raced)
    world.registry = Registry(
        world.store, world.broadcast, world.meter, TTL, 5.0, clock=world.clock, fetch=fetch
    )
    return fetched


def test_files_removed_between_a_loads_look_and_its_read_are_fetched_again(world, monkeypatch):
    """The load fetches the files and imports the version: no 500 for the race."""
    fetched = racing_budget(world, monkeypatch, removals=1)
    assert run(world.call("o/s")) == 1
    assert fetched == [1]


def test_files_removed_again_after_their_fetch_answer_files_away(world, monkeypatch):
    """Held by then, a version is never removed again; should it be, the load answers
    FilesAway (a 503 with Retry-After), never a 500."""
    fetched = racing_budget(world, monkeypatch, removals=2)
    with pytest.raises(loader.FilesAway, match="went from this host while it loaded them"):
        run(world.call("o/s"))
    assert fetched == [1]


def test_a_fleet_worker_never_imports_another_pools_space(world, monkeypatch):
    """A worker of a fleet host in pool cpu: a gpu space is neither imported nor counted as
    a load, and once seen, its requests are sent elsewhere without reading the store
    again until its generation moves."""
    calls = count_imports(monkeypatch)
    world.registry.loads.pool = "cpu"
    world.deploy("o/g", version(1), pool="gpu")
    for _ in range(3):
        with pytest.raises(OtherPool) as err:
            run(world.call("o/g"))
        assert (err.value.space, err.value.pool, err.value.host_pool) == ("o/g", "gpu", "cpu")
    assert calls == [] and world.registry.active == {}
    assert world.cell("o/g", Cell.LOADS) == 0
    assert world.broadcast.oldest_held(world.store.slots.slot("o/g")) is None  # no hold left
    # Known by its generation: the store is not read (a `current` gone behind the
    # registry's back is not noticed) until a change bumps the word.
    (world.store.space_dir("o/g") / "current").unlink()
    with pytest.raises(OtherPool):
        run(world.call("o/g"))
    world.deploy("o/g", version(2))  # back to the default pool: this worker's
    assert run(world.call("o/g")) == 2
    assert calls == ["o/g"]


def test_a_loaded_space_redeployed_into_another_pool_is_let_go(world):
    world.registry.loads.pool = "cpu"
    world.deploy("o/m", version(1))
    assert run(world.call("o/m")) == 1
    world.deploy("o/m", version(2), pool="gpu")
    with pytest.raises(OtherPool):
        run(world.call("o/m"))
    assert world.registry.active == {}
    assert world.cell("o/m", Cell.LOADED_SINCE_US) == 0  # its residency was folded


def test_without_a_pool_a_worker_serves_every_pool(world):
    """A single host (Registry.pool None) imports a gpu space like any other."""
    world.deploy("o/g", version(1), pool="gpu")
    assert run(world.call("o/g")) == 1


@pytest.mark.parametrize("name", ["o/missing", "../x", "a/b/c", "o/.hidden"])
def test_unknown_or_invalid_spaces_are_not_deployed(world, name):
    with pytest.raises(NotDeployed):
        run(world.call(name))


def test_a_new_generation_swaps_and_drains_the_old_version(world):
    world.deploy("o/s", version(1, "import contextlib\n"))

    async def main():
        old = await world.registry.lease("o/s")  # an in-flight request on v1
        old_module = weakref.ref(old.imported.module)
        world.deploy("o/s", version(2))
        assert await world.call("o/s") == 2  # new requests get v2 at once
        assert old.retired and old_module() is not None  # v1 drains, not dropped
        world.registry.end_lease(old)
        await asyncio.gather(old._dropping)
        del old
        return old_module

    old_module = run(main())
    gc.collect()
    assert old_module() is None


def test_a_bump_without_a_new_version_does_not_reimport(world, monkeypatch):
    calls = count_imports(monkeypatch)
    world.deploy("o/s", version(1))
    run(world.call("o/s"))
    world.broadcast.bump(world.store.slots.slot("o/s"))
    assert run(world.call("o/s")) == 1
    assert calls == ["o/s"]


def test_a_load_for_an_older_generation_is_not_trusted(world, monkeypatch):
    """A request that arrives after a deploy never gets the version before it, even if
    a load of the older version is still running when it arrives."""
    world.deploy("o/s", version(1))
    importing, proceed = threading.Event(), threading.Event()
    imported_versions: list[int] = []
    real = loader.import_version

    def slow_import(space, number, *args):
        imported_versions.append(number)
        importing.set()
        proceed.wait(5)
        return real(space, number, *args)

    monkeypatch.setattr(loader, "import_version", slow_import)

    async def main():
        first = asyncio.create_task(world.call("o/s"))
        while not importing.is_set():  # the load of v1 is inside its import
            await asyncio.sleep(0.001)
        world.deploy("o/s", version(2))  # ... and the deploy answers now
        second = asyncio.create_task(world.call("o/s"))
        proceed.set()
        return await first, await second

    first, second = run(main())
    assert imported_versions == [1, 2]
    assert second == 2
    assert first == 2  # it too re-checked the generation before using the result


def test_delete_makes_the_space_not_deployed(world):
    world.deploy("o/s", version(1))

    async def main():
        assert await world.call("o/s") == 1
        world.delete("o/s")
        with pytest.raises(NotDeployed):
            await world.call("o/s")
        assert world.registry.active == {}

    run(main())


def test_refresh_swaps_without_waiting_for_a_request(world):
    world.deploy("o/s", version(1))

    async def main():
        await world.call("o/s")
        world.deploy("o/s", version(2))
        world.registry.refresh()  # what the broadcast signal does
        await asyncio.gather(*world.registry.loads.tasks.values())
        return world.registry.active["o/s"].imported.module.VERSION

    assert run(main()) == 2


def test_idle_spaces_are_released_after_the_ttl(world, monkeypatch):
    calls = count_imports(monkeypatch)
    world.deploy("o/s", version(1))

    async def main():
        await world.call("o/s")
        module = weakref.ref(world.registry.active["o/s"].imported.module)
        assert await world.reap_at(TTL - 1) == []
        assert await world.reap_at(TTL) == ["o/s"]
        assert world.registry.active == {}
        return module

    module = run(main())
    gc.collect()
    assert module() is None
    assert run(world.call("o/s")) == 1 and calls == ["o/s", "o/s"]


def test_a_fleet_hosts_worker_takes_slots_on_first_requests_and_hands_idle_ones_over(tmp_path):
    """lazy_slots, 2 slots, 3 spaces deployed with none: each first request takes a slot;
    with both held the third space's is TableFull; once one is released for idleness
    its slot goes to the third space, whose load finds its current version, and every
    space's usage stays its own by name."""
    world = World(tmp_path, slots=2, lazy_slots=True)
    for i in range(3):
        world.deploy(f"o/s{i}", version(i))
    assert world.store.slots.ledger().names == []

    async def main():
        assert [await world.call("o/s0"), await world.call("o/s1")] == [0, 1]
        with pytest.raises(TableFull):
            await world.call("o/s2")
        world.clock.now = 1.0
        await world.call("o/s1")  # o/s0 is the one idle for the TTL
        assert await world.reap_at(TTL) == ["o/s0"]
        world.deploy("o/s2", version(22))  # before its slot: its load finds this one
        assert await world.call("o/s2") == 22
        assert world.store.slots.slot("o/s2") == 0 and world.store.slots.slot("o/s0") is None
        assert await world.call("o/s1") == 1

    run(main())
    now = world.meter.clock()
    cells = (Cell.LOADS, Cell.RELEASED_IDLE)
    by_name = totals_by_name(world.table, world.store.slots.ledger(), now, cells)
    assert by_name == {"o/s0": (1, 1), "o/s1": (1, 0), "o/s2": (1, 0)}


def test_a_hold_let_go_in_a_slot_handed_over_meanwhile_keeps_the_new_owners(tmp_path):
    """Two spaces' holds in one slot of one worker (a fleet host's slot handed over while
    the worker held its old owner's version): letting the old owner's go leaves the new
    owner's hold in the table, so its slot is not handed over again under its load."""
    world = World(tmp_path, lazy_slots=True)
    world.deploy("o/old", version(1))
    for _ in range(3):
        world.deploy("o/new", version(2))
    held = world.registry.held
    old, new = held.current("o/old", 0), held.current("o/new", 0)
    assert old is not None and new is not None and (old.number, new.number) == (1, 3)
    held.unhold("o/old", 0, 1)
    assert world.broadcast.oldest_held(0) == 3
    held.unhold("o/new", 0, 3)
    assert world.broadcast.oldest_held(0) is None


def test_in_flight_requests_keep_a_space_alive(world):
    world.deploy("o/s", version(1))

    async def main():
        active = await world.registry.lease("o/s")
        assert await world.reap_at(TTL * 10) == []
        world.registry.end_lease(active)

    run(main())


def test_the_idle_clock_starts_when_a_request_ends(world):
    world.deploy("o/s", version(1))

    async def main():
        active = await world.registry.lease("o/s")  # starts at t=0
        world.clock.now = 50.0
        world.registry.end_lease(active)  # ends at t=50
        assert await world.reap_at(TTL + 10) == []
        assert await world.reap_at(TTL + 50) == ["o/s"]

    run(main())


def test_a_failed_load_is_reported_and_retried(world):
    world.deploy("o/s", "raise RuntimeError('flaky')\n")

    async def main():
        for _ in range(2):
            with pytest.raises(loader.LoadError, match="flaky"):
                await world.registry.lease("o/s")
        assert world.registry.loads.tasks == {}

    run(main())


LIFESPAN_APP = """
import contextlib
from starlette.applications import Starlette
EVENTS = []
VERSION = 1

@contextlib.asynccontextmanager
async def lifespan(app):
    EVENTS.append("startup")
    yield
    EVENTS.append("shutdown")

app = Starlette(lifespan=lifespan)
"""


def test_close_runs_every_shutdown(world):
    world.deploy("o/a", LIFESPAN_APP)
    world.deploy("o/b", LIFESPAN_APP)

    async def main():
        await world.call("o/a")
        await world.call("o/b")
        modules = [a.imported.module for a in world.registry.active.values()]
        assert [m.EVENTS for m in modules] == [["startup"]] * 2
        await world.registry.close()
        assert world.registry.active == {}
        return modules

    assert [m.EVENTS for m in run(main())] == [["startup", "shutdown"]] * 2


def test_residency_runs_from_the_load_to_the_release_and_a_swap_does_not_break_it(world):
    world.deploy("o/s", version(1))

    async def main():
        world.clock.now = 10.0
        await world.call("o/s")  # loaded at t=10
        assert world.cell("o/s", Cell.LOADED_SINCE_US) == 10_000_000
        world.clock.now = 20.0
        world.deploy("o/s", version(2))
        assert await world.call("o/s") == 2  # swapped at t=20: still one stretch
        await asyncio.sleep(0)  # let v1's drop run
        assert world.cell("o/s", Cell.LOADED_SINCE_US) == 10_000_000
        assert world.cell("o/s", Cell.RESIDENT_US) == 0
        assert await world.reap_at(20.0 + TTL) == ["o/s"]  # released at t=120

    run(main())
    assert world.cell("o/s", Cell.LOADED_SINCE_US) == 0
    assert world.cell("o/s", Cell.RESIDENT_US) == (20 + TTL - 10) * 1_000_000
    assert world.cell("o/s", Cell.LOADS) == 2


def test_closing_the_worker_folds_every_residency(world):
    world.deploy("o/a", version(1))

    async def main():
        world.clock.now = 1.0
        await world.call("o/a")
        world.clock.now = 7.0
        await world.registry.close()

    run(main())
    assert world.cell("o/a", Cell.RESIDENT_US) == 6_000_000
    assert world.cell("o/a", Cell.LOADED_SINCE_US) == 0


def test_a_release_on_demand_drops_the_space_and_the_next_call_imports_it(world, monkeypatch):
    calls = count_imports(monkeypatch)
    world.deploy("o/s", version(1))

    async def main():
        await world.call("o/s")
        module = weakref.ref(world.registry.active["o/s"].imported.module)
        assert world.changes.release("o/s")
        world.registry.refresh()  # what the broadcast signal does
        assert world.registry.active == {}
        await asyncio.sleep(0)  # the drop
        assert await world.call("o/s") == 1
        return module

    module = run(main())
    gc.collect()
    assert module() is None and calls == ["o/s", "o/s"]


def test_a_release_reaches_a_worker_that_missed_the_signal(world, monkeypatch):
    calls = count_imports(monkeypatch)
    world.deploy("o/s", version(1))

    async def main():
        await world.call("o/s")
        assert world.changes.release("o/s")
        # No refresh(): the generation word alone makes the next request import afresh.
        assert await world.call("o/s") == 1

    run(main())
    assert calls == ["o/s", "o/s"]


# -- the memory cap ---------------------------------------------------------------------

MIB = 1 << 20


def ballast(mib: int) -> str:
    """A space holding `mib` MiB of pretend memory, and the memory held when it was imported."""
    return (
        "from tests.helpers import Ballast\n"
        "AT_IMPORT = Ballast.held()\n"
        f"BLOB = Ballast({mib})\n" + version(1)
    )


@pytest.fixture
def capped(world: World) -> Iterator[World]:
    """The world's registry under a 10 MiB cap on the Ballast memory its spaces hold."""
    world.registry.cap.limit = 10 * MIB
    world.registry.cap.memory = Ballast.held
    yield world
    run(world.registry.close())  # no Ballast left for the next test
    gc.collect()


def deploy_three(world: World) -> None:
    for name in ("o/a", "o/b", "o/c"):
        world.deploy(name, ballast(4))


async def calls_at(world: World, *timeline: tuple[float, str]) -> None:
    """One call to each space at its time, in order."""
    for now, name in timeline:
        world.clock.now = now
        await world.call(name)


def releases(world: World, space: str) -> tuple[int, int, int]:
    return (
        world.cell(space, Cell.RELEASED_IDLE),
        world.cell(space, Cell.RELEASED_MEMORY),
        world.cell(space, Cell.RELEASED_DEMAND),
    )


def test_at_its_memory_cap_a_worker_releases_the_least_recently_used_idle_space(capped):
    """Three 4 MiB spaces under a 10 MiB cap: loading the third releases the one whose
    last request ended first, not the one loaded first."""
    deploy_three(capped)
    run(calls_at(capped, (1.0, "o/a"), (2.0, "o/b"), (3.0, "o/a"), (4.0, "o/c")))
    assert sorted(capped.registry.active) == ["o/a", "o/c"]
    assert Ballast.held() == 8 * MIB  # o/b's memory is gone already, not at the next second
    assert releases(capped, "o/b") == (0, 1, 0) and releases(capped, "o/a") == (0, 0, 0)


def test_a_space_with_a_request_in_flight_is_never_released_for_memory(capped):
    """The least recently used space is skipped while a request holds it."""
    deploy_three(capped)

    async def main():
        capped.clock.now = 1.0
        held = await capped.registry.lease("o/a")  # the oldest, and in flight
        capped.clock.now = 2.0
        await capped.call("o/b")
        capped.clock.now = 3.0
        await capped.call("o/c")
        capped.registry.end_lease(held)

    run(main())
    assert sorted(capped.registry.active) == ["o/a", "o/c"]
    assert releases(capped, "o/a") == (0, 0, 0) and releases(capped, "o/b") == (0, 1, 0)


def test_a_load_that_cannot_fit_is_refused_and_the_worker_keeps_serving(capped):
    """With every other space in flight, a load over the cap raises NoRoom, keeps nothing
    of the refused space, and succeeds once the others' requests end."""
    capped.deploy("o/a", ballast(4))
    capped.deploy("o/b", ballast(4))
    capped.deploy("o/big", ballast(6))

    async def main():
        leases = [await capped.registry.lease(name) for name in ("o/a", "o/b")]
        with pytest.raises(NoRoom, match="POLYSERVE_WORKER_MEMORY_MB"):
            await capped.registry.lease("o/big")
        assert sorted(capped.registry.active) == ["o/a", "o/b"]
        assert Ballast.held() == 8 * MIB  # the refused load's memory is let go at once
        with pytest.raises(NoRoom):  # its size is known now: refused before importing
            await capped.registry.lease("o/big")
        for lease in leases:
            capped.registry.end_lease(lease)
        del lease, leases  # as a finished request's: else they keep the memory alive
        return await capped.call("o/big")

    assert run(main()) == 1
    assert sorted(capped.registry.active) == ["o/big"]
    assert capped.cell("o/big", Cell.LOADS) == 2  # the second refusal imported nothing


def test_a_load_of_known_size_makes_room_before_it_imports(capped):
    """A space's last load size is the estimate of its next one: the space is imported
    with room made for it already, so the worker never goes over the cap."""
    deploy_three(capped)

    async def main():
        await calls_at(capped, (1.0, "o/a"), (2.0, "o/b"), (3.0, "o/c"), (4.0, "o/a"))
        return capped.registry.active["o/a"].imported.module.AT_IMPORT

    # o/a's second load: o/b and o/c (8 MiB) were held; room for 4 more was made first.
    assert run(main()) <= 6 * MIB
    assert releases(capped, "o/a") == (0, 1, 0)


def test_releases_are_counted_by_reason(capped):
    """Idle TTL, memory and release on demand each count in their own cell."""
    capped.registry.cap.limit = 0  # no cap until the memory step
    capped.deploy("o/s", ballast(4))
    capped.deploy("o/t", ballast(8))

    async def main():
        await capped.call("o/s")
        await capped.reap_at(TTL)  # idle
        await capped.call("o/s")
        assert capped.changes.release("o/s")
        capped.registry.refresh()  # on demand
        capped.clock.now = TTL + 1
        await capped.call("o/s")
        capped.registry.cap.limit = 10 * MIB
        capped.clock.now = TTL + 2
        await capped.call("o/t")  # memory

    run(main())
    assert releases(capped, "o/s") == (1, 1, 1)
    assert releases(capped, "o/t") == (0, 0, 0)


def test_a_space_bigger_than_the_cap_alone_is_refused_saying_so(capped):
    """With nothing else held, the refusal says the cap is too small, and keeps nothing."""
    capped.deploy("o/huge", ballast(12))

    async def main():
        with pytest.raises(NoRoom, match="holds no other space"):
            await capped.registry.lease("o/huge")

    run(main())
    assert capped.registry.active == {} and Ballast.held() == 0


def test_a_space_measured_alone_over_the_cap_is_refused_before_it_imports_again(capped):
    """Its size, measured with nothing else held or loading, is certain: the next request
    is refused on the estimate, without importing it again."""
    capped.deploy("o/huge", ballast(12))

    async def main():
        for _ in range(2):
            with pytest.raises(NoRoom, match="holds no other space"):
                await capped.registry.lease("o/huge")

    run(main())
    assert capped.cell("o/huge", Cell.LOADS) == 1


def test_a_hot_swap_under_the_cap_lets_the_idle_old_version_go_for_the_new(capped):
    """A 6 MiB space redeployed under a 10 MiB cap: its idle old version is dropped to
    make room, v2 serves, and the swap is neither an eviction nor a break in residency."""
    capped.deploy("o/s", ballast(6))
    capped.clock.now = 1.0
    assert run(capped.call("o/s")) == 1
    since = capped.cell("o/s", Cell.LOADED_SINCE_US)
    capped.deploy("o/s", ballast(6).replace("VERSION = 1", "VERSION = 2"))
    capped.clock.now = 2.0

    async def main():
        capped.registry.refresh()
        return [await capped.call("o/s") for _ in range(2)]

    assert run(main()) == [2, 2]
    assert capped.registry.active["o/s"].version.number == 2
    assert Ballast.held() == 6 * MIB
    assert releases(capped, "o/s") == (0, 0, 0)
    assert capped.cell("o/s", Cell.LOADED_SINCE_US) == since  # one stretch, not two
    assert capped.cell("o/s", Cell.RESIDENT_US) == 0


def test_a_hot_swap_that_does_not_fit_beside_its_draining_old_version_says_so(capped):
    """While v1 still has a request in flight, v2 is refused saying the old version is
    draining; once v1's request ends, the next request swaps."""
    capped.deploy("o/s", ballast(6))
    capped.deploy("o/s2", version(1))

    async def main():
        held = await capped.registry.lease("o/s")
        capped.deploy("o/s", ballast(6).replace("VERSION = 1", "VERSION = 2"))
        with pytest.raises(NoRoom, match="old version still has requests in flight"):
            await capped.registry.lease("o/s")
        capped.registry.end_lease(held)
        del held  # as a finished request's
        return await capped.call("o/s")

    assert run(main()) == 2
    assert Ballast.held() == 6 * MIB


def test_a_request_during_a_refused_loads_check_never_gets_the_refused_version(capped):
    """A load over the cap whose check waits for an eviction: a request arriving meanwhile
    waits for the load and gets NoRoom too, never the version about to be refused."""
    capped.deploy("o/a", ballast(4))
    capped.deploy("o/c", ballast(1))
    capped.deploy("o/big", ballast(7))

    async def main():
        held = await capped.registry.lease("o/a")
        capped.clock.now = 1.0
        await capped.call("o/c")
        load = asyncio.ensure_future(capped.registry.lease("o/big"))
        grabbed = []
        while not load.done():  # a request at every turn of the loop
            if "o/big" in capped.registry.active:
                grabbed.append(await capped.registry.lease("o/big"))
            await asyncio.sleep(0)
        with pytest.raises(NoRoom, match="1 other spaces it holds have requests in flight"):
            load.result()
        capped.registry.end_lease(held)
        del held, load  # as a finished request's: else they keep the memory alive
        return grabbed

    assert run(main()) == []
    assert sorted(capped.registry.active) == ["o/a"] and Ballast.held() == 4 * MIB


def test_a_size_measured_during_another_load_does_not_refuse_the_space_later(capped, tmp_path):
    """o/x's load measured o/y's 10 MiB, loaded meanwhile, as its own: later, alone, o/x is
    imported anyway, its 1 MiB is measured, and the estimate is corrected."""
    started, go = tmp_path / "started", tmp_path / "go"
    capped.deploy(
        "o/x",
        "import os, time\nfrom tests.helpers import Ballast\n"
        f"open({str(started)!r}, 'w').close()\n"
        f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.001)\n"
        "BLOB = Ballast(1)\n" + version(1),
    )
    capped.deploy("o/y", ballast(10))

    async def main():
        x = asyncio.ensure_future(capped.call("o/x"))
        while not started.exists():  # o/x's import has begun
            await asyncio.sleep(0.001)
        capped.clock.now = 1.0
        await capped.call("o/y")
        go.touch()
        await x  # o/y, idle, is evicted for it
        assert capped.registry.cap.estimates.sizes["o/x"] == 11 * MIB
        await capped.reap_at(TTL + 1)
        gc.collect()  # what the deferred collection would do
        assert Ballast.held() == 0
        return await capped.call("o/x")

    assert run(main()) == 1
    assert capped.registry.cap.estimates.sizes["o/x"] == 1 * MIB


def test_a_load_is_billed_its_own_time_not_the_evictions_it_waited_for(capped, monkeypatch):
    """A load that first evicts a space whose shutdown takes 5 s: its import time and the
    start of its residency leave those 5 s out."""
    real_stop = loader.stop

    async def slow_stop(imported, timeout):
        capped.clock.now += 5.0
        await real_stop(imported, timeout)

    monkeypatch.setattr(loader, "stop", slow_stop)
    deploy_three(capped)

    async def main():
        await calls_at(capped, (1.0, "o/a"), (2.0, "o/b"), (3.0, "o/c"))
        await capped.reap_at(TTL + 1.5)  # o/a only: its size stays known
        await calls_at(capped, (TTL + 10, "o/a"))  # evicts o/b, idle longest

    run(main())
    assert releases(capped, "o/b") == (0, 1, 0)
    assert capped.cell("o/a", Cell.LAST_IMPORT_US) == 0  # the clock stands still in imports
    after_eviction = int((TTL + 15) * 1_000_000)
    assert capped.cell("o/a", Cell.LOADED_SINCE_US) == after_eviction


def test_cold_loads_of_known_size_are_let_in_only_while_they_fit_together(capped, tmp_path):
    """Three 4 MiB spaces of known size under a 10 MiB cap, none held, asked for at once
    (each import waits for another's memory, or for the test): a load is let in only
    if it fits beside the loads in flight, the others wait for room, the worker never
    holds more than its cap, and none is refused."""
    go = tmp_path / "go"
    for name in ("o/a", "o/b", "o/c"):
        capped.deploy(
            name,
            "import os, time\nfrom tests.helpers import Ballast\nBLOB = Ballast(4)\n"
            f"while Ballast.held() < {8 * MIB} and not os.path.exists({str(go)!r}):\n"
            "    time.sleep(0.001)\n" + version(1),
        )

    async def main():
        go.touch()
        await calls_at(capped, (1.0, "o/a"), (2.0, "o/b"), (3.0, "o/c"))  # their sizes
        await capped.reap_at(TTL + 4)
        gc.collect()  # what the deferred collection would do
        assert capped.registry.active == {} and Ballast.held() == 0
        go.unlink()
        Ballast.peak = 0
        calls = asyncio.gather(*(capped.call(name) for name in ("o/a", "o/b", "o/c")))
        for _ in range(20):  # the loads are let in, or wait
            await asyncio.sleep(0)
        go.touch()  # for a load let in alone
        return await calls

    assert run(main()) == [1, 1, 1]
    assert Ballast.peak <= 10 * MIB
    assert len(capped.registry.active) == 2 and Ballast.held() == 8 * MIB


def test_loads_imported_together_over_the_cap_refuse_one_saying_so(capped):
    """Three first loads of 4 MiB under a 10 MiB cap, each import waiting until all three
    hold their memory: the last one checked is refused, saying the other loads hold
    memory (not that the cap is too small), and the other two are served."""
    for name in ("o/a", "o/b", "o/c"):
        capped.deploy(
            name,
            "import time\nfrom tests.helpers import Ballast\nBLOB = Ballast(4)\n"
            f"while Ballast.held() < {12 * MIB}:\n    time.sleep(0.001)\n" + version(1),
        )

    async def main():
        calls = (capped.call(name) for name in ("o/a", "o/b", "o/c"))
        return await asyncio.gather(*calls, return_exceptions=True)

    answers = run(main())
    refused = [a for a in answers if isinstance(a, NoRoom)]
    assert len(refused) == 1 and answers.count(1) == 2, answers
    assert "2 other loads in flight take memory too" in str(refused[0])
    assert len(capped.registry.active) == 2 and Ballast.held() == 8 * MIB


def test_a_load_short_of_room_waits_for_another_spaces_request_to_end(capped):
    """With the only other space in flight, a load of known size that needs its memory
    waits for that request to end, then releases it, instead of being refused at once."""
    capped.registry.cap.room_wait_s = 60.0  # the loop's turns below take far less
    capped.deploy("o/a", ballast(4))
    capped.deploy("o/big", ballast(7))

    async def main():
        assert await capped.call("o/big") == 1  # its size, measured alone
        await capped.reap_at(TTL + 1)
        gc.collect()
        held = await capped.registry.lease("o/a")
        load = asyncio.ensure_future(capped.call("o/big"))
        for _ in range(20):  # the load starts, finds no room before importing, and waits
            await asyncio.sleep(0)
        assert not load.done()
        capped.registry.end_lease(held)
        del held  # as a finished request's
        return await load

    assert run(main()) == 1
    assert sorted(capped.registry.active) == ["o/big"] and releases(capped, "o/a") == (0, 1, 0)


def test_a_load_waits_for_a_hung_import_only_as_long_as_an_import_may_take(capped, tmp_path):
    """A load short of room while another space's import hangs waits for it up to the
    start timeout, then is refused saying a load in flight takes the memory."""
    go = tmp_path / "go"
    capped.registry.held.start_timeout = 0.2
    capped.deploy(
        "o/hang",
        "import os, time\nfrom tests.helpers import Ballast\nBLOB = Ballast(4)\n"
        f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.001)\n" + version(1),
    )
    capped.deploy("o/b", ballast(8))

    async def main():
        assert await capped.call("o/b") == 1  # its size, measured alone
        await capped.reap_at(TTL + 1)
        gc.collect()
        hang = asyncio.ensure_future(capped.call("o/hang"))
        try:
            while Ballast.held() < 4 * MIB:  # its import holds its memory, and hangs
                await asyncio.sleep(0.001)
            with pytest.raises(NoRoom, match="1 other loads in flight take memory too"):
                await capped.registry.lease("o/b")
        finally:
            go.touch()  # else its thread outlives the test
        return await hang

    assert run(main()) == 1


def test_a_size_measured_while_a_space_was_released_does_not_replace_the_estimate(capped, tmp_path):
    """o/x measured alone at 4 MiB; its next load, during which idle o/y (6 MiB) is
    released, measures 0 MiB (o/y's memory left while o/x's came): the estimate stays
    4 MiB."""
    started, go = tmp_path / "started", tmp_path / "go"
    capped.deploy(
        "o/x",
        "import os, time\nfrom tests.helpers import Ballast\nBLOB = Ballast(4)\n"
        f"if os.path.exists({str(started)!r}):\n"
        f"    while not os.path.exists({str(go)!r}):\n        time.sleep(0.001)\n"
        f"open({str(started)!r}, 'w').close()\n" + version(1),
    )
    capped.deploy("o/y", ballast(6))

    async def main():
        await capped.call("o/x")  # measured alone
        await capped.reap_at(TTL + 1)
        gc.collect()
        capped.clock.now = TTL + 2
        await capped.call("o/y")
        x = asyncio.ensure_future(capped.call("o/x"))
        try:
            while Ballast.held() < 10 * MIB:  # o/x's second import holds its memory
                await asyncio.sleep(0.001)
            await capped.reap_at(2 * TTL + 3)  # o/y goes, while o/x is measured
            gc.collect()
        finally:
            go.touch()
        return await x

    assert run(main()) == 1
    assert capped.registry.cap.estimates.sizes["o/x"] == 4 * MIB


# -- a kept version by name (owner/name@N) ------------------------------------------------


def test_a_kept_version_by_name_serves_beside_the_current_and_a_deploy_leaves_it(
    world, monkeypatch
):
    calls = count_imports(monkeypatch)
    world.deploy("o/s", version(1))
    world.deploy("o/s", version(2))

    async def main():
        one, kept = await world.call_named("o/s", "1")
        assert (one, await world.call("o/s")) == (1, 2)
        assert kept.key == "o/s@1" and kept.slot == world.store.slots.slot("o/s")
        world.deploy("o/s", version(3))
        world.registry.refresh()  # the signal a deploy sends
        await asyncio.sleep(0)
        again, same = await world.call_named("o/s", "1")
        assert (again, await world.call("o/s")) == (1, 3)
        assert same is kept and not kept.retired
        assert sorted(world.registry.active) == ["o/s", "o/s@1"]

    run(main())
    assert calls == ["o/s", "o/s", "o/s"]  # v1 and v2, then v3: v1 was not imported again


def test_the_current_version_by_name_is_the_plain_requests_own(world, monkeypatch):
    calls = count_imports(monkeypatch)
    world.deploy("o/s", version(1))

    async def main():
        first, named = await world.call_named("o/s", "1")  # loaded as the space itself
        assert first == 1 and named is world.registry.active["o/s"]
        assert await world.call("o/s") == 1
        assert list(world.registry.active) == ["o/s"]

    run(main())
    assert calls == ["o/s"]


def test_a_version_the_space_does_not_keep_raises_not_kept_with_the_kept_ones(world):
    world.deploy("o/s", version(1))
    world.deploy("o/s", version(2))

    async def main():
        for asked in ("3", "0", "01", "x", "²"):
            with pytest.raises(NotKept) as err:
                await world.call_named("o/s", asked)
            assert err.value.kept == [1, 2] and err.value.version == asked
        with pytest.raises(NotDeployed):
            await world.call_named("o/none", "1")

    run(main())


def test_a_kept_version_held_by_name_is_not_pruned_until_it_is_let_go(world):
    world.deploy("o/s", version(1))
    world.deploy("o/s", version(2))
    world.store.keep_versions = 1  # from the next deploy on

    async def main():
        assert (await world.call_named("o/s", "1"))[0] == 1
        world.deploy("o/s", version(3))  # keeps only v3, and what a worker holds
        assert world.store.kept("o/s") == [1, 2, 3]
        assert (await world.call_named("o/s", "1"))[0] == 1
        assert await world.reap_at(TTL + 1) == ["o/s@1"]
        assert world.store.kept("o/s") == [3]
        with pytest.raises(NotKept) as err:
            await world.call_named("o/s", "1")
        assert err.value.kept == [3]

    run(main())


def test_a_delete_ends_a_kept_version_by_name(world):
    world.deploy("o/s", version(1))
    world.deploy("o/s", version(2))

    async def main():
        assert (await world.call_named("o/s", "1"))[0] == 1
        world.delete("o/s")
        with pytest.raises(NotKept) as err:
            await world.call_named("o/s", "1")
        assert err.value.kept == []
        assert "o/s@1" not in world.registry.active

    run(main())
