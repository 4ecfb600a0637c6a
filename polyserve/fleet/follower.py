"""The master's follower: apply the fleet's changes to this host's data directory, in order.

A change is applied exactly as a local deploy would be — files into place, `current`
flipped under the store lock, the generation word bumped, the workers signalled — so the
request path never talks to the database. LISTEN/NOTIFY wakes the follower at once; a
poll every POLYSERVE_FLEET_POLL_S catches what a host that was not listening missed.
The last change applied is kept in the data directory and acknowledged in the fleet. A
change this host cannot apply is skipped and reported, and the next one applied; a fleet
whose database went back in time is followed from its pointers again.
"""

from __future__ import annotations

import compileall
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from functools import partial
from pathlib import Path

import psycopg

from polyserve.errors import DISK_FULL, ClientError
from polyserve.fleet.db import Boot, Change, FleetDB, Stored, Totals, Unreachable
from polyserve.procs import die_with_parent
from polyserve.settings import Settings, load
from polyserve.state.broadcast import Broadcast
from polyserve.state.shm import H_ALIVE, Table, segment_name
from polyserve.state.store import Staged, Store, Version, write_atomic
from polyserve.usage import meter

log = logging.getLogger("polyserve")
APPLIED = "fleet.applied"  # in the data directory: the last change applied here
BATCH = 1000
# A host further behind than this (joining a fleet with a history, a long partition)
# takes the fleet's pointers and fetches each version's files on first use instead of
# replaying every change; closer, it applies each change with its files.
EAGER_LIMIT = 20
STOP_CHECK_S = 0.2  # how soon a follower waiting for changes sees that it must stop
# Tries of a change that failed in a way that may pass (a full table or disk, a local
# error) before this host skips it; one it can never apply (too large, a bad upload) is
# skipped at once. Between tries the follower heartbeats and waits a poll interval.
ATTEMPTS = 3


def fetch_version(db: FleetDB, store: Store, version: Version, max_unpacked: int) -> None:
    """Put a version's files in place from the fleet, on first use (a worker)."""
    stored = db.fetch(version.space, version.number)
    if stored is None:
        raise ClientError(404, f"{version.space} v{version.number} is not in the fleet store")
    staged = download(db, store, version.space, stored, max_unpacked)
    if staged is not None:
        try:
            with store.locked():
                store.install(version.space, stored.number, staged)
        finally:
            store.discard(staged)


