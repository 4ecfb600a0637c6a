"""The one step that changes what a space serves, for a local deploy and the fleet's follower.

Under the store lock the step moves `current` (a publish, a rollback, a pointer from the
fleet, a delete), bumps the space's generation word and prunes what no worker holds;
then `announce` signals the other workers. Every request reads the generation word, so
once a change returns, no worker starts a request on an older version: the signal only
makes workers act before their next request.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from polyserve.state import access as access_mod
from polyserve.state import rollouts
from polyserve.state.access import Access
from polyserve.state.broadcast import Broadcast
from polyserve.state.slots import NO_SLOT
from polyserve.state.store import Staged, Store
from polyserve.usage import meter


class Changes:
    """One process's way to change a space: the store, the table's words and the signal."""

    def __init__(
        self,
        store: Store,
        broadcast: Broadcast,
        refresh: Callable[[], None] = lambda: None,
        fleet: bool = False,
    ) -> None:
        self.store = store
        self.broadcast = broadcast
        self.refresh = refresh  # this worker's own swap, which no signal reaches
        # A fleet host's rollouts are the fleet's rows: a move to a rollout's new version
        # is ended by the row's change that follows it (rollouts.interrupted's own).
        self.fleet = fleet
        # A deleted space's slot is handed over once its cells are reclaimable.
        self.reclaim = partial(meter.reclaimable, broadcast.table)

    def apply(self, space: str, move: Callable[[], int | None]) -> int | None:
        """Under the store lock, `move` moves the space's `current` and returns its slot
        (None: nothing moved); then the bump and the prune. Returns what `move` did."""
        with self.store.locked():
            slot = move()
            if slot is not None:
                self.moved(space, slot)
        return slot

    def moved(self, space: str, slot: int, completing: bool = False) -> None:
        """After `current` moved, the lock still held: bump the space's generation, so
        every worker's next request sees the change, and prune what no worker holds
        (after the bump, so what a worker holds stays). The access word moves too: a
        slot handed to another space, or a space deleted, has other access now. A live
        rollout this move ends is ended first: its word cleared before the bump, its
        pins before the prune (`completing`: the move is the rollout's own completion,
        which its driver ends). A space with no slot here (NO_SLOT) has no worker holding
        it: nothing to bump."""
        if not completing:
            table, own = self.broadcast.table, not self.fleet
            rollouts.interrupt(self.store, table, space, None if slot == NO_SLOT else slot, own)
        if slot == NO_SLOT:
            self.store.prune(space, None)
            return
        self.broadcast.bump(slot)
        self.broadcast.bump_access(slot)
        self.store.prune(space, self.broadcast.oldest_held(slot))

    def claim(self, space: str, then: Callable[[int], None] = lambda _slot: None) -> int | None:
        """The space's slot, taken now if it has none here (a lazy_slots fleet host, on
        the space's first request); None when it is not deployed. Under the store lock,
        as every move of `current` is: a change after this bumps the slot, one before it
        is what the load that follows finds current. Raises ClientError 507 when the
        table is full and no slot can be handed over. `then` is told a slot just taken,
        the lock still held."""
        with self.store.locked():
            if self.store.current(space) is None:
                return None
            slot = self.store.slots.slot(space)
            if slot is None:
                slot = self.store.claim_slot(space, self.reclaim)
                # Handed over from a space that no worker holds: whoever cached it as
                # that space's looks again, and its rollout's word is not this space's.
                self.broadcast.table.rollouts[slot] = 0
                self.moved(space, slot)
                then(slot)
        return slot

    def publish(
        self,
        space: str,
        staged: Staged,
        meta: dict[str, object],
        number: int | None = None,
        current: bool = True,
    ) -> int:
        """Make a validated stage the space's current version (current=False: a kept
        version beside it, nothing bumped); returns its number (the space's next one, or
        the one a fleet gave it)."""
        with self.store.locked():
            slot, number = self.store.publish(
                space, staged, meta, self.reclaim, number, current=current
            )
            if current:
                self.moved(space, slot)
        return number

    def delete(self, space: str) -> bool:
        """Undeploy; False when the space is not deployed."""
        return self.apply(space, partial(self.store.delete, space)) is not None

    def rollback(self, space: str, asked: int | None) -> tuple[int, int, dict[str, object]]:
        """Make a kept version current again: (the version made current, the one before,
        its metadata)."""
        with self.store.locked():
            slot, number, previous, meta = self.store.reactivate(space, asked)
            self.moved(space, slot)
        return number, previous, meta

    def release(self, space: str) -> bool:
        """Tell every worker to drop its copy, so the next request imports the space
        afresh; False when the space is not deployed."""
        with self.store.locked():
            slot = self.store.slots.slot(space)
            current = self.store.current(space)
            if current is None:
                return False
            if slot is not None:  # none here: no worker holds it, none to tell
                self.broadcast.release(slot)
            self.store.history.record(space, "release", current.number, current.number)
        return True

    def access(self, space: str, edit: Callable[[Access], Access]) -> Access | None:
        """Under the store lock, replace the space's access by `edit` of it and bump its
        access word: every worker's next request of the space checks the new access.
        None when the space is not deployed. A key new here gets its cell's count now as
        its base, so its usage starts from zero (a revoked key may have had the cell)."""
        with self.store.locked():
            slot = self.store.slots.slot(space)
            if self.store.current(space) is None:
                return None
            root = self.store.root
            before = access_mod.read(root, space) or Access()
            after = edit(before)
            # The bases are this host's: kept for the keys it knew, taken for new ones.
            bases = {(k.get("id"), k.get("cell")): k.get("base") for k in before.keys}
            ledger = self.store.slots.ledger()
            counts = meter.key_counts(self.broadcast.table, ledger, slot, space)
            for key in after.keys:
                base = bases.get((key.get("id"), key.get("cell")))
                key["base"] = counts[int(key.get("cell", 0))] if base is None else base
            access_mod.write(root, space, after)
            if slot is not None:  # none here: its first request reads the file
                self.broadcast.bump_access(slot)
        return after

    def secrets(self, space: str, write: Callable[[], None]) -> bool:
        """Change a deployed space's secrets: under the store lock `write` writes its
        file, then the space is released, so every worker's next request imports it
        afresh with the new values (a load reads the file once). False when the space is
        not deployed (nothing written). Announce after it, as after a release."""
        with self.store.locked():
            slot = self.store.slots.slot(space)
            if self.store.current(space) is None:
                return False
            write()
            # Not recorded in the history: it tells what each version served, and a
            # secret's change moves no version. No slot here: no worker holds it.
            if slot is not None:
                self.broadcast.release(slot)
        return True

    def announce(self) -> int:
        """After changes: signal the other workers, and refresh this one. Returns how
        many were signalled."""
        signalled = self.broadcast.announce()
        self.refresh()
        return signalled
