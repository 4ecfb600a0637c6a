"""A worker's objects, built in one place: store, table, registry, dispatch, deploys, usage.

`running_host` builds them at the ASGI lifespan's startup, from the settings and what
the master handed this worker (polyserve/state/handoff.py), starts their background
tasks, and takes them down at shutdown. The control plane and the space dispatch both
serve from the one Host it yields.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import anyio.to_thread

from polyserve import devices
from polyserve import settings as settings_mod
from polyserve.deploy.deploys import Deploys
from polyserve.logs import spacelog
from polyserve.logs.logstore import LogStore
from polyserve.serve import warmup
from polyserve.serve.deadlines import Deadlines
from polyserve.serve.dispatch import Dispatch
from polyserve.serve.gate import Gate
from polyserve.serve.registry import Registry
from polyserve.serve.split import Split
from polyserve.state import handoff
from polyserve.state.broadcast import SIGNAL, Broadcast
from polyserve.state.shm import Table
from polyserve.state.store import Store
from polyserve.usage.answer import Usage
from polyserve.usage.meter import CELLS, Meter

HOST_THREADS = 8  # concurrent imports, stagings and publishes per worker


@dataclass
class Host:
    """Everything one worker serves with, built in one place: `running_host`."""

    settings: settings_mod.Settings
    store: Store
    table: Table
    broadcast: Broadcast
    registry: Registry
    dispatch: Dispatch
    deploys: Deploys
    logs: LogStore
    usage: Usage


@contextlib.asynccontextmanager
async def running_host(
    settings: settings_mod.Settings, clock: Callable[[], float]
) -> AsyncIterator[Host]:
    """A worker's objects and background tasks, from its lifespan startup to shutdown."""
    s = settings
    store = Store(s.data_dir, s.max_spaces, s.keep_versions, s.disk_budget_mb << 20, s.lazy_slots)
    # Without the gunicorn master (in-process tests), a private one-row table.
    inherited = handoff.received()
    if inherited is not None:
        table, row = inherited.table, inherited.row
    else:
        table, row = Table.anonymous(1, s.max_spaces, CELLS), 0
    logs = LogStore(store.logs_dir, s.log_kb << 10)
    # Host work (imports, staging, publishing) gets threads of its own, which no tenant
    # can exhaust: sync handle()s have per-space limiters, and tenants' ASGI apps share
    # anyio's default one.
    host_limiter = anyio.CapacityLimiter(HOST_THREADS)
    # anyio sets up its worker threads lazily: pay that at boot, not in the first cold
    # start, whose time and memory are billed to a space (BENCHMARKS.md, cold start).
    # A worker warms there what that load would pay for (warmup.in_worker), before the
    # capture: the space it imports has no log.
    if inherited is not None:
        await anyio.to_thread.run_sync(warmup.in_worker, s.preload, limiter=host_limiter)
    else:
        await anyio.to_thread.run_sync(lambda: None, limiter=host_limiter)
    # What spaces print and log, from a worker only: the capture replaces this process's
    # sys.stdout, sys.stderr and a root handler, which in-process tests' runners own.
    capture = spacelog.start_capture(logs, s.log_rate) if inherited is not None else None
    broadcast, meter = Broadcast(table, row), Meter(table, row)
    fleet = pools = None
    # Imported here: psycopg is slow to import, a cost for a fleet host alone (bench/NOTES.md,
    # "Figures moved out of code comments (issue 26)").
    if s.database_url:
        from polyserve.fleet.client import FleetClient
        from polyserve.fleet.pools import PoolRouter

        fleet = FleetClient(s, store)  # its database calls on threads of its own
        pools = PoolRouter(fleet.db, s.fleet_live_s, s.pool_retry_after_s, fleet.db_limiter)
    registry = Registry(
        store,
        broadcast,
        meter,
        s.idle_ttl,
        s.import_timeout,
        clock=clock,
        space_threads=s.space_threads,
        host_limiter=host_limiter,
        fetch=fleet.fetch if fleet is not None else None,
        # Pools apply only in a fleet: a single host serves every space it is given.
        pool=s.pool if fleet is not None else None,
        memory_cap=s.worker_memory_mb << 20,
        # A GPU worker's device memory, under its cap; recycled only under a master.
        device_cap=s.worker_gpu_memory_mb << 20 if devices.assigned() is not None else None,
        recycle=None if inherited is not None else lambda: None,
    )
    deadlines = Deadlines(s.request_timeout)
    host = Host(
        settings=s,
        store=store,
        table=table,
        broadcast=broadcast,
        registry=registry,
        dispatch=Dispatch(
            registry,
            meter,
            deadlines,
            pools,
            s.max_infer_mb << 20,
            Gate(store, table, clock),
            Split(store, table),
        ),
        deploys=Deploys(
            s,
            store,
            broadcast,
            table,
            host_limiter,
            registry.refresh,
            fleet,
            registry.cap.floor,
            forkserver=inherited.forkserver if inherited is not None else None,
        ),
        logs=logs,
        usage=Usage(table, store, host_limiter, s.gpus),
    )
    # Off the main thread (an in-process test client) there is no signal handler:
    # requests still read the generation word, which alone keeps the contract.
    with contextlib.suppress(RuntimeError, ValueError):
        asyncio.get_running_loop().add_signal_handler(SIGNAL, registry.refresh)
    broadcast.record_pid()
    background = [
        asyncio.create_task(registry.reaper()),
        asyncio.create_task(deadlines.watch()),
        asyncio.create_task(host.usage.window.run()),
    ]
    try:
        yield host
    finally:
        for task in background:
            task.cancel()
        await registry.close()
        if fleet is not None:
            fleet.db.close()
        if capture is not None:  # last: the spaces' lifespan shutdowns above may log
            spacelog.stop_capture(capture)
