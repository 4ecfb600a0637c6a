"""The host's one shared-memory segment: int64 words the master maps before fork.

Layout (all little-endian int64, so every cell is an aligned 8-byte store):

    word 0              MAGIC
    word 1              LAYOUT_VERSION
    word 2              worker_slots  (W)
    word 3              space_slots   (S)
    words 4 .. 4+W      worker pid per worker slot (0 = free or still booting)
    next S words        generation word per space slot (bumped by each deploy/delete)

The master creates it in gunicorn's ``on_starting``; forked workers inherit the
mapping, so nothing is attached by name on the request path.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
from multiprocessing import resource_tracker, shared_memory

MAGIC = 0x70_6F_6C_79_73_72_76  # "polysrv"
LAYOUT_VERSION = 1
HEADER_WORDS = 4


def segment_name(data_dir: str) -> str:
    """A name derived from the data directory, so a restarted master finds its own."""
    digest = hashlib.sha256(os.path.realpath(data_dir).encode()).hexdigest()[:16]
    return f"polyserve-{digest}"


@contextlib.contextmanager
def _untracked():
    # Python < 3.13 registers every SharedMemory with the resource tracker, which
    # spawns a helper process and unlinks (with a warning) segments it thinks leaked
    # when the master exits. The master owns the lifetime itself (unlink in on_exit),
    # so registration is suppressed while the segment is created or attached.
    register = resource_tracker.register
    resource_tracker.register = lambda name, rtype: None
    try:
        yield
    finally:
        resource_tracker.register = register


class Table:
    """Typed views over the segment's words; see the module docstring for the layout."""

    def __init__(
        self,
        buf: memoryview | mmap.mmap,
        worker_slots: int,
        space_slots: int,
        shm: shared_memory.SharedMemory | None = None,
    ) -> None:
        self._shm = shm
        self._buf = buf
        self.words = memoryview(buf).cast("q")
        self.worker_slots = worker_slots
        self.space_slots = space_slots
        base = HEADER_WORDS
        self.pids = self.words[base : base + worker_slots]
        base += worker_slots
        self.generations = self.words[base : base + space_slots]

    @staticmethod
    def size_for(worker_slots: int, space_slots: int) -> int:
        return 8 * (HEADER_WORDS + worker_slots + space_slots)

    def _init_header(self) -> None:
        self.words[0] = MAGIC
        self.words[1] = LAYOUT_VERSION
        self.words[2] = self.worker_slots
        self.words[3] = self.space_slots

    @classmethod
    def create(cls, name: str, worker_slots: int, space_slots: int) -> Table:
        """Create the named segment, replacing a leftover of a master that died."""
        size = cls.size_for(worker_slots, space_slots)
        with _untracked():
            try:
                shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            except FileExistsError:
                # A master killed with -9 leaves its segment behind; generation words
                # need no recovery (the store is the truth), so start from zero.
                stale = shared_memory.SharedMemory(name=name)
                stale.close()
                stale.unlink()
                shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        table = cls(shm.buf, worker_slots, space_slots, shm=shm)
        table._init_header()
        return table

    @classmethod
    def anonymous(cls, worker_slots: int, space_slots: int) -> Table:
        """A private table for a host app running without gunicorn (in-process tests)."""
        table = cls(
            mmap.mmap(-1, cls.size_for(worker_slots, space_slots)), worker_slots, space_slots
        )
        table._init_header()
        return table

    def close(self, unlink: bool = False) -> None:
        """Release this process's views; the master also unlinks the name at exit."""
        for view in (self.pids, self.generations, self.words):
            view.release()
        if self._shm is not None:
            self._shm.close()
            if unlink:
                with contextlib.suppress(FileNotFoundError):  # already gone: fine
                    self._shm.unlink()
