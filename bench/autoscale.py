"""The autoscaler, measured: load to a new host serving, idle to the pool at its minimum
(local provider, real hosts, real PostgreSQL), and the decision loop's cost per host.

Prints one JSON object. Run by `make bench` (bench/run.py, scenario "autoscale"), or
alone: `python bench/autoscale.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness
import httpx2

sys.path.insert(0, str(harness.REPO))
from polyserve.autoscale import config as config_mod
from polyserve.autoscale.local import LocalProvider
from polyserve.autoscale.provider import HostSpec, Machine
from polyserve.autoscale.scaler import Scaler, scrape_usage
from polyserve.fleet.db import FleetDB
from tests.postgres import PostgresServer, find_bindir

BUSY = b"import time\ndef handle(request):\n    time.sleep(0.05)\n    return {'ok': True}\n"
# Shrunk from the defaults (15 s interval, 30 s up, 600 s down) so a run takes seconds;
# the figures below are these windows plus what the machinery adds.
WINDOWS = {
    "POLYSERVE_SCALE_INTERVAL_S": "1",
    "POLYSERVE_SCALE_UP_WINDOW_S": "2",
    "POLYSERVE_SCALE_DOWN_WINDOW_S": "5",
    "POLYSERVE_DRAIN_S": "1",
}


def live(db: FleetDB) -> list[dict]:
    return [h for h in db.hosts(10) if h["live"] and h["pool"] == "cpu"]


def wait(predicate, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.02)
    raise TimeoutError("autoscale bench: condition not met")


def scale_times(tmp: Path, url: str) -> dict:
    """`polyserve autoscale` between 1 and 2 hosts under a load of 6 clients."""
    hosts_dir = tmp / "hosts"
    env = {
        **os.environ,
        **WINDOWS,
        "POLYSERVE_DATABASE_URL": url,
        "POLYSERVE_LOCAL_DIR": str(hosts_dir),
        "POLYSERVE_CPU_MIN_WORKERS": "1",
        "POLYSERVE_CPU_MAX_WORKERS": "2",
        "POLYSERVE_AUTOSCALE_BIND": f"127.0.0.1:{harness.free_port()}",
        "POLYSERVE_FLEET_POLL_S": "0.5",
    }
    log = open(tmp / "autoscale.log", "wb")  # noqa: SIM115 - the process holds it
    proc = subprocess.Popen(
        [sys.executable, "-m", "polyserve.cli", "autoscale"],
        cwd=harness.REPO,
        env=env,
        stdout=log,
        stderr=log,
    )
    db = FleetDB(url)
    stop = threading.Event()
    try:
        first = wait(lambda: live(db))[0]
        harness.deploy(first["url"], "bench/busy", "main.py", BUSY)

        def client() -> None:
            with httpx2.Client(headers={"Connection": "close"}, timeout=30) as c:
                while not stop.is_set():
                    c.get(first["url"] + "/s/bench/busy/")

        threads = [threading.Thread(target=client) for _ in range(6)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()

        def second_serving() -> bool:
            for h in live(db):
                if h["id"] != first["id"]:
                    r = httpx2.get(h["url"] + "/s/bench/busy/", timeout=30)
                    return r.status_code == 200
            return False

        wait(second_serving)
        up_s = time.perf_counter() - t0
        stop.set()
        for t in threads:
            t.join()
        t1 = time.perf_counter()
        wait(lambda: len(list(hosts_dir.glob("*/machine.json"))) == 1)
        down_s = time.perf_counter() - t1
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        hosts = LocalProvider(hosts_dir, harness.REPO / "gunicorn.conf.py", 1)
        for machine in hosts.list("cpu"):
            hosts.delete(machine)  # by PID, checked against its start time
        db.close()
    return {
        "windows": WINDOWS,
        "load_to_new_host_serving_s": round(up_s, 2),
        "load_stopped_to_minimum_s": round(down_s, 2),
    }


def host_boot(tmp: Path, url: str) -> float:
    """The baseline: one fleet host started by hand, from exec to answering."""
    t0 = time.perf_counter()
    with harness.polyserve(1, tmp / "boot", POLYSERVE_DATABASE_URL=url):
        return round(time.perf_counter() - t0, 2)


class Listed:
    """A measuring rig, not a provider: lists `n` machines that are all one real host,
    so a step scrapes it n times."""

    name = "listed"

    def __init__(self, url: str, n: int) -> None:
        self.machines = [Machine(str(i), f"m{i}", "cpu", url, 0.0, "running") for i in range(n)]

    def list(self, pool: str) -> list[Machine]:
        return self.machines

    def create(self, spec: HostSpec) -> Machine:
        raise AssertionError("the rig never scales")

    def take_out(self, machine: Machine) -> None: ...
    def stop(self, machine: Machine, timeout_s: float) -> None: ...
    def delete(self, machine: Machine) -> None: ...


def loop_cost(tmp: Path, url: str, rounds: int) -> dict:
    """One step (list, scrape, decide) with n hosts, against a bare scrape of one."""
    env = {"POLYSERVE_DATABASE_URL": url, "POLYSERVE_CPU_MAX_WORKERS": "1000"}
    env["POLYSERVE_CPU_MIN_WORKERS"] = "0"
    config = config_mod.load(env)
    db = FleetDB(url)
    result: dict[str, object] = {}
    with harness.polyserve(1, tmp / "scraped") as host:
        bare = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            assert scrape_usage(host.url) is not None
            bare.append((time.perf_counter() - t0) * 1000)
        result["bare_scrape_ms"] = harness.median(bare)
        for n in (1, 10, 50):
            scaler = Scaler(config, db, {"cpu": Listed(host.url, n)}, dry_run=True)
            scaler.step()  # the baselines
            walls, cpus = [], []
            for _ in range(rounds):
                w0, c0 = time.perf_counter(), time.process_time()
                scaler.step()
                walls.append((time.perf_counter() - w0) * 1000)
                cpus.append((time.process_time() - c0) * 1000)
            scaler.close(1)
            result[f"step_{n}_hosts"] = {
                "wall_ms": harness.median(walls),
                "cpu_ms": harness.median(cpus),
            }
    db.close()
    per_host = (result["step_50_hosts"]["cpu_ms"] - result["step_1_hosts"]["cpu_ms"]) / 49
    result["cpu_ms_per_host_scraped"] = round(per_host, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        print(json.dumps({"skipped": "PostgreSQL is not installed: apt-get install postgresql"}))
        return
    logging_quiet()
    server = PostgresServer(bindir).start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-autoscale-"))
    try:
        result = {
            "host_boot_s": host_boot(tmp, server.create_database()),
            **scale_times(tmp, server.create_database()),
            "loop": loop_cost(tmp, server.create_database(), args.rounds),
        }
    finally:
        server.destroy()
    print(json.dumps(result))


def logging_quiet() -> None:
    import logging

    logging.getLogger("polyserve.autoscale").setLevel(logging.WARNING)


if __name__ == "__main__":
    main()
