"""Deploy broadcast inside a host: per-space words in the shared table, and a signal to workers."""

from __future__ import annotations

import errno
import os
import signal

from polyserve.state.shm import Table

# SIGWINCH: gunicorn's worker and uvicorn-worker leave it unused, and its default
# action is to ignore it, so a signal that reaches a worker before its handler is
# installed is harmless instead of fatal. Workers also only record their pid once
# the handler is in place.
SIGNAL = signal.SIGWINCH


class Broadcast:
    """One process's handle on the per-space words (generation, release, held versions)
    and on the worker pid rows: how a change in one worker reaches the others."""

    def __init__(self, table: Table, row: int | None) -> None:
        self.table = table
        self.row = row

    def generation(self, space_slot: int) -> int:
        return self.table.generations[space_slot]

    def bump(self, space_slot: int) -> None:
        """Advance a space's generation. Callers hold the store lock."""
        self.table.generations[space_slot] += 1

    def bump_access(self, space_slot: int) -> None:
        """Advance a space's access word, so every worker re-reads its access file before
        its next request. Callers hold the store lock."""
        self.table.access[space_slot] += 1

    def releases(self, space_slot: int) -> int:
        return self.table.releases[space_slot]

    def release(self, space_slot: int) -> None:
        """Make every worker drop its copy: the release word says why the generation
        moved, so a worker imports afresh instead of keeping the same version."""
        self.table.releases[space_slot] += 1
        self.bump(space_slot)

    def hold(self, space_slot: int, version: int) -> None:
        """Say which is the oldest version of a space this worker holds or is loading
        (0: none), so that nobody prunes it or hands the slot to another space."""
        if self.row is not None:
            self.table.words[self.table.held_index(self.row, space_slot)] = version

    def oldest_held(self, space_slot: int) -> int | None:
        """The oldest version of the space any worker holds, or None when none does."""
        held = self.table.held_array()[:, space_slot]
        held = held[held > 0]
        return int(held.min()) if held.size else None

    def record_pid(self) -> None:
        """Make this worker reachable by announce(); call once the handler is installed."""
        if self.row is not None:
            self.table.pids[self.row] = os.getpid()

    def announce(self) -> int:
        """Signal every other live worker to re-check its spaces; returns how many."""
        me = os.getpid()
        sent = 0
        for pid in self.table.pids.tolist():
            if pid in (0, me):
                continue
            try:
                os.kill(pid, SIGNAL)
                sent += 1
            except OSError as exc:
                # A worker that just died: the master clears its row in child_exit.
                if exc.errno != errno.ESRCH:
                    raise
        return sent
