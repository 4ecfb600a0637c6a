"""A fleet host's disk budget: the files of versions no worker holds, removed least
recently used first until the version directories fit POLYSERVE_DISK_BUDGET_MB.

Only the files go (``versions/N/``); the metadata (``versions/N.json``) stays, so the
version is still current, kept and callable, and its next load fetches the files from
the fleet again (polyserve/fleet/fetch.py). "Used" is the last load of the version by
any worker here, or the arrival of its files: a load sets the directory's mtime
(`reading`).

Two things keep a version's files from going while a worker may read them. A worker
holds every version it has loaded or is loading (Broadcast.hold, polyserve/serve/held.py),
and nothing numbered from the oldest one it holds is removed. And a load reads the
files under a shared lock of their directory, taken after its hold: the removal takes
that lock exclusively without waiting (a version being loaded is skipped) and reads
the holds only then, so a hold written before the load's lock is always seen, and a
load whose lock came after a removal finds the files gone and fetches them. The
directory rather than the metadata file: a rollback replaces that file, and its lock
with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from polyserve.state.broadcast import Broadcast
from polyserve.state.layout import Layout
from polyserve.state.store import Store

log = logging.getLogger("polyserve")


class Pruned(Exception):
    """A version's files went between a load's look and its read lock."""


@dataclass(frozen=True)
class OnDisk:
    """One version whose files are on this host's disk."""

    space: str
    number: int
    size: int  # the bytes of its files
    used: float  # its directory's mtime: its last load here, or its files' arrival


@dataclass
class OverBudget:
    """The warning that the files stay over the budget because workers hold them: said
    when a pass first finds it so, then at most once every `every_s` while it stays so
    (each pass would say it again: hundreds under load), and once more, as info, when
    the files fit again. One per process: each trims on its own."""

    every_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    said_at: float | None = None

    def over(self, total: int, budget: int) -> None:
        now = self.clock()
        if self.said_at is not None and now - self.said_at < self.every_s:
            return
        self.said_at = now
        log.warning(
            "disk budget: the files here take %d bytes, over POLYSERVE_DISK_BUDGET_MB's %d:"
            " the rest are held by workers (said again at most every %g s while so)",
            total, budget, self.every_s,
        )  # fmt: skip

    def fit(self, total: int, budget: int) -> None:
        if self.said_at is not None:
            self.said_at = None
            log.info(
                "disk budget: the files here take %d bytes, within its %d again", total, budget
            )


OVER_BUDGET = OverBudget()


def on_disk(layout: Layout) -> list[OnDisk]:
    """Every version with its files here, least recently used first."""
    found = []
    for owner in _dirs(str(layout.spaces_dir)):
        for name in _dirs(owner.path):
            space = f"{owner.name}/{name.name}"
            versions = os.path.join(name.path, "versions")
            try:
                # A directory's link count is 2 plus its subdirectories (ext4, xfs,
                # tmpfs; a filesystem that does not count says 1): a space known here
                # by its metadata alone costs a stat, not a listing (bench/NOTES.md).
                if os.stat(versions).st_nlink == 2:
                    continue
            except FileNotFoundError:
                continue
            for entry in _dirs(versions):
                if entry.name.isdigit():
                    try:
                        used = entry.stat(follow_symlinks=False).st_mtime
                        size = _size(entry.path)
                    except FileNotFoundError:  # another pass (or a prune) moved it meanwhile
                        continue
                    found.append(OnDisk(space, int(entry.name), size, used))
    return sorted(found, key=lambda v: (v.used, v.space, v.number))


