"""The follower's catch-up: apply the fleet's changes to this host in order, or skip them.

A change is applied by the state wing's one step (polyserve.state.apply), exactly as a
local deploy is: its dependency set installed (the pins the receiving host resolved),
files into place, `current` moved under the store lock, the generation
word bumped, what no worker holds pruned, the workers signalled. The last change
applied is kept in the data directory (APPLIED) for the heartbeat to acknowledge. A
change this host cannot apply is skipped and reported, and the next one applied; a
fleet whose database went back in time is followed from its pointers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, assert_never

import psycopg

from polyserve.errors import ClientError
from polyserve.fleet import rollouts
from polyserve.fleet.changes import Change
from polyserve.fleet.connection import Unreachable
from polyserve.fleet.db import FleetDB
from polyserve.fleet.fetch import download
from polyserve.fleet.uploads import Stored
from polyserve.names import DEFAULT_POOL
from polyserve.settings import Settings
from polyserve.state import access
from polyserve.state.access import Access
from polyserve.state.apply import Changes
from polyserve.state.files import read_short, write_short
from polyserve.state.store import Staged, Store

_T = TypeVar("_T")
log = logging.getLogger("polyserve")
APPLIED = "fleet.applied"  # in the data directory: the last change applied here
BATCH = 1000
# A host further behind than this (joining a fleet with a history, a long partition)
# takes the fleet's pointers and fetches each version's files on first use instead of
# replaying every change; closer, it applies each change with its files.
EAGER_LIMIT = 20
# Tries of a change that failed in a way that may pass (a full table or disk, a package
# index that did not answer, a local error) before this host skips it; one it can never
# apply (too large, a bad upload, dependencies it cannot install) is skipped at once.
# Between tries the follower heartbeats and waits a poll interval.
ATTEMPTS = 3
AGAIN = (424, 507)  # the statuses of a ClientError that may pass
UV_WORDS = 300  # characters of uv's output a skip's reason quotes


class CatchUp:
    """What this host applied of the fleet's change log, and the applying itself."""

    def __init__(
        self,
        settings: Settings,
        db: FleetDB,
        changes: Changes,
        beat: Callable[[], object] = lambda: None,
    ) -> None:
        self.settings = settings
        # The follower's heartbeat, called every poll interval while a dependency set
        # installs: the host stays live and healthy, serving what it has applied.
        self.beat = beat
        self.db = db
        self.changes = changes
        self.store = changes.store
        self.applied, self.token = read_mark(self.store.root / APPLIED)
        self._failed: tuple[int, int] = (0, 0)  # (a change id, its failed tries)
        self.skipped: set[str] = set()  # spaces whose last change here was skipped

    def catch_up(self) -> None:
        """Apply every change after the last one applied here, in order (from the fleet's
        pointers when far behind, or when the fleet went back in time). A change that
        failed in a way that may pass is left for the next poll."""
        while True:
            known, changes = self.db.changes_since(self.applied, BATCH)
            if self._went_back(known):
                self._take_pointers(back=True)
                continue  # from the fleet's last change, whose token it now has
            if not changes:
                break
            if len(changes) > EAGER_LIMIT:
                self._take_pointers()
            else:
                for change in changes:
                    if not self._apply_or_skip(change):
                        self.changes.announce()
                        return
                    self._applied(change.id, change.token)
            self.changes.announce()
            if len(changes) < BATCH:
                break

    def _went_back(self, known: str | None) -> bool:
        """Whether the fleet's change of the id applied here is not the one applied (a
        restore, a failover to a lagging replica): its last change is below it, or the
        id was handed out again (`known`: the token the fleet has for that id, None for
        none). The fleet is the truth, even an older one."""
        if not self.applied:
            return False
        if known is not None and (self.token is None or known == self.token):
            self.token = known  # applied before changes had tokens: taken as it is
            return False
        log.warning(
            "the fleet's database went back in time: change %d is %s; following its pointers again",
            self.applied,
            "gone" if known is None else "another one than the one applied here",
        )
        return True

    def _apply_or_skip(self, change: Change) -> bool:
        """Apply a change, or skip it: False to try it again at the next poll."""
        try:
            self._apply(change)
        except (Unreachable, psycopg.Error):
            raise  # the database's trouble, not the change's: retried until it is back
        except Exception as exc:
            again = not isinstance(exc, ClientError) or exc.status in AGAIN
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
            self.changes.delete(change.space)

    def _apply(self, change: Change) -> None:
        if change.kind == "deploy":
            if change.version is not None:
                self._deploy(change.space, change.version)
        elif change.kind == "delete":
            self.changes.delete(change.space)
        elif change.kind == "release":
            self.changes.release(change.space)
        elif change.kind == "access":
            found = self.db.access_of(change.space)
            if found is not None:  # a space not deployed here has nothing to apply it to
                self.changes.access(change.space, _replaced(found))
        elif change.kind == "secrets":
            self._secrets(change.space)
        elif change.kind == "rollout":
            rollouts.apply(self, change.space, change.version)
        else:
            assert_never(change.kind)

    def _secrets(self, space: str) -> None:
        """The space's secrets as the fleet stores them, into its file here; the space is
        released, so every worker's next request imports it with them."""
        current = self.store.current(space)
        found = self._ours(space, current.pool if current is not None else None)
        self.changes.secrets(space, partial(self.store.secrets.write, space, found))

    def _ours(self, space: str, pool: str | None) -> dict[str, dict[str, Any]]:
        """The space's secrets from the fleet when its version runs in this host's pool;
        none otherwise: a host keeps no file of the secrets of spaces it never imports,
        so pools keep owners' secrets apart on disk too (docs/secrets.md)."""
        if pool != self.settings.pool:
            return {}
        return self.db.secrets(space).get(space, {})

    def _deploy(self, space: str, number: int) -> None:
        # Another pool's version comes without its bytes: this host only points at it
        # (its workers redirect its requests), and fetches its files on first use should
        # it ever serve it (restarted in that pool).
        # With its secrets (none unless it runs in this host's pool: see _ours).
        stored = self.db.fetch(space, number, self.settings.pool, secrets=True)
        if stored is None:
            return  # gone from the fleet store: a later change supersedes it
        found = stored.secrets or {}
        if stored.size is not None:  # this pool's: its set is installed before it is current
            stored = dataclasses.replace(stored, meta=self._installed(number, stored.meta))
        # Its secrets first, so that the loads this deploy causes read them: this host
        # may have dropped them (a change it skipped deletes the space here).
        if self.store.secrets.read(space) != found:
            with self.store.locked():
                self.store.secrets.write(space, found)
        cap = self.settings.max_unpacked_mb << 20
        while True:
            staged = None
            # A space with no files here was never served here (or its files were
            # pruned): only its pointer moves, and its first request fetches the files.
            if stored.size is not None and self._eager(space):
                staged = download(self.db, self.store, space, stored, cap)
            try:
                place = partial(self._place, space, stored, staged)
                if self.changes.apply(space, place) is not None:
                    return
                # An old version (a rollback) pruned since it was found on disk: fetched
                # again. Once current, nothing prunes it.
            finally:
                if staged is not None:
                    self.store.discard(staged)

    def keep(self, space: str, number: int) -> None:
        """Keep a fleet version beside the current one (a deploy with current=false, a
        rollout's new version): its files too when it runs in this host's pool."""
        stored = self.db.fetch(space, number, self.settings.pool)
        if stored is None:
            return  # gone from the fleet store: a later change supersedes it
        staged = None
        if stored.size is not None:
            stored = dataclasses.replace(stored, meta=self._installed(number, stored.meta))
            staged = download(
                self.db, self.store, space, stored, self.settings.max_unpacked_mb << 20
            )
        try:
            with self.store.locked():
                if staged is not None:
                    self.store.place(space, number, staged)
                self.store.keep(space, number, stored.meta)
        finally:
            if staged is not None:
                self.store.discard(staged)

    def _place(self, space: str, stored: Stored, staged: Staged | None) -> int | None:
        """Under the store lock, make a fleet version current: with the files just staged,
        with those on disk, or (another pool's) with none; returns the slot, or None
        when the files found on disk were pruned meanwhile."""
        store, reclaim = self.store, self.changes.reclaim
        if staged is not None:
            return store.publish(space, staged, stored.meta, reclaim, stored.number)[0]
        if stored.size is None or store.has_files(space, stored.number, stored.sha256):
            return store.point(space, stored.number, stored.meta, reclaim)
        if not self._eager(space):  # its files come on its first request here
            return store.point(space, stored.number, stored.meta, reclaim)
        return None

    def _eager(self, space: str) -> bool:
        """Whether a deploy's files are fetched as it arrives (POLYSERVE_FLEET_FILES): for
        every space, or for those with files here (served here, or still held)."""
        return self.settings.fleet_files == "all" or self.store.holds_files(space)

    def _installed(self, number: int, meta: dict[str, Any]) -> dict[str, Any]:
        """A version's metadata once its dependency set is installed on this host (the
        pins the receiving host resolved, from this host's cache, index or find-links),
        naming this host's copy of the set: no version is current here before its set
        is in place. Raises the ClientError that says why not; a version that declares
        none is returned as it is."""
        declared = meta.get("dependencies")
        if not isinstance(declared, dict):
            return meta
        from polyserve.deploy import deps  # uv and packaging: a host that installs pays

        try:
            installed = asyncio.run(
                self._beating(deps.install_pins(declared, self.store.root, self.settings))
            )
        except ClientError as exc:
            uv = exc.details.get("uv")
            words = " ".join(uv.split())[-UV_WORDS:] if isinstance(uv, str) else ""
            raise ClientError(
                exc.status,
                f"installing the dependencies of v{number} on this host failed: {exc.error}"
                + (f" (uv: …{words})" if words else ""),
                **exc.details,
            ) from None
        if installed.installed:
            log.info(
                "installed the dependency set %s (%s) for v%d in %.0f ms",
                installed.digest, ", ".join(installed.packages), number, installed.install_ms,
            )  # fmt: skip
        if installed.digest == declared.get("set"):
            return meta
        # Another Python names the same pins another set: this host's own copy.
        return {**meta, "dependencies": {**declared, "set": installed.digest}}

    async def _beating(self, work: Coroutine[Any, Any, _T]) -> _T:
        """`work`, with a heartbeat every poll interval until it is done: a deploy waiting
        for this host sees it live, and it applies no later change meanwhile."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=self.settings.fleet_poll_s)
            if done:
                return task.result()
            with contextlib.suppress(Unreachable, psycopg.Error):  # the install goes on
                await asyncio.to_thread(self.beat)

    def _serves(self, meta: dict[str, Any]) -> bool:
        """Whether this host's pool imports a version with this metadata."""
        return str(meta.get("pool") or DEFAULT_POOL) == self.settings.pool

    def _take_pointers(self, back: bool = False) -> None:
        """Far behind, or `back` in time: adopt the fleet's current pointers; files come
        on first use. Going back, the spaces the fleet no longer knows are deleted, and
        local files are kept only where their sha256 is the fleet's."""
        last, pointers = self.db.pointers()
        every = self.db.secrets()  # read after the pointers: no older than they are
        last_id = last.id if last is not None else 0
        store = self.store
        unfit: list[tuple[Change, str]] = []
        # Dependency sets first, outside the store lock (an install may take minutes):
        # a version whose set cannot be installed here is skipped, not pointed at.
        for space, pointer in pointers.items():
            if pointer is None or not self._serves(pointer[1]) or _here(store, space, pointer):
                continue
            try:
                pointers[space] = (pointer[0], self._installed(pointer[0], pointer[1]))
            except ClientError as exc:
                unfit.append((Change(last_id, space, "deploy", pointer[0]), exc.error))
        not_installed = {change.space for change, _ in unfit}
        with store.locked():
            if back:
                for space in set(store.spaces()) - set(pointers):
                    pointers[space] = None
            for space, pointer in pointers.items():
                if space in not_installed:
                    continue
                local = store.current(space)
                slot: int | None = None
                try:
                    if pointer is None:
                        slot = store.delete(space) if local is not None else None
                    elif local is None or (local.number, local.sha256) != (
                        pointer[0],
                        pointer[1].get("sha256"),
                    ):
                        slot = store.point(space, *pointer, self.changes.reclaim, sync=False)
                    else:
                        continue
                except ClientError as exc:  # no slot for it here
                    version = pointer[0] if pointer else None
                    unfit.append((Change(last_id, space, "deploy", version), exc.error))
                if slot is not None:
                    self.changes.moved(space, slot)
            self._take_secrets(pointers, every)
            store.slots.sync()
        self._take_accesses()
        rollouts.take(self)
        log.info("took the fleet's pointers for %d spaces, up to change %d", len(pointers), last_id)
        for change, error in unfit:
            self._skip(change, error)
        self._unskip(set(pointers) - {change.space for change, _ in unfit})
        self._applied(last_id, last.token if last is not None else None)

    def _take_accesses(self) -> None:
        """Make every deployed space's access the fleet's (after its pointers, each
        under the store lock of its own)."""
        fleet = self.db.accesses()
        for space in set(fleet) | set(access.listed(self.store.root)):
            wanted = fleet.get(space, Access())
            local = access.read(self.store.root, space) or Access()
            if local.to_json(local=False) != wanted.to_json(local=False):
                self.changes.access(space, _replaced(wanted))

    def _take_secrets(
        self,
        pointers: dict[str, tuple[int, dict[str, Any]] | None],
        every: dict[str, dict[str, dict[str, Any]]],
    ) -> None:
        """Under the store lock, each deployed space's secrets as the fleet has them (for
        this host's pool's spaces); a space whose secrets changed is released (a deleted
        one lost them with it)."""
        for space, pointer in pointers.items():
            if pointer is None:
                continue
            ours = pointer[1].get("pool", DEFAULT_POOL) == self.settings.pool
            found = every.get(space, {}) if ours else {}
            if self.store.secrets.read(space) == found:
                continue
            self.store.secrets.write(space, found)
            slot = self.store.slots.slot(space)
            if slot is not None:
                self.changes.broadcast.release(slot)

    def _applied(self, change_id: int, token: str | None) -> None:
        self.applied, self.token = change_id, token
        write_short(self.store.root / APPLIED, f"{change_id} {token}" if token else str(change_id))


def _here(store: Store, space: str, pointer: tuple[int, dict[str, Any]]) -> bool:
    """Whether this host's current version of `space` is the fleet's pointer already."""
    local = store.current(space)
    here = (pointer[0], pointer[1].get("sha256"))
    return local is not None and (local.number, local.sha256) == here


def _replaced(wanted: Access) -> Callable[[Access], Access]:
    """An edit that makes a space's access the fleet's, whatever it was here."""
    return lambda _before: Access(wanted.private, [dict(k) for k in wanted.keys])


def read_applied(path: Path) -> int:
    """The last change applied here (0: none)."""
    return read_mark(path)[0]


def read_mark(path: Path) -> tuple[int, str | None]:
    """(The last change applied here, its token: None when it had none)."""
    try:
        number, *token = read_short(path).split()
        return int(number), (token[0] if token else None)
    except (FileNotFoundError, ValueError):
        return 0, None
