"""The autoscaler's loop: scrape each pool's hosts, decide, add hosts or retire them."""

from __future__ import annotations

import functools
import json
import logging
import secrets
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from polyserve.autoscale.config import Config, Pool
from polyserve.autoscale.decide import Decider, Decision
from polyserve.autoscale.metrics import Metrics
from polyserve.autoscale.provider import HostSpec, Machine, Provider, ProviderError
from polyserve.autoscale.ratio import HostLoad, Sample, Tracker, pool_ratio
from polyserve.fleet.db import FleetDB

log = logging.getLogger("polyserve.autoscale")
# A provider's word for a machine with no running host: deleted, then replaced if the
# pool needs it.
GONE = frozenset({"exited", "off", "terminated", "dead"})
SCRAPE_TIMEOUT_S = 5.0
LEAVE_WAIT_S = 5.0  # after a graceful stop, for the host's last usage write and leave
# The fleet's host table may lag a host that stopped heartbeating by this long; the
# autoscaler only reads it for hosts no provider of ours made.
LIVE_S = 10.0

Scrape = Callable[[str], Any]


def scrape_usage(url: str) -> Any:
    """A host's usage, host section only, as the JSON it answered (`Sample.parse` judges
    it); None if it did not answer with JSON."""
    try:
        with urllib.request.urlopen(
            f"{url}/_polyserve/usage?only=host", timeout=SCRAPE_TIMEOUT_S
        ) as answer:
            return json.loads(answer.read())
    except (OSError, ValueError):
        return None  # refused, timed out, an HTTP error (URLError is an OSError), not JSON


@dataclass
class PoolState:
    pool: Pool
    provider: Provider
    decider: Decider
    tracker: Tracker = field(default_factory=Tracker)
    unanswered_since: dict[str, float] = field(default_factory=dict)


