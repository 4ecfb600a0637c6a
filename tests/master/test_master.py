"""The master's life on real gunicorn hosts: failed starts, and restarts after kill -9.

A start that fails leaves /dev/shm as it found it; the data-dir lock is the master's
alone, so a restart does not wait for the workers a killed master left draining, and
what they answer after it is counted on the new host once they are gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from polyserve.master import leftover
from polyserve.state.shm import H_ALIVE, Table, segment_name
from polyserve.usage import meter
from polyserve.usage.meter import CELLS, Cell
from tests.helpers import HostProcess, alive, until

SHM = Path("/dev/shm")
# Answers at once, or after ?sleep=<seconds> and once the file ?until=<path> exists: a
# request that keeps its worker draining for as long as a test needs.
SLEEPER = (
    "import os, time\n"
    "def handle(request):\n"
    "    time.sleep(float(request.query_params.get('sleep', '0')))\n"
    "    gate, end = request.query_params.get('until'), time.monotonic() + 120\n"
    "    while gate and not os.path.exists(gate) and time.monotonic() < end:\n"
    "        time.sleep(0.01)\n"
    "    return 'done'\n"
)


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port this test holds open, so gunicorn cannot bind it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def failed_start(data_dir: Path, port: int) -> int:
    """Run a master on a port in use; gunicorn gives up binding it. Its exit status."""
    failed = HostProcess(data_dir, workers=1)
    code, log = failed.start_expecting_exit(port)  # gunicorn tries to bind 5 times, 1 s apart
    assert "Connection in use" in log
    return code


def segments_since(data_dir: Path, started_ns: int) -> list[str]:
    """This data directory's segments created or written since started_ns."""
    names = {segment_name(str(data_dir)), segment_name(str(data_dir.resolve()))}
    found = []
    for path in SHM.glob("polyserve-*"):
        with contextlib.suppress(FileNotFoundError):  # another host's, unlinked meanwhile
            if path.name in names and path.stat().st_mtime_ns >= started_ns:
                found.append(path.name)
    return found


@pytest.mark.gunicorn
def test_a_start_on_a_port_in_use_leaves_no_segment(tmp_path):
    data_dir = tmp_path / "data"
    shm = SHM / segment_name(str(data_dir))
    started_ns = time.time_ns()
    try:
        with taken_port() as port:
            assert failed_start(data_dir, port) != 0
        assert not shm.exists()
        assert segments_since(data_dir, started_ns) == []
    finally:
        shm.unlink(missing_ok=True)


def test_a_failed_start_keeps_a_killed_masters_segment_for_the_next_start(host_factory):
    host = host_factory(workers=1, POLYSERVE_CHECKPOINT_INTERVAL="60")  # no checkpoint
    assert host.deploy("m/left", SLEEPER).status_code == 200
    for _ in range(7):
        assert host.get("/s/m/left/").status_code == 200
    workers = host.worker_pids()
    os.kill(host.proc.pid, signal.SIGKILL)
    until(lambda: host.proc.poll() is not None, what="the master to die")
    until(lambda: not any(alive(p) for p in workers), what="orphaned workers to exit")
    shm = SHM / segment_name(str(host.data_dir))
    leftover = shm.stat()
    with taken_port() as port:
        assert failed_start(host.data_dir, port) != 0
    # The dead master's segment is the only exact record of its counts: a start that
    # never served must neither consume it nor put one of its own in its place.
    after = shm.stat()
    assert (after.st_ino, after.st_mtime_ns) == (leftover.st_ino, leftover.st_mtime_ns)
    host.start()
    assert host.get("/_polyserve/usage").json()["spaces"]["m/left"]["requests"] == 7


def _call(host: HostProcess, path: str) -> None:
    with contextlib.suppress(httpx2.TransportError):  # its worker is killed at the end
        httpx2.get(host.url + path, timeout=120)


