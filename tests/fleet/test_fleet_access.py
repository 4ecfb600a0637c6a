"""Private spaces in a fleet: real gunicorn hosts sharing a real PostgreSQL. Access set
through one host is in force on every host when it answers; keys are kept as digests."""

from __future__ import annotations

from collections.abc import Callable

import httpx2 as httpx
import psycopg
import pytest

from tests.helpers import HostProcess, until

pytestmark = pytest.mark.postgres

FAST = {"POLYSERVE_CHECKPOINT_INTERVAL": "0.3", "POLYSERVE_FLEET_POLL_S": "0.5"}
PID = "import os\ndef handle(request):\n    return {'pid': os.getpid()}\n"


def start(host_factory: Callable[..., HostProcess], url: str) -> tuple[HostProcess, HostProcess]:
    a = host_factory("a", workers=1, POLYSERVE_DATABASE_URL=url, POLYSERVE_HOST_ID="a", **FAST)
    b = host_factory("b", workers=2, POLYSERVE_DATABASE_URL=url, POLYSERVE_HOST_ID="b", **FAST)

    def live() -> bool:
        hosts = httpx.get(f"{a.url}/_polyserve/fleet").json()["hosts"]
        return {h["id"] for h in hosts if h["live"]} == {"a", "b"}

    until(live, what="both hosts live")
    return a, b


def call(host: HostProcess, space: str, key: object = None) -> int:
    headers = {"Connection": "close"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.get(f"{host.url}/s/{space}/", headers=headers, timeout=30).status_code


def test_revoke_on_one_host_is_in_force_on_the_other(host_factory, fleet_db):
    """Private through A, a key minted through B: both hosts check it; revoked through
    A, B answers 401 right after the 200. Neither the database nor a data dir holds it."""
    a, b = start(host_factory, fleet_db)
    space = "u/private"
    deployed = httpx.post(
        f"{a.url}/_polyserve/deploy", data={"space": space}, files={"module": ("main.py", PID)}
    )
    assert deployed.status_code == 200, deployed.text
    made = httpx.put(f"{a.url}/_polyserve/spaces/{space}/access", json={"private": True})
    assert made.status_code == 200, made.text
    assert made.json()["hosts"] == {"applied": 2, "live": 2}
    for host in (a, b):
        assert call(host, space) == 401
    minted = httpx.post(f"{b.url}/_polyserve/spaces/{space}/keys")
    assert minted.status_code == 200, minted.text
    key, key_id = minted.json()["key"], minted.json()["id"]
    for host in (a, b, b, b):
        assert call(host, space, key) == 200
    listed = httpx.get(f"{a.url}/_polyserve/spaces/{space}/keys").json()
    assert [k["id"] for k in listed["keys"]] == [key_id]

    revoked = httpx.delete(f"{a.url}/_polyserve/spaces/{space}/keys/{key_id}")
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["hosts"] == {"applied": 2, "live": 2}
    for host in (b, b, b, b, a):
        assert call(host, space, key) == 401
    # Access changes move no version: the space's history is its one deploy.
    history = httpx.get(f"{a.url}/_polyserve/spaces/{space}/versions").json()["history"]
    assert [(e["event"], e["version"]) for e in history] == [("deploy", 1)]

    with psycopg.connect(fleet_db) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            ).fetchall()
        ]
        dumped = "".join(
            str(row[0]) for t in tables for row in conn.execute(f"SELECT t::text FROM {t} t")
        )
    assert tables and key not in dumped
    for host in (a, b):
        files = [p for p in host.data_dir.rglob("*") if p.is_file()]
        assert not [p for p in files if key.encode() in p.read_bytes()]


def test_a_host_joining_far_behind_takes_the_fleets_access(host_factory, fleet_db):
    """A host that joins after more changes than it replays one by one (it takes the
    fleet's pointers) refuses a private space's callers and takes its live key only."""
    a = host_factory("a", workers=1, POLYSERVE_DATABASE_URL=fleet_db, POLYSERVE_HOST_ID="a", **FAST)
    space = "u/joined"
    deployed = httpx.post(
        f"{a.url}/_polyserve/deploy", data={"space": space}, files={"module": ("main.py", PID)}
    )
    assert deployed.status_code == 200, deployed.text
    keys = f"{a.url}/_polyserve/spaces/{space}/keys"
    httpx.put(
        f"{a.url}/_polyserve/spaces/{space}/access", json={"private": True}
    ).raise_for_status()
    revoked = []
    for _ in range(12):  # 24 changes: more than a follower applies one by one
        minted = httpx.post(keys).json()
        httpx.delete(f"{keys}/{minted['id']}").raise_for_status()
        revoked.append(minted["key"])
    kept = httpx.post(keys).json()["key"]
    b = host_factory("b", workers=1, POLYSERVE_DATABASE_URL=fleet_db, POLYSERVE_HOST_ID="b", **FAST)
    until(lambda: httpx.get(f"{b.url}/_polyserve/health").status_code == 200, what="B caught up")
    assert "took the fleet's pointers" in b.tail(200)
    assert call(b, space) == 401
    assert call(b, space, revoked[0]) == 401 and call(b, space, revoked[-1]) == 401
    assert call(b, space, kept) == 200
