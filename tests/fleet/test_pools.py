"""Pools: a space's manifest names the pool it runs in (`pool = "gpu"`); in a fleet a host
imports only its own pool's spaces, redirects another pool's requests to a live host of
it (307), or records the demand and answers 503 with Retry-After. A single host serves
every space. Real PostgreSQL and real gunicorn hosts; waits have deadlines, never sleeps.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import httpx2 as httpx
import psycopg
import pytest
from starlette.testclient import TestClient

from polyserve import settings
from polyserve.app import create_app
from polyserve.errors import ClientError
from polyserve.fleet.connection import Unreachable
from polyserve.fleet.db import FleetDB
from polyserve.fleet.pools import DEMAND_EVERY_S, HOSTS_TTL_S, PoolRouter
from polyserve.state.store import Store
from tests.helpers import HostProcess, free_port, make_tar, until
from tests.postgres import PostgresServer

FAST = {"POLYSERVE_CHECKPOINT_INTERVAL": "0.3", "POLYSERVE_FLEET_POLL_S": "0.5"}
HANDLE = "def handle(request):\n    return 'ok'\n"


def gpu_tar(main: str = HANDLE, pool: str = "gpu") -> bytes:
    return make_tar({"polyserve.toml": f'pool = "{pool}"\n', "main.py": main})


def echo_space(marks: Path) -> str:
    """A space that appends `pid parent-pid host-id` to `marks` when it is imported (so a
    test can tell a host's worker, whose parent is the master, from a deploy's validation,
    and which host imported it), and answers which host ran the request and what it was
    sent."""
    return f"""\
import os
with open({str(marks)!r}, "a") as f:
    f.write(f"{{os.getpid()}} {{os.getppid()}} {{os.environ['POLYSERVE_HOST_ID']}}\\n")

async def handle(request):
    return {{
        "host": os.environ["POLYSERVE_HOST_ID"],
        "method": request.method,
        "path": request.url.path,
        "query": request.url.query,
        "body": (await request.body()).decode(),
    }}
