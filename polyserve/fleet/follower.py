"""The master's follower process: follow the fleet's changes, heartbeat, bill this host's usage.

It applies each change to this host as a local deploy would (polyserve.fleet.catchup),
so the request path never talks to the database. LISTEN/NOTIFY wakes it at once; a poll
every POLYSERVE_FLEET_POLL_S catches what a host that was not listening missed. After
each catch-up it heartbeats with the last change applied, which a deploy waits for on
every live host, and once a checkpoint interval it writes this boot's usage to the
fleet's ledger.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
import uuid

import psycopg

from polyserve.fleet import rollouts
from polyserve.fleet.catchup import CatchUp
from polyserve.fleet.connection import Unreachable
from polyserve.fleet.db import FleetDB
from polyserve.fleet.ledger import Boot, Totals
from polyserve.procs import die_with_parent
from polyserve.settings import Settings, load
from polyserve.state import budget
from polyserve.state.apply import Changes
from polyserve.state.broadcast import Broadcast
from polyserve.state.shm import H_ALIVE, H_FOLLOWED, Table, segment_name
from polyserve.state.store import Store, write_atomic
from polyserve.usage import meter

log = logging.getLogger("polyserve")
STOP_CHECK_S = 0.2  # how soon a follower waiting for changes sees that it must stop


class Follower:
    """Runs in a process of its own beside the master (see main): a database connection
    must not be inherited by the workers the master forks."""

    def __init__(self, settings: Settings, store: Store, broadcast: Broadcast, boot: Boot) -> None:
        self.settings = settings
        self.store = store
        self.broadcast = broadcast
        self.boot = boot
        # The totals this boot's ledger rows leave out, as the fleet said at the join
        # (None: not joined yet, so nothing to write: the next boot bills it all).
        self.baseline: Totals | None = None
        self.db = FleetDB(settings.database_url, settings.fleet_timeout_s)
        self.catchup = CatchUp(
            settings, self.db, Changes(store, broadcast, fleet=True), self._installing
        )
        # This boot's first heartbeat makes it live, and comes after its first catch-up:
        # an install during that one (a joining host) heartbeats nothing.
        self._beaten = False
        self.stop = threading.Event()
        self._usage_at = 0.0  # monotonic time of the last usage write
        self._trimmed: int | None = None  # the change applied at the last disk budget pass

    def run(self) -> None:
        """Follow until stop is set, through lost connections and a database that is down."""
        s = self.settings
        listener: psycopg.Connection | None = None
        while not self.stop.is_set():
            try:
                if listener is None or listener.closed:
                    listener = self.db.listen()
                    self._join()
                    if self.stop.is_set():
                        break
                self.catchup.catch_up()
                if not self._beat():
                    break
                self._trim()  # after the heartbeat: no deploy waits for it
                if time.monotonic() - self._usage_at >= s.checkpoint_interval:
                    self.write_usage()
                self._wait(listener)
            except (psycopg.Error, Unreachable, OSError) as exc:
                log.warning("fleet store unreachable (%s); retrying", type(exc).__name__)
                if listener is not None:
                    listener.close()
                listener = None
                self.stop.wait(self.settings.fleet_poll_s)
            except Exception:  # a bad change must not stop the follower: log, poll again
                log.exception("applying the fleet's changes failed; retrying")
                self.stop.wait(self.settings.fleet_poll_s)
        if listener is not None:
            listener.close()

    def _trim(self) -> None:
        """Under a disk budget, once at the start and after changes were applied (their
        files may have come with them): the cold versions' files past it go."""
        if self.store.disk_budget and self.catchup.applied != self._trimmed:
            budget.trim(self.store, self.broadcast, self.store.disk_budget)
            self._trimmed = self.catchup.applied

    def _beat(self) -> bool:
        """Heartbeat with the last change applied; False when this boot was replaced."""
        s = self.settings
        acknowledged = (self._workers(), self.catchup.applied, self.catchup.token)
        if not self.db.heartbeat(s.host_id, self.boot.id, *acknowledged):
            self._replaced()  # during an install: it finishes, then the loop stops
            return False
        self._beaten = True
        # The workers' health answers 200 only while this is recent (control/plane.py):
        # a load balancer then sends no requests to a host that may be behind.
        self.broadcast.table.set_header(H_FOLLOWED, meter.now_us())
        return True

    def _installing(self) -> None:
        """Catch-up's call while a dependency set installs (which may take minutes): a
        host that was live stays live and healthy, serving what it applied, until the
        install is done; a boot that has not caught up once stays not live."""
        if self._beaten:
            self._beat()

    def _wait(self, listener: psycopg.Connection) -> None:
        """Until the first NOTIFY, the poll interval (the backstop), the next usage write,
        or a stop: in short waits, so a follower whose master died (SIGTERM) stops at
        once, not a poll interval later, while another boot of the host may have started."""
        s, now = self.settings, time.monotonic()
        end = now + min(s.fleet_poll_s, max(self._usage_at + s.checkpoint_interval - now, 0.0))
        # Its socket polled here, and read only once readable: psycopg's own wait wakes
        # every 0.1 s, which was most of an idle follower's CPU (bench/NOTES.md).
        readable = select.poll()
        readable.register(listener.fileno(), select.POLLIN)
        while not self.stop.is_set() and (left := end - time.monotonic()) > 0:
            if readable.poll(min(left, STOP_CHECK_S) * 1000) != [] and any(
                listener.notifies(timeout=STOP_CHECK_S, stop_after=1)
            ):
                return
            rollouts.tick(self.catchup, s.host_id)  # a rollout's step decided (or not)

    def _join(self) -> None:
        """Join the fleet: this process's first join may take over from an earlier boot;
        a reconnect never does (another boot that replaced this one meanwhile stays)."""
        s = self.settings
        takeover = self.baseline is None
        baseline = self.db.join(s.host_id, s.advertise_url, s.pool, self.boot, takeover)
        if baseline is None:
            self._replaced()
            return
        self.baseline = baseline
        spaces = None if s.lazy_slots else s.max_spaces  # then: how many it serves at once
        self.db.limits(s.host_id, self.boot.id, spaces, s.max_upload_mb, s.max_unpacked_mb)
        skips = self.db.skipped().get(s.host_id, [])
        self.catchup.skipped = {skip["space"] for skip in skips}

    def _replaced(self) -> None:
        log.warning("boot %s of this host was replaced by a newer one: stopping", self.boot.id)
        self.baseline = None  # its rows are the new boot's to continue: write nothing
        self.stop.set()

    def write_usage(self) -> None:
        """This boot's totals per space into the fleet's ledger: absolute, so a retry
        writes the same numbers, and a host killed with -9 loses at most one interval
        until it starts again (its next boot bills the rest, see FleetDB.join).

        Open residency counts up to the master's last checkpoint, as a restarted
        master's recovery does, so no boot bills what the next one will not have."""
        if self.baseline is None:
            return
        table, ledger = self.broadcast.table, self.store.slots.ledger()
        now = meter.totals_by_name(table, ledger, table.header(H_ALIVE), meter.BILLED)
        billed = {}
        for space, values in now.items():
            before = self.baseline.get(space, (0,) * len(values))
            # Never below 0: restored from a checkpoint, a total may be behind the baseline.
            delta = tuple(max(a - b, 0) for a, b in zip(values, before, strict=True))
            if any(delta):
                billed[space] = delta
        loaded = meter.loaded_by_name(table, ledger)
        if not self.db.write_usage(self.settings.host_id, self.boot.id, billed, loaded):
            self._replaced()
        self._usage_at = time.monotonic()

    def leave(self) -> None:
        """A stop: the last usage, then out of the fleet, so no deploy waits for this host.
        Unreachable: it stops counting as live after POLYSERVE_FLEET_LIVE_S instead."""
        with contextlib.suppress(Unreachable, psycopg.Error):
            self.write_usage()
        with contextlib.suppress(Unreachable, psycopg.Error):
            self.db.leave(self.settings.host_id, self.boot.id)
        self.db.close()

    def _workers(self) -> int:
        return sum(1 for pid in self.broadcast.table.pids.tolist() if pid)


