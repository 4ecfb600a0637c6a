"""The ASGI entry: space requests straight to dispatch, everything else to the control plane."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import anyio
import anyio.to_thread
import orjson
from starlette.applications import Starlette
from starlette.datastructures import URL, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from polyserve import settings as settings_mod
from polyserve.control import dashboard, openapi
from polyserve.control.auth import Auth
from polyserve.deploy.deploys import Deploys, rollback_request
from polyserve.errors import ClientError
from polyserve.logs import spacelog
from polyserve.logs.logstore import LogStore
from polyserve.serve import warmup
from polyserve.serve.deadlines import Deadlines
from polyserve.serve.dispatch import Dispatch, answer
from polyserve.serve.inference import InferenceRoutes
from polyserve.serve.spaces import Registry
from polyserve.state import handoff
from polyserve.state.broadcast import SIGNAL, Broadcast
from polyserve.state.shm import Table
from polyserve.state.store import Store
from polyserve.usage import meter, prometheus
from polyserve.usage.mapped import mapped_by_space
from polyserve.usage.meter import CELLS, Meter

if TYPE_CHECKING:
    from polyserve.fleet.client import FleetClient

HOST_THREADS = 8  # concurrent imports, stagings and publishes per worker


@dataclass
class Host:
    """Everything one worker serves with, built in one place: `running_host`."""

    settings: settings_mod.Settings
    store: Store
    table: Table
    broadcast: Broadcast
    registry: Registry
    dispatch: Dispatch
    deploys: Deploys
    logs: LogStore


@contextlib.asynccontextmanager
async def running_host(
    settings: settings_mod.Settings, clock: Callable[[], float]
) -> AsyncIterator[Host]:
    """A worker's objects and background tasks, from its lifespan startup to shutdown."""
    s = settings
    store = Store(s.data_dir, s.max_spaces, s.keep_versions)
    # Without the gunicorn master (in-process tests), a private one-row table.
    inherited = handoff.received()
    if inherited is not None:
        table, row = inherited.table, inherited.row
    else:
        table, row = Table.anonymous(1, s.max_spaces, CELLS), 0
    logs = LogStore(store.logs_dir, s.log_kb << 10)
    # Host work (imports, staging, publishing) gets threads of its own, which no tenant
    # can exhaust: sync handle()s have per-space limiters, and tenants' ASGI apps share
    # anyio's default one.
    threads = anyio.CapacityLimiter(HOST_THREADS)
    # anyio sets up its worker threads lazily: pay that at boot, not in the first cold
    # start, whose time and memory are billed to a space (BENCHMARKS.md, cold start).
    # A worker warms there what that load would pay for (warmup.in_worker), before the
    # capture: the space it imports has no log.
    if inherited is not None:
        await anyio.to_thread.run_sync(warmup.in_worker, s.preload, limiter=threads)
    else:
        await anyio.to_thread.run_sync(lambda: None, limiter=threads)
    # What spaces print and log, from a worker only: the capture replaces this process's
    # sys.stdout, sys.stderr and a root handler, which in-process tests' runners own.
    capture = spacelog.install(logs, s.log_rate) if inherited is not None else None
    broadcast, usage = Broadcast(table, row), Meter(table, row)
    fleet = pools = None
    if s.database_url:  # imported here: psycopg takes ~0.2 s to import, a fleet host's alone
        from polyserve.fleet.client import FleetClient
        from polyserve.fleet.pools import PoolRouter

        fleet = FleetClient(s, store)  # its database calls on threads of its own
        pools = PoolRouter(fleet.db, s.fleet_live_s, s.pool_retry_after_s, fleet.threads)
    registry = Registry(
        store,
        broadcast,
        usage,
        s.idle_ttl,
        s.import_timeout,
        clock=clock,
        space_threads=s.space_threads,
        host_limiter=threads,
        fetch=fleet.fetch if fleet is not None else None,
        # Pools apply only in a fleet: a single host serves every space it is given.
        pool=s.pool if fleet is not None else None,
        memory_cap=s.worker_memory_mb << 20,
    )
    deadlines = Deadlines(s.request_timeout)
    host = Host(
        settings=s,
        store=store,
        table=table,
        broadcast=broadcast,
        registry=registry,
        dispatch=Dispatch(registry, usage, deadlines, pools, s.max_infer_mb << 20),
        deploys=Deploys(
            s,
            store,
            broadcast,
            table,
            threads,
            registry.refresh,
            fleet,
            registry.floor,
            forkserver=inherited.forkserver if inherited is not None else None,
        ),
        logs=logs,
    )
    # Off the main thread (an in-process test client) there is no signal handler:
    # requests still read the generation word, which alone keeps the contract.
    with contextlib.suppress(RuntimeError, ValueError):
        asyncio.get_running_loop().add_signal_handler(SIGNAL, registry.refresh)
    broadcast.publish_pid()
    background = [
        asyncio.create_task(registry.reaper()),
        asyncio.create_task(deadlines.watch()),
    ]
    try:
        yield host
    finally:
        for task in background:
            task.cancel()
        await registry.close()
        if fleet is not None:
            fleet.db.close()
        if capture is not None:  # last: the spaces' lifespan shutdowns above may log
            spacelog.uninstall(capture)


