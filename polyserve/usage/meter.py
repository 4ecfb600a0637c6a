"""The usage table: per (worker, space) counters in shared memory, one writer per row, summed.

Each worker row holds C = len(Cell) int64 cells per space slot (layout: polyserve.state.shm):

    REQUESTS         requests answered
    ERRORS           of those, answered 5xx
    BUSY_US          µs from dispatch to the space until its response completed
    RESIDENT_US      µs the space was loaded, folded in when a worker stops holding it
    LOADED_SINCE_US  monotonic µs when the current stretch began; 0 when not loaded
    LOADS            imports (first request, after idle release, after a deploy)
    IMPORT_US        µs spent importing and starting, all loads together
    LAST_IMPORT_US   µs of the latest load
    MEMORY_BYTES     anonymous memory the latest load added to its worker
    RELEASED_IDLE    releases after POLYSERVE_IDLE_TTL idle seconds
    RELEASED_MEMORY  releases to keep the worker under POLYSERVE_WORKER_MEMORY_MB
    RELEASED_DEMAND  releases on demand (POST …/release), one per worker holding it
    BATCHES          batched runs made (polyserve.serve.batching), beside REQUESTS
    BATCH_ROWS       rows those runs computed, all batches together
    GPU_MEMORY_BYTES device memory the latest load added (NVML's figure for the worker)
    RECYCLED         releases whose device memory stayed with the worker, which was
                     then recycled to give it back (polyserve.serve.devcap)
    DURATION         histogram.BUCKETS cells, requests by duration (dispatch to
                     response complete; bounds in polyserve.usage.histogram, not
                     cumulative); their sum is BUSY_US, the same durations. One
                     block per space slot; a version lane would be another block.
    BATCH_SIZE       histogram.ROW_BUCKETS cells, batches by their rows (powers of
                     two); their count is BATCHES, their sum BATCH_ROWS.
    BATCH_QUEUE      histogram.QUEUE_BUCKETS cells, batched calls by their time in
                     the queue (enqueue to their batch's start)
    FIRST_BYTE       histogram.BUCKETS cells, streamed answers (more than one body
                     message) by the time from dispatch to their first body bytes
    QUEUE_US         one cell, the sum of BATCH_QUEUE's times (µs)
    FIRST_BYTE_US    one cell, the sum of FIRST_BYTE's times (µs)
    KEY_REQUESTS     KEY_CELLS cells, the requests answered per key of a private space
                     (its access file gives each key one of them: polyserve.state.access)
    LANE_REQUESTS    requests a running rollout sent to its new version (the old
    LANE_ERRORS      version's are the space's minus these); of those, errors. Not
                     totals: a rollout's step reads them as differences within one boot
    LANE_BUSY_US     of those, their time (µs), the sum of LANE_DURATION (totals, for
                     /metrics, kept like the other histograms)
    LANE_DURATION    histogram.BUCKETS cells, those requests by duration, as DURATION
                     counts all the space's: the space's less these are the others'

A worker writes only its own row, and only from its event-loop thread (sync handlers
run in the threadpool, but their requests are metered by the dispatcher on the loop),
so no lock is taken on the request path. Stores go through a memoryview cast to int64:
one aligned 8-byte store each, which a reader never sees torn.
"""

from __future__ import annotations

import json
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from polyserve.state.files import write_atomic
from polyserve.state.shm import H_ALIVE, H_STARTED, Table
from polyserve.state.slots import Ledger
from polyserve.usage import histogram


class Cell(IntEnum):
    REQUESTS = 0
    ERRORS = 1
    BUSY_US = 2
    RESIDENT_US = 3
    LOADED_SINCE_US = 4
    LOADS = 5
    IMPORT_US = 6
    LAST_IMPORT_US = 7
    MEMORY_BYTES = 8
    RELEASED_IDLE = 9
    RELEASED_MEMORY = 10
    RELEASED_DEMAND = 11
    BATCHES = 12
    BATCH_ROWS = 13
    GPU_MEMORY_BYTES = 14
    RECYCLED = 15


