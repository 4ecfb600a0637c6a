"""The host's one shared-memory segment: int64 words the master maps before fork.

Layout (native int64 words, so every cell is an aligned 8-byte store)::

    header       8 words   MAGIC, LAYOUT_VERSION, W, S, C, started (wall µs),
                           alive (monotonic µs, the master's last checkpoint),
                           followed (monotonic µs, the fleet follower's last heartbeat
                           after a catch-up; 0 until its first, and on a single host)
    workers      W x 2     per worker row: pid (0 = free or booting), requests in flight
    generations  S         per space slot: bumped by each deploy, delete and release
    releases     S         per space slot: bumped by each release on demand
    access       S         per space slot: bumped by each change of its access (keys,
                           private) and each deploy, delete and rollback, so a worker
                           re-reads the access file it keeps (polyserve.serve.gate)
    rollouts     S         per space slot: its running rollout's word (polyserve.state.
                           rollouts: the new version, its percent and a tag; 0 = none),
                           written from the rollout's file under the store lock (by the
                           master's rollout thread, a start or an abort; on a fleet host
                           also its follower), so every writer writes the file's word
    held         W x S     per (worker, space): the oldest version number the worker
                           holds or is loading (0 = none), so no version directory in
                           use is pruned and no slot in use is handed to another space
    cells        (W+1) x S x C
                           usage counters per (row, space); rows 0..W-1 belong to one
                           worker each, row W is the master's "base" row holding what
                           was restored at start (see polyserve.usage.meter for the C cells)

W worker rows, S space slots, C cells. The master creates the segment in gunicorn's
`when_ready`, once its sockets are bound; forked workers inherit the mapping, so nothing
is attached by name on the request path. Every word has one writer at a time: a worker
writes only its own rows, the master writes the header (but `followed`, the follower's
one word), the base row, and the rows of a worker that died.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
from collections.abc import Iterator
from multiprocessing import resource_tracker, shared_memory

import numpy as np

MAGIC = 0x70_6F_6C_79_73_72_76  # "polysrv"
# 10: the lane's duration histogram (polyserve.usage.meter); 9: the rollout words and
# the lane cells (polyserve.state.rollouts); 8: the batch
# and first-byte histograms (polyserve.usage.meter); 7: the access words
# and the keys' cells (polyserve.serve.gate).
LAYOUT_VERSION = 10
HEADER_WORDS = 8
H_STARTED, H_ALIVE, H_FOLLOWED = 5, 6, 7
WORKER_WORDS = 2  # pid, in flight


def segment_name(data_dir: str) -> str:
    """A name derived from the data directory, so a restarted master finds its own."""
    digest = hashlib.sha256(os.path.realpath(data_dir).encode()).hexdigest()[:16]
    return f"polyserve-{digest}"


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    assert shm.buf is not None  # None only once closed
    return shm.buf


@contextlib.contextmanager
def _untracked() -> Iterator[None]:
    # Python < 3.13 registers every SharedMemory with the resource tracker, which
    # spawns a helper process and unlinks (with a warning) segments it thinks leaked
    # when the master exits; unlink() unregisters, which spawns one too and makes it
    # raise KeyError for a name it never saw. The master owns the lifetime itself
    # (unlink in on_exit), so both are suppressed around create, attach and unlink.
    register, unregister = resource_tracker.register, resource_tracker.unregister
    resource_tracker.register = resource_tracker.unregister = lambda name, rtype: None
    try:
        yield
    finally:
        resource_tracker.register, resource_tracker.unregister = register, unregister


class Table:
    """Typed views over the segment's words; see the module docstring for the layout."""

    def __init__(
        self,
        buf: memoryview | mmap.mmap,
        worker_rows: int,
        space_slots: int,
        cells: int,
        shm: shared_memory.SharedMemory | None = None,
    ) -> None:
        self._shm = shm
        self._buf = buf
        self.words = memoryview(buf).cast("q")
        self.worker_rows = worker_rows
        self.space_slots = space_slots
        self.cells = cells
        w, s = worker_rows, space_slots
        self.pids = self.words[HEADER_WORDS : HEADER_WORDS + WORKER_WORDS * w : WORKER_WORDS]
        self.workers_base = HEADER_WORDS
        gen = HEADER_WORDS + WORKER_WORDS * w
        self.generations = self.words[gen : gen + s]
        self.releases = self.words[gen + s : gen + 2 * s]
        self.access = self.words[gen + 2 * s : gen + 3 * s]
        self.rollouts = self.words[gen + 3 * s : gen + 4 * s]
        self.held_base = gen + 4 * s
        self.cells_base = self.held_base + w * s
        self.base_row = w  # the master's row of restored totals

    @staticmethod
    def size_for(worker_rows: int, space_slots: int, cells: int) -> int:
        w, s = worker_rows, space_slots
        return 8 * (HEADER_WORDS + WORKER_WORDS * w + 4 * s + w * s + (w + 1) * s * cells)

    def inflight_index(self, row: int) -> int:
        return self.workers_base + WORKER_WORDS * row + 1

    def cell_index(self, row: int, slot: int, cell: int) -> int:
        return self.cells_base + (row * self.space_slots + slot) * self.cells + cell

    def held_index(self, row: int, slot: int) -> int:
        return self.held_base + row * self.space_slots + slot

    def held_array(self) -> np.ndarray:
        """The held words as a (W, S) view."""
        n = self.worker_rows * self.space_slots
        flat = np.frombuffer(self._buf, dtype=np.int64, count=n, offset=8 * self.held_base)
        return flat.reshape(self.worker_rows, self.space_slots)

    def cell_array(self) -> np.ndarray:
        """All usage cells as a (W+1, S, C) view, for readers that sum."""
        n = (self.worker_rows + 1) * self.space_slots * self.cells
        flat = np.frombuffer(self._buf, dtype=np.int64, count=n, offset=8 * self.cells_base)
        return flat.reshape(self.worker_rows + 1, self.space_slots, self.cells)

    def inflight_array(self) -> np.ndarray:
        n = WORKER_WORDS * self.worker_rows
        flat = np.frombuffer(self._buf, dtype=np.int64, count=n, offset=8 * self.workers_base)
        return flat[1::WORKER_WORDS]

    def header(self, index: int) -> int:
        return self.words[index]

    def set_header(self, index: int, value: int) -> None:
        self.words[index] = value

    def _init_header(self) -> None:
        for i, v in enumerate(
            (MAGIC, LAYOUT_VERSION, self.worker_rows, self.space_slots, self.cells)
        ):
            self.words[i] = v

    @classmethod
    def create(cls, name: str, worker_rows: int, space_slots: int, cells: int) -> Table:
        """Create the named segment; a leftover must have been dealt with (see attach)."""
        with _untracked():
            shm = shared_memory.SharedMemory(
                name=name, create=True, size=cls.size_for(worker_rows, space_slots, cells)
            )
        table = cls(_buffer(shm), worker_rows, space_slots, cells, shm=shm)
        table._init_header()
        return table

    @classmethod
    def attach(cls, name: str) -> Table | None:
        """The segment of a master that died (kill -9), if one is left with our layout."""
        with _untracked():
            try:
                shm = shared_memory.SharedMemory(name=name)
            except FileNotFoundError:
                return None
        header = _buffer(shm).cast("q")[:HEADER_WORDS].tolist()
        magic, layout, w, s, c = header[:5]
        if (magic, layout) != (MAGIC, LAYOUT_VERSION) or shm.size < cls.size_for(w, s, c):
            shm.close()
            with _untracked():
                shm.unlink()  # not ours to read: an older layout. The checkpoint covers it.
            return None
        return cls(_buffer(shm), w, s, c, shm=shm)

    @classmethod
    def anonymous(cls, worker_rows: int, space_slots: int, cells: int) -> Table:
        """A private table for a host app running without gunicorn (in-process tests)."""
        size = cls.size_for(worker_rows, space_slots, cells)
        table = cls(mmap.mmap(-1, size), worker_rows, space_slots, cells)
        table._init_header()
        return table

    def close(self, unlink: bool = False) -> None:
        """Release this process's views; the master also unlinks the name at exit."""
        views = (self.pids, self.generations, self.releases, self.access, self.rollouts)
        for view in (*views, self.words):
            view.release()
        if self._shm is not None:
            self._shm.close()
            if unlink:
                with _untracked(), contextlib.suppress(FileNotFoundError):  # gone: fine
                    self._shm.unlink()
