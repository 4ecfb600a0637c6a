"""HAProxy in front of a fleet (contrib/haproxy.cfg, docs/load-balancer.md): a space's
requests go to one host, a host that leaves moves only its own spaces, and a host that is
not caught up with the fleet fails the health check and gets no requests.

A real PostgreSQL (tests/postgres.py), real 1-worker gunicorn hosts, and Debian's haproxy
started by the test (tests/haproxy.py); skipped, saying how to install it, without it.
"""

from __future__ import annotations

import os
import re
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.haproxy import HAProxy
from tests.helpers import HostProcess, until

pytestmark = [pytest.mark.postgres, pytest.mark.gunicorn]

FAST = {"POLYSERVE_CHECKPOINT_INTERVAL": "0.3", "POLYSERVE_FLEET_POLL_S": "0.5"}
SPACES = [f"lb/s{i:03d}" for i in range(300)]
MAIN = "def handle(request):\n    return 'ok'\n"

CLIENT: httpx.Client


@pytest.fixture(scope="module", autouse=True)
def _client() -> Iterator[httpx.Client]:
    global CLIENT
    with httpx.Client(headers={"Connection": "close"}, timeout=60) as CLIENT:
        yield CLIENT


@pytest.fixture
def balancer(haproxy_binary: str, tmp_path: Path) -> Iterator[Callable[..., HAProxy]]:
    started: list[HAProxy] = []

    def start(hosts: dict[str, HostProcess]) -> HAProxy:
        servers = {name: (h.port, i) for i, (name, h) in enumerate(hosts.items(), 1)}
        lb = HAProxy(haproxy_binary, tmp_path, servers)
        started.append(lb)
        lb.start()
        until(lambda: lb.up() == set(hosts), what="HAProxy's checks to find every host up")
        return lb

    yield start
    for lb in started:
        lb.stop()


def start_fleet(host_factory, url: str, names: str, **env: str) -> dict[str, HostProcess]:
    hosts = {
        n: host_factory(
            n, workers=1, POLYSERVE_DATABASE_URL=url, POLYSERVE_HOST_ID=n, **FAST, **env
        )
        for n in names
    }
    first = next(iter(hosts.values()))
    until(lambda: live(first) == set(names), what="every host live in the fleet")
    return hosts


def live(host: HostProcess) -> set[str]:
    hosts = CLIENT.get(host.url + "/_polyserve/fleet").json()["hosts"]
    return {h["id"] for h in hosts if h["live"]}


def deploy(host: HostProcess, space: str) -> None:
    files = {"module": ("main.py", MAIN.encode())}
    r = CLIENT.post(host.url + "/_polyserve/deploy", data={"space": space}, files=files)
    assert r.status_code == 200, r.text


def call_all(lb: HAProxy, paths: list[str]) -> None:
    def one(path: str) -> None:
        r = CLIENT.get(lb.url + path)
        assert r.status_code == 200, (path, r.status_code, r.text)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, paths))


def loaded_on(hosts: dict[str, HostProcess]) -> dict[str, set[str]]:
    """Each space of SPACES: the hosts whose workers have it loaded."""
    found: dict[str, set[str]] = {space: set() for space in SPACES}
    for name, host in hosts.items():
        spaces = CLIENT.get(host.url + "/_polyserve/usage").json()["spaces"]
        for space in SPACES:
            if spaces.get(space, {}).get("loaded"):
                found[space].add(name)
    return found


def routed(lb: HAProxy) -> list[tuple[str, str]]:
    """(server, path) of each request in HAProxy's log (option httplog)."""
    text = lb.log.read_text(errors="replace")
    return re.findall(r" polyserve polyserve/(\w+) .*?\"GET (\S+) ", text)


