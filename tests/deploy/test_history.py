"""Version history and rollback: the request body, the routes in process, and real hosts
(one, and a fleet of two on a real PostgreSQL) keeping the deploy's broadcast contract."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from starlette.testclient import TestClient

from polyserve import settings
from polyserve.app import create_app
from polyserve.control.auth import add_token
from polyserve.deploy.deploys import rollback_request
from polyserve.errors import ClientError
from tests.helpers import HostProcess, make_tar, until

# A module-level token changes at each import: an answer says which import served it.
VERSIONED = (
    "import os\nTOKEN = os.urandom(8).hex()\n"
    "def handle(request):\n    return {{'v': {v}, 'token': TOKEN}}\n"
)


def source(v: int) -> str:
    return VERSIONED.format(v=v)


# -- the request body ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "asked"),
    [
        (b"", None),
        (b"  \n", None),
        (b"{}", None),
        (b'{"version": null}', None),
        (b'{"version": 3}', 3),
    ],
)
def test_a_rollback_body_names_a_version_or_nothing(body, asked):
    assert rollback_request(body) == asked


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{bad", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[3]", "JSON object"),
        (b"3", "JSON object"),
        (b'{"version": "3"}', "whole number"),
        (b'{"version": 2.5}', "whole number"),
        (b'{"version": true}', "whole number"),
        (b'{"version": 0}', "whole number"),
        (b'{"version": -1}', "whole number"),
        (b'{"version": 3, "force": true}', "unknown field 'force'"),
    ],
)
def test_a_bad_rollback_body_is_a_422_that_says_what_to_send(body, says):
    with pytest.raises(ClientError) as err:
        rollback_request(body)
    assert err.value.status == 422 and says in err.value.error
    assert '{"version": N}' in err.value.error or "whole number" in err.value.error


# -- the routes, in process -----------------------------------------------------------------


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    s = settings.load(
        {"POLYSERVE_DATA_DIR": str(tmp_path / "data"), "POLYSERVE_KEEP_VERSIONS": "2"}
    )
    with TestClient(create_app(s), client=("127.0.0.1", 50000)) as c:
        yield c


def deploy_to(client: TestClient, space: str, v: int) -> None:
    files = {"module": ("main.py", source(v).encode())}
    r = client.post("/_polyserve/deploy", data={"space": space}, files=files)
    assert r.status_code == 200, r.text


def test_versions_lists_kept_versions_and_the_history(client):
    for v in (1, 2, 3):
        deploy_to(client, "o/s", v)
    answer = client.get("/_polyserve/spaces/o/s/versions").json()
    assert answer["space"] == "o/s" and answer["current"] == 3
    assert answer["store"] == "host" and answer["keep_versions"] == 2
    assert [(v["version"], v["current"], v["replaced"]) for v in answer["versions"]] == [
        (2, False, 1),
        (3, True, 2),
    ]
    for v in answer["versions"]:
        assert len(v["sha256"]) == 64 and v["size"] > 0 and v["entry"] == "main.py"
        assert v["kind"] == "handle" and v["import_ms"] >= 0 and v["deployed_at"] > 0
    events = [(e["event"], e["version"], e["previous"]) for e in answer["history"]]
    assert events == [("deploy", 1, None), ("deploy", 2, 1), ("deploy", 3, 2)]


def test_rollback_answers_the_version_it_made_current(client):
    for v in (1, 2):
        deploy_to(client, "o/s", v)
    r = client.post("/_polyserve/spaces/o/s/rollback")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["space"], body["version"], body["previous"]) == ("o/s", 1, 2)
    assert body["entry"] == "main.py" and len(body["sha256"]) == 64
    assert client.get("/s/o/s/").json()["v"] == 1
    history = client.get("/_polyserve/spaces/o/s/versions").json()["history"]
    assert (history[-1]["event"], history[-1]["version"], history[-1]["previous"]) == (
        "rollback",
        1,
        2,
    )


@pytest.mark.parametrize(
    ("content", "says"),
    [(b"{bad", "not JSON"), (b'{"version": "1"}', "whole number"), (b'{"v": 1}', "unknown field")],
)
def test_a_bad_body_is_a_422_and_changes_nothing(client, content, says):
    for v in (1, 2):
        deploy_to(client, "o/s", v)
    r = client.post("/_polyserve/spaces/o/s/rollback", content=content)
    assert r.status_code == 422 and says in r.json()["error"], r.text
    assert client.get("/s/o/s/").json()["v"] == 2
    assert client.get("/_polyserve/spaces/o/s/versions").json()["history"][-1]["event"] == "deploy"


def test_unknown_spaces_and_versions_are_404s(client):
    r = client.get("/_polyserve/spaces/o/never/versions")
    assert r.status_code == 404 and "never deployed" in r.json()["error"]
    r = client.post("/_polyserve/spaces/o/never/rollback")
    assert r.status_code == 404 and "not deployed" in r.json()["error"]
    deploy_to(client, "o/s", 1)
    r = client.post("/_polyserve/spaces/o/s/rollback")  # v1 replaced nothing
    assert r.status_code == 404 and r.json()["kept"] == [1], r.text
    r = client.get("/_polyserve/spaces/o/.bad/versions")
    assert r.status_code == 422


def test_an_oversized_rollback_body_is_a_413(client):
    deploy_to(client, "o/s", 1)
    r = client.post("/_polyserve/spaces/o/s/rollback", content=b" " * (1 << 17))
    assert r.status_code == 413 and "version" in r.json()["error"]


# -- a real host ------------------------------------------------------------------------------


def answers(host: HostProcess, space: str, n: int) -> list[int]:
    """The version of `n` answers, each on a fresh connection (so they reach every worker)."""
    return [host.get(f"/s/{space}/").json()["v"] for _ in range(n)]


def rollback(host: HostProcess, space: str, body: dict | None = None, **kw) -> httpx.Response:
    url = f"{host.url}/_polyserve/spaces/{space}/rollback"
    return httpx.post(url, json=body, timeout=60, **kw)


def loaded_everywhere(host: HostProcess, space: str) -> None:
    """Until every worker holds the space: a rollback must then swap each of them."""

    def loaded() -> bool:
        host.get(f"/s/{space}/")
        return host.get("/_polyserve/usage").json()["spaces"][space]["workers_loaded"] == 2

    until(loaded, what=f"both workers to load {space}")


def test_after_a_rollback_answers_200_every_request_gets_that_version(host_factory):
    """Both workers serve v3; a rollback (without a number, then to v3 again, then to v1)
    answers 200 and from then on every request gets the version it made current."""
    host = host_factory()
    for v in (1, 2, 3):
        assert host.deploy("o/c", source(v)).status_code == 200
    loaded_everywhere(host, "o/c")
    r = rollback(host, "o/c")
    assert r.status_code == 200, r.text
    assert (r.json()["version"], r.json()["previous"]) == (2, 3)
    assert answers(host, "o/c", 100) == [2] * 100

    for target in (3, 1):
        loaded_everywhere(host, "o/c")
        r = rollback(host, "o/c", {"version": target})
        assert r.status_code == 200, r.text
        assert answers(host, "o/c", 100) == [target] * 100

    versions = host.get("/_polyserve/spaces/o/c/versions").json()
    assert versions["current"] == 1
    events = [(e["event"], e["version"]) for e in versions["history"]]
    assert events[3:] == [("rollback", 2), ("rollback", 3), ("rollback", 1)]


def lazy_space(value: str, marker: Path) -> bytes:
    """A space whose /slow waits for a marker file, then imports its helper: a request in
    flight reads its version's files while other versions are made current."""
    main = (
        "import os, time\n"
        "def handle(request):\n"
        "    if request.url.path.endswith('/slow'):\n"
        f"        while not os.path.exists({str(marker)!r}):\n"
        "            time.sleep(0.01)\n"
        "    import helpers\n"
        "    return {'v': helpers.VALUE}\n"
    )
    return make_tar({"main.py": main, "helpers.py": f"VALUE = {value!r}\n"})


