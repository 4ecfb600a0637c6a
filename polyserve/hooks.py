"""gunicorn server hooks: the master owns the shared table, worker slots and the data dir lock."""

from __future__ import annotations

import fcntl
import logging
import sys
from typing import Any

from polyserve import settings as settings_mod
from polyserve.shm import Table, segment_name
from polyserve.store import Store

# Set in the master by on_starting; forked workers inherit them with the memory.
_table: Table | None = None
_lock_file: Any = None
# Set in each worker by post_fork.
_worker_slot: int | None = None

EXIT_DATA_DIR_BUSY = 4  # named exit code: another master serves this data directory


def inherited() -> tuple[Table, int | None] | None:
    """The table and this worker's row, when running under the polyserve master."""
    return None if _table is None else (_table, _worker_slot)


def worker_slots(workers: int) -> int:
    # A HUP starts a full set of new workers before the old ones leave.
    return max(2 * workers + 2, 8)


def on_starting(server: Any) -> None:
    global _table, _lock_file
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
    _table = Table.create(segment_name(str(store.root)), worker_slots(s.workers), s.max_spaces)


def pre_fork(server: Any, worker: Any) -> None:
    """Give the new worker the lowest free row; a replacement reuses its predecessor's."""
    assert _table is not None
    used = {getattr(w, "polyserve_slot", None) for w in server.WORKERS.values()}
    free = [i for i in range(_table.worker_slots) if i not in used]
    # With no free row (workers raised past the table with TTIN) the worker still serves
    # correctly through the generation words; it only misses the control signal.
    worker.polyserve_slot = free[0] if free else None


def post_fork(server: Any, worker: Any) -> None:
    global _worker_slot
    _worker_slot = worker.polyserve_slot
    # polyserve logs where gunicorn's error log goes, as uvicorn-worker does for uvicorn.
    logger = logging.getLogger("polyserve")
    logger.handlers = server.log.error_log.handlers
    logger.setLevel(server.log.error_log.level)
    logger.propagate = False


def child_exit(server: Any, worker: Any) -> None:
    slot = getattr(worker, "polyserve_slot", None)
    if _table is not None and slot is not None and _table.pids[slot] == worker.pid:
        _table.pids[slot] = 0


def on_exit(server: Any) -> None:
    if _table is not None:
        _table.close(unlink=True)
    if _lock_file is not None:
        _lock_file.close()
