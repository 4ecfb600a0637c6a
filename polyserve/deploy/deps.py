"""A space's dependency set: installed with uv once per host, shared by every version using it.

Layout under POLYSERVE_DATA_DIR/deps::

    sets/<hash>/site/       one installed set (`uv pip install --target`), immutable,
                            named by the hash of the resolved set: shared by every
                            version and space whose requirements resolve to it
    sets/<hash>/set.json    what is in it: packages, size, compiled modules
    requests/<key>          the set a requirement list resolved to (the cache a deploy
                            with the same list hits before any resolution)
    uv-cache/               uv's cache, on the same disk so installs hard-link from it
    tmp/<random>/           an install in progress, renamed into sets/ when complete

The host's own distributions are never installed again and never replaced: uv resolves
with every one of them excluded (polyserve/deploy/requirements.py checked the space's own
requirements on them), each installed package's requirements on them (with the extras
asked of it) are checked here, and so is every module at the top of the set: none may
be one the host imports, whatever distribution ships it.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.parser
import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from polyserve import procs
from polyserve.deploy.requirements import (
    Requested,
    check_host_version,
    host_modules,
    host_packages,
    python_tag,
)
from polyserve.errors import DISK_FULL, ClientError
from polyserve.settings import Settings
from polyserve.state.files import write_atomic

ECHO_CHARS = 200

OUTPUT_TAIL = 4000  # bytes of uv's output kept for the error body
# uv's words for a network failure (reqwest's and its own): the index did not answer.
_NETWORK = re.compile(
    r"error sending request|dns error|failed to lookup address|connection refused|"
    r"operation timed out|timed out|tcp connect error|failed to fetch|network|"
    r"connection reset|certificate",
    re.IGNORECASE,
)
_EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)
_MODULE_SUFFIXES = (".py", ".pyc", *_EXTENSION_SUFFIXES)


@dataclass
class Installed:
    """A dependency set ready to import, and what this deploy did to get it."""

    digest: str
    site: Path  # the directory the loader maps the set's top-level names into
    packages: list[str]  # "name==version" of the whole set
    source: str
    from_host: list[str]
    installed: list[str] = field(default_factory=list)  # empty: the set was there already
    install_ms: float = 0.0

    def answer(self) -> dict[str, object]:
        """The deploy answer's (and the version metadata's) `dependencies`."""
        return {
            "source": self.source,
            "set": self.digest,
            "packages": self.packages,
            "from_host": self.from_host,
            "installed": self.installed,
            "cached": not self.installed,
            "install_ms": self.install_ms,
        }


def site_dir(data_dir: Path, digest: str) -> Path:
    """Where set `digest` is installed: what the loader maps into a version."""
    return data_dir / "deps" / "sets" / digest / "site"


# -- installing a set --------------------------------------------------------------------


async def install(requested: Requested, data_dir: Path, settings: Settings) -> Installed:
    """The set `requested` resolves to, installed under data_dir/deps: from the cache when
    the same requirement list was installed before (nothing runs), else with uv."""
    deps = data_dir / "deps"
    key = requested.key(settings)
    cached = _cached_set(deps, key)
    if cached is not None:
        return Installed(
            cached["set"],
            site_dir(data_dir, cached["set"]),
            cached["packages"],
            requested.source,
            list(requested.from_host),
        )
    if not requested.lines:  # the host has everything: an empty set, nothing to run
        return Installed(_EMPTY, _empty_set(deps), [], requested.source, list(requested.from_host))
    started = time.perf_counter()
    with _disk_full_is_507():
        for d in ("sets", "requests", "tmp", "uv-cache"):
            (deps / d).mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=deps / "tmp"))
    try:
        await _run_uv(requested, work, deps, settings)
        described = _describe_site(work / "site", requested)
        for scratch in (requirements_file(work), excludes_file(work), work / "site" / ".lock"):
            scratch.unlink(missing_ok=True)  # uv's inputs and its lock: not part of the set
        digest = _set_digest(described["packages"])
        described["set"] = digest
        with _disk_full_is_507():
            (work / "set.json").write_text(json.dumps(described))
            fresh = _move_into_place(work, deps / "sets" / digest)
            write_atomic(deps / "requests" / key, json.dumps(described).encode())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Installed(
        digest,
        site_dir(data_dir, digest),
        described["packages"],
        requested.source,
        list(requested.from_host),
        installed=described["packages"] if fresh else [],
        install_ms=round((time.perf_counter() - started) * 1000, 3) if fresh else 0.0,
    )


_EMPTY = "empty"


def _empty_set(deps: Path) -> Path:
    site = deps / "sets" / _EMPTY / "site"
    with _disk_full_is_507():
        site.mkdir(parents=True, exist_ok=True)
    return site


def _cached_set(deps: Path, key: str) -> dict[str, Any] | None:
    """The set this requirement list resolved to before, if it is still installed."""
    try:
        described = json.loads((deps / "requests" / key).read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    if not (deps / "sets" / described["set"] / "set.json").is_file():
        return None  # removed since: install again
    return described


def _set_digest(packages: list[str]) -> str:
    """The name of a resolved set: the same pins on the same Python are the same set."""
    text = "\n".join([python_tag(), *sorted(packages)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _move_into_place(work: Path, final: Path) -> bool:
    """Rename a complete install into sets/; False when another deploy was first."""
    try:
        os.rename(work, final)
    except OSError as exc:
        if exc.errno in DISK_FULL:
            raise
        if final.is_dir():  # ENOTEMPTY/EEXIST: the same set, installed meanwhile
            return False
        raise
    return True


def uv_command(requested_file: Path, target: Path, excludes: Path, settings: Settings) -> list[str]:
    """The one uv run that resolves and installs a set: every host distribution excluded
    from the resolution, no configuration file read, the host's Python's tags."""
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
    if settings.deps_offline:
        command.append("--no-index")
    elif settings.deps_index_url:
        command += ["--default-index", settings.deps_index_url]
    for directory in settings.deps_find_links:
        command += ["--find-links", directory]
    return command


def requirements_file(work: Path) -> Path:
    return work / "requirements.in"


def excludes_file(work: Path) -> Path:
    return work / "host.txt"  # every host distribution: never resolved, never installed


async def _run_uv(requested: Requested, work: Path, deps: Path, settings: Settings) -> None:
    requirements, excludes = requirements_file(work), excludes_file(work)
    with _disk_full_is_507():
        requirements.write_text("".join(f"{line}\n" for line in requested.lines))
        excludes.write_text("".join(f"{name}\n" for name in sorted(host_packages())))
    command = uv_command(requirements, work / "site", excludes, settings)
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
        return _DISK_FULL_ERROR
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


# -- what an install put there -----------------------------------------------------------


@dataclass(frozen=True)
class _Dist:
    """One installed distribution of a set."""

    name: str  # canonical
    version: str
    requires: list[Requirement]
    info: Path  # its .dist-info directory


def _describe_site(site: Path, requested: Requested) -> dict[str, Any]:
    """The set's packages, checked: nothing of the host's shipped again, each one's
    requirements on host packages hold for the host's versions, and nothing runs at
    interpreter start (.pth)."""
    if not site.is_dir():
        return {"packages": [], "compiled": []}
    shutil.rmtree(site / "bin", ignore_errors=True)  # scripts: for the host's Python, unused
    dists: dict[str, _Dist] = {}
    for info in sorted(site.glob("*.dist-info")):
        meta = email.parser.Parser().parsestr((info / "METADATA").read_text("utf-8"))
        name = canonicalize_name(meta["Name"])
        requires = [Requirement(line) for line in meta.get_all("Requires-Dist") or ()]
        dists[name] = _Dist(name, meta["Version"], requires, info)
    _check_host_modules(site, dists, requested.source)
    _check_host_requirements(dists, requested)
    pth = sorted(p.name for p in site.glob("*.pth"))
    if pth:
        raise ClientError(
            422,
            f"a dependency installs {_clip(', '.join(pth))}: a .pth file runs at interpreter"
            " start for every space and the host, which no space may change; ask for a"
            " version without it, or for the package on the host",
            source=requested.source,
        )
    compiled = [
        path
        for dist in dists.values()
        for path in _record_paths(dist.info)
        if path.endswith(_EXTENSION_SUFFIXES)
    ]
    return {
        "packages": [f"{d.name}=={d.version}" for d in dists.values()],
        "compiled": sorted(compiled),
    }


def _check_host_modules(site: Path, dists: dict[str, _Dist], source: str) -> None:
    """A 422 for a module at the top of the set that the host imports too: under another
    distribution's name, a space could ship its own starlette or numpy, which the loader
    would map in for that space. The files on disk decide (what the loader maps), each
    RECORD only names who shipped one."""
    owners = {_top_name(path): d for d in dists.values() for path in _record_paths(d.info)}
    host = host_modules()
    with os.scandir(site) as entries:
        names = {_top_name(entry.name + ("/" if entry.is_dir() else "")) for entry in entries}
    clashes = sorted(names.intersection(host))
    if clashes:
        module, owner = clashes[0], owners.get(clashes[0])
        shipped_by = f"{owner.name} {owner.version}" if owner else "a dependency"
        raise ClientError(
            422,
            f"{shipped_by} ships the module `{module}`, which is the host's ({host[module]}):"
            " the host's packages are shared by every space and no dependency may replace"
            f" them; ask for a dependency that does not ship `{module}`",
            source=source,
            package=owner.name if owner else None,
            module=module,
            host_package=host[module],
        )


def _top_name(path: str) -> str:
    """The top-level import name a set's file belongs to ('' for none)."""
    top, slash, _ = path.partition("/")
    if slash:
        return top if top.isidentifier() and top != "__pycache__" else ""
    stem = top.split(".", 1)[0]
    return stem if top.endswith(_MODULE_SUFFIXES) and stem.isidentifier() else ""