"""


def importers(marks: Path) -> set[int]:
    """The parent pids of every process that imported the space (see echo_space)."""
    if not marks.exists():
        return set()
    return {int(line.split()[1]) for line in marks.read_text().splitlines()}


def importing_hosts(marks: Path) -> set[str]:
    """The hosts whose processes imported the space (see echo_space)."""
    return {line.split()[2] for line in marks.read_text().splitlines()}


# -- the manifest's field -----------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "data", max_spaces=4)


def stage(store: Store, content: bytes, filename: str = "space.tar"):
    return store.stage(io.BytesIO(content), filename, 1 << 20)


def refused(store: Store, manifest: str) -> ClientError:
    with pytest.raises(ClientError) as err:
        stage(store, make_tar({"polyserve.toml": manifest, "main.py": HANDLE}))
    assert list(store.staging_dir.iterdir()) == []  # nothing left behind
    return err.value


@pytest.mark.parametrize("pool", ["gpu", "cpu", "a", "0", "gpu-a100", "x" * 32, "9-"])
def test_the_manifest_names_the_pool(store, pool):
    assert stage(store, gpu_tar(pool=pool)).pool == pool


def test_a_manifest_may_name_the_pool_and_the_entry(store):
    files = {"polyserve.toml": 'entry = "server.py"\npool = "gpu"\n', "server.py": HANDLE}
    staged = stage(store, make_tar(files))
    assert (staged.entry, staged.pool) == ("server.py", "gpu")


def test_a_manifest_with_only_the_pool_keeps_the_default_entry(store):
    staged = stage(store, gpu_tar())
    assert (staged.entry, staged.pool) == ("main.py", "gpu")


def test_without_the_field_or_a_manifest_the_pool_is_cpu(store):
    files = {"polyserve.toml": 'entry = "main.py"\n', "main.py": HANDLE}
    assert stage(store, make_tar(files)).pool == "cpu"
    assert stage(store, make_tar({"main.py": HANDLE})).pool == "cpu"
    assert stage(store, HANDLE.encode(), "hello.py").pool == "cpu"  # a .py has no manifest


@pytest.mark.parametrize(
    "name", ["GPU", "Gpu", "-gpu", "", "x" * 33, "gpu pool", "gpu_1", "gpü", "gpu/a", "gpu\n"]
)
def test_an_invalid_pool_name_is_a_422_naming_the_field_and_the_rule(store, name):
    err = refused(store, f"pool = {json.dumps(name)}\n")  # a JSON string is a TOML one
    assert err.status == 422
    assert err.error.startswith("polyserve.toml: pool must be a pool name, 1-32 of lowercase")
    assert err.details == {"field": "pool", "pool": name}


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("1", "an integer"),
        ("true", "a boolean"),
        ("1.5", "a float"),
        ('["gpu"]', "an array"),
        ('{ name = "gpu" }', "a table"),
        ("1979-05-27", "a date or time"),
    ],
)
def test_a_pool_that_is_not_a_string_is_a_422_naming_its_type(store, value, kind):
    err = refused(store, f"pool = {value}\n")
    assert err.status == 422
    assert err.error == f'polyserve.toml: pool must be a string such as pool = "gpu", not {kind}'
    assert err.details["field"] == "pool"


# -- the deploy answer and the listing (in-process: one host, no fleet) --------------------


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    s = settings.load({"POLYSERVE_DATA_DIR": str(tmp_path / "data")})
    with TestClient(create_app(s), client=("127.0.0.1", 50000)) as c:
        yield c


def deploy_in(client: TestClient, space: str, content: bytes, filename: str):
    return client.post(
        "/_polyserve/deploy", data={"space": space}, files={"module": (filename, content)}
    )


def test_the_deploy_answer_and_the_listing_show_the_pool(client):
    r = deploy_in(client, "o/big", gpu_tar(), "big.tar")
    assert r.status_code == 200, r.text
    assert r.json()["pool"] == "gpu"
    r = deploy_in(client, "o/small", HANDLE.encode(), "small.py")
    assert r.status_code == 200, r.text
    assert r.json()["pool"] == "cpu"
    spaces = client.get("/_polyserve/spaces").json()["spaces"]
    assert {name: meta["pool"] for name, meta in spaces.items()} == {
        "o/big": "gpu",
        "o/small": "cpu",
    }
    spec = client.get("/_polyserve/openapi.json").json()
    assert "pool" in spec["components"]["schemas"]["Deployed"]["required"]


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        ('pool = "GPU"\n', "pool must be a pool name"),
        ("pool = 7\n", "pool must be a string"),
    ],
)
def test_a_bad_pool_is_a_422_json_error_and_the_previous_version_keeps_serving(
    client, manifest, expected
):
    assert deploy_in(client, "o/keep", HANDLE.encode(), "keep.py").status_code == 200
    bad = make_tar({"polyserve.toml": manifest, "main.py": "def handle(r):\n    return 'v2'\n"})
    r = deploy_in(client, "o/keep", bad, "keep.tar")
    assert r.status_code == 422, r.text
    body = r.json()
    assert expected in body["error"] and body["field"] == "pool", body
    assert client.get("/s/o/keep/").text == "ok"
    current = client.get("/_polyserve/spaces").json()["spaces"]["o/keep"]
    assert (current["version"], current["pool"]) == (1, "cpu")


def test_a_host_without_a_fleet_serves_a_gpu_space_in_process(client):
    """The single-host rule, in-process: no database, so no pools."""
    assert deploy_in(client, "o/g", gpu_tar(), "g.tar").status_code == 200
    assert client.get("/s/o/g/").text == "ok"


# -- settings --------------------------------------------------------------------------


def test_the_host_pool_setting_follows_the_same_rule():
    assert settings.load({}).pool == "cpu"
    assert settings.load({"POLYSERVE_POOL": "gpu-a100"}).pool == "gpu-a100"
    with pytest.raises(ValueError, match="POLYSERVE_POOL='GPU': must be a pool name"):
        settings.load({"POLYSERVE_POOL": "GPU"})


def test_retry_after_is_a_whole_positive_number_of_seconds():
    assert settings.load({}).pool_retry_after_s == 30
    assert settings.load({"POLYSERVE_POOL_RETRY_AFTER_S": "5"}).pool_retry_after_s == 5
    for bad in ("0", "1.5"):
        with pytest.raises(ValueError, match="POLYSERVE_POOL_RETRY_AFTER_S"):
            settings.load({"POLYSERVE_POOL_RETRY_AFTER_S": bad})


# -- the router over a real PostgreSQL (no host) ------------------------------------------


class Clock:
    """A clock the test moves: the router's caches expire only when it says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def router(fleet_db: str) -> Iterator[tuple[PoolRouter, FleetDB, Clock]]:
    db, clock = FleetDB(fleet_db), Clock()
    try:
        yield PoolRouter(db, 10.0, 30, None, clock=clock), db, clock
    finally:
        db.close()