BOOT = "fleet-boot.json"  # in the data directory: this boot's id, lineage, starting totals


def start_boot(store: Store, table: Table, settled: bool) -> None:
    """The master, before any worker is forked: name this boot and keep what the table
    holds already (restored from earlier boots). `settled`: restored from a checkpoint,
    not from a killed master's segment whose workers may still count into it. The
    lineage, the data directory's id, stays from boot to boot."""
    path = store.root / BOOT
    try:
        lineage = json.loads(path.read_text()).get("lineage") or uuid.uuid4().hex
    except (FileNotFoundError, ValueError, AttributeError):
        lineage = uuid.uuid4().hex
    start = meter.totals_by_name(table, store.slots.ledger(), meter.now_us(), meter.BILLED)
    data = {"boot": uuid.uuid4().hex, "lineage": lineage, "start": start, "settled": settled}
    write_atomic(path, json.dumps(data).encode())


def read_boot(store: Store) -> Boot:
    data = json.loads((store.root / BOOT).read_text())
    start = {name: tuple(v) for name, v in data["start"].items()}
    return Boot(data["boot"], data["lineage"], start, data["settled"])


def main() -> None:
    """`python -m polyserve.fleet.follower`, started by the master with its environment."""
    logging.basicConfig(level=logging.INFO, format="[follower] %(levelname)s %(message)s")
    # Leave with the master, even one killed with -9 (the kernel sends SIGTERM).
    die_with_parent(signal.SIGTERM)
    settings = load()
    s = settings
    store = Store(s.data_dir, s.max_spaces, s.keep_versions, s.disk_budget_mb << 20, s.lazy_slots)
    table = Table.attach(segment_name(str(store.root)))
    if table is None or os.getppid() == 1:
        sys.exit("polyserve follower: no master (its table is gone)")
    follower = Follower(settings, store, Broadcast(table, None), read_boot(store))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: follower.stop.set())
    follower.run()
    follower.leave()
    table.close()


if __name__ == "__main__":
    main()
