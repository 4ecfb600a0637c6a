"""Hardening on real hosts: lifespan like uvicorn's "auto", validation that does what a
worker does, bounded validator output, memory freed at release, per-space threads,
loopback trust that ignores X-Forwarded-For, and a deadline on the response start only.

Every host here binds 127.0.0.1 and runs one worker; every wait polls with a deadline.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import pytest
from starlette.testclient import TestClient
from websockets.sync.client import connect

from polyserve import settings as settings_mod
from polyserve.app import create_app
from polyserve.http.worker import Worker
from tests.helpers import HostProcess, module_host, until

MiB = 1 << 20


# One 1-worker host shared by this module's deploy-and-call tests.
host1 = module_host("host1", workers=1, POLYSERVE_IMPORT_TIMEOUT="10")


def usage(host: HostProcess) -> dict:
    return host.get("/_polyserve/usage").json()


def proc_status_kib(pid: int, field: str) -> int:
    """A `VmRSS`/`VmHWM`-style line of /proc/<pid>/status, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def worker_pid(host: HostProcess) -> int:
    return host.get("/_polyserve/health").json()["pid"]


# -- 2a. lifespan like uvicorn's lifespan="auto" -------------------------------------------

RETURNS_ON_LIFESPAN = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"returned"})
"""

# uvicorn's hello world, without its `assert scope['type'] == 'http'`.
HELLO_WORLD = """
async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"Hello, world!"})
"""

RAISES_ON_LIFESPAN = """
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        raise RuntimeError("this app has no lifespan")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"raised"})
"""


def test_apps_without_lifespan_support_deploy_and_serve(host1):
    """An app that returns on the lifespan scope, one that answers it like HTTP, and one
    that raises on it before startup.complete all deploy with 200 and answer their first
    request with 200, as under uvicorn's lifespan="auto"."""
    apps = {
        "l/returns": (RETURNS_ON_LIFESPAN, "returned"),
        "l/hello": (HELLO_WORLD, "Hello, world!"),
        "l/raises": (RAISES_ON_LIFESPAN, "raised"),
    }
    outcomes = {}
    for space, (source, _) in apps.items():
        deployed = host1.deploy(space, source)
        first = host1.get(f"/s/{space}/")
        outcomes[space] = (deployed.status_code, first.status_code, first.text)
    assert outcomes == {space: (200, 200, body) for space, (_, body) in apps.items()}


FAILING_STARLETTE_LIFESPAN = """
import contextlib
from starlette.applications import Starlette

@contextlib.asynccontextmanager
async def lifespan(app):
    raise RuntimeError("the weights file is missing")
    yield

app = Starlette(lifespan=lifespan)
"""


def test_a_failing_starlette_lifespan_is_a_422_and_the_previous_version_serves(host1):
    """A Starlette app whose lifespan raises is refused at deploy (422, the exception's
    text in "error"), and the space's previous version keeps serving."""
    assert host1.deploy("l/keep", "def handle(r):\n    return 'v1'\n").status_code == 200
    assert host1.get("/s/l/keep/").text == "v1"
    r = host1.deploy("l/keep", FAILING_STARLETTE_LIFESPAN)
    assert r.status_code == 422, r.text
    assert "the weights file is missing" in r.json()["error"]
    assert [host1.get("/s/l/keep/").text for _ in range(3)] == ["v1"] * 3


# -- 2b. validation does what a worker does ------------------------------------------------

GET_EVENT_LOOP = """
import asyncio
LOOP = asyncio.get_event_loop()
def handle(request):
    return "loop"
"""

MAIN_THREAD_ONLY = """
import signal
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
def handle(request):
    return "signal"
"""


@pytest.mark.parametrize(
    "space,source,message",
    [
        ("v/loop", GET_EVENT_LOOP, "main.py, line 3: RuntimeError"),
        ("v/signal", MAIN_THREAD_ONLY, "main.py, line 3: ValueError"),
    ],
    ids=["get_event_loop", "signal"],
)
def test_an_import_that_fails_off_the_main_thread_is_refused(host1, space, source, message):
    """A module whose import works on the main thread only (where the old validator ran
    it) but not on the worker thread a worker imports on is a 422, never a 200 whose
    requests all fail."""
    r = host1.deploy(space, source)
    assert r.status_code == 422, r.text
    assert message in r.json()["error"]
    assert host1.get(f"/s/{space}/").status_code == 404  # nothing was published


# -- 3. a lifespan message without a type --------------------------------------------------

