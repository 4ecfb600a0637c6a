"""handle(request) as ASGI: the adapter, and the answers its return values become."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

DEFAULT_THREADS = 8  # POLYSERVE_SPACE_THREADS


class HandleApp:
    """Adapts `handle(request)` to ASGI. A sync handle runs on a worker thread, like
    Starlette's, but under a limiter of its own: a space that blocks all of its threads
    delays its own requests, never another space's or the host's."""

    def __init__(self, handle: Callable[[Request], Any], threads: int = DEFAULT_THREADS) -> None:
        self.handle = handle
        call = getattr(handle, "__call__", None)  # noqa: B004 - async __call__ objects
        self.is_async = inspect.iscoroutinefunction(handle) or inspect.iscoroutinefunction(call)
        self.threads = threads
        # Made on the event loop at the first sync call: the import runs on a thread.
        self.limiter: anyio.CapacityLimiter | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        response = to_response(await self.result(Request(scope, receive, send)))
        await response(scope, receive, send)

    async def result(self, request: Request) -> Any:
        """What handle() returned, not sent yet: dispatch sends the common answers itself
        (Dispatch._call), and to_response() makes a Response of the rest."""
        if self.is_async:
            return await self.handle(request)
        if self.limiter is None:
            self.limiter = anyio.CapacityLimiter(self.threads)
        return await anyio.to_thread.run_sync(self.handle, request, limiter=self.limiter)


def is_plain(response: Response) -> bool:
    """A body in memory and nothing to run after it: sending it runs no tenant code, so
    the request's time and count are settled before it is sent."""
    return type(response).__call__ is Response.__call__ and response.background is None


_ORJSON = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def json_body(result: dict[Any, Any] | list[Any]) -> bytes | None:
    """A dict's or list's JSON, or None where orjson cannot encode it (e.g. an int past 64
    bits, a set): to_response() then gives the stdlib's answer, or its error. orjson is
    much faster than the stdlib's encoder (bench/NOTES.md, figures moved out of code
    comments), writes the same compact UTF-8 for what JSON allows, and encodes numpy
    arrays and scalars (a model's output) as lists and numbers."""
    try:
        return orjson.dumps(result, option=_ORJSON)
    except TypeError:
        return None


def json_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    """The headers Starlette's Response(body, media_type="application/json") sends."""
    return [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]


def to_response(result: Any) -> Response:
    """Starlette's Response as is; dict/list as JSON; str text; bytes octet-stream; None 204."""
    if isinstance(result, Response):
        return result
    if isinstance(result, dict | list):
        body = json_body(result)
        if body is None:
            return JSONResponse(result)
        return Response(body, media_type="application/json")
    if isinstance(result, str):
        return PlainTextResponse(result)
    if isinstance(result, bytes | bytearray | memoryview):
        return Response(bytes(result), media_type="application/octet-stream")
    if result is None:
        return Response(status_code=204)
    return JSONResponse(
        {
            "error": f"handle() returned {type(result).__name__}: return a Response, dict, list,"
            " str, bytes or None"
        },
        status_code=500,
    )
