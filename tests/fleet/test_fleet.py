"""The fleet: real gunicorn hosts, each with its own data directory, sharing a real
PostgreSQL (tests/postgres.py). Deploys, deletes and releases through any host reach
every host; hosts that join, lose their connections or stop catch up; usage adds up.

Every host runs one worker (two cores) and polls the fleet every 0.5 s; tests wait with
deadlines (`until`), never a fixed sleep, and assert no timing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator

import httpx2 as httpx
import psycopg
import pytest

from tests.helpers import HostProcess, alive, until
from tests.postgres import INSTALL_HINT, Netns, PostgresServer, find_bindir, terminate_backends

pytestmark = pytest.mark.postgres

FAST = {"POLYSERVE_CHECKPOINT_INTERVAL": "0.3", "POLYSERVE_FLEET_POLL_S": "0.5"}

# A module-level token changes at each import: a release must re-import the space.
VERSIONED = (
    "import os\nTOKEN = os.urandom(8).hex()\n"
    "def handle(request):\n    return {{'v': {v}, 'token': TOKEN}}\n"
)


# One client for the module, each request on a fresh connection (`Connection: close`):
# building a client per request would cost more than the requests themselves.
CLIENT: httpx.Client


@pytest.fixture(scope="module", autouse=True)
def _client() -> Iterator[httpx.Client]:
    global CLIENT
    with httpx.Client(headers={"Connection": "close"}, timeout=60) as CLIENT:
        yield CLIENT


def get(host: HostProcess, path: str) -> httpx.Response:
    return CLIENT.get(host.url + path)


def deploy(host: HostProcess, space: str, content: str) -> httpx.Response:
    files = {"module": ("main.py", content.encode())}
    return CLIENT.post(host.url + "/_polyserve/deploy", data={"space": space}, files=files)


def source(v: int) -> str:
    return VERSIONED.format(v=v)


def start_fleet(
    host_factory: Callable[..., HostProcess], url: str, names: str, **env: str
) -> list[HostProcess]:
    """One 1-worker host per letter of `names` (its host id), all following `url`; returns
    once the fleet lists every one of them as live."""
    hosts = [
        host_factory(n, workers=1, POLYSERVE_DATABASE_URL=url, POLYSERVE_HOST_ID=n, **FAST, **env)
        for n in names
    ]
    wait_live(hosts[0], set(names))
    return hosts


def fleet(host: HostProcess) -> dict:
    r = get(host, "/_polyserve/fleet")
    assert r.status_code == 200, r.text
    return r.json()


def live(host: HostProcess) -> set[str]:
    return {h["id"] for h in fleet(host)["hosts"] if h["live"]}


def wait_live(host: HostProcess, ids: set[str]) -> None:
    until(lambda: live(host) == ids, what=f"the fleet to list {sorted(ids)} as live")


def version(host: HostProcess, space: str) -> int | None:
    """The version `space` answers on `host` (None: not 200)."""
    r = get(host, f"/s/{space}/")
    return r.json()["v"] if r.status_code == 200 else None


def deployed(host: HostProcess, space: str, v: int, hosts: dict | None = None) -> dict:
    """Deploy source(v) through `host`; the answer must be 200 (and its `hosts` part, if
    given, exactly that)."""
    r = deploy(host, space, source(v))
    assert r.status_code == 200, r.text
    body = r.json()
    if hosts is not None:
        assert body["hosts"] == hosts, body
    return body


def write(host: HostProcess, method: str, path: str) -> httpx.Response:
    return CLIENT.request(method, host.url + path)


def local_usage(host: HostProcess, space: str) -> dict:
    return get(host, "/_polyserve/usage").json()["spaces"][space]


def fleet_usage(host: HostProcess) -> dict:
    r = get(host, "/_polyserve/usage?scope=fleet")
    assert r.status_code == 200, r.text
    return r.json()


def fleet_requests(host: HostProcess, space: str) -> int:
    return fleet_usage(host)["spaces"].get(space, {}).get("requests", 0)


def host_requests(usage: dict, host_id: str) -> int:
    """The requests the ledger holds for one host. Each test here uses one space, so a
    host's section reads the same whether it is per space or the host's totals."""
    section = usage["hosts"].get(host_id, {})
    if "spaces" in section:
        return sum(space["requests"] for space in section["spaces"].values())
    return section.get("requests", 0)


def call(host: HostProcess, space: str, n: int) -> None:
    for _ in range(n):
        r = get(host, f"/s/{space}/")
        assert r.status_code == 200, r.text


# -- one database, many hosts ----------------------------------------------------------


def test_writes_through_any_host_reach_every_host_before_the_answer(host_factory, fleet_db):
    """A deploy, delete or release through any host is applied on every live host by the
    time it answers 200: no host answers with the old state afterwards."""
    a, b, c = start_fleet(host_factory, fleet_db, "abc")
    everyone = {"applied": 3, "live": 3}
    assert deployed(a, "u/v", 1, everyone)["version"] == 1
    assert deployed(a, "u/v", 2, everyone)["version"] == 2
    answers = [version((a, b, c)[i % 3], "u/v") for i in range(300)]
    assert answers == [2] * 300

    assert deployed(b, "u/v", 3, everyone)["version"] == 3
    answers = [version((a, b, c)[i % 3], "u/v") for i in range(300)]
    assert answers == [3] * 300

    r = write(c, "DELETE", "/_polyserve/spaces/u/v")
    assert r.status_code == 200, r.text
    assert r.json()["hosts"] == everyone
    for host in (a, b, c):
        assert get(host, "/s/u/v/").status_code == 404

    # A release through A: every host that has the space loaded imports it afresh.
    deployed(a, "u/r", 1, everyone)
    tokens = {h.port: get(h, "/s/u/r/").json()["token"] for h in (a, b, c)}
    loads = {h.port: local_usage(h, "u/r")["cold_starts"] for h in (a, b, c)}
    r = write(a, "POST", "/_polyserve/spaces/u/r/release")
    assert r.status_code == 200, r.text
    assert r.json()["hosts"] == everyone
    for host in (a, b, c):
        assert get(host, "/s/u/r/").json()["token"] != tokens[host.port]
        assert local_usage(host, "u/r")["cold_starts"] == loads[host.port] + 1


def test_a_joining_host_serves_every_space_at_its_current_version(host_factory, fleet_db):
    """A host that joins a fleet with 50 spaces (some at their second version) serves
    each at its current version, and the fleet lists it as live."""
    a, _, _ = start_fleet(host_factory, fleet_db, "abc")
    current = {}
    for i in range(50):
        deployed(a, f"u/s{i}", 1)
        current[f"u/s{i}"] = 1
    for i in range(0, 50, 5):
        deployed(a, f"u/s{i}", 2)
        current[f"u/s{i}"] = 2
    d = host_factory("d", workers=1, POLYSERVE_DATABASE_URL=fleet_db, POLYSERVE_HOST_ID="d", **FAST)
    wait_live(a, {"a", "b", "c", "d"})
    # The join is done once D has applied every change: then it answers like the others.
    last = fleet(d)["last_change"]
    until(
        lambda: {h["id"]: h["applied"] for h in fleet(d)["hosts"]}["d"] == last,
        what="D to apply the fleet's last change",
    )
    assert {space: version(d, space) for space in current} == current
    assert live(d) == {"a", "b", "c", "d"}


# -- catching up -------------------------------------------------------------------------


def test_a_follower_whose_connections_are_killed_catches_up(host_factory, fleet_db):
    """B's database connections are terminated again and again while 20 versions are
    deployed through A: B reconnects and converges to the last version."""
    # Only B's connections carry this application_name: they are the ones cut.
    b_url = fleet_db + "?application_name=fleet-b"
    a = host_factory("a", workers=1, POLYSERVE_DATABASE_URL=fleet_db, POLYSERVE_HOST_ID="a", **FAST)
    b = host_factory("b", workers=1, POLYSERVE_DATABASE_URL=b_url, POLYSERVE_HOST_ID="b", **FAST)
    wait_live(a, {"a", "b"})
    killed: list[int] = []
    for v in range(1, 21):
        cut = None
        if v % 4 == 0:  # kill while the deploy is under way
            cut = threading.Thread(
                target=lambda: killed.extend(terminate_backends(fleet_db, "fleet-b"))
            )
            cut.start()
        r = deploy(a, "u/c", source(v))
        if cut is not None:
            cut.join()
        # B may be reconnecting right then: it is either waited for or named as lagging.
        assert r.status_code in (200, 202), r.text
        assert r.json()["version"] == v
    assert killed, "no connection of B's was terminated"
    until(lambda: version(b, "u/c") == 20, what="B to answer the last version")
    until(
        lambda: all(h["applied"] == fleet(a)["last_change"] for h in fleet(a)["hosts"]),
        what="every host to acknowledge the last change",
    )
    assert version(a, "u/c") == 20


def test_a_host_stopped_gracefully_catches_up_when_it_starts_again(host_factory, fleet_db):
    """A host stopped gracefully leaves the fleet (deploys no longer wait for it: 200 with
    2 live hosts) and, started again after 100 deploys, answers the last version and
    acknowledges the last change."""
    a, _, c = start_fleet(host_factory, fleet_db, "abc")
    deployed(a, "u/g", 1, {"applied": 3, "live": 3})
    assert version(c, "u/g") == 1
    c.stop()
    assert live(a) == {"a", "b"}  # it left at its stop: nobody waits for it to time out
    for v in range(2, 102):
        deployed(a, "u/g", v, {"applied": 2, "live": 2})
    c.start()
    until(lambda: version(c, "u/g") == 101, what="C to answer the last version")

    def caught_up() -> bool:
        view = fleet(c)
        return {h["id"]: h["applied"] for h in view["hosts"]}["c"] == view["last_change"]

    until(caught_up, what="C's acknowledgement to reach the last change")
    assert live(a) == {"a", "b", "c"}


# -- the database goes away --------------------------------------------------------------


def test_hosts_keep_serving_and_counting_while_the_database_is_down(
    own_postgres: PostgresServer, host_factory
):
    """With the fleet's PostgreSQL stopped, hosts keep serving (and counting) what they
    serve, and a deploy answers 503 naming the fleet store; once it is back, a deploy
    reaches both hosts and the fleet's ledger has every request made."""
    url = own_postgres.create_database()
    a, b = start_fleet(host_factory, url, "ab")
    deployed(a, "u/p", 1, {"applied": 2, "live": 2})
    sent = {"a": 0, "b": 0}

    def send(host: HostProcess, host_id: str, n: int, v: int) -> None:
        for _ in range(n):
            assert version(host, "u/p") == v
            sent[host_id] += 1

    send(a, "a", 10, 1)
    send(b, "b", 10, 1)

    own_postgres.stop()
    send(a, "a", 25, 1)
    send(b, "b", 15, 1)
    r = deploy(a, "u/p", source(2))
    assert r.status_code == 503, r.text
    assert "fleet store" in r.json()["error"]
    send(a, "a", 5, 1)  # the failed deploy changed nothing
    send(b, "b", 5, 1)

    own_postgres.start()
    body = deployed(a, "u/p", 2, {"applied": 2, "live": 2})
    assert body["version"] == 2
    send(a, "a", 10, 2)
    send(b, "b", 10, 2)

    # Read through A, whose worker reconnected for the deploy (a worker that has not
    # used the database since the restart is the next test's subject).
    total = sent["a"] + sent["b"]
    until(lambda: fleet_requests(a, "u/p") == total, what=f"the fleet's ledger to reach {total}")
    usage = fleet_usage(a)
    assert usage["spaces"]["u/p"]["requests"] == total
    assert {h: host_requests(usage, h) for h in ("a", "b")} == sent


