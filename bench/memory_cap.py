"""Memory cap: many ~1 MiB spaces called round-robin on one worker, capped and not.

The spaces are published into one data directory with the store's own API (a deploy
through HTTP would time the validator 3,000 times). Each host is one worker; the same
data directory serves both, one after the other. Each space counts its requests since
its import, so the client knows which answers were cold starts. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
import httpx2

SPACE = """\
DATA = bytearray(MIB << 20)  # anonymous memory, touched (zeroed) at import
CALLS = 0


def handle(request):
    global CALLS
    CALLS += 1
    return {"calls": CALLS}  # 1: this request imported the space
"""


def publish(data_dir: Path, spaces: int, mib: int) -> None:
    from polyserve.state.store import Store

    store = Store(data_dir, spaces)
    source = SPACE.replace("MIB", str(mib)).encode()
    for i in range(spaces):
        staged = store.stage(io.BytesIO(source), "space.py", 1 << 20)
        with store.locked():
            store.publish(f"bench/m{i}", staged, {"kind": "handle", "import_ms": 0})


def worker_pid(master: int) -> int:
    """The host's one worker: the master's child that is not its validation fork server
    (whose ~70 MiB, read instead, hid the worker's figures)."""
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"polyserve.deploy.forkserver" not in cmdline:
            return int(child)
    raise RuntimeError("the host has no worker")


def kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def released(usage: dict) -> int:
    return sum(u["released_memory"] for u in usage["spaces"].values())


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return round(values[0], 3) if values else 0.0
    return round(statistics.quantiles(values, n=100, method="inclusive")[98], 3)


def run(data_dir: Path, spaces: int, passes: int, cap_mb: int) -> dict[str, object]:
    """`passes` round-robin passes over every space on a one-worker host."""
    env = {"POLYSERVE_MAX_SPACES": str(spaces), "POLYSERVE_WORKER_MEMORY_MB": str(cap_mb)}
    cold, warm, errors, peak_anon = [], [], 0, 0
    with harness.polyserve(1, data_dir, **env) as host, httpx2.Client(base_url=host.url) as c:
        pid = worker_pid(host.proc.pid)
        before = released(c.get("/_polyserve/usage").json())  # the earlier run's, restored
        t0 = time.perf_counter()
        for _ in range(passes):
            for i in range(spaces):
                started = time.perf_counter()
                r = c.get(f"/s/bench/m{i}/")
                took = (time.perf_counter() - started) * 1000
                if r.status_code != 200:
                    errors += 1
                    if errors == 1:
                        print(f"first error: {r.status_code} {r.text}", file=sys.stderr)
                    continue
                (cold if r.json()["calls"] == 1 else warm).append(took)
                peak_anon = max(peak_anon, kib(pid, "RssAnon"))  # what the cap bounds
        seconds = time.perf_counter() - t0
        high_water = kib(pid, "VmHWM")  # the kernel's own peak RSS of the worker
        memory = released(c.get("/_polyserve/usage").json()) - before
    requests = passes * spaces
    return {
        "cap_mb": cap_mb,
        "requests": requests,
        "errors": errors,
        "hit_rate": round(len(warm) / requests, 4),
        "cold_starts": len(cold),
        "cold_start_p50_ms": round(statistics.median(cold), 3) if cold else 0.0,
        "cold_start_p99_ms": p99(cold),
        "warm_p50_ms": round(statistics.median(warm), 3) if warm else 0.0,
        "peak_rss_mb": round(high_water / 1024, 1),
        "peak_anon_mb": round(peak_anon / 1024, 1),  # sampled after each request
        "released_memory": memory,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spaces", type=int, default=3000)
    parser.add_argument("--mib", type=int, default=1, help="memory each space holds")
    parser.add_argument("--cap-mb", type=int, default=512)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="polyserve-memcap-") as tmp:
        data_dir = Path(tmp) / "data"
        t0 = time.perf_counter()
        publish(data_dir, args.spaces, args.mib)
        print(f"published in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        capped = run(data_dir, args.spaces, args.passes, args.cap_mb)
        uncapped = run(data_dir, args.spaces, args.passes, 0)
    out = {"spaces": args.spaces, "mib": args.mib, "capped": capped, "uncapped": uncapped}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
