"""The shared directory: stage an upload safely, publish atomically, read the current version.

Layout under POLYSERVE_DATA_DIR::

    store.lock                      flock held while publishing, deleting or allocating
    slots.log                       append-only "<slot>\t<owner/name>[\t<totals>]" lines: a
                                    new slot, or a deleted space's slot handed over
    staging/<random>/               one fresh directory per deploy in progress
    spaces/<owner>/<name>/last      the last version number handed out
    spaces/<owner>/<name>/current   symlink -> versions/<n>, replaced atomically
    spaces/<owner>/<name>/versions/<n>/       immutable files of version n
    spaces/<owner>/<name>/versions/<n>.json   its metadata

Published version directories are never written again; only ``current`` moves.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

KEEP_VERSIONS = 3  # older versions are pruned; in-flight requests only ever use the last two
_NAME_PART = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")


class StoreError(Exception):
    """A deploy or lookup that cannot proceed; status is the HTTP answer it maps to."""

    def __init__(self, status: int, error: str, **details: object) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.details = details

    def body(self) -> dict[str, object]:
        return {"error": self.error, **self.details}


def parse_space(text: str) -> str:
    """Check an `owner/name` space name and return it, or raise a 422 that says the rule."""
    parts = text.split("/")
    if len(parts) != 2 or not all(_NAME_PART.fullmatch(p) for p in parts):
        raise StoreError(
            422,
            "invalid space name: use owner/name, each part 1-64 of letters, digits, '.', '_',"
            " '-', not starting with '.'",
            space=text[:100],
        )
    return text


@dataclass(frozen=True)
class Staged:
    """An upload unpacked into a fresh staging directory, not yet published."""

    dir: Path  # the staging directory; removed by discard() or moved by publish()
    entry: str  # entry module file name at the top of dir
    sha256: str
    size: int


@dataclass(frozen=True)
class Ledger:
    """The slot log read for billing. Totals are tuples in the order of meter.TOTALS."""

    names: list[str]  # the owner of each slot
    offsets: dict[int, tuple[int, ...]]  # slot -> added to its raw totals
    retired: dict[str, tuple[int, ...]]  # names that own no slot now -> their usage


# Given a deleted space's slot, its final usage totals, or None while it is in use.
Reclaim = Callable[[int], tuple[int, ...] | None] | None


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
        for d in (self.spaces_dir, self.staging_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._slots_log = self.root / "slots.log"
        self._slots_log.touch()
        self._slots: dict[str, int] = {}
        self._names: list[str] = []  # the owner of each slot
        self._base: dict[int, tuple[int, ...]] = {}  # a handed-over slot's totals then
        self._earlier: dict[str, tuple[int, ...]] = {}  # usage in slots a name lost
        self._slots_read = 0  # bytes of slots.log already parsed
        self._slots_lock = threading.Lock()  # the loop and publish threads both refresh

    def space_dir(self, space: str) -> Path:
        return self.spaces_dir / space

    # -- staging -----------------------------------------------------------

    def stage(self, upload: BinaryIO, filename: str, max_unpacked: int) -> Staged:
        """Unpack an upload (a .py file or a tar) into a fresh directory and find its entry."""
        # Here, not at the top: polyserve.unpack imports StoreError from this module.
        from polyserve.unpack import unpack_upload

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
        self, space: str, staged: Staged, meta: dict[str, object], reclaim: Reclaim = None
    ) -> tuple[int, int]:
        """Move a validated stage into place and flip `current`. Hold locked(); returns
        (slot, version number). Pruning is the caller's: only it knows what is held."""
        sdir = self.space_dir(space)
        versions = sdir / "versions"
        with _disk_full_is_507():
            slot = self.slot(space)
            if slot is None:
                slot = self._allocate_slot(space, reclaim)
            versions.mkdir(parents=True, exist_ok=True)
            number = _read_int(sdir / "last") + 1
            meta = {
                **meta,
                "space": space,
                "version": number,
                "sha256": staged.sha256,
                "size": staged.size,
                "entry": staged.entry,
                "deployed_at": time.time(),
            }
            version_dir, meta_path = versions / str(number), versions / f"{number}.json"
            try:
                _write_atomic(meta_path, json.dumps(meta).encode())
                os.rename(staged.dir, version_dir)
                _write_atomic(sdir / "last", str(number).encode())
                _symlink_atomic(f"versions/{number}", sdir / "current")
            except BaseException:
                # Nothing is active before the flip: undo what this publish wrote (the
                # number may be skipped; numbers are never reused anyway).
                shutil.rmtree(version_dir, ignore_errors=True)
                meta_path.unlink(missing_ok=True)
                raise
        return slot, number

    def delete(self, space: str) -> int | None:
        """Undeploy: drop `current`; prune() removes the versions once nobody uses them.
        Hold locked(); returns the slot, or None when the space is not deployed."""
        try:
            os.unlink(self.space_dir(space) / "current")
        except FileNotFoundError:
            return None
        return self.slot(space)

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

    def _allocate_slot(self, space: str, reclaim: Reclaim) -> int:
        """A new slot while the table has room; then the slot of a deleted space that no
        worker uses any more, whose usage stays readable by name (see ledger())."""
        slot, line = len(self._names), f"{len(self._names)}\t{space}\n"
        if slot >= self.max_spaces:
            for slot, owner in enumerate(self._names):
                if os.path.lexists(self.space_dir(owner) / "current") or reclaim is None:
                    continue
                final = reclaim(slot)  # None while a worker still uses the slot
                if final is not None:
                    line = f"{slot}\t{space}\t{','.join(map(str, final))}\n"
                    break
            else:
                raise StoreError(
                    507,
                    f"space table is full ({self.max_spaces} slots, none of them a deleted"
                    " space's that is no longer in use): raise POLYSERVE_MAX_SPACES",
                    space=space,
                )
        fd = os.open(self._slots_log, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)  # billing rows are keyed by slot: the map must survive a crash
        finally:
            os.close(fd)
        self.refresh_slots()
        return slot

    def refresh_slots(self) -> None:
        """Parse what was appended to slots.log since the last read (complete lines only).

        A line `n<TAB>owner/name` gives a space the next new slot; a line
        `n<TAB>owner/name<TAB>totals` hands slot n over from a deleted space, with the
        slot's usage totals at that moment: the old owner keeps what it used up to
        them, the new one counts from them."""
        with self._slots_lock, open(self._slots_log, "rb") as f:
            f.seek(self._slots_read)
            tail = f.read()
            complete = tail[: tail.rfind(b"\n") + 1]
            for line in complete.decode().splitlines():
                number, space, *final = line.split("\t")
                slot = int(number)
                if slot == len(self._names) and not final:
                    self._names.append(space)
                elif slot < len(self._names) and final:
                    self._hand_over(slot, space, tuple(map(int, final[0].split(","))))
                else:
                    raise RuntimeError(f"slots.log is corrupt at slot {number}")
                self._slots[space] = slot
            self._slots_read += len(complete)

    def _hand_over(self, slot: int, space: str, final: tuple[int, ...]) -> None:
        previous = self._names[slot]
        used = _minus(final, self._base.get(slot, (0,) * len(final)))
        self._earlier[previous] = _plus(self._earlier.get(previous, (0,) * len(final)), used)
        if self._slots.get(previous) == slot:
            del self._slots[previous]
        self._names[slot] = space
        self._base[slot] = final

    # -- reading -------------------------------------------------------------

    def slot(self, space: str) -> int | None:
        """The space's slot, or None if it has none (never deployed, or deleted and its
        slot handed over)."""
        if space not in self._slots:
            self.refresh_slots()
        return self._slots.get(space)

    def ledger(self) -> Ledger:
        """Who owns each slot, and what to add to each slot's raw usage totals so that
        usage is per name across slot hand-overs."""
        self.refresh_slots()
        offsets = {}
        for slot, name in enumerate(self._names):
            earlier, base = self._earlier.get(name), self._base.get(slot)
            if earlier is not None or base is not None:
                width = len(earlier or base or ())
                offsets[slot] = _minus(earlier or (0,) * width, base or (0,) * width)
        owners = set(self._names)
        retired = {n: t for n, t in self._earlier.items() if n not in owners}
        return Ledger(list(self._names), offsets, retired)

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
            meta = version and self.meta(space, version.number)
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


def _plus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def _minus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x - y for x, y in zip(a, b, strict=True))


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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def _disk_full_is_507() -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno not in _DISK_FULL:
            raise
        raise StoreError(
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
