"""A space's declared dependencies: read, refuse what reaches outside, check against the host's.

`requirements.txt` or `dependencies` in polyserve.toml (which wins). What is accepted is
rewritten here as plain PEP 508 lines for uv: uv never reads the tenant's file. Every
requirement on a distribution the host has is checked against the host's version with
`packaging`, and never handed to uv (polyserve/deploy/deps.py installs the rest).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import re
import sys
import sysconfig
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from polyserve.errors import ClientError
from polyserve.settings import Settings

REQUIREMENTS = "requirements.txt"
MANIFEST = "polyserve.toml"
MAX_FILE_BYTES = 64 << 10  # a requirements file is a list of names: this is generous
MAX_REQUIREMENTS = 500
ECHO_CHARS = 200
DEFAULT_INDEX = "https://pypi.org/simple"  # uv's default index
# What an installed set was checked for (polyserve/deploy/deps.py). Part of the cache key, so a
# set cached before a check was added is installed, and checked, again.
CHECKS = 2
_HASH_OPTION = re.compile(r"\s+--hash(?:=|\s+)(\S+)")


@dataclass(frozen=True)
class Requested:
    """A space's dependency declaration, checked: what uv installs and what the host gives."""

    source: str  # the file it came from: requirements.txt or polyserve.toml
    lines: tuple[str, ...]  # PEP 508 requirements (with --hash options) for uv
    from_host: tuple[str, ...]  # "name==version" of host distributions that satisfy some

    def key(self, settings: Settings) -> str:
        """What decides the resolution: the cache key of a requirement list on this host."""
        text = json.dumps(
            [
                sorted(self.lines),
                settings.deps_index_url,
                list(settings.deps_find_links),
                settings.deps_offline,
                python_tag(),
                host_fingerprint(),
                CHECKS,
            ]
        )
        return hashlib.sha256(text.encode()).hexdigest()


# -- what the host has -------------------------------------------------------------------


@functools.cache
def host_packages() -> dict[str, importlib.metadata.Distribution]:
    """The host's distributions by canonical name, as its imports find them (first on
    sys.path wins). Read once: the host's packages never change while it runs."""
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist)
    return found


@functools.cache
def host_modules() -> dict[str, str]:
    """The host's top-level import names (numpy, starlette, …), each with the host
    distribution that ships it: what no dependency of a space may ship again."""
    return {
        module: canonicalize_name(dists[0])
        for module, dists in importlib.metadata.packages_distributions().items()
        if module.isidentifier()
    }


@functools.cache
def host_fingerprint() -> str:
    pins = sorted(f"{n}=={d.version}" for n, d in host_packages().items())
    return hashlib.sha256("\n".join(pins).encode()).hexdigest()


@functools.cache
def python_tag() -> str:
    return f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}"


# -- reading a declaration -----------------------------------------------------------------


def read(root: Path, settings: Settings) -> Requested | None:
    """The dependencies a staged version declares, checked against the host, or None.

    `dependencies` in polyserve.toml wins: when that key is there (even as []),
    requirements.txt is not read, so a tar may carry one for other tools.
    """
    declared = _from_manifest(root)
    if declared is not None:
        source, raw = MANIFEST, [(f"dependencies[{i}]", line) for i, line in enumerate(declared)]
    elif (root / REQUIREMENTS).is_file():
        source, raw = REQUIREMENTS, list(_requirement_lines(root / REQUIREMENTS))
    else:
        return None
    if len(raw) > MAX_REQUIREMENTS:
        raise ClientError(422, f"{source} lists more than {MAX_REQUIREMENTS} requirements")
    lines: list[str] = []
    requirements: list[Requirement] = []
    for where, text in raw:
        if text.startswith("-"):
            _global_option(source, where, text, settings)
            continue
        requirement, hashes = _parse(source, where, text, allow_hashes=source == REQUIREMENTS)
        requirements.append(requirement)
        lines.append(" ".join([str(requirement), *(f"--hash={h}" for h in hashes)]))
    wanted, from_host = _against_host(source, requirements)
    kept = [line for line, r in zip(lines, requirements, strict=True) if r in wanted]
    # Extras of host packages bring requirements of their own (starlette[full]).
    kept += [str(r) for r in wanted if r not in requirements]
    return Requested(source, tuple(kept), tuple(sorted(from_host)))


def _from_manifest(root: Path) -> list[str] | None:
    path = root / MANIFEST
    if not path.is_file():
        return None
    # unpack.py has checked its size and that it parses.
    value = tomllib.loads(path.read_text("utf-8")).get("dependencies")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ClientError(
            422,
            f"{MANIFEST}: dependencies must be an array of requirement strings, such as"
            ' dependencies = ["requests>=2.31"]',
            field="dependencies",
        )
    return value


def _requirement_lines(path: Path) -> Iterator[tuple[str, str]]:
    """(where, text) of each requirement or option line, comments and continuations
    handled the way pip reads them."""
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ClientError(422, f"{REQUIREMENTS} is larger than {MAX_FILE_BYTES >> 10} KiB")
    try:
        text = path.read_text("utf-8")
    except UnicodeDecodeError:
        raise ClientError(422, f"{REQUIREMENTS} is not UTF-8 text") from None
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        line, pending = pending + line, ""
        # A comment starts at `#` at the start of a line or after whitespace (pip's rule:
        # a URL fragment such as #egg= is not one).
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            yield f"line {start}", line
    if pending.strip():
        yield f"line {start}", pending.strip()


