"""The meter's cost per request: begin()+end() on a live table, against an empty baseline.

Both run in alternating rounds in one process (these machines are noisy: the ratio and
the per-request difference hold where absolute numbers drift). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from polyserve.state.shm import Table
from polyserve.usage.meter import CELLS, Meter, now_us


def metered(meter: Meter, n: int) -> float:
    begin, end = meter.begin, meter.end
    t0 = time.perf_counter_ns()
    for _ in range(n):
        end(3, begin(), False)
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
    rounds = []
    for _ in range(args.rounds):
        rounds.append((metered(meter, args.n), baseline(args.n)))
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
            }
        )
    )


if __name__ == "__main__":
    main()
