"""The ASGI entry: space requests straight to dispatch, everything else to the control plane.

gunicorn's workers serve `polyserve.app:app`. The worker's objects are built at the
lifespan's startup (polyserve/host.py); the handlers under /_polyserve live in
polyserve/control/plane.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.datastructures import URL
from starlette.responses import RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from polyserve import settings as settings_mod
from polyserve.control.plane import ControlPlane
from polyserve.host import running_host
from polyserve.serve.dispatch import answer
from polyserve.serve.inference import InferenceRoutes

# The headers uvicorn's ProxyHeadersMiddleware reads; it changes nothing without them.
_FORWARDED = frozenset((b"x-forwarded-for", b"x-forwarded-proto"))


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
        self.control_app = self.control.app(lifespan=self._lifespan)
        self._trusted: list[str] | str | None = None
        self._dispatch: ASGIApp = _not_started
        # The same behind uvicorn's ProxyHeadersMiddleware, for a request that carries
        # the headers it reads: one without them skips its layer (bench/NOTES.md).
        self._forwarded: ASGIApp = _not_started
        self.inference = InferenceRoutes(self.control, self._space_app)

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
            forwarded = serve
            if self._trusted is not None:
                # uvicorn types its middleware with its own, narrower scope types.
                forwarded = ProxyHeadersMiddleware(serve, self._trusted)  # type: ignore[arg-type,assignment]
            self.control.host, self._dispatch, self._forwarded = host, serve, forwarded
            try:
                yield
            finally:
                self.control.host, self._dispatch = None, _not_started
                self._forwarded = _not_started

    def _space_app(self, scope: Scope) -> ASGIApp:
        """Dispatch, behind the middleware when the request has a header it reads."""
        for name, _ in scope["headers"]:
            if name in _FORWARDED:
                return self._forwarded
        return self._dispatch

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
                    scope["root_path"] = f"{root}/s/{owner}/{name}"
                    if "@" in name:  # name@N: kept version N (docs/deploys.md)
                        name, _, version = name.partition("@")
                        if version != "current":  # an empty one is not kept either: a 404
                            params = {"owner": owner, "name": name, "version": version}
                            scope["path_params"] = params
                            return await self._space_app(scope)(scope, receive, send)
                    scope["path_params"] = {"owner": owner, "name": name}
                    return await self._space_app(scope)(scope, receive, send)
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
