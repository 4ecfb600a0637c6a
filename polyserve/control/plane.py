"""The control plane's HTTP handlers under /_polyserve: who asks, what was sent, then one call.

Each handler checks the caller (polyserve/control/auth.py) and the request, then calls
the worker's deploys, store, logs or usage answer (polyserve/host.py builds them); none
holds logic of its own beyond reading the request and shaping the answer.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import anyio
import anyio.to_thread
import orjson
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Lifespan, Message, Receive

from polyserve import settings as settings_mod
from polyserve.control import dashboard, openapi
from polyserve.control.auth import Auth
from polyserve.deploy.deploys import rollback_request
from polyserve.errors import ClientError
from polyserve.host import Host
from polyserve.state import access, rollouts
from polyserve.state import secrets as secret_files
from polyserve.state.shm import H_FOLLOWED
from polyserve.usage import prometheus
from polyserve.usage.answer import Only
from polyserve.usage.meter import now_us

if TYPE_CHECKING:
    from polyserve.fleet.changes import Change
    from polyserve.fleet.client import FleetClient

_T = TypeVar("_T")


class ControlPlane:
    """The HTTP handlers under /_polyserve: each checks who asks and what was sent, then
    calls the host's deploys, store or usage answer."""

    def __init__(self, settings: settings_mod.Settings) -> None:
        self.settings = settings
        self.auth = Auth(settings.deploy_token_sha256, settings.tokens_file)
        self.host: Host | None = None  # set for the worker's life by HostApp's lifespan

    def app(self, lifespan: Lifespan[Starlette]) -> Starlette:
        """The Starlette app that serves these routes, with JSON error bodies."""
        return Starlette(
            routes=self.routes(),
            lifespan=lifespan,
            exception_handlers={
                ClientError: _client_error,
                HTTPException: _http_error,
                Exception: _server_error,  # a bug of ours: still JSON (and in the log)
            },
        )

    def routes(self) -> list[Route]:
        return [
            Route("/_polyserve/deploy", self.deploy, methods=["POST"]),
            Route("/_polyserve/spaces", self.list_spaces, methods=["GET"]),
            Route("/_polyserve/spaces/{owner}/{name}", self.delete, methods=["DELETE"]),
            Route("/_polyserve/spaces/{owner}/{name}/release", self.release, methods=["POST"]),
            Route("/_polyserve/spaces/{owner}/{name}/versions", self.versions, methods=["GET"]),
            Route("/_polyserve/spaces/{owner}/{name}/rollback", self.rollback, methods=["POST"]),
            Route(
                "/_polyserve/spaces/{owner}/{name}/rollout", self.rollout, methods=["GET", "POST"]
            ),
            Route(
                "/_polyserve/spaces/{owner}/{name}/rollout/{action}",
                self.rollout_action,
                methods=["POST"],
            ),
            Route("/_polyserve/spaces/{owner}/{name}/logs", self.logs, methods=["GET"]),
            Route("/_polyserve/spaces/{owner}/{name}/keys", self.keys, methods=["GET", "POST"]),
            Route(
                "/_polyserve/spaces/{owner}/{name}/keys/{key_id}",
                self.revoke_key,
                methods=["DELETE"],
            ),
            Route("/_polyserve/spaces/{owner}/{name}/access", self.access, methods=["PUT"]),
            Route("/_polyserve/spaces/{owner}/{name}/secrets", self.secrets, methods=["GET"]),
            Route(
                "/_polyserve/spaces/{owner}/{name}/secrets/{secret}",
                self.secret,
                methods=["PUT", "DELETE"],
            ),
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
            async with request.form(max_files=1, max_fields=3) as form:
                space, module = form.get("space"), form.get("module")
                current = _current_field(form.get("current"))
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
                    space, module.file, module.filename or "", current=current
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

    async def rollout(self, request: Request) -> Response:
        """GET: the space's rollout (a read: open, like versions); POST: start one, the
        body as rollouts.EXPECTED says (docs/rollouts.md)."""
        host = self.running
        if request.method == "GET":
            space = f"{request.path_params['owner']}/{request.path_params['name']}"
            return JSONResponse(await self._rollout_view(space))
        space = self._space_to_write(request)
        body = await _small_body(request, rollouts.EXPECTED)
        # A space that is not deployed is a 404 whatever the body: its steps are judged
        # only for a space that could take them.
        if await self._thread(partial(host.store.current, space)) is None:
            raise ClientError(404, f"space {space} is not deployed", space=space)
        asked = rollouts.parse(body)
        fleet = host.deploys.fleet
        if fleet is not None:  # the fleet's state, applied by every host before the answer
            change, _ = await fleet.run(fleet.db.rollout_start, space, asked)
            return await self._fleet_rollout(space, change)
        started = partial(rollouts.start, host.store, host.table, space, asked)
        return JSONResponse(await self._thread(started))

    async def rollout_action(self, request: Request) -> Response:
        """POST …/rollout/pause, …/resume or …/abort."""
        space = self._space_to_write(request)
        action = request.path_params["action"]
        if action not in ("pause", "resume", "abort"):
            raise ClientError(404, f"no rollout action {action[:40]!r}: pause, resume or abort")
        host = self.running
        fleet = host.deploys.fleet
        if fleet is not None:
            change, _ = await fleet.run(fleet.db.rollout_act, space, action)
            return await self._fleet_rollout(space, change)
        return JSONResponse(
            await self._thread(partial(rollouts.act, host.store, host.table, space, action))
        )

    async def _fleet_rollout(self, space: str, change: Change) -> Response:
        """A committed rollout change: once every live host applied it, this host's view."""
        host = self.running
        assert host.deploys.fleet is not None
        status, hosts = await host.deploys.fleet.applied(change)
        body = await self._rollout_view(space)
        return JSONResponse({**body, "hosts": hosts}, status_code=status)

    async def _rollout_view(self, space: str) -> dict[str, object]:
        """The space's rollout (rollouts.view); on a fleet host the step under way sums
        every host's counts: this host's own and the others' last reports."""
        host = self.running
        fleet = host.deploys.fleet
        state = await self._thread(partial(rollouts.read, host.store.root, space))
        others = None
        live = state is not None and state["status"] in rollouts.LIVE
        if fleet is not None and state is not None and live:
            others = await fleet.rollout_others(space, state, host.table)
        body = await self._thread(
            partial(rollouts.view, host.store, host.table, state, space, others)
        )
        if fleet is not None and live and others is None:
            body["warning"] = (
                "the fleet store is unreachable: the step under way counts this host's"
                " requests only"
            )
        return body

    async def _thread(self, func: Callable[[], _T]) -> _T:
        return await anyio.to_thread.run_sync(func, limiter=self.running.deploys.host_limiter)

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

        found = await anyio.to_thread.run_sync(read, limiter=host.deploys.host_limiter)
        if found is None:
            raise ClientError(404, f"space {space} is not deployed", space=space)
        records, after = found
        return Response(
            orjson.dumps({"records": records, "next": after}), media_type="application/json"
        )

    async def keys(self, request: Request) -> Response:
        """GET: the space's access and its keys' ids (never a key); POST: mint a key,
        shown in this answer only. The body is nothing or {"rate": N}."""
        space = self._space_to_write(request)  # a key is the owner's to see and mint
        keys = self.running.deploys.keys
        if request.method == "GET":
            return JSONResponse(await keys.read(space))
        rate = access.parse_rate(await _small_body(request, 'nothing or {"rate": N}'))
        status, body = await keys.mint(space, rate)
        return JSONResponse(body, status_code=status, headers={"cache-control": "no-store"})

    async def revoke_key(self, request: Request) -> Response:
        """Revoke a key: once this answers 200, no worker (no live host) takes it."""
        space = self._space_to_write(request)
        key_id = request.path_params["key_id"]
        status, body = await self.running.deploys.keys.revoke(space, key_id)
        return JSONResponse(body, status_code=status)

    async def access(self, request: Request) -> Response:
        """Make a space private ({"private": true}: only its keys pass) or public."""
        space = self._space_to_write(request)
        private = access.parse_private(await _small_body(request, '{"private": true|false}'))
        status, body = await self.running.deploys.keys.set_private(space, private)
        return JSONResponse(body, status_code=status)

    async def secrets(self, request: Request) -> Response:
        """A space's secrets: names and when each was set, never a value."""
        space = self._space_to_write(request)
        return JSONResponse(await self.running.deploys.secret_names(space))

    async def secret(self, request: Request) -> Response:
        """PUT: the body is the value (UTF-8, up to 64 KiB); DELETE: unset it. Either
        reloads the space; the answer never holds the value."""
        space = self._space_to_write(request)  # before the body is read
        name = secret_files.check_name(request.path_params["secret"])
        deploys = self.running.deploys
        if request.method == "DELETE":
            status, body = await deploys.unset_secret(space, name)
            return JSONResponse(body, status_code=status)
        limit = secret_files.MAX_VALUE
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise secret_files.too_large(int(length))
        try:
            value = await Request(request.scope, _limited(request.receive, limit)).body()
        except _TooLarge:
            raise secret_files.too_large(None) from None
        status, body = await deploys.set_secret(space, name, secret_files.check_value(value))
        return JSONResponse(body, status_code=status)

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

        def read() -> dict[str, dict[str, object]]:
            found = host.store.spaces()
            for space, running in rollouts.live(host.store.root).items():
                if space in found:  # a running rollout, for the dashboard's row
                    found[space]["rollout"] = running
            return found

        spaces = await anyio.to_thread.run_sync(read, limiter=host.deploys.host_limiter)
        return JSONResponse({"spaces": spaces})

    async def usage(self, request: Request) -> Response:
        scope = request.query_params.get("scope", "host")
        if scope == "fleet":
            body = orjson.dumps(await self._fleet().usage())
        elif scope == "host":
            body = await self.running.usage.json(_only(request.query_params.get("only")))
        else:
            raise ClientError(400, "scope must be `host` (the default) or `fleet`")
        return Response(body, media_type="application/json")

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
        body = await self.running.usage.prometheus(lag)
        return Response(body, media_type=prometheus.CONTENT_TYPE)

    async def health(self, request: Request) -> Response:
        """This worker: its pid and the version of each space it holds; on a fleet host,
        503 while the host is not caught up with the fleet (what a load balancer checks)."""
        active = self.running.registry.active
        loaded = {space: a.version.number for space, a in active.items()}
        body: dict[str, object] = {"ok": True, "pid": os.getpid(), "loaded": loaded}
        behind = _behind(self.settings, self.running.table.header(H_FOLLOWED), now_us())
        if behind is not None:
            body.update(ok=False, error=behind)
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi.SPEC)


