"""The inference protocol at the host's root: metadata, health and the repository, and infers.

`/v2/models/{owner}/{name}/…` names a model space by its two-part name. An infer is handed
to dispatch with its parsed route, so it is billed, bounded and answered like any request
of the space. Everything else is answered here from the store, never loading a space and
never billed: server metadata and health, a model's metadata and readiness from its
current version's recorded inputs and outputs, and the repository extension (index, load
as a warm-up in this worker, unload as a release in every worker).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import orjson
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from polyserve.errors import ClientError
from polyserve.names import is_owner
from polyserve.serve import protocol, routes
from polyserve.serve.gate import Refused
from polyserve.serve.routes import Answer, Route
from polyserve.serve.tensors import ProtocolError

if TYPE_CHECKING:
    from polyserve.control.plane import ControlPlane


@functools.lru_cache(maxsize=256)
def _route(path: str, method: str) -> Route:
    """The route of a path at the host's root, its model's name checked: cached, as
    routes.parse is, so a repeated infer pays for neither."""
    route = routes.parse(path, method, 2)
    assert route is not None, "HostApp sends only paths under /v2"
    if route.model is not None and not all(map(is_owner, route.model.split("/"))):
        raise ProtocolError(f"no model {route.model[:200]!r}: a model is named owner/name", 404)
    return route


class InferenceRoutes:
    """Every path under `/v2` at the host's root."""

    def __init__(self, control: ControlPlane, dispatch: Callable[[Scope], ASGIApp]) -> None:
        self.control = control
        self.dispatch = dispatch  # the worker's current request path for a scope

    async def __call__(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1008})
            return
        try:
            route = _route(path, scope["method"])
            if route.op == "infer":
                owner, _, name = (route.model or "").partition("/")
                scope["path_params"] = {"owner": owner, "name": name}
                if route.version is not None:  # a kept version by name, as `owner/name@N`
                    scope["path_params"]["version"] = route.version
                scope["polyserve.route"] = route
                await self.dispatch(scope)(scope, receive, send)
                return
            if route.model is not None and route.op not in ("load", "unload"):
                # A private model's metadata and readiness take its key, as its infers do.
                gate = self.control.running.dispatch.gate
                if gate is not None:
                    gate.check(route.model, scope["headers"])
            found = await self._answer(route, scope, receive)
        except Refused as no:
            extra = [(k.encode(), v.encode()) for k, v in no.headers.items()]
            found = routes.answer(no.status, orjson.dumps(no.body), routes.JSON, False, extra)
        except ProtocolError as exc:
            found = routes.error_answer(exc)
        except ClientError as exc:  # auth, and the host's own refusals
            found = routes.json_answer(exc.status, exc.body())
        await send(
            {"type": "http.response.start", "status": found.status, "headers": found.headers}
        )
        await send({"type": "http.response.body", "body": found.body})

    async def _answer(self, route: Route, scope: Scope, receive: Receive) -> Answer:
        op = route.op
        if op == "server":
            return routes.json_answer(200, routes.server_metadata())
        if op in ("live", "ready"):
            return routes.json_answer(200, {op: True})
        if op == "index":
            return routes.json_answer(200, await self._thread(self._index))
        space = route.model or ""
        if op in ("load", "unload"):
            request = Request(scope, receive)
            self.control.auth.allow(self.control._writer(request), space)
            if op == "unload":
                status, body = await self.control.running.deploys.release(space)
                return routes.json_answer(status, {"name": space, "unloaded": True, **body})
            await self._warm(space)
            return routes.json_answer(200, {"name": space, "loaded": True})
        meta = await self._thread(self._model_meta, space, route.version)
        if op == "model_ready":
            return routes.json_answer(200, {"name": space, "ready": True})
        host = self.control.running
        versions = await self._thread(routes.kept_models, host.store.space_dir(space) / "versions")
        inputs = protocol.specs(meta.get("inputs")).values()
        outputs = protocol.specs(meta.get("outputs")).values()
        return routes.json_answer(
            200, protocol.metadata(space, versions or [int(str(meta["version"]))], inputs, outputs)
        )

    def _model_meta(self, space: str, version: str | None = None) -> dict[str, object]:
        """The metadata of a model space's current version, or of kept version `version`;
        a 404 for anything else."""
        store = self.control.running.store
        current = store.current(space)
        meta = store.meta(space, current.number) if current is not None else None
        if meta is None:
            raise ProtocolError(f"no model {space}: it is not deployed", 404)
        if version is not None and version != str(current.number if current else None):
            kept = store.kept(space)
            if not (version.isdigit() and version.isascii() and int(version) in kept):
                raise ProtocolError(
                    f"model {space} keeps no version {version[:40]!r}: it keeps {kept}", 404
                )
            meta = store.meta(space, int(version))
            if meta is None:  # pruned since kept() looked
                raise ProtocolError(f"model {space} keeps no version {version[:40]!r}", 404)
        if meta.get("kind") != "model":
            raise ProtocolError(
                f"space {space} is not a model space: it answers its own routes under /s/{space}/",
                404,
            )
        return meta

    def _index(self) -> list[dict[str, object]]:
        """The repository index: every model space and its current version."""
        return [
            {"name": space, "version": str(meta.get("version")), "state": "READY"}
            for space, meta in self.control.running.store.spaces().items()
            if meta.get("kind") == "model"
        ]

    async def _warm(self, space: str) -> None:
        """The repository's load: this worker imports the space now, not at a request."""
        await self._thread(self._model_meta, space)
        registry = self.control.running.registry
        try:
            active = await registry.lease(space)
        except Exception as exc:
            details = getattr(exc, "details", None)
            error = details.get("error") if isinstance(details, dict) else str(exc)
            raise ProtocolError(f"model {space} could not be loaded: {error}", 503) from None
        registry.end_lease(active)

    async def _thread(self, func: Callable[..., Any], *args: Any) -> Any:
        """Store reads on the host's threads, as the control plane's are."""
        limiter = self.control.running.deploys.host_limiter
        result: Any = await anyio.to_thread.run_sync(func, *args, limiter=limiter)
        return result
