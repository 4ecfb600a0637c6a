"""A fleet host's table slots go to the spaces it serves: a deploy moves its pointer
without a slot, a space's first request here takes one, and a full table hands over the
slot of a space no worker holds, with billing exact by name across hand-overs.

Real gunicorn hosts and a real PostgreSQL, as in test_fleet.py (whose helpers these are).
"""

from __future__ import annotations

from tests.fleet.test_fleet import (
    FAST,
    _client,  # noqa: F401  (test_fleet's shared client, autouse: its helpers use it)
    deployed,
    fleet_usage,
    get,
    start_fleet,
    version,
    wait_live,
    write,
)
from tests.helpers import HostProcess, until

EVERYONE = {"applied": 2, "live": 2}


def slot_owners(host: HostProcess) -> set[str]:
    """The spaces that own a slot of the host's table, as its slots.log says."""
    owners: dict[int, str] = {}
    for line in (host.data_dir / "slots.log").read_text().splitlines():
        number, space, *_ = line.split("\t")
        owners[int(number)] = space  # a later line hands the slot over
    return set(owners.values())


def local_requests(host: HostProcess) -> dict[str, int]:
    spaces = get(host, "/_polyserve/usage").json()["spaces"]
    return {space: fields["requests"] for space, fields in spaces.items()}


def ledger_reaches(host: HostProcess, answered: dict[str, int]) -> None:
    """Wait until the fleet's usage (through `host`) has exactly `answered` requests for
    each of those spaces."""

    def ledger() -> dict[str, int]:
        found = fleet_usage(host)["spaces"]
        return {space: found.get(space, {}).get("requests", 0) for space in answered}

    until(lambda: ledger() == answered, what=f"the fleet's ledger to reach {answered}")


def test_a_host_holds_slots_only_for_the_spaces_it_has_served(host_factory, fleet_db):
    """30 spaces deployed through A: B takes no slot for any of them, serves a space it
    never served on its first request (taking its slot then), and after a new deploy of
    it and of one it never served serves only the new versions."""
    a, b = start_fleet(host_factory, fleet_db, "ab")
    spaces = [f"lee/s{i}" for i in range(30)]
    for space in spaces:
        deployed(a, space, 1, EVERYONE)
    assert slot_owners(b) == set()
    assert local_requests(b) == {}

    served = spaces[:3]
    for space in served:
        assert version(b, space) == 1
    assert slot_owners(b) == set(served)
    assert local_requests(b) == {space: 1 for space in served}

    deployed(a, "lee/s0", 2, EVERYONE)  # one B serves
    deployed(a, "lee/s9", 2, EVERYONE)  # one B never served
    assert slot_owners(b) == set(served)  # a deploy takes no slot
    assert [version(b, "lee/s0") for _ in range(3)] == [2] * 3
    assert [version(b, "lee/s9") for _ in range(3)] == [2] * 3
    assert version(b, "lee/s10") == 1
    assert slot_owners(b) == {*served, "lee/s9", "lee/s10"}


def test_a_host_with_fewer_slots_than_the_fleet_has_spaces_serves_them_all_in_turn(
    host_factory, fleet_db
):
    """B has POLYSERVE_MAX_SPACES=2 in a fleet of 6 spaces: every deploy is taken (the
    fleet's count of spaces is no limit of a host that serves what it is asked). With two
    spaces loaded, a third answers 503 with Retry-After and a JSON body; once one is
    released, the third takes its slot. Served in turn, twice round, the usage by name on
    B and in the fleet's ledger counts exactly the requests that were answered."""
    a = start_fleet(host_factory, fleet_db, "a")[0]
    env = {"POLYSERVE_HOST_ID": "b", "POLYSERVE_MAX_SPACES": "2", **FAST}
    b = host_factory("b", workers=1, POLYSERVE_DATABASE_URL=fleet_db, **env)
    wait_live(a, {"a", "b"})
    spaces = [f"lee/t{i}" for i in range(6)]
    for space in spaces:
        deployed(a, space, 1, EVERYONE)  # not refused for B's two slots

    answered = dict.fromkeys(spaces, 0)
    assert version(b, spaces[0]) == version(b, spaces[1]) == 1
    answered[spaces[0]] += 1
    answered[spaces[1]] += 1
    r = get(b, f"/s/{spaces[2]}/")
    assert r.status_code == 503, r.text
    assert r.json()["space"] == spaces[2] and "no slot on this host" in r.json()["error"]
    assert int(r.headers["retry-after"]) > 0

    loaded = [spaces[0], spaces[1]]
    for turn in range(2):
        for i, space in enumerate(spaces):
            if space in loaded:
                continue
            # Release the one loaded longest: its slot is the only one to hand over.
            oldest = loaded.pop(0)
            assert write(a, "POST", f"/_polyserve/spaces/{oldest}/release").status_code == 200
            first = take_a_slot(b, space)
            assert first == 1
            n = 3 + i + turn
            for _ in range(n - 1):
                assert version(b, space) == 1
            answered[space] += n
            loaded.append(space)
            assert slot_owners(b) <= set(spaces) and len(slot_owners(b)) == 2
    assert local_requests(b) == answered

    for space in spaces[:2]:  # A's requests are billed beside B's
        assert version(a, space) == 1
        answered[space] += 1

    ledger_reaches(a, answered)


def take_a_slot(host: HostProcess, space: str) -> int:
    """The version `space` answers once a space of the host's has been let go (until
    then its first request may find every slot held: a 503, counted nowhere)."""
    found: list[int] = []

    def served() -> bool:
        r = get(host, f"/s/{space}/")
        if r.status_code == 503:
            assert "no slot on this host" in r.json()["error"], r.text
            return False
        assert r.status_code == 200, r.text
        found.append(r.json()["v"])
        return True

    until(served, what=f"{space} to take a released space's slot")
    return found[0]


def test_spaces_released_when_idle_hand_their_slots_to_the_next_ones(host_factory, fleet_db):
    """A fleet host with POLYSERVE_MAX_SPACES=2 and POLYSERVE_IDLE_TTL=0.5, 5 spaces
    called one after another, twice round: each gets a slot once an earlier one was
    released for being idle (until then a 503, counted nowhere), and the usage by name,
    on the host and in the fleet's ledger, counts exactly the requests answered."""
    (b,) = start_fleet(
        host_factory, fleet_db, "b", POLYSERVE_MAX_SPACES="2", POLYSERVE_IDLE_TTL="0.5"
    )
    spaces = [f"lee/i{i}" for i in range(5)]
    for space in spaces:
        deployed(b, space, 1, {"applied": 1, "live": 1})
    answered = dict.fromkeys(spaces, 0)
    for turn in range(2):
        for i, space in enumerate(spaces):
            assert take_a_slot(b, space) == 1
            n = 2 + i + turn
            for _ in range(n - 1):
                assert version(b, space) == 1
            answered[space] += n
    assert local_requests(b) == answered
    assert len(slot_owners(b)) == 2

    ledger_reaches(b, answered)