def download(
    db: FleetDB, store: Store, space: str, stored: Stored, max_unpacked: int
) -> Staged | None:
    """A fleet version's files, staged: its bytes streamed to a file while hashed (never
    whole in memory), the sha256 checked, unpacked from the file as an upload is (the
    same caps), byte-compiled. None when they are on disk already."""
    if store.has_files(space, stored.number, stored.sha256):
        return None
    try:
        with tempfile.TemporaryFile(dir=store.staging_dir) as spool:
            if db.download(space, stored, spool) != stored.sha256:
                raise ClientError(
                    500, f"{space} v{stored.number}: sha256 mismatch in the fleet store"
                )
            upload = str(stored.meta.get("upload") or "space.tar")
            staged = store.stage(spool, upload, max_unpacked)
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        raise ClientError(507, f"{space} v{stored.number}: the data disk is full") from None
    try:
        compileall.compile_dir(str(staged.dir), quiet=2, workers=1)
    except BaseException:
        store.discard(staged)
        raise
    return staged


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
        self.applied, self.token = read_mark(store.root / APPLIED)
        self.stop = threading.Event()
        self._usage_at = 0.0  # monotonic time of the last usage write
        # Deleted spaces' slots are handed over as a single host's deploy does.
        self._reclaim = partial(meter.reclaimable, broadcast.table)
        self._failed: tuple[int, int] = (0, 0)  # (a change id, its failed tries)
        self.skipped: set[str] = set()  # spaces whose last change here was skipped

    # -- the thread ----------------------------------------------------------------------

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
                self.catch_up()
                acknowledged = (self._workers(), self.applied, self.token)
                if not self.db.heartbeat(s.host_id, self.boot.id, *acknowledged):
                    self._replaced()
                    break
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

    def _wait(self, listener: psycopg.Connection) -> None:
        """Until the first NOTIFY, the poll interval (the backstop), the next usage write,
        or a stop: in short waits, so a follower whose master died (SIGTERM) stops at
        once, not a poll interval later, while another boot of the host may have started."""
        s, now = self.settings, time.monotonic()
        end = now + min(s.fleet_poll_s, max(self._usage_at + s.checkpoint_interval - now, 0.0))
        while not self.stop.is_set() and (left := end - time.monotonic()) > 0:
            if next(listener.notifies(timeout=min(left, STOP_CHECK_S), stop_after=1), None):
                return

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
        self.db.limits(s.host_id, self.boot.id, s.max_spaces, s.max_upload_mb, s.max_unpacked_mb)
        self.skipped = {skip["space"] for skip in self.db.skipped().get(s.host_id, [])}

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
        if not self.db.write_usage(self.settings.host_id, self.boot.id, billed):
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

    # -- applying ------------------------------------------------------------------------

    def catch_up(self) -> None:
        """Apply every change after the last one applied here, in order (from the fleet's
        pointers when far behind, or when the fleet went back in time). A change that
        failed in a way that may pass is left for the next poll."""
        if self._went_back():
            self._take_pointers(back=True)
        while changes := self.db.changes_since(self.applied, BATCH):
            if len(changes) > EAGER_LIMIT:
                self._take_pointers()
            else:
                for change in changes:
                    if not self._apply_or_skip(change):
                        self.broadcast.announce()
                        return
                    self._applied(change)
            self.broadcast.announce()
            if len(changes) < BATCH:
                break

    def _went_back(self) -> bool:
        """Whether the fleet's change of the id applied here is not the one applied (a
        restore, a failover to a lagging replica): its last change is below it, or the
        id was handed out again. The fleet is the truth, even an older one."""
        if not self.applied:
            return False
        token = self.db.token(self.applied)
        if token is not None and (self.token is None or token == self.token):
            self.token = token  # applied before changes had tokens: taken as it is
            return False
        log.warning(
            "the fleet's database went back in time: change %d is %s; following its pointers again",
            self.applied,
            "gone" if token is None else "another one than the one applied here",
        )
        return True

    def _apply_or_skip(self, change: Change) -> bool:
        """Apply a change, or skip it: False to try it again at the next poll."""
        try:
            self._apply(change)
        except (Unreachable, psycopg.Error):
            raise  # the database's trouble, not the change's: retried until it is back
        except Exception as exc:
            again = not isinstance(exc, ClientError) or exc.status == 507
            tries = self._failed[1] + 1 if self._failed[0] == change.id else 1
            self._failed = (change.id, tries)
            error = exc.error if isinstance(exc, ClientError) else f"{type(exc).__name__}: {exc}"
            if again and tries < ATTEMPTS:
                log.warning("change %d (%s), try %d: %s", change.id, change.space, tries, error)
                return False
            if not isinstance(exc, ClientError):
                log.exception("change %d (%s) failed", change.id, change.space)
            self._skip(change, error)
            return True
        self._unskip({change.space})
        return True

    def _unskip(self, spaces: set[str]) -> None:
        """Spaces whose fleet state this host now has: what it skipped of them is past."""
        for space in spaces & self.skipped:
            self.db.unskip(self.settings.host_id, space)
            self.skipped.discard(space)

    def _skip(self, change: Change, error: str) -> None:
        """Report a change this host cannot apply, and stop serving what it replaced: a
        host never answers with an older version than the fleet's."""
        log.error(
            "skipped change %d (%s of %s v%s): %s; this host does not serve %s until a later"
            " change of it applies here",
            change.id, change.kind, change.space, change.version, error, change.space,
        )  # fmt: skip
        self.db.skip(self.settings.host_id, change, error)
        self.skipped.add(change.space)
        if change.kind == "deploy":
            with self.store.locked():
                slot = self.store.delete(change.space)
                if slot is not None:
                    self._bump(change.space, slot)

    def _apply(self, change: Change) -> None:
        store, space = self.store, change.space
        if change.kind == "deploy" and change.version is not None:
            # Another pool's version comes without its bytes: this host only points at
            # it (its workers redirect its requests), and fetches its files on first use
            # should it ever serve it (restarted in that pool).
            stored = self.db.fetch(space, change.version, self.settings.pool)
            if stored is None:
                return  # gone from the fleet store: a later change supersedes it
            while True:
                staged = None
                if stored.size is not None:
                    cap = self.settings.max_unpacked_mb << 20
                    staged = download(self.db, store, space, stored, cap)
                try:
                    with store.locked():
                        if staged is not None:
                            slot = store.publish(
                                space, staged, stored.meta, self._reclaim, stored.number
                            )[0]
                        elif stored.size is None or store.has_files(
                            space, stored.number, stored.sha256
                        ):
                            slot = store.point(space, stored.number, stored.meta, self._reclaim)
                        else:
                            # An old version (a rollback) pruned since it was found on
                            # disk: fetched again. Once current, nothing prunes it.
                            continue
                        self._bump(space, slot)
                        return
                finally:
                    if staged is not None:
                        store.discard(staged)
        elif change.kind == "delete":
            with store.locked():
                deleted = store.delete(space)
                if deleted is not None:
                    self._bump(space, deleted)
        elif change.kind == "release":
            known = store.slots.slot(space)
            if known is not None:
                with store.locked():
                    self.broadcast.release(known)

    def _take_pointers(self, back: bool = False) -> None:
        """Far behind, or `back` in time: adopt the fleet's current pointers; files come
        on first use. Going back, the spaces the fleet no longer knows are deleted, and
        local files are kept only where their sha256 is the fleet's."""
        last, pointers = self.db.pointers()
        store = self.store
        unfit: list[tuple[Change, str]] = []
        with store.locked():
            if back:
                for space in set(store.spaces()) - set(pointers):
                    pointers[space] = None
            for space, pointer in pointers.items():
                local = store.current(space)
                slot: int | None = None
                try:
                    if pointer is None:
                        slot = store.delete(space) if local is not None else None
                    elif local is None or (local.number, local.sha256) != (
                        pointer[0],
                        pointer[1].get("sha256"),
                    ):
                        slot = store.point(space, *pointer, self._reclaim, sync=False)
                    else:
                        continue
                except ClientError as exc:  # no slot for it here
                    version = pointer[0] if pointer else None
                    unfit.append((Change(last.id, space, "deploy", version), exc.error))
                if slot is not None:
                    self._bump(space, slot)
            store.slots.sync()
        log.info("took the fleet's pointers for %d spaces, up to change %d", len(pointers), last.id)
        for change, error in unfit:
            self._skip(change, error)
        self._unskip(set(pointers) - {change.space for change, _ in unfit})
        self._applied(last)

    def _bump(self, space: str, slot: int) -> None:
        self.broadcast.bump(slot)
        self.store.prune(space, self.broadcast.oldest_held(slot))

    def _applied(self, change: Change) -> None:
        self.applied, self.token = change.id, change.token
        mark = f"{change.id} {change.token}" if change.token else str(change.id)
        write_atomic(self.store.root / APPLIED, mark.encode())


def read_applied(path: Path) -> int:
    """The last change applied here (0: none)."""
    return read_mark(path)[0]


def read_mark(path: Path) -> tuple[int, str | None]:
    """(The last change applied here, its token: None when it had none)."""
    try:
        number, *token = path.read_text().split()
        return int(number), (token[0] if token else None)
    except (FileNotFoundError, ValueError):
        return 0, None


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
    store = Store(settings.data_dir, settings.max_spaces, settings.keep_versions)
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