TYPELESS_LIFESPAN = """
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        await receive()
        await send({"status": "started"})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"served"})
"""


def test_a_typeless_lifespan_message_leaks_no_in_flight_request(host1):
    """A lifespan that sends {"status": "started"} is either a 200 whose requests are
    served or a 422; after 4 requests the host has none in flight, and a 200's requests
    are counted."""
    before = usage(host1)["spaces"].get("l/typeless", {}).get("requests", 0)
    r = host1.deploy("l/typeless", TYPELESS_LIFESPAN)
    assert r.status_code in (200, 422), r.text
    answers = [host1.get("/s/l/typeless/") for _ in range(4)]
    with contextlib.suppress(AssertionError):
        until(lambda: usage(host1)["host"]["in_flight"] == 0, timeout=5, what="none in flight")
    u = usage(host1)
    assert u["host"]["in_flight"] == 0
    if r.status_code == 200:
        assert u["spaces"]["l/typeless"]["requests"] == before + 4
        assert [(a.status_code, a.text) for a in answers] == [(200, "served")] * 4
    else:
        assert [a.status_code for a in answers] == [404] * 4


# -- 4. validation keeps a bounded tail ----------------------------------------------------

LOUD_IMPORT = """
import sys
for _ in range(300):
    sys.{stream}.write("x" * (1 << 20))
sys.{stream}.write("\\nlast words of the import\\n")
sys.{stream}.flush()
raise RuntimeError("the end")
"""


@pytest.mark.parametrize("stream", ["stderr", "stdout"])
def test_300_mib_of_import_output_costs_the_worker_no_memory(host_factory, stream):
    """A module that writes 300 MiB to stdout or stderr at import is a 422 whose `stderr`
    holds only a few KiB, the end of that output, and the deploying worker's peak memory
    (VmHWM) grows by at most 50 MiB."""
    host = host_factory(f"loud-{stream}", workers=1)
    pid = worker_pid(host)
    hwm_before = proc_status_kib(pid, "VmHWM")
    r = host.deploy("m/loud", LOUD_IMPORT.format(stream=stream))
    hwm_after = proc_status_kib(pid, "VmHWM")
    assert worker_pid(host) == pid, "the deploying worker is the one measured"
    assert r.status_code == 422, r.text[:500]
    body = r.json()
    assert "RuntimeError: the end" in body["error"]
    assert len(body["stderr"]) <= 4096
    assert body["stderr"].endswith("last words of the import\n")
    assert hwm_after - hwm_before <= 50 * 1024, (hwm_before, hwm_after)


# -- 5. a release frees memory -------------------------------------------------------------

BIG = """
DATA = b"x" * (200 << 20)
def handle(request):
    return {"len": len(DATA)}
"""


def test_a_release_gives_a_dropped_versions_memory_back(host_factory):
    """After a release, the worker's RSS falls by at least 150 MiB of the 200 MiB that
    the space held at module level (the dropped version's cycles are collected)."""
    host = host_factory("release", workers=1)
    assert host.deploy("m/big", BIG).status_code == 200
    assert host.get("/s/m/big/").json() == {"len": 200 * MiB}
    pid = worker_pid(host)
    loaded = proc_status_kib(pid, "VmRSS")
    r = httpx.post(host.url + "/_polyserve/spaces/m/big/release", timeout=30)
    assert r.status_code == 200, r.text
    target = loaded - 150 * 1024
    with contextlib.suppress(AssertionError):
        until(lambda: proc_status_kib(pid, "VmRSS") <= target, timeout=15, what="RSS to fall")
    after = proc_status_kib(pid, "VmRSS")
    assert worker_pid(host) == pid
    assert after <= target, (loaded, after)


# -- 6. tenants do not share one thread pool with the host ---------------------------------

WAITER = """
import pathlib, time
MARKER = pathlib.Path({marker!r})
def handle(request):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if MARKER.exists():
            return "released"
        time.sleep(0.01)
    return "timeout"
"""

MAKER = """
import pathlib
async def handle(request):
    pathlib.Path({marker!r}).touch()
    return "made"
"""

COUNTER = """
import pathlib, threading, time
GATE = pathlib.Path({gate!r})
SEEN = pathlib.Path({seen!r})
LOCK = threading.Lock()
NOW = 0
MAX = 0

def handle(request):
    global NOW, MAX
    if request.url.path.endswith("/max"):
        return {{"max": MAX}}
    with LOCK:
        NOW += 1
        MAX = max(MAX, NOW)
        SEEN.write_text(str(MAX))
    try:
        deadline = time.monotonic() + 20
        while not GATE.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
    finally:
        with LOCK:
            NOW -= 1
    return "done"
"""