def test_the_router_finds_a_live_host_and_reads_the_hosts_once_per_interval(router):
    pools, db, clock = router
    db.join("g1", "http://10.9.0.1:8441", "gpu", "boot-1")
    db.join("c1", "http://10.9.0.2:8441", "cpu", "boot-1")
    assert anyio.run(pools.host_of, "gpu") is None  # joined, not caught up: not live yet
    for host in ("g1", "c1"):  # what a follower does once it has caught up
        db.heartbeat(host, "boot-1", 1, 0)
    clock.now += HOSTS_TTL_S
    assert anyio.run(pools.host_of, "gpu") == "http://10.9.0.1:8441"
    assert anyio.run(pools.host_of, "tpu") is None
    db.leave("g1", "boot-1")
    # Within the interval the router answers from what it read: one lookup per burst.
    assert anyio.run(pools.host_of, "gpu") == "http://10.9.0.1:8441"
    clock.now += HOSTS_TTL_S
    assert anyio.run(pools.host_of, "gpu") is None  # it left: not live
    db.join("g2", "http://10.9.0.3:8441", "gpu", "boot-1")
    db.drain("g2")
    clock.now += HOSTS_TTL_S
    assert anyio.run(pools.host_of, "gpu") is None  # draining: not live either


def test_the_router_records_demand_at_most_once_per_interval(router, fleet_db):
    pools, db, clock = router
    for _ in range(5):
        anyio.run(pools.demand, "gpu", "u/big")
    anyio.run(pools.demand, "gpu", "u/other")
    clock.now += DEMAND_EVERY_S
    anyio.run(pools.demand, "gpu", "u/big")
    with psycopg.connect(fleet_db) as conn:
        rows = conn.execute("SELECT space, requests FROM polyserve_demand ORDER BY space")
        assert rows.fetchall() == [("u/big", 2), ("u/other", 1)]
    assert db.demand(60) == {"gpu": ["u/big", "u/other"]}


def test_the_router_says_when_the_database_is_unreachable():
    # A port nobody listens on: connections are refused at once.
    db = FleetDB(f"postgresql://polyserve@127.0.0.1:{free_port()}/polyserve")
    pools = PoolRouter(db, 10.0, 30, None)
    for _ in range(2):  # the second answer comes from the remembered failure
        with pytest.raises(Unreachable, match="fleet store"):
            anyio.run(pools.host_of, "gpu")


# -- real hosts: a cpu host, a gpu host, one PostgreSQL -------------------------------------

CLIENT: httpx.Client


@pytest.fixture(scope="module", autouse=True)
def _client() -> Iterator[httpx.Client]:
    global CLIENT
    with httpx.Client(headers={"Connection": "close"}, timeout=60) as CLIENT:
        yield CLIENT


def deploy(host: HostProcess, space: str, content: bytes, filename: str) -> httpx.Response:
    files = {"module": (filename, content)}
    return CLIENT.post(host.url + "/_polyserve/deploy", data={"space": space}, files=files)


def live(host: HostProcess) -> set[str]:
    r = CLIENT.get(host.url + "/_polyserve/fleet")
    assert r.status_code == 200, r.text
    return {h["id"] for h in r.json()["hosts"] if h["live"]}


def start_host(
    host_factory: Callable[..., HostProcess], url: str, name: str, pool: str, **env: str
) -> HostProcess:
    return host_factory(
        name,
        workers=1,
        POLYSERVE_DATABASE_URL=url,
        POLYSERVE_HOST_ID=name,
        POLYSERVE_POOL=pool,
        **FAST,
        **env,
    )


