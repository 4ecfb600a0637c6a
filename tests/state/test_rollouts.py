"""A rollout's request body, its step's decision and its base, without a host."""

from __future__ import annotations

import pytest

from polyserve.errors import ClientError
from polyserve.state import rollouts
from polyserve.state.shm import Table
from polyserve.state.store import Store
from polyserve.usage.meter import CELLS, Cell


def test_a_body_gets_the_defaults_and_a_lowercased_sticky_header():
    asked = rollouts.parse(b'{"version": 3, "sticky_header": "X-User"}')
    assert asked == {
        "version": 3,
        "steps": [5, 25, 50, 100],
        "step_s": 60.0,
        "max_error_rate": 0.05,
        "sticky_header": "x-user",
    }


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[]",
        b'{"version": true}',
        b'{"version": 2, "steps": []}',
        b'{"version": 2, "steps": [50, 50, 100]}',
        b'{"version": 2, "steps": [0, 100]}',
        b'{"version": 2, "step_s": -1}',
        b'{"version": 2, "max_error_rate": "x"}',
        b'{"version": 2, "sticky_header": "a b"}',
    ],
)
def test_a_bad_body_is_a_422_that_says_what_to_send(body):
    with pytest.raises(ClientError) as refused:
        rollouts.parse(body)
    assert refused.value.status == 422


def state(**kw: object) -> dict:
    base = {"version": 2, "old": 1, "step": 0, "steps": [50, 100], "weight": 50}
    return {**base, "max_error_rate": 0.05, "history": [], **kw}


def counts(new: tuple[int, int], old: tuple[int, int]) -> dict:
    def one(r: int, e: int) -> dict:
        return {"requests": r, "errors": e, "error_rate": round(e / r, 4) if r else 0.0}

    return {"new": one(*new), "old": one(*old)}


def test_past_the_old_rate_plus_the_threshold_it_rolls_back_with_the_figures():
    s = state()
    assert rollouts.decide(s, counts((50, 10), (50, 1)), 10.0) == "rolled_back"
    assert s["reason"].startswith("step 1 (50%): version 2 failed 10 of 50 requests (20.0%)")
    assert s["history"][0]["new"]["errors"] == 10


def test_within_the_threshold_it_goes_on_and_at_100_it_completes():
    s = state(steps=[10, 50, 100], weight=10)
    # 6% against 2%: 4 points more, within 0.05.
    assert rollouts.decide(s, counts((50, 3), (50, 1)), 1.0) == "next"
    assert (s["step"], s["weight"], s["step_started_at"]) == (1, 50, 1.0)
    assert rollouts.decide(s, counts((0, 0), (9, 9)), 2.0) == "completed"
    assert s["reason"] == "version 2 is current"
    assert [h["weight"] for h in s["history"]] == [10, 50]


def test_a_slot_taken_during_a_rollout_counts_its_step_from_the_slot_then(tmp_path):
    """A fleet host's space with no slot here when its rollout arrived (base 0) takes
    a slot that another space used: the step counts from the slot's counts then, so the
    other space's requests are not the rollout's, and the rollout's word is set."""
    store, table = Store(tmp_path, 4, lazy_slots=True), Table.anonymous(1, 4, CELLS)
    table.cell_array()[0, 2, Cell.REQUESTS] = 40  # the slot's previous owner's
    table.cell_array()[0, 2, Cell.ERRORS] = 3
    live = {**state(space="o/s", status="running", started_at=1.0), "base": [0, 0, 0, 0]}
    rollouts.write(store.root, live)
    rollouts.claimed(store, table, "o/s", 2)
    after = rollouts.read(store.root, "o/s")
    assert after is not None and after["base"] == [40, 3, 0, 0]
    assert rollouts.step_counts(table, 2, after)["old"]["requests"] == 0
    assert table.rollouts[2] == rollouts.word_of(after) != 0


def test_a_move_of_current_ends_a_live_rollout_by_where_it_goes():
    """To the old version: it goes on; elsewhere or a delete: aborted; to its new version
    by hand: completed, except in a fleet host's copy, which the fleet's row ends."""
    state = rollouts.started("o/s", rollouts.parse(b'{"version": 3}'), 2)
    assert rollouts.interrupted(state, 2) is None
    assert rollouts.interrupted(state, 4) == ("aborted", "version 4 was made current meanwhile")
    assert rollouts.interrupted(state, None) == ("aborted", "the space was deleted")
    assert rollouts.interrupted(state, 3) == ("completed", "version 3 was made current by hand")
    assert rollouts.interrupted(state, 3, own=False) is None
    assert rollouts.interrupted(state, 4, own=False) == rollouts.interrupted(state, 4)
    rollouts.over(state, "aborted", "aborted on request", 0.0)
    assert rollouts.interrupted(state, 3) is None  # over already
