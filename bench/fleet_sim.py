"""The fleet at size: N real follower processes and M spaces on one PostgreSQL, measured.

Each simulated host is the process a fleet host's master starts (polyserve.fleet.follower,
started by the master's own hooks._start_follower) with a data directory, a shared table
and a boot of its own, but no gunicorn and no workers behind it. One real host (gunicorn,
one worker) joins them and takes the deploys; a single host (no database) takes the same
deploys alternately. The M spaces are the rows ChangeLog.deploy writes, one real deploy
copied in bulk (no validation, no fork per space). Followers fetch files only for spaces
they have files of (POLYSERVE_FLEET_FILES=served, the default): they never served any, so
each deploy moves only its pointer there, and takes no table slot. At the end the real
host serves 10 of the spaces, and the slots and versions' files it then holds are counted
(`served_few`). Prints one JSON object. Alone:
`python bench/fleet_sim.py --followers 50 --spaces 100000`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import harness
import httpx2

sys.path.insert(0, str(harness.REPO))
from psycopg.types.json import Jsonb

from polyserve.fleet import follower
from polyserve.fleet.changes import Change, Fit
from polyserve.fleet.client import FleetClient
from polyserve.fleet.db import FleetDB
from polyserve.fleet.schema import CHANGE_LOCK
from polyserve.master.hooks import _start_follower, worker_rows
from polyserve.procs import stop_child
from polyserve.settings import load
from polyserve.state.shm import Table, segment_name
from polyserve.state.store import Store
from polyserve.usage import meter
from tests.postgres import PostgresServer, find_bindir

LIVE_S = 30.0  # POLYSERVE_FLEET_LIVE_S: 2 shared cores may hold a heartbeat back a while
# The followers' usage write sums their whole table (every slot, as the master's
# checkpoint does: issue 30, item 4): once at the join, then not again during the run.
CHECKPOINT_S = "3600"


def source(n: int) -> bytes:
    return f"def handle(request):\n    return {{'v': {n}}}\n".encode()


def percentile(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))], 1)


def figures(values: list[float]) -> dict[str, float]:
    return {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99)}


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """os.environ with `env` over it: the master's _start_follower hands its own on."""
    before = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


class SimHost:
    """A fleet host without gunicorn: what the master sets up before its follower (the
    data directory, the shared table, the boot), then the follower itself."""

    def __init__(self, root: Path, name: str, url: str, max_spaces: int) -> None:
        self.name, self.url = name, url
        self.env = {
            "POLYSERVE_DATA_DIR": str(root / name),
            "POLYSERVE_HOST_ID": name,
            "POLYSERVE_ADVERTISE_URL": f"http://{name}.invalid",
            "POLYSERVE_MAX_SPACES": str(max_spaces),
            "POLYSERVE_FLEET_LIVE_S": str(LIVE_S),
            "POLYSERVE_FLEET_POLL_S": "1",
            "POLYSERVE_CHECKPOINT_INTERVAL": CHECKPOINT_S,
            "POLYSERVE_WORKERS": "1",
        }
        s = load(self.env)
        self.store = Store(s.data_dir, s.max_spaces, s.keep_versions)
        name_ = segment_name(str(self.store.root))
        self.table = Table.create(name_, worker_rows(s.workers), s.max_spaces, meter.CELLS)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        follower.start_boot(self.store, self.table, settled=True)
        with environ(self.env):
            self.proc = _start_follower(self.url)

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc, 15)

    def close(self) -> None:
        self.stop()
        self.table.close(unlink=True)

    def rss_kib(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0


def seed(db: FleetDB, url: str, spaces: int) -> float:
    """`spaces` deployed spaces: one real deploy, its rows copied for the rest in one
    transaction under the change log's lock (as ChangeLog.deploy holds it)."""
    t0 = time.perf_counter()
    first = _deploy(db, "sim/s0", 0)
    with db.session() as conn:
        meta = conn.execute(
            "SELECT sha256, meta, data FROM polyserve_versions WHERE space = %s", (first.space,)
        ).fetchone()
    assert meta is not None
    with _bulk(url) as conn:
        rest = (1, spaces - 1)
        conn.execute(
            "INSERT INTO polyserve_spaces (name, last_version, current_version)"
            " SELECT 'sim/s' || i, 1, 1 FROM generate_series(%s::int, %s::int) i",
            rest,
        )
        conn.execute(
            "INSERT INTO polyserve_versions (space, number, sha256, meta, data)"
            " SELECT 'sim/s' || i, 1, %s, %s, %s FROM generate_series(%s::int, %s::int) i",
            (meta[0], Jsonb(meta[1]), meta[2], *rest),
        )
        conn.execute(
            "INSERT INTO polyserve_changes (id, space, kind, version)"
            " SELECT %s + i, 'sim/s' || i, 'deploy', 1 FROM generate_series(%s::int, %s::int) i",
            (first.id, *rest),
        )
    return time.perf_counter() - t0


def behind(db: FleetDB, url: str, spaces: int, versions: int) -> int:
    """`versions` more deploys over the first spaces (a new version each), as seed()
    writes them; returns the last change's id."""
    start = db.last_change()
    with _bulk(url) as conn:
        conn.execute(
            "CREATE TEMP TABLE sim_behind AS SELECT i, 'sim/s' || (i %% %s::int) AS space,"
            " 2 + i / %s::int AS number FROM generate_series(0, %s::int) i",
            (spaces, spaces, versions - 1),
        )
        conn.execute(
            "INSERT INTO polyserve_versions (space, number, sha256, meta, data)"
            " SELECT b.space, b.number, v.sha256, v.meta || jsonb_build_object('version',"
            " b.number), v.data FROM sim_behind b JOIN polyserve_versions v"
            " ON v.space = 'sim/s0' AND v.number = 1"
        )
        conn.execute(
            "UPDATE polyserve_spaces s SET last_version = m.number, current_version = m.number"
            " FROM (SELECT space, max(number) AS number FROM sim_behind GROUP BY space) m"
            " WHERE s.name = m.space"
        )
        conn.execute(
            "INSERT INTO polyserve_changes (id, space, kind, version)"
            " SELECT %s + 1 + i, space, 'deploy', number FROM sim_behind",
            (start,),
        )
    return start + versions


@contextlib.contextmanager
def _bulk(url: str) -> Iterator[object]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (CHANGE_LOCK,))
        yield conn


