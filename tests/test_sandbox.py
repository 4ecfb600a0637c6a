"""The fleet's URL, against real hosts: no environment a validation or a space reads
holds it (a space can read the worker's memory, where the URL has to be)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from tests.helpers import HostProcess, descendants

ADMIN = "sandbox-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
GOOD = "def handle(request):\n    return 'ok'\n"
QUICK = {"POLYSERVE_DEPLOY_TOKEN": ADMIN, "POLYSERVE_IMPORT_TIMEOUT": "5"}


# -- the fleet's URL --------------------------------------------------------------------

# What a validation's or a space's code can read of the host's environments: its own
# os.environ, and /proc/<pid>/environ of every process of its host it can see (the master,
# found up its parents, and the master's descendants; without a visible parent, in a PID
# namespace of its own, whatever /proc shows).
PROBE = """
import json, os

def parent_of(pid):
    stat = open(f"/proc/{pid}/stat", "rb").read()
    return int(stat[stat.rindex(b")") + 2 :].split()[1])

def host_processes():
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    master = os.getppid()
    while master > 1 and b"gunicorn: master" not in open(f"/proc/{master}/cmdline", "rb").read():
        master = parent_of(master)
    if master <= 1:
        return pids, False
    parents = {}
    for pid in pids:
        try:
            parents[pid] = parent_of(pid)
        except OSError:
            pass
    ours = {master}
    while grown := {p for p, up in parents.items() if up in ours} - ours:
        ours |= grown
    return sorted(ours), True

def probe():
    pids, found_master = host_processes()
    seen = {}
    for pid in pids:
        try:
            command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ")
            seen[command.decode(errors="replace")] = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            pass
    leaks = [c for c, env in seen.items() if b"DATABASE_URL=" in env or b"postgresql:" in env]
    if any("DATABASE_URL" in k or "postgresql:" in v for k, v in os.environ.items()):
        leaks.append("os.environ")
    return {"commands": sorted(seen), "master": found_master, "leaks": leaks}
"""


def fleet_host(host_factory, url: str, **env: str) -> HostProcess:
    return host_factory(
        workers=1,
        POLYSERVE_DATABASE_URL=url,
        POLYSERVE_HOST_ID="sb",
        POLYSERVE_FLEET_POLL_S="0.5",
        **QUICK,
        **env,
    )


def host_environments(host: HostProcess) -> dict[str, bytes]:
    """The kernel's copy of the environment of each of the host's processes (the master
    and its descendants: workers, follower, fork server, spares), as a validation of a
    host run as a plain user could read them all (a process of the same user, with no
    capabilities to compare)."""
    found = {}
    for pid in {host.proc.pid, *descendants(host.proc.pid)}:
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            found[command.decode(errors="replace")] = Path(f"/proc/{pid}/environ").read_bytes()
    return found


@pytest.mark.gunicorn
def test_no_environment_a_validation_reads_holds_the_fleets_url(host_factory, fleet_db, tmp_path):
    """The follower got the URL in its environment, where /proc/<pid>/environ showed it
    to the validation, which returned it in the 422's body: no host process's
    environment may hold it, nor may the validation's own."""
    host = fleet_host(host_factory, fleet_db)
    seen = tmp_path / "seen.json"
    source = (
        PROBE
        + f"open({str(seen)!r}, 'w').write(json.dumps(probe()))\n"
        + "raise RuntimeError(json.dumps(probe()))\n"
    )
    r = host.deploy("sb/probe", source, headers=AUTH)
    assert r.status_code == 422, r.text
    assert fleet_db not in r.text and "DATABASE_URL=" not in r.text
    found = json.loads(seen.read_text())
    assert found["leaks"] == [] and found["commands"], found  # it read its own, at least
    assert found["master"]
    environments = host_environments(host)
    assert any("fleet.follower" in command for command in environments)
    for command, environ in environments.items():
        assert b"DATABASE_URL=" not in environ and fleet_db.encode() not in environ, command


@pytest.mark.gunicorn
def test_no_environment_a_space_in_a_worker_reads_holds_the_fleets_url(host_factory, fleet_db):
    """A worker's os.environ held the URL (the master's, inherited), and so did the
    follower's /proc/<pid>/environ. A space can still read the worker's memory, where the
    URL has to be: the README says so."""
    host = fleet_host(host_factory, fleet_db)
    source = PROBE + "def handle(request):\n    return probe()\n"
    r = host.deploy("sb/probe", source, headers=AUTH)
    assert r.status_code == 200, r.text
    r = host.get("/s/sb/probe/")
    assert r.status_code == 200 and fleet_db not in r.text
    found = r.json()
    assert found["leaks"] == [], found
    assert found["master"] and any("fleet.follower" in c for c in found["commands"])


@pytest.mark.gunicorn
def test_a_host_reads_the_fleets_url_from_a_file(host_factory, fleet_db, tmp_path):
    """POLYSERVE_DATABASE_URL_FILE: the URL is in no environment from the start, and the
    host is in the fleet (its worker and its follower got the URL)."""
    path = tmp_path / "database-url"
    path.write_text(fleet_db + "\n")
    host = host_factory(
        workers=1,
        POLYSERVE_DATABASE_URL_FILE=str(path),
        POLYSERVE_HOST_ID="sb-file",
        POLYSERVE_FLEET_POLL_S="0.5",
        **QUICK,
    )
    r = host.deploy("sb/filed", GOOD, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["hosts"] == {"applied": 1, "live": 1}
    assert host.get("/s/sb/filed/").text == "ok"