def usage_of(host: HostProcess, space: str) -> dict:
    return CLIENT.get(host.url + "/_polyserve/usage").json()["spaces"][space]


def loaded(host: HostProcess) -> dict:
    """The spaces the host's one worker holds."""
    return CLIENT.get(host.url + "/_polyserve/health").json()["loaded"]


UNTOUCHED = {"requests": 0, "errors": 0, "cold_starts": 0, "loaded": False}


def untouched(host: HostProcess, space: str) -> dict:
    """What the host counted of `space`. One it never served has no slot there
    (POLYSERVE_FLEET_FILES=served) and is absent from its usage: nothing counted."""
    u = CLIENT.get(host.url + "/_polyserve/usage").json()["spaces"].get(space)
    return dict(UNTOUCHED) if u is None else {key: u[key] for key in UNTOUCHED}


def test_another_pools_space_is_redirected_to_a_live_host_of_it_else_demanded(
    host_factory, fleet_db, tmp_path
):
    """A gpu space deployed through a cpu host: the cpu host answers its requests 307 to
    the gpu host (which answers them, method, body and query kept), never imports it,
    counts none of them, and keeps none of its files; once the gpu host has left, it
    answers 503 with Retry-After and the fleet lists the space as demand for gpu."""
    c = start_host(host_factory, fleet_db, "c", "cpu", POLYSERVE_POOL_RETRY_AFTER_S="7")
    g = start_host(host_factory, fleet_db, "g", "gpu")
    until(lambda: live(c) == {"c", "g"}, what="both hosts to be live")
    marks = tmp_path / "imports.txt"
    r = deploy(c, "u/big", gpu_tar(echo_space(marks)), "big.tar")
    assert r.status_code == 200, r.text
    assert r.json()["pool"] == "gpu" and r.json()["hosts"] == {"applied": 2, "live": 2}
    # Validated by the receiving host (in a sandbox of its own: its parent is not known).
    assert importing_hosts(marks) == {"c"}
    assert deploy(c, "u/small", HANDLE.encode(), "small.py").status_code == 200

    r = CLIENT.get(c.url + "/s/u/big/a/b?q=1&r=%20")
    assert r.status_code == 307, r.text
    assert r.headers["location"] == g.url + "/s/u/big/a/b?q=1&r=%20"
    assert r.json() == {
        "space": "u/big",
        "pool": "gpu",
        "location": g.url + "/s/u/big/a/b?q=1&r=%20",
        "message": "space u/big runs in pool gpu and this host in pool cpu: follow Location"
        " to a host of pool gpu",
    }
    r = CLIENT.get(c.url + "/s/u/big/a/b?q=1", follow_redirects=True)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "host": "g",
        "method": "GET",
        "path": "/s/u/big/a/b",
        "query": "q=1",
        "body": "",
    }
    r = CLIENT.post(c.url + "/s/u/big/", content=b"payload", follow_redirects=True)
    assert (r.json()["host"], r.json()["method"], r.json()["body"]) == ("g", "POST", "payload")
    # Pools work both ways: the gpu host sends the cpu space's requests to the cpu host.
    r = CLIENT.get(g.url + "/s/u/small/")
    assert (r.status_code, r.headers["location"]) == (307, c.url + "/s/u/small/")
    assert CLIENT.get(g.url + "/s/u/small/", follow_redirects=True).text == "ok"

    assert untouched(c, "u/big") == UNTOUCHED
    assert "u/big" not in loaded(c)
    assert "u/big" not in (c.data_dir / "slots.log").read_text()  # redirected, no slot taken
    assert c.proc.pid not in importers(marks)  # no worker of the cpu host imported it
    assert g.proc.pid in importers(marks)
    assert usage_of(g, "u/big")["requests"] == 2
    assert untouched(g, "u/small") == UNTOUCHED
    # The cpu host's follower pointed at the version without fetching its files.
    spaces = c.data_dir / "spaces" / "u" / "big" / "versions"
    assert (spaces / "1.json").is_file() and not (spaces / "1").exists()

    g.stop()  # a graceful stop leaves the fleet
    assert live(c) == {"c"}

    def answered_503() -> httpx.Response | None:
        r = CLIENT.get(c.url + "/s/u/big/")
        return r if r.status_code == 503 else None

    # The worker may answer from the hosts it read within the last second: a 307 first.
    r = until(answered_503, what="the cpu host to answer 503 for the gpu space")
    assert r.headers["retry-after"] == "7"
    assert r.json() == {
        "error": "space u/big needs pool gpu, which has no live host: one is being started;"
        " retry in 7 s",
        "space": "u/big",
        "pool": "gpu",
    }
    db = FleetDB(fleet_db)
    try:
        assert db.demand(60) == {"gpu": ["u/big"]}
    finally:
        db.close()
    assert untouched(c, "u/big") == UNTOUCHED
    assert c.proc.pid not in importers(marks)


