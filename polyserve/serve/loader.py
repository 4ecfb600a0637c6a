"""Import one space version into a fresh module namespace, adapt it to ASGI, run its lifespan.

Each version becomes a package with a unique name (``_ps_<owner>__<name>__v<n>_<k>``)
whose ``__path__`` is the version directory, so ``from . import helpers`` works. Every
module of the version also gets its own ``__builtins__`` whose ``__import__`` maps a
top-level name that the version ships (``import helpers``) to the version's own module.
Because a function looks builtins up through its module's globals, that holds for
imports run lazily inside a handler at request time too, and costs other code nothing.

A version with dependencies (polyserve/deploy/deps.py) has its installed set as a second
directory of its package: the set's top-level names are mapped the same way, its modules
get the same builtins, so each version imports its own copy of each pure-Python
dependency, and `importlib.metadata` called from the version's code finds the set's
distributions. Compiled extension modules are loaded once per file (see
_SharedExtensionLoader).
"""

from __future__ import annotations

import asyncio
import builtins
import importlib
import importlib.machinery
import inspect
import itertools
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.to_thread
import orjson
from a2wsgi import WSGIMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:  # numpy comes with it: imported only once a model space needs it
    from polyserve.serve import modelspace

from polyserve.logs import spacelog

_real_import = builtins.__import__
MESSAGE_MAX = 2000
DEFAULT_THREADS = 8  # POLYSERVE_SPACE_THREADS
_counter = itertools.count(1)
_counter_lock = threading.Lock()
_NOT_WORD = re.compile(r"\W")  # compiled here: the first load of a worker paid it, 0.5 ms
_MODULE_SUFFIXES = (".py", *importlib.machinery.EXTENSION_SUFFIXES)


class LoadError(Exception):
    """A version that cannot be imported or started; details say where and why."""

    def __init__(self, error: str, **details: object) -> None:
        if len(error) > MESSAGE_MAX:  # an exception's text is the tenant's: bound it
            error = error[:MESSAGE_MAX] + f"… ({len(error)} characters)"
        super().__init__(error)
        self.details = {"error": error, **details}


# -- the import machinery -----------------------------------------------------------


class _SpaceLoader(importlib.machinery.SourceFileLoader):
    """A source loader that hands each module the version's own builtins before exec."""

    def __init__(self, fullname: str, path: str, space_builtins: dict[str, Any]) -> None:
        super().__init__(fullname, path)
        self.space_builtins = space_builtins

    def exec_module(self, module: Any) -> None:
        module.__dict__["__builtins__"] = self.space_builtins
        super().exec_module(module)


# A C extension module cannot be initialised twice from one file: the dynamic linker
# hands back the same library (by inode), whose static state is already set up, and many
# modules (pybind11's, single-phase C ones) fail or misbehave on a second init. So every
# version that imports the same file, under whatever package name, gets the one module.
_extensions: dict[tuple[int, int], Any] = {}
_extensions_lock = threading.Lock()


