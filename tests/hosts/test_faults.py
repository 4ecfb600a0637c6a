"""Faults under load on real gunicorn hosts: kills, HUP, a blocked loop, timeouts, recycles.

Every load here is bounded in time and count, and only goes to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx2

from polyserve.state.shm import segment_name
from tests.helpers import HostProcess, until

SYNC = "import os\ndef handle(request):\n    return {'pid': os.getpid()}\n"


class Load:
    """`threads` clients calling `path` over fresh connections until stop() or `limit` s."""

    def __init__(self, host: HostProcess, path: str, threads: int = 6, limit: float = 60) -> None:
        self.url = host.url + path
        self.served = 0
        self.failed = 0  # transport errors: no answer at all
        self.errors: list[int] = []  # answers other than 200
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._deadline = time.monotonic() + limit
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            status = 0
            with contextlib.suppress(httpx2.TransportError):  # a worker killed or leaving
                status = httpx2.get(
                    self.url, headers={"Connection": "close"}, timeout=10
                ).status_code
            with self._lock:
                self.served += status == 200
                self.failed += status == 0
                if status not in (0, 200):
                    self.errors.append(status)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def requests(host: HostProcess, space: str) -> int:
    return host.get("/_polyserve/usage").json()["spaces"][space]["requests"]


def test_killing_workers_under_load_loses_no_counted_request(host_factory, capsys):
    host = host_factory()
    assert host.deploy("f/kill", SYNC).status_code == 200
    checks = []
    with Load(host, "/s/f/kill/") as load:
        for round_ in range(1, 4):
            until(lambda r=round_: load.served >= 200 * r, what="load to make progress")
            served_before = load.served
            victim = min(host.worker_pids())
            os.kill(victim, signal.SIGKILL)
            until(
                lambda v=victim: v not in host.worker_pids() and len(host.worker_pids()) == 2,
                what="the killed worker to be replaced",
            )
            counted = requests(host, "f/kill")
            checks.append((served_before, counted))
            assert counted >= served_before
    counted = requests(host, "f/kill")
    assert counted >= load.served and load.errors == []
    with capsys.disabled():
        print(
            f"\nkill -9 x3 under load: served {load.served}, counted {counted}, unanswered"
            f" {load.failed}, lost {max(0, load.served - counted)}; at each kill"
            f" (served, counted): {checks}"
        )


def test_hup_under_load_keeps_serving_and_counting(host_factory, capsys):
    host = host_factory()
    assert host.deploy("f/hup", SYNC).status_code == 200
    with Load(host, "/s/f/hup/") as load:
        until(lambda: load.served >= 200, what="load to make progress")
        host.hup()
        served_at_hup = load.served
        until(lambda: load.served >= served_at_hup + 200, what="load after the HUP")
    assert requests(host, "f/hup") >= load.served
    # No request is answered with an error. uvicorn's graceful shutdown may close a
    # connection it accepted in its last instant, before reading the request (the race
    # of gunicorn#2529): such a request gets no answer and is not counted.
    assert load.errors == []
    with capsys.disabled():
        print(f"\nHUP under load: served {load.served}, unanswered {load.failed}")


def test_a_space_blocking_the_event_loop_gets_its_worker_replaced(host_factory):
    host = host_factory(POLYSERVE_WORKER_TIMEOUT="2")
    blocker = "import time\nasync def handle(request):\n    time.sleep(30)\n"
    assert host.deploy("f/block", blocker).status_code == 200
    assert host.deploy("f/ok", SYNC).status_code == 200
    for _ in range(20):
        assert host.get("/s/f/ok/").status_code == 200
    workers = host.worker_pids()
    thread = threading.Thread(target=lambda: _ignore_errors(host, "/s/f/block/"), daemon=True)
    thread.start()
    # While one worker is stuck the other serves; then gunicorn replaces the stuck one.
    until(lambda: len(host.worker_pids() - workers) == 1, what="the blocked worker's successor")
    assert len(host.worker_pids()) == 2 and "WORKER TIMEOUT" in host.tail(200)
    for _ in range(10):
        assert host.get("/s/f/ok/").status_code == 200
    assert requests(host, "f/ok") == 30
    thread.join()


def _ignore_errors(host: HostProcess, path: str) -> None:
    with contextlib.suppress(httpx2.TransportError):  # its worker is killed, as intended
        host.get(path)


def test_a_request_timeout_answers_504_and_the_host_stays_healthy(host_factory):
    host = host_factory(POLYSERVE_REQUEST_TIMEOUT="1")
    asleep = "import asyncio\nasync def handle(request):\n    await asyncio.sleep(30)\n"
    threads = "import time\ndef handle(request):\n    time.sleep(3)\n    return 'late'\n"
    assert host.deploy("f/slow", asleep).status_code == 200
    assert host.deploy("f/thread", threads).status_code == 200
    assert host.deploy("f/ok", SYNC).status_code == 200
    for path in ("/s/f/slow/", "/s/f/thread/"):
        r = host.get(path)
        assert r.status_code == 504 and "POLYSERVE_REQUEST_TIMEOUT" in r.json()["error"]
    assert host.get("/s/f/ok/").status_code == 200
    usage = host.get("/_polyserve/usage").json()["spaces"]
    assert usage["f/slow"]["errors"] == usage["f/slow"]["requests"] == 1


def test_max_requests_recycles_reuse_rows_and_leak_no_segment(host_factory):
    host = host_factory(args=("--max-requests", "10"))
    assert host.deploy("f/recycle", SYNC).status_code == 200
    shm = Path("/dev/shm") / segment_name(str(host.data_dir))
    size = shm.stat().st_size
    # What a leak could look like: this host's segment replaced or grown, or unnamed
    # multiprocessing segments (psm_*). Other hosts' polyserve-* segments (a test run
    # beside this one) are not this host's to judge.
    unnamed = set(Path("/dev/shm").glob("psm_*"))
    pids = set()
    for _ in range(300):
        r = host.get("/s/f/recycle/")
        assert r.status_code == 200
        pids.add(r.json()["pid"])
    assert len(pids) >= 20, "workers were recycled many times"
    assert requests(host, "f/recycle") == 300
    assert shm.stat().st_size == size
    assert set(Path("/dev/shm").glob("psm_*")) == unnamed
    until(
        lambda: host.get("/_polyserve/usage").json()["host"]["workers"] == 2,
        what="recycled workers' rows to be reused",
    )


MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /s/a/b/ HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"GET /s/a/b/ HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"POST /_polyserve/deploy HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
    b"GET /s/\x00/\xff/ HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\r\n",
]


def test_malformed_http_gets_no_5xx_and_kills_no_worker(host_factory):
    """In the spirit of gunicorn's malformed-request fixtures, against the whole host."""
    host = host_factory()
    workers = host.worker_pids()
    for raw in MALFORMED:
        with socket.create_connection(("127.0.0.1", host.port), timeout=10) as conn:
            conn.sendall(raw)
            conn.shutdown(socket.SHUT_WR)
            answer = b""
            with contextlib.suppress(ConnectionResetError, TimeoutError):
                while chunk := conn.recv(65536):
                    answer += chunk
        status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/") else b"closed"
        assert not status.startswith(b"5"), (raw[:60], answer[:200])
    assert host.get("/_polyserve/health").status_code == 200
    assert host.worker_pids() == workers
