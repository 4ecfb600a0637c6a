"""A space version's life in a worker: import it, start its lifespan, stop it.

The version is imported into a fresh package of its own (polyserve/serve/namespace.py);
what it exports is adapted to ASGI: an ASGI app as is, a WSGI app behind a2wsgi,
`handle(request)` through HandleApp (polyserve/serve/answers.py), a model file through
the host's own InferenceApp. An ASGI app's lifespan runs the way uvicorn runs it.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from a2wsgi import WSGIMiddleware
from starlette.types import ASGIApp

from polyserve import secrets
from polyserve.logs import spacelog
from polyserve.serve import gpu, namespace
from polyserve.serve.answers import DEFAULT_THREADS, HandleApp
from polyserve.serve.namespace import forget

if TYPE_CHECKING:  # numpy comes with it: imported only once a model space needs it
    from polyserve.serve import modelspace

MESSAGE_MAX = 2000


class LoadError(Exception):
    """A version that cannot be imported or started; details say where and why."""

    def __init__(self, error: str, **details: object) -> None:
        if len(error) > MESSAGE_MAX:  # an exception's text is the tenant's: bound it
            error = error[:MESSAGE_MAX] + f"… ({len(error)} characters)"
        super().__init__(error)
        self.details = {"error": error, **details}


class FilesAway(LoadError):
    """A fleet version whose files are not on this host and cannot be fetched now (the
    fleet's database is unreachable): answered 503 with Retry-After."""


class DeviceLoadError(LoadError):
    """A load refused because its session would not run on the worker's GPU
    (polyserve.serve.gpu.DeviceRefused): the host's to fix, answered 503."""


# -- one imported version -----------------------------------------------------------------

Kind = Literal["app", "wsgi", "handle", "model"]  # what a version exports, as served


@dataclass
class _Imported:
    space: str
    version: int
    package: str
    module: Any
    root: Path  # the version's directory
    log: spacelog.Tag  # what its code says is attributed to it (dispatch sets spacelog.RUNNING)
    state: dict[str, Any] = field(default_factory=dict, kw_only=True)  # lifespan state, per ASGI
    lifespan: _Lifespan | None = field(default=None, kw_only=True)
    # The space's secrets as this load read them (read-only): its requests' ASGI scope
    # carries them as scope["polyserve.secrets"] (docs/secrets.md).
    secrets: Mapping[str, str] = field(default_factory=dict, kw_only=True)


@dataclass
class ImportedApp(_Imported):
    """A version that exports an ASGI app ("app"), or a WSGI one served by a2wsgi."""

    app: ASGIApp
    kind: Literal["app", "wsgi"]


@dataclass
class ImportedHandle(_Imported):
    """A version that exports handle(request)."""

    app: HandleApp
    kind: Literal["handle"] = field(default="handle", kw_only=True)


@dataclass
class ImportedModel(_Imported):
    """A model file, or a version whose `app` is an InferenceApp: the host's protocol."""

    app: modelspace.InferenceApp
    kind: Literal["model"] = field(default="model", kw_only=True)


# A version imported into this process, ready to serve once started: `kind` tells which.
Imported = ImportedApp | ImportedHandle | ImportedModel


def import_version(
    space: str,
    version: int,
    root: Path,
    entry: str,
    threads: int = DEFAULT_THREADS,
    deps: Path | None = None,
    values: Mapping[str, str] | None = None,
) -> Imported:
    """Import a version's entry module under a fresh package name (thread-safe); a sync
    handle() gets `threads` worker threads at most. `deps` is its installed dependency
    set: the version's own modules shadow it, as a script's directory shadows sys.path.
    `values` are the space's secrets, which its code reads through polyserve.secrets."""
    root = Path(root)
    if deps is not None and not Path(deps).is_dir():
        raise LoadError(
            f"the dependency set of {space} v{version} is missing from the data directory:"
            " deploy the space again to install it"
        )
    roots = [root] if deps is None else [root, Path(deps)]
    package = namespace.create(space, version, roots, values)
    tag = spacelog.tag(space, version, root)
    speaking = spacelog.RUNNING.set(tag)  # what the module prints at import is the space's
    try:
        imported: Imported
        if entry.endswith(".onnx"):  # a model space: the host's own app serves the file
            app = _model_app(root / entry, threads)
            imported = ImportedModel(space, version, package, None, root, tag, app)
        else:
            module = importlib.import_module(f"{package}.{entry.removesuffix('.py')}")
            where = (space, version, package, module, root, tag)
            imported = _find_callable(where, entry, threads)
        if imported.kind == "model":
            imported.app.version, imported.app.versions_dir = version, root.parent
        imported.secrets = secrets.of(package)
    except LoadError as exc:
        forget(package)
        tag.record(logging.ERROR, "stderr", f"import failed: {exc}", time.time())
        raise
    except gpu.DeviceRefused as exc:  # a space's own onnx_session: the host's to fix
        forget(package)
        tag.record(logging.ERROR, "stderr", f"import failed: {exc}", time.time())
        raise DeviceLoadError(str(exc), providers=exc.providers) from exc
    except (Exception, SystemExit) as exc:  # sys.exit() at import is the tenant's error too
        forget(package)
        tag.exception(exc, f"the import of {entry}")
        raise LoadError(**error_fields(exc, root)) from exc  # type: ignore[arg-type]
    finally:
        spacelog.RUNNING.reset(speaking)
    return imported


def _find_callable(
    where: tuple[str, int, str, Any, Path, spacelog.Tag], entry: str, threads: int
) -> Imported:
    """What the entry module exports, as the version it makes (`where`: its fields)."""
    module = where[3]
    app = getattr(module, "app", None)
    if app is not None:
        if not callable(app):
            raise LoadError(f"{entry}: `app` must be an ASGI or WSGI application (a callable)")
        models = sys.modules.get("polyserve.serve.modelspace")  # imported by inference_app
        if models is not None and isinstance(app, models.InferenceApp):
            return ImportedModel(*where, app)
        if is_wsgi(app):
            # Flask, Django, any WSGI app, unchanged: a2wsgi runs it on a thread pool of
            # the space's own size, as a sync handle() gets.
            # a2wsgi types scope, receive and send with TypedDicts of its own.
            wsgi: ASGIApp = WSGIMiddleware(app, workers=threads)  # type: ignore[assignment]
            return ImportedApp(*where, wsgi, "wsgi")
        return ImportedApp(*where, app, "app")
    handle = getattr(module, "handle", None)
    if handle is not None:
        if not callable(handle):
            raise LoadError(f"{entry}: `handle` must be a function taking a request")
        return ImportedHandle(*where, HandleApp(handle, threads))
    raise LoadError(
        f"{entry} defines neither `app` (an ASGI application) nor `handle(request)`:"
        " export one of them at module level",
        file=entry,
    )


def _model_app(path: Path, threads: int) -> modelspace.InferenceApp:
    """A deployed model file's app, batched as its version's polyserve.toml says; a file
    onnxruntime cannot serve (or not batch as asked) is a LoadError."""
    from polyserve.models import onnx_session
    from polyserve.serve import batching, modelspace

    try:
        asked = batching.read_batching(path.parent)
        # One copy of the weights per host, as a space's own onnx_session() gives; on
        # a GPU worker, the space's session on the GPU, within its polyserve.toml's limit.
        limit = gpu.space_memory_mb(path.parent) if gpu.on_gpu() else None
        model = modelspace.Model(onnx_session(path, gpu_memory_mb=limit))
        return modelspace.InferenceApp(model, threads=threads, batching=asked)
    except gpu.DeviceRefused as exc:
        raise DeviceLoadError(str(exc), providers=exc.providers) from None
    except (modelspace.ModelError, batching.BatchingError, gpu.BadManifest) as exc:
        raise LoadError(f"{path.name}: {exc}", file=path.name) from None
    except Exception as exc:  # onnxruntime's own classes say what is wrong with the file
        message = scrub_paths(f"{type(exc).__name__}: {exc}", path.parent)
        raise LoadError(f"onnxruntime cannot load {path.name}: {message}", file=path.name) from None


def is_wsgi(app: Any) -> bool:
    """A plain (not async) callable taking two positional arguments, environ and
    start_response: PEP 3333's shape. An ASGI app's __call__ is async and takes three."""
    if inspect.isclass(app):
        return False
    call = app if inspect.isfunction(app) or inspect.ismethod(app) else type(app).__call__
    if inspect.iscoroutinefunction(call):
        return False
    try:
        params = inspect.signature(app).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: not a WSGI app of ours
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional for p in params) == 2


