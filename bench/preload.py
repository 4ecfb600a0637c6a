"""Preload before fork, measured on real hosts: a fresh worker's first onnx-tiny load and
the memory it is billed for, and each worker's private memory (USS), with the default
POLYSERVE_PRELOAD against an empty one, alternated in one run.

Prints one JSON object. Run by `make bench` (scenario "preload"), or alone:
`python bench/preload.py --samples 10`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import harness
import httpx2

SPACE = "lee101/onnx-tiny"
VARIANTS = {"preload": "numpy,onnxruntime", "none": ""}


def example_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("main.py", "model.json", "model.onnx"):
            tar.add(harness.REPO / "examples" / "python-onnx-tiny" / name, arcname=name)
    return buf.getvalue()


def worker_pid(master: int) -> int:
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(master)], capture_output=True, text=True
    ).stdout.splitlines()
    (pid,) = [int(line.split()[0]) for line in out if "polyserve.deploy.forkserver" not in line]
    return pid


def uss_kib(pid: int) -> int:
    """Private_Clean + Private_Dirty: what this process alone holds."""
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1])
    return total


def fresh_worker(host: harness.Server) -> dict[str, float]:
    """Replace the worker (a graceful TERM: the master forks a fresh one), call the
    space once, and read what that first load cost."""
    master = host.proc.pid
    old = worker_pid(master)
    os.kill(old, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while True:
        try:
            pid = worker_pid(master)
            if (
                pid != old
                and httpx2.get(host.url + "/_polyserve/health", timeout=5).json()["pid"] == pid
            ):
                break
        except (ValueError, httpx2.HTTPError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("no fresh worker")
        time.sleep(0.05)
    booted_uss = uss_kib(pid)
    httpx2.get(host.url + f"/s/{SPACE}/", timeout=30).raise_for_status()
    space = httpx2.get(host.url + "/_polyserve/usage", timeout=30).json()["spaces"][SPACE]
    return {
        "load_ms": space["last_import_ms"],
        "memory_kib": space["memory_kib"],
        "worker_uss_kib_booted": booted_uss,
        "worker_uss_kib_loaded": uss_kib(pid),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=10, help="fresh workers per variant")
    args = parser.parse_args()
    tar = example_tar()
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-preload-") as tmp:
        hosts = {}
        try:
            for name, preload in VARIANTS.items():
                hosts[name] = harness.polyserve(1, Path(tmp) / name, POLYSERVE_PRELOAD=preload)
                harness.deploy(hosts[name].url, SPACE, "onnx-tiny.tar", tar)
            for _ in range(args.samples):  # alternated: the machine's noise hits both
                for name in VARIANTS:
                    samples[name].append(fresh_worker(hosts[name]))
        finally:
            for host in hosts.values():
                host.stop()
    result: dict[str, object] = {}
    for name, rows in samples.items():
        loads = sorted(r["load_ms"] for r in rows)
        p50 = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        result[name] = {
            "first_load_p50_ms": round(p50["load_ms"], 3),
            "first_load_p99_ms": round(loads[round(0.99 * (len(loads) - 1))], 3),
            "memory_kib_p50": p50["memory_kib"],
            "worker_uss_kib_booted_p50": p50["worker_uss_kib_booted"],
            "worker_uss_kib_loaded_p50": p50["worker_uss_kib_loaded"],
        }
    result["samples"] = args.samples
    print(json.dumps(result))


if __name__ == "__main__":
    main()
