"""Where a model's run goes: on the event loop while its runs are short, else on threads.

A thread hop costs a short run more than the run itself (bench/NOTES.md, the inference
protocol's figures), so a run stays on the loop until SLOW_RUNS runs in a row took
INLINE_S or more: one run slowed by a collection or a busy core does not send the next
through a thread, and a model whose every run is slow goes, so the loop keeps reading
requests meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

INLINE_S = 0.001
SLOW_RUNS = 3

T = TypeVar("T")


class Placement:
    """Runs a sync function on the loop while its runs are short, else on at most
    `threads` threads; with `inline_s` 0, always on the threads."""

    def __init__(self, threads: int, inline_s: float = INLINE_S) -> None:
        self.threads = threads
        self.inline_s = inline_s
        self.slow = 0 if inline_s else SLOW_RUNS  # the latest slow runs in a row
        self._limiter: anyio.CapacityLimiter | None = None  # made on the loop, at first use

    @property
    def inline(self) -> bool:
        """Whether the next run stays on the loop."""
        return self.slow < SLOW_RUNS

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.inline:
            started = time.perf_counter()
            result = fn(*args)
            self.timed(time.perf_counter() - started)
            return result
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        result, took = await anyio.to_thread.run_sync(_timed, fn, *args, limiter=self._limiter)
        self.timed(took)
        return result

    def timed(self, took: float) -> None:
        """Count a run that took `took` seconds toward the next one's place."""
        if self.inline_s:
            self.slow = self.slow + 1 if took >= self.inline_s else 0


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    started = time.perf_counter()
    return fn(*args), time.perf_counter() - started
