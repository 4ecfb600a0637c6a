"""gunicorn server hooks: the master owns the data-dir lock, the shared table, its checkpoints."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from polyserve import meter
from polyserve import settings as settings_mod
from polyserve.shm import H_STARTED, Table, segment_name
from polyserve.store import Store

EXIT_DATA_DIR_BUSY = 4  # named exit code: another master serves this data directory
CHECKPOINT = "usage.json"
_PR_SET_PDEATHSIG = 1


class _Master:
    """What the master holds for its lifetime; forked workers inherit it with the memory."""

    def __init__(self, s: settings_mod.Settings, store: Store, table: Table) -> None:
        self.settings = s
        self.store = store
        self.table = table
        self.checkpoint_path = store.root / CHECKPOINT
        self.lock = threading.Lock()  # checkpoint reads vs folding a dead worker's row
        self.stop = threading.Event()

    def checkpoint(self) -> None:
        with self.lock:
            meter.checkpoint(
                self.table, self.store.slot_names(), self.checkpoint_path, meter.now_us()
            )

    def checkpoints(self) -> None:
        """The checkpoint thread: a master killed with -9 loses at most one interval."""
        while not self.stop.wait(self.settings.checkpoint_interval):
            try:
                self.checkpoint()
            except Exception:  # a full disk must not end the thread: try again next time
                logging.getLogger("polyserve").exception("usage checkpoint failed")


_master: _Master | None = None
_lock_file: Any = None
_worker_slot: int | None = None  # set in each worker by post_fork


def inherited() -> tuple[Table, int] | None:
    """The table and this worker's row, when running under the polyserve master."""
    if _master is None or _worker_slot is None:
        return None
    return _master.table, _worker_slot


def worker_slots(workers: int) -> int:
    # A HUP starts a full set of new workers before the old ones leave.
    return max(2 * workers + 2, 8)


def on_starting(server: Any) -> None:
    global _master, _lock_file
    s = settings_mod.load()
    store = Store(s.data_dir, s.max_spaces)
    _lock_file = open(store.root / "host.lock", "a")  # noqa: SIM115 - held for the master's life
    try:
        fcntl.flock(_lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        server.log.error(
            "another polyserve host is using %s; give each host its own POLYSERVE_DATA_DIR",
            store.root,
        )
        sys.exit(EXIT_DATA_DIR_BUSY)
    _master = _Master(s, store, _create_table(server, s, store))
    threading.Thread(target=_master.checkpoints, name="usage-checkpoint", daemon=True).start()


def _create_table(server: Any, s: settings_mod.Settings, store: Store) -> Table:
    """A fresh table whose base row carries the usage of every earlier run: from the
    segment a killed master left (exact), else from the last checkpoint."""
    name = segment_name(str(store.root))
    leftover = Table.attach(name)
    if leftover is not None:
        earlier = meter.leftover_totals(leftover)
        leftover.close(unlink=True)
        server.log.warning("recovered usage from the segment of a master that died")
    else:
        earlier = meter.checkpoint_totals(store.root / CHECKPOINT, store.slot_names())
    table = Table.create(name, worker_slots(s.workers), s.max_spaces, meter.CELLS)
    table.set_header(H_STARTED, time.time_ns() // 1000)
    if earlier is not None:
        meter.set_base(table, earlier)
    return table


def pre_fork(server: Any, worker: Any) -> None:
    """Give the new worker the lowest free row; a replacement reuses its predecessor's."""
    assert _master is not None
    used = {getattr(w, "polyserve_slot", None) for w in server.WORKERS.values()}
    free = [i for i in range(_master.table.worker_slots) if i not in used]
    worker.polyserve_slot = free[0] if free else None
    if not free:
        # More workers than usage rows (TTIN past the table): a worker that cannot be
        # metered must not serve. Stop asking for it; it exits in post_fork.
        server.log.error(
            "no free usage row for another worker: the table has %d rows",
            _master.table.worker_slots,
        )
        server.num_workers = len(server.WORKERS)


def post_fork(server: Any, worker: Any) -> None:
    global _worker_slot
    if worker.polyserve_slot is None:
        sys.exit(0)
    _worker_slot = worker.polyserve_slot
    # A worker outlives a master killed with -9 unless told: uvicorn-worker does not
    # watch its parent. SIGTERM makes it finish its requests and fold its usage.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != server.pid:  # the master died before prctl took effect
        sys.exit(0)
    # polyserve logs where gunicorn's error log goes, as uvicorn-worker does for uvicorn.
    logger = logging.getLogger("polyserve")
    logger.handlers = server.log.error_log.handlers
    logger.setLevel(server.log.error_log.level)
    logger.propagate = False


def child_exit(server: Any, worker: Any) -> None:
    """A worker is gone (any cause): its counts stay; close its open residency."""
    slot = getattr(worker, "polyserve_slot", None)
    if _master is None or slot is None:
        return
    with _master.lock:
        meter.fold_row(_master.table, slot, meter.now_us())
        if _master.table.pids[slot] == worker.pid:
            _master.table.pids[slot] = 0


def on_exit(server: Any) -> None:
    """After every worker has exited: the final checkpoint, then unlink the segment."""
    if _master is not None:
        _master.stop.set()
        _master.checkpoint()
        _master.table.close(unlink=True)
    if _lock_file is not None:
        _lock_file.close()
