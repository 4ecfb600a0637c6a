"""Rollouts in a fleet: real gunicorn hosts sharing a real PostgreSQL. A rollout started
through one host runs on every host by the same weights, an abort through another host
reaches the first, and a good version's steps (decided by one host from every host's
counts) end with it current everywhere."""

from __future__ import annotations

import os
import signal

import httpx2 as httpx
import psycopg
import pytest

# _client: test_fleet's module-wide HTTP client, which its helpers use (an autouse fixture)
from polyserve.fleet.catchup import EAGER_LIMIT
from tests.fleet.test_fleet import FAST, _client, fleet, start_fleet, wait_live  # noqa: F401
from tests.helpers import HostProcess, alive, until
from tests.hosts.test_rollout import deployed as deploy
from tests.hosts.test_rollout import source
from tests.postgres import PostgresServer

pytestmark = pytest.mark.postgres


def post(host: HostProcess, path: str, **body: object) -> httpx.Response:
    return httpx.post(f"{host.url}/_polyserve/spaces/{path}", json=body or None, timeout=60)


def state(host: HostProcess, space: str) -> dict:
    r = host.get(f"/_polyserve/spaces/{space}/rollout")
    assert r.status_code == 200, r.text
    return r.json()


def answers(host: HostProcess, space: str, n: int) -> dict[str, int]:
    seen = {"one": 0, "two": 0}
    with httpx.Client(base_url=host.url, timeout=30) as client:
        for _ in range(n):
            seen[client.get(f"/s/{space}/").json()["v"]] += 1
    return seen


def test_a_rollout_runs_on_every_host_and_an_abort_through_one_reaches_the_other(
    host_factory, fleet_db
):
    a, b = start_fleet(host_factory, fleet_db, "ab")
    deploy(a, "fr/split", source("one"))
    kept = deploy(a, "fr/split", source("two"), current=False)
    assert kept["version"] == 2 and kept["current"] is False
    assert kept["hosts"]["applied"] == 2
    for host in (a, b):  # kept everywhere, the current one serving
        assert host.get("/s/fr/split/").json() == {"v": "one"}
        assert host.get("/s/fr/split@2/").json() == {"v": "two"}
    r = post(a, "fr/split/rollout", version=2, steps=[30, 100], step_s=3600)
    assert r.status_code == 200, r.text
    assert r.json()["hosts"]["applied"] == 2
    # Both hosts split by the same weights: 200 requests at 30% each.
    for host in (a, b):
        assert state(host, "fr/split")["weights"] == {"1": 70, "2": 30}
        seen = answers(host, "fr/split", 200)
        assert seen["two"] > 0 and seen["one"] > 0, (host.url, seen)
    with psycopg.connect(fleet_db) as conn:
        (row,) = conn.execute("SELECT state FROM polyserve_rollouts").fetchall()
        assert row[0]["status"] == "running" and row[0]["version"] == 2
        kinds = [k for (k,) in conn.execute("SELECT kind FROM polyserve_changes ORDER BY id")]
        assert kinds == ["deploy", "rollout", "rollout"]
    # An abort through B: once it answers, A serves only the current version.
    r = post(b, "fr/split/rollout/abort")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "aborted"
    assert state(a, "fr/split")["status"] == "aborted"
    assert answers(a, "fr/split", 40) == {"one": 40, "two": 0}
    # A new rollout of the space starts with no reports: the aborted one's are gone.
    r = post(a, "fr/split/rollout", version=2, steps=[30, 100], step_s=3600)
    assert r.status_code == 200, r.text
    with psycopg.connect(fleet_db) as conn:
        started = {s for (s,) in conn.execute("SELECT started_at FROM polyserve_rollout_counts")}
    assert started <= {r.json()["started_at"]}, started


def test_a_good_version_completes_fleet_wide_and_becomes_current(host_factory, fleet_db):
    a, b = start_fleet(host_factory, fleet_db, "ab")
    deploy(a, "fr/good", source("one"))
    deploy(b, "fr/good", source("two"), current=False)
    r = post(b, "fr/good/rollout", version=2, steps=[50, 100], step_s=1)
    assert r.status_code == 200, r.text

    def completed() -> bool:
        for host in (a, b):
            host.get("/s/fr/good/")
        return all(state(h, "fr/good")["status"] == "completed" for h in (a, b))

    until(completed, what="the rollout to complete on both hosts")
    # The step was decided once, from both hosts' counts; its own move to version 2
    # completes it as the decision says (not as a move by hand would).
    assert {state(h, "fr/good")["reason"] for h in (a, b)} == {"version 2 is current"}
    (step,) = state(a, "fr/good")["history"]
    assert step["weight"] == 50 and step["new"]["requests"] + step["old"]["requests"] >= 2
    # Version 2 was current before the rollout ended anywhere: its move is logged first,
    # in the decision's transaction, so a host that shows the end serves version 2.
    for host in (a, b):
        assert host.get("/s/fr/good/").json() == {"v": "two"}, host.url
    with psycopg.connect(fleet_db) as conn:
        log = conn.execute("SELECT kind, version FROM polyserve_changes ORDER BY id").fetchall()
    assert log[-2:] == [("deploy", 2), ("rollout", 2)], log


