"""Who may deploy: admin token, per-owner hashed tokens, loopback when no token is set."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from polyserve import settings
from polyserve.app import create_app
from polyserve.control import auth as auth_mod
from polyserve.control.auth import EXIT_BAD_TOKENS_FILE, add_token, digest, load_tokens
from tests.helpers import REPO, HostProcess

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
        [sys.executable, "-m", "polyserve.control.auth", "add", "lee101", "--file", str(tokens)],
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


GOOD = "ab" * 32  # a well-formed SHA-256 in hex


def test_the_admin_token_may_be_configured_by_its_hash_only(tmp_path):
    with client(tmp_path, POLYSERVE_DEPLOY_TOKEN_SHA256=digest(ADMIN)) as c:
        assert deploy(c, "o/s").status_code == 401
        assert deploy(c, "o/s", "wrong").json() == {"error": "invalid token"}
        assert deploy(c, "someone/else", ADMIN).status_code == 200


def test_no_plaintext_admin_token_is_kept(tmp_path):
    s = settings.load({"POLYSERVE_DATA_DIR": str(tmp_path), "POLYSERVE_DEPLOY_TOKEN": ADMIN})
    app = create_app(s)
    assert ADMIN not in repr(s) and ADMIN not in repr(vars(app.control.auth))
    assert app.control.auth.admin == digest(ADMIN)


def test_the_admin_token_command_prints_a_token_and_its_hash():
    out = subprocess.run(
        [sys.executable, "-m", "polyserve.control.auth", "admin-token"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    token, line = out.stdout.splitlines()
    assert len(token) >= 40 and line == f"POLYSERVE_DEPLOY_TOKEN_SHA256={digest(token)}"
    # The line is what the host takes: it parses, and accepts the token.
    s = settings.load(dict([line.split("=", 1)]))
    assert s.deploy_token_sha256 == digest(token)


GOOD_FILE = f"# owners\n\nalice {GOOD.upper()}  # laptop\n  bob.b_-1 {'cd' * 32}\n"
BAD_LINES = {  # appended to GOOD_FILE, so each is line 5
    "owner only": (b"lee", "expected `owner sha256-hex-of-token`"),
    "three fields": (f"alice {GOOD} extra".encode(), "got 3 field"),
    "star owner": (f"* {GOOD}".encode(), "invalid owner '*'"),
    "owner with slash": (f"a/b {GOOD}".encode(), "invalid owner 'a/b'"),
    "dot owner": (f".hidden {GOOD}".encode(), "invalid owner"),
    "non-hex hash": (f"alice {'g' * 64}".encode(), "64 hex digits"),
    "short hash": (f"alice {GOOD[:-1]}".encode(), "got 63 characters"),
    "not utf-8": (b"bob \xff", "not UTF-8"),
}


@pytest.mark.parametrize("shape", BAD_LINES)
def test_a_tokens_file_is_checked_line_by_line(tmp_path, shape):
    path = tmp_path / "tokens.txt"
    path.write_text(GOOD_FILE + f"alice {'ef' * 32}")  # the last line may lack its newline
    assert load_tokens(path) == {"alice": [GOOD, "ef" * 32], "bob.b_-1": ["cd" * 32]}
    bad, what = BAD_LINES[shape]
    path.write_bytes(GOOD_FILE.encode() + bad + b"\n# more\n")
    with pytest.raises(ValueError) as e:
        load_tokens(path)
    assert str(e.value).startswith(f"{path}:5: ") and what in str(e.value)


def test_a_missing_tokens_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="cannot read the tokens file") as e:
        load_tokens(path)
    assert str(e.value).startswith(f"{path}: ")
    path.write_text("# nobody yet\n")
    assert load_tokens(path) == {}


class _FakeServer:
    def __init__(self, env: dict[str, str]) -> None:
        self.cfg = SimpleNamespace(env_orig=env)
        self.errors: list[str] = []
        self.log = SimpleNamespace(error=lambda msg, *args: self.errors.append(msg % args))


def test_the_master_start_refuses_a_bad_tokens_file(tmp_path):
    path = tmp_path / "tokens.txt"
    path.write_text("lee\n")
    server = _FakeServer({})
    s = settings.load({"POLYSERVE_TOKENS_FILE": str(path)})
    with pytest.raises(SystemExit) as e:
        auth_mod.on_starting(server, s)
    assert e.value.code == EXIT_BAD_TOKENS_FILE == 78
    assert server.errors == [f"POLYSERVE_TOKENS_FILE: {path}:1: {load_tokens_error(path)}"]


def load_tokens_error(path: Path) -> str:
    with pytest.raises(ValueError) as e:
        load_tokens(path)
    return str(e.value).split(": ", 1)[1]


def test_the_master_start_forgets_the_plaintext_in_gunicorns_environment_copy(tmp_path):
    path = tmp_path / "tokens.txt"
    add_token(path, "alice")
    server = _FakeServer({"POLYSERVE_DEPLOY_TOKEN": ADMIN, "HOME": "/h"})
    auth_mod.on_starting(server, settings.load({"POLYSERVE_TOKENS_FILE": str(path)}))
    assert server.cfg.env_orig == {"POLYSERVE_DEPLOY_TOKEN_SHA256": digest(ADMIN), "HOME": "/h"}
    assert server.errors == []


def test_a_tokens_file_gone_bad_while_running_is_a_json_503(tmp_path, caplog):
    tokens = tmp_path / "tokens.txt"
    alice = add_token(tokens, "alice")
    good = tokens.read_text()
    with client(tmp_path, POLYSERVE_TOKENS_FILE=str(tokens), POLYSERVE_DEPLOY_TOKEN=ADMIN) as c:
        assert deploy(c, "alice/m", alice).status_code == 200
        for broken in ("* " + GOOD + "\n", None):  # a bad line; then no file at all
            if broken is None:
                tokens.unlink()
            else:
                tokens.write_text(good + broken)
            with caplog.at_level(logging.ERROR, logger="polyserve"):
                r = deploy(c, "alice/m", alice)
            assert r.status_code == 503
            assert "POLYSERVE_TOKENS_FILE" in r.json()["error"]
            assert str(tokens) in caplog.text  # the log says where; the answer does not
            assert str(tokens) not in r.text
            caplog.clear()
            # The admin token is checked first: an operator can still deploy.
            assert deploy(c, "alice/m", ADMIN).status_code == 200
        tokens.write_text(good)  # fixed: owner tokens work again, no restart
        assert deploy(c, "alice/m", alice).status_code == 200


def test_add_token_starts_a_new_line_after_a_hand_edited_last_line(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"alice {GOOD}")  # no trailing newline
    bob = add_token(tokens, "bob")
    assert load_tokens(tokens) == {"alice": [GOOD], "bob": [digest(bob)]}


# -- real hosts ----------------------------------------------------------------------


@pytest.mark.gunicorn
def test_a_host_with_a_bad_tokens_file_does_not_start(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"# owners\nalice {GOOD}\n* {GOOD}\n")
    host = HostProcess(tmp_path / "data", workers=1, POLYSERVE_TOKENS_FILE=str(tokens))
    code, log = host.start_expecting_exit()
    assert code == EXIT_BAD_TOKENS_FILE, log
    assert f"{tokens}:3: invalid owner '*'" in log
    assert "Traceback" not in log and "Booting worker" not in log


def test_a_host_given_only_the_hash_accepts_the_token(host_factory):
    h = host_factory(workers=1, POLYSERVE_DEPLOY_TOKEN_SHA256=digest(ADMIN))
    assert h.deploy("o/s", HELLO[1]).status_code == 401  # loopback, but a token is set
    wrong = h.deploy("o/s", HELLO[1], headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401
    ok = h.deploy("o/s", HELLO[1], headers={"Authorization": f"Bearer {ADMIN}"})
    assert ok.status_code == 200, ok.text
    assert h.get("/s/o/s/").text == "hi"


SHOW_ENVIRONMENT = """
import gc, os, subprocess
from gunicorn.config import Config

