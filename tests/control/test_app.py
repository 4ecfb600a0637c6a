"""In-process tests of polyserve.app's routes: answers, error bodies, prefix semantics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from polyserve import settings
from polyserve.app import create_app
from tests.helpers import make_tar


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    s = settings.load(
        {"POLYSERVE_DATA_DIR": str(tmp_path / "data"), "POLYSERVE_MAX_UPLOAD_MB": "1"}
    )
    with TestClient(create_app(s), client=("127.0.0.1", 50000)) as c:
        yield c


def deploy(client: TestClient, space: str, content: bytes | str, filename: str = "main.py"):
    data = content.encode() if isinstance(content, str) else content
    return client.post(
        "/_polyserve/deploy", data={"space": space}, files={"module": (filename, data)}
    )


def test_deploy_answers_what_was_published(client):
    r = deploy(client, "o/hello", "def handle(request):\n    return 'hi'\n", "hello.py")
    assert r.status_code == 200, r.text
    body = r.json()
    assert {k: body[k] for k in ("space", "version", "entry", "kind", "size")} == {
        "space": "o/hello",
        "version": 1,
        "entry": "hello.py",
        "kind": "handle",
        "size": 37,
    }
    assert len(body["sha256"]) == 64 and body["import_ms"] >= 0
    assert client.get("/s/o/hello/").text == "hi"
    assert client.get("/_polyserve/spaces").json()["spaces"]["o/hello"]["version"] == 1


def test_unknown_spaces_and_routes_answer_json_404(client):
    r = client.get("/s/o/nothing/")
    assert r.status_code == 404 and r.json()["error"] == "space o/nothing is not deployed"
    r = client.get("/nowhere")
    assert r.status_code == 404 and r.json() == {"error": "Not Found"}


def test_the_space_root_without_slash_redirects(client):
    deploy(client, "o/s", "def handle(request):\n    return request.url.path\n")
    r = client.get("/s/o/s", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"].endswith("/s/o/s/")


def test_a_handle_space_sees_the_full_path_and_its_query(client):
    deploy(
        client,
        "o/s",
        "def handle(request):\n"
        "    return [request.url.path, request.scope['root_path'],"
        " request.query_params['q']]\n",
    )
    assert client.get("/s/o/s/a/b?q=1").json() == ["/s/o/s/a/b", "/s/o/s", "1"]


@pytest.mark.parametrize(
    "data,files,message",
    [
        ({}, {"module": ("m.py", b"x")}, "missing form field `space`"),
        ({"space": "o/s"}, {}, "missing file field `module`"),
        ({"space": "o/s", "module": "text"}, {}, "missing file field `module`"),
        ({"space": "../x"}, {"module": ("m.py", b"x")}, "invalid space name"),
    ],
)
def test_a_bad_deploy_request_is_a_422_that_says_what_to_fix(client, data, files, message):
    r = client.post("/_polyserve/deploy", data=data, files=files or None)
    assert r.status_code == 422 and message in r.json()["error"]


def test_a_module_that_fails_validation_changes_nothing(client, tmp_path):
    deploy(client, "o/s", "def handle(request):\n    return 'v1'\n")
    r = deploy(client, "o/s", "def handle(request):\n    return (\n")
    assert r.status_code == 422
    assert r.json()["file"] == "main.py" and r.json()["line"] == 2
    assert client.get("/s/o/s/").text == "v1"
    assert list((tmp_path / "data" / "staging").iterdir()) == []
    assert client.get("/_polyserve/spaces").json()["spaces"]["o/s"]["version"] == 1


def test_an_upload_over_the_cap_is_a_413_by_content_length_and_mid_stream(client, tmp_path):
    big = b"#" * (2 << 20)
    r = deploy(client, "o/s", big)
    assert r.status_code == 413 and "POLYSERVE_MAX_UPLOAD_MB" in r.json()["error"]

    def chunks():  # no Content-Length: the cap must hold while streaming
        boundary = b"--b\r\n"
        yield boundary + b'Content-Disposition: form-data; name="space"\r\n\r\no/s\r\n'
        yield boundary + (b'Content-Disposition: form-data; name="module"; filename="m.py"\r\n\r\n')
        for _ in range(4):
            yield b"#" * (1 << 19)

    r = client.post(
        "/_polyserve/deploy",
        content=chunks(),
        headers={"content-type": "multipart/form-data; boundary=b"},
    )
    assert r.status_code == 413
    assert list((tmp_path / "data" / "staging").iterdir()) == []


def test_delete_undeploys_then_404s(client):
    deploy(client, "o/s", "def handle(request):\n    return 'x'\n")
    assert client.delete("/_polyserve/spaces/o/s").json() == {"space": "o/s", "deleted": True}
    assert client.get("/s/o/s/").status_code == 404
    assert client.delete("/_polyserve/spaces/o/s").status_code == 404
    assert client.get("/_polyserve/spaces").json() == {"spaces": {}}


def test_a_space_that_raises_answers_json_500_and_others_go_on(client):
    deploy(client, "o/bad", "def handle(request):\n    raise ValueError('boom')\n")
    deploy(client, "o/good", "async def handle(request):\n    return 'ok'\n")
    r = client.get("/s/o/bad/")
    assert r.status_code == 500 and r.json()["space"] == "o/bad"
    assert client.get("/s/o/good/").text == "ok"


STARTUP_NEEDS = """
import contextlib, os
from starlette.applications import Starlette
@contextlib.asynccontextmanager
async def lifespan(app):
    if not os.path.exists({path!r}):
        raise RuntimeError('weights missing')
    yield
app = Starlette(lifespan=lifespan)
"""


def test_a_space_whose_startup_fails_is_refused_at_deploy(client, tmp_path):
    source = STARTUP_NEEDS.format(path=str(tmp_path / "absent"))
    r = deploy(client, "o/s", source)
    assert r.status_code == 422 and "startup failed" in r.json()["error"]
    assert "weights missing" in r.json()["error"]
    assert client.get("/s/o/s/").status_code == 404  # nothing was published


def test_a_space_whose_startup_fails_in_a_worker_answers_json_500(client, tmp_path):
    weights = tmp_path / "weights"
    weights.touch()
    assert deploy(client, "o/s2", STARTUP_NEEDS.format(path=str(weights))).status_code == 200
    weights.unlink()  # gone between the deploy and the first request
    r = client.get("/s/o/s2/")
    assert r.status_code == 500 and "startup failed" in r.json()["error"]


FASTAPI_LIKE = """
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, Mount

async def item(request):
    return JSONResponse({"url": str(request.url_for("item", id="7")),
                         "base": str(request.base_url)})

app = Starlette(routes=[Mount("/api", routes=[Route("/items/{id}", item, name="item")])])
"""


def test_an_app_space_routes_and_builds_urls_under_the_prefix(client):
    deploy(client, "o/app", make_tar({"./main.py": FASTAPI_LIKE}), "app.tar")
    assert client.get("/s/o/app/api/items/1").json() == {
        "url": "http://testserver/s/o/app/api/items/7",
        "base": "http://testserver/s/o/app/",
    }
    assert client.get("/s/o/app/missing").status_code == 404


def test_release_makes_the_next_call_import_again(client):
    deploy(client, "o/r", "import time\nT = time.time()\ndef handle(request):\n    return [T]\n")
    first = client.get("/s/o/r/").json()
    assert client.get("/s/o/r/").json() == first
    r = client.post("/_polyserve/spaces/o/r/release")
    assert r.status_code == 200 and r.json()["released"] is True
    assert client.get("/s/o/r/").json() != first
    assert client.post("/_polyserve/spaces/o/none/release").status_code == 404
