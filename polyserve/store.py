"""The shared directory: stage an upload safely, publish atomically, read the current version.

Layout under POLYSERVE_DATA_DIR::

    store.lock                      flock held while publishing, deleting or allocating
    slots.log                       append-only "<slot>\t<owner/name>" lines: slot n is line n
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
import tarfile
import tempfile
import threading
import time
import tomllib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MANIFEST = "polyserve.toml"
DEFAULT_ENTRIES = ("main.py", "app.py")
KEEP_VERSIONS = 3  # older versions are pruned; in-flight requests only ever use the last two
MAX_TAR_ENTRIES = 10_000
_NAME_PART = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
_SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}\.py")  # else stored as main.py


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
        self._names: list[str] = []
        self._slots_read = 0  # bytes of slots.log already parsed
        self._slots_lock = threading.Lock()  # the loop and publish threads both refresh

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
                if filename.endswith(".py"):
                    # Keep the uploaded name, so errors and tracebacks name the user's file.
                    entry = filename if _SOURCE_NAME.fullmatch(filename) else "main.py"
                    _write_source(upload, staging / entry, filename)
                else:
                    _extract_tar(upload, staging, max_unpacked, filename)
                    entry = _find_entry(staging)
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

    def publish(self, space: str, staged: Staged, meta: dict[str, object]) -> tuple[int, int]:
        """Move a validated stage into place and flip `current`. Hold locked(); returns
        (slot, version number)."""
        sdir = self.space_dir(space)
        versions = sdir / "versions"
        with _disk_full_is_507():
            slot = self.slot(space)
            if slot is None:
                slot = self._allocate_slot(space)
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
        self._prune(versions, number)
        return slot, number

    def delete(self, space: str) -> int | None:
        """Undeploy: drop `current` and the versions; the slot stays the space's. Hold
        locked(); returns the slot, or None when the space is not deployed."""
        sdir = self.space_dir(space)
        try:
            os.unlink(sdir / "current")
        except FileNotFoundError:
            return None
        shutil.rmtree(sdir / "versions", ignore_errors=True)
        return self.slot(space)

    def _allocate_slot(self, space: str) -> int:
        slot = len(self._names)  # publish() refreshed the map under the lock
        if slot >= self.max_spaces:
            raise StoreError(
                507,
                f"space table is full ({self.max_spaces} slots): raise POLYSERVE_MAX_SPACES",
                space=space,
            )
        fd = os.open(self._slots_log, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, f"{slot}\t{space}\n".encode())
            os.fsync(fd)  # billing rows are keyed by slot: the map must survive a crash
        finally:
            os.close(fd)
        self._refresh_slots()
        return slot

    def _refresh_slots(self) -> None:
        """Parse what was appended to slots.log since the last read (complete lines only)."""
        with self._slots_lock, open(self._slots_log, "rb") as f:
            f.seek(self._slots_read)
            tail = f.read()
            complete = tail[: tail.rfind(b"\n") + 1]
            for line in complete.decode().splitlines():
                number, space = line.split("\t")
                if int(number) != len(self._names):
                    raise RuntimeError(f"slots.log is corrupt at slot {number}")
                self._slots[space] = len(self._names)
                self._names.append(space)
            self._slots_read += len(complete)

    def _prune(self, versions: Path, newest: int) -> None:
        for path in versions.iterdir():
            number = path.name.removesuffix(".json")
            if number.isdigit() and int(number) <= newest - KEEP_VERSIONS:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    # -- reading -------------------------------------------------------------

    def slot(self, space: str) -> int | None:
        """The space's stable slot, or None if it was never deployed."""
        if space not in self._slots:
            self._refresh_slots()
        return self._slots.get(space)

    def slot_names(self) -> list[str]:
        """Every space that ever had a slot, indexed by slot."""
        self._refresh_slots()
        return self._names

    def current(self, space: str) -> Version | None:
        """The published version `current` points at, or None if not deployed."""
        sdir = self.space_dir(space)
        try:
            target = os.readlink(sdir / "current")
        except (FileNotFoundError, NotADirectoryError):
            return None
        number = int(target.rsplit("/", 1)[1])
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


def _write_source(upload: BinaryIO, dest: Path, filename: str) -> None:
    data = upload.read()
    if not data.strip():
        raise StoreError(422, f"{filename} is empty: upload a module that defines app or handle")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StoreError(422, f"{filename} is not UTF-8 text: {exc}") from None
    dest.write_bytes(data)


def _member_name(raw: str) -> str:
    """Normalize a tar member name (`tar -C dir .` writes `./main.py`); reject escapes."""
    if raw.startswith("/") or "\\" in raw:
        raise StoreError(422, "tar member has an absolute or backslash path", member=raw)
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise StoreError(422, "tar member path contains '..'", member=raw)
    return "/".join(parts)


def _extract_tar(upload: BinaryIO, dest: Path, max_unpacked: int, filename: str) -> None:
    members: list[tarfile.TarInfo] = []
    total = 0
    try:
        with tarfile.open(fileobj=upload, mode="r:*") as tar:
            for m in tar:  # headers stream in; every cap is checked before any data is written
                if len(members) >= MAX_TAR_ENTRIES:
                    raise StoreError(422, f"tar has more than {MAX_TAR_ENTRIES} entries")
                if not (m.isreg() or m.isdir()):
                    # Links and special files are refused outright rather than checked:
                    # the tarfile filter bypasses of 2024-2025 all went through links.
                    raise StoreError(
                        422,
                        "tar may only hold regular files and directories",
                        member=m.name,
                        type=_TYPE_NAMES.get(m.type, repr(m.type)),
                    )
                name = _member_name(m.name)
                if not name:
                    if m.isdir():
                        continue  # the "." directory entry
                    raise StoreError(422, "tar member has an empty name", member=m.name)
                total += m.size
                if total > max_unpacked:
                    raise StoreError(
                        413,
                        f"tar unpacks to more than {max_unpacked >> 20} MiB",
                    )
                members.append(m.replace(name=name, deep=False))
            # The data filter is a second layer under the checks above.
            tar.extractall(dest, members=members, filter="data")
    except StoreError:
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            raise
        raise StoreError(
            422,
            f"module must be a .py file or a valid tar (plain or gzip): {exc}",
            filename=filename,
        ) from None


_TYPE_NAMES = {
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hard link",
    tarfile.CHRTYPE: "character device",
    tarfile.BLKTYPE: "block device",
    tarfile.FIFOTYPE: "fifo",
}


def _find_entry(root: Path) -> str:
    manifest = root / MANIFEST
    if manifest.is_file():
        try:
            entry = tomllib.loads(manifest.read_text("utf-8")).get("entry")
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise StoreError(422, f"{MANIFEST} is not valid TOML: {exc}") from None
        if not isinstance(entry, str) or "/" in entry or not entry.endswith(".py"):
            raise StoreError(
                422,
                f"{MANIFEST}: entry must name a .py file at the top of the tar",
                entry=entry,
            )
        if not (root / entry).is_file():
            raise StoreError(422, f"{MANIFEST}: entry {entry} is not in the tar")
        return entry
    for name in DEFAULT_ENTRIES:
        if (root / name).is_file():
            return name
    top = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())[:10]
    raise StoreError(
        422,
        "no entry module: put main.py or app.py at the top of the tar (create it with"
        f" `tar -cf space.tar -C yourdir .`) or name one in {MANIFEST}",
        found=top,
    )


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
