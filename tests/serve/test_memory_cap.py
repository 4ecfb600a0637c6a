"""A real host under POLYSERVE_WORKER_MEMORY_MB: LRU release, and a 503 instead of dying."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import HostProcess, until

CAP_MB = 160  # an idle worker holds ~45 MiB anonymous: room for one 60 MiB space, never two
SPACE_MB = 60


def hog(marker: Path) -> str:
    """A space holding SPACE_MB of anonymous memory; its /slow waits for the marker."""
    return (
        "import os, time\n"
        f"BLOB = bytearray({SPACE_MB} << 20)\n"
        "def handle(request):\n"
        "    if request.url.path.endswith('/slow'):\n"
        f"        while not os.path.exists({str(marker)!r}):\n"
        "            time.sleep(0.01)\n"
        "    return 'ok'\n"
    )


def anon_mb(pid: int) -> int:
    """The worker's anonymous resident memory, what the cap bounds."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) >> 10
    raise AssertionError("no RssAnon")


def usage(host: HostProcess) -> dict:
    return host.get("/_polyserve/usage").json()["spaces"]


@pytest.mark.gunicorn
def test_a_capped_worker_releases_idle_spaces_and_answers_503_when_nothing_can_go(
    host_factory, tmp_path
):
    """Round-robin over spaces too big to share the cap: each load releases the least
    recently used one and memory stays under the cap; with the only other space in flight,
    a load answers 503 with Retry-After and the same worker serves on."""
    host = host_factory(workers=1, POLYSERVE_WORKER_MEMORY_MB=str(CAP_MB))
    marker = tmp_path / "go"
    names = [f"o/hog{i}" for i in range(3)]
    for name in names:
        assert host.deploy(name, hog(marker)).status_code == 200
    (pid,) = host.worker_pids()
    for _ in range(2):
        for name in names:
            r = host.get(f"/s/{name}/")
            assert r.status_code == 200, r.text
            assert anon_mb(pid) <= CAP_MB
    spaces = usage(host)
    assert [spaces[n]["loaded"] for n in names] == [False, False, True]
    hog0 = spaces["o/hog0"]
    assert (hog0["released_idle"], hog0["released_memory"], hog0["released_demand"]) == (0, 2, 0)

    answers = []
    slow = threading.Thread(target=lambda: answers.append(host.get("/s/o/hog0/slow")))
    slow.start()  # o/hog0 loads (o/hog2 is let go) and stays in flight
    try:
        until(lambda: usage(host)["o/hog0"]["loaded"], 20, "o/hog0 to be loaded")
        refused = host.get("/s/o/hog1/")
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert "POLYSERVE_WORKER_MEMORY_MB" in refused.json()["error"]
        assert anon_mb(pid) <= CAP_MB  # the refused load's memory went at once
    finally:
        marker.touch()
        slow.join(30)
    assert answers[0].status_code == 200
    assert host.get("/s/o/hog1/").status_code == 200  # now o/hog0 is idle: it goes
    assert host.worker_pids() == {pid}
    hog1 = usage(host)["o/hog1"]
    assert (hog1["requests"], hog1["errors"]) == (4, 1)  # the 503 counts as an error


BURST_CAP_MB = 150
BURST_SPACE_MB = 30
BURST = 50  # requests, ten at a time (the 200: bench/NOTES.md)
# What every refusal of the burst may say: the memory is held by something that will let
# it go. Each space fits the cap alone with room to spare.
HELD_BY = ("requests in flight", "other loads in flight take memory too")


def touched(mib: int) -> str:
    """A space whose import allocates `mib` MiB and touches every page, so it is resident."""
    return (
        f"BLOB = bytearray({mib} << 20)\n"
        "for i in range(0, len(BLOB), 4096):\n"
        "    BLOB[i] = 1\n"
        "def handle(request):\n"
        "    return 'ok'\n"
    )


@pytest.mark.gunicorn
def test_a_burst_of_cold_loads_waits_for_room_and_leaves_a_worker_that_can_load_again(
    host_factory,
):
    """One worker capped at 150 MiB, ten spaces whose import allocates 30 MiB: after one
    round one at a time, a burst of requests ten at a time is served (a refusal says
    what holds the memory, never that the cap is too small), the worker ends under its
    cap, and one at a time every space loads again."""
    host = host_factory(workers=1, POLYSERVE_WORKER_MEMORY_MB=str(BURST_CAP_MB))
    names = [f"o/burst{i}" for i in range(10)]
    for name in names:
        assert host.deploy(name, touched(BURST_SPACE_MB)).status_code == 200
    (pid,) = host.worker_pids()
    for name in names:
        assert host.get(f"/s/{name}/").status_code == 200

    with ThreadPoolExecutor(10) as pool:
        burst = list(pool.map(lambda i: host.get(f"/s/{names[i % 10]}/"), range(BURST)))
    assert any(r.status_code == 200 for r in burst)
    refused = [r for r in burst if r.status_code != 200]
    assert all(r.status_code == 503 for r in refused), [r.text for r in refused]
    errors = [r.json()["error"] for r in refused]
    assert all(any(reason in e for reason in HELD_BY) for e in errors), errors
    # Freed heap is handed back: the worker is under its cap, whatever it holds.
    until(lambda: anon_mb(pid) <= BURST_CAP_MB, 10, f"RssAnon under {BURST_CAP_MB} MiB")

    for name in names:
        r = host.get(f"/s/{name}/")
        assert r.status_code == 200, r.text
        assert anon_mb(pid) <= BURST_CAP_MB
    assert host.worker_pids() == {pid}


@pytest.mark.gunicorn
def test_a_version_no_worker_could_load_under_the_cap_is_refused_at_deploy(host_factory):
    """Its validation measures what the load takes: past the cap (beside what a worker
    holds with no space) the deploy is a 422 saying so, and the kept version serves on."""
    host = host_factory(workers=1, POLYSERVE_WORKER_MEMORY_MB=str(CAP_MB))
    small = f"BLOB = bytearray({SPACE_MB} << 20)\ndef handle(request):\n    return 'small'\n"
    assert host.deploy("o/grow", small).status_code == 200
    big = f"BLOB = bytearray({CAP_MB + 20} << 20)\ndef handle(request):\n    return 'big'\n"
    refused = host.deploy("o/grow", big)
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert "POLYSERVE_WORKER_MEMORY_MB" in body["error"] and body["cap_mib"] == CAP_MB
    assert body["memory_mib"] >= CAP_MB + 20
    # Not over the cap alone, only beside an idle worker's own memory.
    near = f"BLOB = bytearray({CAP_MB - 10} << 20)\ndef handle(request):\n    return 'near'\n"
    assert host.deploy("o/grow", near).status_code == 422
    assert host.get("/s/o/grow/").text == "small"
    assert host.get("/_polyserve/spaces/o/grow/versions").json()["current"] == 1
