"""The data directory's layout, and the reads every process makes of it (current, metadata).

Layout under POLYSERVE_DATA_DIR::

    store.lock                      flock held while publishing, deleting or allocating
    slots.log                       which space owns each slot (polyserve.state.slots)
    staging/<random>/               one fresh directory per deploy in progress
    spaces/<owner>/<name>/last      the last version number handed out (a symlink's target)
    spaces/<owner>/<name>/current   symlink -> versions/<n>, replaced atomically
    spaces/<owner>/<name>/versions/<n>/       immutable files of version n
    spaces/<owner>/<name>/versions/<n>.json   its metadata
    spaces/<owner>/<name>/history.jsonl       what happened (polyserve.state.history)
    spaces/<owner>/<name>/pins                the pinned versions, a JSON list (never pruned)
    logs/<owner>/<name>/            the space's recent log records (polyserve.logs.logstore)
    secrets/<owner>/<name>.json     the space's secrets, mode 0600 (polyserve.state.secrets)

Published version directories are never written again; only ``current`` moves
(polyserve.state.store writes, under the lock).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from polyserve.names import DEFAULT_POOL
from polyserve.state.files import read_short
from polyserve.state.history import version_summary
from polyserve.state.secrets import SecretFiles


@dataclass(frozen=True)
class Version:
    """A published version as a worker needs it to import."""

    space: str
    number: int
    dir: Path
    entry: str
    pool: str = DEFAULT_POOL  # in a fleet, only a host of this pool imports it
    deps: Path | None = None  # its installed dependency set (polyserve/deploy/deps.py), if any
    # Which upload's files these are: a fleet whose database went back in time hands a
    # number out again, and a worker holding the old files must then load the new ones.
    sha256: str | None = None


class Layout:
    """Where a data directory keeps each space's versions, and what they say."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.root = Path(data_dir).resolve()
        self.spaces_dir = self.root / "spaces"
        self.staging_dir = self.root / "staging"
        self.logs_dir = self.root / "logs"
        self.secrets = SecretFiles(self.root / "secrets")  # outside every version

    def space_dir(self, space: str) -> Path:
        return self.spaces_dir / space

    def current(self, space: str) -> Version | None:
        """The published version `current` points at, or None if not deployed."""
        number = current_number(self.space_dir(space))
        return None if number is None else self.version(space, number)

    def version(self, space: str, number: int) -> Version | None:
        """Version `number` as a worker imports it, or None when its metadata is gone
        (never published, pruned, or deleted between a readlink and here)."""
        meta = self.meta(space, number)
        if meta is None:
            return None
        # Versions published before pools existed say none: they are the default pool's.
        pool = str(meta.get("pool", DEFAULT_POOL))
        # The layout is polyserve/deploy/deps.py's (site_dir); not imported, to keep packaging off
        # the request path.
        declared = meta.get("dependencies")
        deps = (
            self.root / "deps" / "sets" / str(declared["set"]) / "site"
            if isinstance(declared, dict)
            else None
        )
        files = self.space_dir(space) / "versions" / str(number)
        sha256 = meta.get("sha256")
        return Version(
            space, number, files, str(meta["entry"]), pool, deps, str(sha256) if sha256 else None
        )

    def meta(self, space: str, number: int) -> dict[str, object] | None:
        try:
            return json.loads((self.space_dir(space) / "versions" / f"{number}.json").read_bytes())
        except FileNotFoundError:
            return None

    def has_files(self, space: str, number: int, sha256: str) -> bool:
        """Whether version `number`'s files are on disk, and are those of the upload
        with this sha256 (as its metadata says)."""
        known = self.meta(space, number)
        files = self.space_dir(space) / "versions" / str(number)
        return known is not None and known.get("sha256") == sha256 and files.is_dir()

    def holds_files(self, space: str) -> bool:
        """Whether any version of the space has its files on disk here."""
        try:
            # scandir: the directory's own entry types, not a stat of each of its files.
            with os.scandir(self.space_dir(space) / "versions") as entries:
                return any(entry.is_dir() for entry in entries)
        except FileNotFoundError:
            return False

    def spaces(self) -> dict[str, dict[str, object]]:
        """Every deployed space with its current version's metadata."""
        found: dict[str, dict[str, object]] = {}
        # Not glob("*/*/current"): it skips a `current` whose files are not here yet (a
        # fleet host's pointer, its files fetched on first use), a link to nothing.
        for sdir in sorted(self.spaces_dir.glob("*/*/")):
            if not os.path.lexists(sdir / "current"):
                continue
            space = f"{sdir.parent.name}/{sdir.name}"
            version = self.current(space)
            meta = self.meta(space, version.number) if version is not None else None
            if meta is not None:
                found[space] = {**meta, "pool": meta.get("pool", DEFAULT_POOL)}
        return found

    def kept(self, space: str) -> list[int]:
        """The numbers of the versions kept here, which a rollback may make current: those
        with their metadata. A fleet host may lack their files (never fetched, or removed
        by its disk budget): the first load fetches them."""
        names = [
            p.name.removesuffix(".json") for p in self.space_dir(space).glob("versions/*.json")
        ]
        return sorted(int(n) for n in names if n.isdigit())

    def pins(self, space: str) -> list[int]:
        """The versions pinned in a space (Store.pin): pruning never removes them."""
        try:
            found = json.loads((self.space_dir(space) / "pins").read_bytes())
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in found)

    def waiting(self, space: str) -> int | None:
        """The version deployed with current=false that waits for its rollout (Store.keep):
        pruning keeps it until unpinned, made current, or replaced by a later one."""
        number = read_int(self.space_dir(space) / "waiting")
        return number or None

    def versions(self, space: str) -> list[dict[str, object]]:
        """Each kept version's metadata, oldest first, with `current` marked."""
        current = current_number(self.space_dir(space))
        found = []
        for number in self.kept(space):
            meta = self.meta(space, number)
            if meta is not None:  # pruned since kept() looked
                found.append(version_summary(meta, number, current))
        return found


def current_number(sdir: Path) -> int | None:
    """The number of the version a space directory's `current` points at."""
    try:
        return int(os.readlink(sdir / "current").rsplit("/", 1)[1])
    except (FileNotFoundError, NotADirectoryError):
        return None


def read_int(path: Path) -> int:
    """A number kept at `path` (a symlink's target or a file's text); 0 when there is none yet."""
    try:
        return int(read_short(path))
    except FileNotFoundError:
        return 0