def test_a_restart_after_kill_9_of_the_master_does_not_wait_for_its_workers(host_factory):
    host = host_factory(workers=1)
    assert host.deploy("m/slow", SLEEPER).status_code == 200
    old_workers = host.worker_pids()
    request = threading.Thread(target=_call, args=(host, "/s/m/slow/?sleep=60"), daemon=True)
    try:
        request.start()
        until(
            lambda: host.get("/_polyserve/usage").json()["host"]["in_flight"] == 1,
            what="the slow request to be in flight",
        )
        os.kill(host.proc.pid, signal.SIGKILL)
        until(lambda: host.proc.poll() is not None, what="the master to die")
        # The kernel told the worker (PR_SET_PDEATHSIG); it drains its request.
        assert any(alive(p) for p in old_workers), "the old worker left before the restart"
        host.start()  # the same data directory: refused while a worker held host.lock
        assert host.get("/s/m/slow/").text == "done"
        assert any(alive(p) for p in old_workers), "the old worker drained: nothing proven"
    finally:
        _kill(old_workers)
        request.join(timeout=60)


# -- what the old workers answer after the restart ---------------------------------------


def test_late_counts_bill_each_residency_stretch_once():
    """The fold's arithmetic (leftover.add_late_counts), on private tables: µs clock."""
    alive_at = 1_000  # the dead master's last checkpoint (H_ALIVE)
    old = Table.anonymous(2, 3, CELLS)
    old.set_header(H_ALIVE, alive_at)
    cells = old.cell_array()
    drained, killed = cells[0, 1], cells[1, 1]  # one space in two old workers' rows
    drained[[Cell.REQUESTS, Cell.RESIDENT_US, Cell.LOADED_SINCE_US]] = (5, 50, 400)
    killed[Cell.LOADED_SINCE_US] = 900  # a worker that will die without folding
    cells[0, 2, Cell.LOADED_SINCE_US] = 1_500  # a stretch opened after the checkpoint
    taken = meter.leftover_totals(old)
    assert taken[1, Cell.RESIDENT_US] == 50 + (1_000 - 400) + (1_000 - 900)
    new = Table.anonymous(2, 3, CELLS)
    meter.set_base(new, taken)  # what the new master starts from
    # After that, the first worker answers 2 requests and leaves gracefully at 1,800.
    drained[Cell.REQUESTS] += 2
    drained[Cell.BUSY_US] += 30
    for c in (cells[0, 1], cells[0, 2]):
        c[Cell.RESIDENT_US] += 1_800 - c[Cell.LOADED_SINCE_US]
        c[Cell.LOADED_SINCE_US] = 0
    leftover.add_late_counts(new, old, taken)
    base = new.cell_array()[new.base_row]
    assert base[1, Cell.REQUESTS] == 7 and base[1, Cell.BUSY_US] == 30
    # Each stretch once, up to its known end: the graceful exit, or the last checkpoint.
    assert base[1, Cell.RESIDENT_US] == 50 + (1_800 - 400) + (1_000 - 900)
    assert base[2, Cell.RESIDENT_US] == 1_800 - 1_500
    assert not base[:, Cell.LOADED_SINCE_US].any()


SLOW_S = 4  # the least each old worker's request takes; each waits for its gate file too
FAST, SLOW = "m/fast", "m/slow"


class _Calls:
    """Requests made from threads; `answers` gets (status, text) of each answered one."""

    def __init__(self, urls: list[str]) -> None:
        self.answers: list[tuple[int, str]] = []
        self.threads = [threading.Thread(target=self._call, args=(u,), daemon=True) for u in urls]
        for t in self.threads:
            t.start()

    def _call(self, url: str) -> None:
        with contextlib.suppress(httpx2.TransportError):  # its worker was killed
            r = httpx2.get(url, headers={"Connection": "close"}, timeout=180)
            self.answers.append((r.status_code, r.text))

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=180)


def _kill_9_during(host: HostProcess, paths: list[str]) -> _Calls:
    """Start the requests, and kill -9 the master once they are all in flight."""
    calls = _Calls([host.url + p for p in paths])
    until(
        lambda: host.get("/_polyserve/usage").json()["host"]["in_flight"] == len(paths),
        what="the requests to be in flight",
    )
    os.kill(host.proc.pid, signal.SIGKILL)
    until(lambda: host.proc.poll() is not None, what="the master to die")
    return calls


