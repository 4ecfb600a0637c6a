"""The meter's cost per request: begin()+end() on a live table, against an empty baseline.

Both run in alternating rounds in one process (these machines are noisy: the ratio and
the per-request difference hold where absolute numbers drift). With them, the other
histograms' work: a stream's first_byte(), and what a lone batched call adds to the
batch counting it had before them (two increments and two stores), both less the same
empty baseline. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from polyserve.state.shm import Table
from polyserve.usage.meter import CELLS, BatchCounts, Cell, Meter, now_us


def metered(meter: Meter, n: int) -> float:
    begin, end = meter.begin, meter.end
    t0 = time.perf_counter_ns()
    for _ in range(n):
        end(3, begin(), False)
    return (time.perf_counter_ns() - t0) / n


def first_bytes(meter: Meter, n: int) -> float:
    """A stream's first body bytes: first_byte() with a start, as tracking_send calls it."""
    first_byte, started = meter.first_byte, time.monotonic_ns()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        first_byte(3, started)
    return (time.perf_counter_ns() - t0) / n


class _Call:
    __slots__ = ("queued_at",)

    def __init__(self) -> None:
        self.queued_at = time.monotonic_ns()  # the batcher's _Call takes the same


def batch_counting(meter: Meter, n: int) -> float:
    """A lone batched call, as the batcher and dispatch count it: its enqueue time, its
    batch's start, BatchCounts.ran and the flush."""
    counts, clock, batched = BatchCounts(), time.monotonic_ns, meter.batched
    t0 = time.perf_counter_ns()
    for _ in range(n):
        call = _Call()
        counts.ran(1, (call,), clock())
        if counts.batches:
            batched(3, counts)
    return (time.perf_counter_ns() - t0) / n


def batch_counting_before(meter: Meter, n: int) -> float:
    """The same call before the histograms: two increments on the tag, two stores."""
    words, base = meter.words, meter._row + 3 * CELLS
    batches_at, rows_at = base + Cell.BATCHES, base + Cell.BATCH_ROWS

    class Tag:
        batches = batch_rows = 0

    class Call:  # the call object without its clock read
        __slots__ = ()

    tag = Tag()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        Call()
        tag.batches += 1
        tag.batch_rows += 1
        if tag.batches:
            words[batches_at] += tag.batches
            words[rows_at] += tag.batch_rows
            tag.batches = tag.batch_rows = 0
    return (time.perf_counter_ns() - t0) / n


def baseline(n: int) -> float:
    """The same loop and the same two clock reads, with no table writes."""
    clock = now_us
    t0 = time.perf_counter_ns()
    for _ in range(n):
        clock()
        clock()
    return (time.perf_counter_ns() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    table = Table.anonymous(8, 4096, CELLS)
    meter = Meter(table, 2)
    rounds, extra = [], []
    for _ in range(args.rounds):
        rounds.append((metered(meter, args.n), baseline(args.n)))
        extra.append(
            (
                first_bytes(meter, args.n),
                batch_counting(meter, args.n),
                batch_counting_before(meter, args.n),
            )
        )
    per_request = [m for m, _ in rounds]
    overhead = [m - b for m, b in rounds]
    print(
        json.dumps(
            {
                "scenario": "metering",
                "rounds": args.rounds,
                "requests_per_round": args.n,
                "metered_ns_p50": round(statistics.median(per_request), 1),
                "baseline_ns_p50": round(statistics.median(b for _, b in rounds), 1),
                "meter_writes_ns_p50": round(statistics.median(overhead), 1),
                "ratio_p50": round(statistics.median(m / b for m, b in rounds), 2),
                "goal_ns": 1000,
                "first_byte_ns_p50": round(statistics.median(f for f, _, _ in extra), 1),
                "batch_counting_ns_p50": round(statistics.median(b for _, b, _ in extra), 1),
                "batch_counting_before_ns_p50": round(statistics.median(b for _, _, b in extra), 1),
                "batch_histograms_add_ns_p50": round(
                    statistics.median(b - before for _, b, before in extra), 1
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
