"""A real host: deleted spaces give their slots back, and no version in use is pruned."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx

from tests.helpers import HostProcess, make_tar, until


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
    until(lambda: not usage(host)["x/a"]["loaded"], 20, "x/a to be released in every worker")

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


@contextlib.contextmanager
def slow_call(host: HostProcess, space: str, marker: Path) -> Iterator[list[httpx.Response]]:
    """A call to a lazy space's /slow, in flight for the with-block; after it the marker
    lets the call end, and the list holds its answer."""
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(host.get(f"/s/{space}/slow")))
    thread.start()
    try:
        until(
            lambda: host.get("/_polyserve/usage").json()["host"]["in_flight"] >= 1,
            20,
            "the slow call to be in flight",
        )
        yield answers
    finally:
        marker.touch()
        thread.join(30)


def test_a_draining_request_reads_its_version_while_newer_ones_are_deployed(host_factory, tmp_path):
    """Five deploys while a request on v1 is in flight: v1's files stay until it ends,
    though only 3 versions are kept."""
    host = host_factory(workers=1, POLYSERVE_KEEP_VERSIONS="3")
    marker = tmp_path / "go"
    assert host.deploy("o/lazy", lazy_space("v1", marker), "s.tar").status_code == 200
    versions = host.data_dir / "spaces" / "o" / "lazy" / "versions"
    with slow_call(host, "o/lazy", marker) as answers:
        for n in range(2, 7):
            assert host.deploy("o/lazy", lazy_space(f"v{n}", marker), "s.tar").status_code == 200
        assert (versions / "1").is_dir()
    assert answers[0].status_code == 200 and answers[0].text == "v1", answers[0].text
    assert host.get("/s/o/lazy/").text == "v6"
    # Once the request ended and v1 was dropped, the worker pruned what nobody uses.
    until(lambda: not (versions / "1").exists(), 20, "v1 to be pruned")
    kept = sorted(int(p.name) for p in versions.iterdir() if p.is_dir())
    assert kept == [4, 5, 6]


def test_a_deleted_space_keeps_the_version_a_draining_request_reads(host_factory, tmp_path):
    """Delete during a request: it still finishes on its version; then the files go."""
    host = host_factory(workers=1)
    marker = tmp_path / "go"
    assert host.deploy("o/gone", lazy_space("last", marker), "s.tar").status_code == 200
    with slow_call(host, "o/gone", marker) as answers:
        assert delete(host, "o/gone").status_code == 200
        assert host.get("/s/o/gone/").status_code == 404
    assert answers[0].status_code == 200 and answers[0].text == "last"
    versions = host.data_dir / "spaces" / "o" / "gone" / "versions"
    until(lambda: list(versions.iterdir()) == [], 20, "the deleted space's files to go")
