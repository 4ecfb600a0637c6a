"""The data directory's writes: stage an upload safely, publish it atomically, delete, prune.

Every write but staging holds the store lock. Published version directories are never
written again; only ``current`` moves (the layout is polyserve.state.layout's). Each
move of ``current`` (a deploy, a rollback, a delete) and each release appends an event
to the space's history (polyserve.state.history), which is also what ranks versions for
pruning: the last ``keep_versions`` versions that were made current stay, whatever their
numbers, and so does every pinned version (``pin``) and the version that waits for its
rollout (``keep``), until it is unpinned or the space is deleted.
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

from polyserve.errors import ClientError, disk_full_is_507
from polyserve.names import DEFAULT_POOL
from polyserve.state import access
from polyserve.state.files import symlink_atomic, write_atomic, write_short
from polyserve.state.history import Event, History, rollback_target
from polyserve.state.layout import Layout, current_number, read_int
from polyserve.state.layout import Version as Version  # re-exported: workers import it here
from polyserve.state.slots import NO_SLOT, Reclaim, SlotLog
from polyserve.state.unpack import unpack_upload

log = logging.getLogger("polyserve")
DEFAULT_KEEP_VERSIONS = 10  # POLYSERVE_KEEP_VERSIONS


@dataclass(frozen=True)
class Staged:
    """An upload unpacked into a fresh staging directory, not yet published."""

    dir: Path  # the staging directory; removed by discard() or moved by publish()
    entry: str  # entry module file name at the top of dir
    sha256: str
    size: int
    pool: str = DEFAULT_POOL  # the manifest's: which hosts of a fleet serve it
    unpacked: int = 0  # what its tar unpacked to, as POLYSERVE_MAX_UNPACKED_MB counts it

    def fields(self, space: str, version: int) -> dict[str, object]:
        """What a version's metadata and its deploy's answer both say of the upload."""
        return {
            "space": space,
            "version": version,
            "sha256": self.sha256,
            "size": self.size,
            "entry": self.entry,
            "pool": self.pool,
        }


class Store(Layout):
    """The data directory, read (Layout) and written: the one way `current` moves."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        max_spaces: int,
        keep_versions: int = DEFAULT_KEEP_VERSIONS,
        disk_budget: int = 0,
        lazy_slots: bool = False,
    ) -> None:
        super().__init__(data_dir)
        self.max_spaces = max_spaces
        self.keep_versions = keep_versions
        # Bytes the version files may take, 0: no limit (a fleet host's only, whose files
        # the fleet keeps too: polyserve/state/budget.py).
        self.disk_budget = disk_budget
        # A fleet host that serves what it is asked (Settings.lazy_slots): a space's
        # change moves its pointer without a slot, which its first request here takes
        # (claim_slot), and a full table hands over the slot of a space no worker holds.
        self.lazy_slots = lazy_slots
        for d in (self.spaces_dir, self.staging_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.slots = SlotLog(self.root / "slots.log", max_spaces)
        self.history = History(self.spaces_dir)

    def stage(self, upload: BinaryIO, filename: str, max_unpacked: int) -> Staged:
        """Unpack an upload (a .py file or a tar) into a fresh directory and find its entry."""
        digest, size = _hash(upload)
        with disk_full_is_507():
            staging = Path(tempfile.mkdtemp(dir=self.staging_dir))
        try:
            with disk_full_is_507():
                manifest, unpacked = unpack_upload(upload, staging, filename, max_unpacked)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return Staged(staging, manifest.entry, digest, size, manifest.pool, unpacked)

    def discard(self, staged: Staged) -> None:
        shutil.rmtree(staged.dir, ignore_errors=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The store-wide write lock: publishes are rare and short (bench/NOTES.md,
        "Figures moved out of code comments"), so one lock for the store is enough."""
        with open(self.root / "store.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                # Another process may have taken or handed over a slot since this one
                # last read the log: what is done under the lock sees the slots as they are.
                self.slots.refresh()
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
        current: bool = True,
    ) -> tuple[int, int]:
        """Move a validated stage into place and flip `current` (with current=False,
        keep it beside the current one: a rollout's new version). Hold locked(); returns
        (slot, version number). The number is the space's next one, or the one a fleet
        gave it; the slot is NO_SLOT on a lazy_slots host that has none for the space
        yet. Pruning is the caller's: only it knows what is held."""
        sdir = self.space_dir(space)
        if number is None:
            number = read_int(sdir / "last") + 1
        meta = {
            # What this version replaced: a rollback without a number goes back to it.
            "replaced": current_number(sdir),
            **meta,
            **staged.fields(space, number),
            "deployed_at": meta.get("deployed_at", time.time()),
        }
        fresh = self.place(space, number, staged)
        try:
            if not current:
                slot = self.keep(space, number, meta)
            else:
                slot = self.point(space, number, meta, reclaim)
        except BaseException:
            if fresh:  # nothing is active before the flip: undo what this publish wrote
                shutil.rmtree(sdir / "versions" / str(number), ignore_errors=True)
                (sdir / "versions" / f"{number}.json").unlink(missing_ok=True)
            raise
        return slot, number

    def place(self, space: str, number: int, staged: Staged) -> bool:
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
        with disk_full_is_507():
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
        returns the slot, or NO_SLOT on a lazy_slots host where the space has none (its
        first request here takes one, after this: it finds this version current)."""
        sdir = self.space_dir(space)
        with disk_full_is_507():
            slot = self.slots.slot(space)
            if slot is None and not self.lazy_slots:
                slot = self.slots.allocate(space, self._deleted, reclaim, sync=sync)
            known = self.meta(space, number)
            if known is not None and known.get("sha256") != meta.get("sha256"):
                # Files of another upload under this number (a fleet that went back in
                # time): fetched again on first use rather than served.
                self._drop_files(space, number)
            (sdir / "versions").mkdir(parents=True, exist_ok=True)
            write_atomic(sdir / "versions" / f"{number}.json", json.dumps(meta).encode())
            previous = current_number(sdir)
            event: Event = "rollback"
            if number > read_int(sdir / "last"):
                write_short(sdir / "last", str(number))
                event = "deploy"
            symlink_atomic(f"versions/{number}", sdir / "current")
            self.history.record(space, event, number, previous)
        return NO_SLOT if slot is None else slot

    def claim_slot(self, space: str, reclaim: Reclaim) -> int:
        """A slot for a deployed space that has none here (a lazy_slots host's, on the
        space's first request): a new one while the table has room, then one handed over
        with its totals from a space no worker holds (on a lazy_slots host any such
        space's, since its next request here claims a slot again; elsewhere a deleted
        space's). Hold locked(); raises ClientError 507 when none can be had."""
        deleted = (lambda _owner: True) if self.lazy_slots else self._deleted
        return self.slots.allocate(space, deleted, reclaim)

    def keep(self, space: str, number: int, meta: dict[str, object]) -> int:
        """Store version `number`'s metadata as a kept version without moving `current`
        (a deploy with current=false: a rollout makes it current later). It waits for
        its rollout: no history ranks it, so pruning keeps it by name until unpin() (its
        rollout's end), a move of `current` to it, or a later keep() in its place. Hold
        locked(); returns the slot (NO_SLOT: none here yet). Raises ClientError 409 when
        the space is not deployed: a rollout needs a current version to start from."""
        sdir = self.space_dir(space)
        slot = self.slots.slot(space)
        if current_number(sdir) is None:
            raise ClientError(
                409,
                f"space {space} is not deployed: deploy it first without current=false",
                space=space,
            )
        with disk_full_is_507():
            write_atomic(sdir / "versions" / f"{number}.json", json.dumps(meta).encode())
            if number > read_int(sdir / "last"):
                write_short(sdir / "last", str(number))
            write_atomic(sdir / "waiting", str(number).encode(), fsync=True)
        return NO_SLOT if slot is None else slot

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
        """Undeploy: drop `current`, the space's logs and its secrets; prune() removes
        the versions once nobody uses them. Hold locked(); returns the slot (NO_SLOT: it
        had none here), or None when the space is not deployed."""
        # Its logs go at once: a redeployed space starts a new log (records its draining
        # requests write meanwhile are dropped: see LogStore.open).
        shutil.rmtree(self.logs_dir / space, ignore_errors=True)
        # A space deployed again under this name later starts without them.
        self.secrets.drop(space)
        previous = current_number(self.space_dir(space))
        try:
            os.unlink(self.space_dir(space) / "current")
        except FileNotFoundError:
            return None
        # Its pins go with it: a redeployed space starts with none.
        (self.space_dir(space) / "pins").unlink(missing_ok=True)
        (self.space_dir(space) / "waiting").unlink(missing_ok=True)
        self.history.record(space, "delete", None, previous)
        access.drop(self.root, space)  # a space deployed again under the name starts public
        slot = self.slots.slot(space)
        return NO_SLOT if slot is None else slot

    def pin(self, space: str, number: int) -> list[int]:
        """Keep kept version `number` from pruning until unpin() (a rollout pins the
        versions it names). Hold locked(); returns the pins. Raises ClientError 404 when
        the space is not deployed or the version is not kept (the error lists the kept
        ones)."""
        if current_number(self.space_dir(space)) is None:
            raise ClientError(404, f"space {space} is not deployed", space=space)
        kept = self.kept(space)
        if number not in kept:
            raise ClientError(
                404,
                f"space {space} keeps no version {number} to pin: it keeps {kept}",
                space=space,
                kept=kept,
            )
        return self._write_pins(space, {*self.pins(space), number})

    def unpin(self, space: str, number: int) -> list[int]:
        """Let pruning remove version `number` again (from the next prune on), pinned or
        waiting for its rollout. Hold locked(); returns the pins left."""
        if self.waiting(space) == number:
            (self.space_dir(space) / "waiting").unlink(missing_ok=True)
        return self._write_pins(space, set(self.pins(space)) - {number})

    def _write_pins(self, space: str, pins: set[int]) -> list[int]:
        found = sorted(pins)
        with disk_full_is_507():
            write_atomic(self.space_dir(space) / "pins", json.dumps(found).encode(), fsync=True)
        return found

    def _drop_files(self, space: str, number: int) -> None:
        files = self.space_dir(space) / "versions" / str(number)
        if files.is_dir():
            log.warning("%s v%d: the files on disk are not this upload's: dropped", space, number)
            shutil.rmtree(files)

    def _deleted(self, space: str) -> bool:
        return not os.path.lexists(self.space_dir(space) / "current")

    def prune(self, space: str, oldest_held: int | None) -> None:
        """Remove the versions nobody can use any more. Kept: the current one and the
        ones made current most recently, keep_versions in all, the pinned ones and the
        one waiting for its rollout (none of them once the space is deleted), and every
        version numbered from the oldest one a worker holds — a draining request or a
        slow load may still read its files (a worker writes only the oldest number it
        holds, so everything from there up stays). Hold locked()."""
        sdir = self.space_dir(space)
        current = current_number(sdir)
        try:
            names = [(p.name.removesuffix(".json"), p) for p in (sdir / "versions").iterdir()]
        except FileNotFoundError:
            return
        found = [(int(name), path) for name, path in names if name.isdigit()]
        keep = {current}
        if current is not None:  # a deleted space keeps only what is held
            numbers = {number for number, _ in found}
            keep.update(self.history.ranked(space, numbers, self.keep_versions))
            keep.update(self.pins(space))
            waiting = self.waiting(space)
            if waiting == current:  # made current (every move prunes): the history ranks it
                (sdir / "waiting").unlink(missing_ok=True)
            keep.add(waiting)
        for number, path in found:
            if number in keep or (oldest_held is not None and number >= oldest_held):
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


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
