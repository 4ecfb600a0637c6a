"""Unit tests of polyserve.usage.meter and the table layout, with simulated workers (no forking)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polyserve.state.shm import HEADER_WORDS, MAGIC, Table
from polyserve.state.slots import Ledger, SlotLog
from polyserve.usage import answer, meter, prometheus
from polyserve.usage.meter import CELLS, Cell, Meter

NAMES = ["o/a", "o/b", "o/c"]
SPACES = Ledger(NAMES, offsets={}, retired={})  # three slots, none handed over
S = 1_000_000  # µs per second


class Clock:
    def __init__(self, now: int = 1_000 * S) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def world(workers: int = 3, slots: int = 4):
    table = Table.anonymous(workers, slots, CELLS)
    clock = Clock()
    return table, clock, [Meter(table, row, clock=clock) for row in range(workers)]


def test_every_region_of_the_layout_is_distinct():
    table = Table.anonymous(3, 5, CELLS)
    touched = np.zeros(len(table.words), dtype=int)
    indices = list(range(HEADER_WORDS))
    indices += [HEADER_WORDS + 2 * w for w in range(3)]  # pids
    indices += [table.inflight_index(w) for w in range(3)]
    generations = HEADER_WORDS + 2 * 3
    indices += [generations + s for s in range(5)]
    indices += [generations + 5 + s for s in range(5)]  # release words
    indices += [generations + 10 + s for s in range(5)]  # access words
    indices += [generations + 15 + s for s in range(5)]  # rollout words
    indices += [table.held_index(w, s) for w in range(3) for s in range(5)]
    indices += [table.cell_index(r, s, c) for r in range(4) for s in range(5) for c in range(CELLS)]
    for i in indices:
        touched[i] += 1
    assert (touched == 1).all(), "every word belongs to exactly one field"
    assert len(table.words) * 8 == Table.size_for(3, 5, CELLS)
    assert table.words[0] == MAGIC and table.words[2:5].tolist() == [3, 5, CELLS]
    table.generations[4] = 7
    assert table.words[generations + 4] == 7
    table.access[4] = 9
    assert table.words[generations + 14] == 9
    table.releases[0] = 8
    assert table.words[generations + 5] == 8
    table.pids[2] = 99
    assert table.words[HEADER_WORDS + 4] == 99


def test_requests_busy_time_errors_and_in_flight():
    table, clock, (m, *_) = world()
    t0 = m.begin()
    assert table.inflight_array().tolist() == [1, 0, 0]
    clock.now += 250_000
    m.end(0, t0, error=False)
    t1 = m.begin()
    clock.now += 1_000
    m.end(0, t1, error=True)
    m.end(None, m.begin(), error=False)  # a 404: no space answered
    cells = table.cell_array()[0, 0]
    assert cells[Cell.REQUESTS] == 2 and cells[Cell.ERRORS] == 1
    assert cells[Cell.BUSY_US] == 251_000
    assert table.inflight_array().tolist() == [0, 0, 0]


def test_usage_sums_workers_and_counts_open_residency():
    table, clock, meters = world()
    for row, m in enumerate(meters):  # worker w answers w+1 requests on o/a
        for _ in range(row + 1):
            m.end(0, m.begin(), error=False)
    meters[0].loaded(0, clock.now - 60 * S, memory_bytes=300 * 1024)  # loaded 60 s ago
    meters[1].loaded(0, clock.now - 30 * S, memory_bytes=100 * 1024)
    meters[1].loaded(1, clock.now - 10 * S, memory_bytes=0)
    meters[1].released(1)
    u = answer.usage(meter.snapshot(table, SPACES, clock.now))
    a, b, c = (u["spaces"][name] for name in NAMES)
    assert {k: a[k] for k in ("requests", "busy_ms", "warm_s", "loaded")} == {
        "requests": 6,
        "busy_ms": 0,
        "warm_s": 90,
        "loaded": True,
    }
    assert a["workers_loaded"] == 2 and a["cold_starts"] == 2 and a["memory_kib"] == 300
    assert a["last_import_ms"] == 60_000.0
    assert (b["loaded"], b["warm_s"], b["workers_loaded"]) == (False, 10, 0)
    assert c == {**c, "requests": 0, "warm_s": 0, "loaded": False}


def test_the_seed_fields_have_the_seed_types():
    table, clock, (m, *_) = world()
    m.end(0, m.begin(), error=False)
    fields = answer.usage(meter.snapshot(table, SPACES, clock.now))["spaces"]["o/a"]
    assert [type(fields[k]) for k in ("requests", "busy_ms", "warm_s", "loaded")] == [
        int,
        int,
        int,
        bool,
    ]


def test_a_swap_keeps_one_residency_stretch():
    table, clock, (m, *_) = world()
    m.loaded(0, clock.now, memory_bytes=0)
    clock.now += 5 * S
    m.loaded(0, clock.now, memory_bytes=0)  # the new version, while the old drains
    clock.now += 5 * S
    m.released(0)
    assert table.cell_array()[0, 0, Cell.RESIDENT_US] == 10 * S


def test_a_dead_workers_counts_stay_and_its_residency_is_closed():
    table, clock, meters = world()
    for _ in range(100):
        meters[1].end(0, meters[1].begin(), error=False)
    meters[1].loaded(0, clock.now, memory_bytes=0)
    meters[1].begin()  # killed mid-request
    clock.now += 42 * S
    meter.fold_row(table, 1, clock.now)  # what the master does in child_exit
    clock.now += 1000 * S  # the dead worker's residency must not grow any more
    u = answer.usage(meter.snapshot(table, SPACES, clock.now))["spaces"]["o/a"]
    assert (u["requests"], u["warm_s"], u["loaded"]) == (100, 42, False)
    assert table.inflight_array().tolist() == [0, 0, 0]


def test_a_checkpoint_restores_the_same_usage(tmp_path):
    table, clock, meters = world()
    for m in meters:
        m.end(1, m.begin(), error=True)
    meters[2].loaded(1, clock.now - 7 * S, memory_bytes=0)
    meter.checkpoint(table, SPACES, tmp_path / "usage.json", clock.now)
    before = answer.usage(meter.snapshot(table, SPACES, clock.now))["spaces"]

    restarted = Table.anonymous(3, 4, CELLS)
    meter.set_base(restarted, meter.checkpoint_totals(tmp_path / "usage.json", SPACES))
    after = answer.usage(meter.snapshot(restarted, SPACES, clock.now))["spaces"]
    for name in NAMES:  # everything but the live state carries over
        for key in ("requests", "errors", "busy_ms", "warm_s", "cold_starts"):
            assert after[name][key] == before[name][key], (name, key)
    assert after["o/b"]["warm_s"] == 7 and not after["o/b"]["loaded"]


def test_no_checkpoint_yet_means_nothing_to_restore(tmp_path):
    assert meter.checkpoint_totals(tmp_path / "usage.json", SPACES) is None


def test_a_leftover_segment_is_counted_up_to_the_masters_last_checkpoint(tmp_path):
    table, clock, (m, *_) = world()
    m.loaded(0, clock.now, memory_bytes=0)
    for _ in range(5):
        m.end(0, m.begin(), error=False)
    clock.now += 3 * S
    meter.checkpoint(table, SPACES, tmp_path / "usage.json", clock.now)  # alive at +3 s
    m.loaded(1, clock.now + 60 * S, memory_bytes=0)  # a load after the last sign of life
    t = meter.leftover_totals(table)
    assert t[0, Cell.REQUESTS] == 5
    assert t[0, Cell.RESIDENT_US] == 3 * S  # not past the master's last sign of life
    assert t[1, Cell.RESIDENT_US] == 0  # never negative


def test_prometheus_exposition_parses_and_carries_the_counts():
    table, clock, (m, *_) = world()
    t0 = m.begin()
    clock.now += 1_500_000
    m.end(0, t0, error=False)
    m.loaded(0, clock.now, memory_bytes=2048)
    text = prometheus.exposition(meter.snapshot(table, SPACES, clock.now)).decode()
    samples = {
        (s.name, s.labels.get("space")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("polyserve_space_requests_total", "o/a")] == 1
    assert samples[("polyserve_space_busy_seconds_total", "o/a")] == pytest.approx(1.5)
    assert samples[("polyserve_space_memory_bytes", "o/a")] == 2048
    assert samples[("polyserve_space_workers_loaded", "o/a")] == 1
    assert samples[("polyserve_in_flight", None)] == 0


def test_a_slot_is_reclaimable_only_once_nobody_holds_or_warms_it():
    """Handing a slot over needs its final totals: no hold, no open residency."""
    table, clock, meters = world()
    meters[0].end(1, meters[0].begin(), error=False)
    meters[1].loaded(1, clock.now, memory_bytes=0)
    table.held_array()[1, 1] = 4  # worker 1 holds v4
    assert meter.reclaimable(table, 1) is None
    table.held_array()[1, 1] = 0
    assert meter.reclaimable(table, 1) is None  # its residency is still open
    clock.now += 2 * S
    meters[1].released(1)
    final = meter.reclaimable(table, 1)
    named = {c: v for c, v in zip(meter.TOTALS, final, strict=True) if isinstance(c, Cell)}
    assert final is not None and named == {
        Cell.REQUESTS: 1,
        Cell.ERRORS: 0,
        Cell.BUSY_US: 0,
        Cell.RESIDENT_US: 2 * S,
        Cell.LOADS: 1,
        Cell.IMPORT_US: 0,
        Cell.RELEASED_IDLE: 0,
        Cell.RELEASED_MEMORY: 0,
        Cell.RELEASED_DEMAND: 0,
        Cell.BATCHES: 0,
        Cell.BATCH_ROWS: 0,
        Cell.RECYCLED: 0,
    }


def test_usage_is_per_name_across_a_slot_hand_over(tmp_path):
    """The old owner keeps what it used in the slot; the new one counts from the hand-over,
    and a checkpoint restores both."""
    table, clock, (m, *_) = world()
    for _ in range(3):
        m.end(1, m.begin(), error=False)  # o/b: 3 requests, then deleted
    final = meter.reclaimable(table, 1)
    assert final is not None
    m.end(1, m.begin(), error=True)  # the new owner's first request, an error
    offset = tuple(-v for v in final)
    ledger = Ledger(["o/a", "o/new", "o/c"], offsets={1: offset}, retired={"o/b": final})
    u = answer.usage(meter.snapshot(table, ledger, clock.now))["spaces"]
    assert (u["o/b"]["requests"], u["o/b"]["errors"], u["o/b"]["loaded"]) == (3, 0, False)
    assert (u["o/new"]["requests"], u["o/new"]["errors"]) == (1, 1)
    meter.checkpoint(table, ledger, tmp_path / "usage.json", clock.now)
    restarted = Table.anonymous(3, 4, CELLS)
    meter.set_base(restarted, meter.checkpoint_totals(tmp_path / "usage.json", ledger))
    after = answer.usage(meter.snapshot(restarted, ledger, clock.now))["spaces"]
    assert {n: after[n]["requests"] for n in after} == {n: u[n]["requests"] for n in u}
    assert after["o/new"]["errors"] == 1


def released(u: dict) -> tuple[int, int, int]:
    return u["released_idle"], u["released_memory"], u["released_demand"]


def test_usage_counts_releases_by_reason_over_every_worker():
    """Each worker's idle, memory and on-demand releases sum per space (released_<reason>)."""
    table, clock, meters = world()
    meters[0].count_release(0, Cell.RELEASED_MEMORY)
    meters[1].count_release(0, Cell.RELEASED_MEMORY)
    meters[1].count_release(0, Cell.RELEASED_IDLE)
    meters[2].count_release(1, Cell.RELEASED_DEMAND)
    u = answer.usage(meter.snapshot(table, SPACES, clock.now))["spaces"]
    assert released(u["o/a"]) == (1, 2, 0) and released(u["o/b"]) == (0, 0, 1)
    samples = {
        (s.name, s.labels["space"], s.labels["reason"]): s.value
        for f in text_string_to_metric_families(
            prometheus.exposition(meter.snapshot(table, SPACES, clock.now)).decode()
        )
        for s in f.samples
        if s.name == "polyserve_space_releases_total"
    }
    assert samples[("polyserve_space_releases_total", "o/a", "memory")] == 2
    assert samples[("polyserve_space_releases_total", "o/b", "demand")] == 1


