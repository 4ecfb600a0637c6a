"""Recent latency: each space's p50 and p99 over about the last minute, from the duration cells.

The duration histogram's cells only grow. A worker marks them every STEP_S seconds (one
sum over the rows of the slots in use) and keeps the marks of the last WINDOW_S seconds
and one more; a usage answer subtracts the newest mark at least WINDOW_S old (the oldest
it has, in a worker younger than that) from the cells now, and reads the quantiles of
the difference. So the window is WINDOW_S to WINDOW_S + STEP_S seconds long (the answer
says how long), and a quantile is as precise as its bucket: linear inside it, the last
bound (10 s) past all of them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import numpy as np

from polyserve.state.shm import Table
from polyserve.state.slots import Ledger
from polyserve.usage import histogram, meter
from polyserve.usage.meter import DURATION, Snapshot

WINDOW_S = 60
STEP_S = 5
_END = DURATION + histogram.BUCKETS
_UPPER = np.array(histogram.BOUNDS_US, dtype=np.float64)
_LOWER = np.concatenate(([0.0], _UPPER[:-1]))


def quantiles(counts: np.ndarray, q: float) -> np.ndarray:
    """Per row of bucket counts (N, BUCKETS, not cumulative), the q-quantile in µs (NaN
    for a row without values), for every row at once: a usage answer has one row per
    space. Linear inside the bucket that holds the rank, from its lower bound (0 for
    the first) to its upper one; in the +Inf bucket, the last bound."""
    cumulative = np.cumsum(counts, axis=1)
    total = cumulative[:, -1]
    rank = q * total
    at = np.argmax(cumulative >= rank[:, None], axis=1)  # the bucket that holds the rank
    rows = np.arange(len(counts))
    before = np.where(at > 0, cumulative[rows, np.maximum(at - 1, 0)], 0)
    inside = np.maximum(counts[rows, at], 1)
    last = len(_UPPER)
    bounded = np.minimum(at, last - 1)
    value = _LOWER[bounded] + (_UPPER[bounded] - _LOWER[bounded]) * (rank - before) / inside
    value = np.where(at >= last, _UPPER[-1], value)  # +Inf: "past the last bound"
    return np.where(total > 0, value, np.nan)


class Window:
    """One worker's marks of the duration cells, and the quantiles since the one a
    window ago. `clock` is monotonic µs (meter.now_us), injected for tests."""

    def __init__(
        self,
        table: Table,
        ledger: Callable[[], Ledger],
        clock: Callable[[], int] = meter.now_us,
        window_s: float = WINDOW_S,
        step_s: float = STEP_S,
    ) -> None:
        self.table = table
        self.ledger = ledger
        self.clock = clock
        self.window_us = int(window_s * 1e6)
        self.step_s = step_s
        # (when, the owner of each slot then, its duration cells then (n, BUCKETS))
        self._marks: deque[tuple[int, list[str], np.ndarray]] = deque()

    def mark(self) -> None:
        """Mark the cells now, and forget the marks a window needs no more."""
        ledger = self.ledger()
        n = min(len(ledger.names), self.table.space_slots)
        # As uint32, half the memory: a difference of two, modulo 2**32, is exact while
        # a bucket counts fewer than 2**32 requests in a window.
        counts = meter.totals_of(self.table, ledger, n, DURATION, _END).astype(np.uint32)
        now = self.clock()
        self._marks.append((now, ledger.names[:n], counts))
        while len(self._marks) > 1 and now - self._marks[1][0] >= self.window_us:
            self._marks.popleft()

    async def run(self) -> None:
        """Mark every step_s seconds, until cancelled (the worker's background task)."""
        while True:
            self.mark()
            await asyncio.sleep(self.step_s)

    def latency(self, snap: Snapshot, now: int) -> tuple[float, np.ndarray, np.ndarray]:
        """The seconds the window spans, and each space's p50 and p99 in ms (NaN with no
        request in it), in snap.names order."""
        current = snap.totals[:, DURATION:_END]
        since = self._since(now)
        if since is None:
            return 0.0, np.full(len(current), np.nan), np.full(len(current), np.nan)
        when, names, counts = since
        earlier = np.zeros(current.shape, np.uint32)
        n = min(len(names), len(current))
        earlier[:n] = counts[:n]
        # A slot handed over since the mark: its new owner counted from zero there.
        if names[:n] != snap.names[:n]:  # rare: a per-slot look only then
            for slot in range(n):
                if names[slot] != snap.names[slot]:
                    earlier[slot] = 0
        recent = (current.astype(np.uint32) - earlier).astype(np.int64)
        # The names after the slot owners own no slot (deleted, their slot handed
        # over): they serve nothing now.
        recent[min(len(self.ledger().names), self.table.space_slots) :] = 0
        p50 = (quantiles(recent, 0.5) / 1000).round(3)
        p99 = (quantiles(recent, 0.99) / 1000).round(3)
        return round((now - when) / 1e6, 3), p50, p99

    def _since(self, now: int) -> tuple[int, list[str], np.ndarray] | None:
        """The newest mark at least a window old, or the oldest there is."""
        found = None
        for mark in self._marks:
            if found is None or now - mark[0] >= self.window_us:
                found = mark
            else:
                break
        return found
