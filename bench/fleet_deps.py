"""Deploys with dependencies through a fleet of 3 hosts: what installing on every host costs.

Three kinds of deploy alternate in each round (order reversed every other round), all
through host a of a 3-host fleet on one PostgreSQL, every host installing from a
find-links directory of its own (no network): without dependencies, with a set every
host has installed already, and with a new set (a new version of polyserve-testpkg
each round) that every host installs before it applies the version. Prints one JSON
object. Needs Debian's PostgreSQL: `python bench/fleet_deps.py --rounds 8`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import harness
from fleet import fleet_hosts, live_hosts, timed_deploy

sys.path.insert(0, str(harness.REPO))
from tests.helpers import make_tar
from tests.postgres import PostgresServer, find_bindir
from tests.wheels import TESTPKG, make_testpkg

USES = (
    "import polyserve_testpkg as t\n"
    "def handle(request):\n    return {'version': t.__version__, 'n': %d}\n"
)


def deps_tar(n: int, version: str) -> bytes:
    files = {"main.py": USES % n, "requirements.txt": f"{TESTPKG}=={version}\n"}
    return make_tar(files)


def run(tmp: Path, url: str, rounds: int) -> dict:
    wheels = tmp / "wheels"
    wheels.mkdir()
    for i in range(rounds + 1):
        make_testpkg(wheels, f"1.{i}")
    hosts = []
    for name in "abc":
        own = tmp / f"wheels-{name}"
        shutil.copytree(wheels, own)
        env = {"POLYSERVE_DEPS_OFFLINE": "1", "POLYSERVE_DEPS_FIND_LINKS": str(own)}
        hosts.extend(fleet_hosts(tmp, url, [name], **env))
    times: dict[str, list[float]] = {"plain": [], "cached": [], "new": []}
    installs: list[float] = []
    try:
        a = hosts[0]
        live_hosts(a.url, 3)
        harness.deploy(a.url, "bench/cached0", "space.tar", deps_tar(0, "1.0"))  # every host has it
        for r in range(1, rounds + 1):
            kinds = ["plain", "cached", "new"]
            if r % 2 == 0:
                kinds.reverse()
            for kind in kinds:
                if kind == "plain":
                    ms, body = timed_deploy(a.url, "bench/plain", r)
                else:
                    version = "1.0" if kind == "cached" else f"1.{r}"
                    t0 = time.perf_counter()
                    body = harness.deploy(a.url, f"bench/{kind}", "space.tar", deps_tar(r, version))
                    ms = (time.perf_counter() - t0) * 1000
                    if kind == "new":
                        installs.append(body["dependencies"]["install_ms"])
                assert body["hosts"] == {"applied": 3, "live": 3}, body
                times[kind].append(ms)
    finally:
        for host in hosts:
            host.stop()
    result: dict = {"rounds": rounds}
    for kind, values in times.items():
        result[kind] = {"p50_ms": round(harness.median(values), 1), "max_ms": round(max(values), 1)}
    result["receiving_host_install_p50_ms"] = round(harness.median(installs), 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        sys.exit("needs PostgreSQL (initdb, pg_ctl)")
    server = PostgresServer(bindir).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run(Path(tmp), server.create_database(), args.rounds), indent=1))
    finally:
        server.destroy()


if __name__ == "__main__":
    main()
