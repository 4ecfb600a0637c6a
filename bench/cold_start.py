"""Cold start of the onnx-tiny space, against the seed's 500 ms budget.

- reimport: a space released after idling is imported again (module + ONNX session +
  meter) through the registry's own load path, >= 200 cycles in one process;
- fresh: the first load in a fresh worker process, which includes importing
  onnxruntime and numpy (each sample is a new process booted like a worker).

Prints one JSON object with p50/p99 per scenario and their ratio to the budget.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

SPACE = "lee101/onnx-tiny"
BUDGET_MS = 500.0


async def timed_call(reg) -> float:
    t0 = time.perf_counter()
    active = await reg.lease(SPACE)
    reg.end_lease(active)
    return (time.perf_counter() - t0) * 1000


def footprint() -> dict[str, int]:
    """Live Python objects and modules are exact; RSS also shows the allocator warming
    up (measured here: a few KiB per cycle for the first ~1,000 cycles, then ~0)."""
    from polyserve.usage.meter import rss_bytes

    gc.collect()
    return {
        "objects": len(gc.get_objects()),
        "modules": len(sys.modules),
        "rss_kib": rss_bytes() // 1024,
    }


async def reimports(data_dir: Path, cycles: int) -> tuple[list[float], dict[str, int]]:
    """Release and re-import `cycles` times; returns the times and how much the process
    grew over the second half (0 objects and 0 modules when a release frees it all)."""
    now = [0.0]
    reg = harness.registry(data_dir, lambda: now[0])
    await timed_call(reg)  # the first load (onnxruntime import) is the other scenario
    samples = []
    before: dict[str, int] = {}
    for i in range(cycles):
        if i == cycles // 2:
            before = footprint()
        now[0] += 10.0
        assert await reg.reap() == [SPACE]
        samples.append(await timed_call(reg))
    after = footprint()
    return samples, {f"{k}_growth": after[k] - before[k] for k in after}


async def fresh_child(data_dir: Path) -> None:
    import anyio.to_thread

    import polyserve.app  # noqa: F401 - what a worker imports at boot

    await anyio.to_thread.run_sync(lambda: None)  # as the worker's lifespan does
    print(await timed_call(harness.registry(data_dir, time.monotonic)))


def fresh(data_dir: Path, processes: int) -> list[float]:
    argv = [sys.executable, __file__, "--fresh-child", str(data_dir)]
    return [
        float(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
        for _ in range(processes)
    ]


def summary(samples: list[float]) -> dict[str, float]:
    p50 = statistics.median(samples)
    p99 = (
        statistics.quantiles(samples, n=100, method="inclusive")[98]
        if len(samples) > 1
        else samples[0]
    )
    return {
        "n": len(samples),
        "p50_ms": round(p50, 3),
        "p99_ms": round(p99, 3),
        "p50_vs_budget": round(p50 / BUDGET_MS, 4),
        "p99_vs_budget": round(p99 / BUDGET_MS, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--processes", type=int, default=20)
    parser.add_argument("--fresh-child", type=Path)
    args = parser.parse_args()
    if args.fresh_child:
        asyncio.run(fresh_child(args.fresh_child))
        return
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        harness.publish_example(data_dir, SPACE)
        times, growth = asyncio.run(reimports(data_dir, args.cycles))
        result = {
            "scenario": "cold start (onnx-tiny)",
            "budget_ms": BUDGET_MS,
            "reimport": summary(times),
            "reimport_second_half": {"cycles": args.cycles - args.cycles // 2, **growth},
            "fresh_worker": summary(fresh(data_dir, args.processes)),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
