"""Import and start a staged version as a worker will, in a throwaway subprocess, before publish.

The parent side is `validate()`. The child (`python -m polyserve.deploy.validate [--processes]
ROOT ENTRY MEMORY_MB TIMEOUT [DEPS]`, or the same `child` in a fork of polyserve.deploy.forkserver)
runs in the sandbox of polyserve.deploy.sandbox (`--processes`: without namespaces),
byte-compiles the version, then on an event loop like a worker's imports its entry on a
worker thread, runs the ASGI lifespan startup and shutdown, and writes one JSON line to
its original stdout; tenant output is moved to stderr first.
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
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from polyserve import procs
from polyserve.deploy import forkserver as forkserver_mod
from polyserve.deploy import sandbox
from polyserve.errors import ClientError
from polyserve.usage.meter import anon_bytes

STDERR_TAIL = 2000  # bytes of the import's stderr kept for the error body
_RESULT_MAX = 64 << 10  # the result line is small; anything past this is tenant noise
_CHUNK = 64 << 10
_END_S = 5.0  # how long an ended validation's keeper has to clean up before it is killed


async def validate(
    root: Path,
    entry: str,
    timeout: float,
    memory_mb: int,
    env: Mapping[str, str] | None = None,
    deps: Path | None = None,
    forkserver: str | None = None,
    namespaces: bool = True,
) -> dict[str, object]:
    """Return {"kind", "import_ms"} or raise ClientError(422) saying what to fix. `env` is
    the child's whole environment (the host passes one without its secrets); `deps` the
    version's installed dependency set (polyserve/deploy/deps.py), imported as a worker will.
    With `forkserver` (the master's fork server's name), the child is forked from that
    warm process; without one, or when it does not answer, a new interpreter, in
    namespaces of its own if `namespaces` and the host may make them."""
    argv = [str(root), entry, str(memory_mb), str(timeout), *([str(deps)] if deps else [])]
    proc = await forkserver_mod.fork(forkserver, argv, env) if forkserver else None
    try:
        if proc is None:
            spawned = await _spawn(argv if namespaces else ["--processes", *argv], env)
        return await _wait(proc or spawned, entry, timeout)
    except _ServerGone:
        # The fork server died under this validation (killed, crashed, or killed by the
        # tenant's code): its child died with it. Once more, in a new interpreter.
        return await validate(root, entry, timeout, memory_mb, env, deps, None, namespaces)
    finally:
        if proc is not None:
            proc.close()  # the server ends what is left of the validation


class _ServerGone(Exception):
    pass


async def _spawn(argv: list[str], env: Mapping[str, str] | None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "polyserve.deploy.validate",
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=None if env is None else dict(env),
        start_new_session=True,  # so a timeout kills whatever the import spawned, too
    )


async def _wait(
    proc: asyncio.subprocess.Process | forkserver_mod.Forked, entry: str, timeout: float
) -> dict[str, object]:
    """Read the child's result line and bounded output; end the validation (and what it
    left) once it has answered or at the timeout."""
    stdout, stderr_pipe = proc.stdout, proc.stderr
    assert stdout is not None and stderr_pipe is not None

    async def finished() -> tuple[bytes, bytes]:
        # Both pipes are drained as they fill, keeping a bounded head of stdout and tail
        # of stderr: a module that prints hundreds of MiB costs the worker nothing.
        out, err = await asyncio.gather(
            _read_bounded(stdout, _RESULT_MAX, keep_tail=False),
            _read_bounded(stderr_pipe, STDERR_TAIL, keep_tail=True),
        )
        # Without an answer, how the process ended says why. A spawned child is this
        # process's to reap; a forked one the fork server reaps (and kills its group).
        if _result(out) is None or not isinstance(proc, forkserver_mod.Forked):
            await proc.wait()
        return out, err

    try:
        out, err = await asyncio.wait_for(finished(), timeout)
    except TimeoutError:
        await _end(proc)
        raise ClientError(
            422,
            f"import of {entry} did not finish within {timeout:g} s"
            " (POLYSERVE_IMPORT_TIMEOUT): move slow work out of module level",
        ) from None
    except BaseException:
        # The deploy request was cancelled: leave nothing running. The keeper kills the
        # validation and what it left (a forked one's server is told by the hang-up).
        _terminate(proc)
        raise
    if not isinstance(proc, forkserver_mod.Forked):
        await _end(proc)  # its keeper exits once it has killed what the import left
    stderr = err.decode("utf-8", "replace")
    result = _result(out)
    if result is None:
        if isinstance(proc, forkserver_mod.Forked) and proc.server_gone:
            raise _ServerGone from None
        how = (
            f"signal {signal.Signals(-proc.returncode).name}"
            if proc.returncode is not None and proc.returncode < 0
            else f"exit code {proc.returncode}"
        )
        raise ClientError(
            422,
            f"import of {entry} ended the process ({how}) before it finished",
            stderr=stderr,
        )
    if not result.get("ok"):
        raise ClientError(
            422,
            str(result["error"]),
            file=result.get("file"),
            line=result.get("line"),
            stderr=stderr,
        )
    checked = {"kind": result["kind"], "import_ms": result["import_ms"]}
    checked["memory_bytes"] = result.get("memory_bytes", 0)  # the deploy checks, then drops it
    if result["kind"] == "model":  # what the protocol's metadata will say of it
        checked |= {"inputs": result.get("inputs"), "outputs": result.get("outputs")}
    return checked


def _result(out: bytes) -> dict[str, object] | None:
    """The child's result line, the last line of its stdout; None if it wrote none."""
    try:
        result = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return result if isinstance(result, dict) else None


