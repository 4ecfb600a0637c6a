"""The autoscaler's `haproxy` hook: the hosts a provider makes go behind a real HAProxy
(contrib/haproxy.cfg, tests/haproxy.py) through its runtime API, and out again.

Real 1-worker gunicorn hosts from the local provider, Debian's haproxy started by the
test; skipped, saying how to install it, without it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from polyserve.autoscale.haproxy import Balanced, RuntimeAPI
from polyserve.autoscale.local import LocalProvider
from polyserve.autoscale.provider import HostSpec, Machine
from tests.haproxy import BACKEND, HAProxy
from tests.helpers import REPO, until

pytestmark = pytest.mark.gunicorn
ROUTED = r" polyserve/(\w+) .*?\"GET (\S+) "  # option httplog: the server, the path
MAIN = "def handle(request):\n    return 'ok'\n"


@pytest.fixture
def started(haproxy_binary: str) -> Iterator[list[HAProxy]]:
    balancers: list[HAProxy] = []
    yield balancers
    for lb in balancers:
        lb.stop()


def haproxy(binary: str, root: Path, started: list[HAProxy], **servers: tuple[int, int]) -> HAProxy:
    root.mkdir(parents=True, exist_ok=True)
    lb = HAProxy(binary, root, servers)
    started.append(lb)
    return lb.start()


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalProvider]:
    provider = LocalProvider(tmp_path / "hosts", REPO / "gunicorn.conf.py", workers=1)
    yield provider
    for m in provider.list("cpu"):  # whatever a failed test left: killed by PID
        provider.delete(m)


def spec(host_id: str) -> HostSpec:
    return HostSpec("cpu", host_id, {"POLYSERVE_POOL": "cpu", "POLYSERVE_HOST_ID": host_id})


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/_polyserve/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_hosts_the_local_provider_makes_go_behind_haproxy_and_out_again(
    haproxy_binary, started, local, tmp_path
):
    lb = haproxy(haproxy_binary, tmp_path / "lb", started)  # no server of its own
    hook = Balanced(local, RuntimeAPI(str(lb.socket)), BACKEND)
    one = hook.create(spec("polyserve-cpu-one"))
    servers = lb.servers()
    assert [(s.name, s.id, s.addr, s.port) for s in servers.values()] == [
        (one.host_id, 1, "127.0.0.1", port(one.url))
    ]
    until(lambda: lb.up() == {one.host_id}, 60, "HAProxy's check to find the host up")
    r = httpx.post(
        one.url + "/_polyserve/deploy", data={"space": "lb/x"}, files={"module": ("main.py", MAIN)}
    )
    assert r.status_code == 200, r.text
    assert httpx.get(lb.url + "/s/lb/x/").text == "ok"  # through HAProxy

    two = hook.create(spec("polyserve-cpu-two"))
    assert {s.name: s.id for s in lb.servers().values()} == {one.host_id: 1, two.host_id: 2}
    until(lambda: lb.up() == {one.host_id, two.host_id}, 60, "both hosts up")

    hook.take_out(one)  # no new requests: HAProxy drains it
    assert lb.servers()[one.host_id].draining and not lb.servers()[two.host_id].draining
    hook.stop(one, timeout_s=60)
    hook.delete(one)
    assert set(lb.servers()) == {two.host_id}

    # A restarted HAProxy without them: the next list() (each scaler step) adds them back.
    lb.stop()
    again = haproxy(haproxy_binary, tmp_path / "again", started)
    hook = Balanced(local, RuntimeAPI(str(again.socket)), BACKEND)
    assert [m.host_id for m in hook.list("cpu")] == [two.host_id]
    assert {s.name: s.port for s in again.servers().values()} == {two.host_id: port(two.url)}
    until(lambda: again.up() == {two.host_id}, 60, "the host up behind the new HAProxy")
    hook.delete(two)
    assert again.servers() == {}
    hook.delete(two)  # gone already: nothing to do


def test_a_host_added_at_runtime_takes_the_place_it_has_in_the_config_file(
    haproxy_binary, started, host_factory, tmp_path
):
    """The same spaces go to the same host whether HAProxy's config lists it or the hook
    added it: HAProxy 2.6 places a server added without an explicit id elsewhere."""
    hosts = {n: host_factory(n, workers=1) for n in "abc"}
    ports = {n: (h.port, i) for i, (n, h) in enumerate(hosts.items(), 1)}
    listed = haproxy(haproxy_binary, tmp_path / "listed", started, **ports)
    added = haproxy(haproxy_binary, tmp_path / "added", started, a=ports["a"], b=ports["b"])
    hook = Balanced(
        LocalProvider(tmp_path / "none", REPO / "gunicorn.conf.py", 1), added.api, BACKEND
    )
    hook.add(Machine("0", "c", "cpu", hosts["c"].url, 0.0), added.servers())
    for lb in (listed, added):
        until(lambda lb=lb: lb.up() == {"a", "b", "c"}, what="every host up")
    paths = [f"/s/lb/k{i:03d}/" for i in range(200)]
    for lb in (listed, added):
        for path in paths:
            httpx.get(lb.url + path)  # 404s: only where HAProxy sends each one counts

    def routed(lb: HAProxy) -> dict[str, str]:
        return {path: server for server, path in re.findall(ROUTED, lb.log.read_text())}

    # HAProxy writes a request's log line after its answer: wait for the last ones.
    for lb in (listed, added):
        until(lambda lb=lb: len(routed(lb)) == len(paths), what="every request in the log")
    routes = [routed(lb) for lb in (listed, added)]
    assert set(routes[0].values()) == {"a", "b", "c"}
    assert routes[1] == routes[0]