def test_a_write_after_the_database_restarts_answers_200(
    own_postgres: PostgresServer, host_factory
):
    """A worker whose connection died with a PostgreSQL restart reconnects for the next
    write: once the database is back, a deploy answers 200, not 503."""
    url = own_postgres.create_database()
    (a,) = start_fleet(host_factory, url, "a")
    deployed(a, "u/w", 1, {"applied": 1, "live": 1})  # the worker now holds a connection
    own_postgres.stop()
    own_postgres.start()
    with psycopg.connect(url, autocommit=True) as conn:
        restarted = conn.execute("SELECT now()").fetchone()[0]

        def heartbeat() -> bool:  # the database is back: the follower says so
            query = "SELECT last_seen > %s FROM polyserve_hosts WHERE id = 'a'"
            return conn.execute(query, (restarted,)).fetchone()[0]

        until(heartbeat, what="the follower to heartbeat after the restart")
    r = deploy(a, "u/w", source(2))
    assert r.status_code == 200, r.text


def test_a_host_serves_what_it_acknowledged_while_the_database_is_down(
    own_postgres: PostgresServer, host_factory
):
    """A deploy's 200 says every live host applied it: with POLYSERVE_FLEET_FILES=all each
    host then serves that version without the database, even one that never had a
    request for it (the fleet's first change included)."""
    url = own_postgres.create_database()
    a, b = start_fleet(host_factory, url, "ab", POLYSERVE_FLEET_FILES="all")
    deployed(a, "u/first", 1, {"applied": 2, "live": 2})
    own_postgres.stop()
    for host in (a, b):
        r = get(host, "/s/u/first/")
        assert r.status_code == 200, r.text
        assert r.json()["v"] == 1


