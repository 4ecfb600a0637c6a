"""Weighted rollouts on a real host: the split by percent and by a sticky key, the
automatic rollback of a failing version, the promotion at 100%, and a restart."""

from __future__ import annotations

import math
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.helpers import HostProcess, metrics_histogram, module_host, until

host = module_host("host")


def source(version: str, fail_every: int = 0) -> str:
    """A space answering its version; with fail_every=5 every fifth call in a worker
    raises (a 500): 20% of its requests fail."""
    failing = f"    if calls[0] % {fail_every} == 0:\n        raise RuntimeError('bad')\n"
    return (
        "calls = [0]\n\n"
        "def handle(request):\n"
        "    calls[0] += 1\n"
        f"{failing if fail_every else ''}"
        f"    return {{'v': {version!r}}}\n"
    )


def deployed(host: HostProcess, space: str, content: str, current: bool = True) -> dict:
    """The 200 answer of a deploy of `content` as main.py (current=False: kept beside)."""
    data = {"space": space} if current else {"space": space, "current": "false"}
    answer = httpx.post(
        host.url + "/_polyserve/deploy",
        data=data,
        files={"module": ("main.py", content.encode())},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def deploy(host: HostProcess, space: str, content: str, current: bool = True) -> int:
    return int(deployed(host, space, content, current)["version"])


def rollout(host: HostProcess, space: str, **body: object) -> httpx.Response:
    return httpx.post(f"{host.url}/_polyserve/spaces/{space}/rollout", json=body, timeout=30)


def state(host: HostProcess, space: str) -> dict:
    answer = host.get(f"/_polyserve/spaces/{space}/rollout")
    assert answer.status_code == 200, answer.text
    return answer.json()


def action(host: HostProcess, space: str, what: str) -> dict:
    answer = httpx.post(f"{host.url}/_polyserve/spaces/{space}/rollout/{what}", timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def current(host: HostProcess, space: str) -> int:
    return int(host.get(f"/_polyserve/spaces/{space}/versions").json()["current"])


def test_a_deploy_with_current_false_keeps_the_current_version_serving(host):
    assert deploy(host, "ro/keep", source("one")) == 1
    assert deploy(host, "ro/keep", source("two"), current=False) == 2
    assert host.get("/s/ro/keep/").json() == {"v": "one"}
    assert host.get("/s/ro/keep@2/").json() == {"v": "two"}
    assert current(host, "ro/keep") == 1
    bad = httpx.post(
        host.url + "/_polyserve/deploy",
        data={"space": "ro/keep", "current": "maybe"},
        files={"module": ("main.py", source("x").encode())},
    )
    assert bad.status_code == 422 and "current" in bad.json()["error"]


def test_a_rollout_at_25_percent_sends_a_quarter_and_a_sticky_key_one_version(host):
    deploy(host, "ro/split", source("one"))
    new = deploy(host, "ro/split", source("two"), current=False)
    # A step long enough that the test ends within it.
    answer = rollout(
        host, "ro/split", version=new, steps=[25, 100], step_s=3600, sticky_header="X-User"
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["weights"] == {"1": 75, "2": 25}
    n = 400
    seen = {"one": 0, "two": 0}
    with httpx.Client(base_url=host.url, timeout=30) as client:
        for _ in range(n):
            seen[client.get("/s/ro/split/").json()["v"]] += 1
        # Binomial(400, 0.25): mean 100, sigma 8.66; 4 sigma is ±35 (a false failure
        # about once in 16,000 runs).
        sigma = math.sqrt(n * 0.25 * 0.75)
        assert abs(seen["two"] - n * 0.25) <= 4 * sigma, seen
        # A client sending the sticky header always gets one version.
        for user in ("alice", "bob", "carol", "dave"):
            got = [
                client.get("/s/ro/split/", headers={"x-user": user}).json()["v"] for _ in range(30)
            ]
            assert len(set(got)) == 1, (user, got)
            seen[got[0]] += 30
    found = state(host, "ro/split")
    assert found["status"] == "running" and found["step"] == 0
    # The meter's lane counts each version's requests exactly (the sticky ones too).
    counts = found["versions"]
    assert counts["1"]["requests"] + counts["2"]["requests"] == n + 4 * 30
    assert counts["2"]["requests"] == seen["two"]
    # /metrics: the space's duration histogram counts every request, the rollout's
    # counts those its new version answered, exactly.
    every = metrics_histogram(host, "polyserve_space_request_duration_seconds", "ro/split")
    lane = metrics_histogram(host, "polyserve_space_rollout_request_duration_seconds", "ro/split")
    assert (every["count"], lane["count"]) == (n + 120, seen["two"])
    # Aborted: every plain request is the current version's again.
    assert action(host, "ro/split", "abort")["status"] == "aborted"
    assert {host.get("/s/ro/split/").json()["v"] for _ in range(20)} == {"one"}
    assert rollout(host, "ro/split", version=1, steps=[100]).status_code == 409  # current


def test_requests_by_name_to_a_rollouts_new_version_are_metered_in_its_lane(host):
    deploy(host, "ro/named", source("one"))
    deploy(host, "ro/named", source("two"))
    new = deploy(host, "ro/named", source("three"), current=False)
    answer = rollout(host, "ro/named", version=new, steps=[1, 100], step_s=3600)
    assert answer.status_code == 200, answer.text
    lane_name = "polyserve_space_rollout_request_duration_seconds"
    with httpx.Client(base_url=host.url, timeout=30) as client:
        calls = {"@3": 10, "@2": 7, "@1": 5}  # the new version, the old one, neither
        for suffix, n in calls.items():
            for _ in range(n):
                assert client.get(f"/s/ro/named{suffix}/").status_code == 200
    every = metrics_histogram(host, "polyserve_space_request_duration_seconds", "ro/named")
    lane = metrics_histogram(host, lane_name, "ro/named")
    assert (every["count"], lane["count"]) == (22, 10)
    # The rollout's figures are the lane's: version 1's requests by name count as the
    # old version's (the space's less the lane), as docs/rollouts.md says.
    counts = state(host, "ro/named")["versions"]
    assert (counts["3"]["requests"], counts["2"]["requests"]) == (10, 12), counts
    # Once the rollout is over, version 3 by name is the space's alone again.
    assert action(host, "ro/named", "abort")["status"] == "aborted"
    for _ in range(3):
        assert host.get("/s/ro/named@3/").status_code == 200
    assert metrics_histogram(host, lane_name, "ro/named")["count"] == 10


def test_a_failing_version_is_rolled_back_by_itself_with_the_errors_per_version(host):
    deploy(host, "ro/bad", source("one"))
    new = deploy(host, "ro/bad", source("two", fail_every=5), current=False)
    step_s = 2.0
    answer = rollout(
        host, "ro/bad", version=new, steps=[50, 100], step_s=step_s, max_error_rate=0.05
    )
    assert answer.status_code == 200, answer.text
    observed = {"one": 0, "two": 0, "failed": 0}
    with httpx.Client(base_url=host.url, timeout=30) as client:
        deadline = time.monotonic() + 30
        while state(host, "ro/bad")["status"] == "running":
            assert time.monotonic() < deadline, "no rollback"
            for _ in range(10):
                got = client.get("/s/ro/bad/")
                if got.status_code == 500:
                    observed["failed"] += 1
                else:
                    observed[got.json()["v"]] += 1
    found = state(host, "ro/bad")
    assert found["status"] == "rolled_back", found
    assert "version 2 failed" in found["reason"] and "max_error_rate" in found["reason"]
    # Within one step interval plus one second of its start, by the state's own clock.
    assert found["ended_at"] - found["started_at"] <= step_s + 1, found
    assert found["weights"] == {"1": 100, "2": 0}
    counts = found["versions"]
    assert counts["1"]["errors"] == 0
    assert counts["2"]["errors"] >= 1
    # Every failure the client saw was the new version's; the counts stop at the end.
    assert observed["failed"] - 1 <= counts["2"]["errors"] <= observed["failed"]
    assert current(host, "ro/bad") == 1
    assert {host.get("/s/ro/bad/").json()["v"] for _ in range(20)} == {"one"}


def test_a_good_version_reaches_100_percent_and_becomes_current(host):
    deploy(host, "ro/good", source("one"))
    new = deploy(host, "ro/good", source("two"), current=False)
    answer = rollout(host, "ro/good", version=new, steps=[20, 60, 100], step_s=1)
    assert answer.status_code == 200, answer.text
    seen: set[str] = set()

    def completed() -> bool:
        seen.add(host.get("/s/ro/good/").json()["v"])
        return state(host, "ro/good")["status"] == "completed"

    until(completed, what="the rollout to complete")
    found = state(host, "ro/good")
    assert [step["weight"] for step in found["history"]] == [20, 60]
    assert current(host, "ro/good") == 2
    # The deploy contract: once it is current, no plain request gets the old version.
    assert {host.get("/s/ro/good/").json()["v"] for _ in range(20)} == {"two"}
    assert seen <= {"one", "two"}


def test_bad_rollout_requests_are_422_saying_what_to_send(host):
    deploy(host, "ro/input", source("one"))
    for body in (
        {},
        {"version": 2, "steps": [50]},
        {"version": 2, "steps": [50, 20, 100]},
        {"version": 2, "step_s": 0},
        {"version": 2, "max_error_rate": 2},
        {"version": 2, "extra": 1},
    ):
        answer = rollout(host, "ro/input", **body)
        assert answer.status_code == 422, (body, answer.text)
        assert answer.json()["error"]
    # Arrays nested deeper than the parser's stack, well under the 64 KiB a body may be.
    nested = httpx.post(
        f"{host.url}/_polyserve/spaces/ro/input/rollout", content=b"[" * 60000, timeout=30
    )
    assert nested.status_code == 422 and "not JSON" in nested.json()["error"], nested.text
    missing = rollout(host, "ro/input", version=9)
    assert missing.status_code == 404 and missing.json()["kept"] == [1]
    assert host.get("/_polyserve/spaces/ro/input/rollout").status_code == 404


def test_a_deploy_or_delete_mid_step_ends_the_rollout_at_once(host):
    """A deploy that moves `current` during a long step ends the rollout before its
    answer: every request then gets the deployed version. A delete ends it too, so a
    space deployed again under the name serves only its own versions."""
    deploy(host, "ro/moved", source("one"))
    deploy(host, "ro/moved", source("two"), current=False)
    assert rollout(host, "ro/moved", version=2, steps=[50, 100], step_s=3600).status_code == 200
    deploy(host, "ro/moved", source("three"))
    ended = state(host, "ro/moved")
    assert ended["status"] == "aborted", ended
    assert ended["reason"] == "version 3 was made current meanwhile"
    assert {host.get("/s/ro/moved/").json()["v"] for _ in range(40)} == {"three"}

    deploy(host, "ro/gone", source("one"))
    deploy(host, "ro/gone", source("two"), current=False)
    assert rollout(host, "ro/gone", version=2, steps=[50, 100], step_s=3600).status_code == 200
    assert httpx.delete(f"{host.url}/_polyserve/spaces/ro/gone", timeout=30).status_code == 200
    assert state(host, "ro/gone")["reason"] == "the space was deleted"
    deploy(host, "ro/gone", source("again"))
    deploy(host, "ro/gone", source("again, kept"), current=False)
    answers = [host.get("/s/ro/gone/") for _ in range(40)]
    assert {(r.status_code, r.json()["v"]) for r in answers} == {(200, "again")}
    assert rollout(host, "ro/gone", version=4).status_code == 200  # none live: it starts


def test_a_rollback_to_the_rollouts_new_version_completes_it_and_it_stays_current(host):
    """A rollback by hand to the new version of a live rollout ends the rollout before
    its answer, as completed with a reason that says so: the version made current
    stays current, and no later step judges (or rolls back) anything. The space's own
    rollout may start again."""
    deploy(host, "ro/hand", source("one"))
    deploy(host, "ro/hand", source("two", fail_every=2), current=False)
    assert rollout(host, "ro/hand", version=2, steps=[50, 100], step_s=1).status_code == 200
    back = httpx.post(
        f"{host.url}/_polyserve/spaces/ro/hand/rollback", json={"version": 2}, timeout=30
    )
    assert back.status_code == 200, back.text
    ended = state(host, "ro/hand")
    assert (ended["status"], ended["reason"]) == ("completed", "version 2 was made current by hand")
    assert ended["weights"] == {"1": 0, "2": 100} and ended["history"] == []
    # Half of version 2's answers fail: a live step would roll it back at its end. An
    # ended rollout is never judged again (the driver looks at live ones only).
    answers = [host.get("/s/ro/hand/") for _ in range(40)]
    assert {r.json()["v"] for r in answers if r.status_code == 200} == {"two"}
    assert current(host, "ro/hand") == 2
    assert rollout(host, "ro/hand", version=1, step_s=3600).status_code == 200  # none live


@pytest.mark.gunicorn
def test_a_rollout_survives_a_restart_of_the_host(tmp_path: Path):
    one = HostProcess(tmp_path / "data").start()
    try:
        deploy(one, "ro/restart", source("one"))
        new = deploy(one, "ro/restart", source("two"), current=False)
        answer = rollout(one, "ro/restart", version=new, steps=[30, 100], step_s=3600)
        assert answer.status_code == 200, answer.text
        assert action(one, "ro/restart", "pause")["status"] == "paused"
        assert action(one, "ro/restart", "resume")["status"] == "running"
    finally:
        one.stop()
    again = HostProcess(tmp_path / "data").start()
    try:
        found = state(again, "ro/restart")
        assert found["status"] == "running" and found["weights"] == {"1": 70, "2": 30}
        # 200 requests at 30%: none reaching version 2 would be a chance of 1e-31.
        seen = {"one": 0, "two": 0}
        with httpx.Client(base_url=again.url, timeout=30) as client:
            for _ in range(200):
                seen[client.get("/s/ro/restart/").json()["v"]] += 1
        assert seen["two"] > 0 and seen["one"] > 0, seen
        assert state(again, "ro/restart")["versions"]["2"]["requests"] == seen["two"]
    finally:
        again.stop()


def test_the_command_starts_and_watches_a_rollout_pauses_and_shows_it(host, tmp_path):
    from tests.cli.test_cli import ok, polyserve

    first, second = tmp_path / "one.py", tmp_path / "two.py"
    first.write_text(source("one"))
    second.write_text(source("two"))
    ok(polyserve("deploy", str(first), "--space", "ro/cli", url=host.url))
    out = ok(polyserve("deploy", str(second), "--space", "ro/cli", "--no-current", url=host.url))
    assert "v2" in out and "not current" in out
    assert current(host, "ro/cli") == 1
    out = ok(
        polyserve(
            "rollout",
            "ro/cli",
            "--version",
            "2",
            "--steps",
            "50,100",
            "--step-s",
            "1",
            url=host.url,
        )
    )
    lines = out.splitlines()
    # A live line per step: 50%, then completed at 100%.
    assert "running, step 1/2 (v1 50% / v2 50%)" in lines[0], out
    assert "completed" in lines[-2] and "version 2 is current" in lines[-1], out
    assert current(host, "ro/cli") == 2
    shown = ok(polyserve("rollout", "ro/cli", url=host.url))
    assert shown.startswith("ro/cli v1 -> v2: completed"), shown
    # Pause and abort a second one through the command.
    third = tmp_path / "three.py"
    third.write_text(source("three"))
    ok(polyserve("deploy", str(third), "--space", "ro/cli", "--no-current", url=host.url))
    ok(
        polyserve(
            "rollout", "ro/cli", "--version", "3", "--step-s", "3600", "--no-watch", url=host.url
        )
    )
    assert "paused" in ok(polyserve("rollout", "ro/cli", "--pause", url=host.url))
    assert "aborted" in ok(polyserve("rollout", "ro/cli", "--abort", url=host.url))
    refused = polyserve("rollout", "ro/cli", "--resume", url=host.url)
    assert refused.returncode == 1 and "is over (aborted)" in refused.stderr
