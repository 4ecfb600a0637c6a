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
import orjson

from polyserve import devices
from polyserve.state.shm import Table
from polyserve.state.store import Store
from polyserve.usage import meter, prometheus
from polyserve.usage.mapped import mapped_by_space
from polyserve.usage.meter import Cell, Snapshot

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
        snap = self.snapshot()
        # orjson: the stdlib's encoder was most of the answer's time (bench/NOTES.md,
        # "Where the time goes").
        return orjson.dumps(usage(snap, await self.mapped(), self.gpus))

    async def prometheus(self, fleet: tuple[int, int] | None = None) -> bytes:
        """The /metrics answer; in a fleet, `fleet` is (the last change this host applied,
        the fleet's last change)."""
        snap = self.snapshot()
        gpus = [devices.memory(index) for index in self.gpus] if self.gpus else None
        return prometheus.exposition(snap, fleet, await self.mapped(), gpus)


def usage(
    snap: Snapshot, mapped: Mapping[str, int] | None = None, gpus: tuple[int, ...] = ()
) -> dict[str, object]:
    """The full usage answer: the seed's four fields per space, and more; `mapped` is
    what Usage.mapped read (none: 0 for every space). A GPU host's (`gpus`) has device
    memory fields too; a CPU host's answer is as it was without them."""
    t = snap.totals
    # Column by column in numpy, then one comprehension: a per-space loop of arithmetic
    # was most of the answer's time with many spaces (bench/NOTES.md, "Where the time
    # goes"). A lookup per space only when a space's files are mapped at all.
    if mapped:
        mapped_kib = [mapped.get(name, 0) // 1024 for name in snap.names]
    else:
        mapped_kib = [0] * len(snap.names)
    columns = zip(
        snap.names,
        t[:, Cell.REQUESTS].tolist(),
        (t[:, Cell.BUSY_US] // 1000).tolist(),
        (t[:, Cell.RESIDENT_US] // 1_000_000).tolist(),
        (snap.workers_loaded > 0).tolist(),
        t[:, Cell.ERRORS].tolist(),
        t[:, Cell.LOADS].tolist(),
        snap.workers_loaded.tolist(),
        (snap.last_import_us / 1000).round(3).tolist(),
        (snap.memory_bytes // 1024).tolist(),
        t[:, Cell.RELEASED_IDLE].tolist(),
        t[:, Cell.RELEASED_MEMORY].tolist(),
        t[:, Cell.RELEASED_DEMAND].tolist(),
        mapped_kib,
        t[:, Cell.BATCHES].tolist(),
        t[:, Cell.BATCH_ROWS].tolist(),
        strict=True,
    )
    spaces = {
        name: {
            "requests": r,
            "busy_ms": b,
            "warm_s": w,
            "loaded": lo,
            "errors": e,
            "cold_starts": c,
            "workers_loaded": wl,
            "last_import_ms": li,
            "memory_kib": k,
            # Flat: a nested object per space made the answer much slower (bench/NOTES.md,
            # "Memory cap", what the release counts cost the usage answer).
            "released_idle": ri,
            "released_memory": rm,
            "released_demand": rd,
            "mapped_kib": mk,
            "batches": ba,
            "batch_rows": br,
        }
        for name, r, b, w, lo, e, c, wl, li, k, ri, rm, rd, mk, ba, br in columns
    }
    if gpus:
        device = zip(
            spaces.values(),
            (snap.gpu_memory_bytes // 1024).tolist(),
            t[:, Cell.RECYCLED].tolist(),
            strict=True,
        )
        for fields, gk, rc in device:
            fields["gpu_memory_kib"] = gk
            fields["recycled"] = rc
    return {"spaces": spaces, "host": host_usage(snap, gpus)}


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