def files_here(host: HostProcess, space: str) -> list[int]:
    """The versions of `space` whose files are unpacked in `host`'s data directory."""
    versions = host.data_dir / "spaces" / space / "versions"
    if not versions.is_dir():
        return []
    return sorted(int(p.name) for p in versions.iterdir() if p.is_dir())


def test_a_host_holds_the_files_of_what_it_serves_and_fetches_the_rest_on_first_request(
    own_postgres: PostgresServer, host_factory
):
    """POLYSERVE_FLEET_FILES=served: a deploy moves every host's pointer, but only a host
    that has served the space fetches its files; another fetches them on its first
    request, then follows the space's deploys with their files. With the database away,
    a space a host has files of keeps serving; another answers 503 with Retry-After."""
    url = own_postgres.create_database()
    a, b = start_fleet(host_factory, url, "ab")
    deployed(a, "u/lazy", 1, {"applied": 2, "live": 2})
    assert files_here(a, "u/lazy") == files_here(b, "u/lazy") == []
    assert version(b, "u/lazy") == 1  # its first request here fetches v1
    assert files_here(b, "u/lazy") == [1]
    deployed(a, "u/lazy", 2, {"applied": 2, "live": 2})
    assert 2 in files_here(b, "u/lazy")  # fetched as the deploy arrived: b serves the space
    assert [version(b, "u/lazy") for _ in range(5)] == [2] * 5
    assert files_here(a, "u/lazy") == []  # a received both deploys and never served them
    own_postgres.stop()
    assert [version(b, "u/lazy") for _ in range(5)] == [2] * 5
    r = get(a, "/s/u/lazy/")
    assert r.status_code == 503, r.text
    assert "not on this host" in r.json()["error"] and r.json()["space"] == "u/lazy"
    assert int(r.headers["retry-after"]) > 0


