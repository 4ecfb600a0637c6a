"""The validation sandbox, against real hosts: a validation's code leaves no process
behind, cannot find the fork server or its spares in namespaces of its own, and without
them stops nothing for long (a stopped server is replaced, stopped spares are passed
over); no environment a validation or a space reads holds the fleet's URL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import pytest

from polyserve.deploy import forkclient, forkserver, sandbox
from tests.helpers import (
    HostProcess,
    alive,
    descendants,
    holders,
    module_host,
    running_forkserver,
    until,
    warm_spares,
)

ADMIN = "sandbox-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
GOOD = "def handle(request):\n    return 'ok'\n"
QUICK = {
    "POLYSERVE_DEPLOY_TOKEN": ADMIN,
    "POLYSERVE_IMPORT_TIMEOUT": "5",
    "POLYSERVE_CHECKPOINT_INTERVAL": "0.2",  # how soon the master replaces its server
}

ns_host = module_host("ns_host", workers=1, **QUICK)
plain_host = module_host("plain_host", workers=1, POLYSERVE_VALIDATE_NAMESPACES="0", **QUICK)
MODES = {"namespaces": "ns_host", "processes": "plain_host"}


@pytest.fixture(params=list(MODES))
def sandboxed(request: pytest.FixtureRequest) -> HostProcess:
    """Each test on a host whose validations run in namespaces, and on one without."""
    return request.getfixturevalue(MODES[request.param])


# What a validation's code does to find the fork server: walk up its parents while they
# are the fork server's processes (its keeper, then the server). In a PID namespace of
# its own its parent is outside it: getppid() is 0, and nothing is found.
ANCESTORS = """
import os, signal

def parent_of(pid):
    stat = open(f"/proc/{pid}/stat", "rb").read()
    return int(stat[stat.rindex(b")") + 2 :].split()[1])

ancestors = []
pid = os.getppid()
while pid > 1 and b"polyserve.deploy.forkserver" in open(f"/proc/{pid}/cmdline", "rb").read():
    ancestors.append(pid)
    pid = parent_of(pid)
"""


def escaping(held: Path, started: Path) -> str:
    """A module whose import double-forks a process that detaches as a daemon does (a
    session of its own, no descriptors of its parent's), keeps `held` open and runs on;
    the import then fails."""
    return f"""
import os, time
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 1 << 16)
        held = open({str(held)!r})
        open({str(started)!r}, "w").close()
        while True:
            time.sleep(1)
    os._exit(0)
os.waitpid(pid, 0)
while not os.path.exists({str(started)!r}):
    time.sleep(0.01)
