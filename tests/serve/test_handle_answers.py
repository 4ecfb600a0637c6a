"""What a handle() returns, on a real host: dispatch sends a plain answer itself, and
streams, background tasks and errors keep their billing and log attribution."""

from __future__ import annotations

import httpx2 as httpx

from tests.helpers import HostProcess, module_host

host = module_host("host", workers=1)

SPACE = """
import asyncio
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

async def chunks():
    for i in range(3):
        if i:
            await asyncio.sleep(0.3)
        yield f"chunk {i}\\n".encode()

def after(n):
    print(f"background task {n} ran")

class Shouting(Response):
    async def __call__(self, scope, receive, send):
        self.body = self.body.upper()
        self.headers["content-length"] = str(len(self.body))
        await super().__call__(scope, receive, send)

async def handle(request):
    kind = request.query_params["kind"]
    if kind == "plain":
        return {"kind": kind}
    if kind == "list":
        return [1, 2.5, None, "three"]
    if kind == "big":
        return {"big": 2**70}  # past orjson's 64 bits: the stdlib's encoder answers
    if kind == "set":
        return {"set": {1, 2}}  # no JSON for a set
    if kind == "unavailable":
        return JSONResponse({"error": "not today"}, status_code=503)
    if kind == "stream":
        return StreamingResponse(chunks(), media_type="text/plain")
    if kind == "background":
        n = request.query_params["n"]
        return Response(f"answered {n}", background=BackgroundTask(after, n))
    if kind == "subclass":
        return Shouting("quiet", media_type="text/plain")
    raise ValueError(kind)
"""


def usage(h: HostProcess, space: str) -> dict:
    r = h.get("/_polyserve/usage")
    assert r.status_code == 200, r.text
    return r.json()["spaces"][space]


def log_messages(h: HostProcess, space: str) -> list[str]:
    r = httpx.get(f"{h.url}/_polyserve/spaces/{space}/logs", timeout=30)
    assert r.status_code == 200, r.text
    return [record["message"] for record in r.json()["records"]]


def test_each_kind_of_answer_arrives_whole_and_is_counted_once(host):
    assert host.deploy("h/kinds", SPACE).status_code == 200
    got = [host.get("/s/h/kinds/", params={"kind": "plain"}) for _ in range(3)]
    assert [(r.status_code, r.json()) for r in got] == [(200, {"kind": "plain"})] * 3
    for kind, body in (
        ("plain", b'{"kind":"plain"}'),
        ("list", b'[1,2.5,null,"three"]'),
        ("big", b'{"big":1180591620717411303424}'),
    ):
        r = host.get("/s/h/kinds/", params={"kind": kind})
        assert (r.status_code, r.content) == (200, body)
        assert r.headers["content-type"] == "application/json"
        assert r.headers["content-length"] == str(len(body))
    r = host.get("/s/h/kinds/", params={"kind": "set"})
    assert r.status_code == 500 and "raised an exception" in r.json()["error"]
    r = host.get("/s/h/kinds/", params={"kind": "unavailable"})
    assert (r.status_code, r.json()) == (503, {"error": "not today"})
    r = host.get("/s/h/kinds/", params={"kind": "subclass"})
    assert (r.status_code, r.text) == (200, "QUIET")  # its own __call__ ran
    r = host.get("/s/h/kinds/", params={"kind": "boom"})
    assert r.status_code == 500 and "raised an exception" in r.json()["error"]
    counted = usage(host, "h/kinds")
    assert (counted["requests"], counted["errors"]) == (10, 3)


def test_a_streamed_answer_is_billed_until_its_last_chunk(host):
    """Two 0.3 s waits between the chunks: the request's busy time holds both."""
    assert host.deploy("h/stream", SPACE).status_code == 200
    r = host.get("/s/h/stream/", params={"kind": "stream"})
    assert (r.status_code, r.text) == (200, "chunk 0\nchunk 1\nchunk 2\n")
    counted = usage(host, "h/stream")
    assert counted["requests"] == 1
    assert counted["busy_ms"] >= 600, counted


def test_a_background_task_runs_after_the_answer_and_logs_as_the_space(host):
    assert host.deploy("h/background", SPACE).status_code == 200
    for n in range(3):
        r = host.get("/s/h/background/", params={"kind": "background", "n": n})
        assert (r.status_code, r.text) == (200, f"answered {n}")
    assert [m for m in log_messages(host, "h/background") if "background" in m] == [
        f"background task {n} ran" for n in range(3)
    ]
    assert usage(host, "h/background")["requests"] == 3
