"""Per-space secrets on a real host: set over HTTP, read by the space's own code through
polyserve.secrets (at import, in a request, in its ASGI scope), never by another space,
never printed back, and in force on every worker from the next load on."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import sys
import types
from pathlib import Path

import httpx2 as httpx
import pytest

from polyserve import secrets
from polyserve.deploy.validate import validate
from polyserve.errors import ClientError
from polyserve.settings import scrubbed_environ
from polyserve.state.secrets import MAX_VALUE
from tests.helpers import HostProcess, module_host, until

host = module_host("host")

VALUE = "sk-test-3f9c1e0d7a5b"  # never in any source deployed below: they hash it
OTHER = "sk-other-8e2b6c4a91"


def digest(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


# A module-level token changes at each import: a reload shows as a new token.
READER = """
import hashlib, os
import polyserve.secrets

def digest(text):
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()

AT_IMPORT = digest(polyserve.secrets.get("API_KEY"))
TOKEN = os.urandom(8).hex()
print("imported, token", TOKEN)

def handle(request):
    print("serving")
    scope = request.scope.get("polyserve.secrets", {})
    return {
        "pid": os.getpid(),
        "token": TOKEN,
        "import": AT_IMPORT,
        "request": digest(polyserve.secrets.get("API_KEY")),
        "scope": digest(scope.get("API_KEY")),
        "default": polyserve.secrets.get("NOT_SET", "fallback"),
    }
"""


def put(host: HostProcess, space: str, name: str, value: bytes | str) -> httpx.Response:
    url = f"{host.url}/_polyserve/spaces/{space}/secrets/{name}"
    return httpx.put(url, content=value, timeout=60)


def unset(host: HostProcess, space: str, name: str) -> httpx.Response:
    return httpx.delete(f"{host.url}/_polyserve/spaces/{space}/secrets/{name}", timeout=60)


def every_worker(host: HostProcess, space: str) -> dict[int, dict]:
    """Call the space over fresh connections until every worker has answered once."""
    answers: dict[int, dict] = {}

    def collect() -> bool:
        r = host.get(f"/s/{space}/")
        assert r.status_code == 200, r.text
        answers[r.json()["pid"]] = r.json()
        return len(answers) >= host.workers

    until(collect, what=f"every worker to answer {space}")
    return answers


def test_a_secret_reaches_its_space_at_import_in_a_request_and_in_its_scope(host):
    assert host.deploy("sec/reader", READER).status_code == 200
    before = every_worker(host, "sec/reader")
    assert {a["request"] for a in before.values()} == {None}
    r = put(host, "sec/reader", "API_KEY", VALUE)
    assert r.status_code == 200, r.text
    assert r.json()["secret"] == "API_KEY" and VALUE not in r.text
    # The change reloads the space: after the 200, every worker serves the new value.
    after = every_worker(host, "sec/reader")
    for answer in after.values():
        assert answer["import"] == answer["request"] == answer["scope"] == digest(VALUE)
        assert answer["default"] == "fallback"
    assert {a["token"] for a in after.values()}.isdisjoint(a["token"] for a in before.values())


def test_a_new_value_is_served_on_every_worker_once_the_put_answers(host):
    assert host.deploy("sec/change", READER).status_code == 200
    assert put(host, "sec/change", "API_KEY", VALUE).status_code == 200
    assert {a["request"] for a in every_worker(host, "sec/change").values()} == {digest(VALUE)}
    assert put(host, "sec/change", "API_KEY", OTHER).status_code == 200
    # Not "eventually": every call after the 200 gets the new value.
    for _ in range(20):
        answer = host.get("/s/sec/change/").json()
        assert (answer["import"], answer["request"]) == (digest(OTHER), digest(OTHER))
    assert unset(host, "sec/change", "API_KEY").status_code == 200
    assert {a["import"] for a in every_worker(host, "sec/change").values()} == {None}


def test_another_space_never_reads_them(host):
    assert host.deploy("sec/owner", READER).status_code == 200
    assert host.deploy("sec/nosy", READER).status_code == 200
    assert put(host, "sec/owner", "API_KEY", VALUE).status_code == 200
    for answer in every_worker(host, "sec/nosy").values():
        assert (answer["import"], answer["request"], answer["scope"]) == (None, None, None)
    # With a secret of its own by the same name, each reads its own.
    assert put(host, "sec/nosy", "API_KEY", OTHER).status_code == 200
    assert {a["request"] for a in every_worker(host, "sec/nosy").values()} == {digest(OTHER)}
    assert {a["request"] for a in every_worker(host, "sec/owner").values()} == {digest(VALUE)}


def test_the_values_are_in_no_answer_log_history_or_file_but_their_own(host):
    r = host.deploy("sec/quiet", READER)
    assert r.status_code == 200
    assert put(host, "sec/quiet", "API_KEY", VALUE).status_code == 200
    redeployed = host.deploy("sec/quiet", READER)  # its validation reads the secret too
    assert redeployed.status_code == 200 and VALUE not in redeployed.text
    every_worker(host, "sec/quiet")
    listed = host.get("/_polyserve/spaces/sec/quiet/secrets")
    assert listed.status_code == 200
    assert [s["name"] for s in listed.json()["secrets"]] == ["API_KEY"]
    assert listed.json()["secrets"][0]["updated_at"] > 0
    answers = [
        listed.text,
        host.get("/_polyserve/usage").text,
        host.get("/metrics").text,
        host.get("/_polyserve/spaces").text,
        host.get("/_polyserve/spaces/sec/quiet/versions").text,
        host.get("/_polyserve/spaces/sec/quiet/logs").text,
        host.get("/_polyserve/").text,
        host.get("/_polyserve/openapi.json").text,
    ]
    assert "serving" in answers[5]  # the space's log is there, without the value
    for text in answers:
        assert VALUE not in text
    assert VALUE not in host.log.read_text(errors="replace")
    secret_file = host.data_dir / "secrets" / "sec" / "quiet.json"
    assert VALUE in secret_file.read_text()
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(secret_file.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((host.data_dir / "secrets").stat().st_mode) == 0o700
    secret_files = host.data_dir / "secrets"  # other tests' spaces hold it too
    for path in host.data_dir.rglob("*"):
        if path.is_file() and not path.is_relative_to(secret_files):
            assert VALUE.encode() not in path.read_bytes(), path


CHECKS_AT_IMPORT = """
import hashlib, os
import polyserve.secrets