def test_a_checkpoint_written_before_releases_were_counted_still_restores(tmp_path):
    """An older checkpoint (no release totals) restores its totals, releases at 0."""
    path = tmp_path / "usage.json"
    old = {"requests": 5, "errors": 1, "busy_us": 7, "resident_us": 9, "loads": 2, "import_us": 3}
    path.write_text(json.dumps({"format": 1, "saved_at": 0, "spaces": {"o/a": old}}))
    table, clock, _ = world()
    meter.set_base(table, meter.checkpoint_totals(path, SPACES))
    u = answer.usage(meter.snapshot(table, SPACES, clock.now))["spaces"]["o/a"]
    assert (u["requests"], u["errors"], u["cold_starts"]) == (5, 1, 2)
    assert released(u) == (0, 0, 0)


def test_a_checkpoint_that_names_the_releases_evicted_still_restores_them(tmp_path):
    """A checkpoint written before issue 26 names the release totals evicted_<reason>:
    a restart on it restores them as released_<reason>."""
    path = tmp_path / "usage.json"
    old = {"requests": 5, "errors": 0, "busy_us": 7, "resident_us": 9, "loads": 2}
    old |= {"import_us": 3, "evicted_idle": 4, "evicted_memory": 1, "evicted_demand": 6}
    path.write_text(json.dumps({"format": 1, "saved_at": 0, "spaces": {"o/a": old}}))
    table, clock, _ = world()
    meter.set_base(table, meter.checkpoint_totals(path, SPACES))
    u = answer.usage(meter.snapshot(table, SPACES, clock.now))["spaces"]["o/a"]
    assert u["requests"] == 5 and released(u) == (4, 1, 6)
    meter.checkpoint(table, SPACES, path, clock.now)  # written back under the new names
    saved = json.loads(path.read_text())["spaces"]["o/a"]
    assert released(saved) == (4, 1, 6)
    assert not any(key.startswith("evicted_") for key in saved)