def _check_host_requirements(dists: dict[str, _Dist], requested: Requested) -> None:
    """Each installed package's requirements on host packages, checked against the
    host's versions: its base ones, and those of every extra asked of it, by the space
    (`pkg[extra]`) or by another package of the set. uv resolved with the host's
    packages excluded, so it never saw these."""
    host = host_packages()
    asked = _extras_asked(dists, requested)
    for dist in dists.values():
        for requirement, extra in _applying(dist.requires, asked[dist.name]):
            host_dist = host.get(canonicalize_name(requirement.name))
            if host_dist is not None:
                by = (
                    f"{dist.name}[{extra}] {dist.version}"
                    if extra
                    else f"{dist.name} {dist.version}"
                )
                check_host_version(requirement, host_dist.version, by)


def _extras_asked(dists: dict[str, _Dist], requested: Requested) -> dict[str, set[str]]:
    """Per installed package, the extras asked of it ('' for its base requirements)."""
    asked = {name: {""} for name in dists}
    queue = [Requirement(line.split(" --hash=", 1)[0]) for line in requested.lines]
    queue += [r for d in dists.values() for r, _ in _applying(d.requires, {""})]
    while queue:
        requirement = queue.pop()
        name = canonicalize_name(requirement.name)
        new = requirement.extras - asked.get(name, requirement.extras)
        if new:
            asked[name] |= new
            queue += [r for r, _ in _applying(dists[name].requires, new)]
    return asked


def _applying(requires: list[Requirement], extras: set[str]) -> Iterator[tuple[Requirement, str]]:
    """The requirements that hold on this host with one of these extras, each with the
    first such extra ('' sorts first: a base requirement is named as one)."""
    for requirement in requires:
        marker = requirement.marker
        extra = next(
            (e for e in sorted(extras) if marker is None or marker.evaluate({"extra": e})), None
        )
        if extra is not None:
            yield requirement, extra


def _record_paths(info: Path) -> Iterable[str]:
    try:
        lines = (info / "RECORD").read_text("utf-8").splitlines()
    except FileNotFoundError:
        return ()
    return [line.rsplit(",", 2)[0] for line in lines if line]


_DISK_FULL_ERROR = ClientError(
    507,
    "the data disk is full: nothing was published; free space under POLYSERVE_DATA_DIR"
    " and deploy again",
)


@contextlib.contextmanager
def _disk_full_is_507() -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        raise ClientError(507, _DISK_FULL_ERROR.error) from None


def _clip(text: str, width: int = ECHO_CHARS) -> str:
    return text if len(text) <= width else text[:width] + "…"
