"""The fleet under faults: a real PostgreSQL (tests/postgres.py) restarted, stopped or
frozen while hosts use it, masters killed with -9 and started again at once. A write
committed before the fault answers 202, never the pre-commit 503; the ledger bills each
answered request once; a drain mark holds; a stalled database ties up no worker.

Real gunicorn hosts, one worker each; waits have deadlines (`until`), never a fixed sleep.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

import httpx2 as httpx
import psycopg
import pytest

from polyserve.fleet.connection import CHANNEL
from polyserve.fleet.db import FleetDB
from polyserve.fleet.ledger import Boot
from polyserve.fleet.schema import CHANGE_LOCK
from tests.helpers import HostProcess, alive, children, until
from tests.postgres import PostgresServer

pytestmark = pytest.mark.postgres

FAST = {"POLYSERVE_CHECKPOINT_INTERVAL": "0.3", "POLYSERVE_FLEET_POLL_S": "0.5"}
OK = "def handle(request):\n    return {'v': %d}\n"
# Requests with ?wait=1 are held in the space until the gate file exists.
GATED = """\
import os, time
def handle(request):
    if request.query_params.get("wait"):
        while not os.path.exists(%r):
            time.sleep(0.005)
    return "ok"
"""
# Every request is held while the block file exists.
BLOCKING = """\
import os, time
def handle(request):
    while os.path.exists(%r):
        time.sleep(0.005)
    return "ok"
"""


def fleet_host(
    factory: Callable[..., HostProcess], url: str, host_id: str, **kw: str
) -> HostProcess:
    env = {**FAST, "POLYSERVE_DATABASE_URL": url, "POLYSERVE_HOST_ID": host_id, **kw}
    return factory(host_id, workers=1, **env)


def get(host: HostProcess, path: str, timeout: float = 60) -> httpx.Response:
    return httpx.get(host.url + path, headers={"Connection": "close"}, timeout=timeout)


def deploy(host: HostProcess, space: str, source: str, timeout: float = 60) -> httpx.Response:
    files = {"module": ("main.py", source.encode())}
    return httpx.post(
        host.url + "/_polyserve/deploy", data={"space": space}, files=files, timeout=timeout
    )


def deployed(host: HostProcess, space: str, source: str) -> dict:
    r = deploy(host, space, source)
    assert r.status_code == 200, r.text
    return r.json()


def query(url: str, sql: str, *params: object) -> list[tuple]:
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        return conn.execute(sql, params).fetchall()


def live(url: str) -> set[str]:
    """The hosts the fleet lists as live, read as a deploy reads them."""
    db = FleetDB(url)
    try:
        return {h["id"] for h in db.hosts(60) if h["live"]}
    finally:
        db.close()


def host_row(url: str, host_id: str) -> dict:
    db = FleetDB(url)
    try:
        return next(h for h in db.hosts(60) if h["id"] == host_id)
    finally:
        db.close()


def billed(url: str, space: str) -> dict[str, int]:
    """The ledger's requests for `space`, per boot."""
    rows = query(url, "SELECT boot, requests FROM polyserve_usage WHERE space = %s", space)
    return dict(rows)


def local_requests(host: HostProcess, space: str) -> int:
    return get(host, "/_polyserve/usage").json()["spaces"].get(space, {}).get("requests", 0)


def in_flight(host: HostProcess) -> int:
    return get(host, "/_polyserve/usage").json()["host"]["in_flight"]


# -- the ledger's fence, on the database alone ---------------------------------------------

ZERO = (0, 0, 0, 0, 0, 0)


def req(n: int) -> tuple[int, ...]:
    return (n, *ZERO[1:])


def test_a_new_boot_takes_over_where_the_one_it_replaces_stopped_billing(fleet_db):
    """A boot of the same data directory starts billing where the boot it replaces
    stopped (its baseline plus its rows); that boot's writes are refused from then on,
    and it learns it was replaced; a reconnect of the current boot keeps its baseline;
    another directory under the same host id starts afresh."""
    db = FleetDB(fleet_db)
    try:
        url = "http://10.9.0.1:8441"
        # 5 requests counted before the host joined the fleet: never billed.
        assert db.join("h", url, "cpu", Boot("b1", "dir", {"u/a": req(5)}, True)) == {"u/a": req(5)}
        assert db.write_usage("h", "b1", {"u/a": req(7)})  # 12 counted, 7 billed
        # Killed with -9 at 14: the next boot, from the segment, takes over at 5 + 7.
        b2 = Boot("b2", "dir", {"u/a": req(14)}, False)
        assert db.join("h", url, "cpu", b2) == {"u/a": req(12)}
        assert not db.write_usage("h", "b1", {"u/a": req(9)})  # b1's late write: refused
        assert not db.heartbeat("h", "b1", 1, 0)
        assert db.join("h", url, "cpu", Boot("b1", "dir", {}, False), takeover=False) is None
        assert db.join("h", url, "cpu", b2, takeover=False) == {"u/a": req(12)}
        assert db.write_usage("h", "b2", {"u/a": req(2)})  # 14 - 12
        assert billed(fleet_db, "u/a") == {"b1": 7, "b2": 2}  # 14 - 5, each once

        # Restored from a checkpoint behind what was billed (a machine restart lost
        # /dev/shm): what it counts from its start on is billed, nothing twice.
        b3 = Boot("b3", "dir", {"u/a": req(13)}, True)
        assert db.join("h", url, "cpu", b3) == {"u/a": req(13)}
        # Another data directory under the same id (a new machine): its own start.
        b4 = Boot("b4", "other", {"u/a": req(3)}, True)
        assert db.join("h", url, "cpu", b4) == {"u/a": req(3)}
    finally:
        db.close()