value = polyserve.secrets.get("API_KEY")
if value is None or hashlib.sha256(value.encode()).hexdigest() != {digest!r}:
    raise RuntimeError("the import did not read its secret")
if any(value in v for v in os.environ.values()):
    raise RuntimeError("the secret is in the environment")

def handle(request):
    return {{"ok": True, "pid": os.getpid()}}
"""


def test_the_validation_child_reads_its_secret_at_import_not_from_its_environment(host):
    checking = CHECKS_AT_IMPORT.format(digest=digest(VALUE))
    assert host.deploy("sec/checked", READER).status_code == 200
    refused = host.deploy("sec/checked", checking)  # no secret yet: its import raises
    assert refused.status_code == 422, refused.text
    assert "did not read its secret" in refused.json()["error"]
    assert put(host, "sec/checked", "API_KEY", VALUE).status_code == 200
    r = host.deploy("sec/checked", checking)
    assert r.status_code == 200, r.text
    assert VALUE not in r.text
    assert host.get("/s/sec/checked/").json()["ok"] is True


def test_a_spawned_validation_reads_them_on_its_stdin(tmp_path):
    """Without a fork server (a new interpreter), the same: the secrets on its stdin."""
    root = tmp_path / "v"
    root.mkdir()
    (root / "main.py").write_text(CHECKS_AT_IMPORT.format(digest=digest(VALUE)))
    env = scrubbed_environ()
    checked = asyncio.run(
        validate(root, "main.py", 30, 1024, env=env, secrets={"API_KEY": VALUE}, namespaces=False)
    )
    assert checked["kind"] == "handle"
    with pytest.raises(ClientError) as refused:
        asyncio.run(validate(root, "main.py", 30, 1024, env=env, namespaces=False))
    assert "did not read its secret" in refused.value.error


def test_bad_requests_are_answered_with_what_to_fix(host):
    assert put(host, "sec/never", "API_KEY", "x").status_code == 404
    assert host.get("/_polyserve/spaces/sec/never/secrets").status_code == 404
    assert host.deploy("sec/rules", READER).status_code == 200
    for name in ("lower", "1STARTS_WITH_DIGIT", "A" * 65, "DASH-ED"):
        r = put(host, "sec/rules", name, "x")
        assert r.status_code == 400, (name, r.text)
        assert "A-Z" in r.json()["error"]
    r = put(host, "sec/rules", "BIG", b"x" * (MAX_VALUE + 1))
    assert r.status_code == 413 and "64 KiB" in r.json()["error"]
    assert put(host, "sec/rules", "BINARY", b"\xff\xfe").status_code == 400
    assert put(host, "sec/rules", "FULL", b"x" * MAX_VALUE).status_code == 200
    r = unset(host, "sec/rules", "NEVER_SET")
    assert r.status_code == 404 and "NEVER_SET" in r.json()["error"]
    assert host.get("/s/sec/rules/").status_code == 200  # the space still serves


def test_deleting_the_space_drops_its_secrets(host):
    assert host.deploy("sec/gone", READER).status_code == 200
    assert put(host, "sec/gone", "API_KEY", VALUE).status_code == 200
    assert httpx.delete(f"{host.url}/_polyserve/spaces/sec/gone", timeout=60).status_code == 200
    assert not (host.data_dir / "secrets" / "sec" / "gone.json").exists()
    assert host.deploy("sec/gone", READER).status_code == 200
    assert host.get("/_polyserve/spaces/sec/gone/secrets").json()["secrets"] == []
    assert {a["request"] for a in every_worker(host, "sec/gone").values()} == {None}


def test_code_outside_a_space_gets_an_error_not_someone_elses_values():
    with pytest.raises(secrets.NotInSpace):
        secrets.get("API_KEY")
    package = "_ps_o__s__v1_1"
    module = types.ModuleType(f"{package}.main")
    secrets.give(package, {"API_KEY": VALUE})
    sys.modules[module.__name__] = module
    try:
        # Globals that merely name a loaded space's module are not that module's.
        forged = {"__name__": module.__name__, "get": secrets.get}
        with pytest.raises(secrets.NotInSpace):
            exec("get('API_KEY')", forged)
        # The module's own code reads them.
        module.get = secrets.get
        exec("found = get('API_KEY')", vars(module))
        assert module.found == VALUE
    finally:
        secrets.take(package)
        del sys.modules[module.__name__]


def test_a_secret_is_not_in_the_worker_environment(host):
    assert host.deploy("sec/env", READER).status_code == 200
    assert put(host, "sec/env", "API_KEY", VALUE).status_code == 200
    for pid in every_worker(host, "sec/env"):
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert VALUE.encode() not in environ
    assert VALUE not in os.environ.values()


def test_the_cli_sets_lists_and_unsets_without_printing_a_value(host):
    from tests.cli.test_cli import ok, polyserve

    assert host.deploy("sec/cli", READER).status_code == 200
    out = ok(polyserve("secret", "set", "sec/cli", "API_KEY", url=host.url, stdin=VALUE + "\n"))
    assert "set secret API_KEY of sec/cli" in out and VALUE not in out
    # The trailing newline of a piped value is dropped: the space reads the value itself.
    assert {a["request"] for a in every_worker(host, "sec/cli").values()} == {digest(VALUE)}
    ok(polyserve("secret", "set", "sec/cli", "OTHER_KEY", "--value", OTHER, url=host.url))
    listed = ok(polyserve("secret", "list", "sec/cli", url=host.url))
    assert listed.split()[:4] == ["NAME", "UPDATED", "API_KEY", listed.split()[3]]
    assert "OTHER_KEY" in listed and VALUE not in listed and OTHER not in listed
    ok(polyserve("secret", "unset", "sec/cli", "OTHER_KEY", url=host.url))
    assert "OTHER_KEY" not in ok(polyserve("secret", "list", "sec/cli", url=host.url))
    refused = polyserve("secret", "unset", "sec/cli", "OTHER_KEY", url=host.url)
    assert refused.returncode == 1 and "no secret OTHER_KEY" in refused.stderr
    bad = polyserve("secret", "set", "sec/cli", "lower", url=host.url, stdin="x")
    assert bad.returncode == 1 and "A-Z" in bad.stderr
