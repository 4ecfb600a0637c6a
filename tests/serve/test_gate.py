"""The key check alone (polyserve/serve/gate.py), on a real store and an anonymous table,
with an injected clock: what it lets through, refuses, and when it reads access again."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from polyserve.serve.gate import PUBLIC, Gate, Refused
from polyserve.state import access
from polyserve.state.apply import Changes
from polyserve.state.broadcast import Broadcast
from polyserve.state.shm import Table
from polyserve.state.slots import NO_SLOT
from polyserve.state.store import Store
from polyserve.usage.meter import CELLS
from tests.helpers import make_tar


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def world(tmp_path: Path) -> tuple[Store, Table, Gate, Clock]:
    store, table, clock = Store(tmp_path, 4, 3), Table.anonymous(1, 4, CELLS), Clock()
    with store.locked():
        store.slots.allocate("o/s", lambda _: False, None, sync=False)
    return store, table, Gate(store, table, clock), clock


def headers(key: str | None) -> list[tuple[bytes, bytes]]:
    found = [(b"host", b"h")]
    return found if key is None else [*found, (b"authorization", f"Bearer {key}".encode())]


def change(store: Store, table: Table, state: access.Access) -> None:
    """What Changes.access does: the file, then the access word."""
    access.write(store.root, "o/s", state)
    table.access[store.slots.slot("o/s") or 0] += 1


def test_public_until_the_word_moves(world) -> None:
    """A file written without bumping the word is not read: the word is what moves it."""
    store, table, gate, _ = world
    assert gate.check("o/s", headers(None)) == PUBLIC
    access.write(store.root, "o/s", access.Access(private=True))
    assert gate.check("o/s", headers(None)) == PUBLIC
    table.access[store.slots.slot("o/s") or 0] += 1
    with pytest.raises(Refused) as refused:
        gate.check("o/s", headers(None))
    assert refused.value.status == 401 and "Bearer" in str(refused.value.body["error"])


def test_keys_pass_until_revoked(world) -> None:
    store, table, gate, _ = world
    state, first = access.mint(access.Access(private=True), "o/s", None)
    state, second = access.mint(state, "o/s", None)
    change(store, table, state)
    assert gate.check("o/s", headers(str(first["key"]))) == 0
    assert gate.check("o/s", headers(str(second["key"]))) == 1
    assert gate.check("o/s", headers(str(second["key"]))) == 1  # remembered: the same
    change(store, table, access.revoke(state, "o/s", str(second["id"])))
    with pytest.raises(Refused) as refused:
        gate.check("o/s", headers(str(second["key"])))
    assert refused.value.status == 401 and "not one of" in str(refused.value.body["error"])
    assert gate.check("o/s", headers(str(first["key"]))) == 0
    for wrong in ("Basic abc", "Bearer ", "bearer nope"):
        with pytest.raises(Refused):
            gate.check("o/s", [(b"authorization", wrong.encode())])


def test_a_rate_refills_with_the_clock(world) -> None:
    """Rate 2: a burst of 2, then 429 with Retry-After; half a second gives one more."""
    store, table, gate, clock = world
    state, minted = access.mint(access.Access(private=True), "o/s", 2.0)
    change(store, table, state)
    key = headers(str(minted["key"]))
    assert gate.check("o/s", key) == 0
    assert gate.check("o/s", key) == 0
    with pytest.raises(Refused) as refused:
        gate.check("o/s", key)
    assert refused.value.status == 429 and refused.value.headers == {"retry-after": "1"}
    clock.now += 0.5
    assert gate.check("o/s", key) == 0
    with pytest.raises(Refused):
        gate.check("o/s", key)
    # Another change of access keeps what the key has spent in this worker.
    change(store, table, access.set_private(state, True))
    with pytest.raises(Refused):
        gate.check("o/s", key)


def test_a_space_without_a_slot_is_not_kept(world) -> None:
    _, _, gate, _ = world
    assert gate.check("never/deployed", headers(None)) == PUBLIC
    assert "never/deployed" not in gate._seen


def test_a_space_with_no_slot_here_is_checked_from_its_file(tmp_path: Path) -> None:
    """A fleet host's space deployed with no slot here yet (lazy_slots): Changes.access
    writes its file with no word to move, and the gate reads it at each request, so a
    private space is refused from its first request and a revoke is in force at once."""
    store, table = Store(tmp_path, 4, 3, lazy_slots=True), Table.anonymous(1, 4, CELLS)
    changes = Changes(store, Broadcast(table, 0))
    staged = store.stage(io.BytesIO(make_tar({"main.py": ""})), "s.tar", 1 << 20)
    with store.locked():
        assert store.publish("o/t", staged, {})[0] == NO_SLOT
    gate = Gate(store, table, Clock())
    assert gate.check("o/t", headers(None)) == PUBLIC
    state, minted = access.mint(access.Access(private=True), "o/t", None)
    assert changes.access("o/t", lambda _before: state) is not None
    with pytest.raises(Refused):
        gate.check("o/t", headers(None))
    assert gate.check("o/t", headers(str(minted["key"]))) == 0
    changes.access("o/t", lambda before: access.revoke(before, "o/t", str(minted["id"])))
    with pytest.raises(Refused):
        gate.check("o/t", headers(str(minted["key"])))
    assert store.slots.slot("o/t") is None  # none of this took a slot


def test_a_keys_rate_holds_for_a_space_with_no_slot_here(tmp_path: Path) -> None:
    """A lazy-slot host's private space with no slot yet (its first load has not taken
    one, or the table is full) is read from its file at each request, and its keys'
    buckets carry over from read to read: the rate holds, and still holds once a slot
    is taken."""
    store, table = Store(tmp_path, 4, 3, lazy_slots=True), Table.anonymous(1, 4, CELLS)
    changes, clock = Changes(store, Broadcast(table, 0)), Clock()
    staged = store.stage(io.BytesIO(make_tar({"main.py": ""})), "s.tar", 1 << 20)
    with store.locked():
        assert store.publish("o/t", staged, {})[0] == NO_SLOT
    state, minted = access.mint(access.Access(private=True), "o/t", 2.0)
    assert changes.access("o/t", lambda _before: state) is not None
    gate, key = Gate(store, table, clock), headers(str(minted["key"]))
    assert gate.check("o/t", key) == 0
    assert gate.check("o/t", key) == 0
    with pytest.raises(Refused) as refused:
        gate.check("o/t", key)
    assert refused.value.status == 429
    assert store.slots.slot("o/t") is None  # still none: each check read the file
    assert changes.claim("o/t") is not None  # its first load takes one
    with pytest.raises(Refused):
        gate.check("o/t", key)  # what it spent is still spent
    clock.now += 0.5
    assert gate.check("o/t", key) == 0
