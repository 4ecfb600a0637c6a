"""WSGI spaces: a real Flask app, unchanged, behind a real host under /s/owner/name/."""

from __future__ import annotations

import subprocess

import httpx2 as httpx
import pytest

from polyserve.serve.loader import is_wsgi
from tests.helpers import REPO, make_tar

FLASK_APP = (REPO / "examples" / "flask-app" / "app.py").read_text()


# -- telling WSGI from ASGI ---------------------------------------------------------


def wsgi_function(environ, start_response):
    start_response("200 OK", [])
    return [b""]


async def asgi_function(scope, receive, send): ...


class WSGIClass:
    def __call__(self, environ, start_response): ...


class ASGIClass:
    async def __call__(self, scope, receive, send): ...


def test_wsgi_and_asgi_callables_are_told_apart():
    from flask import Flask
    from starlette.applications import Starlette

    assert is_wsgi(wsgi_function) and is_wsgi(WSGIClass()) and is_wsgi(Flask("x"))
    assert not is_wsgi(asgi_function) and not is_wsgi(ASGIClass()) and not is_wsgi(Starlette())
    assert not is_wsgi(WSGIClass)  # a class is an ASGI2-style factory, never WSGI
    assert not is_wsgi(print)  # no signature


# -- a Flask app through a real host --------------------------------------------------


@pytest.fixture(scope="module")
def flask_host(host):
    r = host.deploy("demo/flask", make_tar({"app.py": FLASK_APP}), "flask-app.tar")
    assert r.status_code == 200, r.text
    assert r.json()["kind"] == "wsgi"
    return host


def test_routes_and_url_for_know_the_mount_point(flask_host):
    r = flask_host.get("/s/demo/flask/")
    assert r.json() == {"hello": "/s/demo/flask/hello/world", "docs": "/s/demo/flask/"}
    r = flask_host.get("/s/demo/flask/hello/you?lang=fr")
    assert r.json() == {"greeting": "hello, you", "lang": "fr"}


def test_a_request_body_reaches_flask(flask_host):
    r = flask_host.get("/s/demo/flask/echo")  # GET on a POST-only route: Flask's 405
    assert r.status_code == 405
    r = httpx.post(flask_host.url + "/s/demo/flask/echo", json={"n": [1, 2]}, timeout=30)
    assert r.json() == {"got": {"n": [1, 2]}}


def test_flask_errors_are_flasks(flask_host):
    r = flask_host.get("/s/demo/flask/nowhere")
    assert r.status_code == 404
    assert r.json() == {"error": "no such page", "path": "/nowhere"}
    r = flask_host.get("/s/demo/flask/boom")
    assert r.status_code == 500  # Flask's own 500 page: the app handled its exception
    assert "Internal Server Error" in r.text


def test_wsgi_requests_are_metered(flask_host):
    before = flask_host.get("/_polyserve/usage").json()["spaces"]["demo/flask"]
    for _ in range(5):
        assert flask_host.get("/s/demo/flask/hello/x").status_code == 200
    after = flask_host.get("/_polyserve/usage").json()["spaces"]["demo/flask"]
    assert after["requests"] - before["requests"] == 5


def test_ps_names_the_master_and_its_workers(host):
    """gunicorn's proc_name with setproctitle: this host's processes, by name."""
    port = host.url.rsplit(":", 1)[1]
    names = {}
    for pid in [host.proc.pid, *host.worker_pids()]:
        names[pid] = subprocess.run(
            ["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True
        ).stdout.strip()
    assert names[host.proc.pid] == f"gunicorn: master [polyserve 127.0.0.1:{port}]"
    workers = [n for pid, n in names.items() if pid != host.proc.pid]
    assert workers and all(n == f"gunicorn: worker [polyserve 127.0.0.1:{port}]" for n in workers)
