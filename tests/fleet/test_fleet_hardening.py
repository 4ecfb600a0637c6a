"""The fleet's apply path, hardened: a change a host cannot take is refused before it is
committed or skipped and reported by that host, which goes on; a database that went back
in time is followed again; a large deploy streams through every process it crosses.

Real gunicorn hosts and a real PostgreSQL, as in test_fleet.py (whose helpers these are).
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx2 as httpx
import psycopg

from polyserve.fleet.changes import Fit
from polyserve.fleet.db import FleetDB
from polyserve.fleet.uploads import CHUNK
from tests.fleet import test_fleet
from tests.fleet.test_fleet import (
    _client,  # noqa: F401  (test_fleet's shared client, autouse: its helpers use it)
    deploy,
    deployed,
    fleet,
    get,
    source,
    start_fleet,
    version,
    wait_live,
    write,
)
from tests.helpers import HostProcess, make_tar, until
from tests.postgres import PostgresServer

EVERYONE = {"applied": 2, "live": 2}


def post(
    host: HostProcess, space: str, name: str, data: bytes, timeout: float = 60
) -> httpx.Response:
    files = {"module": (name, data)}
    return test_fleet.CLIENT.post(
        host.url + "/_polyserve/deploy", data={"space": space}, files=files, timeout=timeout
    )


def host_row(host: HostProcess, host_id: str) -> dict:
    return next(h for h in fleet(host)["hosts"] if h["id"] == host_id)


def caught_up(host: HostProcess, host_id: str) -> bool:
    view = fleet(host)
    return next(h for h in view["hosts"] if h["id"] == host_id)["applied"] == view["last_change"]


def tar_of(size: int, v: int, compressible: bool) -> bytes:
    """A space answering {'v': v} with a data file of `size` bytes (zeros, or random)."""
    blob = bytes(size) if compressible else os.urandom(size)
    return make_tar({"main.py": source(v), "blob.bin": blob}, gzip=True)


# -- 1. a change a host cannot apply ----------------------------------------------------


def big_and_small(host_factory, url: str, **small: str) -> tuple[HostProcess, HostProcess]:
    """A with the default limits and B with POLYSERVE_MAX_UPLOAD_MB=1 (so 4 MiB unpacked)
    and `small`, both live."""
    a = start_fleet(host_factory, url, "a")[0]
    env = {"POLYSERVE_HOST_ID": "b", "POLYSERVE_MAX_UPLOAD_MB": "1", **small}
    b = host_factory("b", workers=1, POLYSERVE_DATABASE_URL=url, **env, **test_fleet.FAST)
    wait_live(a, {"a", "b"})
    return a, b


def test_a_space_deployed_after_a_delete_takes_the_deleted_slot_on_every_host(
    host_factory, fleet_db
):
    """POLYSERVE_MAX_SPACES=2: deploy lee/s1 and lee/s2, delete lee/s1, deploy lee/s3.
    Every host hands lee/s1's slot to lee/s3, as a single host does: the deploy answers
    200 on both hosts and the fleet goes on applying what comes after it."""
    a, b = start_fleet(host_factory, fleet_db, "ab", POLYSERVE_MAX_SPACES="2")
    deployed(a, "lee/s1", 1, EVERYONE)
    deployed(a, "lee/s2", 1, EVERYONE)
    for host in (a, b):  # loaded everywhere: each host must see its workers let go of it
        assert version(host, "lee/s1") == 1
    r = write(b, "DELETE", "/_polyserve/spaces/lee/s1")
    assert r.status_code == 200, r.text
    deployed(a, "lee/s3", 1, EVERYONE)
    deployed(b, "lee/s2", 2, EVERYONE)
    for host in (a, b):
        assert (version(host, "lee/s1"), version(host, "lee/s2"), version(host, "lee/s3")) == (
            None,
            2,
            1,
        )
        assert host_row(a, host.extra_env["POLYSERVE_HOST_ID"])["skipped"] == []


def test_a_deploy_a_live_host_cannot_take_is_refused_before_it_is_committed(host_factory, fleet_db):
    """B takes smaller uploads and fewer spaces than A (a slot for every space deployed,
    with POLYSERVE_FLEET_FILES=all): a deploy through A that B could
    not apply is refused (413, 507) naming B and its setting, nothing is committed, the
    previous version keeps serving on both, and the next deploy that fits reaches both."""
    a, b = big_and_small(
        host_factory, fleet_db, POLYSERVE_MAX_SPACES="1", POLYSERVE_FLEET_FILES="all"
    )
    deployed(a, "lee/big", 1, EVERYONE)
    last = fleet(a)["last_change"]

    r = post(a, "lee/big", "big.tar.gz", tar_of(6 << 20, 2, compressible=True))
    assert r.status_code == 413, r.text
    assert r.json()["hosts"] == ["b"] and "POLYSERVE_MAX_UNPACKED_MB=4" in r.json()["error"]
    r = post(a, "lee/big", "big.tar.gz", tar_of(2 << 20, 2, compressible=False))
    assert r.status_code == 413, r.text
    assert r.json()["hosts"] == ["b"] and "POLYSERVE_MAX_UPLOAD_MB=1" in r.json()["error"]
    r = deploy(a, "lee/other", source(1))
    assert r.status_code == 507, r.text
    assert r.json()["hosts"] == ["b"] and "POLYSERVE_MAX_SPACES=1" in r.json()["error"]

    assert fleet(a)["last_change"] == last  # nothing was committed
    assert (version(a, "lee/big"), version(b, "lee/big")) == (1, 1)
    deployed(a, "lee/big", 2, EVERYONE)
    assert (version(a, "lee/big"), version(b, "lee/big")) == (2, 2)


def test_a_host_that_cannot_apply_a_change_skips_it_reports_it_and_goes_on(host_factory, fleet_db):
    """B takes 4 MiB unpacked at most and was stopped when a larger version of lee/big
    was deployed (so nothing refused it). Started again, B skips that change, says so in
    the fleet's view, stops serving the older version, heartbeats, and applies what
    follows; a version of lee/big that fits clears the report."""
    a, b = big_and_small(host_factory, fleet_db)
    deployed(a, "lee/big", 1, EVERYONE)
    assert version(b, "lee/big") == 1
    b.stop()
    r = post(a, "lee/big", "big.tar.gz", tar_of(6 << 20, 2, compressible=True))
    assert r.status_code == 200, r.text
    skipped_change = fleet(a)["last_change"]
    b.start()
    wait_live(a, {"a", "b"})
    until(lambda: caught_up(a, "b"), what="B to acknowledge the change it skipped")
    (skip,) = host_row(a, "b")["skipped"]
    assert (skip["space"], skip["change"], skip["version"]) == ("lee/big", skipped_change, 2)
    assert "4 MiB" in skip["error"], skip
    assert get(b, "/s/lee/big/").status_code == 404  # never the older version
    assert version(a, "lee/big") == 2

    deployed(a, "lee/after", 1, EVERYONE)  # B goes on with the changes after it
    assert version(b, "lee/after") == 1
    deployed(a, "lee/big", 3, EVERYONE)
    assert (version(a, "lee/big"), version(b, "lee/big")) == (3, 3)
    assert host_row(a, "b")["skipped"] == []


SLOW = """
import os, time
def handle(request):
    open({started!r}, "w").close()
    while not os.path.exists({go!r}):
        time.sleep(0.01)
    return {{"v": 1}}
