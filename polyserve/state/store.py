"""The shared directory: stage an upload safely, publish atomically, read versions and history.

Layout under POLYSERVE_DATA_DIR::

    store.lock                      flock held while publishing, deleting or allocating
    slots.log                       which space owns each slot (polyserve.state.slots)
    staging/<random>/               one fresh directory per deploy in progress
    spaces/<owner>/<name>/last      the last version number handed out
    spaces/<owner>/<name>/current   symlink -> versions/<n>, replaced atomically
    spaces/<owner>/<name>/versions/<n>/       immutable files of version n
    spaces/<owner>/<name>/versions/<n>.json   its metadata
    spaces/<owner>/<name>/history.jsonl       what happened: one JSON event a line
    logs/<owner>/<name>/            the space's recent log records (polyserve.logs.logstore)

Published version directories are never written again; only ``current`` moves. Each
move of ``current`` (a deploy, a rollback, a delete) and each release appends an event
to the history, which is also what ranks versions for pruning: the last
``keep_versions`` versions that were made current stay, whatever their numbers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from polyserve.errors import DISK_FULL, ClientError
from polyserve.names import DEFAULT_POOL
from polyserve.state.files import symlink_atomic, write_atomic
from polyserve.state.slots import Reclaim, SlotLog
from polyserve.state.unpack import unpack_upload

log = logging.getLogger("polyserve")
DEFAULT_KEEP_VERSIONS = 10  # POLYSERVE_KEEP_VERSIONS
# Events kept in a space's history file: trimmed to HISTORY_KEEP once it holds twice as
# many, so a space deployed in a loop costs a bounded file, rewritten once in a while.
HISTORY_KEEP = 500


@dataclass(frozen=True)
class Staged:
    """An upload unpacked into a fresh staging directory, not yet published."""

    dir: Path  # the staging directory; removed by discard() or moved by publish()
    entry: str  # entry module file name at the top of dir
    sha256: str
    size: int
    pool: str = DEFAULT_POOL  # the manifest's: which hosts of a fleet serve it
    unpacked: int = 0  # what its tar unpacked to, as POLYSERVE_MAX_UNPACKED_MB counts it


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


class Store:
    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        max_spaces: int,
        keep_versions: int = DEFAULT_KEEP_VERSIONS,
    ) -> None:
        self.root = Path(data_dir).resolve()
        self.max_spaces = max_spaces
        self.keep_versions = keep_versions
        self.spaces_dir = self.root / "spaces"
        self.staging_dir = self.root / "staging"
        self.logs_dir = self.root / "logs"
        for d in (self.spaces_dir, self.staging_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.slots = SlotLog(self.root / "slots.log", max_spaces)

    def space_dir(self, space: str) -> Path:
        return self.spaces_dir / space

    # -- staging -----------------------------------------------------------

    def stage(self, upload: BinaryIO, filename: str, max_unpacked: int) -> Staged:
        """Unpack an upload (a .py file or a tar) into a fresh directory and find its entry."""
        digest, size = _hash(upload)
        with _disk_full_is_507():
            staging = Path(tempfile.mkdtemp(dir=self.staging_dir))
        try:
            with _disk_full_is_507():
                manifest, unpacked = unpack_upload(upload, staging, filename, max_unpacked)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return Staged(staging, manifest.entry, digest, size, manifest.pool, unpacked)

    def discard(self, staged: Staged) -> None:
        shutil.rmtree(staged.dir, ignore_errors=True)

    # -- publishing ----------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The store-wide write lock: publishes are rare and each takes milliseconds."""
        with open(self.root / "store.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def publish(
        self,
        space: str,
        staged: Staged,
        meta: dict[str, object],
        reclaim: Reclaim | None = None,
        number: int | None = None,
    ) -> tuple[int, int]:
        """Move a validated stage into place and flip `current`. Hold locked(); returns
        (slot, version number). The number is the space's next one, or the one a fleet
        gave it. Pruning is the caller's: only it knows what is held."""
        sdir = self.space_dir(space)
        if number is None:
            number = _read_int(sdir / "last") + 1
        meta = {
            # What this version replaced: a rollback without a number goes back to it.
            "replaced": _current_number(sdir),
            **meta,
            "space": space,
            "version": number,
            "sha256": staged.sha256,
            "size": staged.size,
            "entry": staged.entry,
            "pool": staged.pool,
            "deployed_at": meta.get("deployed_at", time.time()),
        }
        fresh = self.install(space, number, staged)
        try:
            slot = self.point(space, number, meta, reclaim)
        except BaseException:
            if fresh:  # nothing is active before the flip: undo what this publish wrote
                shutil.rmtree(sdir / "versions" / str(number), ignore_errors=True)
                (sdir / "versions" / f"{number}.json").unlink(missing_ok=True)
            raise
        return slot, number

    def install(self, space: str, number: int, staged: Staged) -> bool:
        """Move a stage into place as version `number`, unless that version's files are
        there already (a fleet host fetching what it has). Files under that number whose
        metadata names another upload, or none, are not reused but replaced: a fleet
        whose database went back in time hands a number out again. Hold locked();
        returns whether this call put them there."""
        version_dir = self.space_dir(space) / "versions" / str(number)
        if self.has_files(space, number, staged.sha256):
            return False
        self._drop_files(space, number)
        known = self.meta(space, number)
        if known is not None and known.get("sha256") != staged.sha256:
            (self.space_dir(space) / "versions" / f"{number}.json").unlink()
        with _disk_full_is_507():
            version_dir.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staged.dir, version_dir)
        return True

    def point(
        self,
        space: str,
        number: int,
        meta: dict[str, object],
        reclaim: Reclaim | None = None,
        sync: bool = True,
    ) -> int:
        """Make version `number` (with this metadata) current; its files may come later
        (a fleet host fetches them on first use). A number past the last one handed out
        is a deploy, any other a rollback: the history says which. Hold locked();
        returns the slot."""
        sdir = self.space_dir(space)
        with _disk_full_is_507():
            slot = self.slots.slot(space)
            if slot is None:
                slot = self.slots.allocate(space, self._deleted, reclaim, sync=sync)
            known = self.meta(space, number)
            if known is not None and known.get("sha256") != meta.get("sha256"):
                # Files of another upload under this number (a fleet that went back in
                # time): fetched again on first use rather than served.
                self._drop_files(space, number)
            (sdir / "versions").mkdir(parents=True, exist_ok=True)
            write_atomic(sdir / "versions" / f"{number}.json", json.dumps(meta).encode())
            previous = _current_number(sdir)
            event = "rollback"
            if number > _read_int(sdir / "last"):
                write_atomic(sdir / "last", str(number).encode())
                event = "deploy"
            symlink_atomic(f"versions/{number}", sdir / "current")
            self.record(space, event, number, previous)
        return slot

    def reactivate(self, space: str, asked: int | None) -> tuple[int, int, int, dict[str, object]]:
        """A rollback: make a kept version (`asked`, or the one the current version
        replaced) current again. Hold locked(); returns (slot, its number, the number
        of the version it replaced, its metadata).
        Raises ClientError 404 when the space is not deployed or the version is not
        kept (the error lists the kept ones)."""
        current = self.current(space)
        if current is None:
            raise ClientError(
                404, f"space {space} is not deployed: deploy it, then roll back", space=space
            )
        kept = self.kept(space)
        meta = self.meta(space, current.number) or {}
        number = rollback_target(space, current.number, meta, kept, asked)
        target = self.meta(space, number)
        assert target is not None  # kept() lists only versions with their metadata
        slot = self.point(space, number, target)
        return slot, number, current.number, target

    def delete(self, space: str) -> int | None:
        """Undeploy: drop `current` and the space's logs; prune() removes the versions
        once nobody uses them. Hold locked(); returns the slot, or None when the space is
        not deployed."""
        # Its logs go at once: a redeployed space starts a new log (records its draining
        # requests write meanwhile are dropped: see LogStore.open).
        shutil.rmtree(self.logs_dir / space, ignore_errors=True)
        previous = _current_number(self.space_dir(space))
        try:
            os.unlink(self.space_dir(space) / "current")
        except FileNotFoundError:
            return None
        self.record(space, "delete", None, previous)
        return self.slots.slot(space)

    def has_files(self, space: str, number: int, sha256: str) -> bool:
        """Whether version `number`'s files are on disk, and are those of the upload
        with this sha256 (as its metadata says)."""
        known = self.meta(space, number)
        files = self.space_dir(space) / "versions" / str(number)
        return known is not None and known.get("sha256") == sha256 and files.is_dir()

    def _drop_files(self, space: str, number: int) -> None:
        files = self.space_dir(space) / "versions" / str(number)
        if files.is_dir():
            log.warning("%s v%d: the files on disk are not this upload's: dropped", space, number)
            shutil.rmtree(files)

    def _deleted(self, space: str) -> bool:
        return not os.path.lexists(self.space_dir(space) / "current")

    def prune(self, space: str, oldest_held: int | None) -> None:
        """Remove the versions nobody can use any more. Kept: the current one and the
        ones made current most recently, keep_versions in all (none once the space is
        deleted), and every version numbered from the oldest one a worker holds — a
        draining request or a slow load may still read its files (a worker publishes
        only the oldest number it holds, so everything from there up stays). Hold
        locked()."""
        sdir = self.space_dir(space)
        current = _current_number(sdir)
        try:
            paths = list((sdir / "versions").iterdir())
        except FileNotFoundError:
            return
        found = {int(n) for p in paths if (n := p.name.removesuffix(".json")).isdigit()}
        keep = set()
        if current is not None:  # a deleted space keeps only what is held
            keep = set(self._ranked(space, found)[: self.keep_versions])
        for path in paths:
            name = path.name.removesuffix(".json")
            if not name.isdigit():
                continue
            number = int(name)
            if number in keep or number == current:
                continue
            if oldest_held is not None and number >= oldest_held:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _ranked(self, space: str, numbers: set[int]) -> list[int]:
        """`numbers`, the most recently made current first (by the history); those the
        history no longer names (or never did: a data directory from before it) after
        them, newest number first."""
        ranked: list[int] = []
        for event in reversed(self.history(space, HISTORY_KEEP)):
            number = event.get("version")
            activated = event.get("event") in ("deploy", "rollback")
            if activated and isinstance(number, int) and number in numbers - set(ranked):
                ranked.append(number)
        rest = sorted(numbers.difference(ranked), reverse=True)
        return ranked + rest

    # -- history ---------------------------------------------------------------

    def record(self, space: str, event: str, version: int | None, previous: int | None) -> None:
        """Append an event to the space's history (`previous`: the version current
        before it). Hold locked(): one writer at a time, so the trim loses nothing."""
        path = self.space_dir(space) / "history.jsonl"
        line = {"event": event, "version": version, "previous": previous, "at": time.time()}
        try:
            with open(path, "ab") as f:
                f.write(json.dumps(line).encode() + b"\n")
                size = f.tell()
            # Lines are under 100 bytes: only a long history is read back to be trimmed.
            if size > HISTORY_KEEP * 200:
                lines = path.read_bytes().splitlines(keepends=True)
                if len(lines) > 2 * HISTORY_KEEP:
                    write_atomic(path, b"".join(lines[-HISTORY_KEEP:]))
        except OSError as exc:
            # After the change it records (`current` has moved): failing the change now
            # would misreport it. A full disk costs a line of history, not the change.
            log.warning("%s: could not record the %s in its history: %s", space, event, exc)

    def history(self, space: str, limit: int) -> list[dict[str, object]]:
        """The last `limit` events of the space's history, oldest first."""
        try:
            lines = (self.space_dir(space) / "history.jsonl").read_bytes().splitlines()
        except FileNotFoundError:
            return []
        except OSError as exc:  # unreadable: pruning then ranks by number alone
            log.warning("%s: could not read its history: %s", space, exc)
            return []
        events = []
        for line in lines[-limit:]:
            with contextlib.suppress(ValueError):  # a line cut by a crash mid-append
                events.append(json.loads(line))
        return events

    def kept(self, space: str) -> list[int]:
        """The numbers of the versions on disk that a rollback may make current."""
        versions = self.space_dir(space) / "versions"
        try:
            names = [p.name for p in versions.iterdir()]
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit() and f"{n}.json" in names)

    def versions(self, space: str) -> list[dict[str, object]]:
        """Each kept version's metadata, oldest first, with `current` marked."""
        current = _current_number(self.space_dir(space))
        found = []
        for number in self.kept(space):
            meta = self.meta(space, number)
            if meta is not None:  # pruned since kept() looked
                found.append(describe(meta, number, current))
        return found

    # -- reading -------------------------------------------------------------

    def current(self, space: str) -> Version | None:
        """The published version `current` points at, or None if not deployed."""
        sdir = self.space_dir(space)
        number = _current_number(sdir)
        if number is None:
            return None
        meta = self.meta(space, number)
        if meta is None:  # deleted between the readlink and here
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
        files = sdir / "versions" / str(number)
        sha256 = meta.get("sha256")
        return Version(
            space, number, files, str(meta["entry"]), pool, deps, str(sha256) if sha256 else None
        )

    def meta(self, space: str, number: int) -> dict[str, object] | None:
        try:
            return json.loads((self.space_dir(space) / "versions" / f"{number}.json").read_bytes())
        except FileNotFoundError:
            return None

    def spaces(self) -> dict[str, dict[str, object]]:
        """Every deployed space with its current version's metadata."""
        found: dict[str, dict[str, object]] = {}
        for current in sorted(self.spaces_dir.glob("*/*/current")):
            space = f"{current.parent.parent.name}/{current.parent.name}"
            version = self.current(space)
            meta = self.meta(space, version.number) if version is not None else None
            if meta is not None:
                found[space] = {**meta, "pool": meta.get("pool", DEFAULT_POOL)}
        return found