def _deploy(db: FleetDB, space: str, n: int) -> Change:
    """A commit as a host's deploy makes it, after its validation (Fit as FleetClient's)."""
    data = source(n)
    sha = hashlib.sha256(data).hexdigest()
    meta = {"kind": "handle", "import_ms": 0.0, "entry": "v.py", "upload": "v.py"}
    meta |= {"size": len(data), "sha256": sha}
    return db.deploy(space, io.BytesIO(data), sha, meta, Fit("real", LIVE_S, len(data)))


def wait_applied(db: FleetDB, hosts: int, change_id: int, timeout_s: float = 600) -> None:
    """Until `hosts` live hosts have applied `change_id`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = db.hosts(LIVE_S)
        if sum(1 for h in rows if h["live"] and h["applied"] >= change_id) >= hosts:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{hosts} hosts never applied change {change_id}")


def cpu_s(pids: list[int]) -> float:
    """The CPU seconds (user and system) these processes have used so far."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def postgres_pids(server: PostgresServer) -> list[int]:
    """The server's processes: the postmaster and its children (backends, workers)."""
    master = int((server.data / "postmaster.pid").read_text().split()[0])
    found = [master]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == master:
                found.append(int(stat.parent.name))
    return found


def level(
    db: FleetDB,
    client: FleetClient,
    hosts: tuple[harness.Server, harness.Server],
    cpu: tuple[list[int], list[int]],
    n: int,
    k: int,
) -> dict:
    """`k` rounds at this fleet size: a deploy to the single host, one to the fleet's real
    host (its 200 waits for every live host), and a commit timed to every host's
    acknowledgement by FleetClient.applied, the very wait that 200 is."""
    alone, real = hosts
    single, fleet, commit, ack = [], [], [], []
    followers_cpu, postgres_cpu = cpu_s(cpu[0]), cpu_s(cpu[1])
    for i in range(k):
        t0 = time.perf_counter()
        harness.deploy(alone.url, "bench/one", "v.py", source(i))
        single.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        body = harness.deploy(real.url, "sim/deploy", "v.py", source(i))
        fleet.append((time.perf_counter() - t0) * 1000)
        assert body["hosts"] == {"applied": n + 1, "live": n + 1}, body
        t0 = time.perf_counter()
        change = _deploy(db, "sim/ack", i)
        t1 = time.perf_counter()
        status, hosts = asyncio.run(client.applied(change))
        assert status == 200 and hosts["applied"] == n + 1, hosts
        commit.append((t1 - t0) * 1000)
        ack.append((time.perf_counter() - t0) * 1000)
    changes = 2 * k  # the fleet's deploy and the timed commit, each round
    followers_cpu = (cpu_s(cpu[0]) - followers_cpu) * 1000 / changes / max(n, 1)
    postgres_cpu = (cpu_s(cpu[1]) - postgres_cpu) * 1000 / changes
    ratio = percentile(fleet, 50) / percentile(single, 50)
    return {
        "followers": n,
        "single_host_deploy": figures(single),
        "fleet_deploy": figures(fleet),
        "p50_ratio": round(ratio, 2),
        "commit": figures(commit),
        "acknowledged_by_all": figures(ack),
        "ack_p50_ratio_to_single": round(percentile(ack, 50) / percentile(single, 50), 2),
        "connections": database(db.url, tables=False)["connections"],
        # Per change: one follower's CPU, and the database server's for all hosts. On a
        # machine whose cores the followers share, n of the first come one after another.
        "follower_cpu_ms_per_change": round(followers_cpu, 2),
        "postgres_cpu_ms_per_change": round(postgres_cpu, 2),
    }


