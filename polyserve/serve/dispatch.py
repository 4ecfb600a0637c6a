"""The request path: lease the space's version, meter it, bound its wait, answer errors as JSON."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from polyserve.logs import spacelog
from polyserve.serve import answers, loader
from polyserve.serve.deadlines import Deadlines
from polyserve.serve.gate import PUBLIC, Gate, Refused
from polyserve.serve.refusals import answer, elsewhere, refusal
from polyserve.serve.registry import OtherPool, Registry
from polyserve.serve.split import Split
from polyserve.usage.meter import Meter

if TYPE_CHECKING:  # the fleet's modules import psycopg: only a fleet host pays for that
    from polyserve.fleet.pools import PoolRouter

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
        gate: Gate | None = None,
        split: Split | None = None,
    ) -> None:
        self.registry = registry
        self.split = split  # None: no rollouts (in-process tests of dispatch alone)
        self.gate = gate  # None: every space is public (in-process tests of dispatch alone)
        self.max_infer = max_infer  # bytes of a model space's infer body
        self.meter = meter
        self.deadlines = deadlines
        self.pools = pools  # in a fleet: where another pool's spaces are served

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request for a space: HostApp has set path_params and extended root_path."""
        params = scope["path_params"]
        space = f"{params['owner']}/{params['name']}"
        version = params.get("version")  # `@N` in the URL: kept version N, by name
        # The key check comes first: a refused request is counted nowhere, loads nothing.
        key = PUBLIC
        if self.gate is not None:
            try:
                key = self.gate.check(space, scope["headers"])
            except Refused as no:
                return await answer(scope, receive, send, no.status, no.body, no.headers)
        started = self.meter.begin()  # busy time includes a cold start's import
        slot: int | None = None  # None: no space answered, so no request is counted
        metered = False
        lane = False  # to a rollout's new version (its choice, or by name): in the lane too

        def count(status: int, billed: bool = True, error: bool | None = None) -> None:
            # A model space's metadata and health reads are answered but not billed, and
            # its refused infers count as errors (`error`); other answers err from 500.
            nonlocal metered
            if not metered:
                metered = True
                failed = status >= 500 if error is None else error
                took = self.meter.end(slot if billed else None, started, error=failed)
                if lane and billed and slot is not None:
                    self.meter.lane(slot, failed, took)
                if key != PUBLIC and billed and slot is not None:
                    self.meter.keyed(slot, key)

        status = 500  # if anything below raises mid-way
        # The deadline runs from here: a wait for a cold load (its own, or another
        # request's of the same space) is part of the request's time.
        task = self.deadlines.enter()
        try:
            try:
                if version is None:
                    active = self.registry.lease_current(space) or await self.registry.lease(space)
                    split = self.split
                    # One word read when no rollout runs: the rest only while one does.
                    if split is not None and split.words[active.slot]:
                        chosen = split.choose(active.slot, space, scope["headers"])
                    else:
                        chosen = 0
                    if chosen and chosen != active.version.number:
                        # A rollout's choice: the only way two versions serve plain requests.
                        self.registry.end_lease(active)
                        version, lane = str(chosen), True
                        active = self.registry.lease_named(space, version) or (
                            await self.registry.lease_version(space, version)
                        )
                else:
                    active = self.registry.lease_named(space, version) or (
                        await self.registry.lease_version(space, version)
                    )
                    split = self.split
                    # By name, a live rollout's new version is metered as its split's
                    # requests are: in the lane (docs/rollouts.md, "What is labelled").
                    if split is not None and split.words[active.slot]:
                        lane = split.new_version(active.slot) == active.version.number
            except BaseException as exc:
                timed_out = isinstance(exc, asyncio.CancelledError) and self.deadlines.expired(task)
                self.deadlines.leave(task)  # no lease: what is left is the answer why
                if not (timed_out or isinstance(exc, Exception)):
                    raise  # the worker is stopping, or the client's connection is gone
                if isinstance(exc, OtherPool):
                    # Not this host's to run: the request is counted nowhere (slot is None).
                    assert self.pools is not None, "only a fleet host's registry raises OtherPool"
                    status = await elsewhere(self.pools, exc, scope, receive, send)
                    return
                known = self.registry.slot_of(space)
                slot, status, body, headers = refusal(exc, space, known, self.deadlines.timeout)
                return await answer(scope, receive, send, status, body, headers)
            slot = active.slot
            try:
                status = await self._call(
                    active.imported, space, scope, receive, send, count, task, (slot, started)
                )
            finally:
                # Counted before the lease ends: once the last lease on a deleted space's
                # version ends, its slot may be handed to another space.
                if not metered:
                    count(status)
                batched = active.imported.log.batched
                if batched.batches:  # the runs its batchers made meanwhile, whoever waited
                    self.meter.batched(slot, batched)
                self.registry.end_lease(active)
        finally:
            if not metered:  # a cancelled lease, a client gone: in flight drops all the same
                count(status)

    async def _call(
        self,
        imported: loader.Imported,
        space: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        count: Callable[..., None],
        task: asyncio.Task[object],
        metered: tuple[int, int],
    ) -> int:
        """Call the space, under the deadline `task` entered; returns the status it
        answered (0 for a websocket). `metered` is the space's slot and the meter's
        begin() of the request."""
        status = 0
        # A stream's time to its first body bytes: an answer is a stream once a body
        # message says more follows; the first with bytes (or the last) is timed.
        first_byte, streamed = True, False

        async def tracking_send(message: Message) -> None:
            nonlocal status, first_byte, streamed
            kind = message["type"]
            if kind == "http.response.body":
                more = message.get("more_body", False)
                if first_byte:
                    streamed = streamed or more
                    if message.get("body") or not more:
                        first_byte = False
                        if streamed:
                            self.meter.first_byte(*metered)
                if not more:
                    # Counted before the last bytes leave: a worker killed after its
                    # client has the answer must not have lost the count (counted >=
                    # served).
                    count(status)
            elif kind == "http.response.start":
                status = message["status"]
                # The deadline bounds the wait for an answer: a started stream lives on.
                self.deadlines.leave(task)
            elif kind == "websocket.accept":
                self.deadlines.leave(task)
            await send(message)

        if imported.kind == "app":
            scope["state"] = imported.state.copy()  # lifespan state, shallow-copied per ASGI
        if imported.secrets:  # the space's own, read at its load (docs/secrets.md)
            scope["polyserve.secrets"] = imported.secrets
        if imported.kind != "model" and "polyserve.route" in scope:
            # An infer at the host's root (polyserve/serve/inference.py) for a space that is
            # not a model: its own app never sees the protocol's path. Not billed.
            self.deadlines.leave(task)
            count(404, billed=False)
            error = f"space {space} is not a model space: it has no inference protocol routes"
            await answer(scope, receive, send, 404, {"error": error, "space": space})
            return 404
        # What the space prints and logs from here (and in the tasks and threads it
        # starts) is its own: one context variable set, the whole cost per request.
        speaking = spacelog.RUNNING.set(imported.log)
        try:
            if imported.kind == "handle" and scope["type"] == "http":
                # handle()'s answer is in hand before a byte is sent: a dict or list,
                # or a plain Response, is counted and sent here, without the wrapped
                # send and HandleApp's layer (bench/NOTES.md, the onnx-tiny path).
                result = await imported.app.result(Request(scope, receive, send))
                answer_type = type(result)
                plain_json = answer_type is dict or answer_type is list  # not subclasses
                body = answers.json_body(result) if plain_json else None
                if body is not None:
                    # The bytes Starlette's Response would send, without building one.
                    status = 200
                    self.deadlines.leave(task)
                    count(status)
                    headers = answers.json_headers(body)
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    await send({"type": "http.response.body", "body": body})
                    return status
                response = answers.to_response(result)
                if answers.is_plain(response):
                    status = response.status_code
                    self.deadlines.leave(task)
                    count(status)  # before the bytes leave, as tracking_send counts
                    await response(scope, receive, send)
                    return status
                await response(scope, receive, tracking_send)
            elif imported.kind == "model" and scope["type"] == "http":
                # The protocol's answer is in hand before a byte is sent, as handle()'s.
                route = scope.get("polyserve.route")
                found = await imported.app.respond(scope, receive, route, self.max_infer)
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
            spacelog.RUNNING.reset(speaking)
            self.deadlines.leave(task)
        # An HTTP app that returns without a response gets a 500 from the server.
        return 500 if status == 0 and scope["type"] == "http" else status