"""


def test_a_deploy_answers_at_once_when_a_live_host_skipped_it(host_factory, fleet_db, tmp_path):
    """POLYSERVE_MAX_SPACES=2, and a request still running on B in lee/s1 when lee/s1 is
    deleted: B cannot hand its slot to lee/s3 yet. The deploy of lee/s3 answers 202 with
    B under `skipped` (not after POLYSERVE_DEPLOY_WAIT_S, far longer than the client
    waits), B stays live, and once the request is done a new deploy reaches B."""
    started, go = tmp_path / "started", tmp_path / "go"
    a, b = start_fleet(
        host_factory,
        fleet_db,
        "ab",
        POLYSERVE_MAX_SPACES="2",
        POLYSERVE_DEPLOY_WAIT_S="600",
        POLYSERVE_FLEET_FILES="all",  # every deploy takes a slot as it arrives
    )
    r = deploy(a, "lee/s1", SLOW.format(started=str(started), go=str(go)))
    assert r.status_code == 200, r.text
    deployed(a, "lee/s2", 1, EVERYONE)
    slow = threading.Thread(target=lambda: get(b, "/s/lee/s1/"))
    slow.start()
    try:
        until(started.exists, what="the slow request to start on B")
        r = write(a, "DELETE", "/_polyserve/spaces/lee/s1")
        assert r.status_code == 200, r.text
        r = deploy(a, "lee/s3", source(1))
        assert r.status_code == 202, r.text
        hosts = r.json()["hosts"]
        assert (hosts["applied"], hosts["live"], list(hosts["skipped"])) == (1, 2, ["b"])
        assert "space table is full" in hosts["skipped"]["b"]
        assert "lagging" not in hosts
        assert version(a, "lee/s3") == 1 and get(b, "/s/lee/s3/").status_code == 404
        deployed(a, "lee/s2", 2, EVERYONE)  # B is live and applies what follows
        assert version(b, "lee/s2") == 2
    finally:
        go.touch()
        slow.join()
    until(lambda: deploy(a, "lee/s3", source(2)).status_code == 200, what="B to take lee/s3")
    assert (version(a, "lee/s3"), version(b, "lee/s3")) == (2, 2)
    assert host_row(a, "b")["skipped"] == []


# -- 3. a database that goes back in time -----------------------------------------------


def pg_tool(postgres: PostgresServer, tool: str, *args: str) -> None:
    done = subprocess.run(
        [str(postgres.bindir / tool), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_a_database_restored_from_an_older_dump_is_followed_again(
    postgres: PostgresServer, fleet_db, host_factory, tmp_path
):
    """Deploy "one", pg_dump, deploy "two", restore the dump, deploy "three": the fleet
    hands out change 2 and version 2 again, and every host notices the fleet went back:
    the deploy answers 200 once both serve "three", never "two"."""
    a, b = start_fleet(host_factory, fleet_db, "ab")
    deployed(a, "lee/t", 1, EVERYONE)
    dump = tmp_path / "fleet.dump"
    pg_tool(postgres, "pg_dump", "-Fc", "-f", str(dump), fleet_db)
    deployed(a, "lee/t", 2, EVERYONE)
    deployed(a, "lee/later", 1, EVERYONE)  # a space the dump does not know
    assert [version(h, "lee/t") for h in (a, b)] == [2, 2]
    pg_tool(
        postgres, "pg_restore", "--clean", "--if-exists", "--single-transaction", "-d", fleet_db,
        str(dump),
    )  # fmt: skip
    body = deployed(a, "lee/t", 3, EVERYONE)
    assert body["version"] == 2  # the number handed out again
    assert [version(h, "lee/t") for h in (a, b)] == [3, 3]
    for host in (a, b):
        assert get(host, "/s/lee/later/").status_code == 404  # the fleet has no such space
    deployed(b, "lee/t", 4, EVERYONE)
    assert [version(h, "lee/t") for h in (a, b)] == [4, 4]


# -- 13. the answer of a host that is not live ------------------------------------------


def test_a_write_through_a_host_that_is_not_live_counts_only_live_hosts(host_factory, fleet_db):
    """A's follower is stopped (SIGSTOP), so A drops out of `live`: a deploy through A
    says B applied it and A lags — never a negative count."""
    a, b = start_fleet(
        host_factory, fleet_db, "ab", POLYSERVE_FLEET_LIVE_S="1", POLYSERVE_DEPLOY_WAIT_S="1"
    )
    follower = a.follower_pid()
    os.kill(follower, signal.SIGSTOP)
    try:
        wait_live(b, {"b"})
        r = deploy(a, "lee/n", source(1))
        assert r.status_code == 202, r.text
        assert r.json()["hosts"] == {"applied": 1, "live": 1, "lagging": ["a"]}
        assert version(b, "lee/n") == 1
    finally:
        os.kill(follower, signal.SIGCONT)
    wait_live(b, {"a", "b"})


# -- 15. a large deploy streams ---------------------------------------------------------


def memory_kib(pid: int) -> dict[str, int]:
    """VmHWM (the peak resident set) and RssAnon of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon"):
            fields[key] = int(value.split()[0])
    return fields


