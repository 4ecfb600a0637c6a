"""Integration tests of metering on a real 2-worker gunicorn: exact, and nothing lost."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from polyserve.state.shm import segment_name
from tests.helpers import HostProcess, alive, until

SYNC = "import os\ndef handle(request):\n    return {'pid': os.getpid()}\n"
SLEEPY = "import time\ndef handle(request):\n    time.sleep(0.2)\n    return 'done'\n"


def usage(host: HostProcess, space: str) -> dict:
    return host.get("/_polyserve/usage").json()["spaces"][space]


def call(host: HostProcess, space: str, n: int) -> None:
    for _ in range(n):
        assert host.get(f"/s/{space}/").status_code == 200


def test_concurrent_requests_are_counted_exactly(host_factory):
    host = host_factory()
    assert host.deploy("u/sync", SYNC).status_code == 200
    assert host.deploy("u/async", SYNC.replace("def handle", "async def handle")).status_code == 200

    async def burst(space: str) -> set[int]:
        limits = httpx2.Limits(max_connections=64)
        async with httpx2.AsyncClient(base_url=host.url, limits=limits, timeout=60) as client:
            answers = await asyncio.gather(*(client.get(f"/s/{space}/") for _ in range(400)))
        assert {r.status_code for r in answers} == {200}
        return {r.json()["pid"] for r in answers}

    for space in ("u/sync", "u/async"):
        before = usage(host, space)["requests"]
        asyncio.run(burst(space))
        assert usage(host, space)["requests"] == before + 400


def test_busy_time_is_the_time_spent_answering(host_factory):
    host = host_factory()
    assert host.deploy("u/sleepy", SLEEPY).status_code == 200
    call(host, "u/sleepy", 1)  # the import is not part of what is measured below
    before = usage(host, "u/sleepy")["busy_ms"]
    spent = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        assert host.get("/s/u/sleepy/").text == "done"
        spent += time.perf_counter() - t0
    busy = usage(host, "u/sleepy")["busy_ms"] - before
    # Each call sleeps 200 ms inside the space, and the host cannot have been busy
    # longer than the client waited for it.
    assert 1000 <= busy <= spent * 1000


def test_a_killed_worker_loses_no_counts_and_the_host_keeps_serving(host_factory):
    host = host_factory()
    assert host.deploy("u/k", SYNC).status_code == 200
    call(host, "u/k", 100)
    assert usage(host, "u/k")["requests"] == 100
    victim = sorted(host.worker_pids())[0]
    os.kill(victim, signal.SIGKILL)
    seen = []

    def replaced():
        seen.append(usage(host, "u/k")["requests"])
        pids = host.worker_pids()
        return victim not in pids and len(pids) == 2

    until(replaced, what="gunicorn to replace the killed worker")
    assert min(seen) == 100
    call(host, "u/k", 50)
    assert usage(host, "u/k")["requests"] == 150


def test_hup_keeps_the_counts(host_factory):
    host = host_factory()
    assert host.deploy("u/h", SYNC).status_code == 200
    call(host, "u/h", 30)
    host.hup()
    assert usage(host, "u/h")["requests"] == 30
    call(host, "u/h", 5)
    assert usage(host, "u/h")["requests"] == 35


def test_stop_and_start_keeps_the_counts_and_leaks_no_segment(host_factory):
    host = host_factory()
    assert host.deploy("u/s", SYNC).status_code == 200
    call(host, "u/s", 25)
    before = usage(host, "u/s")
    host.stop()
    assert not (Path("/dev/shm") / segment_name(str(host.data_dir))).exists()
    assert "resource_tracker" not in host.log.read_text(), "Python's tracker got involved"
    host.start()
    after = usage(host, "u/s")
    assert after["requests"] == 25 and after["busy_ms"] == before["busy_ms"]
    assert after["warm_s"] >= before["warm_s"] and after["loaded"] is False


def test_a_master_killed_with_sigkill_loses_no_counts(host_factory):
    host = host_factory(POLYSERVE_CHECKPOINT_INTERVAL="60")  # no checkpoint to fall back on
    assert host.deploy("u/m", SYNC).status_code == 200
    call(host, "u/m", 40)
    workers = host.worker_pids()
    host.proc.send_signal(signal.SIGKILL)
    host.proc.wait()
    # Workers are told of the master's death (PR_SET_PDEATHSIG) and leave.
    until(lambda: not any(alive(p) for p in workers), what="orphaned workers to exit")
    assert (Path("/dev/shm") / segment_name(str(host.data_dir))).exists()
    host.start()  # recovers the leftover segment
    assert usage(host, "u/m")["requests"] == 40
    host.stop()
    assert not (Path("/dev/shm") / segment_name(str(host.data_dir))).exists()


def test_idle_release_folds_residency(host_factory):
    host = host_factory(POLYSERVE_IDLE_TTL="1")
    assert host.deploy("u/i", SYNC).status_code == 200
    call(host, "u/i", 1)
    assert usage(host, "u/i")["loaded"] is True
    until(lambda: usage(host, "u/i")["loaded"] is False, what="idle release")
    u = usage(host, "u/i")
    assert u["warm_s"] >= 1 and u["workers_loaded"] == 0 and u["cold_starts"] == 1
    assert u["last_import_ms"] > 0


def test_usage_reports_the_host_and_metrics_agree(host_factory):
    host = host_factory()
    assert host.deploy("u/p", SYNC).status_code == 200
    call(host, "u/p", 3)
    body = host.get("/_polyserve/usage").json()
    assert body["host"]["workers"] == 2 and body["host"]["in_flight"] == 0
    assert body["host"]["uptime_s"] > 0 and body["host"]["busy_ms"] >= 0
    text = host.get("/metrics").text
    samples = {
        (s.name, s.labels.get("space")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("polyserve_space_requests_total", "u/p")] == 3
    assert samples[("polyserve_workers", None)] == 2