def join(db: FleetDB, sims: list[SimHost], live: int) -> float:
    """Start these followers at once; seconds until each is live and caught up."""
    last = db.last_change()
    t0 = time.perf_counter()
    for sim in sims:
        sim.start()
    wait_applied(db, live, last)
    took = round(time.perf_counter() - t0, 2)
    settle([sim.proc.pid for sim in sims if sim.proc is not None])
    return took


def settle(pids: list[int], timeout_s: float = 120) -> None:
    """Until these processes are idle: a follower's first usage write, right after its
    first heartbeat, sums its whole table (585 MiB at 100,000 slots), and must not be
    counted as the CPU of the deploys measured next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = cpu_s(pids)
        time.sleep(0.5)
        if cpu_s(pids) - before <= 0.02 * len(pids):
            return


def catch_up(db: FleetDB, url: str, sims: list[SimHost], spaces: int, versions: int) -> dict:
    """Every follower stopped (each leaves the fleet), `versions` deploys made meanwhile,
    then one started again and timed until it has applied them all: it takes the
    fleet's pointers (it is more than catchup.EAGER_LIMIT behind), one per space."""
    for sim in sims:
        sim.stop()
    last = behind(db, url, spaces, versions)
    wait_applied(db, 1, last)  # the real host first: the follower timed then runs alone
    t0 = time.perf_counter()
    sims[0].start()
    wait_applied(db, 2, last)
    took = time.perf_counter() - t0
    return {
        "versions_behind": versions,
        "spaces": spaces,
        "seconds_to_applied": round(took, 2),
        "versions_per_s": round(versions / took, 1),
    }


