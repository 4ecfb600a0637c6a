"""Per-space dependencies in a fleet: real gunicorn hosts sharing a real PostgreSQL, each
installing from a find-links directory of its own (tests/wheels.py, no network).

A deploy with requirements resolves once, on the receiving host; every other host
installs the same pins before it applies the version, and one that cannot is named in
the answer and serves no older version than the fleet's.
"""

from __future__ import annotations

import asyncio
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx2 as httpx
import pytest

from polyserve.fleet.catchup import CatchUp
from polyserve.fleet.connection import Unreachable
from polyserve.settings import load
from polyserve.state.store import Store
from tests.fleet.test_fleet import FAST
from tests.helpers import HostProcess, make_tar, until
from tests.wheels import TESTPKG, make_testpkg, wheelhouse

pytestmark = pytest.mark.postgres

USES_TESTPKG = (
    "import polyserve_testpkg as t\n"
    "from polyserve_testpkg import sub\n"
    "def handle(request):\n"
    "    return {'version': t.__version__, 'metadata': t.metadata_version, 'sub': sub.WHO}\n"
)

CLIENT: httpx.Client


@pytest.fixture(scope="module", autouse=True)
def _client() -> Iterator[httpx.Client]:
    global CLIENT
    with httpx.Client(headers={"Connection": "close"}, timeout=60) as CLIENT:
        yield CLIENT


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    """Every test wheel, for the hosts that have them all."""
    return wheelhouse(tmp_path / "wheels")


def start(host_factory, url: str, name: str, find_links: Path, **env: str) -> HostProcess:
    """A 1-worker host `name` of the fleet at `url`, installing only from `find_links`."""
    deps = {"POLYSERVE_DEPS_OFFLINE": "1", "POLYSERVE_DEPS_FIND_LINKS": str(find_links)}
    fleet = {"POLYSERVE_DATABASE_URL": url, "POLYSERVE_HOST_ID": name, **FAST}
    return host_factory(name, workers=1, **fleet, **(deps | env))


def deploy(host: HostProcess, space: str, version: str) -> httpx.Response:
    """Deploy the space that imports polyserve-testpkg, pinned to `version`."""
    files = {"main.py": USES_TESTPKG, "requirements.txt": f"{TESTPKG}=={version}\n"}
    return CLIENT.post(
        host.url + "/_polyserve/deploy",
        data={"space": space},
        files={"module": ("space.tar", make_tar(files))},
    )


def serves(host: HostProcess, space: str) -> str | None:
    """The testpkg version `space` imports on `host` (None: not a 200)."""
    r = CLIENT.get(f"{host.url}/s/{space}/")
    if r.status_code != 200:
        return None
    body = r.json()
    # Its own modules and its metadata are the set's, on every host.
    assert body["metadata"] == body["version"] and body["sub"] == f"sub of {body['version']}"
    return body["version"]


def sets(host: HostProcess) -> set[str]:
    """The dependency sets installed in the host's own data directory."""
    return {p.parent.name for p in (host.data_dir / "deps" / "sets").glob("*/set.json")}


def fleet(host: HostProcess) -> dict:
    r = CLIENT.get(host.url + "/_polyserve/fleet")
    assert r.status_code == 200, r.text
    return r.json()


def wait_live(host: HostProcess, ids: set[str]) -> None:
    def live() -> set[str]:
        return {h["id"] for h in fleet(host)["hosts"] if h["live"]}

    until(lambda: live() == ids, what=f"the fleet to list {sorted(ids)} as live")


def test_a_deploy_with_dependencies_is_installed_and_served_on_every_host(
    host_factory, fleet_db, wheels
):
    """Resolved once by the host that took the deploy, installed by the others before
    the 200: every host answers with the set the version names, then with the next."""
    hosts = [start(host_factory, fleet_db, n, wheels) for n in "abc"]
    a, b, _ = hosts
    wait_live(a, {"a", "b", "c"})
    r = deploy(a, "d/app", "1.0")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["hosts"] == {"applied": 3, "live": 3}
    assert body["dependencies"]["packages"] == [f"{TESTPKG}==1.0"]
    first = body["dependencies"]["set"]
    assert [serves(h, "d/app") for h in hosts] == ["1.0"] * 3
    for host in hosts:  # each installed it itself, under the same name
        assert sets(host) == {first}

    r = deploy(b, "d/app", "2.0")  # through another host
    assert r.status_code == 200, r.text
    assert r.json()["hosts"] == {"applied": 3, "live": 3}
    second = r.json()["dependencies"]["set"]
    assert [serves(h, "d/app") for h in hosts] == ["2.0"] * 3
    for host in hosts:
        assert sets(host) == {first, second}

    # A rollback needs no install: each host has the first set already.
    r = CLIENT.post(a.url + "/_polyserve/spaces/d/app/rollback")
    assert r.status_code == 200, r.text
    assert [serves(h, "d/app") for h in hosts] == ["1.0"] * 3


