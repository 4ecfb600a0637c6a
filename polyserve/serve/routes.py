"""The inference protocol's routes and answers: what a /v2 path asks, and the reply in hand.

Both faces of the protocol use them: a model space's own app under its prefix
(polyserve.serve.modelspace), where a model is named `name`, and the host's root
(polyserve.serve.inference), where it is named `owner/name`. An answer is built whole
before a byte is sent, so dispatch can count it (billed or not) and send it itself.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson
from starlette.types import Scope

from polyserve.serve.tensors import ProtocolError

Op = Literal["server", "live", "ready", "model", "model_ready", "infer", "index", "load", "unload"]


_BILLED: frozenset[Op] = frozenset(("infer",))


_METHODS: dict[Op, str] = {
    "infer": "POST",
    "index": "POST",
    "load": "POST",
    "unload": "POST",
}


@dataclass(frozen=True)
class Route:
    """What a protocol path asks: the operation, and the model and version it names."""

    op: Op
    model: str | None = None
    version: str | None = None

    @property
    def billed(self) -> bool:
        return self.op in _BILLED


@functools.lru_cache(maxsize=256)
def parse(path: str, method: str, name_parts: int) -> Route | None:
    """The protocol route of a path under `/v2` (None: not one). A model name is
    `name_parts` segments: two at the host's root (owner/name), one under a space's
    prefix. Raises ProtocolError for a protocol path with the wrong method or shape.

    Cached: a client calls the same few routes again and again, and a parse is a share
    of a tiny model's answer. A refusal is never cached, and the bound keeps a client's
    many odd paths from growing the cache."""
    parts = path.strip("/").split("/")
    if parts[0] != "v2":
        return None
    rest = parts[1:]
    route: Route | None = None
    if not rest:
        route = Route("server")
    elif rest[0] == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
        route = Route("live" if rest[1] == "live" else "ready")
    elif rest[0] == "models" and len(rest) > name_parts:
        model = "/".join(rest[1 : 1 + name_parts])
        tail, version = rest[1 + name_parts :], None
        if len(tail) >= 2 and tail[0] == "versions":
            version, tail = tail[1], tail[2:]
        op = {(): "model", ("ready",): "model_ready", ("infer",): "infer"}.get(tuple(tail))
        if op is not None:
            route = Route(op, model, version)  # type: ignore[arg-type]
    elif rest == ["repository", "index"]:
        route = Route("index")
    elif rest[:2] == ["repository", "models"] and len(rest) == 3 + name_parts:
        op = rest[-1]
        if op in ("load", "unload"):
            route = Route(op, "/".join(rest[2 : 2 + name_parts]))  # type: ignore[arg-type]
    if route is None:
        raise ProtocolError(f"no such route of the inference protocol: {path[:200]}", 404)
    wanted = _METHODS.get(route.op, "GET")
    if method != wanted and not (wanted == "GET" and method == "HEAD"):
        raise ProtocolError(f"{path[:200]} takes {wanted}, not {method}", 405)
    return route


@dataclass
class Answer:
    """A response in hand: dispatch sends it, and bills it when `billed`."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]
    billed: bool = False

    @property
    def error(self) -> bool:
        return self.status >= 400


JSON = b"application/json"


def json_answer(status: int, value: object, billed: bool = False) -> Answer:
    return answer(status, orjson.dumps(value), JSON, billed)


def answer(
    status: int, body: bytes, media: bytes, billed: bool, extra: Sequence[tuple[bytes, bytes]] = ()
) -> Answer:
    headers = [(b"content-length", b"%d" % len(body)), (b"content-type", media), *extra]
    return Answer(status, body, headers, billed)


def error_answer(exc: ProtocolError, billed: bool = False) -> Answer:
    return answer(exc.status, exc.body(), JSON, billed)


def server_metadata() -> dict[str, object]:
    from polyserve import __version__

    return {
        "name": "polyserve",
        "version": __version__,
        "extensions": ["binary_tensor_data", "model_repository"],
    }


def check_version(name: str, route: Route, current: int) -> None:
    """A route naming a version under a space's prefix names the version that prefix
    serves (`/s/owner/name@N/` serves kept version N: docs/deploys.md)."""
    if route.version is not None and route.version != str(current):
        raise ProtocolError(
            f"model {name} serves version {current} here, not {route.version[:40]!r}:"
            " call a kept version under /s/{owner}/{name}@N/, or at the host's root as"
            " /v2/models/{owner}/{name}/versions/N (or leave the version out)",
            404,
        )


def kept_models(versions_dir: Path) -> list[int]:
    """The kept versions of a space (its `versions` directory) that are models."""
    found = []
    try:
        entries = list(versions_dir.iterdir())
    except FileNotFoundError:
        return []
    for path in entries:
        if path.suffix != ".json" or not path.stem.isdigit():
            continue
        try:
            meta = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):  # pruned while listed, or half-written
            continue
        if isinstance(meta, dict) and meta.get("kind") == "model":
            found.append(int(path.stem))
    return sorted(found)


def model_name(scope: Scope) -> str:
    """The model's name: the space's own name under its prefix."""
    params = scope.get("path_params") or {}
    name = params.get("name")
    if isinstance(name, str):
        return name
    return str(scope.get("root_path", "")).rstrip("/").rpartition("/")[2] or "model"
