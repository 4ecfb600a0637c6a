"""The usage answer: one snapshot of the table per request, rendered as JSON or as Prometheus text.

`/_polyserve/usage` and `/metrics` both come from here, so the two cannot disagree on a
field: each answer reads the table once (meter.snapshot) and, for the full answer, the
bytes the workers map of each space's files (polyserve/usage/mapped.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import anyio
import anyio.to_thread
import numpy as np
import orjson

from polyserve import devices
from polyserve.state import access
from polyserve.state.shm import Table
from polyserve.state.store import Store
from polyserve.usage import meter, prometheus
from polyserve.usage.mapped import mapped_by_space
from polyserve.usage.meter import Cell, Snapshot
from polyserve.usage.window import Window

# `?only=host`: the host's section alone, what the autoscaler scrapes.
Only = Literal["host"]


class Usage:
    """The host's usage as the control plane answers it, read from the shared table."""

    def __init__(
        self,
        table: Table,
        store: Store,
        host_limiter: anyio.CapacityLimiter,
        gpus: tuple[int, ...] = (),
    ) -> None:
        self.table = table
        self.store = store
        self.host_limiter = host_limiter  # the host's own threads: reading /proc runs on them
        self.gpus = gpus  # a GPU host's (POLYSERVE_GPUS): its answer has their fields
        self._rendering = Rendering()
        # p50 and p99 over the last minute: marks of the duration cells, which the
        # worker's background task takes (Window.run).
        self.window = Window(table, store.slots.ledger)

    def snapshot(self) -> Snapshot:
        return meter.snapshot(self.table, self.store.slots.ledger(), meter.now_us())

    async def mapped(self) -> dict[str, int]:
        """Bytes of each space's version files the workers map (model weights through
        polyserve.models), counted once for the host."""
        pids = [pid for pid in self.table.pids.tolist() if pid]
        # On a host thread: reading every worker's maps is a few system calls each.
        return await anyio.to_thread.run_sync(
            mapped_by_space, self.store.spaces_dir, pids, limiter=self.host_limiter
        )

    async def json(self, only: Only | None = None) -> bytes:
        """The /_polyserve/usage answer, encoded."""
        if only == "host":  # no spaces: no maps to read
            return orjson.dumps({"host": host_usage(self.snapshot(), self.gpus)})
        now = meter.now_us()
        snap = meter.snapshot(self.table, self.store.slots.ledger(), now)
        mapped = await self.mapped()
        window_s, p50, p99 = self.window.latency(snap, now)
        fields, values = columns(snap, mapped, self.gpus)
        fields, values = fields + LATENCY_FIELDS, [*values, p50, p99]
        # orjson: the stdlib's encoder was most of the answer's time (bench/NOTES.md,
        # "Where the time goes"). It writes NaN (no request in the window) as null.
        host = orjson.dumps({**host_usage(snap, self.gpus), "latency_window_s": window_s})
        keyed = key_requests(snap, await self._accesses())
        spaces = self._rendering.spaces(
            snap.names, fields, values, keyed
        )  # synchronous: answers never interleave over it
        return b'{"spaces":' + spaces + b',"host":' + host + b"}"

    async def _accesses(self) -> dict[str, access.Access]:
        """Every private space's access file (its keys' cells and bases)."""
        return await anyio.to_thread.run_sync(
            access.listed, self.store.root, limiter=self.host_limiter
        )

    async def prometheus(self, fleet: tuple[int, int] | None = None) -> bytes:
        """The /metrics answer; in a fleet, `fleet` is (the last change this host applied,
        the fleet's last change)."""
        snap = self.snapshot()
        gpus = [devices.memory(index) for index in self.gpus] if self.gpus else None
        keys = key_counts(snap, await self._accesses())
        return prometheus.exposition(snap, fleet, await self.mapped(), gpus, keys)


# The fields of each space in the usage answer, in order. Flat: a nested object per
# space made the answer much slower (bench/NOTES.md, "Memory cap").
FIELDS = (
    "requests",
    "busy_ms",
    "warm_s",
    "loaded",
    "errors",
    "cold_starts",
    "workers_loaded",
    "last_import_ms",
    "memory_kib",
    "released_idle",
    "released_memory",
    "released_demand",
    "mapped_kib",
    "batches",
    "batch_rows",
)
GPU_FIELDS = ("gpu_memory_kib", "recycled")  # a GPU host's only
# Over the host section's latency_window_s (polyserve/usage/window.py): the full answer's.
LATENCY_FIELDS = ("p50_ms", "p99_ms")


