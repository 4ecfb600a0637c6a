"""The fleet's rollouts: one state per space in PostgreSQL, applied by every host.

A rollout's state is one row of `polyserve_rollouts` (migration 7), the same object a
single host keeps in its file (polyserve.state.rollouts) less what is each host's own
(its counts' base and boot). Each write commits the row and a change of kind `rollout`
(carrying the new version) under CHANGE_LOCK; every host's follower applies it: keeps
the new version (fetching its files), pins both, and writes the state into its file and
the table's word, so every host splits by the same weights.

Who moves the steps: every host's follower reports its counts of the step under way
(`polyserve_rollout_counts`); once the step is due, the first follower to lock the row
(`SELECT … FOR UPDATE`, then a check that the step is still the due one) sums every
host's counts, decides (rollouts.decide) and commits the next state; at 100% the same
transaction makes the new version current with a rollback's change, logged before the
ended state. So each step is decided once, by one host, from the fleet's counts.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import psycopg

from polyserve.errors import ClientError
from polyserve.fleet.changes import Change, kept_versions, log_change
from polyserve.fleet.connection import Connection
from polyserve.fleet.schema import CHANGE_LOCK
from polyserve.state import rollouts
from polyserve.state.shm import H_STARTED, Table

if TYPE_CHECKING:
    from polyserve.fleet.catchup import CatchUp

log = logging.getLogger("polyserve")


class RolloutRows(Connection):
    """The rollouts' rows, their counts, and the changes that tell the hosts."""

    def rollout_of(self, space: str) -> dict[str, Any] | None:
        with self.session() as conn:
            row = conn.execute(
                "SELECT state FROM polyserve_rollouts WHERE space = %s", (space,)
            ).fetchone()
        return dict(row[0]) if row else None

    def rollouts_live(self) -> dict[str, int]:
        """Every running or paused rollout: its new version, by space."""
        with self.session() as conn:
            rows = conn.execute(
                "SELECT space, (state->>'version')::int FROM polyserve_rollouts"
                " WHERE state->>'status' = ANY(%s)",
                (list(rollouts.LIVE),),
            ).fetchall()
        return {str(space): int(version) for space, version in rows}

    def rollout_start(self, space: str, asked: dict[str, Any]) -> tuple[Change, dict[str, Any]]:
        """Commit a new rollout (rollouts.parse's `asked`); ClientError 404 (not deployed,
        or the space keeps no such version: kept_versions) or 409 (one is live, or it is
        current)."""
        with _changing(self) as conn:
            row = conn.execute(
                "SELECT current_version FROM polyserve_spaces WHERE name = %s", (space,)
            ).fetchone()
            if row is None or row[0] is None:
                raise ClientError(404, f"space {space} is not deployed", space=space)
            current, new = int(row[0]), int(asked["version"])
            kept = kept_versions(conn, space)
            if new not in kept:
                raise ClientError(
                    404,
                    f"space {space} keeps no version {new} to roll out: it keeps {kept}",
                    space=space,
                    kept=kept,
                )
            if new == current:
                raise ClientError(409, f"version {new} of {space} is current already", space=space)
            earlier = _locked_state(conn, space)
            if earlier is not None and earlier["status"] in rollouts.LIVE:
                raise ClientError(
                    409,
                    f"space {space} has a rollout of version {earlier['version']}"
                    f" {earlier['status']}: abort it first (POST …/rollout/abort)",
                    space=space,
                )
            state = rollouts.started(space, asked, current)
            # The earlier rollouts' reports: their figures are in their states' history.
            conn.execute("DELETE FROM polyserve_rollout_counts WHERE space = %s", (space,))
            return _commit(conn, space, state), state

    def rollout_act(self, space: str, action: str) -> tuple[Change, dict[str, Any]]:
        """pause, resume or abort; ClientError 404 (no rollout) or 409 (it is over)."""
        with _changing(self) as conn:
            state = _locked_state(conn, space)
            if state is None:
                raise ClientError(404, f"space {space} has no rollout", space=space)
            if state["status"] not in rollouts.LIVE:
                raise ClientError(
                    409, f"the rollout of {space} is over ({state['status']})", space=space
                )
            now = time.time()
            if action == "pause" and state["status"] == "running":
                state["status"] = "paused"
                left = state["step_s"] - (now - state["step_started_at"])
                state["paused_left_s"] = max(left, 0.0)
            elif action == "resume" and state["status"] == "paused":
                state["status"] = "running"
                left = float(state.pop("paused_left_s", state["step_s"]))
                state["step_started_at"] = now - (state["step_s"] - left)
            elif action == "abort":
                rollouts.over(state, "aborted", "aborted on request", now)
            return _commit(conn, space, state), state

    def rollout_report(self, space: str, host: str, state: dict[str, Any], counts: Any) -> None:
        """This host boot's counts of the step under way (rollouts.step_counts'); `host`
        is reporter()'s, so a restarted host's earlier counts of the step stay summed."""
        with self.session() as conn:
            conn.execute(
                "INSERT INTO polyserve_rollout_counts (space, host, started_at, step, counts)"
                " VALUES (%s, %s, %s, %s, %s::jsonb) ON CONFLICT (space, host, started_at, step)"
                " DO UPDATE SET counts = EXCLUDED.counts",
                (space, host, state["started_at"], state["step"], json.dumps(counts)),
            )

    def rollout_judge(self, space: str, seen: dict[str, Any]) -> dict[str, Any] | None:
        """The step `seen` is due: decide it from every host's counts, unless another
        host has (None then). Returns the committed state."""
        with _changing(self) as conn:
            state = _locked_state(conn, space)
            if (
                state is None
                or state["status"] != "running"
                or state["started_at"] != seen["started_at"]
                or state["step"] != seen["step"]
                or time.time() - state["step_started_at"] < state["step_s"]
            ):
                return None
            summed = _step_sum(conn, space, state, but="")
            outcome = rollouts.decide(state, summed, time.time())
            if outcome != "next":
                state["ended_at"] = time.time()
                state["weight"] = 0 if outcome == "rolled_back" else 100
                state["status"] = outcome
            if outcome == "completed":
                # In the same transaction, and logged before the ended state: a host never
                # clears the rollout's word while the old version is still current, and a
                # host that dies after the decision leaves no completed rollout behind an
                # old current version.
                version = int(state["version"])
                conn.execute(
                    "UPDATE polyserve_spaces SET current_version = %s WHERE name = %s",
                    (version, space),
                )
                log_change(conn, space, "deploy", version)
            _commit(conn, space, state)
        return state

    def rollout_others(self, space: str, state: dict[str, Any], but: str) -> dict[str, Any]:
        """The step under way as every other reporter (host and boot) last reported it:
        what GET …/rollout adds to this host's own, fresher, counts."""
        with self.session() as conn:
            return _step_sum(conn, space, state, but)


