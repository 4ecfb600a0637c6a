"""The validation child: import a staged version as a worker will, start it, and report.

It runs either as a new interpreter (`python -m polyserve.deploy.child [--processes]
ROOT ENTRY MEMORY_MB TIMEOUT [DEPS]`, spawned by polyserve.deploy.validate) or in a fork
of the fork server (polyserve.deploy.forkloop), in the sandbox of polyserve.deploy.sandbox
(`--processes`: without namespaces). Either way it takes the request's pipes, environment
and argv, byte-compiles the version, then on an event loop like a worker's imports its
entry on a worker thread, runs the ASGI lifespan startup and shutdown, and writes one JSON
line to its original stdout; tenant output is moved to stderr first.
"""

from __future__ import annotations

import asyncio
import compileall
import contextlib
import json
import logging
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from polyserve import devices, procs
from polyserve.deploy import sandbox
from polyserve.usage.meter import anon_bytes

EXIT_CHILD_FAILED = 70  # EX_SOFTWARE: a fork of the server failed before run() took over


# -- a fork of the fork server, before it validates ---------------------------------------


def in_child(run: Callable[..., None], *args: Any) -> NoReturn:
    """Run a forked child's code. Whatever happens, never return into the server's loop,
    and never run the exit handlers of what the server loaded: onnxruntime's hang in a
    forked child (see hooks.worker_exit)."""
    try:
        run(*args)  # a validation ends with os._exit
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
            sys.stderr.flush()
    os._exit(EXIT_CHILD_FAILED)


def detach(server: int) -> None:
    """In a fork of the server `server`: its own session, and death with the server."""
    os.setsid()  # its own group: the timeout kills whatever the import spawned
    # Nothing outlives the server (the master stops it, or it dies with it).
    procs.die_with_parent(signal.SIGKILL)
    if os.getppid() != server:
        os._exit(EXIT_CHILD_FAILED)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def become(argv: list[str], env: dict[str, str] | None, fds: list[int]) -> None:
    """Take the request's pipes (stdout, stderr, and stdin when the space has secrets),
    environment and argv, as a spawned validator has them."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fds[2] if len(fds) > 2 else null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        os.close(fd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    sys.argv = [__file__, *argv]


def forked(namespaces: bool, argv: list[str], env: dict[str, str] | None, fds: list[int]) -> None:
    """In a fork of the server for a request: become what a spawned validator is, and run."""
    sandbox.contain(namespaces)
    become(argv, env, fds)
    main(argv)  # ends with os._exit


# -- the validation ---------------------------------------------------------------------


async def _check(
    root: Path,
    entry: str,
    timeout: float,
    deps: Path | None = None,
    values: dict[str, str] | None = None,
) -> tuple[dict[str, object], object]:
    """What a worker does with a version: import on a worker thread, start, and stop.
    Returns the result line and, for a failure, what caused it."""
    import anyio.to_thread

    from polyserve.serve import loader

    # anyio starts its worker threads at first use; a worker pays that at boot (a fork
    # server's spare before its request), so the import time reported is the module's own.
    await anyio.to_thread.run_sync(lambda: None)
    before = anon_bytes()
    started = time.perf_counter()
    try:
        imported = await anyio.to_thread.run_sync(
            loader.import_version,
            "validate/space",
            0,
            root,
            entry,
            loader.DEFAULT_THREADS,
            deps,
            values,
        )
        await loader.start(imported, timeout)
    except loader.LoadError as exc:
        return {"ok": False, **exc.details}, exc.__cause__
    import_ms = round((time.perf_counter() - started) * 1000, 3)
    # What the load added to this process, measured as a worker's memory cap measures it.
    grew = max(anon_bytes() - before, 0)
    await loader.stop(imported, timeout)
    result: dict[str, object] = {
        "ok": True,
        "kind": imported.kind,
        "import_ms": import_ms,
        "memory_bytes": grew,
    }
    model = getattr(imported.app, "model", None) if imported.kind == "model" else None
    if model is not None:
        result |= model.tensor_metadata()
    return result, None


def runner() -> asyncio.Runner:
    """A runner of the event loop workers run (uvicorn's "auto": uvloop when installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def main(argv: list[str]) -> None:
    """The validator of a new interpreter, or of a child the fork server forked for it."""
    # Not closed: closing would wait for threads and tasks the tenant left running.
    runner().run(run(argv))


async def run(argv: list[str]) -> NoReturn:
    """Validate the version `argv` names, write the result line, and exit. Run on the
    event loop: main()'s, or the one a fork server's spare set up while it waited."""
    root, entry, memory_mb, timeout = Path(argv[0]), argv[1], int(argv[2]), float(argv[3])
    deps = Path(argv[4]) if len(argv) > 4 else None
    values = _take_secrets()
    result_fd = os.dup(1)
    os.dup2(2, 1)  # tenant prints must not corrupt the result line
    # A worker echoes a space's exceptions to the host log (polyserve.logs.spacelog); here
    # the answer says what failed, and the stderr it quotes is the tenant's own output.
    logging.getLogger("polyserve.space").disabled = True
    limit = memory_mb << 20
    if devices.assigned() is None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # A GPU worker's validation runs on its GPU (the worker's environment names it), so
    # that a session onnxruntime would put on the CPU is refused here, at deploy, as the
    # worker would refuse it. CUDA reserves address space far past any such limit (its
    # unified addressing), so there the limit would refuse every CUDA load: left unset.
    # Compile every module now: workers then load bytecode (this environment may set
    # PYTHONDONTWRITEBYTECODE, so nothing else would write it). Files that do not
    # compile are reported by the import below if the entry actually uses them.
    compileall.compile_dir(str(root), quiet=2, workers=1)
    if devices.assigned() is None and any(
        root.rglob("*.onnx")
    ):  # and the models it may load get prepacked weights built
        from polyserve.models import prepacked

        prepacked.PREPARE = True
    if devices.assigned() is not None:
        # As a GPU worker opens its context at boot: its cost is not the version's
        # memory_bytes or import_ms.
        from polyserve.serve import gpu

        gpu.open_context()
    result, cause = await _check(root, entry, timeout, deps, values)
    if isinstance(cause, MemoryError):
        result["error"] = (
            f"import of {entry} exceeded the validator's {memory_mb} MiB"
            " address-space limit (POLYSERVE_IMPORT_MEMORY_MB)"
        )
    os.write(result_fd, (json.dumps(result) + "\n").encode())
    # The parent has its answer when these pipes end: close them now rather than in the
    # exit's teardown of this address space, which comes first and is slower
    # (bench/NOTES.md, "Figures moved out of code comments (issue 26)").
    os.closerange(0, 3)
    os.close(result_fd)
    # Skip interpreter shutdown: tenant threads or atexit hooks must not hang the deploy.
    os._exit(0)


def _take_secrets() -> dict[str, str]:
    """The space's secrets, which the worker put on stdin (nothing: none), read whole;
    stdin is /dev/null from here on. They reach the version through polyserve.secrets
    only, as in a worker: never the environment."""
    data = bytearray()
    while chunk := os.read(0, 1 << 16):
        data += chunk
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    found = json.loads(data) if data else {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


if __name__ == "__main__":
    # A new interpreter keeps the validation it forks (a fork server's child is one already).
    processes = sys.argv[1:2] == ["--processes"]
    sandbox.contain(namespaces=not processes)
    main(sys.argv[2 if processes else 1 :])
