"""A space's weighted rollout: its state file, its word in the table, and its steps.

A rollout moves a space's plain requests from its current version to a kept one (deployed
with current=false) by steps of percent (docs/rollouts.md). Its state is one JSON file in
the data directory (`rollouts/<owner>+<name>.json`), so it survives a restart; while it
runs, the space's word in the table says the new version and its percent, which every
worker reads on the request path (polyserve/serve/split.py). The master's rollout thread
(`Driver`) is the one writer that moves the steps: at each step's end it compares the two
versions' error rates over the step, from the lane cells (polyserve.usage.meter), and
either rolls back by itself, takes the next step, or makes the new version current.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyserve.errors import ClientError, json_fields
from polyserve.state.files import write_atomic
from polyserve.state.shm import H_STARTED, Table
from polyserve.state.store import Store
from polyserve.usage import meter

if TYPE_CHECKING:
    from polyserve.state.apply import Changes  # which calls interrupt() at each move

log = logging.getLogger("polyserve")
DIR = "rollouts"
TICK_S = 0.1  # how often the driver looks: a step ends at most this late
LIVE = ("running", "paused")  # the statuses in which the rollout's word is set
MAX_STEP_S = 7 * 86400.0
_HEADER = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]{1,64}")
EXPECTED = (
    '{"version": N, "steps": [5, 25, 50, 100], "step_s": 60, "max_error_rate": 0.05,'
    ' "sticky_header": "x-user" (optional)}'
)


def path(root: Path, space: str) -> Path:
    owner, name = space.split("/")
    return root / DIR / f"{owner}+{name}.json"


def read(root: Path, space: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads(path(root, space).read_bytes())
    except FileNotFoundError:
        return None
    return found


def write(root: Path, state: dict[str, Any]) -> None:
    target = path(root, str(state["space"]))
    target.parent.mkdir(exist_ok=True)
    write_atomic(target, json.dumps(state).encode(), fsync=True)


def live(root: Path) -> dict[str, dict[str, Any]]:
    """Every running or paused rollout, by space: what the spaces list shows of it."""
    found: dict[str, dict[str, Any]] = {}
    try:
        names = list((root / DIR).iterdir())
    except FileNotFoundError:
        return found
    for p in names:
        try:
            state = json.loads(p.read_bytes())
        except (FileNotFoundError, ValueError):
            continue
        if state.get("status") in LIVE:
            keys = ("version", "old", "status", "step", "steps", "weight")
            found[str(state["space"])] = {k: state[k] for k in keys}
    return found


def word(version: int, percent: int, tag: int = 0) -> int:
    """The table's word of a live rollout: its new version and its percent (0: none),
    and a tag of the rollout (from its start), so a worker that cached the sticky header
    of an earlier rollout of the same version and percent reads the file again."""
    return (tag & 0xFFFF) << 40 | version << 8 | percent


def word_of(state: dict[str, Any]) -> int:
    """A live state's word (word())."""
    tag = int(float(state["started_at"]) * 1000)
    return word(int(state["version"]), int(state["weight"]), tag)


def counts(table: Table, slot: int) -> list[int]:
    """The slot's requests and errors, and its lane's (the new version's), every row."""
    cells = table.cell_array()[:, slot]
    picked = (meter.Cell.REQUESTS, meter.Cell.ERRORS, meter.LANE_REQUESTS, meter.LANE_ERRORS)
    return [int(cells[:, c].sum()) for c in picked]


def parse(body: bytes) -> dict[str, Any]:
    """A rollout's request body, checked; raises ClientError 422 saying what to send."""
    fields = {"version", "steps", "step_s", "max_error_rate", "sticky_header"}
    found = json_fields(body, fields, f"send {EXPECTED}")
    asked: dict[str, Any] = {} if found is None else dict(found)
    version = asked.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ClientError(
            422, "`version` must be a kept version's number (deploy it with current=false)"
        )
    steps = asked.get("steps", [5, 25, 50, 100])
    if (
        not isinstance(steps, list)
        or not steps
        or len(steps) > 100
        or not all(_whole(p) and 1 <= p <= 100 for p in steps)
        or any(a >= b for a, b in itertools.pairwise(steps))
        or steps[-1] != 100
    ):
        raise ClientError(
            422, "`steps` must be percents from 1 to 100, rising, ending with 100: [5, 25, 50, 100]"
        )
    step_s = asked.get("step_s", 60)
    if not _number(step_s) or not 0 < step_s <= MAX_STEP_S:
        raise ClientError(422, f"`step_s` must be seconds, more than 0 and at most {MAX_STEP_S:g}")
    rate = asked.get("max_error_rate", 0.05)
    if not _number(rate) or not 0 <= rate <= 1:
        raise ClientError(422, "`max_error_rate` must be a fraction from 0 to 1, e.g. 0.05")
    header = asked.get("sticky_header")
    if header is not None and (
        not isinstance(header, str) or not _HEADER.fullmatch(header.lower())
    ):
        raise ClientError(422, "`sticky_header` must be a header's name, e.g. x-user")
    return {
        "version": version,
        "steps": steps,
        "step_s": float(step_s),
        "max_error_rate": float(rate),
        "sticky_header": header.lower() if header else None,
    }