threads_host = module_host("threads_host", workers=1, POLYSERVE_SPACE_THREADS="4")


def _fire(host: HostProcess, path: str, n: int) -> tuple[ThreadPoolExecutor, list]:
    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(lambda: host.get(path).text) for _ in range(n)]
    return pool, futures


def test_a_space_blocking_its_threads_does_not_stall_another_spaces_deploy(threads_host, tmp_path):
    """While 45 requests hold a sync space's threads, another space deploys, cold-starts
    and answers (its deploy and import never wait behind the first space's threads), and
    then every one of the 45 requests completes."""
    host = threads_host
    marker = tmp_path / "marker"
    assert host.deploy("t/waiter", WAITER.format(marker=str(marker))).status_code == 200
    pool, futures = _fire(host, "/s/t/waiter/", 45)
    try:
        until(
            lambda: usage(host)["host"]["in_flight"] >= 45,
            timeout=30,
            what="45 requests in flight",
        )
        deployed = host.deploy("t/maker", MAKER.format(marker=str(marker)))
        made = host.get("/s/t/maker/").text
        answers = [f.result(timeout=60) for f in futures]
    finally:
        marker.touch()  # whatever happened, let the waiters go
        pool.shutdown(wait=True)
    assert (deployed.status_code, made) == (200, "made")
    assert answers.count("released") == 45, answers


def test_a_spaces_sync_handler_runs_on_at_most_space_threads_threads(threads_host, tmp_path):
    """With POLYSERVE_SPACE_THREADS=4, 10 concurrent requests to one sync space run its
    handler at most 4 at a time, and reach 4."""
    host = threads_host
    gate, seen = tmp_path / "gate", tmp_path / "seen"
    source = COUNTER.format(gate=str(gate), seen=str(seen))
    assert host.deploy("t/counter", source).status_code == 200
    assert host.get("/s/t/counter/max").json() == {"max": 0}  # imported, nothing counted
    pool, futures = _fire(host, "/s/t/counter/", 10)
    try:
        until(
            lambda: (
                usage(host)["host"]["in_flight"] >= 10
                and seen.exists()
                and int(seen.read_text() or 0) >= 4
            ),
            timeout=30,
            what="10 requests in flight, 4 of them in the handler",
        )
        gate.touch()
        answers = [f.result(timeout=60) for f in futures]
    finally:
        gate.touch()
        pool.shutdown(wait=True)
    assert answers == ["done"] * 10
    assert host.get("/s/t/counter/max").json() == {"max": 4}


# -- 7. loopback trust never follows X-Forwarded-For ---------------------------------------

CLIENT_HOST = "def handle(request):\n    return request.client.host\n"


def test_uvicorn_does_not_rewrite_the_control_planes_client():
    """The worker turns uvicorn's proxy_headers off: only HostApp applies X-Forwarded-For,
    and to space requests only."""
    assert Worker.CONFIG_KWARGS["proxy_headers"] is False


def test_a_forwarded_loopback_address_gets_no_loopback_trust(tmp_path):
    """From a non-loopback peer, with every proxy trusted and no token configured, a
    deploy and a delete that claim X-Forwarded-For: 127.0.0.1 are 403, while a space
    still sees the forwarded client."""
    s = settings_mod.load({"POLYSERVE_DATA_DIR": str(tmp_path / "data")})
    with TestClient(create_app(s), client=("127.0.0.1", 50000)) as local:
        r = local.post(
            "/_polyserve/deploy",
            data={"space": "o/who"},
            files={"module": ("main.py", CLIENT_HOST.encode())},
        )
        assert r.status_code == 200, r.text
    app = create_app(s)
    app.trust_forwarded("*")
    forged = {"X-Forwarded-For": "127.0.0.1"}
    with TestClient(app, client=("192.0.2.10", 50000)) as remote:
        deploy = remote.post(
            "/_polyserve/deploy",
            data={"space": "o/x"},
            files={"module": ("main.py", b"def handle(r):\n    return 'x'\n")},
            headers=forged,
        )
        delete = remote.delete("/_polyserve/spaces/o/who", headers=forged)
        direct = remote.get("/s/o/who/").text
        forwarded = remote.get("/s/o/who/", headers={"X-Forwarded-For": "203.0.113.7"}).text
        still_there = remote.get("/_polyserve/spaces").json()["spaces"]
    assert (deploy.status_code, delete.status_code) == (403, 403), (deploy.text, delete.text)
    assert "token" in deploy.json()["error"]
    assert (direct, forwarded) == ("192.0.2.10", "203.0.113.7")
    assert set(still_there) == {"o/who"}