def error_fields(exc: BaseException, root: Path) -> dict[str, object]:
    """An import failure as the deployer needs it: message, and the file and line in the
    version that raised it (relative to the version root)."""
    message = f"{type(exc).__name__}: {exc}"
    file: str | None = None
    line: int | None = None
    if isinstance(exc, SyntaxError) and exc.filename:
        file, line = exc.filename, exc.lineno
        message = f"SyntaxError: {exc.msg}"
    else:
        for frame in reversed(traceback.extract_tb(exc.__traceback__)):
            if frame.filename.startswith(str(root) + os.sep):
                file, line = frame.filename, frame.lineno
                break
    if file is not None and file.startswith(str(root) + os.sep):
        file = file[len(str(root)) + 1 :]
    where = f"{file}, line {line}: " if file else ""
    return {
        "error": f"import failed: {where}{scrub_paths(message, root)}",
        "file": file,
        "line": line,
    }


_ABSOLUTE = re.compile(r"""(?<![\w.])/(?:[^\s"':,()/]+/)+""")


def scrub_paths(text: str, root: Path) -> str:
    """Tenant-facing text without the host's filesystem: paths in the version become
    relative to it, and any other absolute path keeps only its last part."""
    return _ABSOLUTE.sub("", text.replace(str(root) + os.sep, ""))