def database(url: str, tables: bool = True) -> dict:
    """The database's connections, and each polyserve table's rows and bytes."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        states = conn.execute(
            "SELECT coalesce(state, '?'), count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid() GROUP BY 1"
        ).fetchall()
        names = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE tablename LIKE 'polyserve%' ORDER BY 1"
            )
            if tables
        ]
        sizes = {}
        for name in names:
            row = conn.execute(
                f"SELECT count(*), pg_total_relation_size('{name}') FROM {name}"
            ).fetchone()
            assert row is not None
            sizes[name] = {"rows": row[0], "bytes": row[1]}
        size = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    by_state = dict(states)
    return {
        "connections": sum(by_state.values()),
        "connections_by_state": by_state,
        "tables": sizes,
        "database_bytes": size[0] if size else 0,
    }


def ledger_row_bytes(db: FleetDB, url: str, spaces: int) -> dict:
    """What one boot's usage of `spaces` spaces adds to the ledger (a probe host's)."""
    import psycopg

    def size() -> int:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_total_relation_size('polyserve_usage')"
                " + pg_total_relation_size('polyserve_loaded')"
            ).fetchone()
        return row[0] if row else 0

    before = size()
    db.join("ledger-probe", "http://probe.invalid", "cpu", "boot-1")
    totals = {f"sim/s{i}": (i, 0, 1000 * i, 10**6, 1, 500) for i in range(spaces)}
    assert db.write_usage("ledger-probe", "boot-1", totals, dict.fromkeys(totals, 1))
    grown = size() - before
    db.leave("ledger-probe", "boot-1")
    return {"spaces": spaces, "bytes": grown, "bytes_per_space": round(grown / spaces, 1)}


def local_disk(root: Path) -> dict:
    """A follower's data directory: files and bytes it keeps for the fleet's pointers."""
    files, size = 0, 0
    for _dir, dirs, names in os.walk(root):
        files += len(names) + len(dirs)
        size += sum(os.lstat(os.path.join(_dir, n)).st_blocks * 512 for n in names)
    return {"inodes": files, "bytes": size}


def served_few(real: harness.Server, root: Path, spaces: int, served: int = 10) -> dict:
    """The real host once it has served `served` of the `spaces` seeded (spread over
    them): the table slots and the versions' files it holds (issue 30: at most 10 of
    each for 10 of 10,000)."""
    served = min(served, spaces)
    step = spaces // served
    for i in range(0, step * served, step):
        r = httpx2.get(f"{real.url}/s/sim/s{i}/", timeout=60)
        assert r.status_code == 200, r.text
    lines = (root / "slots.log").read_text().splitlines()
    slots = len({line.split("\t")[0] for line in lines})
    versions = sum(1 for p in (root / "spaces").glob("*/*/versions/*") if p.is_dir())
    return {
        "deployed": spaces,
        "served": served,
        "slots": slots,
        "versions_on_disk": versions,
        "met": slots <= served and versions <= served,
    }


def run(args: argparse.Namespace, server: PostgresServer, tmp: Path) -> dict:
    url = server.create_database()
    db = FleetDB(url)
    max_spaces = args.spaces + 16
    seeded = seed(db, url, args.spaces)
    env = {
        "POLYSERVE_DATABASE_URL": url,
        "POLYSERVE_HOST_ID": "real",
        "POLYSERVE_MAX_SPACES": str(max_spaces),
        "POLYSERVE_FLEET_LIVE_S": str(LIVE_S),
        "POLYSERVE_FLEET_POLL_S": "1",
    }
    sims = [SimHost(tmp / "sims", f"f{i:03}", url, max_spaces) for i in range(args.followers)]
    levels = sorted({0, args.followers // 2, args.followers} if args.followers else {0})
    result: dict = {"followers": args.followers, "spaces": args.spaces, "files": "served"}
    result["seed_s"] = round(seeded, 2)
    real_host = harness.polyserve(1, tmp / "real", **env)
    with harness.polyserve(1, tmp / "single") as alone, real_host as real:
        try:
            wait_applied(db, 1, db.last_change())
            # FleetClient.applied, the wait a deploy's 200 is, as the real host's worker.
            client = FleetClient(load(env), Store(tmp / "client", 16))
            joins, levels_out, started = [], [], 0
            for n in levels:
                if n > started:
                    took = join(db, sims[started:n], n + 1)
                    joins.append({"followers": n - started, "seconds": took})
                    started = n
                pids = [sim.proc.pid for sim in sims[:n] if sim.proc is not None]
                cpu = (pids, postgres_pids(server))
                levels_out.append(level(db, client, (alone, real), cpu, n, args.deploys))
            result["joins"] = joins
            result["levels"] = levels_out
            result["database"] = database(url)
            if sims:
                result["follower"] = {
                    "rss_kib_p50": sorted(s.rss_kib() for s in sims)[len(sims) // 2],
                    "table_bytes": Table.size_for(worker_rows(1), max_spaces, meter.CELLS),
                    "disk": local_disk(tmp / "sims" / sims[0].name),
                    # What the fleet's connections grew by per follower joined.
                    "connections": round(
                        (levels_out[-1]["connections"] - levels_out[0]["connections"])
                        / args.followers,
                        2,
                    ),
                }
                result["catch_up"] = catch_up(db, url, sims, args.spaces, args.behind)
            result["database_after_catch_up"] = database(url)["tables"]["polyserve_changes"]
            result["ledger_per_boot"] = ledger_row_bytes(db, url, min(args.spaces, 10_000))
            # Last: the usage the real host writes of them would share the ledger's pages.
            result["served_few"] = served_few(real, tmp / "real", args.spaces)
        finally:
            for sim in sims:
                sim.close()
            db.close()
    last = result["levels"][-1]
    result["goal"] = (
        f"a deploy acknowledged by all {args.followers} followers (its 200) p50 <= 3x a"
        " single host's deploy (issue 30: at 50)"
    )
    result["met"] = last["p50_ratio"] <= 3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--followers", type=int, default=4)
    parser.add_argument("--spaces", type=int, default=1000)
    parser.add_argument("--deploys", type=int, default=10, help="deploys at each fleet size")
    parser.add_argument("--behind", type=int, default=2000, help="versions a follower misses")
    args = parser.parse_args()
    bindir = find_bindir()
    if bindir is None:
        print(json.dumps({"skipped": "PostgreSQL is not installed: apt-get install postgresql"}))
        return
    server = PostgresServer(bindir).start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-sim-"))
    try:
        result = run(args, server, tmp)
        server.destroy()
        # Before the data directories go: at 100,000 spaces a host's are 600,000 inodes.
        print(json.dumps(result), flush=True)
    finally:
        server.destroy()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
