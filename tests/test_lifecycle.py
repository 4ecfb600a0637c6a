"""A real host: deleted spaces give their slots back, and no version in use is pruned."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx2 as httpx

from tests.helpers import HostProcess, make_tar


def poll(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def usage(host: HostProcess) -> dict:
    return host.get("/_polyserve/usage").json()["spaces"]


def delete(host: HostProcess, space: str) -> httpx.Response:
    return httpx.delete(f"{host.url}/_polyserve/spaces/{space}", timeout=30)


HELLO = "def handle(request):\n    return 'hi'\n"


def test_deleted_spaces_give_their_slots_back_and_keep_their_usage(host_factory):
    """With POLYSERVE_MAX_SPACES=2, throwaway names cannot fill the table for good: a
    deleted space's slot is reused once no worker holds it, and its usage stays
    readable by name while the new owner counts from zero."""
    host = host_factory(POLYSERVE_MAX_SPACES="2")
    assert host.deploy("x/a", HELLO).status_code == 200
    for _ in range(3):
        assert host.get("/s/x/a/").text == "hi"
    assert delete(host, "x/a").status_code == 200
    assert host.deploy("x/b", HELLO).status_code == 200
    assert delete(host, "x/b").status_code == 200
    assert host.get("/_polyserve/spaces").json() == {"spaces": {}}
    poll(lambda: not usage(host)["x/a"]["loaded"], "x/a to be released in every worker")

    r = host.deploy("x/c", HELLO)
    assert r.status_code == 200, r.text
    assert host.deploy("x/d", HELLO).status_code == 200  # both deleted slots came back
    r = host.deploy("x/e", HELLO)
    assert r.status_code == 507 and "POLYSERVE_MAX_SPACES" in r.json()["error"]
    for _ in range(2):
        assert host.get("/s/x/c/").text == "hi"
    assert host.get("/s/x/a/").status_code == 404

    spaces = usage(host)
    assert (spaces["x/a"]["requests"], spaces["x/a"]["loaded"]) == (3, False)
    assert spaces["x/b"]["requests"] == 0
    assert spaces["x/c"]["requests"] == 2 and spaces["x/d"]["requests"] == 0

    host.stop()  # the hand-overs survive a restart, and so does the usage by name
    host.start()
    after = usage(host)
    assert {n: after[n]["requests"] for n in after} == {n: spaces[n]["requests"] for n in spaces}


def lazy_space(value: str, marker: Path) -> bytes:
    """A space whose handler imports its helper only at request time, after waiting for
    a marker file: the version's files are read while newer versions get deployed."""
    main = (
        "import os, time\n"
        "def handle(request):\n"
        "    if request.url.path.endswith('/slow'):\n"
        f"        while not os.path.exists({str(marker)!r}):\n"
        "            time.sleep(0.01)\n"
        "    import helpers\n"
        "    return helpers.VALUE\n"
    )
    return make_tar({"main.py": main, "helpers.py": f"VALUE = {value!r}\n"})


def slow_call(host: HostProcess, space: str, answers: list[httpx.Response]) -> threading.Thread:
    thread = threading.Thread(target=lambda: answers.append(host.get(f"/s/{space}/slow")))
    thread.start()
    return thread


def wait_in_flight(host: HostProcess, n: int) -> None:
    poll(lambda: host.get("/_polyserve/usage").json()["host"]["in_flight"] >= n, "in flight")


def test_a_draining_request_reads_its_version_while_newer_ones_are_deployed(host_factory, tmp_path):
    """Five deploys while a request on v1 is in flight: v1's files stay until it ends."""
    host = host_factory(workers=1)
    marker = tmp_path / "go"
    assert host.deploy("o/lazy", lazy_space("v1", marker), "s.tar").status_code == 200
    answers: list[httpx.Response] = []
    thread = slow_call(host, "o/lazy", answers)
    wait_in_flight(host, 1)
    for n in range(2, 7):
        assert host.deploy("o/lazy", lazy_space(f"v{n}", marker), "s.tar").status_code == 200
    versions = host.data_dir / "spaces" / "o" / "lazy" / "versions"
    assert (versions / "1").is_dir()
    marker.touch()
    thread.join(30)
    assert answers[0].status_code == 200 and answers[0].text == "v1", answers[0].text
    assert host.get("/s/o/lazy/").text == "v6"
    # Once the request ended and v1 was dropped, the worker pruned what nobody uses.
    poll(lambda: not (versions / "1").exists(), "v1 to be pruned")
    kept = sorted(int(p.name) for p in versions.iterdir() if p.is_dir())
    assert kept == [4, 5, 6]


def test_a_deleted_space_keeps_the_version_a_draining_request_reads(host_factory, tmp_path):
    """Delete during a request: it still finishes on its version; then the files go."""
    host = host_factory(workers=1)
    marker = tmp_path / "go"
    assert host.deploy("o/gone", lazy_space("last", marker), "s.tar").status_code == 200
    answers: list[httpx.Response] = []
    thread = slow_call(host, "o/gone", answers)
    wait_in_flight(host, 1)
    assert delete(host, "o/gone").status_code == 200
    assert host.get("/s/o/gone/").status_code == 404
    marker.touch()
    thread.join(30)
    assert answers[0].status_code == 200 and answers[0].text == "last"
    versions = host.data_dir / "spaces" / "o" / "gone" / "versions"
    poll(lambda: list(versions.iterdir()) == [], "the deleted space's files to go")
