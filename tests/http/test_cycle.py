"""polyserve.http.cycle: the bytes of every answer are uvicorn's, in one write where the response's
length is known, and a stream's head still leaves before its first chunk."""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from gunicorn.config import Config as GunicornConfig
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from polyserve.http import cycle, strict
from polyserve.http.cycle import Cycle

App = Callable[[Any, Any, Any], Awaitable[None]]
GET = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
CLOSED = b"<closed>"


class Recording(asyncio.Transport):
    """A transport that keeps each write, and its close, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.vectored = 0  # writes of several buffers at once

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.writes.append(b"".join(list_of_data))
        self.vectored += 1

    def close(self) -> None:
        self.writes.append(CLOSED)

    def is_closing(self) -> bool:
        return CLOSED in self.writes

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)


def connection(protocol_class: type[HttpToolsProtocol], app: App) -> tuple[Any, Recording]:
    config = Config(app=app, lifespan="off", log_level="critical", access_log=False)
    config.load()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = Recording()
    protocol.connection_made(transport)
    return protocol, transport


async def served(protocol_class: type[HttpToolsProtocol], app: App, request: bytes) -> list[bytes]:
    """What `protocol_class` writes for `request` answered by `app`, once it is answered."""
    protocol, transport = connection(protocol_class, app)
    protocol.data_received(request)
    for _ in range(100):
        await asyncio.sleep(0)
        if protocol.cycle.response_complete or transport.is_closing():
            break
    return transport.writes


def both(app: App, request: bytes = GET) -> tuple[list[bytes], list[bytes]]:
    """The writes of polyserve's protocol and of uvicorn's own, for the same request."""

    async def run() -> tuple[list[bytes], list[bytes]]:
        ours = await served(strict.protocol(GunicornConfig()), app, request)
        return ours, await served(HttpToolsProtocol, app, request)

    return asyncio.run(run())


def answering(status: int, headers: list[tuple[bytes, bytes]], *bodies: bytes) -> App:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for i, body in enumerate(bodies):
            more = i < len(bodies) - 1
            await send({"type": "http.response.body", "body": body, "more_body": more})

    return app


JSON = [(b"content-type", b"application/json"), (b"content-length", b"11")]


def test_a_fixed_length_answer_is_one_write_of_uvicorns_bytes():
    ours, uvicorns = both(answering(200, JSON, b'{"a": true}'))
    assert len(uvicorns) == 2, uvicorns  # the head, then the body
    assert ours == [b"".join(uvicorns)]
    assert ours[0].startswith(b"HTTP/1.1 200 OK\r\n") and ours[0].endswith(b'\r\n\r\n{"a": true}')


def test_a_bad_header_field_is_refused_every_time_and_the_checked_ones_stay_bounded():
    """Cycle remembers the fields that passed uvicorn's checks, never one that failed: a
    value with a CRLF in it breaks the answer as uvicorn's does, the second time too, and
    distinct values past the bound leave the memory at its bound."""
    bad = answering(200, [(b"x-a", b"1\r\nset-cookie: x"), (b"content-length", b"2")], b"ok")
    for _ in range(2):
        ours, uvicorns = both(bad)
        assert ours == uvicorns == [CLOSED], (ours, uvicorns)
    for n in range(cycle.CHECKED_MAX + 10):
        ours, uvicorns = both(answering(200, [(b"x-n", b"%d" % n), *JSON], b'{"a": true}'))
        assert ours == [b"".join(uvicorns)]
    assert 0 < len(cycle.CHECKED) <= cycle.CHECKED_MAX
    assert (b"x-a", b"1\r\nset-cookie: x") not in cycle.CHECKED


def test_a_large_body_is_written_beside_its_head_not_copied_behind_it():
    body = b"x" * (1 << 20)
    app = answering(200, [(b"content-length", b"%d" % len(body))], body)

    async def run() -> tuple[list[bytes], Recording]:
        protocol, transport = connection(strict.protocol(GunicornConfig()), app)
        protocol.data_received(GET)
        for _ in range(5):
            await asyncio.sleep(0)
        return await served(HttpToolsProtocol, app, GET), transport

    uvicorns, ours = asyncio.run(run())
    assert ours.writes == [b"".join(uvicorns)] and ours.vectored == 1


def test_a_body_in_parts_carries_the_head_in_its_first_write():
    ours, uvicorns = both(answering(200, [(b"content-length", b"10")], b"hello", b"world"))
    assert len(uvicorns) == 3, uvicorns
    assert ours == [uvicorns[0] + b"hello", b"world"]


@pytest.mark.parametrize(
    ("request_", "status", "headers"),
    [
        (b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n", 200, JSON),  # a length, and no body
        (b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n", 200, []),
        (GET, 204, []),
        (GET, 304, []),
    ],
)
def test_a_head_without_a_body_still_leaves(request_, status, headers):
    """HEAD, 204 and 304 send no body bytes: the head goes out all the same."""
    ours, uvicorns = both(answering(status, headers, b""), request_)
    assert ours == [uvicorns[0]], (ours, uvicorns)
    assert ours[0].endswith(b"\r\n\r\n") and ours[0].startswith(b"HTTP/1.1 %d " % status)


def test_connection_close_comes_after_the_answer():
    """An HTTP/1.0 request is answered, then its connection closed, in that order."""
    ours, uvicorns = both(answering(200, JSON, b'{"a": true}'), b"GET / HTTP/1.0\r\n\r\n")
    assert uvicorns[-1] == CLOSED and len(uvicorns) == 3, uvicorns
    assert ours == [uvicorns[0] + uvicorns[1], CLOSED]


async def before_and_after(app: App, request: bytes, then: bytes = b"") -> tuple[list, list]:
    """What polyserve's protocol has written once `app` waits after its start, and once
    it was released (`app` gets the event as scope["release"]) and `then` was received."""
    release = asyncio.Event()

    async def released(scope: Any, receive: Any, send: Any) -> None:
        await app({**scope, "release": release}, receive, send)

    protocol, transport = connection(strict.protocol(GunicornConfig()), released)
    protocol.data_received(request)
    for _ in range(5):
        await asyncio.sleep(0)
    before = list(transport.writes)
    release.set()
    if then:
        protocol.data_received(then)
    for _ in range(10):
        await asyncio.sleep(0)
    assert protocol.cycle.response_complete
    return before, transport.writes


async def stream(scope: Any, receive: Any, send: Any) -> None:
    """A stream: its start, a wait, a chunk, its end."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await scope["release"].wait()
    await send({"type": "http.response.body", "body": b"tick", "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def test_a_streams_head_leaves_before_its_first_chunk():
    """A response without a length (chunked) gets its head at once: its first chunk may be
    a long way off, and the client should know the status meanwhile."""
    before, after = asyncio.run(before_and_after(stream, GET))
    assert before == [after[0]] and b"transfer-encoding: chunked\r\n" in before[0], before
    assert after[1:] == [b"4\r\ntick\r\n", b"0\r\n\r\n"]


@pytest.mark.parametrize("headers", [[], [(b"content-length", b"4")]], ids=["stream", "length"])
def test_a_head_requests_head_leaves_at_once(headers):
    """No body byte follows a HEAD response's head: it is not held for a body message
    that may be a long way off (an endless stream's never ends)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await scope["release"].wait()
        await send({"type": "http.response.body", "body": b"tick"})

    head = b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n"
    before, after = asyncio.run(before_and_after(app, head))
    assert len(before) == 1 and before[0].startswith(b"HTTP/1.1 200 OK\r\n"), before
    assert after == before  # and nothing more: HEAD has no body


def test_a_head_leaves_at_once_when_the_client_expects_100_continue():
    """A client that sent `Expect: 100-continue` may hold its body back until it sees an
    answer; an app that starts its response and then reads the body must not wait on it."""

    async def echo(scope: Any, receive: Any, send: Any) -> None:
        length = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": length})
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.body", "body": body})

    post = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    before, after = asyncio.run(before_and_after(echo, post, then=b"hello"))
    assert len(before) == 1 and before[0].startswith(b"HTTP/1.1 200 OK\r\n"), before
    assert after == [before[0], b"hello"]


def test_a_response_abandoned_after_its_start_sends_nothing():
    """The app raised between its head and its body: the connection closes without a
    byte of the response (uvicorn's own would have sent the head, then closed)."""

    async def abandoning(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": JSON})
        raise RuntimeError("the space failed after its start")

    ours, uvicorns = both(abandoning)
    assert ours == [CLOSED]
    assert len(uvicorns) == 2 and uvicorns[0].startswith(b"HTTP/1.1 200 "), uvicorns


# uvicorn 0.54's RequestResponseCycle.send, which polyserve/http/cycle.py copies (compared as
# syntax trees: the lines are wrapped to fit ours).
UPSTREAM_SEND = """
async def send(self, message: ASGISendEvent) -> None:
    if self.flow.write_paused and not self.disconnected:
        await self.flow.drain()  # pragma: full coverage

    if self.disconnected:
        return  # pragma: full coverage

    if not self.response_started:
        # Sending response status line and headers
        if message["type"] != "http.response.start":
            raise RuntimeError(
                f"Expected ASGI message 'http.response.start', but got '{message['type']}'."
            )

        self.response_started = True
        self.waiting_for_100_continue = False

        status_code = message["status"]
        headers = self.default_headers + list(message.get("headers", []))

        if self.access_log:
            self.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(self.scope),
                self.scope["method"],
                get_path_with_query_string(self.scope),
                self.scope["http_version"],
                status_code,
            )

        # Write response status line and headers
        content = [STATUS_LINE[status_code]]
        has_connection_close = False

        for name, value in headers:
            if HEADER_RE.search(name):
                raise RuntimeError("Invalid HTTP header name.")  # pragma: full coverage
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")

            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection":
                connection = [token.lower().strip() for token in value.split(b",")]
                if b"close" in connection:
                    self.keep_alive = False
                    has_connection_close = True
            content.extend([name, b": ", value, b"\\r\\n"])

        if not self.keep_alive and not has_connection_close:
            content.append(b"connection: close\\r\\n")

        if (
            self.chunked_encoding is None
            and self.scope["method"] != "HEAD"
            and status_code not in (204, 304)
        ):
            # Neither content-length nor transfer-encoding specified
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\\r\\n")

        content.append(b"\\r\\n")
        self.transport.write(b"".join(content))

    elif not self.response_complete:
        # Sending response body
        if message["type"] != "http.response.body":
            raise RuntimeError(
                f"Expected ASGI message 'http.response.body', but got '{message['type']}'."
            )

        body = message.get("body", b"")
        more_body = message.get("more_body", False)

        # Write response body
        if self.scope["method"] == "HEAD":
            self.expected_content_length = 0
        elif self.chunked_encoding:
            if body:
                content = [b"%x\\r\\n" % len(body), body, b"\\r\\n"]
            else:
                content = []
            if not more_body:
                content.append(b"0\\r\\n\\r\\n")
            self.transport.write(b"".join(content))
        else:
            num_bytes = len(body)
            if num_bytes > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            else:
                self.expected_content_length -= num_bytes
            self.transport.write(body)

        # Handle response completion
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    else:
        # Response already sent
        raise RuntimeError(
            f"Unexpected ASGI message '{message['type']}' sent, after response already"
            " completed."
        )
"""


def test_upstream_send_is_what_cycle_py_copied():
    """uvicorn's RequestResponseCycle.send is still the one polyserve/http/cycle.py copied."""
    upstream = textwrap.dedent(inspect.getsource(RequestResponseCycle.send))
    assert ast.dump(ast.parse(upstream)) == ast.dump(ast.parse(UPSTREAM_SEND)), (
        "uvicorn's RequestResponseCycle.send changed: bring polyserve/http/cycle.py's copy in"
        f" step, then its text here. It is now:\n{upstream}"
    )


def test_upstream_run_asgi_is_what_cycle_py_copied():
    """polyserve/http/cycle.py's run_asgi is uvicorn's RequestResponseCycle.run_asgi but for its
    first statement (the wait at the door)."""
    upstream = textwrap.dedent(inspect.getsource(RequestResponseCycle.run_asgi))
    ours = ast.parse(textwrap.dedent(inspect.getsource(Cycle.run_asgi))).body[0]
    assert isinstance(ours, ast.AsyncFunctionDef) and isinstance(ours.body[0], ast.If)
    ours.body = ours.body[1:]
    assert ast.dump(ours) == ast.dump(ast.parse(upstream).body[0]), (
        "uvicorn's RequestResponseCycle.run_asgi changed: bring polyserve/http/cycle.py's copy in"
        f" step. It is now:\n{upstream}"
    )