async def _read_bounded(stream: asyncio.StreamReader, keep: int, keep_tail: bool) -> bytes:
    """Read a pipe to its end, keeping at most `keep` bytes: its head or its tail."""
    kept = bytearray()
    while chunk := await stream.read(_CHUNK):
        if keep_tail:
            kept += chunk
            del kept[:-keep]
        elif len(kept) < keep:
            kept += chunk[: keep - len(kept)]
    return bytes(kept)


async def _end(proc: asyncio.subprocess.Process | forkserver_mod.Forked) -> None:
    """End a validation: its keeper (`proc`) kills it and what it left, then exits; one
    that has not exited after _END_S (stopped, or its fork server is) is killed with its
    group."""
    if proc.returncode is None:
        _terminate(proc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), _END_S)
    procs.kill_group(proc.pid)


def _terminate(proc: asyncio.subprocess.Process | forkserver_mod.Forked) -> None:
    if proc.returncode is None:  # else reaped: its pid may name another process by now
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)


# -- the child --------------------------------------------------------------------------


async def _check(
    root: Path, entry: str, timeout: float, deps: Path | None = None
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
            loader.import_version, "validate/space", 0, root, entry, loader.DEFAULT_THREADS, deps
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
        result |= model.describe()
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
    runner().run(child(argv))


async def child(argv: list[str]) -> NoReturn:
    """Validate the version `argv` names, write the result line, and exit. Run on the
    event loop: main()'s, or the one a fork server's spare set up while it waited."""
    root, entry, memory_mb, timeout = Path(argv[0]), argv[1], int(argv[2]), float(argv[3])
    deps = Path(argv[4]) if len(argv) > 4 else None
    result_fd = os.dup(1)
    os.dup2(2, 1)  # tenant prints must not corrupt the result line
    # A worker echoes a space's exceptions to the host log (polyserve.logs.spacelog); here the
    # answer says what failed, and the stderr it quotes is the tenant's own output.
    logging.getLogger("polyserve.space").disabled = True
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Compile every module now: workers then load bytecode (this environment may set
    # PYTHONDONTWRITEBYTECODE, so nothing else would write it). Files that do not
    # compile are reported by the import below if the entry actually uses them.
    compileall.compile_dir(str(root), quiet=2, workers=1)
    result, cause = await _check(root, entry, timeout, deps)
    if isinstance(cause, MemoryError):
        result["error"] = (
            f"import of {entry} exceeded the validator's {memory_mb} MiB"
            " address-space limit (POLYSERVE_IMPORT_MEMORY_MB)"
        )
    os.write(result_fd, (json.dumps(result) + "\n").encode())
    # The parent has its answer when these pipes end: close them now rather than in the
    # exit's teardown of this address space, which comes first and takes milliseconds.
    os.closerange(0, 3)
    os.close(result_fd)
    # Skip interpreter shutdown: tenant threads or atexit hooks must not hang the deploy.
    os._exit(0)


if __name__ == "__main__":
    # A new interpreter keeps the validation it forks (a fork server's child is one already).
    processes = sys.argv[1:2] == ["--processes"]
    sandbox.contain(namespaces=not processes)
    main(sys.argv[2 if processes else 1 :])