# -- kill -9, and a restart at once ---------------------------------------------------------


def test_a_master_killed_with_requests_in_flight_and_restarted_at_once_bills_each_once(
    host_factory, fleet_db, tmp_path
):
    """Six requests held in the space, the master killed with -9 and started again at
    once, the six answered by the old worker after the new master read the segment:
    the fleet's ledger holds every answered request exactly once, in one boot's row
    each. The old follower is woken (a deploy elsewhere notifies every follower) once
    the restarted host has counted the six, so its last write, if it still makes one,
    comes after they were answered."""
    gate = tmp_path / "gate"
    # A long poll: the old follower sits in its wait until a NOTIFY wakes it.
    a = fleet_host(
        host_factory,
        fleet_db,
        "a",
        POLYSERVE_FLEET_POLL_S="30",
        POLYSERVE_FLEET_LIVE_S="120",
    )
    until(lambda: live(fleet_db) == {"a"}, what="A to be live")
    deployed(a, "u/k", GATED % str(gate))
    answered = 0
    for _ in range(10):
        assert get(a, "/s/u/k/").status_code == 200
        answered += 1
    held: list[int] = []
    callers = [
        threading.Thread(target=lambda: held.append(get(a, "/s/u/k/?wait=1", 120).status_code))
        for _ in range(6)
    ]
    for t in callers:
        t.start()
    until(lambda: in_flight(a) == 6, what="six requests in flight")
    old_workers, old_follower = a.worker_pids(), a.follower_pid()
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    a.start()  # the same data directory, while the old worker still holds six requests
    gate.touch()
    for t in callers:
        t.join()
    assert held == [200] * 6
    answered += 6
    until(lambda: not any(alive(pid) for pid in old_workers), what="the old worker to exit")
    until(lambda: local_requests(a, "u/k") == answered, what="the restarted host to count all")
    query(fleet_db, "SELECT pg_notify(%s, %s)", CHANNEL, "0")
    until(lambda: sum(billed(fleet_db, "u/k").values()) == answered, what="the ledger to bill all")
    until(lambda: not alive(old_follower), what="the old follower to exit")
    a.stop()  # the last usage write, after the final checkpoint
    rows = billed(fleet_db, "u/k")
    assert sum(rows.values()) == answered, rows
    assert len(rows) == 2, rows  # the killed boot's row and the restarted one's


class Load:
    """`threads` clients calling `path` one request after another; counts the 200s."""

    def __init__(self, host: HostProcess, path: str, threads: int) -> None:
        self.url = host.url + path
        self.answered = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        with httpx.Client(headers={"Connection": "close"}, timeout=120) as client:
            while True:
                try:
                    r = client.get(self.url)
                except httpx.TransportError:
                    return  # the host was killed under this request: not answered
                assert r.status_code == 200, r.text
                with self._lock:
                    self.answered += 1

    def join(self) -> int:
        for t in self._threads:
            t.join(timeout=120)
            assert not t.is_alive()
        return self.answered


def test_a_host_whose_whole_process_group_is_killed_bills_what_it_recovers(
    host_factory, fleet_db, tmp_path
):
    """Under load, the host's whole process group is killed with -9 (master, worker,
    follower at once) after many answers its follower never wrote: restarted, the host
    recovers the exact totals from the segment, and the ledger bills them, each answered
    request once."""
    block = tmp_path / "block"
    a = host_factory(
        "a",
        workers=1,
        session=True,
        POLYSERVE_DATABASE_URL=fleet_db,
        POLYSERVE_HOST_ID="a",
        POLYSERVE_FLEET_POLL_S="0.5",
        POLYSERVE_CHECKPOINT_INTERVAL="2",  # many answers since the follower's last write
    )
    until(lambda: live(fleet_db) == {"a"}, what="A to be live")
    deployed(a, "u/l", BLOCKING % str(block))
    load = Load(a, "/s/u/l/", threads=4)
    until(lambda: load.answered >= 300, 120, "300 answers under load")
    block.touch()  # each client's next request is held: none is half answered
    until(lambda: in_flight(a) == 4, what="every client held in the space")
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait()
    answered = load.join()
    block.unlink()
    a.start()
    until(lambda: local_requests(a, "u/l") == answered, what="the host to recover its totals")
    until(lambda: sum(billed(fleet_db, "u/l").values()) == answered, what="the ledger to bill all")
    a.stop()
    rows = billed(fleet_db, "u/l")
    assert sum(rows.values()) == answered, (rows, answered)


