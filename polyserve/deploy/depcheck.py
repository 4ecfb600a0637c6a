"""What an install put in a dependency set, read from its files and checked against the host.

The host's own distributions are never installed again and never replaced: uv resolved
with every one of them excluded, so it never saw the set's requirements on them. Here
each installed package's requirements on host packages (with the extras asked of it)
are checked against the host's versions, and so is every module at the top of the set:
none may be one the host imports, whatever distribution ships it.
"""

from __future__ import annotations

import email.parser
import importlib.machinery
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from polyserve.deploy.requirements import (
    Requested,
    check_host_version,
    host_modules,
    host_packages,
)
from polyserve.errors import ClientError

ECHO_CHARS = 200
_EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)
_MODULE_SUFFIXES = (".py", ".pyc", *_EXTENSION_SUFFIXES)


@dataclass(frozen=True)
class _Dist:
    """One installed distribution of a set."""

    name: str  # canonical
    version: str
    requires: list[Requirement]
    info: Path  # its .dist-info directory


def contents(site: Path, requested: Requested) -> dict[str, Any]:
    """What the set at `site` holds (its packages and compiled modules), checked: nothing
    of the host's shipped again, each one's requirements on host packages hold for the
    host's versions, and nothing runs at interpreter start (.pth)."""
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


def _clip(text: str, width: int = ECHO_CHARS) -> str:
    return text if len(text) <= width else text[:width] + "…"