# Histogram blocks after the scalar cells, each named by its first cell, then their sums.
DURATION = len(Cell)  # the first of the duration histogram's cells
DURATION_END = DURATION + histogram.BUCKETS  # past the histogram's last cell
BATCH_SIZE = DURATION_END  # rows per batch
BATCH_QUEUE = BATCH_SIZE + histogram.ROW_BUCKETS  # a batched call's time in the queue
FIRST_BYTE = BATCH_QUEUE + histogram.QUEUE_BUCKETS  # a stream's time to its first bytes
QUEUE_US = FIRST_BYTE + histogram.BUCKETS
FIRST_BYTE_US = QUEUE_US + 1
# The keys' block, after the histograms': a key's requests are KEY_REQUESTS + its cell.
KEY_REQUESTS = FIRST_BYTE_US + 1
KEY_CELLS = 8  # a space's keys at most (polyserve.state.access.MAX_KEYS)
LANE_REQUESTS = KEY_REQUESTS + KEY_CELLS  # the lane of a rollout's new version
LANE_ERRORS = LANE_REQUESTS + 1
LANE_BUSY_US = LANE_ERRORS + 1
LANE_DURATION = LANE_BUSY_US + 1  # the lane's duration histogram
CELLS = LANE_DURATION + histogram.BUCKETS
_BUCKET = histogram.bucket
# Plain ints for the request path: an IntEnum member lookup costs more than the store.
_REQUESTS, _ERRORS, _BUSY_US = int(Cell.REQUESTS), int(Cell.ERRORS), int(Cell.BUSY_US)
_BATCHES, _BATCH_ROWS = int(Cell.BATCHES), int(Cell.BATCH_ROWS)
_MAX_ROW_BOUND = histogram.ROW_BOUNDS[-1]
_ROWS_INF = BATCH_SIZE + histogram.ROW_BUCKETS - 1
_QUEUE_BOUNDS_NS = histogram.QUEUE_BOUNDS_NS
# Counters that only grow: what a checkpoint saves, a restart restores, and a slot
# handed over to another space keeps for its old owner (slots.Ledger).
# The first six are the billing totals, the columns of the fleet's usage ledger (BILLED).
TOTALS: tuple[int, ...] = (
    Cell.REQUESTS,
    Cell.ERRORS,
    Cell.BUSY_US,
    Cell.RESIDENT_US,
    Cell.LOADS,
    Cell.IMPORT_US,
    Cell.RELEASED_IDLE,
    Cell.RELEASED_MEMORY,
    Cell.RELEASED_DEMAND,
    Cell.BATCHES,
    Cell.BATCH_ROWS,
    Cell.RECYCLED,
    *range(DURATION, KEY_REQUESTS),  # the histograms' cells and their sums
    *range(KEY_REQUESTS, LANE_REQUESTS),
    *range(LANE_BUSY_US, CELLS),  # the lane's histogram, for /metrics
)
BILLED = TOTALS[:6]
_TOTAL_CELLS = [int(c) for c in TOTALS]
# As checkpoints name them; the histogram's cells by their bucket's bound.
TOTAL_NAMES = (
    tuple(c.name.lower() for c in TOTALS if isinstance(c, Cell))
    + histogram.names("duration")
    + histogram.names("batch_size", histogram.ROW_BOUNDS, "rows")
    + histogram.names("batch_queue", histogram.QUEUE_BOUNDS_US)
    + histogram.names("first_byte")
    + ("batch_queue_us", "first_byte_us")
    + tuple(f"key_requests_{k}" for k in range(KEY_CELLS))
    + ("lane_busy_us",)
    + histogram.names("lane_duration")
)
_TOTAL_INDEX = dict(zip(TOTAL_NAMES, _TOTAL_CELLS, strict=True))
BILLED_NAMES = TOTAL_NAMES[: len(BILLED)]  # as the fleet's ledger names them
# Checkpoints written before the release counts were renamed name them evicted_<reason>.
_OLD_TOTAL_NAMES = {
    "evicted_idle": "released_idle",
    "evicted_memory": "released_memory",
    "evicted_demand": "released_demand",
}
# Why a worker let a space go, as the usage answer (released_<reason>) and Prometheus name it.
Reason = Literal["idle", "memory", "demand"]
RELEASES: dict[Reason, Cell] = {
    "idle": Cell.RELEASED_IDLE,
    "memory": Cell.RELEASED_MEMORY,
    "demand": Cell.RELEASED_DEMAND,
}