def _dirs(path: str) -> list[os.DirEntry[str]]:
    """The directories in `path` (none when it is not there)."""
    try:
        with os.scandir(path) as entries:
            return [e for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def trim(
    store: Store, broadcast: Broadcast, budget: int, warning: OverBudget = OVER_BUDGET
) -> list[OnDisk]:
    """Remove the files of the least recently used versions no worker holds or is
    loading, until the files here take at most `budget` bytes; returns what it removed.
    The disk's trouble is logged, not raised: the next pass tries again. Files that
    stay over the budget (held) are told by `warning`."""
    try:
        return _trim(store, broadcast, budget, warning)
    except OSError:
        log.exception("disk budget: the pass failed")
        return []


def _trim(store: Store, broadcast: Broadcast, budget: int, warning: OverBudget) -> list[OnDisk]:
    """trim's work. The data directory is listed before the store lock (a long walk on a
    host of many spaces); each version is looked at again under it, where its files are
    moved aside, and deleted after it."""
    found = on_disk(store)
    total = sum(v.size for v in found)
    if total <= budget:
        warning.fit(total, budget)
        return []
    trash: list[Path] = []
    removed: list[OnDisk] = []
    with store.locked():
        store.slots.refresh()  # a slot allocated by another process since this one looked
        for version in found:
            if total <= budget:
                break
            if not (store.space_dir(version.space) / "versions" / str(version.number)).is_dir():
                total -= version.size  # pruned since the listing (every removal holds the lock)
                continue
            moved = _move_aside(store, broadcast, version)
            if moved is not None:
                trash.append(moved)
                removed.append(version)
                total -= version.size
    for path in trash:
        shutil.rmtree(path, ignore_errors=True)
    for version in removed:
        log.info(
            "disk budget: removed the files of %s v%d (%d bytes); fetched again on its next load",
            version.space, version.number, version.size,
        )  # fmt: skip
    if total > budget:
        warning.over(total, budget)
    else:
        warning.fit(total, budget)
    return removed


def _move_aside(store: Store, broadcast: Broadcast, version: OnDisk) -> Path | None:
    """Rename a version's files into the staging directory, unless a worker holds the
    version or reads it right now; the new path, or None when they stay."""
    versions = store.space_dir(version.space) / "versions"
    if not (versions / f"{version.number}.json").exists():
        return None  # files without metadata: Store.prune's, not the budget's
    files = os.open(versions / str(version.number), os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(files, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a load reads them right now
        # Read only now: a hold written before a load's lock is seen here.
        if _held(store, broadcast, version):
            return None
        trash = store.staging_dir / f"pruned-{uuid.uuid4().hex}"
        os.rename(versions / str(version.number), trash)
    finally:
        os.close(files)  # and its lock: a load waiting for it finds the files gone
    return trash


def _held(store: Store, broadcast: Broadcast, version: OnDisk) -> bool:
    """Whether some worker may hold the version: every worker writes only the oldest
    number it holds of a space, so everything from the oldest held up counts as held."""
    slot = store.slots.slot(version.space)
    if slot is None or slot >= broadcast.table.space_slots:
        return False  # no slot here: no worker can hold any version of it
    oldest = broadcast.oldest_held(slot)
    return oldest is not None and version.number >= oldest


@contextlib.contextmanager
def reading(layout: Layout, space: str, number: int) -> Iterator[None]:
    """A load's read of a version's files: under a shared lock of their directory, which
    the budget's removal takes exclusively; marks the version used. Take it after the
    version's hold. Raises Pruned when the files are gone, or went while it waited."""
    path = layout.space_dir(space) / "versions" / str(number)
    try:
        files = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise Pruned(f"{space} v{number}") from None
    try:
        fcntl.flock(files, fcntl.LOCK_SH)
        try:
            here = os.stat(path).st_ino == os.fstat(files).st_ino
        except FileNotFoundError:
            here = False
        if not here:  # moved aside while this waited for the lock
            raise Pruned(f"{space} v{number}")
        os.utime(files)  # used now: the last to go
        yield
    finally:
        os.close(files)


def _size(path: str) -> int:
    """The bytes of the regular files under a directory."""
    total = 0
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                total += _size(entry.path)
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total