# -- usage -----------------------------------------------------------------------------


def test_the_fleet_ledger_sums_every_host_and_loses_at_most_a_killed_hosts_last_interval(
    host_factory, fleet_db
):
    """The fleet's usage is exactly the requests each host answered; a host killed with -9
    loses at most what it answered since its last usage write, and never overcounts."""
    a, b, c = start_fleet(host_factory, fleet_db, "abc")
    deployed(a, "u/m", 1, {"applied": 3, "live": 3})
    sent = {"a": 40, "b": 30, "c": 20}
    for host, n in zip((a, b, c), sent.values(), strict=True):
        call(host, "u/m", n)
    total = sum(sent.values())
    until(lambda: fleet_requests(b, "u/m") == total, what=f"the fleet's ledger to reach {total}")
    usage = fleet_usage(a)
    assert usage["spaces"]["u/m"]["requests"] == total
    assert {h: host_requests(usage, h) for h in sent} == sent

    # Everything so far is in the ledger: K more to C, then kill C's master and workers.
    k = 15
    workers, follower = c.worker_pids(), c.follower_pid()
    call(c, "u/m", k)
    c.proc.send_signal(signal.SIGKILL)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    c.proc.wait()
    seen = []

    def follower_gone() -> bool:
        seen.append(fleet_usage(a))
        return not alive(follower)

    until(follower_gone, what="C's follower to exit after its master")
    seen.append(fleet_usage(a))
    sent["c"] += k
    total += k
    for usage in seen:
        assert total - k <= usage["spaces"]["u/m"]["requests"] <= total
        assert sent["c"] - k <= host_requests(usage, "c") <= sent["c"]
        assert {h: host_requests(usage, h) for h in ("a", "b")} == {"a": 40, "b": 30}


