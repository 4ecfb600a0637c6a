"""A rollout's choice on the request path: which version serves a plain request.

While a space's rollout runs, its word in the table (polyserve.state.rollouts) holds the
new version and its percent. A request whose client sends the rollout's sticky header
goes by a hash of that header's value, so one client keeps one version at a step (and,
as the percent only grows, keeps the new one once it has it); any other request by a
random draw.
"""

from __future__ import annotations

import random
import zlib

from polyserve.state import rollouts
from polyserve.state.shm import Table
from polyserve.state.store import Store


class Split:
    """One worker's reader of the rollout words, with each live rollout's sticky header."""

    def __init__(self, store: Store, table: Table) -> None:
        self.store = store
        self.words = table.rollouts
        self._headers: dict[int, tuple[int, bytes | None]] = {}  # slot -> (word, header)
        self._draw = random.Random()

    def new_version(self, slot: int) -> int:
        """The new version of the slot's live rollout (0: none), as word() packs it."""
        return (self.words[slot] >> 8) & 0xFFFFFFFF

    def choose(self, slot: int, space: str, headers: list[tuple[bytes, bytes]]) -> int:
        """The version number a rollout sends this request to, or 0: the current one."""
        found = self.words[slot]
        if not found:
            return 0
        version, percent = (found >> 8) & 0xFFFFFFFF, found & 0xFF
        known = self._headers.get(slot)
        if known is None or known[0] != found:
            # Read once per step: the word moves at each one.
            state = rollouts.read(self.store.root, space) or {}
            name = state.get("sticky_header")
            known = (found, name.encode() if isinstance(name, str) else None)
            self._headers[slot] = known
        sticky = known[1]
        if sticky is not None:
            for key, value in headers:
                if key == sticky:
                    return version if zlib.crc32(value) % 100 < percent else 0
        return version if self._draw.random() * 100 < percent else 0