def test_a_large_fleet_deploy_streams_through_the_receiving_worker_and_the_followers(
    host_factory, fleet_db
):
    """A 40 MiB (incompressible) deploy through A: neither A's worker nor B's follower
    ever holds a copy of the upload (their peak grows by less than half of it), and
    neither keeps one after the answer."""
    size = 40 << 20
    a, b = start_fleet(host_factory, fleet_db, "ab", POLYSERVE_DEPLOY_WAIT_S="300")
    (worker,) = a.worker_pids()
    deployed(a, "lee/warm", 1, EVERYONE)  # connections made, modules imported
    post(a, "lee/warm", "warm.tar.gz", tar_of(1 << 20, 2, compressible=False))
    processes = {"A's worker": worker, "B's follower": b.follower_pid()}
    before = {name: memory_kib(pid) for name, pid in processes.items()}
    started = time.monotonic()
    r = post(a, "lee/large", "large.tar.gz", tar_of(size, 1, compressible=False), timeout=300)
    took = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert r.json()["hosts"] == EVERYONE
    assert version(b, "lee/large") == 1
    after = {name: memory_kib(pid) for name, pid in processes.items()}
    grown = {
        name: {key: after[name][key] - before[name][key] for key in ("VmHWM", "RssAnon")}
        for name in processes
    }
    print(f"a {size >> 20} MiB deploy, answered in {took:.1f} s; memory growth (KiB): {grown}")
    for name, growth in grown.items():
        assert growth["VmHWM"] < (size >> 10) // 2, (name, grown)
        assert growth["RssAnon"] < (size >> 10) // 4, (name, grown)


