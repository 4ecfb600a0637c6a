"""The autoscaler's own /metrics: desired and current hosts, busy ratio, per pool."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from polyserve.autoscale.decide import Decision
from polyserve.autoscale.ratio import HostLoad


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.desired = Gauge(
            "polyserve_autoscale_desired_hosts", "Hosts wanted", ["pool"], registry=r
        )
        self.current = Gauge("polyserve_autoscale_current_hosts", "Hosts now", ["pool"], registry=r)
        self.ratio = Gauge(
            "polyserve_autoscale_busy_ratio",
            "Busy time per second of worker capacity, last interval (NaN: no figure)",
            ["pool"],
            registry=r,
        )
        self.hosts = Gauge(
            "polyserve_autoscale_hosts_by_status",
            "Hosts scraped last interval, by what their answer gave",
            ["pool", "status"],
            registry=r,
        )
        self.actions = Counter(
            "polyserve_autoscale_actions",
            "Hosts created, retired (drained, stopped, deleted) and replaced",
            ["pool", "action"],
            registry=r,
        )
        self.errors = Counter(
            "polyserve_autoscale_errors", "Provider calls that failed", ["pool"], registry=r
        )
        self.step_seconds = Gauge(
            "polyserve_autoscale_step_seconds",
            "The last interval's scrape and decision",
            registry=r,
        )

    def record(self, decision: Decision, loads: Iterable[HostLoad]) -> None:
        pool = decision.pool
        self.desired.labels(pool).set(decision.desired)
        self.current.labels(pool).set(decision.current)
        self.ratio.labels(pool).set(float("nan") if decision.ratio is None else decision.ratio)
        statuses = [load.status for load in loads]
        for status in ("ok", "new", "restarted", "unanswered"):
            self.hosts.labels(pool, status).set(statuses.count(status))

    def serve(self, bind: str) -> Any:
        """Serve /metrics on host:port in a daemon thread; returns the server (shutdown())."""
        host, _, port = bind.rpartition(":")
        server, _thread = start_http_server(int(port), host or "127.0.0.1", registry=self.registry)
        return server