def test_the_fleet_usage_says_which_spaces_are_loaded_on_the_live_hosts(host_factory, fleet_db):
    """`loaded` and `workers_loaded` count the workers of live hosts that hold the space
    now: a space called on one host of two is held once, on both twice, and a host that
    left holds nothing."""
    a, b = start_fleet(host_factory, fleet_db, "ab")
    deployed(a, "u/l", 1, {"applied": 2, "live": 2})

    def held() -> tuple[bool, int] | None:
        fields = fleet_usage(a)["spaces"].get("u/l")
        return None if fields is None else (fields["loaded"], fields["workers_loaded"])

    call(b, "u/l", 3)
    until(lambda: held() == (True, 1), what="the fleet usage to hold u/l on one worker")
    call(a, "u/l", 2)
    until(lambda: held() == (True, 2), what="the fleet usage to hold u/l on both hosts")
    assert fleet_usage(a)["spaces"]["u/l"]["requests"] == 5
    b.stop()  # it leaves the fleet: what its worker held is not counted
    until(lambda: held() == (True, 1), what="the fleet usage to drop the host that left")
    assert write(a, "POST", "/_polyserve/spaces/u/l/release").status_code == 200
    until(lambda: held() == (False, 0), what="the fleet usage to see the release")


# -- a real network partition ----------------------------------------------------------

# What a deploy through a partitioned host may take to answer 503 before this test calls
# it hung: the fleet's connect timeout is 5 s, validation well under a second.
PARTITIONED_ANSWER_S = 30


@pytest.fixture
def partitioned_postgres() -> Iterator[tuple[PostgresServer, Netns]]:
    """A server of the test's own inside a network namespace, reachable over a veth pair
    the test can cut (skipped where namespaces cannot be made: root and iproute2)."""
    bindir = find_bindir()
    if bindir is None:
        pytest.skip(INSTALL_HINT)
    try:
        netns = Netns()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot make a network namespace here (`ip netns add`, as root): {exc}")
    try:
        server = PostgresServer(bindir, host=netns.inner, netns=netns.name)
        try:
            yield server.start(), netns
        finally:
            server.destroy()
    finally:
        netns.remove()


def test_a_partitioned_host_keeps_serving_and_answers_503_for_writes(
    partitioned_postgres: tuple[PostgresServer, Netns], host_factory
):
    """With the link to PostgreSQL cut (packets vanish: nothing refuses or resets), hosts
    keep serving and a deploy answers 503; once the link is back, a deploy reaches every
    host."""
    server, netns = partitioned_postgres
    url = server.create_database()
    a, b = start_fleet(host_factory, url, "ab", POLYSERVE_FLEET_FILES="all")
    deployed(a, "u/n", 1, {"applied": 2, "live": 2})  # A's worker now holds a connection
    deployed(a, "u/n", 2, {"applied": 2, "live": 2})  # applied eagerly: files on both hosts
    netns.cut()
    try:
        for host in (a, b):
            assert [version(host, "u/n") for _ in range(10)] == [2] * 10
        files = {"module": ("main.py", source(3).encode())}
        r = CLIENT.post(
            a.url + "/_polyserve/deploy",
            data={"space": "u/n"},
            files=files,
            timeout=PARTITIONED_ANSWER_S,
        )
        assert r.status_code == 503, r.text
        assert "fleet store" in r.json()["error"]
        assert version(b, "u/n") == 2
    finally:
        netns.restore()
    r = deploy(a, "u/n", source(4))
    # A follower may still be waiting out TCP's retransmission backoff: lagging, then.
    assert r.status_code in (200, 202), r.text
    for host in (a, b):
        until(lambda h=host: version(h, "u/n") == 4, 180, "every host to serve the new version")
