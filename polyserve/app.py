"""The ASGI entry: the control plane under /_polyserve, space dispatch under /s/{owner}/{name}."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import anyio.to_thread
import orjson
from starlette.applications import Starlette
from starlette.datastructures import URL, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from polyserve import hooks, loader, openapi, prometheus
from polyserve import meter as meter_mod
from polyserve import settings as settings_mod
from polyserve.auth import Auth
from polyserve.control import CONTROL_SIGNAL, Control
from polyserve.deadlines import Deadlines
from polyserve.meter import CELLS, Meter
from polyserve.shm import Table
from polyserve.spaces import NotDeployed, Registry
from polyserve.store import Staged, Store, StoreError
from polyserve.validate import validate

log = logging.getLogger("polyserve")
HOST_THREADS = 8  # concurrent imports, stagings and publishes per worker


class _TooLarge(Exception):
    pass


class Host:
    """Everything one worker serves with; the side effects wait for the lifespan startup."""

    def __init__(self, settings: settings_mod.Settings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self.auth = Auth(settings.deploy_token_sha256, settings.tokens_file)
        self.deadlines = Deadlines(settings.request_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        s = self.settings
        self.store = Store(s.data_dir, s.max_spaces)
        # Without the gunicorn master (in-process tests), a private one-row table.
        self.table, row = hooks.inherited() or (Table.anonymous(1, s.max_spaces, CELLS), 0)
        self.control = Control(self.table, row)
        self.meter = Meter(self.table, row)
        # Host work (imports, staging, publishing) gets threads of its own, which no
        # tenant can exhaust: sync handle()s have per-space limiters, and tenants' ASGI
        # apps share anyio's default one.
        self.threads = anyio.CapacityLimiter(HOST_THREADS)
        self.registry = Registry(
            self.store,
            self.control,
            self.meter,
            s.idle_ttl,
            s.import_timeout,
            clock=self.clock,
            space_threads=s.space_threads,
            host_limiter=self.threads,
        )
        # Off the main thread (an in-process test client) there is no signal handler:
        # requests still read the generation word, which alone keeps the contract.
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(CONTROL_SIGNAL, self.registry.refresh)
        # anyio sets up its worker threads lazily (about 19 ms here): pay that at boot,
        # not in the first cold start, whose time and memory are billed to a space.
        await anyio.to_thread.run_sync(lambda: None, limiter=self.threads)
        self.control.publish_pid()
        reaper = asyncio.create_task(self.registry.reaper())
        watchdog = asyncio.create_task(self.deadlines.watch())
        try:
            yield
        finally:
            reaper.cancel()
            watchdog.cancel()
            await self.registry.close()

    # -- the data plane --------------------------------------------------------------

    async def dispatch(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """A request for /s/{owner}/{name}/…: HostApp has already extended root_path."""
        params = scope["path_params"]
        space = f"{params['owner']}/{params['name']}"
        started = self.meter.begin()  # busy time includes a cold start's import
        slot: int | None = None  # None: no space answered, so no request is counted
        metered = False

        def count(status: int) -> None:
            nonlocal metered
            if not metered:
                metered = True
                self.meter.end(slot, started, error=status >= 500)

        status = 500  # if anything below raises mid-way
        try:
            try:
                active = await self.registry.acquire(space)
            except NotDeployed:
                status = 404
                body = {"error": f"space {space} is not deployed", "space": space}
                return await _answer(scope, receive, send, 404, body)
            except Exception as exc:
                slot = self.registry.slot_of(space)
                if isinstance(exc, loader.LoadError):
                    body = {**exc.details, "space": space}
                else:  # a bug of ours, or the data dir changed under us: still JSON
                    log.exception("loading %s failed", space)
                    body = {"error": f"space {space} could not be loaded; see the host log"}
                return await _answer(scope, receive, send, 500, {**body, "space": space})
            slot = active.slot
            try:
                status = await self._run(active.imported, space, scope, receive, send, count)
            finally:
                # Counted before the lease ends: once the last lease on a deleted space's
                # version ends, its slot may be handed to another space.
                count(status)
                self.registry.release(active)
        finally:
            count(status)  # a cancelled acquire, a client gone: in flight drops all the same

    async def _run(
        self,
        imported: loader.Imported,
        space: str,
        scope: dict[str, Any],
        receive: Any,
        send: Any,
        count: Callable[[int], None],
    ) -> int:
        """Call the space; returns the status it answered (0 for a websocket)."""
        status = 0

        async def tracking_send(message: dict[str, Any]) -> None:
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

        if imported.kind == "app":
            scope["state"] = imported.state.copy()  # lifespan state, shallow-copied per ASGI
        timeout = self.settings.request_timeout
        task = self.deadlines.enter()
        try:
            await imported.app(scope, receive, tracking_send)
        except (Exception, asyncio.CancelledError) as exc:
            timed_out = self.deadlines.expired(task)
            if isinstance(exc, asyncio.CancelledError) and not timed_out:
                raise  # the worker is stopping, or the client's connection is gone
            if timed_out:
                log.warning("space %s took longer than %g s: cancelled", space, timeout)
            else:
                log.exception("space %s v%d raised", space, imported.version)
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
            await _answer(scope, receive, send, code, {"error": error, "space": space})
            return code
        finally:
            self.deadlines.leave(task)
        # An HTTP app that returns without a response gets a 500 from the server.
        return 500 if status == 0 and scope["type"] == "http" else status

    # -- the control plane ---------------------------------------------------------------

    async def deploy(self, request: Request) -> Response:
        who = self._writer(request)  # before the body is read
        limit = self.settings.max_upload_mb << 20
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        request = Request(request.scope, _limited(request.receive, limit))
        try:
            async with request.form(max_files=1, max_fields=2) as form:
                space, module = form.get("space"), form.get("module")
                if not isinstance(space, str) or not space:
                    raise StoreError(422, "missing form field `space` (owner/name)")
                self.auth.allow(who, space)
                if not isinstance(module, UploadFile):
                    raise StoreError(
                        422,
                        "missing file field `module`: send -F module=@file.py"
                        " or -F module=@space.tar",
                    )
                staged = await anyio.to_thread.run_sync(
                    self.store.stage,
                    module.file,
                    module.filename or "",
                    self.settings.max_unpacked_mb << 20,
                    limiter=self.threads,
                )
        except _TooLarge:
            raise _too_large(limit) from None
        try:
            checked = await validate(
                staged.dir,
                staged.entry,
                self.settings.import_timeout,
                self.settings.import_memory_mb,
                env=settings_mod.scrubbed_environ(),
            )
            number = await anyio.to_thread.run_sync(
                self._publish, space, staged, checked, limiter=self.threads
            )
        finally:
            self.store.discard(staged)  # after a publish the directory has moved: a no-op
        self._announce()
        return JSONResponse(
            {
                "space": space,
                "version": number,
                "sha256": staged.sha256,
                "size": staged.size,
                "entry": staged.entry,
                **checked,
            }
        )

    def _publish(self, space: str, staged: Staged, checked: dict[str, object]) -> int:
        with self.store.locked():
            slot, number = self.store.publish(
                space, staged, checked, reclaim=partial(meter_mod.reclaimable, self.table)
            )
            self.control.bump(slot)
            self.store.prune(space, self.control.oldest_held(slot))
        return number

    async def delete(self, request: Request) -> Response:
        space, _ = await self._change(request, self._undeploy)
        return JSONResponse({"space": space, "deleted": True})

    async def release(self, request: Request) -> Response:
        """What the idle reaper does, now and in every worker: the next request imports
        the space afresh (for operators, and for cold-start benchmarks)."""
        space, signalled = await self._change(request, self._release)
        return JSONResponse({"space": space, "released": True, "workers_signalled": signalled})

    async def _change(self, request: Request, change: Callable[[str], bool]) -> tuple[str, int]:
        """An authorized write to a deployed space under the store lock, then announced."""
        space = f"{request.path_params['owner']}/{request.path_params['name']}"
        self.auth.allow(self._writer(request), space)

        def locked() -> bool:
            with self.store.locked():
                return change(space)

        if not await anyio.to_thread.run_sync(locked, limiter=self.threads):
            raise StoreError(404, f"space {space} is not deployed", space=space)
        return space, self._announce()

    def _announce(self) -> int:
        """After a change: signal the other workers, and refresh this one. Every request
        reads the generation word, so the contract already holds; the signal only makes
        workers act before their next request. Returns how many were signalled."""
        signalled = self.control.announce()
        self.registry.refresh()
        return signalled

    def _undeploy(self, space: str) -> bool:
        slot = self.store.delete(space)
        if slot is not None:
            self.control.bump(slot)
            self.store.prune(space, self.control.oldest_held(slot))
        return slot is not None

    def _release(self, space: str) -> bool:
        if self.store.current(space) is None:
            return False
        self.control.request_release(self.store.slot(space))
        return True

    def _writer(self, request: Request) -> str:
        client = request.client.host if request.client else None
        return self.auth.identify(request.headers.get("authorization"), client)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi.SPEC)

    async def list_spaces(self, request: Request) -> Response:
        spaces = await anyio.to_thread.run_sync(self.store.spaces, limiter=self.threads)
        return JSONResponse({"spaces": spaces})

    async def usage(self, request: Request) -> Response:
        # orjson: with 10,000 spaces the stdlib's encoder took 19 ms of the answer, orjson 2.
        return Response(orjson.dumps(self._usage()), media_type="application/json")

    def _usage(self) -> dict[str, Any]:
        return meter_mod.usage(self.table, self.store.ledger(), meter_mod.now_us())

    async def metrics(self, request: Request) -> Response:
        return Response(prometheus.exposition(self._usage()), media_type=prometheus.CONTENT_TYPE)

    async def health(self, request: Request) -> Response:
        """This worker: its pid and the version of each space it holds."""
        loaded = {space: a.version.number for space, a in self.registry.active.items()}
        return JSONResponse({"ok": True, "pid": os.getpid(), "loaded": loaded})


def _limited(receive: Any, limit: int) -> Any:
    """Count body bytes as they stream in, so a chunked upload stops at the cap."""
    seen = 0

    async def limited_receive() -> dict[str, Any]:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise _TooLarge()
        return message

    return limited_receive


def _too_large(limit: int) -> StoreError:
    return StoreError(413, f"upload is larger than {limit >> 20} MiB (POLYSERVE_MAX_UPLOAD_MB)")


async def _answer(
    scope: dict[str, Any], receive: Any, send: Any, status: int, body: dict[str, object]
) -> None:
    if scope["type"] == "http":
        await JSONResponse(body, status_code=status)(scope, receive, send)
    elif scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1011 if status >= 500 else 1008})


async def _store_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StoreError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


_SPACE_PATH = re.compile(r"/s/([^/]+)/([^/]+)(/.*)?", re.DOTALL)


class HostApp:
    """The ASGI entry's two faces. `/s/{owner}/{name}/…` goes straight to the space, with
    the scope Starlette's Mount would give it (path kept, root_path extended, owner and
    name as path_params); everything else — the control plane, lifespan, 404s — goes to
    a Starlette app. Measured: Starlette's middleware and router in front of every space
    request cost about 12 µs, a third of a tiny model's whole answer."""

    def __init__(self, host: Host, control: Starlette) -> None:
        self.host = host
        self.control = control
        self.state = control.state
        self._dispatch: Any = host.dispatch

    def trust_forwarded(self, trusted_hosts: list[str] | str) -> None:
        """Give spaces the client that X-Forwarded-For names, from these proxies only.
        The worker calls this instead of letting uvicorn rewrite every scope, so the
        control plane always sees the socket's peer: its loopback trust must never
        follow a header."""
        self._dispatch = ProxyHeadersMiddleware(self.host.dispatch, trusted_hosts)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            root, path = scope.get("root_path", ""), scope["path"]
            match = _SPACE_PATH.fullmatch(path[len(root) :] if path.startswith(root) else path)
            if match:
                owner, name, rest = match.groups()
                if rest is None:  # /s/owner/name: on to its root, as Starlette's router does
                    return await _answer_redirect(scope, receive, send)
                scope["path_params"] = {"owner": owner, "name": name}
                scope["root_path"] = f"{root}/s/{owner}/{name}"
                return await self._dispatch(scope, receive, send)
        await self.control(scope, receive, send)


async def _answer_redirect(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        url = URL(scope=scope)
        await RedirectResponse(url.replace(path=url.path + "/"))(scope, receive, send)
    else:
        await send({"type": "websocket.close", "code": 1008})


def create_app(
    settings: settings_mod.Settings | None = None, clock: Callable[[], float] = time.monotonic
) -> HostApp:
    host = Host(settings or settings_mod.load(), clock)
    routes = [
        Route("/_polyserve/deploy", host.deploy, methods=["POST"]),
        Route("/_polyserve/spaces", host.list_spaces, methods=["GET"]),
        Route("/_polyserve/spaces/{owner}/{name}", host.delete, methods=["DELETE"]),
        Route("/_polyserve/spaces/{owner}/{name}/release", host.release, methods=["POST"]),
        Route("/_polyserve/usage", host.usage, methods=["GET"]),
        Route("/_polyserve/health", host.health, methods=["GET"]),
        Route("/metrics", host.metrics, methods=["GET"]),
        Route("/_polyserve/openapi.json", host.openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=host.lifespan,
        exception_handlers={StoreError: _store_error, HTTPException: _http_error},
    )
    app.state.host = host
    return HostApp(host, app)


app = create_app()
