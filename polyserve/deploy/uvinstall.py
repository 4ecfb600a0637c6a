"""One uv run: install a requirement list into a directory, within the host's limits.

The run resolves and installs in one `uv pip install --target` with every host
distribution excluded (polyserve/deploy/requirements.py), no configuration file read and
an environment of the host's proxy and certificate settings only. It is watched: past
POLYSERVE_DEPS_TIMEOUT or POLYSERVE_DEPS_MAX_MB installed, uv and every build it started
are killed. Its failures are put in the deployer's words (a build that failed, no
solution, an index that did not answer), with uv's own output scrubbed of host paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from pathlib import Path

from polyserve import procs
from polyserve.deploy.requirements import Requested, host_packages
from polyserve.errors import ClientError, disk_full, disk_full_is_507
from polyserve.settings import Settings

OUTPUT_TAIL = 4000  # bytes of uv's output kept for the error body
# uv's words for a network failure (reqwest's and its own): the index did not answer.
_NETWORK = re.compile(
    r"error sending request|dns error|failed to lookup address|connection refused|"
    r"operation timed out|timed out|tcp connect error|failed to fetch|network|"
    r"connection reset|certificate",
    re.IGNORECASE,
)


def uv_command(
    requested_file: Path, target: Path, excludes: Path, settings: Settings, exact: bool = False
) -> list[str]:
    """The one uv run that resolves and installs a set: every host distribution excluded
    from the resolution, no configuration file read, the host's Python's tags. `exact`:
    the list is a whole resolved set's pins (a fleet host installing what the receiving
    host resolved), installed as they are, with no resolution of their dependencies."""
    import uv  # the uv package ships the binary; imported here, on the deploy path only

    command = [
        uv.find_uv_bin(),
        "pip",
        "install",
        "--no-config",
        "--python",
        sys.executable,
        "--target",
        str(target),
        "--requirements",
        str(requested_file),
        "--excludes",
        str(excludes),
        "--compile-bytecode",  # workers import from bytecode, as from a version's files
        "--no-progress",
        "--color",
        "never",
    ]
    if exact:
        command.append("--no-deps")
    if settings.deps_offline:
        command.append("--no-index")
    elif settings.deps_index_url:
        command += ["--default-index", settings.deps_index_url]
    for directory in settings.deps_find_links:
        command += ["--find-links", directory]
    return command


def requirements_file(work: Path) -> Path:
    """uv's input in an install's directory: the requirement lines asked for."""
    return work / "requirements.in"


def excludes_file(work: Path) -> Path:
    """uv's input in an install's directory: every host distribution, never resolved and
    never installed."""
    return work / "host.txt"


async def run(
    requested: Requested, work: Path, deps: Path, settings: Settings, exact: bool = False
) -> None:
    """Install `requested` into work/site with uv, or raise the ClientError that says why
    not: over the time limit (422) or the size limit (413), or uv's own failure. `exact`:
    see uv_command."""
    requirements, excludes = requirements_file(work), excludes_file(work)
    with disk_full_is_507():
        requirements.write_text("".join(f"{line}\n" for line in requested.lines))
        excludes.write_text("".join(f"{name}\n" for name in sorted(host_packages())))
    command = uv_command(requirements, work / "site", excludes, settings, exact)
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=_uv_environ(deps, settings),
        cwd=work,  # nothing of the host's working directory is read
        start_new_session=True,  # a timeout kills builds uv started, too
    )
    assert proc.stdout is not None
    cap = settings.deps_max_mb << 20
    try:
        output, over = await asyncio.wait_for(
            _watch(proc, proc.stdout, work / "site", cap), settings.deps_timeout
        )
    except TimeoutError:
        procs.kill_group(proc.pid)
        await proc.wait()
        raise ClientError(
            422,
            f"installing the dependencies did not finish within {settings.deps_timeout:g} s"
            " (POLYSERVE_DEPS_TIMEOUT): the package index did not answer in time, or a"
            " build took too long; nothing was published",
            source=requested.source,
        ) from None
    except BaseException:
        procs.kill_group(proc.pid)  # the deploy was cancelled: leave nothing running
        raise
    procs.kill_group(proc.pid)
    if over:
        raise ClientError(
            413,
            f"the dependencies take more than {settings.deps_max_mb} MiB installed"
            " (POLYSERVE_DEPS_MAX_MB); nothing was published",
            source=requested.source,
        )
    if proc.returncode != 0:
        raise _uv_failure(output.decode("utf-8", "replace"), requested.source, work, settings)


async def _watch(
    proc: asyncio.subprocess.Process, stream: asyncio.StreamReader, site: Path, cap: int
) -> tuple[bytes, bool]:
    """uv's output (its tail) once it exits, or as soon as the install passes the cap."""
    kept = bytearray()

    async def read() -> None:
        while chunk := await stream.read(64 << 10):
            kept.extend(chunk)
            del kept[:-OUTPUT_TAIL]

    reader = asyncio.ensure_future(read())
    exited = asyncio.ensure_future(proc.wait())
    try:
        while not exited.done():
            await asyncio.wait({exited}, timeout=0.25)
            # Counted as it grows, off the event loop: a set may be thousands of files.
            if await asyncio.to_thread(_size, site) > cap:
                procs.kill_group(proc.pid)
                await exited
                return bytes(kept), True
        await reader
    finally:
        reader.cancel()
        exited.cancel()
    return bytes(kept), await asyncio.to_thread(_size, site) > cap