def _whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def start(store: Store, table: Table, space: str, asked: dict[str, Any]) -> dict[str, Any]:
    """Start a rollout of kept version asked["version"] (parse()'s); returns its state.
    ClientError 404 (not deployed, not kept), 409 (one runs already, or it is current)."""
    with store.locked():
        current = store.current(space)
        slot = store.slots.slot(space)
        if current is None or slot is None:
            raise ClientError(404, f"space {space} is not deployed", space=space)
        earlier = read(store.root, space)
        if earlier is not None and earlier["status"] in LIVE:
            raise ClientError(
                409,
                f"space {space} has a rollout of version {earlier['version']} {earlier['status']}:"
                " abort it first (POST …/rollout/abort)",
                space=space,
            )
        new = int(asked["version"])
        if new == current.number:
            raise ClientError(409, f"version {new} of {space} is current already", space=space)
        store.pin(space, new)  # 404 when it is not kept, with the kept ones
        store.pin(space, current.number)
        state = started(space, asked, current.number)
        state |= {"boot": table.header(H_STARTED), "base": counts(table, slot)}
        write(store.root, state)
        table.rollouts[slot] = word_of(state)
    return view(store, table, state)


def started(space: str, asked: dict[str, Any], old: int) -> dict[str, Any]:
    """The state of a rollout that starts now: `asked` is its checked body (parse())."""
    now = time.time()
    return {
        "space": space,
        **asked,
        "old": old,
        "status": "running",
        "step": 0,
        "weight": asked["steps"][0],
        "reason": None,
        "started_at": now,
        "step_started_at": now,
        "ended_at": None,
        "history": [],
    }


def act(store: Store, table: Table, space: str, action: str) -> dict[str, Any]:
    """pause, resume or abort the space's rollout; ClientError 404 (none) or 409 (over)."""
    with store.locked():
        state = read(store.root, space)
        if state is None:
            raise ClientError(404, f"space {space} has no rollout", space=space)
        status = state["status"]
        if status not in LIVE:
            raise ClientError(409, f"the rollout of {space} is over ({status})", space=space)
        now = time.time()
        if action == "pause" and status == "running":
            state["status"] = "paused"
            state["paused_left_s"] = max(state["step_s"] - (now - state["step_started_at"]), 0.0)
        elif action == "resume" and status == "paused":
            state["status"] = "running"
            left = float(state.pop("paused_left_s", state["step_s"]))
            state["step_started_at"] = now - (state["step_s"] - left)
        elif action == "abort":
            _end(store, table, state, "aborted", "aborted on request", now)
        write(store.root, state)
    return view(store, table, state)


