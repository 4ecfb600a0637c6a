"""The autoscaler's loop against stand-in hosts whose usage answers are scripted: one
host's garbage marks that host unhealthy, and every other host and pool is scaled as usual.

The scaler is the real one (its scrape over HTTP, its tracker, its decisions, a real
PostgreSQL fleet); the hosts are loopback servers answering /_polyserve/usage, and the
provider is a list of them. The clock is injected, so intervals pass without waiting.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from polyserve.autoscale import config
from polyserve.autoscale.provider import HostSpec, Machine
from polyserve.autoscale.scaler import Scaler
from polyserve.fleet.db import FleetDB
from tests.helpers import until

INTERVAL_S = 10.0
UNHEALTHY_S = 30.0


class Hosts:
    """One loopback server standing in for many hosts: `/<host id>/_polyserve/usage`
    answers what `answers[host id]` makes of the time."""

    def __init__(self) -> None:
        self.answers: dict[str, Callable[[float], bytes]] = {}
        self.now = 0.0
        hosts = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                host_id = self.path.split("/")[1]
                body = hosts.answers[host_id](hosts.now)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,))
        self.thread.start()

    def url(self, host_id: str) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/{host_id}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class Machines:
    """A provider whose machines are the stand-in hosts; it records what the scaler asks."""

    name = "standin"

    def __init__(self, machines: list[Machine]) -> None:
        self.machines = machines
        self.created: list[HostSpec] = []
        self.deleted: list[str] = []

    def list(self, pool: str) -> list[Machine]:
        return [m for m in self.machines if m.pool == pool]

    def create(self, spec: HostSpec) -> Machine:
        self.created.append(spec)
        machine = Machine(spec.host_id, spec.host_id, spec.pool, "", created_at=0.0)
        self.machines.append(machine)
        return machine

    def take_out(self, machine: Machine) -> None:
        pass

    def stop(self, machine: Machine, timeout_s: float) -> None:
        pass

    def delete(self, machine: Machine) -> None:
        self.deleted.append(machine.host_id)
        self.machines = [m for m in self.machines if m.host_id != machine.host_id]


def busy_half_the_time(now: float) -> bytes:
    """A healthy host of one worker, busy half of every second since it booted."""
    return (
        f'{{"host": {{"uptime_s": {now:.3f}, "busy_ms": {int(now * 500)},'
        ' "workers": 1, "in_flight": 0}}'
    ).encode()


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    h = Hosts()
    yield h
    h.close()


GARBAGE = {
    "nan": b'{"host": {"uptime_s": NaN, "busy_ms": 1, "workers": 1, "in_flight": 0}}',
    "1e400": b'{"host": {"uptime_s": 5, "busy_ms": 1e400, "workers": 1, "in_flight": 0}}',
    "huge int": b'{"host": {"uptime_s": 5, "busy_ms": 1' + b"0" * 400 + b', "workers": 1,'
    b' "in_flight": 0}}',
    "negative": b'{"host": {"uptime_s": 5, "busy_ms": -5000, "workers": 1, "in_flight": 0}}',
    "infinite uptime": b'{"host": {"uptime_s": Infinity, "busy_ms": 1, "workers": 1,'
    b' "in_flight": 0}}',
    "non-numeric": b'{"host": {"uptime_s": "5", "busy_ms": 1, "workers": "two", "in_flight": 0}}',
    "boolean": b'{"host": {"uptime_s": 5, "busy_ms": 1, "workers": true, "in_flight": 0}}',
    "host a list": b'{"host": [5, 1, 1, 0]}',
    "counter an object": b'{"host": {"uptime_s": {"s": 5}, "busy_ms": 1, "workers": 1,'
    b' "in_flight": 0}}',
    "a list": b"[1, 2]",
    "a string": b'"usage"',
}


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
def test_one_hosts_garbage_usage_marks_it_unhealthy_and_the_rest_scale_as_usual(
    hosts, fleet_db, caplog, garbage
):
    """A cpu pool of a bad host and a good one, a gpu pool of one good host: every
    interval decides both pools from the good hosts; the bad one counts as unanswered,
    is replaced once unhealthy for POLYSERVE_UNHEALTHY_S, and its replacement created."""
    hosts.answers = {"bad": lambda now: garbage, "good": busy_half_the_time}
    hosts.answers["gpu"] = busy_half_the_time
    cpu = Machines(
        [
            Machine("1", "bad", "cpu", hosts.url("bad"), created_at=0.0),
            Machine("2", "good", "cpu", hosts.url("good"), created_at=0.0),
        ]
    )
    gpu = Machines([Machine("3", "gpu", "gpu", hosts.url("gpu"), created_at=0.0)])
    settings = config.load(
        {
            "POLYSERVE_DATABASE_URL": fleet_db,
            "POLYSERVE_CPU_MIN_WORKERS": "2",
            "POLYSERVE_CPU_MAX_WORKERS": "2",
            "POLYSERVE_GPU_PROVIDER": "local",
            "POLYSERVE_GPU_MIN_WORKERS": "1",
            "POLYSERVE_GPU_MAX_WORKERS": "1",
            "POLYSERVE_SCALE_INTERVAL_S": str(INTERVAL_S),
            "POLYSERVE_UNHEALTHY_S": str(UNHEALTHY_S),
            "POLYSERVE_BOOT_GRACE_S": "1",
            "POLYSERVE_DRAIN_S": "1",
        }
    )
    db = FleetDB(fleet_db)
    scaler = Scaler(settings, db, {"cpu": cpu, "gpu": gpu}, clock=lambda: hosts.now)
    caplog.set_level(logging.INFO, "polyserve.autoscale")

    def unanswered(pool: str) -> float | None:
        return scaler.metrics.registry.get_sample_value(
            "polyserve_autoscale_hosts_by_status", {"pool": pool, "status": "unanswered"}
        )

    try:
        hosts.now = 1000.0
        first = {d.pool: d for d in scaler.step()}
        assert set(first) == {"cpu", "gpu"}
        assert unanswered("cpu") == 1 and unanswered("gpu") == 0
        # Until the bad host has been unhealthy for UNHEALTHY_S, both pools hold, each
        # with the ratio of its good hosts alone.
        while hosts.now < 1000.0 + UNHEALTHY_S:
            hosts.now += INTERVAL_S
            decisions = {d.pool: d for d in scaler.step()}
            assert set(decisions) == {"cpu", "gpu"}
            for pool in ("cpu", "gpu"):
                assert decisions[pool].ratio == pytest.approx(0.5), decisions[pool]
            assert decisions["cpu"].current == 2 and decisions["cpu"].desired == 2
            assert unanswered("cpu") == 1 and unanswered("gpu") == 0
            assert cpu.deleted == [] and cpu.created == []

        hosts.now += INTERVAL_S  # past UNHEALTHY_S: replaced, without a drain
        replaced = {d.pool: d for d in scaler.step()}
        assert replaced["cpu"].reason.startswith("bounds"), replaced["cpu"]
        until(lambda: cpu.deleted == ["bad"], 30, "the bad host deleted")
        assert [spec.pool for spec in cpu.created] == ["cpu"] and gpu.created == []
        assert gpu.deleted == []
        assert "host=bad bad usage:" in caplog.text
        assert "interval failed" not in caplog.text
    finally:
        scaler.close(30)
        db.close()