@pytest.mark.parametrize("history", [0, EAGER_LIMIT + 1])
def test_a_host_that_joins_mid_rollout_splits_by_the_fleets_weights(
    host_factory, fleet_db, history
):
    """B joins while a rollout runs at 50%: replaying the few changes of the fleet, or
    (with a longer history) taking its pointers, it applies the rollout's state."""
    (a,) = start_fleet(host_factory, fleet_db, "a")
    for i in range(history):  # other spaces' deploys: B takes the fleet's pointers
        deploy(a, f"fr/other{i}", source("one"))
    deploy(a, "fr/join", source("one"))
    deploy(a, "fr/join", source("two"), current=False)
    r = post(a, "fr/join/rollout", version=2, steps=[50, 100], step_s=3600)
    assert r.status_code == 200, r.text
    b = host_factory("b", workers=1, POLYSERVE_DATABASE_URL=fleet_db, POLYSERVE_HOST_ID="b", **FAST)
    wait_live(a, {"a", "b"})
    last = fleet(b)["last_change"]
    until(
        lambda: {h["id"]: h["applied"] for h in fleet(b)["hosts"]}["b"] == last,
        what="B to apply the fleet's last change",
    )
    assert state(b, "fr/join")["weights"] == {"1": 50, "2": 50}
    # 100 requests at 50%: one version alone would be a chance of 1e-30.
    seen = answers(b, "fr/join", 100)
    assert seen["two"] > 0 and seen["one"] > 0, seen


def test_the_step_under_way_shows_the_fleets_counts_on_every_host(host_factory, fleet_db):
    a, b = start_fleet(host_factory, fleet_db, "ab")
    deploy(a, "fr/sum", source("one"))
    deploy(a, "fr/sum", source("two"), current=False)
    r = post(a, "fr/sum/rollout", version=2, steps=[50, 100], step_s=3600)
    assert r.status_code == 200, r.text
    sent = answers(a, "fr/sum", 30)
    for version, n in answers(b, "fr/sum", 50).items():
        sent[version] += n
    wanted = {"1": sent["one"], "2": sent["two"]}

    def summed(host: HostProcess) -> dict[str, int]:
        versions = state(host, "fr/sum")["versions"]
        return {v: counts["requests"] for v, counts in versions.items()}

    for host in (a, b):  # each host's own counts, and the other's last report
        until(lambda h=host: summed(h) == wanted, what=f"{host.url} to show {wanted}")


def test_a_rollout_goes_on_after_a_host_is_killed_and_started_again(host_factory, fleet_db):
    """B's gunicorn master is killed mid-step (SIGKILL by PID) and started again: B
    splits by the rollout's weights again, and the step's counts keep what B's first
    boot reported beside what its second one counts."""
    a, b = start_fleet(host_factory, fleet_db, "ab")
    deploy(a, "fr/kill", source("one"))
    deploy(a, "fr/kill", source("two"), current=False)
    r = post(a, "fr/kill/rollout", version=2, steps=[50, 100], step_s=3600)
    assert r.status_code == 200, r.text
    before = answers(b, "fr/kill", 20)

    def requests(host: HostProcess) -> int:
        return sum(v["requests"] for v in state(host, "fr/kill")["versions"].values())

    until(lambda: requests(a) == 20, what="B's report of 20 requests to reach A's view")
    workers, follower = b.worker_pids(), b.follower_pid()
    os.kill(b.proc.pid, signal.SIGKILL)
    until(lambda: b.proc.poll() is not None, what="B's master to die")
    until(lambda: not any(alive(p) for p in {*workers, follower}), what="B's processes to exit")
    b.start()
    wait_live(a, {"a", "b"})
    found = state(b, "fr/kill")
    assert found["status"] == "running" and found["weights"] == {"1": 50, "2": 50}, found
    # 100 requests at 50%: one version alone would be a chance of 1e-30.
    after = answers(b, "fr/kill", 100)
    assert after["one"] > 0 and after["two"] > 0, after
    wanted = {
        "1": before["one"] + after["one"],
        "2": before["two"] + after["two"],
    }
    for host in (a, b):
        until(
            lambda h=host: (
                {v: c["requests"] for v, c in state(h, "fr/kill")["versions"].items()} == wanted
            ),
            what=f"{host.url} to show both boots' counts {wanted}",
        )


