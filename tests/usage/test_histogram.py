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