class Queued(Protocol):
    queued_at: int  # monotonic ns


class BatchCounts(dict[int, int]):
    """What one version's batchers ran and have not metered yet, which dispatch adds to
    the worker's row (Meter.batched) after each request: the runs, their rows and their
    calls' time queued as ints, and the buckets touched as a dict (cell of a slot's
    block -> count), so that a flush stores only the cells that changed. The batchers
    run on the loop, so no lock."""

    __slots__ = ("batches", "queue_ns", "rows")

    def __init__(self) -> None:
        super().__init__()
        self.batches = self.rows = self.queue_ns = 0

    def ran(self, rows: int, calls: Iterable[Queued], now: int) -> None:
        """A batch of `rows` rows starts at `now` (monotonic ns) with these calls."""
        self.batches += 1
        self.rows += rows
        get = self.get
        size = BATCH_SIZE + (rows - 1).bit_length() if 0 < rows <= _MAX_ROW_BOUND else _ROWS_INF
        self[size] = get(size, 0) + 1
        waited = 0
        for call in calls:
            took = now - call.queued_at
            waited += took
            cell = BATCH_QUEUE + bisect_left(_QUEUE_BOUNDS_NS, took)
            self[cell] = get(cell, 0) + 1
        self.queue_ns += waited


def now_us() -> int:
    """Monotonic µs: CLOCK_MONOTONIC is one clock for every process of the machine."""
    return time.monotonic_ns() // 1000