def test_a_failing_version_is_rolled_back_fleet_wide_by_itself(host_factory, fleet_db):
    """A new version that fails 20% of its requests, called through both hosts, is rolled
    back by the fleet's judgement; every host then serves the old version alone."""
    a, b = start_fleet(host_factory, fleet_db, "ab")
    deploy(a, "fr/bad", source("one"))
    deploy(a, "fr/bad", source("two", fail_every=5), current=False)
    r = post(a, "fr/bad/rollout", version=2, steps=[50, 100], step_s=2, max_error_rate=0.05)
    assert r.status_code == 200, r.text
    failed = {"a": 0, "b": 0}
    clients = {n: httpx.Client(base_url=h.url, timeout=30) for n, h in (("a", a), ("b", b))}
    try:

        def rolled_back() -> bool:
            for name, client in clients.items():
                for _ in range(5):
                    failed[name] += client.get("/s/fr/bad/").status_code == 500
            return state(a, "fr/bad")["status"] != "running"

        until(rolled_back, what="the rollout to end")
    finally:
        for client in clients.values():
            client.close()
    assert failed["a"] > 0 and failed["b"] > 0, failed  # both hosts' requests failed
    for host in (a, b):
        found = state(host, "fr/bad")
        assert found["status"] == "rolled_back", found
        assert "version 2 failed" in found["reason"], found
        assert found["weights"] == {"1": 100, "2": 0}
        (step,) = found["history"]
        assert step["old"]["errors"] == 0 and step["new"]["errors"] >= 1, step
        assert answers(host, "fr/bad", 40) == {"one": 40, "two": 0}
    # The step was judged from both hosts' reports (each of them saw failures), which
    # hold no more than the failures the clients saw.
    with psycopg.connect(fleet_db) as conn:
        rows = dict(conn.execute("SELECT host, counts FROM polyserve_rollout_counts").fetchall())
    assert {h.split("@")[0] for h in rows} == {"a", "b"}, rows
    assert all(c["new"]["errors"] > 0 for c in rows.values()), rows
    reported = sum(c["new"]["errors"] for c in rows.values())
    assert step["new"]["errors"] <= reported <= failed["a"] + failed["b"], (step, rows, failed)


def test_a_rollouts_view_without_the_database_is_this_hosts_and_says_so(
    own_postgres: PostgresServer, host_factory
):
    url = own_postgres.create_database()
    a, b = start_fleet(host_factory, url, "ab")
    deploy(a, "fr/down", source("one"))
    deploy(a, "fr/down", source("two"), current=False)
    r = post(a, "fr/down/rollout", version=2, steps=[50, 100], step_s=3600)
    assert r.status_code == 200, r.text
    here = answers(a, "fr/down", 10)  # A's own (A fetches v1's files at the first)
    answers(b, "fr/down", 10)  # B's: in A's view while the database answers
    until(
        lambda: sum(v["requests"] for v in state(a, "fr/down")["versions"].values()) == 20,
        what="B's report to reach A's view",
    )
    assert "warning" not in state(a, "fr/down")
    own_postgres.stop()
    for version, n in answers(a, "fr/down", 20).items():
        here[version] += n
    found = state(a, "fr/down")
    assert "unreachable" in found["warning"], found
    requests = {v: c["requests"] for v, c in found["versions"].items()}
    assert requests == {"1": here["one"], "2": here["two"]}, (requests, here)


def test_a_deploy_through_another_host_mid_step_ends_the_rollout_fleet_wide(host_factory, fleet_db):
    """A deploy that moves `current` during a long step ends the rollout in the fleet's
    row and on every host before its answer: every request then gets the deployed
    version (never the rollout's new one, and not the rollout's at its end), and a new
    rollout of the space may start."""
    a, b = start_fleet(host_factory, fleet_db, "ab")
    deploy(a, "fr/moved", source("one"))
    deploy(a, "fr/moved", source("two"), current=False)
    r = post(a, "fr/moved/rollout", version=2, steps=[50, 100], step_s=3600)
    assert r.status_code == 200, r.text
    assert deploy(b, "fr/moved", source("three"))["hosts"]["applied"] == 2
    for host in (a, b):
        with httpx.Client(base_url=host.url, timeout=30) as client:
            seen = {client.get("/s/fr/moved/").json()["v"] for _ in range(40)}
        assert seen == {"three"}, (host.url, seen)
    until(lambda: all(state(h, "fr/moved")["status"] == "aborted" for h in (a, b)))
    assert state(a, "fr/moved")["reason"] == "version 3 was made current meanwhile"
    with psycopg.connect(fleet_db) as conn:
        (row,) = conn.execute("SELECT state FROM polyserve_rollouts").fetchall()
    assert row[0]["status"] == "aborted", row[0]
    deploy(a, "fr/moved", source("four"), current=False)
    r = post(b, "fr/moved/rollout", version=4, steps=[50, 100], step_s=3600)
    assert r.status_code == 200, r.text
    assert r.json()["old"] == 3


