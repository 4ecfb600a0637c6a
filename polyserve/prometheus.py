"""Prometheus exposition of the usage table, through prometheus_client's own text format."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# (usage field, metric name, kind, units per base unit, help); dividing (not multiplying
# by 1e-3) keeps 26 ms as 0.026 s exactly.
_SPACE_METRICS = (
    ("requests", "polyserve_space_requests", "counter", 1, "Requests answered by the space."),
    ("errors", "polyserve_space_errors", "counter", 1, "Requests the space answered 5xx."),
    (
        "busy_ms",
        "polyserve_space_busy_seconds",
        "counter",
        1000,
        "Time from dispatch to the space until its responses completed.",
    ),
    (
        "warm_s",
        "polyserve_space_warm_seconds",
        "counter",
        1,
        "Residency: seconds loaded, summed over the workers holding the space.",
    ),
    (
        "cold_starts",
        "polyserve_space_cold_starts",
        "counter",
        1,
        "Imports of the space (first request, after idle release, after a deploy).",
    ),
    (
        "workers_loaded",
        "polyserve_space_workers_loaded",
        "gauge",
        1,
        "Workers that hold the space now.",
    ),
    (
        "last_import_ms",
        "polyserve_space_last_import_seconds",
        "gauge",
        1000,
        "Duration of the latest import and startup of the space in a worker.",
    ),
    (
        "rss_kib",
        "polyserve_space_memory_bytes",
        "gauge",
        1 / 1024,
        "Resident memory the latest load of the space added to its worker.",
    ),
)


class _UsageCollector:
    def __init__(self, usage: dict[str, Any]) -> None:
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        spaces = self.usage["spaces"]
        for field, name, kind, per_unit, doc in _SPACE_METRICS:
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(name, doc, labels=["space"])
            for space, values in spaces.items():
                family.add_metric([space], values[field] / per_unit)
            yield family
        host = self.usage["host"]
        yield GaugeMetricFamily(
            "polyserve_workers", "Live worker processes.", value=host["workers"]
        )
        yield GaugeMetricFamily(
            "polyserve_in_flight", "Requests in flight on this host.", value=host["in_flight"]
        )
        yield GaugeMetricFamily(
            "polyserve_uptime_seconds", "Seconds since the master started.", value=host["uptime_s"]
        )


def exposition(usage: dict[str, Any]) -> bytes:
    """The Prometheus text format for one usage snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_UsageCollector(usage))
    return generate_latest(registry)