def view(
    store: Store,
    table: Table,
    state: dict[str, Any] | None = None,
    space: str = "",
    others: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The rollout as GET …/rollout answers it: its state, the weights, and the requests
    and errors of each version (its steps' and, while it runs, the current step's: this
    host's, plus `others`, a fleet's other hosts' in step_counts' shape)."""
    if state is None:
        state = read(store.root, space)
        if state is None:
            raise ClientError(404, f"space {space} has no rollout", space=space)
    new, old = int(state["version"]), int(state["old"])
    steps = list(state["history"])
    slot = store.slots.slot(str(state["space"]))
    if state["status"] in LIVE and slot is not None and state["boot"] == table.header(H_STARTED):
        steps.append(step_counts(table, slot, state))
    if state["status"] in LIVE and others is not None:
        steps.append(others)
    totals = {new: [0, 0], old: [0, 0]}
    for step in steps:
        for v, key in ((new, "new"), (old, "old")):
            totals[v][0] += step[key]["requests"]
            totals[v][1] += step[key]["errors"]
    out = {k: v for k, v in state.items() if k not in ("base", "boot")}
    out["weights"] = {str(old): 100 - state["weight"], str(new): state["weight"]}
    out["versions"] = {str(v): {"requests": r, "errors": e} for v, (r, e) in totals.items()}
    return out


def step_counts(table: Table, slot: int, state: dict[str, Any]) -> dict[str, Any]:
    """The step so far: each version's requests, errors and error rate since its base."""
    req, err, lane_req, lane_err = (
        a - b for a, b in zip(counts(table, slot), state["base"], strict=True)
    )
    found = {}
    for key, (r, e) in (("new", (lane_req, lane_err)), ("old", (req - lane_req, err - lane_err))):
        found[key] = {"requests": r, "errors": e, "error_rate": round(e / r, 4) if r else 0.0}
    return found


def claimed(store: Store, table: Table, space: str, slot: int) -> None:
    """A space took a slot on this host (its first request here, on a fleet host): a
    live rollout of it counts its step from the slot's counts now, which may be those of
    the space that had the slot before, and its word is set at once. Hold the store lock."""
    state = read(store.root, space)
    if state is None or state["status"] not in LIVE:
        return
    state["base"] = counts(table, slot)
    write(store.root, state)
    table.rollouts[slot] = word_of(state)


def interrupted(
    state: dict[str, Any], current: int | None, own: bool = True
) -> tuple[str, str] | None:
    """How `current` moving to `current` (None: the space deleted) ends this rollout, as
    (its status, its reason), or None when it does not. A move to its old version (a
    slot's claim moves nothing) leaves it live; a move elsewhere aborts it. A move to its
    new version made by hand (a rollback) completes it: that version stays current and
    the rollout, with nothing left to do, never rolls back later. The rollout's own
    completion moves `current` there too, and ends it itself (Changes.moved is told).
    own=False, a fleet host's copy, leaves that move to the fleet's row: its rollout
    change, right after the move's, ends this copy, by hand or by its completion."""
    if state["status"] not in LIVE or current == state["old"]:
        return None
    if current is None:
        return "aborted", "the space was deleted"
    if current != state["version"]:
        return "aborted", f"version {current} was made current meanwhile"
    if not own:
        return None  # every request gets the new version already: the split is moot
    return "completed", f"version {current} was made current by hand"


def interrupt(store: Store, table: Table, space: str, slot: int | None, own: bool = True) -> None:
    """After a deploy, rollback or delete moved `current` (the store lock held, before
    the bump): the space's live rollout ends now if that move ends it, so no request
    after the move's answer goes to the rollout's new version. `slot` is None when the
    space has none on this host; `own` as interrupted() takes it."""
    state = read(store.root, space)
    current = store.current(space)
    number = None if current is None else current.number
    ended = None if state is None else interrupted(state, number, own)
    if state is not None and ended is not None:
        _end(store, table, state, *ended, time.time(), slot)
        write(store.root, state)
        log.info("%s: its rollout ended (%s): %s", space, *ended)


def over(state: dict[str, Any], status: str, reason: str, now: float) -> None:
    """Mark a state ended (a file's or a fleet row's)."""
    state.update(
        status=status, reason=reason, ended_at=now, weight=100 if status == "completed" else 0
    )
    state.pop("paused_left_s", None)


def _end(
    store: Store,
    table: Table,
    state: dict[str, Any],
    status: str,
    reason: str,
    now: float,
    slot: int | None = None,
) -> None:
    """The rollout is over: its word cleared, its pins let go. Hold the store lock.
    `slot`: the space's, when a delete may have let it go."""
    over(state, status, reason, now)
    if slot is None:
        slot = store.slots.slot(str(state["space"]))
    if slot is not None:
        table.rollouts[slot] = 0
    space = str(state["space"])
    if store.current(space) is not None:
        for v in {int(state["version"]), int(state["old"])}:
            store.unpin(space, v)


class Driver:
    """The master's rollout thread: the one process that moves every rollout's steps."""

    def __init__(self, store: Store, table: Table, changes: Changes | None = None) -> None:
        self.store = store
        self.table = table
        self.changes = changes  # None: a fleet host follows the state; it decides nothing
        # The master forks workers at any time: a fork while this thread holds the store
        # lock would leave the child a copy of the locked file, holding it for its life.
        self.forking = threading.Lock()

    def run(self, stop: threading.Event) -> None:
        """The thread's loop (in the master: no fork happens while a step holds the lock)."""
        os.register_at_fork(
            before=self.forking.acquire,
            after_in_parent=self.forking.release,
            after_in_child=self.forking.release,
        )
        while not stop.wait(TICK_S):
            try:
                self.tick()
            except Exception:  # a full disk must not end the thread: try again next time
                log.exception("rollout step failed")

    def tick(self) -> None:
        try:
            names = [p for p in (self.store.root / DIR).iterdir() if p.suffix == ".json"]
        except FileNotFoundError:
            return
        for p in names:
            try:
                state = json.loads(p.read_bytes())
            except (FileNotFoundError, ValueError):
                continue  # removed meanwhile, or not ours
            if state["status"] in LIVE:
                self.look(state)

    def look(self, state: dict[str, Any]) -> None:
        """One live rollout: its word set, its step moved if it ended (on a fleet host,
        the follower moves the steps: this thread keeps the words and the bases)."""
        space = str(state["space"])
        slot = self.store.slots.slot(space)
        now = time.time()
        due = state["status"] == "running" and now - state["step_started_at"] >= state["step_s"]
        due = due and self.changes is not None
        restarted = state.get("boot") != self.table.header(H_STARTED)
        if slot is not None and not (due or restarted):
            if self.table.rollouts[slot] != word_of(state):  # a slot new here, say
                # Under the lock, from the file again: an abort since this tick read it
                # clears the word, and a word written from the older read would outlive it.
                with self.forking, self.store.locked():
                    found = read(self.store.root, space)
                    if found is not None and found["status"] in LIVE:
                        self.table.rollouts[slot] = word_of(found)
            return
        announce = False
        with self.forking, self.store.locked():
            state = read(self.store.root, space) or state  # a pause or abort meanwhile
            if state["status"] not in LIVE:
                return
            current = self.store.current(space)
            if restarted and slot is not None:
                # The lane cells are this boot's: the step's counts start again here.
                state.update(boot=self.table.header(H_STARTED), base=counts(self.table, slot))
                if self.changes is not None:  # a fleet's step has the fleet's clock
                    state["step_started_at"] = now
                log.info("%s: its rollout continues at step %d", space, state["step"] + 1)
            elif self.changes is None:
                return
            elif slot is None or current is None:
                _end(self.store, self.table, state, "aborted", "the space was deleted", now)
            elif current.number != state["old"]:
                why = f"version {current.number} was made current meanwhile"
                _end(self.store, self.table, state, "aborted", why, now)
            else:
                announce = self._judge(state, slot, now)
            write(self.store.root, state)
            if state["status"] in LIVE and slot is not None:
                self.table.rollouts[slot] = word_of(state)
        if announce and self.changes is not None:
            self.changes.announce()

    def _judge(self, state: dict[str, Any], slot: int, now: float) -> bool:
        """The step ended: roll back, take the next step, or make the new version
        current. Hold the store lock; returns whether current moved."""
        assert self.changes is not None
        outcome = decide(state, step_counts(self.table, slot, state), now)
        space, version = str(state["space"]), int(state["version"])
        if outcome == "rolled_back":
            _end(self.store, self.table, state, "rolled_back", str(state["reason"]), now)
            log.warning("%s: rollout rolled back: %s", space, state["reason"])
            return False
        state["base"] = counts(self.table, slot)
        if outcome == "next":
            return False
        # The last step: the new version becomes current as a rollback moves it (bump,
        # prune, announce), so the deploy contract holds for whoever asks next.
        moved = self.store.reactivate(space, version)[0]
        self.changes.moved(space, moved, completing=True)
        _end(self.store, self.table, state, "completed", str(state["reason"]), now)
        log.info("%s: rollout completed, version %d is current", space, version)
        return True


def decide(state: dict[str, Any], step: dict[str, Any], now: float) -> str:
    """A step ended with these counts (step_counts'): record it in the state's history and
    say what follows: "rolled_back" (the reason set), "next" (the next step set), or
    "completed" (its reason set; the caller makes the version current). The same on a
    single host and for a fleet (polyserve/fleet/rollouts.py)."""
    new, old = step["new"], step["old"]
    entry = {"step": state["step"] + 1, "weight": state["weight"], "ended_at": now, **step}
    state["history"].append(entry)
    limit = old["error_rate"] + state["max_error_rate"]
    version = int(state["version"])
    if new["requests"] and new["error_rate"] > limit:
        state["reason"] = (
            f"step {entry['step']} ({state['weight']}%): version {version} failed"
            f" {new['errors']} of {new['requests']} requests ({new['error_rate']:.1%}),"
            f" version {state['old']} {old['errors']} of {old['requests']}"
            f" ({old['error_rate']:.1%}): more than max_error_rate"
            f" {state['max_error_rate']:g} above the old version's"
        )
        return "rolled_back"
    state["step"] += 1
    state["weight"] = state["steps"][state["step"]]
    state["step_started_at"] = now
    if state["weight"] < 100:
        return "next"
    state["reason"] = f"version {version} is current"
    return "completed"
