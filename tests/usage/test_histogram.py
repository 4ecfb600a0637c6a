"""Unit tests of the request-duration histogram: its bucket function, cells and exposition."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from polyserve.state.shm import Table
from polyserve.state.slots import Ledger
from polyserve.usage import histogram, meter, prometheus
from polyserve.usage.meter import CELLS, DURATION, DURATION_END, Cell, Meter


def test_a_duration_goes_to_the_first_bucket_whose_bound_holds_it():
    assert histogram.bucket(0) == 0
    assert histogram.bucket(500) == 0  # le: the bound itself is inside
    assert histogram.bucket(501) == 1
    assert histogram.bucket(10_000_000) == histogram.BUCKETS - 2
    assert histogram.bucket(10_000_001) == histogram.BUCKETS - 1  # +Inf
    for i, bound in enumerate(histogram.BOUNDS_US):
        assert histogram.bucket(bound) == i and histogram.bucket(bound + 1) == i + 1


class Clock:
    now = 0

    def __call__(self) -> int:
        return self.now


def test_requests_of_two_workers_sum_into_cumulative_buckets_with_count_and_sum():
    table, clock = Table.anonymous(2, 2, CELLS), Clock()
    meters = [Meter(table, row, clock=clock) for row in range(2)]
    took = [300, 700, 700, 40_000, 3_000_000, 20_000_000]
    for i, us in enumerate(took):
        clock.now = 0
        started = meters[i % 2].begin()
        clock.now = us
        meters[i % 2].end(0, started, error=False)
    snap = meter.snapshot(table, Ledger(["o/a"], {}, {}), 0)
    cells = snap.totals[0, DURATION:DURATION_END].tolist()
    assert sum(cells) == len(took) and snap.totals[0, Cell.BUSY_US] == sum(took)
    text = prometheus.exposition(snap).decode()
    (family,) = [
        f
        for f in text_string_to_metric_families(text)
        if f.name == "polyserve_space_request_duration_seconds"
    ]
    assert family.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert buckets["0.0005"] == 1 and buckets["0.001"] == 3 and buckets["0.05"] == 4
    assert buckets["2.5"] == 4 and buckets["5"] == 5 and buckets["10"] == 5
    assert buckets["+Inf"] == len(took)
    values = list(buckets.values())
    assert values == sorted(values)  # cumulative
    count = [s.value for s in family.samples if s.name.endswith("_count")]
    total = [s.value for s in family.samples if s.name.endswith("_sum")]
    assert count == [len(took)] and abs(total[0] - sum(took) / 1e6) < 1e-9


def test_a_checkpoint_restores_the_histogram_cells(tmp_path):
    table, clock = Table.anonymous(1, 2, CELLS), Clock()
    m = Meter(table, 0, clock=clock)
    started = m.begin()
    clock.now = 2_000
    m.end(0, started, error=False)
    ledger = Ledger(["o/a"], {}, {})
    meter.checkpoint(table, ledger, tmp_path / "usage.json", 0)
    restored = meter.checkpoint_totals(tmp_path / "usage.json", ledger)
    assert restored is not None
    assert restored[0, DURATION + histogram.bucket(2_000)] == 1
    assert restored[0, Cell.BUSY_US] == 2_000


def test_a_batch_goes_to_the_first_power_of_two_that_holds_its_rows():
    assert [histogram.row_bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 1024)] == [
        0,
        1,
        2,
        2,
        3,
        3,
        4,
        10,
    ]
    assert histogram.row_bucket(1025) == histogram.ROW_BUCKETS - 1  # +Inf
    assert histogram.row_bucket(1 << 20) == histogram.ROW_BUCKETS - 1
    for i, bound in enumerate(histogram.ROW_BOUNDS):
        assert histogram.row_bucket(bound) == i


def test_batched_counts_and_first_bytes_land_in_their_cells_and_a_checkpoint(tmp_path):
    table, clock = Table.anonymous(2, 2, CELLS), Clock()
    counts = meter.BatchCounts()

    class Call:
        def __init__(self, queued_at: int) -> None:
            self.queued_at = queued_at

    counts.ran(1, [Call(10_000)], 15_000)  # one call queued 5 µs
    counts.ran(3, [], 0)  # its calls left the queue: counted as a batch, no call
    counts.ran(64, [Call(0), Call(1_000_000)], 4_000_000)  # queued 4 ms and 3 ms
    m = Meter(table, 1, clock=clock)
    m.batched(1, counts)
    assert not counts and (counts.batches, counts.rows, counts.queue_ns) == (0, 0, 0)
    started = m.begin()
    clock.now = 40_000
    m.first_byte(1, started)
    ledger = Ledger(["o/a", "o/b"], {}, {})
    snap = meter.snapshot(table, ledger, 0)
    t = snap.totals[1]
    assert t[Cell.BATCHES] == 3 and t[Cell.BATCH_ROWS] == 68
    assert t[meter.BATCH_SIZE : meter.BATCH_SIZE + histogram.ROW_BUCKETS].tolist()[:7] == [
        1,
        0,
        1,
        0,
        0,
        0,
        1,
    ]
    assert t[meter.QUEUE_US] == 7_005 and t[meter.FIRST_BYTE_US] == 40_000
    assert t[meter.FIRST_BYTE + histogram.bucket(40_000)] == 1
    families = {
        f.name: f for f in text_string_to_metric_families(prometheus.exposition(snap).decode())
    }

    def samples(name: str, suffix: str) -> dict[str, float]:
        return {
            s.labels.get("le", ""): s.value
            for s in families[name].samples
            if s.labels["space"] == "o/b" and s.name.endswith(suffix)
        }

    rows = samples("polyserve_space_batch_rows", "_bucket")
    assert rows["1"] == 1 and rows["2"] == 1 and rows["4"] == 2 and rows["64"] == 3
    assert samples("polyserve_space_batch_rows", "_sum") == {"": 68}
    assert samples("polyserve_space_batch_rows", "_count") == {"": 3}
    queue = samples("polyserve_space_batch_queue_seconds", "_bucket")
    assert queue["1e-05"] == 1 and queue["0.0025"] == 1 and queue["0.005"] == 3
    assert samples("polyserve_space_batch_queue_seconds", "_sum") == {"": 0.007005}
    assert samples("polyserve_space_first_byte_seconds", "_count") == {"": 1}
    meter.checkpoint(table, ledger, tmp_path / "usage.json", 0)
    restored = meter.checkpoint_totals(tmp_path / "usage.json", ledger)
    assert restored is not None
    assert restored[1].tolist() == snap.totals[1].tolist()
