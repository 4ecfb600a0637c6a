"""Private spaces on a real host: keys minted, checked, limited, revoked on every worker,
kept as digests only, and counted per key in usage; refused requests counted nowhere."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import HostProcess, module_host, until

WORKERS = 3
host = module_host("host", workers=WORKERS)

PID = "import os\ndef handle(request):\n    return {'pid': os.getpid()}\n"


def deploy(host: HostProcess, space: str) -> None:
    answer = host.deploy(space, PID)
    assert answer.status_code == 200, answer.text


def mint(host: HostProcess, space: str, **body: object) -> dict[str, object]:
    answer = httpx.post(f"{host.url}/_polyserve/spaces/{space}/keys", json=body or None)
    assert answer.status_code == 200, answer.text
    return answer.json()


def make_private(host: HostProcess, space: str, private: bool = True) -> None:
    answer = httpx.put(f"{host.url}/_polyserve/spaces/{space}/access", json={"private": private})
    assert answer.status_code == 200, answer.text
    assert answer.json()["private"] is private


def bearer(key: object) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def call(host: HostProcess, space: str, key: object = None) -> httpx.Response:
    """The space's root on a fresh connection (so calls spread over the workers)."""
    headers = {"Connection": "close", **(bearer(key) if key is not None else {})}
    return httpx.get(f"{host.url}/s/{space}/", headers=headers, timeout=30)


def usage_of(host: HostProcess, space: str) -> dict[str, object]:
    return host.get("/_polyserve/usage").json()["spaces"].get(space, {})


@pytest.fixture
def pin(host: HostProcess) -> Iterator[Callable[[], dict[int, httpx.Client]]]:
    """One kept-alive connection per worker, by the pid that answers on it, made when
    the test asks: an idle connection outlives the server's keep-alive timeout only so
    long, and a slow setup before it would let it lapse."""
    made: list[httpx.Client] = []
    deploy(host, "probe/pids")

    def pinned() -> dict[int, httpx.Client]:
        clients: dict[int, httpx.Client] = {}

        def one_more() -> bool:
            client = httpx.Client(base_url=host.url, timeout=30)
            made.append(client)
            clients.setdefault(client.get("/s/probe/pids/").json()["pid"], client)
            return len(clients) == WORKERS

        until(one_more, what="a connection to every worker")
        return clients

    yield pinned
    for client in made:
        client.close()


def test_private_space_needs_a_key(host: HostProcess) -> None:
    """Without a key 401 saying what to send; with a minted key 200; a wrong key 401."""
    space = "alice/private"
    deploy(host, space)
    assert call(host, space).status_code == 200  # public until made private
    make_private(host, space)
    refused = call(host, space)
    assert refused.status_code == 401
    assert "Authorization: Bearer" in refused.json()["error"]
    assert refused.headers["www-authenticate"].startswith("Bearer")
    minted = mint(host, space)
    assert str(minted["key"]).startswith("ps_")
    assert call(host, space, minted["key"]).status_code == 200
    wrong = call(host, space, "ps_not-a-key")
    assert wrong.status_code == 401
    assert "not one of" in wrong.json()["error"]
    listed = host.get(f"/_polyserve/spaces/{space}/keys").json()
    assert listed["private"] is True
    assert [k["id"] for k in listed["keys"]] == [minted["id"]]
    assert "sha256" not in str(listed) and str(minted["key"]) not in str(listed)
    make_private(host, space, False)
    assert call(host, space).status_code == 200


