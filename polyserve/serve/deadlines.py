"""Per-request timeouts: one watchdog task per worker, instead of a timer per request.

`asyncio.timeout` arms and cancels a loop timer for every request; at tens of thousands
of requests a second that was a measurable share of the dispatch cost. Here a request
costs a dict insert and delete, and the watchdog cancels the overdue ones, so a
timeout fires within `timeout + interval` (interval: a quarter of it, at most 1 s).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class Deadlines:
    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.clock = clock
        self._due: dict[asyncio.Task[object], float] = {}
        self._expired: set[asyncio.Task[object]] = set()
        # Python 3.11's current_task() looks the running loop up first; given the loop it
        # is one dict get (a measurable share of a warm request's dispatch).
        self._loop: asyncio.AbstractEventLoop | None = None

    def enter(self) -> asyncio.Task[object]:
        """The current task starts a request; returns it, for leave() and expired()."""
        task = asyncio.current_task(self._loop)
        assert task is not None
        self._due[task] = self.clock() + self.timeout
        return task

    def leave(self, task: asyncio.Task[object]) -> None:
        self._due.pop(task, None)
        self._expired.discard(task)

    def expired(self, task: asyncio.Task[object]) -> bool:
        """Whether a CancelledError in `task` came from the watchdog (and absorb it)."""
        if task not in self._expired:
            return False
        task.uncancel()
        return True

    def check(self) -> None:
        """Cancel every request past its deadline."""
        now = self.clock()
        for task, due in list(self._due.items()):
            if now >= due and task not in self._expired:
                self._expired.add(task)
                task.cancel()

    async def watch(self) -> None:
        self._loop = asyncio.get_running_loop()
        interval = min(self.timeout / 4, 1.0)
        while True:
            await asyncio.sleep(interval)
            self.check()