def _size(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # uv renames as it goes
                total += os.lstat(os.path.join(directory, name)).st_size
    return total


def _uv_environ(deps: Path, settings: Settings) -> dict[str, str]:
    """uv's whole environment: the host's proxy and certificate settings, nothing else
    of it (no secrets, no UV_* of the operator's shell), and the cache on the data disk."""
    kept = {
        k: v
        for k, v in os.environ.items()
        if k in ("PATH", "HOME", "LANG", "SSL_CERT_FILE", "SSL_CERT_DIR", "TMPDIR")
        or k.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
    }
    # Each network attempt gets a share of the install's time, so an index that does
    # not answer is reported by uv itself (424) before the install's own limit (422).
    http_timeout = max(1, int(settings.deps_timeout / 4))
    return {
        **kept,
        "UV_CACHE_DIR": str(deps / "uv-cache"),
        "UV_HTTP_TIMEOUT": str(http_timeout),
        "UV_HTTP_RETRIES": "1",
        "UV_NO_PROGRESS": "1",
        "UV_PYTHON_DOWNLOADS": "never",
        "NO_COLOR": "1",
    }


def _uv_failure(output: str, source: str, work: Path, settings: Settings) -> ClientError:
    """uv's failure as the deployer needs it: which kind, and uv's own words."""
    text = _scrub(output, work, settings)
    message = text.strip().splitlines()
    # uv starts its error at a line beginning `error:` (or a multiplication sign, for a
    # build failure).
    start = next(
        (i for i, line in enumerate(message) if line.startswith(("error:", "\u00d7"))),
        max(0, len(message) - 20),
    )
    detail = "\n".join(message[start:])[-OUTPUT_TAIL:]
    if "No space left on device" in text:
        return disk_full()
    if re.search(r"failed to build|build backend|failed to prepare|build failed", text, re.I):
        return ClientError(
            422,
            "building a dependency from its source distribution failed: ask for a version"
            " with a wheel, or fix its build",
            source=source,
            uv=detail,
        )
    if "No solution found" in text or "not found in the package registry" in text:
        return ClientError(
            422,
            "the dependencies cannot be resolved: no set of versions satisfies them from"
            " this host's package index",
            source=source,
            uv=detail,
        )
    if _NETWORK.search(text):
        return ClientError(
            424,
            "the package index did not answer: nothing was installed or published; deploy"
            " again later (POLYSERVE_DEPS_INDEX_URL)",
            source=source,
            uv=detail,
        )
    return ClientError(422, "installing the dependencies failed", source=source, uv=detail)


def _scrub(text: str, work: Path, settings: Settings) -> str:
    """uv's output without the host's paths: the install's own directory and the data dir."""
    text = text.replace(str(work) + os.sep, "").replace(str(work), ".")
    for directory in settings.deps_find_links:
        text = text.replace(directory, "<find-links>")
    return re.sub(r"(?<![\w.])/(?:[^\s\"':,()/]+/)+", "", text)