def test_revoked_key_is_refused_on_every_worker(
    host: HostProcess, pin: Callable[[], dict[int, httpx.Client]]
) -> None:
    """After the revoke's 200, each worker (its own kept-alive connection) answers 401."""
    space = "alice/revoked"
    deploy(host, space)
    make_private(host, space)
    key = mint(host, space)
    pinned = pin()
    for pid, client in pinned.items():
        answer = client.get(f"/s/{space}/", headers=bearer(key["key"]))
        assert answer.status_code == 200 and answer.json()["pid"] == pid
    revoked = httpx.delete(f"{host.url}/_polyserve/spaces/{space}/keys/{key['id']}")
    assert revoked.status_code == 200, revoked.text
    for _ in range(3):
        for client in pinned.values():
            assert client.get(f"/s/{space}/", headers=bearer(key["key"])).status_code == 401
    missing = httpx.delete(f"{host.url}/_polyserve/spaces/{space}/keys/{key['id']}")
    assert missing.status_code == 404


def test_keys_are_not_stored_in_plaintext(host: HostProcess) -> None:
    """No file of the data directory (nor the host's log) holds a minted key."""
    space = "alice/hashed"
    deploy(host, space)
    make_private(host, space)
    key = str(mint(host, space)["key"])
    assert call(host, space, key).status_code == 200
    holding = [
        path
        for path in [*host.data_dir.rglob("*"), host.log]
        if path.is_file() and key.encode() in path.read_bytes()
    ]
    assert holding == []
    access = (host.data_dir / "access" / "alice" / "hashed.json").read_text()
    assert hashlib.sha256(key.encode()).hexdigest() in access


def test_rate_limited_key_gets_429(host: HostProcess) -> None:
    """A key of rate 0.01/s passes once, then 429 with Retry-After; another key passes."""
    space = "alice/limited"
    deploy(host, space)
    make_private(host, space)
    slow = mint(host, space, rate=0.01)
    fast = mint(host, space)
    with httpx.Client(base_url=host.url, timeout=30) as client:  # one worker's bucket
        assert client.get(f"/s/{space}/", headers=bearer(slow["key"])).status_code == 200
        limited = client.get(f"/s/{space}/", headers=bearer(slow["key"]))
        assert limited.status_code == 429
        assert int(limited.headers["retry-after"]) >= 1
        assert slow["id"] in limited.json()["error"]
        assert client.get(f"/s/{space}/", headers=bearer(fast["key"])).status_code == 200
    bad = httpx.post(f"{host.url}/_polyserve/spaces/{space}/keys", json={"rate": -1})
    assert bad.status_code == 422 and "rate" in bad.json()["error"]


def test_refusals_are_not_counted_and_load_nothing(host: HostProcess) -> None:
    """401s leave requests, errors and cold starts at 0 and the space unloaded."""
    space = "alice/unloaded"
    deploy(host, space)
    make_private(host, space)
    for _ in range(5):
        assert call(host, space).status_code == 401
        assert call(host, space, "ps_wrong").status_code == 401
    used = usage_of(host, space)
    assert (used["requests"], used["errors"], used["cold_starts"]) == (0, 0, 0)
    assert used["loaded"] is False


def test_usage_counts_requests_per_key(host: HostProcess) -> None:
    """Usage has each key's requests; a key taking a revoked key's cell starts at 0."""
    space = "alice/counted"
    deploy(host, space)
    make_private(host, space)
    a, b = mint(host, space), mint(host, space)
    for key, times in ((a, 3), (b, 2)):
        for _ in range(times):
            assert call(host, space, key["key"]).status_code == 200
    assert call(host, space).status_code == 401
    used = usage_of(host, space)
    assert used["keys"] == {a["id"]: 3, b["id"]: 2}
    assert used["requests"] == 5
    httpx.delete(f"{host.url}/_polyserve/spaces/{space}/keys/{a['id']}").raise_for_status()
    c = mint(host, space)
    assert call(host, space, c["key"]).status_code == 200
    assert usage_of(host, space)["keys"] == {b["id"]: 2, c["id"]: 1}
    # /metrics has the same counts, one series per key.
    assert metrics_keys(host, space) == {b["id"]: 2, c["id"]: 1}


def metrics_keys(host: HostProcess, space: str) -> dict[str, float]:
    """A space's requests per key on /metrics."""
    families = text_string_to_metric_families(host.get("/metrics").text)
    (family,) = [f for f in families if f.name == "polyserve_space_key_requests"]
    return {s.labels["key"]: s.value for s in family.samples if s.labels["space"] == space}


