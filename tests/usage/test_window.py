"""Unit tests of the recent-latency window: its quantiles, its marks and which it uses."""

from __future__ import annotations

import numpy as np

from polyserve.state.shm import Table
from polyserve.state.slots import Ledger
from polyserve.usage import histogram, meter
from polyserve.usage.meter import CELLS, Meter
from polyserve.usage.window import Window, quantiles


def counts(*pairs: tuple[int, int]) -> np.ndarray:
    row = np.zeros(histogram.BUCKETS, dtype=np.int64)
    for us, n in pairs:
        row[histogram.bucket(us)] += n
    return row


def test_a_quantile_interpolates_inside_its_bucket_row_by_row():
    rows = np.stack(
        [
            counts((30_000, 100)),  # all in (25 ms, 50 ms]
            counts((30_000, 100), (100, 100)),  # half at most 0.5 ms
            counts(),  # no requests
            counts((20_000_000, 3)),  # past the last bound
        ]
    )
    p50 = quantiles(rows, 0.5)
    assert p50[0] == 37_500 and p50[1] == 500 and np.isnan(p50[2]) and p50[3] == 10_000_000
    assert quantiles(rows, 0.99)[0] == 25_000 + 25_000 * 0.99
    assert quantiles(rows, 0.25)[1] == 250


class Clock:
    now = 0

    def __call__(self) -> int:
        return self.now


def test_the_window_reads_from_the_newest_mark_a_window_old():
    table, clock = Table.anonymous(2, 3, CELLS), Clock()
    ledger = Ledger(["o/a", "o/b"], {}, {})
    window = Window(table, lambda: ledger, clock=clock, window_s=60, step_s=5)
    meters = [Meter(table, row, clock=clock) for row in range(2)]

    def requests(n: int, took_us: int) -> None:
        for i in range(n):
            started = meters[i % 2].begin()
            clock.now += took_us
            meters[i % 2].end(0, started, error=False)

    clock.now = 1
    window.mark()
    assert window.latency(meter.snapshot(table, ledger, clock.now), clock.now)[0] == 0
    requests(50, 2_000)  # before the second mark: out of the window at the end
    clock.now = 15_000_000
    window.mark()
    requests(100, 300_000)
    requests(1, 4_000_000)
    for step in range(4, 16):
        clock.now = step * 5_000_000
        window.mark()
    assert len(window._marks) <= 60 // 5 + 2  # forgotten once no window needs them
    clock.now = 75_500_000
    snap = meter.snapshot(table, ledger, clock.now)
    span, p50, p99 = window.latency(snap, clock.now)
    assert span == 60.5  # since the mark at 15 s
    assert 250 < p50[0] <= 500 and 250 < p99[0] <= 500
    assert np.isnan(p50[1]) and np.isnan(p99[1])  # o/b answered nothing
    # A worker younger than the window reads from its first mark.
    young = Window(table, lambda: ledger, clock=clock)
    young.mark()
    requests(10, 1_500)
    span, p50, _ = young.latency(meter.snapshot(table, ledger, clock.now), clock.now)
    assert span == 0.015 and 1 < p50[0] <= 2.5


def test_a_slot_handed_over_in_the_window_counts_only_its_new_owner():
    table, clock = Table.anonymous(1, 2, CELLS), Clock()
    m = Meter(table, 0, clock=clock)
    before = Ledger(["o/old"], {}, {})
    ledger = before
    window = Window(table, lambda: ledger, clock=clock)
    for marked in (False, True):  # the old owner's, before and after the mark: slow
        if marked:
            window.mark()
        for _ in range(5):
            started = m.begin()
            clock.now += 3_000_000
            m.end(0, started, error=False)
    # o/old deleted, its slot handed to o/new: the log keeps o/old's totals, and o/new
    # counts from them.
    (kept,) = meter.totals_by_name(table, before, clock.now).values()
    ledger = Ledger(["o/new"], {0: tuple(-v for v in kept)}, {"o/old": kept})
    for _ in range(5):  # the new owner's: fast
        started = m.begin()
        clock.now += 700
        m.end(0, started, error=False)
    snap = meter.snapshot(table, ledger, clock.now)
    assert snap.names == ["o/new", "o/old"]
    _, p50, p99 = window.latency(snap, clock.now)
    assert 0.5 < p50[0] <= 1 and 0.5 < p99[0] <= 1  # ms: o/new's alone
    assert np.isnan(p50[1]) and np.isnan(p99[1])  # o/old serves nothing now
