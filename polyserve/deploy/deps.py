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

A set is installed by one uv run (polyserve/deploy/uvinstall.py) and checked against
the host before it is moved into place (polyserve/deploy/depcheck.py): the host's own
distributions are never installed again and never replaced (polyserve/deploy/
requirements.py checked the space's own requirements on them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyserve.deploy import depcheck, uvinstall
from polyserve.deploy.requirements import Requested, python_tag
from polyserve.errors import DISK_FULL, ClientError, disk_full_is_507
from polyserve.settings import Settings
from polyserve.state.files import write_atomic


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
    fresh, contents, install_ms = await _install(requested, deps, settings, exact=False)
    with disk_full_is_507():
        write_atomic(deps / "requests" / key, json.dumps(contents).encode())
    return Installed(
        contents["set"],
        site_dir(data_dir, contents["set"]),
        contents["packages"],
        requested.source,
        list(requested.from_host),
        installed=contents["packages"] if fresh else [],
        install_ms=install_ms,
    )


async def install_pins(declared: dict[str, Any], data_dir: Path, settings: Settings) -> Installed:
    """A fleet version's set on this host: exactly the pins the receiving host resolved
    (the version's metadata's `dependencies`), from this host's cache, index or
    find-links, with no resolution of its own; nothing runs when this host has the set.
    The set is named by this host's Python, as the receiving host named its own."""
    packages = sorted(str(p) for p in declared.get("packages") or ())
    source = str(declared.get("source") or "dependencies")
    from_host = [str(p) for p in declared.get("from_host") or ()]
    deps = data_dir / "deps"
    if not packages:
        return Installed(_EMPTY, _empty_set(deps), [], source, from_host)
    digest = _set_digest(packages)
    if (deps / "sets" / digest / "set.json").is_file():
        return Installed(digest, site_dir(data_dir, digest), packages, source, from_host)
    requested = Requested(source, tuple(packages), ())
    fresh, contents, install_ms = await _install(requested, deps, settings, exact=True)
    if sorted(contents["packages"]) != packages:  # never with --no-deps: say so if it were
        raise ClientError(
            422,
            f"installing the pinned set gave {', '.join(contents['packages'])} instead of"
            f" {', '.join(packages)}",
            source=source,
        )
    return Installed(
        contents["set"],
        site_dir(data_dir, contents["set"]),
        packages,
        source,
        from_host,
        installed=packages if fresh else [],
        install_ms=install_ms,
    )


async def _install(
    requested: Requested, deps: Path, settings: Settings, exact: bool
) -> tuple[bool, dict[str, Any], float]:
    """One uv run into a fresh directory, checked and moved into sets/: (whether this
    run's copy is the one in place, the set's contents, the install's milliseconds)."""
    started = time.perf_counter()
    with disk_full_is_507():
        for d in ("sets", "requests", "tmp", "uv-cache"):
            (deps / d).mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=deps / "tmp"))
    try:
        await uvinstall.run(requested, work, deps, settings, exact=exact)
        contents = depcheck.contents(work / "site", requested)
        scratch_files = (uvinstall.requirements_file(work), uvinstall.excludes_file(work))
        for scratch in (*scratch_files, work / "site" / ".lock"):
            scratch.unlink(missing_ok=True)  # uv's inputs and its lock: not part of the set
        digest = _set_digest(contents["packages"])
        contents["set"] = digest
        with disk_full_is_507():
            (work / "set.json").write_text(json.dumps(contents))
            fresh = _move_into_place(work, deps / "sets" / digest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    install_ms = round((time.perf_counter() - started) * 1000, 3) if fresh else 0.0
    return fresh, contents, install_ms


_EMPTY = "empty"


def _empty_set(deps: Path) -> Path:
    site = deps / "sets" / _EMPTY / "site"
    with disk_full_is_507():
        site.mkdir(parents=True, exist_ok=True)
    return site


def _cached_set(deps: Path, key: str) -> dict[str, Any] | None:
    """The set this requirement list resolved to before, if it is still installed."""
    try:
        contents = json.loads((deps / "requests" / key).read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    if not (deps / "sets" / contents["set"] / "set.json").is_file():
        return None  # removed since: install again
    return contents


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