CLIENT_AND_SCHEME = (
    "def handle(request):\n    return f'{request.client.host} {request.url.scheme}'\n"
)


def test_a_space_sees_x_forwarded_proto_alone_and_with_x_forwarded_for(tmp_path):
    """HostApp skips uvicorn's proxy-headers layer for a request with neither header it
    reads, so each header alone must still take it there: X-Forwarded-Proto alone sets
    the scheme and leaves the peer, and both set both."""
    s = settings_mod.load({"POLYSERVE_DATA_DIR": str(tmp_path / "data")})
    app = create_app(s)
    app.trust_forwarded("*")
    with TestClient(app, client=("127.0.0.1", 50000)) as c:
        r = c.post(
            "/_polyserve/deploy",
            data={"space": "o/where"},
            files={"module": ("main.py", CLIENT_AND_SCHEME.encode())},
        )
        assert r.status_code == 200, r.text
        plain = c.get("/s/o/where/").text
        proto = c.get("/s/o/where/", headers={"X-Forwarded-Proto": "https"}).text
        both = c.get(
            "/s/o/where/", headers={"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.7"}
        ).text
    assert (plain, proto, both) == ("127.0.0.1 http", "127.0.0.1 https", "203.0.113.7 https")


# -- 10. the request deadline bounds the wait for the response start only ------------------

STREAM_AND_SOCKET = """
import asyncio
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocketDisconnect

async def chunks():
    for i in range(6):
        if i:
            await asyncio.sleep(0.5)
        yield f"chunk {i}\\n".encode()

async def stream(request):
    return StreamingResponse(chunks(), media_type="text/plain")

async def late(request):
    await asyncio.sleep(3)
    return StreamingResponse(chunks(), media_type="text/plain")

async def echo(websocket):
    await websocket.accept()
    try:
        while True:
            text = await websocket.receive_text()
            if text == "later":
                await asyncio.sleep(2.5)  # past the 1 s request deadline
            await websocket.send_text(text)
    except WebSocketDisconnect:
        pass

app = Starlette(routes=[
    Route("/stream", stream), Route("/late", late), WebSocketRoute("/ws", echo),
])
"""

WHOLE_STREAM = "".join(f"chunk {i}\n" for i in range(6))


deadline_host1 = module_host("deadline_host1", workers=1, POLYSERVE_REQUEST_TIMEOUT="1")


@pytest.fixture(scope="module")
def deadline_host(deadline_host1: HostProcess) -> HostProcess:
    assert deadline_host1.deploy("d/live", STREAM_AND_SOCKET).status_code == 200
    return deadline_host1


def test_a_started_stream_outlives_the_request_deadline(deadline_host):
    """With POLYSERVE_REQUEST_TIMEOUT=1, a StreamingResponse of 6 chunks 0.5 s apart
    arrives whole."""
    received: list[bytes] = []
    error = None
    status = 0
    try:
        with httpx.stream("GET", deadline_host.url + "/s/d/live/stream", timeout=30) as r:
            status = r.status_code
            received.extend(r.iter_bytes())
    except httpx.TransportError as exc:
        error = repr(exc)
    assert (status, b"".join(received).decode(), error) == (200, WHOLE_STREAM, None)


def test_an_accepted_websocket_outlives_the_request_deadline(deadline_host):
    """With POLYSERVE_REQUEST_TIMEOUT=1, an accepted websocket stays open past 2.5 s and
    still echoes."""
    url = f"ws://127.0.0.1:{deadline_host.port}/s/d/live/ws"
    echoes = []
    with connect(url, open_timeout=10, close_timeout=5) as ws:
        for text in ("first", "later", "after"):
            ws.send(text)
            echoes.append(ws.recv(timeout=10))
    assert echoes == ["first", "later", "after"]


def test_a_response_that_does_not_start_in_time_is_still_a_504(deadline_host):
    """With POLYSERVE_REQUEST_TIMEOUT=1, a handler that waits 3 s before its response
    starts is answered 504 with a JSON error naming the setting."""
    r = deadline_host.get("/s/d/live/late")
    assert r.status_code == 504, r.text
    assert "POLYSERVE_REQUEST_TIMEOUT" in r.json()["error"]
