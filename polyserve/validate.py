"""Import a staged version in a throwaway subprocess (timeout, address-space limit) before publish.

The parent side is `validate()`. The child (`python -m polyserve.validate ROOT ENTRY
MEMORY_MB`) byte-compiles the version, imports its entry the way a worker will, and
writes one JSON line to its original stdout; tenant output is moved to stderr first.
"""

from __future__ import annotations

import asyncio
import compileall
import contextlib
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

from polyserve.store import StoreError

_STDERR_TAIL = 2000


async def validate(root: Path, entry: str, timeout: float, memory_mb: int) -> dict[str, object]:
    """Return {"kind", "import_ms"} or raise StoreError(422) saying what to fix."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "polyserve.validate",
        str(root),
        entry,
        str(memory_mb),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # so a timeout kills whatever the import spawned, too
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        raise StoreError(
            422,
            f"import of {entry} did not finish within {timeout:g} s"
            " (POLYSERVE_IMPORT_TIMEOUT): move slow work out of module level",
        ) from None
    except BaseException:
        _kill_group(proc.pid)  # the deploy request was cancelled: leave nothing running
        raise
    _kill_group(proc.pid)  # children the import left behind
    stderr = err.decode("utf-8", "replace")[-_STDERR_TAIL:]
    try:
        result = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        how = (
            f"signal {signal.Signals(-proc.returncode).name}"
            if proc.returncode < 0
            else f"exit code {proc.returncode}"
        )
        raise StoreError(
            422,
            f"import of {entry} ended the process ({how}) before it finished",
            stderr=stderr,
        ) from None
    if not result.get("ok"):
        raise StoreError(
            422,
            str(result["message"]),
            file=result.get("file"),
            line=result.get("line"),
            stderr=stderr,
        )
    return {"kind": result["kind"], "import_ms": result["import_ms"]}


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(pid, signal.SIGKILL)


def main(argv: list[str]) -> None:
    root, entry, memory_mb = Path(argv[0]), argv[1], int(argv[2])
    result_fd = os.dup(1)
    os.dup2(2, 1)  # tenant prints must not corrupt the result line
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Compile every module now: workers then load bytecode (this environment may set
    # PYTHONDONTWRITEBYTECODE, so nothing else would write it). Files that do not
    # compile are reported by the import below if the entry actually uses them.
    compileall.compile_dir(str(root), quiet=2, workers=1)
    from polyserve import loader

    started = time.perf_counter()
    try:
        imported = loader.import_version("validate/space", 0, root, entry)
        result = {
            "ok": True,
            "kind": imported.kind,
            "import_ms": round((time.perf_counter() - started) * 1000, 3),
        }
    except loader.LoadError as exc:
        result = {"ok": False, **exc.details}
        result["message"] = result.pop("error")
        if isinstance(exc.__cause__, MemoryError):
            result["message"] = (
                f"import of {entry} exceeded the validator's {memory_mb} MiB"
                " address-space limit (POLYSERVE_IMPORT_MEMORY_MB)"
            )
    os.write(result_fd, (json.dumps(result) + "\n").encode())
    # Skip interpreter shutdown: tenant threads or atexit hooks must not hang the deploy.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