@contextlib.contextmanager
def slow_call(host: HostProcess, space: str, marker: Path) -> Iterator[list[httpx.Response]]:
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


def on_disk(host: HostProcess, space: str) -> list[int]:
    versions = host.data_dir / "spaces" / space / "versions"
    return sorted(int(p.name) for p in versions.iterdir() if p.is_dir())


def test_keep_versions_prunes_by_recency_but_never_a_version_in_use(host_factory, tmp_path):
    """POLYSERVE_KEEP_VERSIONS=2: after v1, v2, a rollback to v1 and v3, the kept ones are
    v3 and v1 (the most recently current), while v2 stays on disk as long as a request
    on it is in flight; then it is pruned, and a rollback to it is a 404 listing v1, v3."""
    host = host_factory(workers=1, POLYSERVE_KEEP_VERSIONS="2")
    marker = tmp_path / "go"
    for v in (1, 2):
        assert host.deploy("o/k", lazy_space(str(v), marker), "s.tar").status_code == 200
    with slow_call(host, "o/k", marker) as slow:
        assert rollback(host, "o/k", {"version": 1}).status_code == 200
        assert host.deploy("o/k", lazy_space("3", marker), "s.tar").status_code == 200
        assert answers(host, "o/k", 3) == ["3"] * 3
        assert on_disk(host, "o/k") == [1, 2, 3]  # v2: held by the request in flight
    assert slow[0].status_code == 200 and slow[0].json() == {"v": "2"}
    until(lambda: on_disk(host, "o/k") == [1, 3], 20, "v2 to be pruned once let go")
    r = rollback(host, "o/k", {"version": 2})
    assert r.status_code == 404, r.text
    assert r.json()["kept"] == [1, 3] and "not kept" in r.json()["error"]
    kept = host.get("/_polyserve/spaces/o/k/versions").json()["versions"]
    assert [v["version"] for v in kept] == [1, 3]
    assert answers(host, "o/k", 3) == ["3"] * 3  # the refusal changed nothing


