"""Per-space logs' costs: the context variable every request sets, and a record a space prints.

The request path pays one ContextVar set and reset (against the same loop without it, in
alternating rounds). A space pays for what it says: a print kept (its log file and the
echo to the host's log) and a print dropped by POLYSERVE_LOG_RATE. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from polyserve.logs import spacelog
from polyserve.logs.logstore import LogStore


def with_var(tag: spacelog.Tag, n: int) -> float:
    current = spacelog.RUNNING
    t0 = time.perf_counter_ns()
    for _ in range(n):
        token = current.set(tag)
        try:
            pass
        finally:
            current.reset(token)
    return (time.perf_counter_ns() - t0) / n


def baseline(n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        try:
            pass
        finally:
            pass
    return (time.perf_counter_ns() - t0) / n


def prints(tag: spacelog.Tag, n: int) -> float:
    """print() as a space calls it: the text, a separator, a number and the newline."""
    token = spacelog.RUNNING.set(tag)
    try:
        t0 = time.perf_counter_ns()
        for i in range(n):
            print("a line of about forty characters", i)
        return (time.perf_counter_ns() - t0) / n
    finally:
        spacelog.RUNNING.reset(token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    result: dict[str, object] = {"scenario": "logs", "rounds": args.rounds}
    tag = spacelog.Tag("o/s", 1, None)
    rounds = [(with_var(tag, args.n), baseline(args.n)) for _ in range(args.rounds)]
    result["request_contextvar_ns_p50"] = round(statistics.median(a - b for a, b in rounds), 1)
    # The host's log as a worker has it (a formatted line per record), to /dev/null.
    host_log = logging.getLogger("polyserve")
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - for the run
    handler.setFormatter(
        logging.Formatter("[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s")
    )
    host_log.handlers, host_log.propagate = [handler], False
    host_log.setLevel(logging.INFO)
    out = sys.stdout
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the host's own stdout, unused here
    store = LogStore(Path(tempfile.mkdtemp()) / "logs", 1 << 20)
    try:
        n = max(args.n // 100, 100)
        capture = spacelog.start_capture(store, rate=10**9)
        kept = statistics.median(prints(spacelog.tag("o/kept", 1), n) for _ in range(5))
        spacelog.stop_capture(capture)
        capture = spacelog.start_capture(store, rate=1)
        noisy = spacelog.tag("o/noisy", 1)
        prints(noisy, 20)  # past its burst: what follows is dropped
        dropped = statistics.median(prints(noisy, n) for _ in range(5))
        spacelog.stop_capture(capture)
    finally:
        sys.stdout = out
    result["kept_print_us_p50"] = round(kept / 1000, 2)
    result["dropped_print_us_p50"] = round(dropped / 1000, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
