"""The local provider: real gunicorn hosts on this machine, found again and stopped by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx2 as httpx
import pytest

from polyserve.autoscale.local import MACHINE, LocalProvider
from polyserve.autoscale.provider import HostSpec
from tests.helpers import REPO, alive, until

pytestmark = pytest.mark.gunicorn


def provider(tmp_path: Path) -> LocalProvider:
    return LocalProvider(tmp_path / "hosts", REPO / "gunicorn.conf.py", workers=1)


def spec(host_id: str = "polyserve-cpu-test") -> HostSpec:
    return HostSpec("cpu", host_id, {"POLYSERVE_POOL": "cpu", "POLYSERVE_HOST_ID": host_id})


def group(pid: int) -> list[int]:
    """The PIDs in process group `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.fixture
def hosts(tmp_path: Path):
    p = provider(tmp_path)
    yield p
    for m in p.list("cpu"):  # whatever a failed test left: killed by PID
        p.delete(m)


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/_polyserve/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_host_is_created_found_again_stopped_gracefully_and_deleted(hosts, tmp_path):
    m = hosts.create(spec())
    until(lambda: answers(m.url), 60, "the host")
    again = provider(tmp_path).list("cpu")  # a restarted autoscaler finds it
    assert [(x.host_id, x.url, x.state) for x in again] == [(m.host_id, m.url, "running")]
    assert provider(tmp_path).list("gpu") == []

    hosts.stop(m, timeout_s=60)
    assert not alive(int(m.id))
    log = (tmp_path / "hosts" / m.host_id / "host.log").read_text()
    assert "Shutting down: Master" in log  # gunicorn's graceful stop, not a kill
    assert [x.state for x in hosts.list("cpu")] == ["exited"]
    hosts.delete(m)
    hosts.delete(m)  # idempotent
    assert hosts.list("cpu") == [] and not (tmp_path / "hosts" / m.host_id).exists()


def test_delete_after_kill_9_of_the_master_kills_the_workers_it_left(hosts):
    m = hosts.create(spec())
    until(lambda: answers(m.url), 60, "the host")
    pid = int(m.id)
    workers = [p for p in group(pid) if p != pid]
    assert workers
    os.kill(pid, signal.SIGKILL)
    until(lambda: hosts.list("cpu")[0].state == "exited", 30, "the master seen as gone")
    hosts.delete(m)
    assert not any(alive(w) for w in workers)


def test_a_pid_reused_by_another_process_is_never_signalled(hosts, tmp_path):
    """A record whose PID now names another process (its start time differs) is gone,
    and deleting it signals nothing."""
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        home = tmp_path / "hosts" / "polyserve-cpu-stale"
        home.mkdir(parents=True)
        record = {
            "pid": other.pid,
            "started": 1,  # not sleep's start time
            "host_id": "polyserve-cpu-stale",
            "pool": "cpu",
            "url": "http://127.0.0.1:9",
            "created_at": 0.0,
        }
        (home / MACHINE).write_text(json.dumps(record))
        (m,) = hosts.list("cpu")
        assert m.state == "exited"
        hosts.delete(m)
        assert other.poll() is None and not home.exists()
    finally:
        other.kill()
        other.wait()
