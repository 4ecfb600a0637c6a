"""A kept version by name against the plain path, on the same space, in one process: the
worker's whole app serves keep-alive GETs of `/s/o/n@1/` (kept v1), `/s/o/n/` (current
v2) and `/s/o/n@2/` (current, by name) in alternating rounds; prints one JSON object (CPU
µs per request of each, and the ratios to the plain path).

The transport and the lifespan are bench/inprocess.py's: no sockets, so what is left
is the request path's own work, where a name's extra lookup would show.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import uvloop
from gunicorn.config import Config as GunicornConfig
from inprocess import Connection, lifespan  # bench/ is a folder of scripts, not a package
from starlette.testclient import TestClient

from polyserve import settings
from polyserve.app import create_app
from polyserve.http import strict

SPACE = "bench/pinned"
# Answers of one length: the two versions differ in a digit only.
SOURCE = "def handle(request):\n    return {{'version': {n}}}\n"
PATHS = {"kept": f"/s/{SPACE}@1/", "plain": f"/s/{SPACE}/", "current": f"/s/{SPACE}@2/"}


def request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:8441\r\n\r\n".encode()


async def rounds(count: int, n: int) -> dict[str, object]:
    host = create_app(settings.load())
    host.trust_forwarded(GunicornConfig().forwarded_allow_ips)  # as the worker does
    async with lifespan(host):
        sides = {
            name: Connection(strict.protocol(GunicornConfig()), host, request(path))
            for name, path in PATHS.items()
        }
        for side in sides.values():  # the loads, then warm
            await side.per_request_us(n)
        for name, side in sides.items():
            answer = await side.answer_bytes()
            wanted = b'{"version":1}' if name == "kept" else b'{"version":2}'
            assert answer.endswith(wanted), (name, answer)
        leases = lease_ns(host.control.running.registry, count * 10, n)
        got: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for round_ in range(count):
            turn = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in turn:
                got[name].append(await sides[name].per_request_us(n))
    medians = {name: statistics.median(values) for name, values in got.items()}
    plain = medians["plain"]
    return {
        "requests_per_round": n,
        "rounds": count,
        **{f"{name}_median_us": round(value, 2) for name, value in medians.items()},
        "kept_over_plain": round(medians["kept"] / plain, 3),
        "current_over_plain": round(medians["current"] / plain, 3),
        **leases,
        "kept_minus_plain_median_us": round(
            statistics.median(k - p for k, p in zip(got["kept"], got["plain"], strict=True)), 2
        ),
    }


def lease_ns(registry: Any, count: int, n: int) -> dict[str, float]:
    """The registry's warm lease alone, ns per call (and its end_lease), median of
    `count` alternating rounds of `n` calls: plain, kept by name, current by name."""
    calls: dict[str, Callable[[], Any]] = {
        "plain": lambda: registry.lease_current(SPACE),
        "kept": lambda: registry.lease_named(SPACE, "1"),
        "current": lambda: registry.lease_named(SPACE, "2"),
    }
    got: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(count):
        for name, call in calls.items():
            end = registry.end_lease
            start = time.perf_counter_ns()
            for _ in range(n):
                end(call())
            got[name].append((time.perf_counter_ns() - start) / n)
    return {f"lease_{name}_ns": round(statistics.median(v)) for name, v in got.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--requests", type=int, default=200, help="per round and side")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="polyserve-pinned-") as data:
        os.environ["POLYSERVE_DATA_DIR"] = data
        # Deployed through the control plane, on another thread's loop, as a test does.
        with TestClient(create_app(settings.load()), client=("127.0.0.1", 50000)) as c:
            for n in (1, 2):
                module = SOURCE.format(n=n).encode()
                r = c.post(
                    "/_polyserve/deploy",
                    data={"space": SPACE},
                    files={"module": ("main.py", module)},
                )
                assert r.status_code == 200, r.text
        print(json.dumps(uvloop.run(rounds(args.rounds, args.requests)), indent=1))


if __name__ == "__main__":
    main()
