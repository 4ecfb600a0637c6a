"""Density: many distinct onnx-tiny spaces loaded in one worker, and the memory each adds.

Each space is its own published version (its own files, module namespace and ONNX
session), loaded through the registry as a worker loads it. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from polyserve.usage.meter import rss_bytes


async def load_all(data_dir: Path, spaces: int) -> dict[str, float]:
    reg = harness.registry(data_dir, time.monotonic, max_spaces=spaces)

    async def call(i: int) -> None:
        reg.end_lease(await reg.lease(f"bench/s{i}"))

    await call(0)  # the first load brings onnxruntime and numpy in: not per-space memory
    gc.collect()
    rss0, threads0 = rss_bytes(), threading.active_count()
    t0 = time.perf_counter()
    for i in range(1, spaces):
        await call(i)
    took = time.perf_counter() - t0
    gc.collect()
    assert len(reg.active) == spaces
    return {
        "spaces_loaded": spaces,
        "kib_per_space": round((rss_bytes() - rss0) / 1024 / (spaces - 1), 1),
        "threads_added": threading.active_count() - threads0,
        "load_ms_per_space": round(took * 1000 / (spaces - 1), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spaces", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.spaces):
            harness.publish_example(Path(tmp), f"bench/s{i}", max_spaces=args.spaces)
        print(json.dumps(asyncio.run(load_all(Path(tmp), args.spaces))))


if __name__ == "__main__":
    main()
