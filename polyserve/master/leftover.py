"""A killed master's segment, while the workers it left finish their requests into it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import numpy as np

from polyserve.state.shm import Table
from polyserve.usage import meter

_SHM_DIR = "/dev/shm"  # where Linux keeps the POSIX shared memory segments, by name
_KILLED_WAIT_S = 5.0  # for a SIGKILLed old worker to be gone (see Leftover.stop)


class Leftover:
    """The segment of a master killed with -9, while the workers it left drain into it.

    The kernel sent them SIGTERM (PR_SET_PDEATHSIG): they finish the requests they hold
    and fold their residency, writing into this segment after the new master has read
    it. Its name is unlinked at once, so no later master recovers it a second time, but
    the mapping is kept; once every one of those workers is gone, what they counted
    after `taken` is added to the new table's base row, once (see `add_late_counts`).
    """

    def __init__(self, table: Table, name: str, taken: np.ndarray) -> None:
        self.table = table
        self.path = os.path.join(_SHM_DIR, name)
        self.inode = os.stat(self.path).st_ino
        self.taken = taken  # meter.leftover_totals(table) when this master started
        self.workers: dict[int, tuple[int, int]] = {}  # pid -> (row, start time)
        self._seen: set[int] = set()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def drained(self) -> bool:
        """Whether no worker of the dead master is left to write into the segment.

        A pid in its rows is taken for one of them when the process maps this segment
        (by inode), is not a child of this master, and keeps the start time it had then:
        not a process that reused the pid of a worker long gone, nor one that reuses it
        later. Its rows are read each time: a worker that was booting records its pid late.
        """
        for row, pid in enumerate(self.table.pids.tolist()):
            if pid and pid not in self._seen:
                self._seen.add(pid)
                found = _process(pid)
                if found and found[0] != os.getpid() and _maps(pid, self.path, self.inode):
                    self.workers[pid] = (row, found[1])
        self.workers = {
            pid: (row, start)
            for pid, (row, start) in self.workers.items()
            if (found := _process(pid)) is not None and found[1] == start
        }
        return not self.workers

    def fold_into(self, table: Table) -> None:
        """Once drained: add what the workers counted after `taken` to table's base
        row (see add_late_counts), and let go of the segment."""
        add_late_counts(table, self.table, self.taken)
        self.table.close()

    def stop(self, timeout: float, log: logging.Logger, lock: threading.Lock) -> None:
        """At the new master's exit: give the workers `timeout` s more, then kill them,
        as gunicorn does its own at a graceful stop; a request they had not answered is
        not counted, and their open residency ends when they are killed."""
        deadline = time.monotonic() + timeout
        while not self.drained() and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = dict(self.workers)
        for pid, (_, start) in killed.items():
            if (found := _process(pid)) is not None and found[1] == start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _KILLED_WAIT_S
        while not self.drained() and time.monotonic() < deadline:
            time.sleep(0.01)
        if killed:
            log.warning(
                "killed workers %s of the master that died: still busy after %s s",
                sorted(killed),
                timeout,
            )
        if self.workers:  # not gone after SIGKILL (uninterruptible sleep)
            log.error(
                "workers %s of the master that died did not exit: counts they make from now"
                " on are lost",
                sorted(self.workers),
            )
            self.workers.clear()
        now = meter.now_us()
        with lock:
            for row, _ in killed.values():
                meter.fold_row(self.table, row, now)  # no writer left in these rows


def _process(pid: int) -> tuple[int, int] | None:
    """A live process's parent pid and start time (clock ticks after boot); None once it
    has exited, a zombie included (an orphan's reaper may be slow to collect it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after the name, which may hold spaces
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), int(fields[19])


def _maps(pid: int, path: str, inode: int) -> bool:
    """Whether the process has the segment (that file, by inode) mapped."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            maps = f.read()
    except OSError:  # gone, or another user's: no worker of ours
        return False
    ino, name = str(inode).encode(), path.encode()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode path
        if len(fields) == 6 and fields[4] == ino and fields[5].startswith(name):
            return True
    return False


def add_late_counts(table: Table, leftover: Table, taken: np.ndarray) -> None:
    """Add to the base row what the dead master's workers counted after `taken` was read
    (= meter.leftover_totals(leftover) then). Call once they are all gone.

    leftover_totals counts a stretch still open (since S) up to the dead master's last
    checkpoint A, never past it; A does not move, the dead master writes nothing more.
    With R the residency already folded into RESIDENT_US, a stretch open at `taken`:
    - was counted then as R + max(A - S, 0);
    - its worker left gracefully at E (> A: it outlived the dead master) and folded it:
      RESIDENT_US = R + E - S, LOADED_SINCE = 0, now counted as R + E - S. The delta,
      E - max(A, S), is the part not billed yet: nothing twice, nothing lost;
    - its worker ended without folding (kill -9): still R + max(A - S, 0), delta 0,
      as at start: never billed past what is known;
    - its worker was killed by this master's on_exit, which folded it at that time K:
      delta K - max(A, S), as for a graceful exit.
    A stretch opened and folded after `taken` (a cold start in a drained request) is
    wholly in the delta; one folded before `taken` is in both, delta 0. The other
    TOTALS only grow. So no delta is negative, and each stretch is billed once.
    """
    late = meter.leftover_totals(leftover) - taken
    slots = min(table.space_slots, len(late))
    base = table.cell_array()[table.base_row]
    for c in meter.TOTALS:
        base[:slots, c] += late[:slots, c]