# -- the drain mark ----------------------------------------------------------------------


def test_a_draining_host_stays_draining_when_its_follower_reconnects(
    own_postgres: PostgresServer, host_factory
):
    """The autoscaler's drain mark survives a PostgreSQL restart (the follower
    reconnects and joins again); only the host's next boot clears it."""
    url = own_postgres.create_database()
    a = fleet_host(host_factory, url, "a")
    until(lambda: live(url) == {"a"}, what="A to be live")
    db = FleetDB(url)
    try:
        db.drain("a")
    finally:
        db.close()
    assert host_row(url, "a")["draining"] and not host_row(url, "a")["live"]
    own_postgres.stop()
    own_postgres.start()
    restarted = query(url, "SELECT now()")[0][0]

    def heartbeat() -> bool:  # the follower reconnected (and joined again) since
        sql = "SELECT last_seen > %s FROM polyserve_hosts WHERE id = 'a'"
        return query(url, sql, restarted)[0][0]

    until(heartbeat, what="the follower to heartbeat after the restart")
    row = host_row(url, "a")
    assert row["draining"] and not row["live"], row
    a.stop()
    a.start()  # a new boot: a host that was stopped and started again is not draining
    until(lambda: live(url) == {"a"}, what="A's next boot to be live")


# -- a write committed, then the database goes away --------------------------------------


def committed(url: str, changes: int) -> Callable[[], bool]:
    return lambda: query(url, "SELECT count(*) FROM polyserve_changes")[0][0] >= changes