def test_a_rollback_to_the_rollouts_new_version_completes_it_fleet_wide(host_factory, fleet_db):
    """A rollback by hand through another host to a live rollout's new version ends the
    rollout in the fleet's row as completed, with a reason that says so, and every host
    takes that end: the version made current stays current and no step is judged later."""
    a, b = start_fleet(host_factory, fleet_db, "ab")
    deploy(a, "fr/hand", source("one"))
    deploy(a, "fr/hand", source("two"), current=False)
    r = post(a, "fr/hand/rollout", version=2, steps=[50, 100], step_s=3600)
    assert r.status_code == 200, r.text
    back = post(b, "fr/hand/rollback", version=2)
    assert back.status_code == 200, back.text
    with psycopg.connect(fleet_db) as conn:
        (row,) = conn.execute("SELECT state FROM polyserve_rollouts").fetchall()
        log = conn.execute("SELECT kind, version FROM polyserve_changes ORDER BY id").fetchall()
    assert (row[0]["status"], row[0]["reason"]) == (
        "completed",
        "version 2 was made current by hand",
    ), row[0]
    assert log[-2:] == [("deploy", 2), ("rollout", None)], log
    until(lambda: all(state(h, "fr/hand")["status"] == "completed" for h in (a, b)))
    for host in (a, b):
        assert state(host, "fr/hand")["reason"] == "version 2 was made current by hand"
        assert answers(host, "fr/hand", 40) == {"one": 0, "two": 40}, host.url
    r = post(b, "fr/hand/rollout", version=1, steps=[50, 100], step_s=3600)
    assert r.status_code == 200, r.text  # none live: the space's next rollout starts


def test_a_rollout_of_a_version_from_before_the_spaces_delete_is_a_404(host_factory, fleet_db):
    """The fleet store holds every version, but one deployed before the space's delete
    is not kept by the space deployed again: a rollout of it, or a rollback to it, is a
    404 listing the kept ones, as on a single host, and nothing is committed."""
    (a,) = start_fleet(host_factory, fleet_db, "a")
    deploy(a, "fr/life", source("one"))
    deploy(a, "fr/life", source("two"), current=False)
    assert httpx.delete(f"{a.url}/_polyserve/spaces/fr/life", timeout=60).status_code == 200
    deploy(a, "fr/life", source("three"))
    deploy(a, "fr/life", source("four"), current=False)
    for version in (2, 9):
        r = post(a, "fr/life/rollout", version=version, steps=[50, 100], step_s=3600)
        assert r.status_code == 404, r.text
        assert r.json()["kept"] == [3, 4] and f"no version {version}" in r.json()["error"]
    back = post(a, "fr/life/rollback", version=1)
    assert back.status_code == 404 and back.json()["kept"] == [3, 4], back.text
    with psycopg.connect(fleet_db) as conn:
        assert conn.execute("SELECT count(*) FROM polyserve_rollouts").fetchone() == (0,)
    assert a.get("/s/fr/life/").json() == {"v": "three"}
    r = post(a, "fr/life/rollout", version=4, steps=[50, 100], step_s=3600)
    assert r.status_code == 200, r.text


def test_a_rollout_write_a_host_has_not_applied_answers_202_as_its_spec_says(
    host_factory, fleet_db
):
    """With B's follower stopped (still live, so writes wait for it): starting and
    aborting a rollout through A answer 202 naming B, and the OpenAPI document lists a
    202 for both, as for the fleet's other writes."""
    a, b = start_fleet(host_factory, fleet_db, "ab", POLYSERVE_DEPLOY_WAIT_S="1")
    deploy(a, "fr/lag", source("one"))
    deploy(a, "fr/lag", source("two"), current=False)
    spec = a.get("/_polyserve/openapi.json").json()["paths"]
    follower = b.follower_pid()
    os.kill(follower, signal.SIGSTOP)
    try:
        started = post(a, "fr/lag/rollout", version=2, steps=[50, 100], step_s=3600)
        aborted = post(a, "fr/lag/rollout/abort")
    finally:
        os.kill(follower, signal.SIGCONT)
    for r, path in (
        (started, "/_polyserve/spaces/{owner}/{name}/rollout"),
        (aborted, "/_polyserve/spaces/{owner}/{name}/rollout/{action}"),
    ):
        assert r.status_code == 202, r.text
        assert r.json()["hosts"]["lagging"] == ["b"], r.json()
        assert "202" in spec[path]["post"]["responses"], (path, spec[path]["post"]["responses"])
