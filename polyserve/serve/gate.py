"""The key check of a private space's requests, before they are counted or load anything.

Each worker keeps the access it read of each space (polyserve.state.access) with the
space's access word as it was then; a request compares the word and reads the file again
only when a change moved it (an access change, a deploy, a delete), so a public space's
request costs one dict lookup and one word compare (bench/NOTES.md, "The key check").
A private space's request sends `Authorization: Bearer <key>`: its sha256 finds the key
by digest, compared again with hmac.compare_digest, then the key's rate is checked. A
worker remembers the keys that passed since the space's access last changed, so a
key's next request skips the sha256: the worker sees each key in every request anyway,
and nothing of it is written anywhere (docs/private-spaces.md, "What it costs").

A key's rate is a token bucket in each worker: a key of rate r is let through at most r
requests a second per worker (a burst of max(r, 1)), so a host lets through up to r
times its workers; docs/private-spaces.md says so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import sha256
from hmac import compare_digest

from polyserve.state import access as access_mod
from polyserve.state.shm import Table
from polyserve.state.slots import NO_SLOT
from polyserve.state.store import Store

PUBLIC = -1  # what check() returns for a public space: no key cell to count


class Refused(Exception):
    """A request the gate answers itself: 401 (no key, or not one of the space's), or
    429 (past its key's rate)."""

    def __init__(self, status: int, body: dict[str, object], headers: dict[str, str]) -> None:
        super().__init__(body["error"])
        self.status = status
        self.body = body
        self.headers = headers


@dataclass(slots=True)
class _Key:
    id: str
    digest: bytes  # sha256 of the key, raw
    cell: int
    rate: float | None
    burst: float = 1.0  # the bucket's size: max(rate, 1)
    tokens: float = 0.0
    at: float = 0.0  # when `tokens` was last filled (monotonic s)


@dataclass(slots=True)
class _Seen:
    slot: int
    word: int  # the space's access word when the file was read
    keys: dict[bytes, _Key] | None  # by digest; None: public
    by_id: dict[str, _Key] = field(default_factory=dict)
    verified: dict[bytes, _Key] = field(default_factory=dict)  # keys sent that passed


class Gate:
    """One worker's access check: `check` before a request is metered."""

    def __init__(self, store: Store, table: Table, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.words = table.access
        self.clock = clock
        self._seen: dict[str, _Seen] = {}

    def check(self, space: str, headers: list[tuple[bytes, bytes]]) -> int:
        """PUBLIC, or the cell of the key the request sent; raises Refused."""
        seen = self._seen.get(space)
        if seen is None or seen.slot == NO_SLOT or self.words[seen.slot] != seen.word:
            seen = self._read(space, seen)
            if seen is None:
                return PUBLIC  # not deployed here: dispatch answers that
        if seen.keys is None:
            return PUBLIC
        return self._private(space, seen, headers)

    def _read(self, space: str, before: _Seen | None) -> _Seen | None:
        """The space's access as its file says now; None when it is not deployed. A
        space deployed with no slot here (a fleet host's, until its first load claims
        one) is read from its file at each request, as no word would say when the file
        changes; a private one's record is kept all the same, as NO_SLOT's, so its keys'
        buckets carry over from one read to the next (and to the slot it takes)."""
        slots = self.store.slots
        slots.refresh()  # a slot handed to another space since: this space has none
        slot = slots.slot(space)
        if slot is None and self.store.current(space) is None:
            self._seen.pop(space, None)
            return None
        # Read before the file: a change after the read moves the word again.
        word = self.words[slot] if slot is not None else 0
        found = access_mod.read(self.store.root, space)
        keys: dict[bytes, _Key] | None = None
        if found is not None and found.private:
            old = before.by_id if before is not None else {}
            now = self.clock()
            made = [_key(k, old.get(str(k.get("id"))), now) for k in found.keys]
            keys = {k.digest: k for k in made}
        by_id = {k.id: k for k in (keys or {}).values()}
        seen = _Seen(NO_SLOT if slot is None else slot, word, keys, by_id)
        if slot is not None or keys is not None:
            self._seen[space] = seen
        else:  # public with no slot: nothing to carry over
            self._seen.pop(space, None)
        return seen

    def _private(self, space: str, seen: _Seen, headers: list[tuple[bytes, bytes]]) -> int:
        sent = _bearer(headers)
        if sent is None:
            raise _unauthorized(
                space,
                f"space {space} is private: send `Authorization: Bearer <key>` with a key"
                f" its owner minted (POST /_polyserve/spaces/{space}/keys)",
            )
        match = seen.verified.get(sent)
        if match is None:
            # Found by its digest, then compared in constant time: what a lookup's timing
            # could tell is about the sha256 of the key sent, never about a key kept.
            digest = sha256(sent).digest()
            match = seen.keys.get(digest) if seen.keys is not None else None
            if match is None or not compare_digest(digest, match.digest):
                raise _unauthorized(
                    space,
                    f"the key sent is not one of space {space}'s keys (revoked, mistyped, or"
                    " another space's): send `Authorization: Bearer <key>` with one of its keys",
                )
            # The sha256 is most of the check's cost: a key that passed is found by
            # itself next time (at most MAX_KEYS of them, dropped with this record at
            # the next change of access, a revoke included).
            seen.verified[sent] = match
        rate = match.rate
        if rate:
            # The key's token bucket in this worker: a burst of max(rate, 1).
            now = self.clock()
            tokens = match.tokens + (now - match.at) * rate
            match.at = now
            if tokens >= 1.0:
                match.tokens = min(match.burst, tokens) - 1.0
                return match.cell
            match.tokens = tokens
            raise _limited(space, match)
        return match.cell


def _limited(space: str, key: _Key) -> Refused:
    """429, and when one token will be back."""
    rate = key.rate or 1.0
    wait = max(1, math.ceil((1.0 - key.tokens) / rate))
    error = (
        f"key {key.id} of space {space} is limited to {rate:g} requests per second"
        f" (per worker): retry after {wait} s, or ask the owner for a higher rate"
    )
    body: dict[str, object] = {"error": error, "space": space, "key": key.id, "rate": rate}
    return Refused(429, body, {"retry-after": str(wait)})


def _key(record: dict[str, object], old: _Key | None, now: float) -> _Key:
    rate = record.get("rate")
    key = _Key(
        id=str(record.get("id")),
        digest=bytes.fromhex(str(record.get("sha256"))),
        cell=int(str(record.get("cell", 0))),
        rate=float(rate) if isinstance(rate, int | float) else None,
    )
    key.burst = max(key.rate or 0.0, 1.0)
    if old is not None and old.digest == key.digest and old.rate == key.rate:
        key.tokens, key.at = old.tokens, old.at  # a re-read keeps what the key has spent
    else:
        key.tokens, key.at = key.burst, now
    return key


def _bearer(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    for name, value in headers:
        if name == b"authorization":
            if value[:7].lower() != b"bearer ":
                return None
            return value[7:].strip() or None
    return None


def _unauthorized(space: str, error: str) -> Refused:
    body: dict[str, object] = {"error": error, "space": space}
    return Refused(401, body, {"www-authenticate": f'Bearer realm="{space}"'})