def test_a_committed_write_answers_202_whatever_the_database_does_during_the_wait(
    own_postgres: PostgresServer, host_factory, tmp_path
):
    """With B's follower stopped (still live, so the writes wait for it): a deploy during
    whose wait PostgreSQL restarts answers 202 naming B; a deploy, rollback, release and
    delete during whose wait it is down answer 202 with the version and the hosts
    unknown, and the CLI says committed (exit 4, not 3). Nothing is committed twice."""
    url = own_postgres.create_database()
    a = fleet_host(
        host_factory, url, "a", POLYSERVE_DEPLOY_WAIT_S="10", POLYSERVE_FLEET_LIVE_S="120"
    )
    b = fleet_host(host_factory, url, "b")
    until(lambda: live(url) == {"a", "b"}, what="A and B to be live")
    for space in ("u/x", "u/y", "u/z"):
        deployed(a, space, OK % 1)
    deployed(a, "u/x", OK % 2)
    stopped = b.follower_pid()
    os.kill(stopped, signal.SIGSTOP)
    answers: dict[str, httpx.Response] = {}

    def send(name: str, method: str, path: str, **kw: object) -> threading.Thread:
        def call() -> None:
            answers[name] = httpx.request(method, a.url + path, timeout=120, **kw)

        thread = threading.Thread(target=call)
        thread.start()
        return thread

    try:
        files = {"module": ("main.py", (OK % 3).encode())}
        changes = query(url, "SELECT count(*) FROM polyserve_changes")[0][0]
        waiting = send("deploy", "POST", "/_polyserve/deploy", data={"space": "u/x"}, files=files)
        until(committed(url, changes + 1), what="the deploy to commit")
        own_postgres.stop()
        own_postgres.start()
        waiting.join()
        r = answers["deploy"]
        assert r.status_code == 202, r.text
        assert r.json()["version"] == 3
        assert "b" in r.json()["hosts"]["lagging"]

        source = tmp_path / "w.py"
        source.write_text(OK % 1)
        cli = [sys.executable, "-m", "polyserve.cli", "deploy", str(source), "--space", "u/w"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("POLYSERVE_")}
        deploying = subprocess.Popen(
            [*cli, "--url", a.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        waits = [
            send("rollback", "POST", "/_polyserve/spaces/u/x/rollback"),
            send("release", "POST", "/_polyserve/spaces/u/y/release"),
            send("delete", "DELETE", "/_polyserve/spaces/u/z"),
        ]
        until(committed(url, changes + 5), 60, "the four writes to commit")
        own_postgres.stop()
        for t in waits:
            t.join()
        out, err = deploying.communicate(timeout=120)
    finally:
        os.kill(stopped, signal.SIGCONT)
        if not own_postgres.running():
            own_postgres.start()
    for name in ("rollback", "release", "delete"):
        r = answers[name]
        assert r.status_code == 202, (name, r.text)
        assert r.json()["hosts"]["unknown"] is True, (name, r.json())
        assert "committed" in r.json()["hosts"]["error"]
    assert answers["rollback"].json()["version"] == 2
    assert deploying.returncode == 4, (out, err)
    assert b"deployed u/w v1" in out and b"committed" in err, (out, err)
    # Each write once: u/w has one version, u/x three, one of them current again.
    assert query(url, "SELECT number FROM polyserve_versions WHERE space = 'u/w'") == [(1,)]
    spaces = dict(query(url, "SELECT name, current_version FROM polyserve_spaces"))
    assert spaces == {"u/w": 1, "u/x": 2, "u/y": 1, "u/z": None}


# -- a database that stops answering -----------------------------------------------------


def stall(server: PostgresServer, sig: signal.Signals) -> list[int]:
    """Send `sig` to the server's postmaster and every process it started (ours)."""
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    pids = [postmaster, *children(postmaster)]
    for pid in pids:
        os.kill(pid, sig)
    return pids


def raw_get(host: HostProcess, path: str) -> socket.socket:
    """A request sent in full, its answer left to read (see status)."""
    sock = socket.create_connection(("127.0.0.1", host.port), timeout=120)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    return sock


def status(sock: socket.socket) -> tuple[int, bytes]:
    with sock:
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_a_stalled_database_holds_no_worker_and_its_calls_answer_503(
    own_postgres: PostgresServer, host_factory
):
    """A PostgreSQL that stops answering without closing its connections (SIGSTOP):
    twelve requests that read the fleet answer 503 naming the fleet store, and a space's
    first request, an import, answers before any of them (the database's calls have
    threads of their own, never the imports')."""
    url = own_postgres.create_database()
    eager = {"POLYSERVE_FLEET_FILES": "all"}  # the deploy's files come with it
    a = fleet_host(host_factory, url, "a", POLYSERVE_FLEET_TIMEOUT_S="3", **eager)
    until(lambda: live(url) == {"a"}, what="A to be live")
    deployed(a, "u/cold", OK % 1)  # applied, never requested: its first request imports
    pids = stall(own_postgres, signal.SIGSTOP)
    try:
        reads = [raw_get(a, "/_polyserve/fleet") for _ in range(12)]
        results: list[tuple[int, bytes]] = []
        readers = [threading.Thread(target=lambda s=s: results.append(status(s))) for s in reads]
        for t in readers:
            t.start()
        r = get(a, "/s/u/cold/", timeout=120)
        assert r.status_code == 200, r.text
        assert results == []  # answered while every database call was still waiting
        for t in readers:
            t.join(timeout=120)
        assert [code for code, _ in results] == [503] * 12, results
        assert all(b"fleet store" in body for _, body in results)
    finally:
        stall(own_postgres, signal.SIGCONT)
        assert pids
    until(lambda: deploy(a, "u/cold", OK % 2).status_code == 200, what="a write once it is back")


def test_a_write_waiting_on_a_lock_another_transaction_holds_answers_503(host_factory, fleet_db):
    """A transaction that stalled holding the change log's lock (another host's, frozen
    mid-deploy): a deploy answers 503 once the lock timeout passes, instead of waiting
    for it; once it is released, the deploy goes through."""
    a = fleet_host(host_factory, fleet_db, "a", POLYSERVE_FLEET_TIMEOUT_S="2")
    until(lambda: live(fleet_db) == {"a"}, what="A to be live")
    with psycopg.connect(fleet_db, connect_timeout=10) as holder:  # a transaction
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (CHANGE_LOCK,))
        r = deploy(a, "u/lock", OK % 1, timeout=120)
        assert r.status_code == 503, r.text
        assert "fleet store" in r.json()["error"]
    assert deployed(a, "u/lock", OK % 1)["version"] == 1


TIMEOUTS = ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")


def test_every_fleet_connection_has_statement_and_lock_timeouts(fleet_db):
    """The server ends a fleet call's statement, lock wait or idle transaction that
    outlives POLYSERVE_FLEET_TIMEOUT_S."""
    db = FleetDB(fleet_db, timeout_s=2.5)
    try:
        with db.session() as conn:
            shown = [conn.execute(f"SHOW {name}").fetchone()[0] for name in TIMEOUTS]
    finally:
        db.close()
    assert shown == ["2500ms", "2500ms", "2500ms"]
