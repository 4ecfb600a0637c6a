"""Unit tests of polyserve.state.budget against a real data directory and a real table:
which versions' files a disk budget removes, and which it never does."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import pytest

from polyserve.state import budget
from polyserve.state.broadcast import Broadcast
from polyserve.state.shm import Table
from polyserve.state.store import Store
from polyserve.usage.meter import CELLS
from tests.helpers import make_tar

KIB = 1024
PAD = 100 * KIB  # each version's files: a little over this


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "data", max_spaces=8, keep_versions=3)


@pytest.fixture
def table() -> Table:
    return Table.anonymous(2, 8, CELLS)


def publish(store: Store, space: str, used: float) -> int:
    """A version of `space` whose files take about PAD bytes, last used at `used`."""
    files = {"main.py": "def handle(request):\n    return {}\n", "pad.bin": os.urandom(PAD)}
    staged = store.stage(io.BytesIO(make_tar(files)), "space.tar", max_unpacked=1 << 20)
    with store.locked():
        _, number = store.publish(space, staged, {"kind": "handle"})
    os.utime(store.space_dir(space) / "versions" / str(number), (used, used))
    return number


def files_here(store: Store) -> set[tuple[str, int]]:
    return {(v.space, v.number) for v in budget.on_disk(store)}


def test_the_least_recently_used_versions_go_first_and_held_ones_never(store, table):
    """Over the budget, the files of the least recently used versions go until the rest
    fit; a version a worker holds (and every later one of its space) stays, however
    cold; the metadata of every version stays."""
    publish(store, "u/held", used=100)  # the coldest, but held
    publish(store, "u/held", used=150)  # numbered after the held one: may be held too
    publish(store, "u/cold", used=200)
    publish(store, "u/cool", used=300)
    publish(store, "u/warm", used=400)
    worker, trimmer = Broadcast(table, 0), Broadcast(table, None)
    slot = store.slots.slot("u/held")
    assert slot is not None
    worker.hold(slot, 1)
    sizes = {(v.space, v.number): v.size for v in budget.on_disk(store)}
    assert all(PAD <= size < PAD + KIB for size in sizes.values()), sizes
    limit = sum(sizes.values()) - sizes["u/cold", 1]  # one version too many

    assert budget.trim(store, trimmer, sum(sizes.values())) == []  # at the budget: none go
    removed = budget.trim(store, trimmer, limit)
    assert [(v.space, v.number) for v in removed] == [("u/cold", 1)]
    removed = budget.trim(store, trimmer, 3 * PAD)  # two more must go: held ones stay
    assert [(v.space, v.number) for v in removed] == [("u/cool", 1), ("u/warm", 1)]
    assert files_here(store) == {("u/held", 1), ("u/held", 2)}
    for space in ("u/cold", "u/cool", "u/warm"):
        assert store.meta(space, 1) is not None  # still current: fetched on its next load
        assert store.current(space) is not None
        assert store.kept(space) == [1]  # and kept: a rollout may pin it, a request call it
        assert store.pin(space, 1) == [1]
    assert list(store.staging_dir.iterdir()) == []  # what was moved aside is deleted

    worker.hold(slot, 0)  # let go: the held versions are cold like any other now
    removed = budget.trim(store, trimmer, PAD + KIB)
    assert [(v.space, v.number) for v in removed] == [("u/held", 1)]
    assert files_here(store) == {("u/held", 2)}


def test_a_version_being_loaded_stays_and_a_load_marks_it_used(store, table):
    """A load reads the files under `reading`: the budget skips the version meanwhile,
    and the load makes it the most recently used, so the next cold one goes instead."""
    publish(store, "u/a", used=100)
    publish(store, "u/b", used=200)
    trimmer = Broadcast(table, None)
    with budget.reading(store, "u/a", 1):  # a worker importing it, its hold not seen
        removed = budget.trim(store, trimmer, 0)
        assert [(v.space, v.number) for v in removed] == [("u/b", 1)]
    assert files_here(store) == {("u/a", 1)}
    publish(store, "u/c", used=100)  # colder than u/a's load of just now
    removed = budget.trim(store, trimmer, PAD + KIB)
    assert [(v.space, v.number) for v in removed] == [("u/c", 1)]


def test_a_load_of_removed_files_is_told_so(store, table):
    """A load whose lock comes after the removal finds the files gone (Pruned: it
    fetches them again), as does one of a version whose metadata went."""
    publish(store, "u/a", used=100)
    assert budget.trim(store, Broadcast(table, None), 0) != []
    with pytest.raises(budget.Pruned), budget.reading(store, "u/a", 1):
        pass
    with pytest.raises(budget.Pruned), budget.reading(store, "u/a", 2):
        pass


def test_a_pass_goes_on_when_another_removes_files_it_is_measuring(store, table, monkeypatch):
    """Every worker and the follower run passes, each listing outside the store lock: a
    version another pass moves aside while this one measures it is left out, and this
    pass still brings the rest under the budget."""
    publish(store, "u/a", used=100)
    publish(store, "u/b", used=200)
    publish(store, "u/c", used=300)
    measure = budget._size
    raced: list[str] = []

    def racing(path: str) -> int:
        if not raced:  # the other pass moves the first version measured aside meanwhile
            raced.append(path)
            os.rename(path, store.staging_dir / "pruned-by-another-pass")
        return measure(path)

    monkeypatch.setattr(budget, "_size", racing)
    removed = budget.trim(store, Broadcast(table, None), PAD + KIB)
    assert len(raced) == 1
    assert len(removed) == 1  # the other two were three; one fits
    assert len(files_here(store)) == 1


def test_files_held_over_the_budget_are_warned_of_once_a_minute_and_when_they_fit(
    store, table, caplog
):
    """Every pass over a budget that held files exceed would say so: the warning is said
    at the first, then again only once its minute has passed, and the files' fitting
    again is said once (so a later excess is warned of at once)."""
    publish(store, "u/held", used=100)
    worker, trimmer = Broadcast(table, 0), Broadcast(table, None)
    slot = store.slots.slot("u/held")
    assert slot is not None
    worker.hold(slot, 1)
    now = [1000.0]
    warning = budget.OverBudget(clock=lambda: now[0])

    def said(n: int, limit: int = PAD // 2) -> list[str]:
        """What n passes under `limit` log, info and up (none removes the held files)."""
        caplog.clear()
        for _ in range(n):
            assert budget.trim(store, trimmer, limit, warning) == []
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]

    with caplog.at_level(logging.INFO, logger="polyserve"):
        (first,) = said(100)
        assert "held by workers" in first
        now[0] += 59.0
        assert said(100) == []
        now[0] += 1.0
        assert [m for m in said(100) if "held by workers" in m] == [first]
        (fits,) = said(3, limit=10 * PAD)  # it fits now: said once
        assert "within its" in fits
        assert said(3) == [first]  # over again: said at once, not a minute later
    assert files_here(store) == {("u/held", 1)}