class Meter:
    """One worker's writer: the request path and load/release record into its own row."""

    def __init__(self, table: Table, row: int, clock: Callable[[], int] = now_us) -> None:
        self.words = table.words
        self.clock = clock
        # The request path reads nanoseconds from the C clock itself: now_us's Python
        # frame, twice a request, cost more than the stores (bench/NOTES.md). An
        # injected µs clock is scaled.
        self._ns: Callable[[], int] = (
            time.monotonic_ns if clock is now_us else (lambda: clock() * 1000)
        )
        self._row = table.cell_index(row, 0, 0)
        self._inflight = table.inflight_index(row)

    def begin(self) -> int:
        """A request is dispatched to a space; returns its start time (for end())."""
        self.words[self._inflight] += 1
        return self._ns()

    def end(self, slot: int | None, started: int, error: bool) -> int:
        """The response is complete; slot is None when no space answered (404). Returns
        the request's time (µs; 0 when not counted), for lane()."""
        words = self.words
        words[self._inflight] -= 1
        if slot is None:
            return 0
        base = self._row + slot * CELLS
        took = (self._ns() - started) // 1000
        words[base + _REQUESTS] += 1
        words[base + _BUSY_US] += took
        words[base + DURATION + _BUCKET(took)] += 1  # the histogram's sum is BUSY_US
        if error:
            words[base + _ERRORS] += 1
        return took

    def keyed(self, slot: int, cell: int) -> None:
        """A request of a private space was answered with the key in `cell`."""
        self.words[self._row + slot * CELLS + KEY_REQUESTS + cell] += 1

    def lane(self, slot: int, error: bool, took: int = 0) -> None:
        """A request that a rollout sent to its new version was answered in `took` µs
        (what end() returned)."""
        words, base = self.words, self._row + slot * CELLS
        words[base + LANE_REQUESTS] += 1
        words[base + LANE_BUSY_US] += took
        words[base + LANE_DURATION + _BUCKET(took)] += 1
        if error:
            words[base + LANE_ERRORS] += 1

    def loaded(self, slot: int, started: int, memory_bytes: int, gpu_bytes: int = 0) -> None:
        """A version finished loading; residency runs from `started`, the load's start."""
        words, base = self.words, self._row + slot * CELLS
        took = self.clock() - started
        words[base + Cell.LOADS] += 1
        words[base + Cell.IMPORT_US] += took
        words[base + Cell.LAST_IMPORT_US] = took
        words[base + Cell.MEMORY_BYTES] = max(memory_bytes, 0)
        words[base + Cell.GPU_MEMORY_BYTES] = max(gpu_bytes, 0)
        if words[base + Cell.LOADED_SINCE_US] == 0:  # a swap does not restart the stretch
            words[base + Cell.LOADED_SINCE_US] = max(started, 1)  # 0 means "not loaded"

    def count_release(self, slot: int, cell: Cell) -> None:
        """The worker let the space go for the reason `cell` (one of RELEASES)."""
        self.words[self._row + slot * CELLS + cell] += 1

    def batched(self, slot: int, counts: BatchCounts) -> None:
        """Move what the space's batchers counted since the last call into this row, and
        zero `counts`."""
        words, base = self.words, self._row + slot * CELLS
        words[base + _BATCHES] += counts.batches
        words[base + _BATCH_ROWS] += counts.rows
        words[base + QUEUE_US] += counts.queue_ns // 1000
        for cell, n in counts.items():
            words[base + cell] += n
        counts.clear()
        counts.batches = counts.rows = counts.queue_ns = 0

    def first_byte(self, slot: int, started: int) -> None:
        """A streamed answer sent its first body bytes; `started` is begin()'s."""
        words, base = self.words, self._row + slot * CELLS
        took = (self._ns() - started) // 1000
        words[base + FIRST_BYTE_US] += took
        words[base + FIRST_BYTE + _BUCKET(took)] += 1

    def released(self, slot: int) -> None:
        """This worker holds no version of the space any more: fold its residency."""
        words, base = self.words, self._row + slot * CELLS
        since = words[base + Cell.LOADED_SINCE_US]
        if since:
            words[base + Cell.RESIDENT_US] += self.clock() - since
            words[base + Cell.LOADED_SINCE_US] = 0


