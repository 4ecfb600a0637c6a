"""The shared directory: stage an upload safely, publish atomically, read the current version.

Layout under POLYSERVE_DATA_DIR::

    store.lock                      flock held while publishing, deleting or allocating
    slots.log                       which space owns each slot (polyserve.slots)
    staging/<random>/               one fresh directory per deploy in progress
    spaces/<owner>/<name>/last      the last version number handed out
    spaces/<owner>/<name>/current   symlink -> versions/<n>, replaced atomically
    spaces/<owner>/<name>/versions/<n>/       immutable files of version n
    spaces/<owner>/<name>/versions/<n>.json   its metadata
    logs/<owner>/<name>/            the space's recent log records (polyserve.logstore)

Published version directories are never written again; only ``current`` moves.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from polyserve.errors import DISK_FULL, ClientError
from polyserve.slots import Reclaim, SlotLog
from polyserve.unpack import unpack_upload

KEEP_VERSIONS = 3  # older versions are pruned; in-flight requests only ever use the last two


@dataclass(frozen=True)
class Staged:
    """An upload unpacked into a fresh staging directory, not yet published."""

    dir: Path  # the staging directory; removed by discard() or moved by publish()
    entry: str  # entry module file name at the top of dir
    sha256: str
    size: int


@dataclass(frozen=True)
class Version:
    """A published version as a worker needs it to import."""

    space: str
    number: int
    dir: Path
    entry: str


class Store:
    def __init__(self, data_dir: str | os.PathLike[str], max_spaces: int) -> None:
        self.root = Path(data_dir).resolve()
        self.max_spaces = max_spaces
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
                entry = unpack_upload(upload, staging, filename, max_unpacked)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return Staged(staging, entry, digest, size)

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
            **meta,
            "space": space,
            "version": number,
            "sha256": staged.sha256,
            "size": staged.size,
            "entry": staged.entry,
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
        there already (a fleet host fetching what it has). Hold locked(); returns
        whether this call put them there."""
        version_dir = self.space_dir(space) / "versions" / str(number)
        if version_dir.is_dir():
            return False
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
        (a fleet host fetches them on first use). Hold locked(); returns the slot."""
        sdir = self.space_dir(space)
        with _disk_full_is_507():
            slot = self.slots.slot(space)
            if slot is None:
                slot = self.slots.allocate(space, self._deleted, reclaim, sync=sync)
            (sdir / "versions").mkdir(parents=True, exist_ok=True)
            write_atomic(sdir / "versions" / f"{number}.json", json.dumps(meta).encode())
            if number > _read_int(sdir / "last"):
                write_atomic(sdir / "last", str(number).encode())
            _symlink_atomic(f"versions/{number}", sdir / "current")
        return slot

    def delete(self, space: str) -> int | None:
        """Undeploy: drop `current` and the space's logs; prune() removes the versions
        once nobody uses them. Hold locked(); returns the slot, or None when the space is
        not deployed."""
        # Its logs go at once: a redeployed space starts a new log (records its draining
        # requests write meanwhile are dropped: see LogStore.open).
        shutil.rmtree(self.logs_dir / space, ignore_errors=True)
        try:
            os.unlink(self.space_dir(space) / "current")
        except FileNotFoundError:
            return None
        return self.slots.slot(space)

    def _deleted(self, space: str) -> bool:
        return not os.path.lexists(self.space_dir(space) / "current")

    def prune(self, space: str, oldest_held: int | None) -> None:
        """Remove the versions nobody can use any more: those older than the newest
        KEEP_VERSIONS (all of them once the space is deleted) that are also older than
        the oldest version a worker holds — a draining request or a slow load may still
        read its files. Hold locked()."""
        sdir = self.space_dir(space)
        current = _current_number(sdir)
        newest = _read_int(sdir / "last")
        floor = newest - KEEP_VERSIONS + 1 if current is not None else newest + 1
        if oldest_held is not None:
            floor = min(floor, oldest_held)
        try:
            paths = list((sdir / "versions").iterdir())
        except FileNotFoundError:
            return
        for path in paths:
            number = path.name.removesuffix(".json")
            if number.isdigit() and int(number) < floor and int(number) != current:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

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
        return Version(space, number, sdir / "versions" / str(number), str(meta["entry"]))

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
                found[space] = meta
        return found


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


def write_atomic(path: Path, data: bytes) -> None:
    """Replace a file whole: readers see the old bytes or the new, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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


def _symlink_atomic(target: str, link: Path) -> None:
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)
