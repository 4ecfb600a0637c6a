"""The slot log: which space owns each slot of the shared table, across hand-overs.

`slots.log` in the data directory is append-only. A line `n<TAB>owner/name` gives a
space the next new slot; a line `n<TAB>owner/name<TAB>totals` hands slot n over from a
deleted space, with the slot's usage totals (meter.TOTALS, comma-separated) at that
moment: the old owner keeps what it used up to them, the new one counts from them.
Slot n of a fresh log is line n, so every process reads the same map.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from polyserve.errors import ClientError

# What a space deployed on a fleet host has for a slot until its first request there.
NO_SLOT = -1

# Given a deleted space's slot: its final usage totals, or None while it is in use.
Reclaim = Callable[[int], tuple[int, ...] | None]


@dataclass(frozen=True)
class Ledger:
    """The slot log read for billing. Totals are tuples in the order of meter.TOTALS."""

    names: list[str]  # the owner of each slot
    offsets: dict[int, tuple[int, ...]]  # slot -> added to its raw totals
    retired: dict[str, tuple[int, ...]]  # names that own no slot now -> their usage


class SlotLog:
    def __init__(self, path: Path, max_spaces: int) -> None:
        self.path = path
        self.max_spaces = max_spaces
        path.touch()
        self._slots: dict[str, int] = {}
        self._names: list[str] = []  # the owner of each slot
        self._base: dict[int, tuple[int, ...]] = {}  # a handed-over slot's totals then
        self._earlier: dict[str, tuple[int, ...]] = {}  # usage in slots a name lost
        self._read = 0  # bytes of the log already parsed
        self._lock = threading.Lock()  # the loop and the host's threads both refresh
        self._changes = 0  # lines parsed so far, which the cached ledger is checked by
        self._ledger: tuple[int, Ledger] | None = None

    def slot(self, space: str) -> int | None:
        """The space's slot, or None if it has none (never deployed, or deleted and its
        slot handed over)."""
        if space not in self._slots:
            self.refresh()
        return self._slots.get(space)

    def allocate(
        self,
        space: str,
        deleted: Callable[[str], bool],
        reclaim: Reclaim | None,
        sync: bool = True,
    ) -> int:
        """A new slot while the table has room; then the slot of a deleted space that no
        worker uses any more, whose usage stays readable by name (see ledger()). Hold
        the store lock."""
        self.refresh()
        slot, line = len(self._names), f"{len(self._names)}\t{space}\n"
        if slot >= self.max_spaces:
            for slot, owner in enumerate(self._names):
                final = reclaim(slot) if reclaim is not None and deleted(owner) else None
                if final is not None:
                    line = f"{slot}\t{space}\t{','.join(map(str, final))}\n"
                    break
            else:
                raise ClientError(
                    507,
                    f"space table is full ({self.max_spaces} slots, none of them a deleted"
                    " space's that is no longer in use): raise POLYSERVE_MAX_SPACES",
                    space=space,
                )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line.encode())
            if sync:  # billing rows are keyed by slot: the map must survive a crash
                os.fsync(fd)
        finally:
            os.close(fd)
        self.refresh()
        return slot

    def sync(self) -> None:
        """Make every allocation so far durable (after allocate(..., sync=False))."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def refresh(self) -> None:
        """Parse what was appended since the last read (complete lines only)."""
        with self._lock, open(self.path, "rb") as f:
            f.seek(self._read)
            tail = f.read()
            complete = tail[: tail.rfind(b"\n") + 1]
            for line in complete.decode().splitlines():
                number, space, *final = line.split("\t")
                slot = int(number)
                if slot == len(self._names) and not final:
                    self._names.append(space)
                elif slot < len(self._names) and final:
                    self._hand_over(slot, space, tuple(map(int, final[0].split(","))))
                else:
                    raise RuntimeError(f"{self.path} is corrupt at slot {number}")
                self._slots[space] = slot
                self._changes += 1
            self._read += len(complete)

    def _hand_over(self, slot: int, space: str, final: tuple[int, ...]) -> None:
        previous = self._names[slot]
        used = _minus(final, self._base.get(slot, (0,) * len(final)))
        self._earlier[previous] = _plus(self._earlier.get(previous, (0,) * len(final)), used)
        if self._slots.get(previous) == slot:
            del self._slots[previous]
        self._names[slot] = space
        self._base[slot] = final

    def ledger(self) -> Ledger:
        """Who owns each slot, and what to add to each slot's raw usage totals so that
        usage is per name across slot hand-overs.

        It is built again only after the log changed: every usage answer asks for it,
        and with many spaces building it was a large part of the answer. Callers share
        the one object and must not change it."""
        self.refresh()
        changes = self._changes
        if self._ledger is None or self._ledger[0] != changes:
            # Checked by the count read before building: a refresh on another thread
            # meanwhile leaves a stale ledger that the next call builds again.
            self._ledger = (changes, self._build_ledger())
        return self._ledger[1]

    def _build_ledger(self) -> Ledger:
        offsets = {}
        for slot, name in enumerate(self._names):
            earlier, base = self._earlier.get(name), self._base.get(slot)
            if earlier is not None or base is not None:
                width = len(earlier or base or ())
                offsets[slot] = _minus(earlier or (0,) * width, base or (0,) * width)
        owners = set(self._names)
        retired = {n: t for n, t in self._earlier.items() if n not in owners}
        return Ledger(list(self._names), offsets, retired)


# A log written before meter.TOTALS grew has shorter tuples: the missing totals are 0.
def _plus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip_longest(a, b, fillvalue=0))


def _minus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x - y for x, y in zip_longest(a, b, fillvalue=0))