def test_access_writes_refuse_bad_input(host: HostProcess) -> None:
    """Not deployed: 404; a bad body: 422 saying what to send; past 8 keys: 409."""
    url = f"{host.url}/_polyserve/spaces"
    assert httpx.post(f"{url}/nobody/here/keys").status_code == 404
    assert httpx.put(f"{url}/nobody/here/access", json={"private": True}).status_code == 404
    space = "alice/full"
    deploy(host, space)
    bad = httpx.put(f"{url}/{space}/access", json={"private": "yes"})
    assert bad.status_code == 422 and "private" in bad.json()["error"]
    for _ in range(8):
        mint(host, space)
    full = httpx.post(f"{url}/{space}/keys")
    assert full.status_code == 409 and "revoke" in full.json()["error"]
    assert call(host, space).status_code == 200  # still public: serving as before


def test_delete_drops_access(host: HostProcess) -> None:
    """A space deleted and deployed again under its name is public, its keys gone."""
    space = "alice/again"
    deploy(host, space)
    make_private(host, space)
    mint(host, space)
    httpx.delete(f"{host.url}/_polyserve/spaces/{space}").raise_for_status()
    deploy(host, space)
    assert call(host, space).status_code == 200
    assert host.get(f"/_polyserve/spaces/{space}/keys").json()["keys"] == []


def test_key_counts_survive_a_restart(host_factory) -> None:
    """Per-key requests are checkpointed and restored with the other totals."""
    one = host_factory("restarted", workers=1, POLYSERVE_CHECKPOINT_INTERVAL="0.3")
    space = "alice/restarted"
    deploy(one, space)
    make_private(one, space)
    key = mint(one, space)
    for _ in range(4):
        assert call(one, space, key["key"]).status_code == 200
    one.stop()
    one.start()
    assert usage_of(one, space)["keys"] == {key["id"]: 4}
    assert call(one, space, key["key"]).status_code == 200
    assert usage_of(one, space)["keys"] == {key["id"]: 5}


def test_the_keys_command(host: HostProcess) -> None:
    """`polyserve keys`: --private, --add --rate (the key printed once), list, --revoke."""
    from tests.cli.test_cli import ok, polyserve

    space = "alice/cli"
    deploy(host, space)
    assert "private" in ok(polyserve("keys", space, "--private", url=host.url))
    added = ok(polyserve("keys", space, "--add", "--rate", "5", url=host.url))
    key = added.split("key: ", 1)[1].split()[0]
    key_id = added.split("minted key ", 1)[1].split()[0]
    assert call(host, space, key).status_code == 200
    listed = ok(polyserve("keys", space, url=host.url))
    assert key_id in listed and "5/s" in listed and key not in listed
    ok(polyserve("keys", space, "--revoke", key_id, url=host.url))
    assert call(host, space, key).status_code == 401
    missing = polyserve("keys", space, "--revoke", key_id, url=host.url)
    assert missing.returncode == 1 and "no key" in missing.stderr
    assert polyserve("keys", space, "--rate", "1", url=host.url).returncode == 2


def test_inference_protocol_routes_take_the_key(host: HostProcess) -> None:
    """/v2/models/{owner}/{name}/… of a private space: 401 without its key, then on."""
    space = "alice/protocol"
    deploy(host, space)
    make_private(host, space)
    key = mint(host, space)["key"]
    for path, method in ((f"/v2/models/{space}", "GET"), (f"/v2/models/{space}/infer", "POST")):
        url = host.url + path
        refused = httpx.request(method, url, json={"inputs": []})
        assert refused.status_code == 401, refused.text
        assert "Bearer" in refused.json()["error"]
        # With the key the request goes on: this space is not a model, which says so.
        passed = httpx.request(method, url, json={"inputs": []}, headers=bearer(key))
        assert passed.status_code == 404 and "not a model space" in passed.text