# -- versions and rollbacks, the same on a host and in a fleet ----------------------

VERSION_FIELDS = ("sha256", "size", "entry", "kind", "import_ms", "deployed_at", "replaced")


def describe(meta: dict[str, object], number: int, current: int | None) -> dict[str, object]:
    """One version as the versions answer lists it."""
    return {
        "version": number,
        **{key: meta.get(key) for key in VERSION_FIELDS},
        "current": number == current,
    }


def rollback_target(
    space: str, current: int, meta: dict[str, object], kept: list[int], asked: int | None
) -> int:
    """The version a rollback makes current: `asked`, or else the one the current
    version replaced when it was deployed — so rollbacks without a number walk back
    through the deploys (v3 -> v2 -> v1) instead of toggling between two versions. A
    version deployed before `replaced` was recorded falls back to the newest kept one
    below it. Raises ClientError 404, listing the kept versions, when there is none."""
    what = f"{space} v{asked}"
    if asked is None:
        if "replaced" in meta:
            replaced = meta["replaced"]
            asked = replaced if isinstance(replaced, int) else None
        else:
            asked = max((n for n in kept if n < current), default=None)
        if asked is None:
            raise ClientError(
                404,
                f"{space} v{current} replaced no earlier version: name a kept one,"
                ' {"version": N}',
                space=space,
                kept=kept,
            )
        what = f"{space} v{asked} (the version v{current} replaced)"
    if asked not in kept:
        raise ClientError(
            404,
            f"{what} is not kept (pruned, or never deployed): roll back to one of `kept`",
            space=space,
            version=asked,
            kept=kept,
        )
    return asked


# -- helpers -------------------------------------------------------------------


def _hash(upload: BinaryIO) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    upload.seek(0)
    while chunk := upload.read(1 << 20):
        h.update(chunk)
        size += len(chunk)
    upload.seek(0)
    return h.hexdigest(), size


def _current_number(sdir: Path) -> int | None:
    try:
        return int(os.readlink(sdir / "current").rsplit("/", 1)[1])
    except (FileNotFoundError, NotADirectoryError):
        return None


def _read_int(path: Path) -> int:
    """A number kept in a file; 0 when the file does not exist yet."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return 0


@contextlib.contextmanager
def _disk_full_is_507() -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        raise ClientError(
            507,
            "the data disk is full: nothing was published; free space under"
            " POLYSERVE_DATA_DIR and deploy again",
        ) from None
