"""Validate a staged version before publish: a throwaway child imports and starts it.

This is the parent's side, `validate()`: it asks the fork server for the child
(polyserve.deploy.forkclient) or spawns one (`python -m polyserve.deploy.child`), reads
its result line and bounded output, ends it and what it left, and turns its answer into
the deploy's (a 422 saying what to fix). What the child does is polyserve.deploy.child.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from polyserve import procs
from polyserve.deploy.forkclient import Forked, fork
from polyserve.errors import ClientError

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
    secrets: Mapping[str, str] | None = None,
) -> dict[str, object]:
    """Return {"kind", "import_ms"} or raise ClientError(422) saying what to fix. `env` is
    the child's whole environment (the host passes one without its secrets); `deps` the
    version's installed dependency set (polyserve/deploy/deps.py), imported as a worker will.
    With `forkserver` (the master's fork server's name), the child is forked from that
    warm process; without one, or when it does not answer, a new interpreter, in
    namespaces of its own if `namespaces` and the host may make them. `secrets` are the
    space's, which the child reads on its stdin (a memfd), never in its environment."""
    argv = [str(root), entry, str(memory_mb), str(timeout), *([str(deps)] if deps else [])]
    stdin = _secrets_fd(secrets) if secrets else None
    proc = None
    try:
        proc = await fork(forkserver, argv, env, stdin) if forkserver else None
        if proc is None:
            spawned = await _spawn(argv if namespaces else ["--processes", *argv], env, stdin)
        if stdin is not None:  # the child holds its own copy now: none stays here
            os.close(stdin)
            stdin = None
        return await _wait(proc or spawned, entry, timeout)
    except _ServerGone:
        # The fork server died under this validation (killed, crashed, or killed by the
        # tenant's code): its child died with it. Once more, in a new interpreter.
        return await validate(root, entry, timeout, memory_mb, env, deps, None, namespaces, secrets)
    finally:
        if stdin is not None:
            os.close(stdin)
        if proc is not None:
            proc.close()  # the server ends what is left of the validation


def _secrets_fd(secrets: Mapping[str, str]) -> int:
    """An anonymous file holding the secrets as JSON, read from its start: what the
    child takes as its stdin. A memfd, not a pipe: no size makes its writer wait."""
    fd = os.memfd_create("polyserve-secrets", os.MFD_CLOEXEC)
    try:
        os.write(fd, json.dumps(dict(secrets)).encode())
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _ServerGone(Exception):
    pass


async def _spawn(
    argv: list[str], env: Mapping[str, str] | None, stdin: int | None = None
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "polyserve.deploy.child",
        *argv,
        stdin=asyncio.subprocess.DEVNULL if stdin is None else stdin,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=None if env is None else dict(env),
        start_new_session=True,  # so a timeout kills whatever the import spawned, too
    )


async def _wait(
    proc: asyncio.subprocess.Process | Forked, entry: str, timeout: float
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
        if _result(out) is None or not isinstance(proc, Forked):
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
    if not isinstance(proc, Forked):
        await _end(proc)  # its keeper exits once it has killed what the import left
    stderr = err.decode("utf-8", "replace")
    result = _result(out)
    if result is None:
        if isinstance(proc, Forked) and proc.server_gone:
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


async def _end(proc: asyncio.subprocess.Process | Forked) -> None:
    """End a validation: its keeper (`proc`) kills it and what it left, then exits; one
    that has not exited after _END_S (stopped, or its fork server is) is killed with its
    group."""
    if proc.returncode is None:
        _terminate(proc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), _END_S)
    procs.kill_group(proc.pid)


def _terminate(proc: asyncio.subprocess.Process | Forked) -> None:
    if proc.returncode is None:  # else reaped: its pid may name another process by now
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
