"""Prometheus exposition of a usage snapshot, through prometheus_client's own text format."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Literal

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from polyserve.devices import Memory
from polyserve.usage import histogram
from polyserve.usage.meter import (
    BATCH_QUEUE,
    BATCH_SIZE,
    DURATION,
    FIRST_BYTE,
    FIRST_BYTE_US,
    LANE_BUSY_US,
    LANE_DURATION,
    QUEUE_US,
    RELEASES,
    Cell,
    Snapshot,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _total(cell: Cell, per_unit: float = 1) -> Callable[[Snapshot], np.ndarray]:
    return lambda snap: snap.totals[:, cell] / per_unit


Kind = Literal["counter", "gauge"]
_FAMILIES: dict[Kind, type[CounterMetricFamily | GaugeMetricFamily]] = {
    "counter": CounterMetricFamily,
    "gauge": GaugeMetricFamily,
}

# (metric name, its kind, help, the values per space in the metric's unit). From the
# snapshot's base units, so seconds keep microsecond resolution.
_SPACE_METRICS: tuple[tuple[str, Kind, str, Callable[[Snapshot], np.ndarray]], ...] = (
    (
        "polyserve_space_requests",
        "counter",
        "Requests answered by the space.",
        _total(Cell.REQUESTS),
    ),
    ("polyserve_space_errors", "counter", "Requests the space answered 5xx.", _total(Cell.ERRORS)),
    (
        "polyserve_space_busy_seconds",
        "counter",
        "Time from dispatch to the space until its responses completed.",
        _total(Cell.BUSY_US, 1e6),
    ),
    (
        "polyserve_space_warm_seconds",
        "counter",
        "Residency: seconds loaded, summed over the workers holding the space.",
        _total(Cell.RESIDENT_US, 1e6),
    ),
    (
        "polyserve_space_cold_starts",
        "counter",
        "Imports of the space (first request, after idle release, after a deploy).",
        _total(Cell.LOADS),
    ),
    (
        "polyserve_space_batches",
        "counter",
        "Batched runs of the space's model (or its polyserve.models.batched functions).",
        _total(Cell.BATCHES),
    ),
    (
        "polyserve_space_workers_loaded",
        "gauge",
        "Workers that hold the space now.",
        lambda snap: snap.workers_loaded,
    ),
    (
        "polyserve_space_last_import_seconds",
        "gauge",
        "Duration of the latest import and startup of the space in a worker.",
        lambda snap: snap.last_import_us / 1e6,
    ),
    (
        "polyserve_space_memory_bytes",
        "gauge",
        "Anonymous memory (RssAnon) the latest load of the space added to its worker.",
        lambda snap: snap.memory_bytes,
    ),
)


class _SnapshotCollector:
    def __init__(
        self,
        snap: Snapshot,
        fleet: tuple[int, int] | None,
        mapped: dict[str, int] | None,
        gpus: Sequence[Memory | None] | None,
        keys: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        self.snap = snap
        self.fleet = fleet
        self.mapped = mapped
        self.gpus = gpus
        self.keys = keys

    def collect(self) -> Iterator[Metric]:
        snap = self.snap
        for name, kind, doc, values in _SPACE_METRICS:
            family = _FAMILIES[kind](name, doc, labels=["space"])
            for space, value in zip(snap.names, values(snap).tolist(), strict=True):
                family.add_metric([space], value)
            yield family
        yield from self._histograms()
        if self.keys:
            family = CounterMetricFamily(
                "polyserve_space_key_requests",
                "Requests of a private space answered with each of its keys (by key id).",
                labels=["space", "key"],
            )
            for space, counts in self.keys.items():
                for key, value in counts.items():
                    family.add_metric([space, key], value)
            yield family
        if self.mapped is not None:
            family = GaugeMetricFamily(
                "polyserve_space_mapped_bytes",
                "The space's own files mapped by the host's workers, each range counted once.",
                labels=["space"],
            )
            for space in snap.names:
                family.add_metric([space], self.mapped.get(space, 0))
            yield family
        yield GaugeMetricFamily("polyserve_workers", "Live worker processes.", value=snap.workers)
        yield GaugeMetricFamily(
            "polyserve_in_flight", "Requests in flight on this host.", value=snap.in_flight
        )
        yield GaugeMetricFamily(
            "polyserve_uptime_seconds",
            "Seconds since the master started.",
            value=snap.uptime_us / 1e6,
        )
        if self.gpus is not None:
            yield from self._gpu_metrics()
        releases = CounterMetricFamily(
            "polyserve_space_releases",
            "Releases of the space by a worker, by reason: idle (POLYSERVE_IDLE_TTL), memory"
            " (POLYSERVE_WORKER_MEMORY_MB) or demand (a release request).",
            labels=["space", "reason"],
        )
        for reason, cell in RELEASES.items():
            for space, value in zip(snap.names, snap.totals[:, cell].tolist(), strict=True):
                releases.add_metric([space, reason], value)
        yield releases
        if self.fleet is not None:
            applied, last = self.fleet
            yield GaugeMetricFamily(
                "polyserve_fleet_applied_change",
                "The last fleet change this host has applied.",
                value=applied,
            )
            yield GaugeMetricFamily(
                "polyserve_fleet_lag_changes",
                "Fleet changes this host has not applied yet.",
                value=max(last - applied, 0),
            )

    def _histograms(self) -> Iterator[Metric]:
        """Each space's histograms: buckets made cumulative here, the table's cells count
        each bucket alone. Each sum is the cell that adds the same values."""
        t = self.snap.totals
        seconds = [f"{b / 1e6:g}" for b in histogram.BOUNDS_US]
        yield self._histogram(
            "polyserve_space_request_duration_seconds",
            "Time from dispatch to the space until its response completed.",
            seconds,
            t[:, DURATION : DURATION + histogram.BUCKETS],
            t[:, Cell.BUSY_US] / 1e6,  # end() adds the same µs to both
        )
        yield self._histogram(
            "polyserve_space_rollout_request_duration_seconds",
            "The space's requests that a rollout sent to its new version, by duration (the"
            " space's histogram less this one is its other requests'); since the host's start.",
            seconds,
            t[:, LANE_DURATION : LANE_DURATION + histogram.BUCKETS],
            t[:, LANE_BUSY_US] / 1e6,
        )
        yield self._histogram(
            "polyserve_space_batch_rows",
            "Rows per batched run of the space's model (or its polyserve.models.batched"
            " functions); the count is the batches, the sum the rows.",
            [str(b) for b in histogram.ROW_BOUNDS],
            t[:, BATCH_SIZE : BATCH_SIZE + histogram.ROW_BUCKETS],
            t[:, Cell.BATCH_ROWS],
        )
        yield self._histogram(
            "polyserve_space_batch_queue_seconds",
            "Time a batched call waited, from its enqueue to the start of its batch.",
            [f"{b / 1e6:g}" for b in histogram.QUEUE_BOUNDS_US],
            t[:, BATCH_QUEUE : BATCH_QUEUE + histogram.QUEUE_BUCKETS],
            t[:, QUEUE_US] / 1e6,
        )
        yield self._histogram(
            "polyserve_space_first_byte_seconds",
            "Time from dispatch to the first body bytes of a streamed answer (one sent in"
            " more than one body message).",
            seconds,
            t[:, FIRST_BYTE : FIRST_BYTE + histogram.BUCKETS],
            t[:, FIRST_BYTE_US] / 1e6,
        )

    def _histogram(
        self, name: str, doc: str, bounds: list[str], cells: np.ndarray, sums: np.ndarray
    ) -> Metric:
        family = HistogramMetricFamily(name, doc, labels=["space"])
        les = [*bounds, "+Inf"]
        cumulative = np.cumsum(cells, axis=1).tolist()
        for space, counts, total in zip(self.snap.names, cumulative, sums.tolist(), strict=True):
            family.add_metric([space], list(zip(les, counts, strict=True)), total)
        return family

    def _gpu_metrics(self) -> Iterator[Metric]:
        """A GPU host's: each space's device memory and recycles, each GPU's memory."""
        snap = self.snap
        device = GaugeMetricFamily(
            "polyserve_space_gpu_memory_bytes",
            "Device memory the latest load of the space added to its worker (NVML).",
            labels=["space"],
        )
        recycled = CounterMetricFamily(
            "polyserve_space_recycled",
            "Releases of the space whose device memory stayed, so its worker was recycled.",
            labels=["space"],
        )
        rows = zip(
            snap.names,
            snap.gpu_memory_bytes.tolist(),
            snap.totals[:, Cell.RECYCLED].tolist(),
            strict=True,
        )
        for space, nbytes, count in rows:
            device.add_metric([space], nbytes)
            recycled.add_metric([space], count)
        yield device
        yield recycled
        total = GaugeMetricFamily(
            "polyserve_gpu_memory_total_bytes", "Each GPU's memory (NVML).", labels=["gpu"]
        )
        used = GaugeMetricFamily(
            "polyserve_gpu_memory_used_bytes", "Each GPU's memory in use (NVML).", labels=["gpu"]
        )
        for found in self.gpus or ():
            if found is not None:
                total.add_metric([str(found.index)], found.total)
                used.add_metric([str(found.index)], found.used)
        yield total
        yield used


def exposition(
    snap: Snapshot,
    fleet: tuple[int, int] | None = None,
    mapped: dict[str, int] | None = None,
    gpus: Sequence[Memory | None] | None = None,
    keys: Mapping[str, Mapping[str, int]] | None = None,
) -> bytes:
    """The Prometheus text format for one usage snapshot; in a fleet, with this host's
    lag: `fleet` is (the last change it applied, the fleet's last change); `mapped` the
    bytes each space's files are mapped for (polyserve/usage/mapped.py); on a GPU host,
    `gpus` each GPU's memory (None where NVML cannot read it); `keys` each private
    space's requests per key id."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap, fleet, mapped, gpus, keys))
    return generate_latest(registry)
