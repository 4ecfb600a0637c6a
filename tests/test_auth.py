"""Who may deploy: admin token, per-owner hashed tokens, loopback when no token is set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from polyserve import settings
from polyserve.app import create_app
from polyserve.auth import add_token, digest
from tests.conftest import REPO

HELLO = ("main.py", b"def handle(request):\n    return 'hi'\n")
REMOTE = ("203.0.113.9", 40000)  # a documentation address: any non-loopback peer
ADMIN = "admin-secret-token"


def client(tmp_path: Path, peer=REMOTE, **env: str) -> TestClient:
    s = settings.load({"POLYSERVE_DATA_DIR": str(tmp_path / "data"), **env})
    return TestClient(create_app(s), client=peer)


def deploy(c: TestClient, space: str, token: str | None = None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return c.post(
        "/_polyserve/deploy", data={"space": space}, files={"module": HELLO}, headers=headers
    )


def test_without_tokens_loopback_clients_may_write(tmp_path):
    for peer in (("127.0.0.1", 1), ("::1", 1), ("127.8.9.10", 1)):
        with client(tmp_path, peer=peer) as c:
            assert deploy(c, "o/s").status_code == 200


def test_without_tokens_other_clients_are_told_how_to_configure_one(tmp_path):
    with client(tmp_path) as c:
        r = deploy(c, "o/s")
        assert r.status_code == 403
        assert "POLYSERVE_DEPLOY_TOKEN" in r.json()["error"]
        assert c.delete("/_polyserve/spaces/o/s").status_code == 403
        # Reads stay open: the autoscaler scrapes usage from other hosts.
        assert c.get("/_polyserve/usage").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_the_admin_token_writes_any_space(tmp_path):
    with client(tmp_path, POLYSERVE_DEPLOY_TOKEN=ADMIN) as c:
        r = deploy(c, "o/s")
        assert r.status_code == 401 and "Bearer" in r.json()["error"]
        assert deploy(c, "o/s", "wrong").json() == {"error": "invalid token"}
        assert deploy(c, "o/s", ADMIN).status_code == 200
        assert deploy(c, "someone/else", ADMIN).status_code == 200
        assert c.delete("/_polyserve/spaces/o/s").status_code == 401
        auth = {"Authorization": f"bearer {ADMIN}"}  # the scheme is case-insensitive
        assert c.delete("/_polyserve/spaces/o/s", headers=auth).status_code == 200


def test_a_token_on_loopback_is_still_required_once_configured(tmp_path):
    with client(tmp_path, peer=("127.0.0.1", 1), POLYSERVE_DEPLOY_TOKEN=ADMIN) as c:
        assert deploy(c, "o/s").status_code == 401


def test_an_owner_token_writes_only_its_owners_spaces(tmp_path):
    tokens = tmp_path / "tokens.txt"
    alice = add_token(tokens, "alice")
    with client(tmp_path, POLYSERVE_TOKENS_FILE=str(tokens), POLYSERVE_DEPLOY_TOKEN=ADMIN) as c:
        assert deploy(c, "alice/model", alice).status_code == 200
        r = deploy(c, "bob/model", alice)
        assert r.status_code == 403 and "alice/*" in r.json()["error"]
        assert deploy(c, "bob/model", ADMIN).status_code == 200
        auth = {"Authorization": f"Bearer {alice}"}
        assert c.delete("/_polyserve/spaces/bob/model", headers=auth).status_code == 403
        assert c.get("/s/bob/model/").text == "hi"
        assert c.delete("/_polyserve/spaces/alice/model", headers=auth).status_code == 200
        # The file is read per request: a token added now works without a restart.
        bob = add_token(tokens, "bob")
        assert deploy(c, "bob/other", bob).status_code == 200


def test_tokens_are_stored_hashed(tmp_path):
    tokens = tmp_path / "tokens.txt"
    token = add_token(tokens, "alice")
    text = tokens.read_text()
    assert token not in text and f"alice {digest(token)}\n" == text


def test_the_command_prints_a_token_once_and_stores_its_hash(tmp_path):
    tokens = tmp_path / "tokens.txt"
    out = subprocess.run(
        [sys.executable, "-m", "polyserve.auth", "add", "lee101", "--file", str(tokens)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    token = out.stdout.strip()
    assert len(token) >= 40 and tokens.read_text() == f"lee101 {digest(token)}\n"


@pytest.mark.parametrize("header", ["Basic YWxpY2U6cHc=", "Bearer", "Bearer ", "Token x"])
def test_malformed_authorization_is_a_401(tmp_path, header):
    with client(tmp_path, POLYSERVE_DEPLOY_TOKEN=ADMIN) as c:
        r = c.post(
            "/_polyserve/deploy",
            headers={"Authorization": header},
            data={"space": "o/s"},
            files={"module": HELLO},
        )
        assert r.status_code == 401