def _step_sum(
    conn: psycopg.Connection, space: str, state: dict[str, Any], but: str
) -> dict[str, Any]:
    """Each version's requests, errors and error rate in the step under way, summed over
    the reports of every host boot but `but` (rollouts.step_counts' shape)."""
    rows = conn.execute(
        "SELECT counts FROM polyserve_rollout_counts"
        " WHERE space = %s AND started_at = %s AND step = %s AND host <> %s",
        (space, state["started_at"], state["step"], but),
    ).fetchall()
    summed = {k: {"requests": 0, "errors": 0} for k in ("new", "old")}
    for (counts,) in rows:
        for k, c in summed.items():
            c["requests"] += int(counts[k]["requests"])
            c["errors"] += int(counts[k]["errors"])
    return {
        k: {**c, "error_rate": round(c["errors"] / c["requests"], 4) if c["requests"] else 0.0}
        for k, c in summed.items()
    }


def reporter(host: str, table: Table) -> str:
    """Who reports a step's counts: the host and its boot. The lane cells are the boot's
    table's, so a restarted host reports under a new name and its earlier boot's counts
    of the step stay in the sum (a host's boots never count a request twice)."""
    return f"{host}@{table.header(H_STARTED)}"


def _changing(db: Connection) -> Any:
    """A transaction under CHANGE_LOCK, as ChangeLog's writes take."""
    return _Changing(db)


class _Changing:
    def __init__(self, db: Connection) -> None:
        self.db = db

    def __enter__(self) -> psycopg.Connection:
        self._session = self.db.session()
        conn = self._session.__enter__()
        self._tx = conn.transaction()
        self._tx.__enter__()
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (CHANGE_LOCK,))
        return conn

    def __exit__(self, *exc: Any) -> None:
        try:
            self._tx.__exit__(*exc)
        finally:
            self._session.__exit__(*exc)