def test_a_follower_reads_a_version_with_its_secrets_only_in_its_pool(fleet_db):
    """One round trip per deploy: the version and, for a host of its pool alone, the
    space's secrets (a host of another pool gets none, as it keeps no file of them)."""
    db = FleetDB(fleet_db)
    data = b"def handle(request):\n    return {}\n"
    sha = hashlib.sha256(data).hexdigest()
    change = db.deploy("lee/keys", io.BytesIO(data), sha, {"pool": "cpu"}, Fit("x", 10, 0))
    assert db.fetch("lee/keys", change.version, "cpu", secrets=True).secrets == {}
    db.set_secret("lee/keys", "API_KEY", "k1")
    db.set_secret("lee/keys", "OTHER", "k2")
    ours = db.fetch("lee/keys", change.version, "cpu", secrets=True)
    assert ours is not None and ours.size == len(data)
    assert ours.secrets == db.secrets("lee/keys")["lee/keys"]
    assert sorted(ours.secrets) == ["API_KEY", "OTHER"] and ours.secrets["OTHER"]["value"] == "k2"
    theirs = db.fetch("lee/keys", change.version, "gpu", secrets=True)
    assert theirs is not None and theirs.size is None and theirs.secrets == {}
    assert db.fetch("lee/keys", change.version, "cpu").secrets is None  # not asked for
    db.close()


def test_the_changes_since_one_say_whether_the_fleet_still_has_it(fleet_db):
    """A follower's poll is one query: the changes after the one it applied, and that
    one's token as the fleet has it (None: the fleet's database went back before it)."""
    db = FleetDB(fleet_db)
    first, second = (
        db.deploy("lee/log", io.BytesIO(b"x = 1\n"), "0" * 64, {}, Fit("x", 10, 0))
        for _ in range(2)
    )
    assert db.changes_since(0, 10) == (None, [first, second])
    assert db.changes_since(first.id, 10) == (first.token, [second])
    assert db.changes_since(first.id, 0) == (first.token, [])
    assert db.changes_since(second.id, 10) == (second.token, [])
    assert db.changes_since(second.id + 1, 10) == (None, [])
    with psycopg.connect(fleet_db, autocommit=True) as conn:
        conn.execute("DELETE FROM polyserve_changes WHERE id = %s", (first.id,))
    assert db.changes_since(first.id, 1) == (None, [second])
    db.close()


def test_the_fleet_store_reads_back_what_it_streamed_in(fleet_db):
    """The binary COPY and the sliced read agree byte for byte, across slice edges."""
    db = FleetDB(fleet_db)
    data = os.urandom(2 * CHUNK + 12345)
    sha = hashlib.sha256(data).hexdigest()
    change = db.deploy("lee/bytes", io.BytesIO(data), sha, {"pool": "cpu"}, Fit("x", 10, 0))
    stored = db.fetch("lee/bytes", change.version)
    assert stored is not None and stored.size == len(data) and stored.sha256 == sha
    out = io.BytesIO()
    assert db.download("lee/bytes", stored, out) == sha
    assert out.getvalue() == data
    with psycopg.connect(fleet_db) as conn:
        row = conn.execute("SELECT data FROM polyserve_versions WHERE space = 'lee/bytes'")
        assert bytes(row.fetchone()[0]) == data
    db.close()
