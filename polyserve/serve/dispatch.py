"""The request path: lease the space's version, meter it, bound its wait, answer errors as JSON."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, cast
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send

from polyserve.errors import ClientError
from polyserve.logs import spacelog
from polyserve.serve import loader
from polyserve.serve.deadlines import Deadlines
from polyserve.serve.spaces import NO_ROOM_RETRY_S, NoRoom, NotDeployed, OtherPool, Registry
from polyserve.usage.meter import Meter

if TYPE_CHECKING:  # the fleet's modules import psycopg: only a fleet host pays for that
    from polyserve.fleet.pools import PoolRouter
    from polyserve.serve import modelspace

log = logging.getLogger("polyserve")


class Dispatch:
    """One worker's request path; `serve` is the ASGI callable for `/s/{owner}/{name}/…`."""

    def __init__(
        self,
        registry: Registry,
        meter: Meter,
        deadlines: Deadlines,
        pools: PoolRouter | None = None,
        max_infer: int = 64 << 20,
    ) -> None:
        self.registry = registry
        self.max_infer = max_infer  # bytes of a model space's infer body
        self.meter = meter
        self.deadlines = deadlines
        self.pools = pools  # in a fleet: where another pool's spaces are served

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request for a space: HostApp has set path_params and extended root_path."""
        params = scope["path_params"]
        space = f"{params['owner']}/{params['name']}"
        started = self.meter.begin()  # busy time includes a cold start's import
        slot: int | None = None  # None: no space answered, so no request is counted
        metered = False

        def count(status: int, billed: bool = True, error: bool | None = None) -> None:
            # A model space's metadata and health reads are answered but not billed, and
            # its refused infers count as errors (`error`); other answers err from 500.
            nonlocal metered
            if not metered:
                metered = True
                failed = status >= 500 if error is None else error
                self.meter.end(slot if billed else None, started, error=failed)

        status = 500  # if anything below raises mid-way
        # The deadline runs from here: a wait for a cold load (its own, or another
        # request's of the same space) is part of the request's time.
        task = self.deadlines.enter()
        try:
            try:
                active = self.registry.lease_current(space) or await self.registry.lease(space)
            except BaseException as exc:
                timed_out = isinstance(exc, asyncio.CancelledError) and self.deadlines.expired(task)
                self.deadlines.leave(task)  # no lease: what is left is the answer why
                if not (timed_out or isinstance(exc, Exception)):
                    raise  # the worker is stopping, or the client's connection is gone
                if isinstance(exc, OtherPool):
                    # Not this host's to run: the request is counted nowhere (slot is None).
                    status = await self._elsewhere(exc, scope, receive, send)
                    return
                slot, status, body, headers = self._refusal(exc, space)
                return await answer(scope, receive, send, status, body, headers)
            slot = active.slot
            try:
                status = await self._call(active.imported, space, scope, receive, send, count, task)
            finally:
                # Counted before the lease ends: once the last lease on a deleted space's
                # version ends, its slot may be handed to another space.
                if not metered:
                    count(status)
                self.registry.end_lease(active)
        finally:
            if not metered:  # a cancelled lease, a client gone: in flight drops all the same
                count(status)

    def _refusal(
        self, exc: BaseException, space: str
    ) -> tuple[int | None, int, dict[str, object], dict[str, str] | None]:
        """What to answer a request that got no version of its space to serve: the slot
        to count it in (None: counted nowhere), the status, the body and the headers."""
        slot = self.registry.slot_of(space)
        if isinstance(exc, asyncio.CancelledError):  # the deadline's: the wait for a load
            # Counted as a request and an error, as a space's own 504 is. The load goes
            # on (lease shields it) and serves the requests after this one.
            error = (
                f"space {space} was not loaded within {self.deadlines.timeout:g} s"
                " (POLYSERVE_REQUEST_TIMEOUT); its load goes on: retry"
            )
            return slot, 504, {"error": error, "space": space}, None
        if isinstance(exc, NotDeployed):
            return None, 404, {"error": f"space {space} is not deployed", "space": space}, None
        if isinstance(exc, NoRoom):
            # This host's space, refused for now: counted as a request and an error, like
            # a failed load, so the usage shows what the cap costs a space.
            retry = {"retry-after": str(NO_ROOM_RETRY_S)}
            return slot, 503, {"error": str(exc), "space": space}, retry
        if isinstance(exc, loader.LoadError):
            body = exc.details
        else:  # a bug of ours, or the data dir changed under us: still JSON
            log.error("loading %s failed", space, exc_info=exc)
            body = {"error": f"space {space} could not be loaded; see the host log"}
        return slot, 500, {**body, "space": space}, None

    async def _elsewhere(self, other: OtherPool, scope: Scope, receive: Receive, send: Send) -> int:
        """Another pool's space: 307 to a live host of that pool, else record the demand
        and answer 503 with Retry-After (also when the fleet's database is away)."""
        assert self.pools is not None, "only a fleet host's registry raises OtherPool"
        space, pool = other.space, other.pool
        body: dict[str, object] = {"space": space, "pool": pool}
        retry = {"retry-after": str(self.pools.retry_after_s)}
        try:
            url = await self.pools.host_of(pool)
            if url is None:
                await self.pools.demand(pool, space)
        except ClientError as exc:  # Unreachable
            await answer(scope, receive, send, 503, {**exc.body(), **body}, retry)
            return 503
        except Exception:  # a bug of ours: still JSON
            log.exception("finding a host of pool %s for %s failed", pool, space)
            error = f"space {space} runs in pool {pool}, and finding a host of it failed"
            await answer(scope, receive, send, 500, {"error": error, **body})
            return 500
        if url is None:
            error = (
                f"space {space} needs pool {pool}, which has no live host: one is being"
                f" started; retry in {self.pools.retry_after_s} s"
            )
            await answer(scope, receive, send, 503, {"error": error, **body}, retry)
            return 503
        location = url.rstrip("/") + _path_and_query(scope)
        message = (
            f"space {space} runs in pool {pool} and this host in pool {other.host_pool}:"
            f" follow Location to a host of pool {pool}"
        )
        body |= {"location": location, "message": message}
        await answer(scope, receive, send, 307, body, {"location": location})
        return 307

    async def _call(
        self,
        imported: loader.Imported,
        space: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        count: Callable[..., None],
        task: asyncio.Task[object],
    ) -> int:
        """Call the space, under the deadline `task` entered; returns the status it
        answered (0 for a websocket)."""
        status = 0

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # The deadline bounds the wait for an answer: a started stream lives on.
                self.deadlines.leave(task)
            elif message["type"] == "websocket.accept":
                self.deadlines.leave(task)
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                # Counted before the last bytes leave: a worker killed after its client
                # has the answer must not have lost the count (counted >= served).
                count(status)
            await send(message)

        kind = imported.kind
        if kind == "app":
            scope["state"] = imported.state.copy()  # lifespan state, shallow-copied per ASGI
        if kind != "model" and "polyserve.route" in scope:
            # An infer at the host's root (polyserve/serve/inference.py) for a space that is
            # not a model: its own app never sees the protocol's path. Not billed.
            self.deadlines.leave(task)
            count(404, billed=False)
            error = f"space {space} is not a model space: it has no inference protocol routes"
            await answer(scope, receive, send, 404, {"error": error, "space": space})
            return 404
        # What the space prints and logs from here (and in the tasks and threads it
        # starts) is its own: one context variable set, the whole cost per request.
        speaking = spacelog.CURRENT.set(imported.log)
        try:
            if kind == "handle" and scope["type"] == "http":
                # handle()'s answer is in hand before a byte is sent: a dict or list,
                # or a plain Response, is counted and sent here, without the wrapped
                # send and HandleApp's layer (bench/NOTES.md, the onnx-tiny path).
                handler = cast(loader.HandleApp, imported.app)  # kind "handle" is one
                result = await handler.result(Request(scope, receive, send))
                answer_type = type(result)
                plain_json = answer_type is dict or answer_type is list  # not subclasses
                body = loader.json_body(result) if plain_json else None
                if body is not None:
                    # The bytes Starlette's Response would send, without building one.
                    status = 200
                    self.deadlines.leave(task)
                    count(status)
                    headers = loader.json_headers(body)
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    await send({"type": "http.response.body", "body": body})
                    return status
                response = loader.to_response(result)
                if loader.is_plain(response):
                    status = response.status_code
                    self.deadlines.leave(task)
                    count(status)  # before the bytes leave, as tracking_send counts
                    await response(scope, receive, send)
                    return status
                await response(scope, receive, tracking_send)
            elif kind == "model" and scope["type"] == "http":
                # The protocol's answer is in hand before a byte is sent, as handle()'s.
                model = cast("modelspace.InferenceApp", imported.app)
                route = scope.get("polyserve.route")
                found = await model.respond(scope, receive, route, self.max_infer)
                status = found.status
                self.deadlines.leave(task)
                count(status, billed=found.billed, error=found.error)
                start = {"type": "http.response.start", "status": status, "headers": found.headers}
                await send(start)
                await send({"type": "http.response.body", "body": found.body})
                return status
            else:
                await imported.app(scope, receive, tracking_send)
        except (Exception, asyncio.CancelledError) as exc:
            timed_out = self.deadlines.expired(task)
            if isinstance(exc, asyncio.CancelledError) and not timed_out:
                raise  # the worker is stopping, or the client's connection is gone
            timeout = self.deadlines.timeout
            where = f"{scope.get('method', 'WEBSOCKET')} {scope['path']}"
            if timed_out:
                message = f"{where} took longer than {timeout:g} s: cancelled"
                imported.log.record(logging.WARNING, "stderr", message, time.time())
            else:
                imported.log.exception(exc, where)
            if status:
                raise  # mid-response: nothing more can be said; the server closes it
            code, error = (
                (
                    504,
                    f"space {space} did not answer within {timeout:g} s"
                    " (POLYSERVE_REQUEST_TIMEOUT)",
                )
                if timed_out
                else (500, f"space {space} raised an exception; see the host log")
            )
            await answer(scope, receive, send, code, {"error": error, "space": space})
            return code
        finally:
            spacelog.CURRENT.reset(speaking)
            self.deadlines.leave(task)
        # An HTTP app that returns without a response gets a 500 from the server.
        return 500 if status == 0 and scope["type"] == "http" else status


def _path_and_query(scope: Scope) -> str:
    """The request's path and query as this host received them, for another host."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if raw else quote(scope["path"])
    query = scope.get("query_string", b"").decode("latin-1")
    return f"{path}?{query}" if query else path


async def answer(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    body: dict[str, object],
    headers: Mapping[str, str] | None = None,
) -> None:
    """A JSON error for HTTP; for a websocket, a close code that says as much."""
    if scope["type"] == "http":
        await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)
    elif scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1011 if status >= 500 else 1008})