def _locked_state(conn: psycopg.Connection, space: str) -> dict[str, Any] | None:
    row = conn.execute(
        "SELECT state FROM polyserve_rollouts WHERE space = %s FOR UPDATE", (space,)
    ).fetchone()
    return dict(row[0]) if row else None


def _commit(conn: psycopg.Connection, space: str, state: dict[str, Any]) -> Change:
    conn.execute(
        "INSERT INTO polyserve_rollouts (space, state) VALUES (%s, %s::jsonb)"
        " ON CONFLICT (space) DO UPDATE SET state = EXCLUDED.state, updated_at = now()",
        (space, json.dumps(state)),
    )
    return log_change(conn, space, "rollout", int(state["version"]))


# -- a host's side: applying a state, and the follower's tick ---------------------------


def apply(catchup: CatchUp, space: str, version: int | None) -> None:
    """A `rollout` change here: keep `version` (its files fetched, if this pool's), then
    take the fleet's state of the space's rollout into the file and the table's word."""
    store, db = catchup.store, catchup.db
    table = catchup.changes.broadcast.table
    if version is not None and store.meta(space, version) is None:
        catchup.keep(space, version)
    state = db.rollout_of(space)
    if state is None:
        return  # a deploy with current=false alone
    with store.locked():
        local = rollouts.read(store.root, space)
        slot = store.slots.slot(space)
        same = (
            local is not None
            and local.get("started_at") == state["started_at"]
            and local.get("step") == state["step"]
            and local.get("status") == state["status"]
        )
        if same and local is not None:
            state["base"], state["boot"] = local["base"], local["boot"]
        else:  # a new step here: its counts start now
            state["base"] = rollouts.counts(table, slot) if slot is not None else [0, 0, 0, 0]
            state["boot"] = table.header(H_STARTED)
        versions = {int(state["version"]), int(state["old"])}
        live = state["status"] in rollouts.LIVE and store.current(space) is not None
        for v in versions:
            if live and v in store.kept(space):
                store.pin(space, v)
            elif not live and store.current(space) is not None:
                store.unpin(space, v)
        rollouts.write(store.root, state)
        if slot is not None:
            table.rollouts[slot] = rollouts.word_of(state) if live else 0


def take(catchup: CatchUp) -> None:
    """After this host took the fleet's pointers (it joined, or was far behind): every
    live rollout's state, as its change would have brought it, so this host splits by
    the fleet's weights from now on instead of at the rollout's next change; and the
    ended state of one that is live here only (it ended while this host was away)."""
    fleet = catchup.db.rollouts_live()
    for space in fleet.keys() | rollouts.live(catchup.store.root).keys():
        try:
            apply(catchup, space, fleet.get(space))
        except ClientError as exc:  # its next change (each step has one) tries again
            log.warning("%s: its rollout is not applied here yet: %s", space, exc.error)


def tick(catchup: CatchUp, host: str) -> None:
    """The follower's turn (every STOP_CHECK_S): report this host's counts of each live
    rollout's step, and decide the steps that are due (the first host to lock wins)."""
    store, db = catchup.store, catchup.db
    table = catchup.changes.broadcast.table
    try:
        names = list((store.root / rollouts.DIR).iterdir())
    except FileNotFoundError:
        return
    for p in names:
        try:
            local = json.loads(p.read_bytes())
        except (FileNotFoundError, ValueError):
            continue
        space = str(local.get("space"))
        slot = store.slots.slot(space)
        if local.get("status") not in rollouts.LIVE or slot is None:
            continue
        if local.get("boot") != table.header(H_STARTED):
            continue  # the master's thread resets a restarted boot's base first
        counts = rollouts.step_counts(table, slot, local)
        db.rollout_report(space, reporter(host, table), local, counts)
        due = time.time() - local["step_started_at"] >= local["step_s"]
        if local["status"] != "running" or not due:
            continue
        decided = db.rollout_judge(space, local)
        if decided is None:
            continue
        log.info(
            "%s: rollout step %d decided here: %s", space, local["step"] + 1, decided["status"]
        )
