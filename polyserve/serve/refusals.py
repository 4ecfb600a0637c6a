"""What a request is answered when no version of its space serves it here, as JSON."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import quote

from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from polyserve.errors import ClientError
from polyserve.serve import loader
from polyserve.serve.loading import NotDeployed, NotKept, OtherPool, TableFull
from polyserve.serve.memcap import NO_ROOM_RETRY_S, NoRoom

if TYPE_CHECKING:  # the fleet's modules import psycopg: only a fleet host pays for that
    from polyserve.fleet.pools import PoolRouter

log = logging.getLogger("polyserve")
# Retry-After (s) of a space whose files this fleet host cannot fetch now.
FILES_RETRY_S = 5
# Retry-After (s) of a space that found no free slot in this fleet host's table.
TABLE_FULL_RETRY_S = 5


def refusal(
    exc: BaseException, space: str, slot: int | None, timeout: float
) -> tuple[int | None, int, dict[str, object], dict[str, str] | None]:
    """What to answer a request that got no version of its space to serve: the slot
    to count it in (None: counted nowhere), the status, the body and the headers.
    `slot` is the space's, if known; `timeout` the request's."""
    if isinstance(exc, asyncio.CancelledError):  # the deadline's: the wait for a load
        # Counted as a request and an error, as a space's own 504 is. The load goes
        # on (lease shields it) and serves the requests after this one.
        error = (
            f"space {space} was not loaded within {timeout:g} s"
            " (POLYSERVE_REQUEST_TIMEOUT); its load goes on: retry"
        )
        return slot, 504, {"error": error, "space": space}, None
    if isinstance(exc, NotKept):
        if not exc.kept:  # deleted, or never deployed: as a plain request's answer
            return None, 404, {"error": f"space {space} is not deployed", "space": space}, None
        error = (
            f"space {space} keeps no version {exc.version!r}: call one it keeps"
            f" ({', '.join(map(str, exc.kept))}) as {space}@N, or {space} for the current one"
        )
        return None, 404, {"error": error, "space": space, "kept": exc.kept}, None
    if isinstance(exc, NotDeployed):
        return None, 404, {"error": f"space {space} is not deployed", "space": space}, None
    if isinstance(exc, NoRoom):
        # This host's space, refused for now: counted as a request and an error, like
        # a failed load, so the usage shows what the cap costs a space.
        retry = {"retry-after": str(NO_ROOM_RETRY_S)}
        return slot, 503, {"error": str(exc), "space": space}, retry
    if isinstance(exc, TableFull):  # no slot to count it in
        retry = {"retry-after": str(TABLE_FULL_RETRY_S)}
        return None, 503, {"error": str(exc), "space": space}, retry
    if isinstance(exc, loader.FilesAway):
        retry = {"retry-after": str(FILES_RETRY_S)}
        return slot, 503, {**exc.details, "space": space}, retry
    if isinstance(exc, loader.DeviceLoadError):
        # The worker's GPU cannot run it (onnxruntime gave the session another provider):
        # never served from the CPU instead; the host's to fix, not the request's.
        return slot, 503, {**exc.details, "space": space}, None
    if isinstance(exc, loader.LoadError):
        body = exc.details
    else:  # a bug of ours, or the data dir changed under us: still JSON
        log.error("loading %s failed", space, exc_info=exc)
        body = {"error": f"space {space} could not be loaded; see the host log"}
    return slot, 500, {**body, "space": space}, None


async def elsewhere(
    pools: PoolRouter, other: OtherPool, scope: Scope, receive: Receive, send: Send
) -> int:
    """Another pool's space: 307 to a live host of that pool, else record the demand
    and answer 503 with Retry-After (also when the fleet's database is away)."""
    space, pool = other.space, other.pool
    body: dict[str, object] = {"space": space, "pool": pool}
    retry = {"retry-after": str(pools.retry_after_s)}
    try:
        url = await pools.host_of(pool)
        if url is None:
            await pools.demand(pool, space)
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
            f" started; retry in {pools.retry_after_s} s"
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