def test_a_host_that_cannot_install_the_set_is_named_and_serves_no_older_version(
    host_factory, fleet_db, wheels, tmp_path
):
    """C's find-links has testpkg 1.0 only: the deploy pinned to 2.0 answers 202 naming
    C and why, A and B serve 2.0, and C serves neither version (never an older one than
    the fleet's) until a change it can install: the rollback to 1.0."""
    partial = tmp_path / "partial"
    partial.mkdir()
    make_testpkg(partial, "1.0")
    a = start(host_factory, fleet_db, "a", wheels)
    b = start(host_factory, fleet_db, "b", wheels)
    c = start(host_factory, fleet_db, "c", partial)
    hosts = (a, b, c)
    wait_live(a, {"a", "b", "c"})
    r = deploy(a, "d/app", "1.0")
    assert r.status_code == 200, r.text
    assert [serves(h, "d/app") for h in hosts] == ["1.0"] * 3

    r = deploy(a, "d/app", "2.0")
    assert r.status_code == 202, r.text
    answer = r.json()["hosts"]
    assert answer["applied"] == 2 and answer["live"] == 3 and "lagging" not in answer
    assert list(answer["skipped"]) == ["c"]
    reason = answer["skipped"]["c"]
    assert reason.startswith("installing the dependencies of v2 on this host failed")
    assert TESTPKG in reason  # uv's words name what it could not find
    assert [serves(h, "d/app") for h in hosts] == ["2.0", "2.0", None]
    skips = {h["id"]: h["skipped"] for h in fleet(b)["hosts"]}
    assert [(s["space"], s["version"]) for s in skips["c"]] == [("d/app", 2)]
    assert skips["a"] == skips["b"] == []

    # The rollback to 1.0 is a change C can install: it applies everywhere, and the
    # skip is past.
    r = CLIENT.post(b.url + "/_polyserve/spaces/d/app/rollback")
    assert r.status_code == 200, r.text
    assert r.json()["hosts"] == {"applied": 3, "live": 3}
    assert [serves(h, "d/app") for h in hosts] == ["1.0"] * 3
    assert all(h["skipped"] == [] for h in fleet(c)["hosts"])


def test_a_host_joining_far_behind_installs_the_sets_of_the_fleets_pointers(
    host_factory, fleet_db, wheels, tmp_path
):
    """A host that joins past more changes than it replays takes the fleet's pointers:
    it installs each current version's set before pointing at it, then serves it."""
    a = start(host_factory, fleet_db, "a", wheels)
    wait_live(a, {"a"})
    for i in range(25):  # more than catch-up replays one by one (EAGER_LIMIT)
        r = CLIENT.post(
            a.url + "/_polyserve/deploy",
            data={"space": f"p/s{i}"},
            files={"module": ("main.py", b"def handle(request):\n    return 'plain'\n")},
        )
        assert r.status_code == 200, r.text
    assert deploy(a, "d/app", "2.0").status_code == 200
    own = tmp_path / "own-wheels"
    shutil.copytree(wheels, own)
    d = start(host_factory, fleet_db, "d", own)
    wait_live(a, {"a", "d"})
    last = fleet(d)["last_change"]
    until(
        lambda: {h["id"]: h["applied"] for h in fleet(d)["hosts"]}["d"] == last,
        what="D to take the fleet's pointers",
    )
    assert serves(d, "d/app") == "2.0"
    assert sets(d) == sets(a)
    assert CLIENT.get(d.url + "/s/p/s0/").text == "plain"


def b_beats(a: HostProcess, n: int) -> None:
    """Until host b's heartbeat has moved on `n` times, as host a's fleet view says."""
    for _ in range(n):
        seen = {h["id"]: h["last_seen"] for h in fleet(a)["hosts"]}["b"]
        until(
            lambda: {h["id"]: h["last_seen"] for h in fleet(a)["hosts"]}["b"] > seen,  # noqa: B023
            what="B to heartbeat while it installs",
        )


class GatedIndex:
    """A PEP 503 package index of a wheel directory on 127.0.0.1 whose project pages are
    held until `gate` is set: an index as slow as a test wants. `asks` counts the
    project pages asked for."""

    def __init__(self, wheels: Path) -> None:
        self.gate = threading.Event()
        self.asks = 0
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if parts[0] == "simple" and len(parts) == 2:
                    index.asks += 1  # one thread per request; a test reads it only
                    index.gate.wait(60)  # bounded: a test that never opens it fails
                    norm = parts[1].replace("-", "_")
                    links = "".join(
                        f'<a href="/files/{w.name}">{w.name}</a>'
                        for w in sorted(wheels.glob(f"{norm}-*.whl"))
                    )
                    self._send(f"<html><body>{links}</body></html>".encode(), "text/html")
                elif parts[0] == "files" and len(parts) == 2:
                    self._send((wheels / parts[1]).read_bytes(), "application/octet-stream")
                else:
                    self.send_error(404)

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gated(wheels) -> Iterator[GatedIndex]:
    index = GatedIndex(wheels)
    try:
        yield index
    finally:
        index.close()


