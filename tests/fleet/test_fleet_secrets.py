"""Secrets in a fleet: real gunicorn hosts sharing a real PostgreSQL. A secret set
through one host is stored once, in the database, and served by every host once the
PUT answers; a host that joins later (from the fleet's pointers) serves it too."""

from __future__ import annotations

import hashlib

import httpx2 as httpx
import psycopg
import pytest

from polyserve.fleet.catchup import EAGER_LIMIT

# _client: test_fleet's module-wide HTTP client, which its helpers use (an autouse fixture)
from tests.fleet.test_fleet import FAST, _client, start_fleet, wait_live  # noqa: F401
from tests.helpers import HostProcess, make_tar, until

pytestmark = pytest.mark.postgres

VALUE = "sk-fleet-51a7d2c09e"  # the deployed source only hashes it

READER = """
import hashlib, os
import polyserve.secrets

def digest(text):
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()

AT_IMPORT = digest(polyserve.secrets.get("API_KEY"))

def handle(request):
    return {"import": AT_IMPORT, "request": digest(polyserve.secrets.get("API_KEY"))}
"""


def digest(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def secret_url(host: HostProcess, space: str, name: str) -> str:
    return f"{host.url}/_polyserve/spaces/{space}/secrets/{name}"


def read(host: HostProcess, space: str) -> tuple[str | None, str | None]:
    r = host.get(f"/s/{space}/")
    assert r.status_code == 200, r.text
    return r.json()["import"], r.json()["request"]


def test_a_secret_set_on_one_host_is_served_by_the_others(host_factory, fleet_db):
    a, b = start_fleet(host_factory, fleet_db, "ab")
    assert a.deploy("fs/reader", READER).status_code == 200
    assert read(b, "fs/reader") == (None, None)
    r = httpx.put(secret_url(a, "fs/reader", "API_KEY"), content=VALUE, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["hosts"] == {"applied": 2, "live": 2} and VALUE not in r.text
    # Applied on every live host before the 200: B serves it at once.
    assert read(b, "fs/reader") == (digest(VALUE), digest(VALUE))
    assert read(a, "fs/reader") == (digest(VALUE), digest(VALUE))
    listed = b.get("/_polyserve/spaces/fs/reader/secrets").json()["secrets"]
    assert [s["name"] for s in listed] == ["API_KEY"]
    with psycopg.connect(fleet_db) as conn:
        rows = conn.execute("SELECT space, name FROM polyserve_secrets").fetchall()
        assert rows == [("fs/reader", "API_KEY")]  # stored once, for the fleet
        changes = conn.execute("SELECT kind, space, version FROM polyserve_changes").fetchall()
        assert ("secrets", "fs/reader", 1) in changes
        assert VALUE not in repr(changes)
    history = a.get("/_polyserve/spaces/fs/reader/versions").json()["history"]
    assert [e["event"] for e in history] == ["deploy"]  # as a single host's: no version moved
    for host in (a, b):
        assert VALUE not in host.get("/_polyserve/spaces/fs/reader/versions").text
        assert VALUE not in host.get("/_polyserve/usage?scope=fleet").text
        assert VALUE not in host.log.read_text(errors="replace")
    # Unset through B: A serves without it after the 200.
    r = httpx.delete(secret_url(b, "fs/reader", "API_KEY"), timeout=60)
    assert r.status_code == 200, r.text
    assert read(a, "fs/reader") == (None, None)
    assert httpx.delete(secret_url(b, "fs/reader", "API_KEY"), timeout=60).status_code == 404


def test_a_host_that_joins_later_takes_the_secrets_with_the_pointers(host_factory, fleet_db):
    (a,) = start_fleet(host_factory, fleet_db, "a")
    assert a.deploy("fs/late", READER).status_code == 200
    # More changes than a joining host replays: it takes the fleet's pointers instead.
    for n in range(EAGER_LIMIT + 1):
        value = VALUE if n == EAGER_LIMIT else f"older-{n}"
        r = httpx.put(secret_url(a, "fs/late", "API_KEY"), content=value, timeout=60)
        assert r.status_code == 200, r.text
    b = host_factory("b", workers=1, POLYSERVE_DATABASE_URL=fleet_db, POLYSERVE_HOST_ID="b", **FAST)
    wait_live(a, {"a", "b"})
    until(lambda: b.get("/_polyserve/health").status_code == 200, what="b to catch up")
    assert read(b, "fs/late") == (digest(VALUE), digest(VALUE))
    assert "took the fleet's pointers" in b.tail(200)


def test_deleting_a_space_drops_its_secrets_in_the_fleet(host_factory, fleet_db):
    a, b = start_fleet(host_factory, fleet_db, "ab")
    assert a.deploy("fs/gone", READER).status_code == 200
    assert httpx.put(secret_url(a, "fs/gone", "API_KEY"), content=VALUE).status_code == 200
    assert (b.data_dir / "secrets" / "fs" / "gone.json").exists()
    assert httpx.delete(f"{a.url}/_polyserve/spaces/fs/gone", timeout=60).status_code == 200
    with psycopg.connect(fleet_db) as conn:
        assert conn.execute("SELECT count(*) FROM polyserve_secrets").fetchone() == (0,)
    assert not (b.data_dir / "secrets" / "fs" / "gone.json").exists()
    assert b.deploy("fs/gone", READER).status_code == 200
    assert read(a, "fs/gone") == (None, None)


CHECKED = """
import hashlib
import polyserve.secrets

value = polyserve.secrets.get("API_KEY")
if value is None or hashlib.sha256(value.encode()).hexdigest() != {digest!r}:
    raise RuntimeError("the import did not read its secret")

def handle(request):
    return {{"import": {digest!r}, "request": None}}
"""


def test_only_the_hosts_of_the_spaces_pool_keep_its_secrets(host_factory, fleet_db):
    """A cpu host applies the change but keeps no file of a gpu space's secrets; it still
    validates a deploy of that space with them (read from the fleet)."""
    a, g = (
        host_factory(
            n, workers=1, POLYSERVE_DATABASE_URL=fleet_db, POLYSERVE_HOST_ID=n,
            POLYSERVE_POOL=pool, **FAST,
        )
        for n, pool in (("a", "cpu"), ("g", "gpu"))
    )  # fmt: skip
    wait_live(a, {"a", "g"})
    manifest = {"polyserve.toml": 'pool = "gpu"\n'}
    assert (
        a.deploy("fs/pooled", make_tar({**manifest, "main.py": READER}), "s.tar").status_code == 200
    )
    r = httpx.put(secret_url(a, "fs/pooled", "API_KEY"), content=VALUE, timeout=60)
    assert r.status_code == 200 and r.json()["hosts"] == {"applied": 2, "live": 2}, r.text
    assert read(g, "fs/pooled") == (digest(VALUE), digest(VALUE))
    assert (g.data_dir / "secrets" / "fs" / "pooled.json").exists()
    assert not (a.data_dir / "secrets" / "fs" / "pooled.json").exists()
    checked = make_tar({**manifest, "main.py": CHECKED.format(digest=digest(VALUE))})
    r = a.deploy("fs/pooled", checked, "s.tar")  # validated on a, a cpu host
    assert r.status_code == 200, r.text
    assert not (a.data_dir / "secrets" / "fs" / "pooled.json").exists()
    assert (g.data_dir / "secrets" / "fs" / "pooled.json").exists()