class Scaler:
    def __init__(
        self,
        config: Config,
        db: FleetDB,
        providers: dict[str, Provider],
        dry_run: bool = False,
        clock: Callable[[], float] = time.time,
        scrape: Scrape = scrape_usage,
    ) -> None:
        self.config, self.db, self.dry_run = config, db, dry_run
        self.clock, self.scrape = clock, scrape
        self.metrics = Metrics()
        self.pools = [
            PoolState(
                p,
                providers[p.name],
                Decider(
                    p.name,
                    p.min_workers,
                    p.max_workers,
                    config.target_busy_ratio,
                    config.scale_up_window_s,
                    config.scale_down_window_s,
                ),
            )
            for p in config.pools
            if p.name in providers
        ]
        self._retiring: dict[str, threading.Thread] = {}  # host id -> its retirement
        self._scrapers = ThreadPoolExecutor(32, thread_name_prefix="scrape")

    def step(self) -> list[Decision]:
        """One interval: every pool scraped, decided and acted on."""
        started = time.perf_counter()
        hosts = self.db.hosts(LIVE_S)
        demand = self.db.demand(2 * self.config.scale_interval_s)
        decisions = []
        for state in self.pools:
            try:
                decisions.append(self._pool_step(state, hosts, bool(demand.get(state.pool.name))))
            except ProviderError as exc:
                log.error(
                    "pool=%s provider=%s failed: %s", state.pool.name, state.pool.provider, exc
                )
                self.metrics.errors.labels(state.pool.name).inc()
        self.metrics.step_seconds.set(time.perf_counter() - started)
        return decisions

    def _pool_step(self, state: PoolState, hosts: list[dict[str, Any]], demand: bool) -> Decision:
        pool, now = state.pool.name, self.clock()
        machines = state.provider.list(pool)
        for m in machines:
            if m.state.lower() in GONE and m.host_id not in self._retiring:
                log.warning("pool=%s host=%s is %s: deleting it", pool, m.host_id, m.state)
                self._act(state, "replaced", functools.partial(state.provider.delete, m))
        active = [
            m for m in machines if m.state.lower() not in GONE and m.host_id not in self._retiring
        ]
        ours = {m.host_id for m in machines}
        others = [h for h in hosts if h["pool"] == pool and h["live"] and h["id"] not in ours]
        urls = {m.host_id: m.url or _fleet_url(hosts, m.host_id) for m in active}
        urls |= {h["id"]: h["url"] for h in others}
        loads = self._scrape(state, urls)
        state.tracker.forget(urls)

        for m in list(active):  # a host that stopped answering for good is replaced
            if loads[m.host_id].status != "unanswered":
                state.unanswered_since.pop(m.host_id, None)
                continue
            since = state.unanswered_since.setdefault(m.host_id, now)
            booted = now - m.created_at > self.config.boot_grace_s
            if booted and now - since > self.config.unhealthy_s:
                log.warning(
                    "pool=%s host=%s unanswered for %.0f s: replacing it",
                    pool,
                    m.host_id,
                    now - since,
                )
                active.remove(m)
                self._retire(state, m, graceful=False)

        ratio = pool_ratio(loads.values())
        current = len(active) + len(others)
        decision = state.decider.decide(now, current, ratio, demand)
        self._log(decision, loads.values(), demand)
        if decision.desired > current:
            for _ in range(decision.desired - current):
                self._create(state)
        elif decision.desired < current:
            for m in _victims(active, loads, current - decision.desired):
                self._retire(state, m, graceful=True)
        self.metrics.record(decision, loads.values())
        return decision

    def _scrape(self, state: PoolState, urls: dict[str, str]) -> dict[str, HostLoad]:
        def one(item: tuple[str, str]) -> HostLoad:
            host_id, url = item
            answer = self.scrape(url) if url else None
            sample = None
            if answer is not None:
                try:
                    sample = Sample.parse(answer, self.clock())
                except ValueError as exc:  # not a host's usage: unhealthy, like a silent one
                    log.warning("pool=%s host=%s bad usage: %s", state.pool.name, host_id, exc)
            return state.tracker.observe(host_id, sample)

        return {load.host_id: load for load in self._scrapers.map(one, urls.items())}

    def _create(self, state: PoolState) -> None:
        pool = state.pool.name
        host_id = f"polyserve-{pool}-{secrets.token_hex(4)}"
        env = {
            "POLYSERVE_DATABASE_URL": self.config.database_url,
            "POLYSERVE_POOL": pool,
            "POLYSERVE_HOST_ID": host_id,
        }
        if self.config.deploy_token_sha256:
            env["POLYSERVE_DEPLOY_TOKEN_SHA256"] = self.config.deploy_token_sha256
        spec = HostSpec(pool, host_id, env)
        log.info("pool=%s creating host=%s", pool, host_id)
        self._act(state, "created", lambda: state.provider.create(spec))

    def _retire(self, state: PoolState, machine: Machine, graceful: bool) -> None:
        """Take a host out, let it drain, stop it gracefully, then delete it — in a
        thread of its own, so the loop goes on meanwhile."""
        if self.dry_run:
            log.info("pool=%s would retire host=%s (dry run)", state.pool.name, machine.host_id)
            return
        thread = threading.Thread(
            target=self._retirement,
            args=(state, machine, graceful),
            name=f"retire-{machine.host_id}",
        )
        self._retiring[machine.host_id] = thread
        thread.start()

    def _retirement(self, state: PoolState, machine: Machine, graceful: bool) -> None:
        pool, host_id = state.pool.name, machine.host_id
        cfg = self.config
        try:
            self.db.drain(host_id)  # no deploy waits for it; it drops out of the live list
            if graceful:
                state.provider.take_out(machine)
                log.info("pool=%s host=%s taken out: draining %.0f s", pool, host_id, cfg.drain_s)
                time.sleep(cfg.drain_s)
                state.provider.stop(machine, cfg.stop_timeout_s)
                self._wait_left(host_id)
            state.provider.delete(machine)
            log.info("pool=%s host=%s deleted", pool, host_id)
            self.metrics.actions.labels(pool, "retired" if graceful else "replaced").inc()
        except Exception as exc:  # the next step finds the host again and retries
            log.error("pool=%s host=%s retirement failed: %s", pool, host_id, exc)
            self.metrics.errors.labels(pool).inc()
        finally:
            self._retiring.pop(host_id, None)

    def _wait_left(self, host_id: str) -> None:
        """Until the host's graceful stop has written its last usage and left the fleet
        (or LEAVE_WAIT_S): what it counted is in the ledger before it is deleted."""
        deadline = time.monotonic() + LEAVE_WAIT_S
        while time.monotonic() < deadline:
            row = next((h for h in self.db.hosts(LIVE_S) if h["id"] == host_id), None)
            if row is None or row["left"]:
                return
            time.sleep(0.1)
        log.warning("host=%s did not leave the fleet after its stop", host_id)

    def _act(self, state: PoolState, action: str, call: Callable[[], object]) -> None:
        if self.dry_run:
            log.info("pool=%s would do: %s (dry run)", state.pool.name, action)
            return
        call()
        self.metrics.actions.labels(state.pool.name, action).inc()

    def _log(self, d: Decision, loads: Any, demand: bool) -> None:
        loads = list(loads)
        by = {
            s: sum(1 for x in loads if x.status == s)
            for s in ("ok", "new", "restarted", "unanswered")
        }
        log.info(
            "pool=%s current=%d answering=%d new=%d restarted=%d unanswered=%d busy_s=%.3f"
            " capacity_s=%.3f ratio=%s target=%.2f demand=%s raw=%d desired=%d: %s%s",
            d.pool, d.current, by["ok"], by["new"], by["restarted"], by["unanswered"],
            sum(x.busy_s for x in loads), sum(x.capacity_s for x in loads),
            "-" if d.ratio is None else f"{d.ratio:.3f}", self.config.target_busy_ratio,
            "yes" if demand else "no", d.raw, d.desired, d.reason,
            " (dry run)" if self.dry_run and d.desired != d.current else "",
        )  # fmt: skip

    def close(self, timeout_s: float) -> None:
        """Let retirements in progress finish (each is bounded), then stop scraping."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self._retiring.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
        self._scrapers.shutdown(wait=False, cancel_futures=True)


def _fleet_url(hosts: list[dict[str, Any]], host_id: str) -> str:
    return next((h["url"] for h in hosts if h["id"] == host_id), "")


def _victims(active: list[Machine], loads: dict[str, HostLoad], n: int) -> list[Machine]:
    """The hosts to retire: not answering first (nothing to drain), then the least busy
    last interval, then the newest."""

    def cost(m: Machine) -> tuple[bool, float, float]:
        load = loads.get(m.host_id)
        answering = load is not None and load.status != "unanswered"
        return (answering, load.busy_s if load else 0.0, -m.created_at)

    return sorted(active, key=cost)[:n]