def test_a_follower_installing_a_set_stays_live_and_serves_the_previous_version(
    host_factory, fleet_db, wheels, gated, tmp_path
):
    """B installs from an index that holds its answer: meanwhile B heartbeats (live, its
    health 200), serves v1, and the deploy answers 202 naming B as lagging; a host that
    joins meanwhile is not live until its own install is done. Once the index answers,
    both serve v2."""
    a = start(host_factory, fleet_db, "a", wheels, POLYSERVE_DEPLOY_WAIT_S="1")
    index = {"POLYSERVE_DEPS_OFFLINE": "0", "POLYSERVE_DEPS_INDEX_URL": gated.url}
    none = tmp_path / "no-wheels"  # B and D install from the index only
    none.mkdir()
    b = start(host_factory, fleet_db, "b", none, **index)
    wait_live(a, {"a", "b"})
    plain = {"main.py": "def handle(request):\n    return {'version': 'plain', 'metadata':"
             " 'plain', 'sub': 'sub of plain'}\n"}  # fmt: skip
    r = CLIENT.post(
        a.url + "/_polyserve/deploy",
        data={"space": "d/app"},
        files={"module": ("space.tar", make_tar(plain))},
    )
    assert r.status_code == 200, r.text

    r = deploy(a, "d/app", "2.0")
    assert r.status_code == 202, r.text
    assert r.json()["hosts"] == {"applied": 1, "live": 2, "lagging": ["b"]}
    # B is installing, from the index (it may ask only now, on a busy machine: the 202
    # came at POLYSERVE_DEPLOY_WAIT_S, however far B had got).
    until(lambda: gated.asks == 1, what="B to ask the index")
    b_beats(a, 1)
    assert {h["id"] for h in fleet(a)["hosts"] if h["live"]} == {"a", "b"}
    assert CLIENT.get(b.url + "/_polyserve/health").status_code == 200
    assert serves(b, "d/app") == "plain"

    d = start(host_factory, fleet_db, "d", none, **index)  # joins, and installs too
    until(lambda: gated.asks == 2, what="D to ask the index")
    b_beats(a, 2)  # as many poll intervals as D would have heartbeaten in
    assert "d" not in {h["id"] for h in fleet(a)["hosts"] if h["live"]}

    gated.gate.set()
    wait_live(a, {"a", "b", "d"})
    last = fleet(a)["last_change"]
    until(
        lambda: all(h["applied"] == last for h in fleet(a)["hosts"]),
        what="every host to apply v2",
    )
    assert [serves(h, "d/app") for h in (a, b, d)] == ["2.0"] * 3


def test_a_host_restarted_into_a_versions_pool_installs_its_set_on_first_use(
    host_factory, fleet_db, wheels
):
    """A CPU host keeps only the pointer of a GPU-pool version (no bytes, no set); restarted
    into the GPU pool, its first request fetches the files and installs the set."""
    g = start(host_factory, fleet_db, "g", wheels, POLYSERVE_POOL="gpu")
    c = start(host_factory, fleet_db, "c", wheels)
    wait_live(g, {"g", "c"})
    manifest = f'pool = "gpu"\ndependencies = ["{TESTPKG}==2.0"]\n'
    files = {"main.py": USES_TESTPKG, "polyserve.toml": manifest}
    r = CLIENT.post(
        g.url + "/_polyserve/deploy",
        data={"space": "d/gpu"},
        files={"module": ("space.tar", make_tar(files))},
    )
    assert r.status_code == 200, r.text
    assert r.json()["hosts"] == {"applied": 2, "live": 2}
    assert sets(c) == set()  # another pool's version: only its pointer here

    c.extra_env["POLYSERVE_POOL"] = "gpu"
    c.stop()
    c.start()
    assert serves(c, "d/gpu") == "2.0"
    assert sets(c) == sets(g)


def test_the_follower_heartbeats_while_a_set_installs(tmp_path):
    """An install that lasts (here: until the third heartbeat) runs under heartbeats every
    poll interval, and a heartbeat the database refuses does not stop it."""
    settings = load({"POLYSERVE_DATA_DIR": str(tmp_path), "POLYSERVE_FLEET_POLL_S": "0.05"})
    beats: list[int] = []

    def beat() -> None:
        beats.append(len(beats))
        if len(beats) == 1:
            raise Unreachable()

    async def install() -> str:
        for _ in range(3000):  # a bound, so a loop that never beats fails, not hangs
            if len(beats) >= 3:
                return "installed"
            await asyncio.sleep(0.01)
        return "no heartbeat"

    store = SimpleNamespace(store=Store(tmp_path, 4, 2))
    catchup = CatchUp(settings, None, store, beat)  # type: ignore[arg-type]
    assert asyncio.run(catchup._beating(install())) == "installed"
    assert beats == [0, 1, 2]