raise RuntimeError("refused, with a process left running")
"""


@contextlib.contextmanager
def no_escapee_left(held: Path):
    """Whatever the test finds, no process holding `held` outlives it."""
    try:
        yield
    finally:
        for pid in holders(held):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def leaves_no_process(host: HostProcess, tmp_path: Path) -> None:
    """Deploy `escaping`: refused, and its detached process killed."""
    held, started = tmp_path / "held", tmp_path / "started"
    held.touch()
    with no_escapee_left(held):
        r = host.deploy("sb/escape", escaping(held, started), headers=AUTH)
        assert r.status_code == 422 and "refused" in r.json()["error"], r.text
        until(lambda: not holders(held), what="the detached process to be killed")


@pytest.mark.gunicorn
def test_an_import_that_double_forks_and_detaches_leaves_no_process(sandboxed, tmp_path):
    """setsid() escapes the process group the timeout used to kill: the namespace's end
    (or, without one, the keeper, the orphan's subreaper) kills the daemon anyway."""
    leaves_no_process(sandboxed, tmp_path)


@pytest.mark.gunicorn
@pytest.mark.parametrize("namespaces", ["1", "0"])
def test_a_spawned_validation_leaves_no_process_either(host_factory, tmp_path, namespaces):
    """Without the fork server, the spawned validator is the keeper."""
    env = {"POLYSERVE_VALIDATE_FORKSERVER": "0", "POLYSERVE_VALIDATE_NAMESPACES": namespaces}
    leaves_no_process(host_factory(workers=1, **env, **QUICK), tmp_path)


def stopping(mark: Path, whom: str) -> str:
    """A module whose import sends SIGSTOP to `whom` it can find (its ancestors up to the
    fork server, or the server's other descendants: its spares), writes their pids to
    `mark`, and imports fine."""
    spares = """
parents = {}
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        parents[int(p)] = parent_of(int(p))
    except OSError:
        pass
family = {ancestors[-1]} if ancestors else set()
while grown := {p for p, up in parents.items() if up in family} - family:
    family |= grown
targets = sorted(family - {os.getpid(), *ancestors})
"""
    return (
        ANCESTORS
        + (spares if whom == "spares" else "targets = ancestors\n")
        + "for p in targets:\n    os.kill(p, signal.SIGSTOP)\n"
        + f"open({str(mark)!r}, 'w').write(' '.join(map(str, targets)))\n"
        + GOOD
    )


@pytest.mark.gunicorn
def test_a_validation_that_stops_its_fork_server_delays_no_later_deploy(sandboxed, tmp_path):
    """In a PID namespace the validation cannot find its server (nothing is stopped);
    without one it can, and the master replaces the stopped server rather than let every
    later deploy wait for it."""
    mark = tmp_path / "stopped"
    server = sandboxed.forkserver_pid()
    for attempt in range(5):
        r = sandboxed.deploy(f"sb/stop-server{attempt}", stopping(mark, "ancestors"), headers=AUTH)
        assert r.status_code == 200, r.text
        stopped = [int(pid) for pid in mark.read_text().split()]
        # A worker whose handshake with the server timed out (a loaded machine) spawns
        # the validation instead: it has no server among its ancestors. Deploy again.
        if stopped or not without_namespaces(sandboxed):
            break
    if without_namespaces(sandboxed):
        # The ancestors are the spare, then the server: the server stopped is the one read
        # before the deploy, unless the master replaced a slow one meanwhile (a loaded
        # machine), and then the one read is gone.
        stopped_server = stopped[-1]
        assert stopped_server == server or not alive(server)
        until(lambda: not alive(stopped_server), what="the master to kill the stopped server")
        assert sandboxed.forkserver_pid() != stopped_server
    else:
        assert stopped == [] and sandboxed.forkserver_pid() == server
    r = sandboxed.deploy("sb/after-stop", GOOD, headers=AUTH)
    assert r.status_code == 200, r.text
    assert sandboxed.get("/s/sb/after-stop/").text == "ok"


def without_namespaces(host: HostProcess) -> bool:
    return host.extra_env.get("POLYSERVE_VALIDATE_NAMESPACES") == "0"


@pytest.mark.gunicorn
def test_a_validation_that_stops_the_spares_fails_no_other_deploy(sandboxed, tmp_path):
    """Stopped spares would take another tenant's request and never run it (a 422 at the
    import timeout): the server passes over them, and they are replaced."""
    mark = tmp_path / "stopped"
    warm_spares(sandboxed.forkserver_pid())
    r = sandboxed.deploy("sb/stop-spares", stopping(mark, "spares"), headers=AUTH)
    assert r.status_code == 200, r.text
    stopped = [int(pid) for pid in mark.read_text().split()]
    assert bool(stopped) == without_namespaces(sandboxed)
    r = sandboxed.deploy("sb/other-tenant", GOOD, headers=AUTH)
    assert r.status_code == 200, r.text
    assert sandboxed.get("/s/sb/other-tenant/").text == "ok"
    until(lambda: not any(map(alive, stopped)), what="the stopped spares to be killed")


# -- the fork server's side of it ----------------------------------------------------


def test_a_stopped_fork_server_is_replaced(tmp_path):
    """ensure() (the master's check) finds a stopped server and starts a new one."""
    with running_forkserver() as server:
        old = server.proc
        assert server.ensure() is None  # running and answering: left alone
        os.kill(old.pid, signal.SIGSTOP)
        until(lambda: sandbox.stopped(old.pid), what="the server to stop")
        assert server.ensure() == "stopped answering"
        assert old.poll() is not None and server.proc.pid != old.pid
        until(lambda: forkserver.listening(server.proc.pid), what="the new server")
        assert server.ensure() is None


def test_a_worker_does_not_wait_for_a_stopped_fork_server(monkeypatch, tmp_path):
    """fork() finds the server stopped and gives up at once (its caller spawns), where it
    waited HANDSHAKE_S for an answer that never came."""
    monkeypatch.setattr(forkclient, "HANDSHAKE_S", 3600.0)  # a wait would hang the test
    (tmp_path / "main.py").write_text(GOOD)
    with running_forkserver() as server:
        os.kill(server.proc.pid, signal.SIGSTOP)
        until(lambda: sandbox.stopped(server.proc.pid), what="the server to stop")
        try:
            argv = [str(tmp_path), "main.py", "4096", "20"]
            # The bound only stops a hang: a fix answers at once.
            got = asyncio.run(asyncio.wait_for(forkclient.fork(server.name, argv, None), 60))
            assert got is None
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)


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
@pytest.mark.parametrize("namespaces", ["1", "0"])
def test_no_environment_a_validation_reads_holds_the_fleets_url(
    host_factory, fleet_db, tmp_path, namespaces
):
    """The follower got the URL in its environment, where /proc/<pid>/environ showed it
    to the validation, which returned it in the 422's body. In namespaces of its own the
    validation sees only itself; without, as here (root), it runs with no capabilities
    and may not read processes that have some, but a host run as a plain user has none:
    no host process's environment may hold the URL."""
    host = fleet_host(host_factory, fleet_db, POLYSERVE_VALIDATE_NAMESPACES=namespaces)
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
    assert found["master"] == (namespaces == "0")  # its parents are out of its sight
    environments = host_environments(host)
    assert any("fleet.follower" in command for command in environments)
    for command, environ in environments.items():
        assert b"DATABASE_URL=" not in environ and fleet_db.encode() not in environ, command


@pytest.mark.gunicorn
def test_no_environment_a_space_in_a_worker_reads_holds_the_fleets_url(host_factory, fleet_db):
    """A worker's os.environ held the URL (the master's, inherited), and so did the
    follower's /proc/<pid>/environ. A space can still read the worker's memory, where the
    URL has to be: docs/honest-limit.md says so."""
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
