"""The fleet, measured against one host in the same run: deploys, catch-up, fleet usage.

Needs Debian's PostgreSQL (initdb, pg_ctl); prints one JSON object. Run by `make bench`
(bench/run.py, scenario "fleet"), or alone: `python bench/fleet.py --deploys 10`.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import harness
import httpx2

sys.path.insert(0, str(harness.REPO))
from polyserve.fleet.changes import Fit
from polyserve.fleet.db import FleetDB
from tests.postgres import PostgresServer, find_bindir


def source(n: int) -> bytes:
    return f"def handle(request):\n    return {{'v': {n}}}\n".encode()


def percentile(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def timed_deploy(url: str, space: str, n: int) -> tuple[float, dict]:
    t0 = time.perf_counter()
    body = harness.deploy(url, space, "v.py", source(n))
    return (time.perf_counter() - t0) * 1000, body


def fleet_hosts(tmp: Path, url: str, names: list[str], **env: str) -> list[harness.Server]:
    return [
        harness.polyserve(
            1,
            tmp / f"host-{name}",
            POLYSERVE_DATABASE_URL=url,
            POLYSERVE_HOST_ID=name,
            POLYSERVE_FLEET_POLL_S="0.5",
            **env,
        )
        for name in names
    ]


def live_hosts(url: str, n: int, timeout_s: float = 30) -> None:
    """Wait until the fleet lists `n` live hosts: one not there yet is not waited for."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hosts = httpx2.get(url + "/_polyserve/fleet", timeout=10).json()["hosts"]
        if sum(h["live"] for h in hosts) >= n:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the fleet never listed {n} live hosts")


def deploys(tmp: Path, url: str, n: int) -> dict:
    """Deploy -> 200 on all of 3 hosts, alternated with deploys to one host alone."""
    single, fleet = [], []
    with harness.polyserve(1, tmp / "single") as alone:
        hosts = fleet_hosts(tmp, url, ["a", "b", "c"])
        try:
            live_hosts(hosts[0].url, 3)  # a fast deploy must not beat a host's first heartbeat
            # Served on every host first: each then fetches every deploy's files as it
            # arrives (POLYSERVE_FLEET_FILES=served), the dearest case.
            timed_deploy(hosts[0].url, "bench/fleet", 0)
            for host in hosts:
                assert httpx2.get(f"{host.url}/s/bench/fleet/", timeout=30).status_code == 200
            for i in range(1, n + 1):
                ms, _ = timed_deploy(alone.url, "bench/one", i)
                single.append(ms)
                ms, body = timed_deploy(hosts[0].url, "bench/fleet", i)
                assert body["hosts"] == {"applied": 3, "live": 3}, body
                fleet.append(ms)
        finally:
            for host in hosts:
                host.stop()
    ratio = harness.median(fleet) / harness.median(single)
    return {
        "deploys": n,
        "single_host": {"p50_ms": harness.median(single), "p99_ms": percentile(single, 99)},
        "fleet_of_3": {"p50_ms": harness.median(fleet), "p99_ms": percentile(fleet, 99)},
        "p50_ratio": round(ratio, 2),
        "met": ratio <= 1.5,
    }


def cold_fetch(tmp: Path, url: str, n: int) -> dict:
    """A fleet host's first request for onnx-tiny whose files it never had (fetched from
    PostgreSQL, unpacked, imported), against a single host's first request after its
    deploy (imported from its own disk); a new space each time, alternated."""
    example = harness.REPO / "examples" / "python-onnx-tiny"
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        for path in sorted(example.iterdir()):
            if path.is_file():
                t.add(path, arcname=path.name)
    upload = tar.getvalue()
    local, fetched = [], []
    with harness.polyserve(1, tmp / "single") as alone:
        hosts = fleet_hosts(tmp, url, ["a", "b"])
        try:
            live_hosts(hosts[0].url, 2)
            for i in range(n):
                for receiving, serving, times in (
                    (alone, alone, local),
                    (hosts[0], hosts[1], fetched),
                ):
                    harness.deploy(receiving.url, f"bench/cold{i}", "onnx-tiny.tar", upload)
                    t0 = time.perf_counter()
                    r = httpx2.get(f"{serving.url}/s/bench/cold{i}/", timeout=60)
                    times.append((time.perf_counter() - t0) * 1000)
                    assert r.status_code == 200, r.text
        finally:
            for host in hosts:
                host.stop()
    ratio = harness.median(fetched) / harness.median(local)
    return {
        "spaces": n,
        "single_host_first_request": {"p50_ms": harness.median(local)},
        "fleet_host_fetching_first_request": {"p50_ms": harness.median(fetched)},
        "p50_ratio": round(ratio, 2),
        "met": ratio <= 3,
    }