def _space(host: HostProcess, space: str) -> dict:
    return host.get("/_polyserve/usage").json()["spaces"][space]


def _kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    until(lambda: not any(alive(p) for p in pids), what="old workers to be gone")


def test_what_old_workers_answer_after_the_restart_is_counted_on_the_new_host(host_factory):
    fast, slow = 5, 3
    host = host_factory(workers=2, POLYSERVE_CHECKPOINT_INTERVAL="0.2")
    for space in (FAST, SLOW):
        assert host.deploy(space, SLEEPER).status_code == 200
    for _ in range(fast):
        assert host.get(f"/s/{FAST}/").text == "done"
    old_workers = host.worker_pids()
    gate = host.data_dir.parent / "answer-now"
    try:
        calls = _kill_9_during(host, [f"/s/{SLOW}/?sleep={SLOW_S}&until={gate}"] * slow)
        host.start()  # its when_ready has read the dead master's segment
        assert any(alive(p) for p in old_workers), "the old workers left before the restart"
        assert len(calls.answers) < slow, "all answered before the restart: nothing proven"
        gate.touch()  # however long the restart took on a busy machine
        calls.join()
        assert calls.answers == [(200, "done")] * slow
        # Counted once every old worker is gone, at the new master's next checkpoint.
        want = {FAST: fast, SLOW: slow}

        def counted() -> dict[str, int]:
            return {space: _space(host, space)["requests"] for space in want}

        with contextlib.suppress(AssertionError):  # the assert below shows what was counted
            until(lambda: counted() == want, what="the late counts")
        assert counted() == want
        late = _space(host, SLOW)
        assert late["errors"] == 0 and late["busy_ms"] >= slow * SLOW_S * 1000
        assert late["warm_s"] >= SLOW_S  # folded by each old worker as it left
        assert not any(alive(p) for p in old_workers)
    finally:
        _kill(old_workers)


def test_a_stop_while_old_workers_drain_waits_for_them_and_keeps_their_counts(host_factory):
    host = host_factory(workers=1, POLYSERVE_CHECKPOINT_INTERVAL="60")  # only on_exit folds
    assert host.deploy(SLOW, SLEEPER).status_code == 200
    old_workers = host.worker_pids()
    gate = host.data_dir.parent / "answer-now"
    try:
        calls = _kill_9_during(host, [f"/s/{SLOW}/?sleep={SLOW_S}&until={gate}"])
        host.start()
        assert any(alive(p) for p in old_workers), "the old worker left before the stop"
        gate.touch()
        host.stop()  # on_exit waits for it: well within gunicorn's graceful timeout
        assert not any(alive(p) for p in old_workers)
        assert not (SHM / segment_name(str(host.data_dir))).exists()
        calls.join()
        assert calls.answers == [(200, "done")]
        host.start()  # from the checkpoint the stop wrote
        assert _space(host, SLOW)["requests"] == 1
    finally:
        _kill(old_workers)


def test_a_stop_kills_old_workers_past_the_graceful_timeout_and_folds_them(host_factory):
    host = host_factory(workers=1, POLYSERVE_CHECKPOINT_INTERVAL="60")
    assert host.deploy(SLOW, SLEEPER).status_code == 200
    old_workers = host.worker_pids()
    try:
        calls = _kill_9_during(host, [f"/s/{SLOW}/?sleep=120"])
        host.args = ("--graceful-timeout", "1")
        host.start()
        host.stop()  # on_exit waits 1 s for the old worker, then kills it
        assert not any(alive(p) for p in old_workers), "a stop left an old worker running"
        calls.join()
        assert calls.answers == []  # killed: never answered, so never counted
        host.args = ()
        host.start()
        killed = _space(host, SLOW)
        assert killed["requests"] == 0 and killed["cold_starts"] == 1
        assert killed["warm_s"] >= 1  # its stretch, closed when it was killed
    finally:
        _kill(old_workers)
