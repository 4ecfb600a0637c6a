"""One copy per host, measured: a generated 20 MiB MatMul model served by 8 workers, loaded
with polyserve.models.onnx_session (A) against a plain onnxruntime.InferenceSession (B,
what a space did before), two hosts side by side in one run.

For each: the workers' combined memory for the model once every worker has served it
(the growth of their summed Pss, in copies of the model; measured after a small model
has run in every worker, so that onnxruntime's own pages are not counted), the first
request after a
release (import + session + one inference), and warm requests of 1, 8 and 64 rows,
alternated between A and B. Prints one JSON object. Run by `make bench` (scenario
"model sharing"), or alone: `python bench/sharing.py --calls 50`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import harness
import httpx2
import matmul

SPACE = "bench/matmul"
WARMUP = "bench/warmup"  # a 512 KiB model
VARIANTS = {"shared": True, "plain": False}


def worker_pids(host: harness.Server) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(host.proc.pid)], capture_output=True, text=True
    ).stdout
    return [int(pid) for pid in out.split()]


def pss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) << 10
    return total


def every_worker_serves(host: harness.Server, workers: int, space: str) -> None:
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    while len(seen) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {workers} workers answered")
        r = httpx2.get(host.url + f"/s/{space}/", headers={"Connection": "close"}, timeout=60)
        seen.add(r.raise_for_status().json()["pid"])


def timed(client: httpx2.Client, path: str) -> float:
    t0 = time.perf_counter()
    client.get(path).raise_for_status()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--calls", type=int, default=50, help="timed calls per measure")
    args = parser.parse_args()
    model, small = matmul.model(), matmul.model(256, 512)
    copy = matmul.K * matmul.M * 4
    result: dict[str, dict[str, object]] = {v: {} for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-sharing-") as tmp:
        hosts: dict[str, harness.Server] = {}
        try:
            for name, shared in VARIANTS.items():
                host = hosts[name] = harness.polyserve(args.workers, Path(tmp) / name)
                harness.deploy(host.url, SPACE, "space.tar", matmul.space_tar(model, shared))
                harness.deploy(host.url, WARMUP, "warmup.tar", matmul.space_tar(small, shared))
                pids = worker_pids(host)
                cold = pss_bytes(pids)
                # onnxruntime's code pages, faulted in by a worker's first inference, are
                # paid once per worker whatever the models: a small model pays them first.
                every_worker_serves(host, args.workers, WARMUP)
                before = pss_bytes(pids)
                every_worker_serves(host, args.workers, SPACE)
                after = pss_bytes(pids)
                usage = httpx2.get(host.url + "/_polyserve/usage").json()["spaces"][SPACE]
                result[name].update(
                    host_memory_copies=round((after - before) / copy, 3),
                    with_first_inference_copies=round((after - cold) / copy, 3),
                    mapped_kib=usage["mapped_kib"],
                    memory_kib=usage["memory_kib"],
                )
            clients = {n: httpx2.Client(base_url=h.url, timeout=60) for n, h in hosts.items()}
            times: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
            for i in range(args.calls):  # alternated: the machine's noise hits both
                for name in VARIANTS if i % 2 == 0 else reversed(VARIANTS):
                    c = clients[name]
                    c.post(f"/_polyserve/spaces/{SPACE}/release").raise_for_status()
                    times[name].setdefault("first_after_release", []).append(
                        timed(c, f"/s/{SPACE}/")
                    )
            for rows in (1, 8, 64):  # one keep-alive connection: the worker that loaded it
                for i in range(args.calls):
                    for name in VARIANTS if i % 2 == 0 else reversed(VARIANTS):
                        times[name].setdefault(f"warm_{rows}_rows", []).append(
                            timed(clients[name], f"/s/{SPACE}/?rows={rows}")
                        )
            for c in clients.values():
                c.close()
        finally:
            for host in hosts.values():
                host.stop()
    for name, measures in times.items():
        for measure, values in measures.items():
            result[name][f"{measure}_p50_ms"] = harness.median(values)
    ratios = {
        key.removesuffix("_p50_ms"): round(result["shared"][key] / result["plain"][key], 3)
        for key in result["shared"]
        if key.endswith("_p50_ms")
    }
    print(
        json.dumps(
            {
                **result,
                "ratios": ratios,
                "model_mib": round(copy / (1 << 20), 1),
                "workers": args.workers,
                "calls": args.calls,
            }
        )
    )


if __name__ == "__main__":
    main()