class ControlPlane:
    """The HTTP handlers under /_polyserve: each checks who asks and what was sent, then
    calls the host's deploys, store or meter."""

    def __init__(self, settings: settings_mod.Settings) -> None:
        self.settings = settings
        self.auth = Auth(settings.deploy_token_sha256, settings.tokens_file)
        self.host: Host | None = None  # set for the worker's life by HostApp's lifespan

    def routes(self) -> list[Route]:
        return [
            Route("/_polyserve/deploy", self.deploy, methods=["POST"]),
            Route("/_polyserve/spaces", self.list_spaces, methods=["GET"]),
            Route("/_polyserve/spaces/{owner}/{name}", self.delete, methods=["DELETE"]),
            Route("/_polyserve/spaces/{owner}/{name}/release", self.release, methods=["POST"]),
            Route("/_polyserve/spaces/{owner}/{name}/versions", self.versions, methods=["GET"]),
            Route("/_polyserve/spaces/{owner}/{name}/rollback", self.rollback, methods=["POST"]),
            Route("/_polyserve/spaces/{owner}/{name}/logs", self.logs, methods=["GET"]),
            Route("/_polyserve/", self.dashboard, methods=["GET"]),
            Route("/_polyserve/usage", self.usage, methods=["GET"]),
            Route("/_polyserve/health", self.health, methods=["GET"]),
            Route("/_polyserve/fleet", self.fleet, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/_polyserve/openapi.json", self.openapi, methods=["GET"]),
        ]

    @property
    def running(self) -> Host:
        assert self.host is not None, "the control plane answers only after its lifespan"
        return self.host

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
                    raise ClientError(422, "missing form field `space` (owner/name)")
                self.auth.allow(who, space)
                if not isinstance(module, UploadFile):
                    raise ClientError(
                        422,
                        "missing file field `module`: send -F module=@file.py"
                        " or -F module=@space.tar",
                    )
                status, body = await self.running.deploys.deploy(
                    space, module.file, module.filename or ""
                )
        except _TooLarge:
            raise _too_large(limit) from None
        return JSONResponse(body, status_code=status)

    async def delete(self, request: Request) -> Response:
        space = self._space_to_write(request)
        status, body = await self.running.deploys.undeploy(space)
        return JSONResponse({"space": space, "deleted": True, **body}, status_code=status)

    async def release(self, request: Request) -> Response:
        """Release a space in every worker now, as the idle reaper would (for operators,
        and for cold-start benchmarks)."""
        space = self._space_to_write(request)
        status, body = await self.running.deploys.release(space)
        return JSONResponse({"space": space, "released": True, **body}, status_code=status)

    async def versions(self, request: Request) -> Response:
        """A space's kept versions and its history (a read: open, like usage)."""
        space = f"{request.path_params['owner']}/{request.path_params['name']}"
        return JSONResponse(await self.running.deploys.versions(space))

    async def rollback(self, request: Request) -> Response:
        """Make a kept version current again: the body is nothing or {"version": N}."""
        space = self._space_to_write(request)  # before the body is read
        try:
            body = await Request(request.scope, _limited(request.receive, 1 << 16)).body()
        except _TooLarge:
            raise ClientError(413, 'a rollback\'s body is {"version": N}, or nothing') from None
        status, answer = await self.running.deploys.rollback(space, rollback_request(body))
        return JSONResponse(answer, status_code=status)

    async def logs(self, request: Request) -> Response:
        """A space's recent records from every worker, oldest first; `since` is the
        `next` of an earlier answer. A space's logs may say what its code and its
        callers hold, so reading them takes the right to deploy it."""
        space = self._space_to_write(request)
        since = _cursor(request.query_params.get("since", "0"))
        host = self.running

        def read() -> tuple[list[dict[str, object]], int] | None:
            if host.store.current(space) is None:
                return None
            return host.logs.read(space, since)

        found = await anyio.to_thread.run_sync(read, limiter=host.deploys.threads)
        if found is None:
            raise ClientError(404, f"space {space} is not deployed", space=space)
        records, after = found
        return Response(
            orjson.dumps({"records": records, "next": after}), media_type="application/json"
        )

    async def dashboard(self, request: Request) -> Response:
        return dashboard.response()

    def _space_to_write(self, request: Request) -> str:
        space = f"{request.path_params['owner']}/{request.path_params['name']}"
        self.auth.allow(self._writer(request), space)
        return space

    def _writer(self, request: Request) -> str:
        # The socket's peer: HostApp keeps X-Forwarded-For away from the control plane.
        client = request.client.host if request.client else None
        return self.auth.identify(request.headers.get("authorization"), client)

    async def list_spaces(self, request: Request) -> Response:
        host = self.running
        spaces = await anyio.to_thread.run_sync(host.store.spaces, limiter=host.deploys.threads)
        return JSONResponse({"spaces": spaces})

    async def usage(self, request: Request) -> Response:
        scope = request.query_params.get("scope", "host")
        if scope == "fleet":
            answer = await self._fleet().usage()
        elif scope == "host" and request.query_params.get("only") == "host":
            # The autoscaler's scrape: the host's totals, without 10,000 spaces.
            answer = {"host": meter.host_usage(self._snapshot())}
        elif scope == "host":
            answer = meter.usage(self._snapshot())
            spaces = cast(dict[str, dict[str, object]], answer["spaces"])
            for row in spaces.values():  # cheaper than a lookup per space at 10,000 of them
                row["mapped_kib"] = 0
            for name, size in (await self._mapped()).items():
                if name in spaces:
                    spaces[name]["mapped_kib"] = size // 1024
        else:
            raise ClientError(400, "scope must be `host` (the default) or `fleet`")
        # orjson: the stdlib's encoder was most of the answer at 10,000 spaces.
        return Response(orjson.dumps(answer), media_type="application/json")

    async def _mapped(self) -> dict[str, int]:
        """Bytes of each space's version files the workers map (model weights through
        polyserve.models), counted once for the host (polyserve/usage/mapped.py)."""
        host = self.running
        pids = [pid for pid in host.table.pids.tolist() if pid]
        # On a host thread: reading every worker's maps is a few system calls each.
        return await anyio.to_thread.run_sync(
            mapped_by_space, host.store.spaces_dir, pids, limiter=host.deploys.threads
        )

    async def fleet(self, request: Request) -> Response:
        """The fleet's hosts: live or not, and the last change each has applied."""
        return JSONResponse(await self._fleet().view())

    def _fleet(self) -> FleetClient:
        fleet = self.running.deploys.fleet
        if fleet is None:
            raise ClientError(404, "this host is not in a fleet: set POLYSERVE_DATABASE_URL")
        return fleet

    async def metrics(self, request: Request) -> Response:
        fleet = self.running.deploys.fleet
        lag = None
        if fleet is not None:
            # Unreachable (a 503 ClientError): the lag is unknown, the rest is not.
            with contextlib.suppress(ClientError):
                lag = await fleet.lag()
        body = prometheus.exposition(self._snapshot(), lag, await self._mapped())
        return Response(body, media_type=prometheus.CONTENT_TYPE)

    def _snapshot(self) -> meter.Snapshot:
        host = self.running
        return meter.snapshot(host.table, host.store.slots.ledger(), meter.now_us())

    async def health(self, request: Request) -> Response:
        """This worker: its pid and the version of each space it holds."""
        active = self.running.registry.active
        loaded = {space: a.version.number for space, a in active.items()}
        return JSONResponse({"ok": True, "pid": os.getpid(), "loaded": loaded})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi.SPEC)