class _SharedExtensionLoader(importlib.machinery.ExtensionFileLoader):
    """Loads an extension module file once per process (by device and inode)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        st = os.stat(self.path)
        self.key = (st.st_dev, st.st_ino)
        with _extensions_lock:
            self.shared = _extensions.get(self.key)
        if self.shared is not None:
            return self.shared
        return super().create_module(spec)

    def exec_module(self, module: Any) -> None:
        if self.shared is not None:
            return  # initialised already, under another version's name
        super().exec_module(module)
        with _extensions_lock:
            _extensions.setdefault(self.key, module)


class _SpaceFinder:
    """Finds the modules of registered version packages; registered once on sys.meta_path."""

    def __init__(self) -> None:
        # package -> (its directories: the version's, then its dependency set's; builtins)
        self.packages: dict[str, tuple[list[Path], dict[str, Any]]] = {}

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        top, dot, _ = fullname.partition(".")
        found = self.packages.get(top)
        if found is None:
            return None
        roots, space_builtins = found
        if not dot:  # the version package itself: a namespace over the version dir
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(root) for root in roots]
            return spec
        details: list[tuple[Any, list[str]]] = [
            (
                partial(_SpaceLoader, space_builtins=space_builtins),
                importlib.machinery.SOURCE_SUFFIXES,
            ),
            (_SharedExtensionLoader, importlib.machinery.EXTENSION_SUFFIXES),
        ]
        portions: list[str] = []
        for entry in path or ():
            module = importlib.machinery.FileFinder(entry, *details).find_spec(fullname, target)
            if module is not None and module.loader is not None:
                return module
            if module is not None:  # a directory without __init__.py: look further first
                portions += module.submodule_search_locations or ()
        if portions:  # as sys.path does: a namespace package only when nothing else matched
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = portions
            return spec
        return None

    def find_distributions(self, context: Any = None) -> Any:
        """importlib.metadata's hook: for code of a version with dependencies, the
        distributions of its set (before the host's, as they come first here)."""
        from importlib.metadata import DistributionFinder, MetadataPathFinder

        if context is not None and "path" in vars(context):
            return iter(())  # an explicit path was asked for: only that
        roots = self._caller_roots()
        if roots is None or len(roots) < 2:
            return iter(())
        name = getattr(context, "name", None)
        return MetadataPathFinder.find_distributions(
            DistributionFinder.Context(name=name, path=[str(roots[1])])
        )

    def _caller_roots(self) -> list[Path] | None:
        """The directories of the version whose code is asking, from the nearest frame
        of one of its modules; None for the host's own code."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_globals.get("__name__")
            if isinstance(name, str) and name.startswith("_ps_"):
                found = self.packages.get(name.partition(".")[0])
                if found is not None:
                    return found[0]
            frame = frame.f_back  # type: ignore[assignment]
        return None


_finder = _SpaceFinder()
sys.meta_path.insert(0, _finder)


def _space_builtins(package: str, top_names: frozenset[str]) -> dict[str, Any]:
    def space_import(
        name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
    ) -> Any:
        top = name.partition(".")[0]
        if level == 0 and top in top_names:
            module = _real_import(f"{package}.{name}", globals, locals, fromlist, 0)
            return module if fromlist else sys.modules[f"{package}.{top}"]
        return _real_import(name, globals, locals, fromlist, level)

    space = dict(builtins.__dict__)
    space["__import__"] = space_import
    return space


def _top_names(root: Path) -> frozenset[str]:
    """Module and package names at the top of a version (or of its dependency set): what
    `import x` may mean there."""
    names = set()
    with os.scandir(root) as entries:
        for entry in entries:
            name = entry.name
            if entry.is_dir():
                if name.isidentifier() and name != "__pycache__":
                    names.add(name)
            elif name.endswith(_MODULE_SUFFIXES):
                names.add(name.split(".", 1)[0])
    return frozenset(names)


# -- one imported version -----------------------------------------------------------------


@dataclass
class Imported:
    """A version imported into this process, ready to serve once started."""

    space: str
    version: int
    package: str
    module: Any
    kind: str  # "app" (ASGI), "wsgi", "handle" or "model" (an InferenceApp)
    app: ASGIApp
    root: Path  # the version's directory
    log: spacelog.Tag  # what its code says is attributed to it (dispatch sets CURRENT)
    state: dict[str, Any] = field(default_factory=dict)  # the lifespan state, per ASGI
    lifespan: _Lifespan | None = None


def import_version(
    space: str,
    version: int,
    root: Path,
    entry: str,
    threads: int = DEFAULT_THREADS,
    deps: Path | None = None,
) -> Imported:
    """Import a version's entry module under a fresh package name (thread-safe); a sync
    handle() gets `threads` worker threads at most. `deps` is its installed dependency
    set: the version's own modules shadow it, as a script's directory shadows sys.path."""
    with _counter_lock:
        n = next(_counter)
    package = "_ps_" + _NOT_WORD.sub("_", space.replace("/", "__")) + f"__v{version}_{n}"
    root = Path(root)
    if deps is not None and not Path(deps).is_dir():
        raise LoadError(
            f"the dependency set of {space} v{version} is missing from the data directory:"
            " deploy the space again to install it"
        )
    roots = [root] if deps is None else [root, Path(deps)]
    names = frozenset().union(*(_top_names(r) for r in roots))
    _finder.packages[package] = (roots, _space_builtins(package, names))
    tag = spacelog.tag(space, version, root)
    speaking = spacelog.CURRENT.set(tag)  # what the module prints at import is the space's
    try:
        app: ASGIApp
        if entry.endswith(".onnx"):  # a model space: the host's own app serves the file
            module, kind, app = None, "model", _model_app(root / entry, threads)
        else:
            module = importlib.import_module(f"{package}.{entry.removesuffix('.py')}")
            kind, app = _find_callable(module, entry, threads)
        if kind == "model":
            model = cast("modelspace.InferenceApp", app)
            model.version, model.versions_dir = version, root.parent
    except LoadError as exc:
        forget(package)
        tag.record(logging.ERROR, "stderr", f"import failed: {exc}", time.time())
        raise
    except (Exception, SystemExit) as exc:  # sys.exit() at import is the tenant's error too
        forget(package)
        tag.exception(exc, f"the import of {entry}")
        raise LoadError(**describe(exc, root)) from exc  # type: ignore[arg-type]
    finally:
        spacelog.CURRENT.reset(speaking)
    return Imported(space, version, package, module, kind, app, root, tag)


def _find_callable(module: Any, entry: str, threads: int) -> tuple[str, ASGIApp]:
    app = getattr(module, "app", None)
    if app is not None:
        if not callable(app):
            raise LoadError(f"{entry}: `app` must be an ASGI or WSGI application (a callable)")
        models = sys.modules.get("polyserve.serve.modelspace")  # imported by inference_app
        if models is not None and isinstance(app, models.InferenceApp):
            return "model", app
        if is_wsgi(app):
            # Flask, Django, any WSGI app, unchanged: a2wsgi runs it on a thread pool of
            # the space's own size, as a sync handle() gets.
            # a2wsgi types scope, receive and send with TypedDicts of its own.
            wsgi: ASGIApp = WSGIMiddleware(app, workers=threads)  # type: ignore[assignment]
            return "wsgi", wsgi
        return "app", app
    handle = getattr(module, "handle", None)
    if handle is not None:
        if not callable(handle):
            raise LoadError(f"{entry}: `handle` must be a function taking a request")
        return "handle", HandleApp(handle, threads)
    raise LoadError(
        f"{entry} defines neither `app` (an ASGI application) nor `handle(request)`:"
        " export one of them at module level",
        file=entry,
    )


def _model_app(path: Path, threads: int) -> modelspace.InferenceApp:
    """A deployed model file's app; a file onnxruntime cannot serve is a LoadError."""
    from polyserve.models import onnx_session
    from polyserve.serve import modelspace

    try:
        # One copy of the weights per host, as a space's own onnx_session() gives.
        return modelspace.InferenceApp(modelspace.Model(onnx_session(path)), threads=threads)
    except modelspace.ModelError as exc:
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


def forget(package: str) -> None:
    """Drop every module of a version package so nothing here references it any more."""
    _finder.packages.pop(package, None)
    prefix = package + "."
    for name in [n for n in sys.modules if n == package or n.startswith(prefix)]:
        del sys.modules[name]


def describe(exc: BaseException, root: Path) -> dict[str, object]:
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


# -- handle() as ASGI ------------------------------------------------------------------------


class HandleApp:
    """Adapts `handle(request)` to ASGI. A sync handle runs on a worker thread, like
    Starlette's, but under a limiter of its own: a space that blocks all of its threads
    delays its own requests, never another space's or the host's."""

    def __init__(self, handle: Callable[[Request], Any], threads: int = DEFAULT_THREADS) -> None:
        self.handle = handle
        call = getattr(handle, "__call__", None)  # noqa: B004 - async __call__ objects
        self.is_async = inspect.iscoroutinefunction(handle) or inspect.iscoroutinefunction(call)
        self.threads = threads
        # Made on the event loop at the first sync call: the import runs on a thread.
        self.limiter: anyio.CapacityLimiter | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        response = to_response(await self.result(Request(scope, receive, send)))
        await response(scope, receive, send)

    async def result(self, request: Request) -> Any:
        """What handle() returned, not sent yet: dispatch sends the common answers itself
        (Dispatch._call), and to_response() makes a Response of the rest."""
        if self.is_async:
            return await self.handle(request)
        if self.limiter is None:
            self.limiter = anyio.CapacityLimiter(self.threads)
        return await anyio.to_thread.run_sync(self.handle, request, limiter=self.limiter)


def is_plain(response: Response) -> bool:
    """A body in memory and nothing to run after it: sending it runs no tenant code, so
    the request's time and count are settled before it is sent."""
    return type(response).__call__ is Response.__call__ and response.background is None


_ORJSON = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def json_body(result: dict[Any, Any] | list[Any]) -> bytes | None:
    """A dict's or list's JSON, or None where orjson cannot encode it (e.g. an int past 64
    bits, a set): to_response() then gives the stdlib's answer, or its error. orjson: 10x
    the stdlib's encoder, the same compact UTF-8 for what JSON allows, and numpy arrays
    and scalars (a model's output) as lists and numbers."""
    try:
        return orjson.dumps(result, option=_ORJSON)
    except TypeError:
        return None


def json_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    """The headers Starlette's Response(body, media_type="application/json") sends."""
    return [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]


def to_response(result: Any) -> Response:
    """Starlette's Response as is; dict/list as JSON; str text; bytes octet-stream; None 204."""
    if isinstance(result, Response):
        return result
    if isinstance(result, dict | list):
        body = json_body(result)
        if body is None:
            return JSONResponse(result)
        return Response(body, media_type="application/json")
    if isinstance(result, str):
        return PlainTextResponse(result)
    if isinstance(result, bytes | bytearray | memoryview):
        return Response(bytes(result), media_type="application/octet-stream")
    if result is None:
        return Response(status_code=204)
    return JSONResponse(
        {
            "error": f"handle() returned {type(result).__name__}: return a Response, dict, list,"
            " str, bytes or None"
        },
        status_code=500,
    )


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
    speaking = spacelog.CURRENT.set(imported.log)
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
        spacelog.CURRENT.reset(speaking)


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