def _behind(s: settings_mod.Settings, followed_us: int, now: int) -> str | None:
    """Why a fleet host is not caught up (None: it is, or it is a single host): its
    follower has not heartbeated after a catch-up yet, or not for POLYSERVE_FLEET_LIVE_S,
    after which the fleet stops counting it live and deploys stop waiting for it."""
    if not s.database_url:
        return None
    if not followed_us:
        return "not caught up with the fleet yet: its follower has not applied the changes"
    if now - followed_us > s.fleet_live_s * 1_000_000:
        return (
            f"not caught up with the fleet: its follower has not heartbeated for"
            f" {(now - followed_us) / 1e6:.0f} s (POLYSERVE_FLEET_LIVE_S={s.fleet_live_s:g}),"
            " so it may serve older versions: see its log"
        )
    return None


def _current_field(value: object) -> bool:
    """A deploy's form field `current`: absent or `true` moves current, `false` keeps
    the version beside it (a rollout's new version)."""
    if value is None or value == "true":
        return True
    if value == "false":
        return False
    raise ClientError(422, "form field `current` must be `true` (the default) or `false`")


def _only(text: str | None) -> Only | None:
    """`?only=host` asks for the host's section alone; any other value, the whole answer."""
    return "host" if text == "host" else None


class _TooLarge(Exception):
    pass


_CURSOR = re.compile(r"[0-9]{1,18}")


def _cursor(text: str) -> int:
    if not _CURSOR.fullmatch(text):
        raise ClientError(
            422, "since must be a whole number of at least 0: the `next` of an earlier answer"
        )
    return int(text)


async def _small_body(request: Request, expected: str) -> bytes:
    try:
        return await Request(request.scope, _limited(request.receive, 1 << 16)).body()
    except _TooLarge:
        raise ClientError(413, f"the body is too large: send {expected}") from None


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