def handle(request):
    # gunicorn's Config keeps a copy of the environment it started with (env_orig). The
    # master froze its heap before the fork (gc.freeze), which hides the objects it made
    # from gc.get_objects(): let them back in for the search.
    gc.unfreeze()
    configs = [o for o in gc.get_objects() if isinstance(o, Config)]
    gc.freeze()
    with open("/proc/self/environ", "rb") as f:
        kernel = f.read().decode(errors="replace")
    return {
        "environ": dict(os.environ),
        "env_orig": [dict(c.env_orig) for c in configs],
        "child": subprocess.run(["env"], capture_output=True, text=True).stdout,
        "kernel": kernel,
    }
"""


def test_a_space_does_not_see_the_plaintext_admin_token(host_factory):
    h = host_factory(workers=1, POLYSERVE_DEPLOY_TOKEN=ADMIN)
    auth = {"Authorization": f"Bearer {ADMIN}"}

    def check(when: str) -> None:
        r = h.deploy("o/env", SHOW_ENVIRONMENT, headers=auth)
        assert r.status_code == 200, r.text
        assert h.deploy("o/env", SHOW_ENVIRONMENT).status_code == 401
        seen = h.get("/s/o/env/").json()
        assert "POLYSERVE_DEPLOY_TOKEN" not in seen["environ"], when
        assert seen["environ"]["POLYSERVE_DEPLOY_TOKEN_SHA256"] == digest(ADMIN)
        assert seen["env_orig"], "the space found no gunicorn Config: the check proves nothing"
        for copy in seen["env_orig"]:
            assert "POLYSERVE_DEPLOY_TOKEN" not in copy, when
        assert ADMIN not in repr([seen["environ"], seen["env_orig"], seen["child"]]), when
        # The kernel's copy of the environment the master started with: setproctitle
        # (gunicorn's proc_name) writes the process title over that block, so it no
        # longer shows the token either (docs/auth.md says what still can).
        assert len(seen["kernel"]) > len(ADMIN), "the space read no environment block"
        assert ADMIN not in seen["kernel"], when

    check("at start")
    # A HUP re-reads gunicorn.conf.py and the settings from the rewritten environment in
    # fresh workers: they must still know the admin token, and still not show it.
    h.hup()
    h.wait_ready()
    check("after a HUP")