# -- ASGI lifespan ---------------------------------------------------------------------------


class _Lifespan:
    """Drives one app's ASGI lifespan the way uvicorn's `lifespan="auto"` does: an app that
    returns, raises before `startup.complete`, or sends anything but a lifespan message
    there simply does not support lifespan, and is served; only `startup.failed` fails."""

    def __init__(self, app: ASGIApp, state: dict[str, Any], log: spacelog.Tag) -> None:
        self.app = app
        self.state = state
        self.log = log
        self.inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        self.started = asyncio.Event()  # startup answered, failed, or the app gave up
        self.stopped = asyncio.Event()
        self.failed: str | None = None  # the message of lifespan.startup.failed
        self.task: asyncio.Task[None] | None = None

    async def _main(self) -> None:
        scope = {
            "type": "lifespan",
            "asgi": {"version": "3.0", "spec_version": "2.0"},
            "state": self.state,
        }
        try:
            await self.app(scope, self.inbox.get, self._send)
        except Exception as exc:
            if self.started.is_set() and self.failed is None:
                self.log.exception(exc, "the app's lifespan, after its startup")
        finally:
            self.started.set()
            self.stopped.set()

    async def _send(self, message: Any) -> None:
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "lifespan.startup.complete" and not self.started.is_set():
            self.started.set()
        elif kind == "lifespan.startup.failed" and not self.started.is_set():
            self.failed = str(message.get("message") or "")
            self.started.set()
        elif kind in _SHUTDOWN_DONE and self.started.is_set() and not self.stopped.is_set():
            self.stopped.set()
        else:
            # Raised into the app, as uvicorn's assertions are: an app that does not
            # check the scope type ends its lifespan here and is served without one.
            raise RuntimeError(f"unexpected ASGI message on the lifespan scope: {kind!r}")

    async def startup(self, timeout: float) -> bool:
        """True if the app started with lifespan; False if it does not support it."""
        self.task = asyncio.create_task(self._main())
        await self.inbox.put({"type": "lifespan.startup"})
        try:
            await asyncio.wait_for(self.started.wait(), timeout)
        except TimeoutError:
            self.task.cancel()
            raise LoadError(f"app lifespan startup took longer than {timeout:g} s") from None
        if self.failed is not None:
            self.task.cancel()
            raise LoadError(f"app lifespan startup failed: {self.failed[-_MESSAGE_TAIL:]}".strip())
        return not self.task.done()

    async def shutdown(self, timeout: float) -> None:
        if self.task is None or self.task.done():
            return
        await self.inbox.put({"type": "lifespan.shutdown"})
        try:
            await asyncio.wait_for(self.stopped.wait(), timeout)
        finally:
            self.task.cancel()


_SHUTDOWN_DONE = ("lifespan.shutdown.complete", "lifespan.shutdown.failed")
_MESSAGE_TAIL = 2000  # Starlette sends the whole traceback; its end says what failed


async def start(imported: Imported, timeout: float) -> None:
    """Run an app's lifespan startup. Any failure, whatever it raises, forgets the
    version, cancels its lifespan, and is a LoadError."""
    if imported.kind != "app":
        return
    lifespan = _Lifespan(imported.app, imported.state, imported.log)
    # The lifespan task copies this context: its startup and shutdown speak as the space.
    speaking = spacelog.RUNNING.set(imported.log)
    try:
        if await lifespan.startup(timeout):
            imported.lifespan = lifespan
    except BaseException as exc:
        if lifespan.task is not None:
            lifespan.task.cancel()
        forget(imported.package)
        if not isinstance(exc, Exception):
            raise  # a cancelled load stays cancelled
        if isinstance(exc, LoadError):
            message = str(exc)
            imported.log.record(logging.ERROR, "stderr", message, time.time())
        else:
            message = f"{type(exc).__name__}: {exc}"
            imported.log.exception(exc, "the app's lifespan startup")
        if not message.startswith("app lifespan"):
            message = f"app lifespan startup failed: {message}"
        raise LoadError(scrub_paths(message, imported.root)) from exc
    finally:
        spacelog.RUNNING.reset(speaking)


async def stop(imported: Imported, timeout: float) -> None:
    """Run lifespan shutdown (bounded by timeout), then forget the version's modules."""
    try:
        if imported.lifespan is not None:
            await imported.lifespan.shutdown(timeout)
    except Exception as exc:  # a tenant's failing shutdown must not keep its version loaded
        imported.log.exception(exc, "the app's lifespan shutdown")
    finally:
        imported.lifespan = None
        if isinstance(imported.app, WSGIMiddleware):
            imported.app.executor.shutdown(wait=False)  # its idle threads end now
        forget(imported.package)
