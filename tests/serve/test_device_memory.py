"""Unit tests of polyserve.serve.devcap through a worker's registry: device memory measured
around loads, the cap's least recently used release, and the recycle when a release
leaves memory behind. The device is a stand-in: a space "holds" device memory from its
import until its module is collected (or, leaking, for ever), read as NVML would be."""

from __future__ import annotations

import asyncio
import io
import sys
from pathlib import Path

import pytest

from polyserve.serve.devcap import DeviceNoRoom
from polyserve.serve.registry import Registry
from polyserve.state.apply import Changes
from polyserve.state.broadcast import Broadcast
from polyserve.state.shm import Table
from polyserve.state.store import Store
from polyserve.usage.meter import CELLS, Cell, Meter
from tests.helpers import make_tar

MIB = 1 << 20
CONTEXT = 500 * MIB  # what the worker holds at boot: its CUDA context
HELD: dict[str, int] = {}  # what each space's module holds on the stand-in device
LEAKED: list[int] = []  # what released spaces left behind


def space(name: str, mib: int, leak: bool = False) -> str:
    """A space holding `mib` MiB on the stand-in device while its module lives (`name`
    keys what it holds: give each version its own)."""
    me = __name__
    keep = f"sys.modules[{me!r}].LEAKED.append({mib} * {MIB})\n" if leak else ""
    return (
        "import sys, weakref\n"
        f"_device = sys.modules[{me!r}]\n"
        f"_device.HELD[{name!r}] = {mib} * {MIB}\n"
        f"{keep}"
        "class _Hold: pass\n"
        "_HOLD = _Hold()\n"
        # Freed when the module is collected, as a framework's tensors are.
        f"weakref.finalize(_HOLD, _device.HELD.pop, {name!r}, None)\n"
        f"if {leak!r}: _device.HELD.pop({name!r})\n"
        "def handle(request):\n"
        "    return 'ok'\n"
    )


def device_memory() -> int:
    return CONTEXT + sum(HELD.values()) + sum(LEAKED)


class World:
    def __init__(self, tmp_path: Path, cap_mib: int = 0) -> None:
        self.store = Store(tmp_path / "data", max_spaces=8)
        self.table = Table.anonymous(1, 8, CELLS)
        self.broadcast = Broadcast(self.table, row=0)
        self.now = 0.0
        self.recycled = 0
        self.registry = Registry(
            self.store,
            self.broadcast,
            Meter(self.table, 0),
            100.0,
            5.0,
            clock=lambda: self.now,
            device_cap=cap_mib * MIB,
            device_memory=device_memory,
            recycle=self.recycle,
        )
        self.changes = Changes(self.store, self.broadcast)

    def recycle(self) -> None:
        self.recycled += 1

    def deploy(self, name: str, source: str) -> None:
        staged = self.store.stage(io.BytesIO(make_tar({"main.py": source})), "s.tar", 1 << 20)
        self.changes.publish(name, staged, {"kind": "?", "import_ms": 0})

    async def call(self, name: str) -> None:
        self.now += 1
        active = await self.registry.lease(name)
        self.registry.end_lease(active)

    async def reap_all(self) -> None:
        self.now += 1000
        await self.registry.reap()
        await self.registry.held.collect_after([])

    def cell(self, name: str, cell: Cell) -> int:
        return int(self.table.cell_array()[0, self.store.slots.slot(name), cell])


@pytest.fixture(autouse=True)
def empty_device():
    HELD.clear()
    LEAKED.clear()
    yield
    HELD.clear()
    LEAKED.clear()
    assert __name__ in sys.modules


def test_each_load_is_metered_with_the_device_memory_it_added(tmp_path):
    world = World(tmp_path)
    world.deploy("a/one", space("a/one", 64))
    world.deploy("a/two", space("a/two", 32))
    asyncio.run(world.call("a/one"))
    asyncio.run(world.call("a/two"))
    assert world.cell("a/one", Cell.GPU_MEMORY_BYTES) == 64 * MIB
    assert world.cell("a/two", Cell.GPU_MEMORY_BYTES) == 32 * MIB
    assert world.registry.device is not None and world.registry.device.baseline == CONTEXT


def test_a_release_that_gives_the_memory_back_recycles_nothing(tmp_path):
    world = World(tmp_path)
    world.deploy("a/clean", space("a/clean", 64))

    async def scenario() -> None:
        await world.call("a/clean")
        await world.reap_all()

    asyncio.run(scenario())
    assert device_memory() == CONTEXT
    assert world.recycled == 0 and world.cell("a/clean", Cell.RECYCLED) == 0


def test_a_release_that_leaves_memory_behind_recycles_the_worker_once(tmp_path):
    world = World(tmp_path)
    world.deploy("a/leaky", space("a/leaky", 64, leak=True))

    async def scenario() -> None:
        await world.call("a/leaky")
        await world.reap_all()
        await world.registry.held.collect_after([])  # a second collection: still once

    asyncio.run(scenario())
    assert world.recycled == 1
    assert world.cell("a/leaky", Cell.RECYCLED) == 1


def test_the_cap_releases_the_least_recently_used_gpu_space(tmp_path):
    """Room for two 64 MiB spaces over the context: a third releases the oldest."""
    world = World(tmp_path, cap_mib=500 + 150)
    for name in ("a/old", "a/mid", "a/new"):
        world.deploy(name, space(name, 64))

    async def scenario() -> None:
        await world.call("a/old")
        await world.call("a/mid")
        await world.call("a/new")

    asyncio.run(scenario())
    assert sorted(world.registry.active) == ["a/mid", "a/new"]
    assert world.cell("a/old", Cell.RELEASED_MEMORY) == 1
    assert device_memory() <= (500 + 150) * MIB
    assert world.recycled == 0  # a release for room while loading is no leak


def test_a_space_over_the_cap_alone_is_refused(tmp_path):
    world = World(tmp_path, cap_mib=500 + 32)
    world.deploy("a/big", space("a/big", 64))
    with pytest.raises(DeviceNoRoom, match="POLYSERVE_WORKER_GPU_MEMORY_MB"):
        asyncio.run(world.call("a/big"))
    assert "a/big" not in world.registry.active


def test_under_the_cap_a_redeploy_drops_its_own_old_version_uncounted(tmp_path):
    """Old and new version do not fit together: the old one (no request can lease it any
    more) goes first, and a swap is no release."""
    world = World(tmp_path, cap_mib=500 + 100)
    world.deploy("a/swap", space("a/swap v1", 64))

    async def scenario() -> None:
        await world.call("a/swap")
        world.deploy("a/swap", space("a/swap v2", 64))
        await world.call("a/swap")

    asyncio.run(scenario())
    assert world.registry.active["a/swap"].version.number == 2
    assert world.cell("a/swap", Cell.RELEASED_MEMORY) == 0
    assert list(HELD) == ["a/swap v2"] and device_memory() <= 600 * MIB