def test_each_space_is_loaded_on_one_host_and_only_a_leaving_hosts_spaces_move(
    host_factory, fleet_db, balancer
):
    hosts = start_fleet(host_factory, fleet_db, "abc")
    with ThreadPoolExecutor(4) as pool:  # through one host: every host applies each
        list(pool.map(lambda space: deploy(hosts["a"], space), SPACES))
    lb = balancer(hosts)

    # Each space called 3 times: a balancer that spreads requests would load it on
    # several hosts.
    call_all(lb, [f"/s/{space}/" for space in SPACES for _ in range(3)])
    before = loaded_on(hosts)
    assert {space: len(on) for space, on in before.items()} == {space: 1 for space in SPACES}
    home = {space: next(iter(on)) for space, on in before.items()}
    spread = Counter(home.values())
    print(f"spread over 3 hosts: {dict(sorted(spread.items()))}")
    assert set(spread) == {"a", "b", "c"} and min(spread.values()) >= 50, spread

    # The inference protocol's paths, and a version suffix, go where the space's prefix
    # goes (whatever a handle() space answers them).
    sample = SPACES[:30]
    for space in sample:
        owner, name = space.split("/")
        for path in (f"/v2/models/{space}/ready", f"/s/{owner}/{name}@1/", f"/s/{space}"):
            CLIENT.get(lb.url + path)
    asked = {
        path
        for space in sample
        for path in (f"/v2/models/{space}/ready", f"/s/{space}@1/", f"/s/{space}")
    }
    # HAProxy writes a request's log line after its answer: wait for the last ones.
    until(lambda: asked <= {path for _, path in routed(lb)}, what="every request in the log")
    seen = {(server, path) for server, path in routed(lb)}
    for space in sample:
        owner, name = space.split("/")
        for path in (f"/v2/models/{space}/ready", f"/s/{owner}/{name}@1/", f"/s/{space}"):
            assert (home[space], path) in seen, (space, path, home[space])

    hosts["c"].stop()  # its master, by PID: a graceful stop
    until(lambda: lb.up() == {"a", "b"}, what="HAProxy to mark c down")
    call_all(lb, [f"/s/{space}/" for space in SPACES for _ in range(3)])
    after = loaded_on({n: hosts[n] for n in "ab"})
    moved = [space for space in SPACES if home[space] == "c"]
    for space in SPACES:
        if home[space] == "c":
            assert len(after[space]) == 1, (space, after[space])
        else:  # stayed where it was, and loaded nowhere else
            assert after[space] == {home[space]}, (space, home[space], after[space])
    took = Counter(next(iter(after[space])) for space in moved)
    print(f"moved when c left: {len(moved)} of {len(SPACES)}, to {dict(sorted(took.items()))}")


def test_a_host_not_caught_up_fails_the_health_check_and_gets_no_requests(
    host_factory, fleet_db, balancer
):
    """A host whose follower stopped heartbeating for POLYSERVE_FLEET_LIVE_S answers 503
    on /_polyserve/health, so HAProxy takes it out; caught up again, it is back."""
    hosts = start_fleet(host_factory, fleet_db, "ab", POLYSERVE_FLEET_LIVE_S="2")
    lb = balancer(hosts)
    b = hosts["b"]
    assert CLIENT.get(b.url + "/_polyserve/health").status_code == 200
    follower = b.follower_pid()
    os.kill(follower, signal.SIGSTOP)
    try:
        health = until(
            lambda: (r := CLIENT.get(b.url + "/_polyserve/health")).status_code == 503 and r,
            what="b's health to answer 503",
        )
        assert "not caught up with the fleet" in health.json()["error"], health.text
        assert health.json()["pid"]
        until(lambda: lb.up() == {"a"}, what="HAProxy to mark b down")
        # b is not live: these deploys do not wait for it, and b has not applied them.
        # Every call answers 200, so none went to b (it would answer 404).
        fresh = [f"lb/new{i}" for i in range(10)]
        for space in fresh:
            deploy(hosts["a"], space)
        call_all(lb, [f"/s/{space}/" for space in fresh])
        assert {server for server, path in routed(lb) if "/new" in path} == {"a"}
    finally:
        os.kill(follower, signal.SIGCONT)
    until(lambda: CLIENT.get(b.url + "/_polyserve/health").status_code == 200, what="b back")
    until(lambda: lb.up() == {"a", "b"}, what="HAProxy to mark b up again")