def test_a_space_redeployed_into_another_pool_leaves_the_hosts_that_held_it(host_factory, fleet_db):
    """A cpu space loaded on the cpu host, redeployed with `pool = "gpu"`: once the deploy
    answers 200 the cpu host redirects it and has let its old version go."""
    c = start_host(host_factory, fleet_db, "c", "cpu")
    g = start_host(host_factory, fleet_db, "g", "gpu")
    until(lambda: live(c) == {"c", "g"}, what="both hosts to be live")
    assert deploy(c, "u/move", HANDLE.encode(), "move.py").status_code == 200
    assert CLIENT.get(c.url + "/s/u/move/").text == "ok"
    assert loaded(c) == {"u/move": 1}
    r = deploy(c, "u/move", gpu_tar("def handle(request):\n    return 'v2'\n"), "move.tar")
    assert r.status_code == 200, r.text
    r = CLIENT.get(c.url + "/s/u/move/")
    assert (r.status_code, r.headers["location"]) == (307, g.url + "/s/u/move/")
    assert CLIENT.get(c.url + "/s/u/move/", follow_redirects=True).text == "v2"
    assert loaded(c) == {}
    assert usage_of(c, "u/move")["requests"] == 1  # the one it answered on v1
    # And back: redeployed without the field, it is the cpu host's again.
    v3 = b"def handle(request):\n    return 'v3'\n"
    assert deploy(g, "u/move", v3, "move.py").status_code == 200
    assert CLIENT.get(c.url + "/s/u/move/").text == "v3"


def test_an_unreachable_fleet_store_answers_503_and_records_nothing(
    own_postgres: PostgresServer, host_factory
):
    """With the database stopped, a request for another pool's space is a 503 with the
    fleet store's message (no host can be looked up, no demand written); once it is back,
    the demand is recorded."""
    url = own_postgres.create_database()
    c = start_host(host_factory, url, "c", "cpu")
    until(lambda: live(c) == {"c"}, what="the host to be live")
    assert deploy(c, "u/big", gpu_tar(), "big.tar").status_code == 200
    own_postgres.stop()

    def unreachable() -> httpx.Response | None:
        r = CLIENT.get(c.url + "/s/u/big/")
        return r if "fleet store" in r.json()["error"] else None

    r = until(unreachable, what="the answer to name the unreachable fleet store")
    assert r.status_code == 503
    assert r.headers["retry-after"] == "30"
    assert r.json() == {**Unreachable().body(), "space": "u/big", "pool": "gpu"}
    assert untouched(c, "u/big") == UNTOUCHED

    own_postgres.start()
    until(
        lambda: "no live host" in CLIENT.get(c.url + "/s/u/big/").json()["error"],
        what="the no-host answer once the database is back",
    )
    db = FleetDB(url)
    try:
        assert db.demand(60) == {"gpu": ["u/big"]}
    finally:
        db.close()


def test_a_single_host_serves_a_gpu_space(host_factory):
    """Without POLYSERVE_DATABASE_URL there are no pools: a cpu host serves it."""
    host = host_factory("single", workers=1)
    r = host.deploy("u/big", gpu_tar(), "big.tar")
    assert r.status_code == 200, r.text
    assert r.json()["pool"] == "gpu"
    assert host.get("/s/u/big/").text == "ok"
    assert usage_of(host, "u/big")["requests"] == 1