def rss_bytes() -> int:
    """This process's resident set size, from /proc: cheap enough to read at every load."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def anon_bytes() -> int:
    """This process's resident anonymous memory (RssAnon: statm's resident minus its
    file-backed and shared pages), read at every load. What a load adds to it is what the
    space costs its worker: library pages shared with the master that the load faults
    back in are file-backed, so unlike RSS growth they do not count."""
    with open("/proc/self/statm", "rb") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


# -- the master's side ---------------------------------------------------------------


def fold_row(table: Table, row: int, now: int) -> None:
    """Close a dead worker's open stretches and in-flight count. Called by the master
    once the worker is reaped, so the row has no other writer."""
    cells = table.cell_array()[row]
    since = cells[:, Cell.LOADED_SINCE_US]
    open_ = since > 0
    cells[open_, Cell.RESIDENT_US] += now - since[open_]
    since[open_] = 0
    table.words[table.inflight_index(row)] = 0
    table.held_array()[row] = 0  # a dead worker holds no version


def reclaimable(table: Table, slot: int) -> tuple[int, ...] | None:
    """A deleted space's final totals, once no worker holds or loads any version of it
    and no residency is open (nothing will write its cells again); else None."""
    if table.held_array()[:, slot].any():
        return None
    cells = table.cell_array()[:, slot]
    if cells[:, Cell.LOADED_SINCE_US].any():
        return None
    return tuple(int(v) for v in cells[:, _TOTAL_CELLS].sum(axis=0))


def totals(table: Table, now: int, slots: int | None = None) -> np.ndarray:
    """Per-slot totals (S, C) over every row, open stretches counted up to `now`; with
    `slots`, of the first that many only.

    Slots are handed out in order, so the ledger's count of them covers every slot in
    use: summing only those keeps the cost of a checkpoint or a usage answer in
    proportion to the spaces deployed, not to POLYSERVE_MAX_SPACES."""
    cells = table.cell_array()[:, :slots]
    summed = cells.sum(axis=0)
    since = cells[:, :, Cell.LOADED_SINCE_US]
    # A stretch that began after `now` (possible when recovering up to a dead master's
    # last checkpoint) counts nothing rather than something negative.
    summed[:, Cell.RESIDENT_US] += np.where(since > 0, np.maximum(now - since, 0), 0).sum(axis=0)
    return summed


def totals_of(table: Table, ledger: Ledger, slots: int, start: int, end: int) -> np.ndarray:
    """Cells start:end (TOTALS, a histogram's block) of the first `slots` slots, summed
    over every row, the ledger's offsets applied: a part of what snapshot() reads."""
    summed = table.cell_array()[:, :slots, start:end].sum(axis=0)
    first = _TOTAL_CELLS.index(start)
    for slot, offset in ledger.offsets.items():
        if slot < slots:
            summed[slot] += _widen(offset)[first : first + end - start]
    return summed


def _by_name(table: Table, summed: np.ndarray, ledger: Ledger) -> tuple[list[str], np.ndarray]:
    """Names and their (N, C) totals: slot owners (raw totals plus the ledger's offsets),
    then the names whose slots were handed over, with what they used there."""
    n = min(len(ledger.names), table.space_slots)
    t = summed[:n].copy()
    for slot, offset in ledger.offsets.items():
        if slot < n:
            t[slot, _TOTAL_CELLS] += _widen(offset)
    names = ledger.names[:n]
    if ledger.retired:
        extra = np.zeros((len(ledger.retired), t.shape[1]), dtype=np.int64)
        extra[:, _TOTAL_CELLS] = [_widen(v) for v in ledger.retired.values()]
        t = np.vstack([t, extra])
        names = names + list(ledger.retired)
    return names, t


def _widen(values: tuple[int, ...]) -> tuple[int, ...]:
    """Totals from a slot log written before TOTALS grew: the newer ones are 0."""
    return values + (0,) * (len(TOTALS) - len(values))


@dataclass(frozen=True)
class Snapshot:
    """The usage table read once, per space name, in base units (counts, µs, bytes).

    polyserve/usage/answer.py renders it as the usage JSON and the Prometheus text."""

    names: list[str]
    totals: np.ndarray  # (N, C): the TOTALS cells per name, ledger offsets applied
    workers_loaded: np.ndarray  # (N,): workers holding the space now
    last_import_us: np.ndarray  # (N,): the latest load, the largest over the workers
    memory_bytes: np.ndarray  # (N,): what the latest load added, the largest over workers
    gpu_memory_bytes: np.ndarray  # (N,): the same of device memory
    workers: int  # live workers
    uptime_us: int  # since the master started (wall clock)
    busy_us: int  # every space's busy time, the host's total
    in_flight: int  # requests in flight on the host


def snapshot(table: Table, ledger: Ledger, now: int) -> Snapshot:
    """Read every worker's row and sum: `now` is monotonic µs (now_us)."""
    n = min(len(ledger.names), table.space_slots)
    cells = table.cell_array()[:, :n]
    summed = totals(table, now, n)
    names, t = _by_name(table, summed, ledger)
    pad = (0, len(names) - n)  # names without a slot: not loaded anywhere, no latest load
    started = table.header(H_STARTED)
    return Snapshot(
        names=names,
        totals=t,
        workers_loaded=np.pad((cells[:, :, Cell.LOADED_SINCE_US] > 0).sum(axis=0), pad),
        last_import_us=np.pad(cells[:, :, Cell.LAST_IMPORT_US].max(axis=0), pad),
        memory_bytes=np.pad(cells[:, :, Cell.MEMORY_BYTES].max(axis=0), pad),
        gpu_memory_bytes=np.pad(cells[:, :, Cell.GPU_MEMORY_BYTES].max(axis=0), pad),
        workers=int(np.count_nonzero(table.pids)),
        uptime_us=time.time_ns() // 1000 - started if started else 0,
        busy_us=int(summed[:, Cell.BUSY_US].sum()),
        in_flight=int(table.inflight_array().sum()),
    )


def key_counts(table: Table, ledger: Ledger, slot: int | None, space: str) -> list[int]:
    """A space's KEY_CELLS counts over every row, as the usage answer reads them (with
    the ledger's offset of a handed-over slot); with no slot here, what it used in the
    slots it had (the next slot it takes counts on from there)."""
    first = _TOTAL_CELLS.index(KEY_REQUESTS)
    if slot is None:
        used = _widen(ledger.retired.get(space, ()))
        return list(used[first : first + KEY_CELLS])
    cells = table.cell_array()[:, slot, KEY_REQUESTS:LANE_REQUESTS].sum(axis=0)
    offset = ledger.offsets.get(slot)
    if offset is not None:
        widened = _widen(offset)
        cells = cells + np.array(widened[first : first + KEY_CELLS], dtype=np.int64)
    return [int(v) for v in cells]


def loaded_by_name(table: Table, ledger: Ledger) -> dict[str, int]:
    """The spaces some worker holds now, each with how many workers hold it."""
    n = min(len(ledger.names), table.space_slots)
    held = (table.cell_array()[:, :n, Cell.LOADED_SINCE_US] > 0).sum(axis=0)
    return {ledger.names[slot]: int(held[slot]) for slot in np.flatnonzero(held).tolist()}


# -- checkpoint and restore ------------------------------------------------------------


def totals_by_name(
    table: Table, ledger: Ledger, now: int, cells: tuple[int, ...] = TOTALS
) -> dict[str, tuple[int, ...]]:
    """Every space's `cells` (in that order), open stretches counted up to `now`."""
    n = min(len(ledger.names), table.space_slots)
    names, t = _by_name(table, totals(table, now, n), ledger)
    rows = t[:, [int(c) for c in cells]].tolist()
    return {name: tuple(row) for name, row in zip(names, rows, strict=True)}


def checkpoint(table: Table, ledger: Ledger, path: Path, now: int) -> None:
    """Write every space's totals (open stretches counted to now) atomically to path."""
    data = {
        "format": 1,
        "saved_at": time.time(),
        "spaces": {
            name: dict(zip(TOTAL_NAMES, values, strict=True))
            for name, values in totals_by_name(table, ledger, now).items()
        },
    }
    write_atomic(path, json.dumps(data).encode(), fsync=True)
    table.set_header(H_ALIVE, now)


def checkpoint_totals(path: Path, ledger: Ledger) -> np.ndarray | None:
    """A checkpoint's totals as raw per-slot totals (S, C) — the ledger's offsets taken
    back out, since snapshot() adds them again — or None if there is none yet."""
    try:
        saved = json.loads(path.read_text())["spaces"]
    except FileNotFoundError:
        return None
    t = np.zeros((len(ledger.names), CELLS), dtype=np.int64)
    for slot, name in enumerate(ledger.names):
        for key, value in saved.get(name, {}).items():
            index = _TOTAL_INDEX.get(_OLD_TOTAL_NAMES.get(key, key))
            if index is not None:  # a name this layout has not: not restored
                t[slot, index] = value
        if slot in ledger.offsets:
            t[slot, _TOTAL_CELLS] -= _widen(ledger.offsets[slot])
    return t


def leftover_totals(leftover: Table) -> np.ndarray:
    """What a dead master's segment holds: every count its workers wrote, and their open
    stretches up to the master's last checkpoint (never past it: the downtime is not
    billed)."""
    alive = leftover.header(H_ALIVE)
    return totals(leftover, alive) if alive else leftover.cell_array().sum(axis=0)


def set_base(table: Table, t: np.ndarray) -> None:
    """Start the base row from an earlier run's totals (the master, before any fork)."""
    slots = min(table.space_slots, len(t))
    base = table.cell_array()[table.base_row]
    for c in TOTALS:
        base[:slots, c] = t[:slots, c]