def _global_option(source: str, where: str, text: str, settings: Settings) -> None:
    """Options that reach outside the upload are refused; an index URL that is the
    host's own is accepted as a no-op (`uv pip compile --emit-index-url` writes one)."""
    match = re.match(r"(-{1,2}[A-Za-z][\w-]*)(?:=|\s+|$)(.*)", text)
    option, value = (match.group(1), match.group(2).strip()) if match else (text.split()[0], "")
    if option in ("-i", "--index-url") and value.rstrip("/") == (
        settings.deps_index_url or DEFAULT_INDEX
    ):
        return
    reason = {
        "-e": "editable installs run a local project's code",
        "--editable": "editable installs run a local project's code",
        "-i": "the host installs from its own index (POLYSERVE_DEPS_INDEX_URL)",
        "--index-url": "the host installs from its own index (POLYSERVE_DEPS_INDEX_URL)",
        "--extra-index-url": "the host installs from its own index (POLYSERVE_DEPS_INDEX_URL)",
        "-f": "the host has its own wheel directories (POLYSERVE_DEPS_FIND_LINKS)",
        "--find-links": "the host has its own wheel directories (POLYSERVE_DEPS_FIND_LINKS)",
        "-r": "include files are not read: list every requirement in this one",
        "-c": "constraint files are not read: pin the version in the requirement",
    }.get(option, "only requirements (and --hash) are read")
    raise ClientError(
        422,
        f"{source}, {where}: option {_clip(option)} is not accepted: {reason}",
        file=source,
        option=_clip(option),
    )


def _parse(source: str, where: str, text: str, allow_hashes: bool) -> tuple[Requirement, list[str]]:
    hashes = _HASH_OPTION.findall(text) if allow_hashes else []
    bare = _HASH_OPTION.sub("", text).strip() if allow_hashes else text.strip()
    refused = _refused_form(bare)
    if refused:
        raise ClientError(
            422,
            f"{source}, {where}: {refused} are not accepted: name a package from the index,"
            " such as `requests>=2.31`",
            file=source,
            requirement=_clip(bare),
        )
    if re.search(r"\s-{1,2}[A-Za-z]", bare):
        raise ClientError(
            422,
            f"{source}, {where}: only --hash may follow a requirement",
            file=source,
            requirement=_clip(bare),
        )
    try:
        requirement = Requirement(bare)
    except InvalidRequirement as exc:
        raise ClientError(
            422,
            f"{source}, {where}: not a requirement: {_clip(str(exc))}",
            file=source,
            requirement=_clip(bare),
        ) from None
    if requirement.url:
        raise ClientError(
            422,
            f"{source}, {where}: direct references (name @ URL) are not accepted: name a"
            " version from the index instead",
            file=source,
            requirement=_clip(bare),
        )
    return requirement, hashes


def _refused_form(text: str) -> str:
    """What a line that names a location instead of a package is, or ''."""
    lowered = text.lower()
    if lowered.startswith(("git+", "hg+", "svn+", "bzr+")) or "+git" in lowered[:12]:
        return "version-control URLs"
    if lowered.startswith("file:"):
        return "file: URLs"
    if "://" in lowered.split("@", 1)[0] or lowered.startswith(("http:", "https:")):
        return "URLs"
    if text.startswith((".", "/", "~")) or "/" in text.split(";", 1)[0].split("@", 1)[0]:
        return "local paths"
    if "@" not in text and lowered.endswith((".whl", ".tar.gz", ".zip", ".tar.bz2")):
        return "archive files"
    return ""


def _against_host(
    source: str, requirements: list[Requirement]
) -> tuple[list[Requirement], set[str]]:
    """The requirements uv must install, and the host's pins that satisfy the others.
    A requirement the host satisfies stays the host's; one it does not is a 422."""
    host = host_packages()
    wanted: list[Requirement] = []
    from_host: set[str] = set()
    seen: set[tuple[str, str]] = set()
    queue = list(requirements)
    while queue:
        requirement = queue.pop(0)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # not for this host's Python or platform
        name = canonicalize_name(requirement.name)
        dist = host.get(name)
        if dist is None:
            wanted.append(requirement)
            continue
        check_host_version(requirement, dist.version, source)
        from_host.add(f"{name}=={dist.version}")
        for extra in sorted(requirement.extras):
            if (name, extra) not in seen:
                seen.add((name, extra))
                queue.extend(_extra_requirements(dist, extra))
    return wanted, from_host


def check_host_version(requirement: Requirement, host_version: str, asked_by: str) -> None:
    if requirement.specifier.contains(host_version, prereleases=True):
        return
    name = canonicalize_name(requirement.name)
    raise ClientError(
        422,
        f"{asked_by} asks for {name}{requirement.specifier}, which conflicts with the host's"
        f" {name} {host_version}: the host's own packages are shared by every space and"
        f" cannot be replaced; accept {name}=={host_version} (or drop the requirement)",
        package=name,
        requested=str(requirement.specifier),
        host_version=host_version,
        requested_by=asked_by,
    )


def _extra_requirements(dist: importlib.metadata.Distribution, extra: str) -> Iterator[Requirement]:
    """What `name[extra]` adds to the host distribution, without the extra's marker."""
    for line in dist.requires or ():
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or marker.evaluate({"extra": ""}):
            continue  # a base dependency: the host has it already
        if marker.evaluate({"extra": extra}):
            # The whole marker holds here with the extra set, so what is left of it once
            # the extra is dropped holds too: the requirement applies unconditionally.
            requirement.marker = None
            yield requirement


def _clip(text: str, width: int = ECHO_CHARS) -> str:
    return text if len(text) <= width else text[:width] + "…"
