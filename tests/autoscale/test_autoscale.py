"""The autoscaler for real: `polyserve autoscale` with the local provider scales real
gunicorn hosts around a real PostgreSQL, from the busy ratio of a real load.

Timings are shrunk (0.5 s intervals, windows of seconds) so a test runs in tens of
seconds; tests wait with deadlines, never a fixed sleep, and assert no timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from polyserve.autoscale.local import LocalProvider
from polyserve.fleet.db import FleetDB
from tests.helpers import REPO, alive, free_port, make_tar, until

pytestmark = [pytest.mark.postgres, pytest.mark.gunicorn]

BUSY = "import time\ndef handle(request):\n    time.sleep(0.05)\n    return {'ok': True}\n"
QUICK = "def handle(request):\n    return {'ok': True}\n"


class Autoscaler:
    """`python -m polyserve.cli autoscale`, started by a test and stopped by its PID, with
    the local hosts it made (found from their directories) killed by PID afterwards."""

    def __init__(self, tmp: Path, database_url: str, *args: str, **env: str) -> None:
        self.args = args
        self.hosts_dir = tmp / "hosts"
        self.metrics_port = free_port()
        self.log = tmp / "autoscale.log"
        self.env = {
            **os.environ,
            "POLYSERVE_DATABASE_URL": database_url,
            "POLYSERVE_LOCAL_DIR": str(self.hosts_dir),
            "POLYSERVE_LOCAL_WORKERS": "1",
            "POLYSERVE_AUTOSCALE_BIND": f"127.0.0.1:{self.metrics_port}",
            "POLYSERVE_SCALE_INTERVAL_S": "0.5",
            "POLYSERVE_TARGET_BUSY_RATIO": "0.5",
            "POLYSERVE_SCALE_UP_WINDOW_S": "1",
            "POLYSERVE_SCALE_DOWN_WINDOW_S": "3",
            "POLYSERVE_DRAIN_S": "1",
            "POLYSERVE_UNHEALTHY_S": "5",
            # The hosts it starts inherit these: quick polls and checkpoints.
            "POLYSERVE_FLEET_POLL_S": "0.5",
            "POLYSERVE_CHECKPOINT_INTERVAL": "0.3",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.db = FleetDB(database_url)

    def start(self) -> Autoscaler:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "polyserve.cli", "autoscale", *self.args],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=log,
            )
        return self

    def machines(self, pool: str = "cpu") -> list[dict]:
        found = []
        for path in self.hosts_dir.glob("*/machine.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being written or deleted
            if record["pool"] == pool:
                found.append(record)
        return found

    def live(self, pool: str = "cpu") -> list[dict]:
        return [h for h in self.db.hosts(10) if h["live"] and h["pool"] == pool]

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def tail(self) -> str:
        return self.log.read_text()[-4000:]

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        hosts = LocalProvider(self.hosts_dir, REPO / "gunicorn.conf.py", 1)
        for machine in hosts.list("cpu") + hosts.list("gpu"):
            hosts.delete(machine)  # by PID, checked against its start time
        self.db.close()


@pytest.fixture
def autoscaler(tmp_path: Path, fleet_db: str) -> Iterator[callable]:
    made: list[Autoscaler] = []

    def start(*args: str, **env: str) -> Autoscaler:
        made.append(Autoscaler(tmp_path, fleet_db, *args, **env).start())
        return made[-1]

    yield start
    for a in made:
        a.cleanup()


class Load:
    """Clients calling a space on the fleet's live hosts, as a load balancer that reads
    the fleet would: each request on a fresh connection to a host listed live (a host
    taken out of the fleet is no longer listed). Every answer is recorded."""

    def __init__(self, a: Autoscaler, space: str, clients: int, pause_s: float = 0.0) -> None:
        self.a, self.space, self.pause_s = a, space, pause_s
        self.results: Counter[str] = Counter()
        self.failures: list[str] = []
        self._urls: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._refresh)]
        self._threads += [threading.Thread(target=self._call, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Load:
        self._urls = [h["url"] for h in self.a.live()]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _refresh(self) -> None:
        db = FleetDB(self.a.db.url)
        while not self._stop.wait(0.1):
            self._urls = [h["url"] for h in db.hosts(10) if h["live"] and h["pool"] == "cpu"]
        db.close()

    def _call(self, i: int) -> None:
        with httpx.Client(headers={"Connection": "close"}, timeout=30) as client:
            n = i
            while not self._stop.is_set():
                urls = self._urls
                url = urls[n % len(urls)]
                n += 1
                try:
                    r = client.get(f"{url}/s/{self.space}/")
                    self.results[url] += r.status_code == 200
                    if r.status_code != 200:
                        self.failures.append(f"{url}: {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{url}: {exc!r}")
                if self.pause_s:
                    self._stop.wait(self.pause_s)


def deploy(url: str, space: str, source: str) -> None:
    r = httpx.post(
        f"{url}/_polyserve/deploy",
        data={"space": space},
        files={"module": ("main.py", source.encode())},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def fleet_requests(url: str, space: str) -> int:
    r = httpx.get(f"{url}/_polyserve/usage", params={"scope": "fleet"}, timeout=30)
    return r.json()["spaces"].get(space, {}).get("requests", 0)


def test_load_scales_the_pool_up_and_back_down_without_a_failed_request(autoscaler):
    a = autoscaler(POLYSERVE_CPU_MIN_WORKERS="1", POLYSERVE_CPU_MAX_WORKERS="3")
    first = until(lambda: a.live(), 90, "the pool's first host")[0]
    deploy(first["url"], "t/busy", BUSY)
    deploy(first["url"], "t/quick", QUICK)

    # Six clients keep ~6 s of busy time a second on hosts of one worker each: far over
    # the 0.5 target, so the pool grows to its maximum.
    with Load(a, "t/busy", clients=6) as heavy:
        live = until(lambda: len(a.live()) == 3 and a.live(), 120, f"3 hosts\n{a.tail()}")
    assert heavy.failures == []
    # Each new host serves the spaces deployed before it existed.
    for host in live:
        r = httpx.get(f"{host['url']}/s/t/quick/", timeout=30)
        assert r.status_code == 200, (host, r.text)
    assert 'polyserve_autoscale_current_hosts{pool="cpu"} 3.0' in a.metrics()
    scraped = httpx.get(f"{live[0]['url']}/_polyserve/usage?only=host", timeout=30).json()
    assert set(scraped) == {"host"} and scraped["host"]["workers"] == 1

    # A trickle: one client, a fast space, pauses. The pool shrinks back to one host
    # while it runs, and not one of its requests fails.
    with Load(a, "t/quick", clients=1, pause_s=0.02) as light:
        until(lambda: len(a.machines()) == 1, 120, f"back to 1 host\n{a.tail()}")
        until(lambda: len(light.results) >= 1 and sum(light.results.values()) > 50)
    assert light.failures == []
    assert len(a.live()) == 1
    # Every request the retired hosts answered is in the fleet's ledger: the quick
    # space's requests were the trickle's and the four checks above.
    answered = sum(light.results.values()) + len(live)
    survivor = a.live()[0]["url"]
    until(lambda: fleet_requests(survivor, "t/quick") == answered, 30, "the ledger")
    assert "scale down" in a.log.read_text()

    assert a.stop() == 0
    assert alive(a.machines()[0]["pid"])  # the fleet outlives its autoscaler


def test_a_host_killed_with_kill_9_is_replaced(autoscaler):
    a = autoscaler(POLYSERVE_CPU_MIN_WORKERS="1", POLYSERVE_CPU_MAX_WORKERS="2")
    first = until(lambda: a.live(), 90, "the pool's first host")[0]
    deploy(first["url"], "t/quick", QUICK)
    (victim,) = a.machines()
    os.kill(victim["pid"], signal.SIGKILL)

    def replaced() -> list[dict]:
        return [h for h in a.live() if h["id"] != victim["host_id"]]

    (new,) = until(replaced, 90, f"a replacement\n{a.tail()}")
    r = httpx.get(f"{new['url']}/s/t/quick/", timeout=30)
    assert r.status_code == 200, r.text
    until(lambda: [m["host_id"] for m in a.machines()] == [new["id"]], 30, "the old one gone")
    assert not (a.hosts_dir / victim["host_id"]).exists()
    assert 'polyserve_autoscale_actions_total{action="replaced",pool="cpu"} 1.0' in a.metrics()
    assert a.stop() == 0


def test_dry_run_decides_and_changes_nothing(autoscaler):
    a = autoscaler("--dry-run", "--once", POLYSERVE_CPU_MIN_WORKERS="2")
    assert a.proc.wait(timeout=60) == 0, a.tail()
    logged = a.log.read_text()
    assert "pool=cpu current=0" in logged and "desired=2" in logged
    assert logged.count("would do: created (dry run)") == 2
    assert a.machines() == [] and a.live() == []


def test_a_gpu_space_called_at_zero_brings_the_gpu_pool_up_and_idle_takes_it_down(autoscaler):
    """The local provider stands in for RunPod as the GPU pool's provider."""
    a = autoscaler(
        POLYSERVE_CPU_MIN_WORKERS="1",
        POLYSERVE_CPU_MAX_WORKERS="1",
        POLYSERVE_GPU_PROVIDER="local",
        POLYSERVE_GPU_MIN_WORKERS="0",
        POLYSERVE_GPU_MAX_WORKERS="1",
    )
    cpu = until(lambda: a.live(), 90, "the CPU pool's host")[0]
    tar = make_tar({"main.py": QUICK, "polyserve.toml": 'pool = "gpu"\n'})
    r = httpx.post(
        f"{cpu['url']}/_polyserve/deploy",
        data={"space": "t/big"},
        files={"module": ("big.tar", tar)},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["pool"] == "gpu", r.text
    assert a.machines("gpu") == []

    r = httpx.get(f"{cpu['url']}/s/t/big/", timeout=30)
    assert r.status_code == 503 and "Retry-After" in r.headers, r.text
    assert r.json()["pool"] == "gpu"

    (gpu,) = until(lambda: a.live("gpu"), 90, f"a GPU host\n{a.tail()}")

    def redirected() -> httpx.Response | None:
        # The CPU host's workers look the pool's hosts up at most once a second.
        r = httpx.get(f"{cpu['url']}/s/t/big/", timeout=30, follow_redirects=True)
        return r if r.status_code == 200 else None

    r = until(redirected, 30, "the CPU host redirecting to the GPU host")
    assert str(r.url).startswith(gpu["url"]) and r.history[0].status_code == 307
    assert "demand at zero" in a.log.read_text()

    # Idle: after the down window the GPU pool is back at its minimum, zero.
    until(lambda: a.machines("gpu") == [], 90, f"the GPU pool at zero\n{a.tail()}")
    assert [m["pool"] for m in a.machines("cpu")] == ["cpu"]
    assert a.stop() == 0