ADMIN = "admin-token-for-the-history-tests"


def test_a_rollback_needs_the_spaces_owner_or_the_admin(host_factory, tmp_path):
    """Versions are a read (open to all); a rollback is a write: no token is a 401, another
    owner's token a 403, the owner's or the admin's token a 200."""
    tokens = tmp_path / "tokens.txt"
    alice, bob = add_token(tokens, "alice"), add_token(tokens, "bob")
    host = host_factory(POLYSERVE_TOKENS_FILE=str(tokens), POLYSERVE_DEPLOY_TOKEN=ADMIN)
    auth = {"Authorization": f"Bearer {alice}"}
    for v in (1, 2):
        assert host.deploy("alice/m", source(v), headers=auth).status_code == 200
    assert host.get("/_polyserve/spaces/alice/m/versions").status_code == 200
    assert rollback(host, "alice/m").status_code == 401
    r = rollback(host, "alice/m", headers={"Authorization": f"Bearer {bob}"})
    assert r.status_code == 403 and "bob/*" in r.json()["error"]
    assert answers(host, "alice/m", 4) == [2] * 4
    assert rollback(host, "alice/m", headers=auth).status_code == 200
    assert answers(host, "alice/m", 4) == [1] * 4
    r = rollback(host, "alice/m", {"version": 2}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200
    assert answers(host, "alice/m", 4) == [2] * 4


# -- a fleet -------------------------------------------------------------------------------------


FAST = {"POLYSERVE_CHECKPOINT_INTERVAL": "0.3", "POLYSERVE_FLEET_POLL_S": "0.5"}


@pytest.mark.postgres
def test_a_fleet_rollback_reaches_every_host_before_its_200(host_factory, fleet_db):
    """Two hosts, B keeping one version on disk: a rollback through either answers 200
    once both serve it — current moves backwards on each host, and B fetches the bytes
    of a version it had pruned. The fleet keeps every version for rollbacks."""
    a = host_factory("a", workers=1, POLYSERVE_DATABASE_URL=fleet_db, POLYSERVE_HOST_ID="a", **FAST)
    b = host_factory(
        "b",
        workers=1,
        POLYSERVE_DATABASE_URL=fleet_db,
        POLYSERVE_HOST_ID="b",
        POLYSERVE_KEEP_VERSIONS="1",
        **FAST,
    )
    until(
        lambda: (
            {h["id"] for h in a.get("/_polyserve/fleet").json()["hosts"] if h["live"]} == {"a", "b"}
        ),
        what="both hosts to be live",
    )
    both = {"applied": 2, "live": 2}
    for v in (1, 2, 3):
        r = a.deploy("u/h", source(v))
        assert r.status_code == 200 and r.json()["hosts"] == both, r.text
    assert answers(a, "u/h", 2) == answers(b, "u/h", 2) == [3, 3]
    until(lambda: on_disk(b, "u/h") == [3], 20, "B to prune all but v3")

    r = rollback(b, "u/h")
    assert r.status_code == 200, r.text
    assert (r.json()["version"], r.json()["previous"], r.json()["hosts"]) == (2, 3, both)
    assert [v for _ in range(50) for v in (*answers(a, "u/h", 1), *answers(b, "u/h", 1))] == [
        2
    ] * 100

    r = rollback(a, "u/h", {"version": 1})
    assert r.status_code == 200 and r.json()["hosts"] == both, r.text
    assert [v for _ in range(50) for v in (*answers(a, "u/h", 1), *answers(b, "u/h", 1))] == [
        1
    ] * 100

    versions = b.get("/_polyserve/spaces/u/h/versions").json()
    assert versions["store"] == "fleet" and versions["current"] == 1
    assert [(v["version"], v["current"]) for v in versions["versions"]] == [
        (1, True),
        (2, False),
        (3, False),
    ]
    events = [(e["event"], e["version"], e["previous"]) for e in versions["history"]]
    assert events == [
        ("deploy", 1, None),
        ("deploy", 2, 1),
        ("deploy", 3, 2),
        ("rollback", 2, 3),
        ("rollback", 1, 2),
    ]
    r = rollback(a, "u/h", {"version": 9})
    assert r.status_code == 404 and r.json()["kept"] == [1, 2, 3], r.text
    r = a.deploy("u/h", source(4))  # a deploy after rollbacks takes the next number
    assert r.status_code == 200 and r.json()["version"] == 4, r.text
    assert answers(a, "u/h", 2) == answers(b, "u/h", 2) == [4, 4]