def columns(
    snap: Snapshot, mapped: Mapping[str, int] | None = None, gpus: tuple[int, ...] = ()
) -> tuple[tuple[str, ...], list[np.ndarray]]:
    """Each space's fields as columns: the field names, then one array per field, in
    snap.names order.

    Column by column in numpy: a per-space loop of arithmetic was most of the answer's
    time with many spaces (bench/NOTES.md, "Where the time goes"). A lookup per space
    only when a space's files are mapped at all."""
    t = snap.totals
    n = len(snap.names)
    if mapped:
        mapped_kib = np.fromiter((mapped.get(name, 0) // 1024 for name in snap.names), np.int64, n)
    else:
        mapped_kib = np.zeros(n, np.int64)
    values = [
        t[:, Cell.REQUESTS],
        t[:, Cell.BUSY_US] // 1000,
        t[:, Cell.RESIDENT_US] // 1_000_000,
        snap.workers_loaded > 0,
        t[:, Cell.ERRORS],
        t[:, Cell.LOADS],
        snap.workers_loaded,
        (snap.last_import_us / 1000).round(3),
        snap.memory_bytes // 1024,
        t[:, Cell.RELEASED_IDLE],
        t[:, Cell.RELEASED_MEMORY],
        t[:, Cell.RELEASED_DEMAND],
        mapped_kib,
        t[:, Cell.BATCHES],
        t[:, Cell.BATCH_ROWS],
    ]
    if not gpus:
        return FIELDS, values
    return FIELDS + GPU_FIELDS, [*values, snap.gpu_memory_bytes // 1024, t[:, Cell.RECYCLED]]


def key_counts(snap: Snapshot, accesses: Mapping[str, access.Access]) -> dict[str, dict[str, int]]:
    """Each keyed space's requests per key id: a key's cell's count since the key took
    the cell (its base). Revoked keys are gone from it."""
    if not accesses:
        return {}
    index = {name: i for i, name in enumerate(snap.names)}
    found: dict[str, dict[str, int]] = {}
    for space, known in accesses.items():
        i = index.get(space)
        if i is None or not known.keys:
            continue
        row = snap.totals[i]
        found[space] = {
            str(k.get("id")): int(row[meter.KEY_REQUESTS + int(k.get("cell", 0))])
            - int(k.get("base", 0))
            for k in known.keys
        }
    return found


def key_requests(snap: Snapshot, accesses: Mapping[str, access.Access]) -> dict[str, bytes]:
    """Each keyed space's `"keys": {id: requests}`, encoded (key_counts)."""
    return {space: orjson.dumps(counts) for space, counts in key_counts(snap, accesses).items()}


def usage(
    snap: Snapshot, mapped: Mapping[str, int] | None = None, gpus: tuple[int, ...] = ()
) -> dict[str, object]:
    """The full usage answer as a dict: the seed's four fields per space, and more;
    `mapped` is what Usage.mapped read (none: 0 for every space). A GPU host's (`gpus`)
    has device memory fields too."""
    fields, values = columns(snap, mapped, gpus)
    rows = zip(snap.names, zip(*(v.tolist() for v in values), strict=True), strict=True)
    spaces = {name: dict(zip(fields, row, strict=True)) for name, row in rows}
    return {"spaces": spaces, "host": host_usage(snap, gpus)}


class Rendering:
    """The `spaces` object of the last usage answer, kept encoded one space at a time so
    that the next answer encodes again only the spaces whose fields changed.

    With thousands of spaces most are idle between two answers, and building and
    encoding a dict per space was most of the answer's time (bench/NOTES.md, "Usage at
    scale"). The result is exactly what a full encoding gives: a space is encoded again
    whenever any of its values differs from the last answer's, compared column by
    column in numpy."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.fields: tuple[str, ...] = ()
        self.values: list[np.ndarray] = []
        self.parts: list[bytes] = []

    def spaces(
        self,
        names: list[str],
        fields: tuple[str, ...],
        values: list[np.ndarray],
        keyed: Mapping[str, bytes] | None = None,
    ) -> bytes:
        """The encoded `spaces` object for these columns (as columns() gives them), with
        `keyed` spaces' encoded `keys` (key_requests) added to their objects."""
        if names != self.names or fields != self.fields:
            changed: list[int] | range = range(len(names))
            self.parts = [b""] * len(names)
        else:
            differs = np.zeros(len(names), dtype=bool)
            for now, before in zip(values, self.values, strict=True):
                unequal = now != before
                if now.dtype.kind == "f":  # NaN (null) is not a change from NaN
                    unequal &= ~(np.isnan(now) & np.isnan(before))
                differs |= unequal
            changed = np.flatnonzero(differs).tolist()
        if changed:
            picked = [v[changed].tolist() for v in values]
            for i, row in zip(changed, zip(*picked, strict=True), strict=True):
                self.parts[i] = orjson.dumps({names[i]: dict(zip(fields, row, strict=True))})[1:-1]
        self.names, self.fields, self.values = names, fields, values
        parts = self.parts
        if keyed:
            parts = list(parts)  # the cache keeps the objects without them
            for i, name in enumerate(names):
                if name in keyed:
                    parts[i] = parts[i][:-1] + b',"keys":' + keyed[name] + b"}"
        return b"{" + b",".join(parts) + b"}"


def host_usage(snap: Snapshot, gpus: tuple[int, ...] = ()) -> dict[str, object]:
    """The usage answer's `host` section: what the autoscaler's busy ratio is made of,
    and on a GPU host each GPU's memory (NVML's, read now; null where NVML cannot
    tell) and the workers recycled to give device memory back."""
    host: dict[str, object] = {
        "workers": snap.workers,
        "uptime_s": round(snap.uptime_us / 1e6, 3),
        "busy_ms": snap.busy_us // 1000,
        "in_flight": snap.in_flight,
    }
    if gpus:
        host["gpus"] = [_gpu_memory(index) for index in gpus]
        host["recycles"] = int(snap.totals[:, Cell.RECYCLED].sum())
    return host


def _gpu_memory(index: int) -> dict[str, object]:
    found = devices.memory(index)
    if found is None:
        return {"index": index, "total_kib": None, "used_kib": None}
    return {"index": index, "total_kib": found.total // 1024, "used_kib": found.used // 1024}