class _TooLarge(Exception):
    pass


_CURSOR = re.compile(r"[0-9]{1,18}")


def _cursor(text: str) -> int:
    if not _CURSOR.fullmatch(text):
        raise ClientError(
            422, "since must be a whole number of at least 0: the `next` of an earlier answer"
        )
    return int(text)


def _limited(receive: Receive, limit: int) -> Receive:
    """Count body bytes as they stream in, so a chunked upload stops at the cap."""
    seen = 0

    async def limited_receive() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise _TooLarge()
        return message

    return limited_receive


def _too_large(limit: int) -> ClientError:
    return ClientError(413, f"upload is larger than {limit >> 20} MiB (POLYSERVE_MAX_UPLOAD_MB)")


async def _client_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ClientError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": "internal error; see the host log"}, status_code=500)


class HostApp:
    """The ASGI entry's two faces. `/s/{owner}/{name}/…` goes straight to the space, with
    the scope Starlette's Mount would give it (path kept, root_path extended, owner and
    name as path_params); everything else — the control plane, lifespan, 404s — goes to
    a Starlette app. Starlette's router in front of every space request would cost a
    tiny model a large share of its answer (BENCHMARKS.md, dispatch overhead)."""

    def __init__(self, settings: settings_mod.Settings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self.control = ControlPlane(settings)
        self.control_app = Starlette(
            routes=self.control.routes(),
            lifespan=self._lifespan,
            exception_handlers={
                ClientError: _client_error,
                HTTPException: _http_error,
                Exception: _server_error,  # a bug of ours: still JSON (and in the log)
            },
        )
        self._trusted: list[str] | str | None = None
        self._dispatch: ASGIApp = _not_started
        self.inference = InferenceRoutes(self.control, lambda: self._dispatch)

    def trust_forwarded(self, trusted_hosts: list[str] | str) -> None:
        """Give spaces the client that X-Forwarded-For names, from these proxies only.
        The worker calls this instead of letting uvicorn rewrite every scope, so the
        control plane always sees the socket's peer: its loopback trust must never
        follow a header."""
        self._trusted = trusted_hosts

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with running_host(self.settings, self.clock) as host:
            serve: ASGIApp = host.dispatch.serve
            if self._trusted is not None:
                # uvicorn types its middleware with its own, narrower scope types.
                serve = ProxyHeadersMiddleware(serve, self._trusted)  # type: ignore[arg-type,assignment]
            self.control.host, self._dispatch = host, serve
            try:
                yield
            finally:
                self.control.host, self._dispatch = None, _not_started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            root, path = scope.get("root_path", ""), scope["path"]
            if root and path.startswith(root):
                path = path[len(root) :]
            # /s/{owner}/{name}/…, both non-empty; string methods, not a regex: this runs
            # for every request and a match cost several times a split.
            if path.startswith("/s/"):
                parts = path.split("/", 4)  # "", "s", owner, name[, the rest]
                if len(parts) > 3 and parts[2] and parts[3]:
                    owner, name = parts[2], parts[3]
                    if len(parts) == 4:  # /s/owner/name: on to its root, as Starlette's does
                        return await _answer_redirect(scope, receive, send)
                    scope["path_params"] = {"owner": owner, "name": name}
                    scope["root_path"] = f"{root}/s/{owner}/{name}"
                    return await self._dispatch(scope, receive, send)
            elif path == "/v2" or path.startswith("/v2/"):  # the inference protocol
                if self.control.host is None:
                    return await _not_started(scope, receive, send)
                return await self.inference(scope, receive, send, path)
        await self.control_app(scope, receive, send)


async def _not_started(scope: Scope, receive: Receive, send: Send) -> None:
    error = "this worker has not started yet (ASGI lifespan): retry"
    await answer(scope, receive, send, 503, {"error": error})


async def _answer_redirect(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "http":
        url = URL(scope=scope)
        await RedirectResponse(url.replace(path=url.path + "/"))(scope, receive, send)
    else:
        await send({"type": "websocket.close", "code": 1008})


def create_app(
    settings: settings_mod.Settings | None = None, clock: Callable[[], float] = time.monotonic
) -> HostApp:
    return HostApp(settings or settings_mod.load(), clock)


app = create_app()