def catch_up(tmp: Path, url: str, versions: int) -> dict:
    """A host that missed `versions` deploys (made while it was stopped) catching up."""
    db = FleetDB(url)
    (host,) = fleet_hosts(tmp, url, ["late"])
    host.stop()
    for i in range(versions):  # straight into the fleet: validation is not what is timed
        upload = io.BytesIO(source(i))
        db.deploy(f"bench/c{i % 100}", upload, _sha(source(i)), _meta(i), Fit("bench", 30, 0))
    last = db.last_change()
    t0 = time.perf_counter()
    (host,) = fleet_hosts(tmp, url, ["late"])
    try:
        ready = time.perf_counter() - t0
        while next(h for h in db.hosts(30) if h["id"] == "late")["applied"] < last:
            time.sleep(0.01)
        took = time.perf_counter() - t0
        first = httpx2.get(host.url + "/s/bench/c0/", timeout=30).json()  # fetched on use
    finally:
        host.stop()
        db.close()
    return {
        "versions": versions,
        "seconds_to_applied": round(took, 3),
        "host_start_s": round(ready, 3),
        "versions_per_s": round(versions / took, 1),
        "first_call_after": first,
        "met": versions / took >= 200,
    }


def fleet_usage(tmp: Path, url: str, spaces: int) -> dict:
    """GET /_polyserve/usage?scope=fleet with 3 hosts x `spaces` rows in the ledger."""
    db = FleetDB(url)
    totals = {f"bench/u{i}": (i, 0, 1000 * i, 10**6, 1, 500) for i in range(spaces)}
    for host in "xyz":
        # Only a host's current boot writes its rows (the ledger's fence): join first.
        db.join(host, f"http://{host}.invalid", "cpu", "boot-1")
        assert db.write_usage(host, "boot-1", totals)
    db.close()
    times = []
    (host,) = fleet_hosts(tmp, url, ["u"])
    try:
        body = httpx2.get(host.url + "/_polyserve/usage?scope=fleet", timeout=60).json()
        assert len(body["spaces"]) == spaces and body["spaces"]["bench/u7"]["requests"] == 21
        for _ in range(20):
            t0 = time.perf_counter()
            httpx2.get(host.url + "/_polyserve/usage?scope=fleet", timeout=60).raise_for_status()
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        host.stop()
    p50 = harness.median(times)
    return {
        "hosts": 3,
        "spaces": spaces,
        "p50_ms": p50,
        "p99_ms": percentile(times, 99),
        "met": p50 <= 100,
    }


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _meta(i: int) -> dict:
    return {
        "kind": "handle",
        "import_ms": 0.0,
        "entry": "v.py",
        "upload": "v.py",
        "size": len(source(i)),
        "sha256": _sha(source(i)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deploys", type=int, default=20)
    parser.add_argument("--versions", type=int, default=1000)
    parser.add_argument("--spaces", type=int, default=10_000)
    parser.add_argument("--cold", type=int, default=10)
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        print(json.dumps({"skipped": "PostgreSQL is not installed: apt-get install postgresql"}))
        return
    server = PostgresServer(bindir).start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    try:
        result = {
            "deploy": deploys(tmp / "d", server.create_database(), args.deploys),
            "catch_up": catch_up(tmp / "c", server.create_database(), args.versions),
            "cold_fetch": cold_fetch(tmp / "f", server.create_database(), args.cold),
            "fleet_usage": fleet_usage(tmp / "u", server.create_database(), args.spaces),
        }
    finally:
        server.destroy()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