def test_a_hand_over_logged_before_releases_were_counted_still_reads(tmp_path):
    """A slot log line with the six older totals hands the slot over as it did."""
    log = tmp_path / "slots.log"
    log.write_text("0\to/old\n0\to/new\t4,0,10,20,1,5\n")
    slots = SlotLog(log, max_spaces=4)
    table, clock, (m, *_) = world()
    for _ in range(6):  # four by o/old before the hand-over, two by o/new after
        m.end(0, m.begin(), error=False)
    m.count_release(0, Cell.RELEASED_IDLE)
    u = answer.usage(meter.snapshot(table, slots.ledger(), clock.now))["spaces"]
    assert (u["o/old"]["requests"], u["o/new"]["requests"]) == (4, 2)
    assert released(u["o/new"]) == (1, 0, 0) and released(u["o/old"]) == (0, 0, 0)


def test_the_kept_rendering_encodes_exactly_what_a_full_encoding_does():
    """Usage.json re-encodes only the spaces whose fields changed since the last answer:
    after every change below, its bytes parse to the full dict answer."""
    table, clock, meters = world(workers=2, slots=4)
    rendering = answer.Rendering()

    def rendered(ledger: Ledger) -> dict:
        snap = meter.snapshot(table, ledger, clock.now)
        fields, values = answer.columns(snap, {"o/b": 5 << 10})
        got = json.loads(rendering.spaces(snap.names, fields, values))
        assert got == answer.usage(snap, {"o/b": 5 << 10})["spaces"]
        return got

    first = rendered(SPACES)
    meters[0].loaded(1, clock.now - 2_000, memory_bytes=1 << 20)
    meters[1].end(2, meters[1].begin(), error=True)
    clock.now += 3 * S
    second = rendered(SPACES)
    assert second["o/b"]["loaded"] and second["o/c"]["errors"] == 1
    assert second["o/a"] == first["o/a"]  # untouched: kept as it was
    assert second["o/b"]["warm_s"] == 3 and second["o/b"]["mapped_kib"] == 5
    assert second["o/b"]["last_import_ms"] == 2.0
    clock.now += 2 * S  # only the open residency grows
    assert rendered(SPACES)["o/b"]["warm_s"] == 5
    # A space handed over to another name: the names differ, all is encoded again.
    grown = Ledger([*NAMES, "o/d"], offsets={}, retired={})
    assert rendered(grown)["o/d"]["requests"] == 0
    assert rendered(SPACES).keys() == set(NAMES)


def test_the_ledger_is_built_again_only_when_the_slot_log_changed(tmp_path):
    log = SlotLog(tmp_path / "slots.log", 4)
    log.allocate("o/a", lambda name: False, None)
    first = log.ledger()
    assert log.ledger() is first  # nothing new in the log: the same object
    log.allocate("o/b", lambda name: False, None)
    second = log.ledger()
    assert second is not first and second.names == ["o/a", "o/b"]
    # Another process appends (a worker's deploy): this one's next ledger has it.
    with open(tmp_path / "slots.log", "a") as f:
        f.write("2\to/c\n")
    assert log.ledger().names == ["o/a", "o/b", "o/c"]
