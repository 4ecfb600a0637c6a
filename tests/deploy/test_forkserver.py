"""The validation fork server: it survives what tenants' validations do, hands out children
that get no secrets and run the tenant's code (it never does), and never blocks a deploy:
without it, a deploy spawns its validator as before."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from polyserve.deploy import forkclient, forkloop, forkserver, forkspares, sandbox
from polyserve.deploy.validate import validate
from polyserve.errors import ClientError
from tests.helpers import (
    FORKSERVER,
    RECVMSG,
    HostProcess,
    alive,
    children,
    holders,
    module_host,
    parent,
    running_forkserver,
    until,
)

ADMIN = "forkserver-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
GOOD = "def handle(request):\n    return 'ok'\n"

fs_host = module_host(
    "fs_host",
    workers=1,
    POLYSERVE_DEPLOY_TOKEN=ADMIN,
    POLYSERVE_IMPORT_TIMEOUT="3",
    POLYSERVE_CHECKPOINT_INTERVAL="0.2",  # how soon the master restarts a dead server
)


@pytest.fixture(scope="module")
def server() -> Iterator[forkserver.ForkServer]:
    """One fork server shared by the unit tests that do not kill it."""
    with running_forkserver() as s:
        yield s


def check(tmp_path: Path, name: str, source: str, timeout: float = 20) -> dict[str, object]:
    (tmp_path / "main.py").write_text(source)
    return asyncio.run(validate(tmp_path, "main.py", timeout, 4096, forkserver=name))


@contextlib.contextmanager
def importing(
    tmp_path: Path, run: Callable[[str], object], tag: str = "held"
) -> Iterator[tuple[int, list[object]]]:
    """Run `run(source)` in a thread, with a module that keeps a file open while it is
    imported, until released: yields the pid of the process that imports it (and the
    list `run`'s result goes in); on leaving, releases the import and waits for `run`."""
    held, go = tmp_path / f"{tag}-file", tmp_path / f"{tag}-go"
    held.touch()
    source = (
        "import os, time\n"
        f"_held = open({str(held)!r})\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.01)\n" + GOOD
    )
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(run(source)))
    thread.start()
    try:
        (pid,) = until(lambda: holders(held), what="the import to start")
        yield pid, results
    finally:
        go.touch()
        thread.join()


def kept_by(pid: int) -> int:
    """The process that forked the validation `pid` and keeps it (polyserve.deploy.sandbox):
    the parent the validation itself cannot see."""
    return parent(pid)


def waits_for(own: Path, other: Path) -> str:
    """A module that marks `own` at import, then waits (bounded) until `other` exists:
    two of them validate only if both validations run at the same time."""
    return (
        "import os, time\n"
        f"open({str(own)!r}, 'w').close()\n"
        "for _ in range(1000):\n"
        f"    if os.path.exists({str(other)!r}):\n"
        "        break\n"
        "    time.sleep(0.01)\n"
        "else:\n"
        "    raise RuntimeError('the other validation never ran beside this one')\n" + GOOD
    )


# -- the server alone -------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "import time\ntime.sleep(60)\n",
        "import ctypes\nctypes.string_at(0)\n",
        "import os\nos._exit(3)\n",
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    ],
    ids=["hang", "segfault", "os._exit", "SIGKILL"],
)
def test_the_server_serves_the_next_validation_after_a_failing_one(tmp_path, server, source):
    """A validation that hangs or ends its process is a 422; the server forks the next."""
    with pytest.raises(ClientError) as err:
        check(tmp_path, server.name, source, timeout=1)
    assert err.value.status == 422
    assert server.proc.poll() is None
    assert check(tmp_path, server.name, GOOD)["kind"] == "handle"


def test_a_child_that_ends_as_its_client_hangs_up_leaves_the_loop_serving():
    """A child's exit and its client's hang-up in one select: reaping the child closes
    the client, and the hang-up, stale by then, is skipped (it ended the server once)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(f"\0polyserve-test-{os.getpid()}")
        listener.listen(1)
        listener.setblocking(False)
        server = forkloop.Server(listener, os.getppid())
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        pidfd = os.pidfd_open(pid)
        server.children[pid] = (theirs, pidfd)
        server.selector.register(pidfd, selectors.EVENT_READ, pid)
        server.selector.register(theirs, selectors.EVENT_READ, ("running", pid))
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # the exit is ready first
        ours.close()  # then the hang-up
        events = server.selector.select(timeout=5)
        assert {key.data for key, _ in events} == {pid, ("running", pid)}
        server.step()  # raised ValueError before: unregistering a closed socket
        assert server.children == {} and theirs.fileno() == -1
        assert list(server.selector.get_map()) == [listener.fileno()]
        server.selector.close()


# A master that starts a fork server (as the real one does, in a session of its own) and
# dies `delay` s later, while the server is still starting or warming up.
DYING_MASTER = """
import os, subprocess, sys, time
argv = [sys.executable, "-m", "polyserve.deploy.forkserver", sys.argv[1], str(os.getpid())]
server = subprocess.Popen(
    [*argv, "numpy,onnxruntime"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
)
print(server.pid, flush=True)
time.sleep(float(sys.argv[2]))
os._exit(0)
"""


def test_the_server_loop_ends_when_its_master_is_gone(monkeypatch):
    """Between selects the loop looks at its parent: a lost SIGTERM cannot keep it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(f"\0polyserve-test-loop-{os.getpid()}")
        listener.listen(1)
        server = forkloop.Server(listener, master=os.getppid())
        parents = iter([os.getppid(), os.getppid(), 1])  # the master dies after two selects
        monkeypatch.setattr(forkloop.os, "getppid", lambda: next(parents))
        monkeypatch.setattr(forkloop, "_PARENT_CHECK_S", 0.01)
        server.run()  # returns: before, it served on
        server.selector.close()


def test_fork_servers_whose_masters_die_while_they_start_all_exit():
    """Masters that die 0.1 to 1.0 s after starting their fork servers, at once: each
    server exits. A SIGTERM of PR_SET_PDEATHSIG that landed during the warm-up's imports
    was swallowed with the import's error, and the server served on, an orphan."""
    masters = [
        subprocess.Popen(
            [sys.executable, "-c", DYING_MASTER, f"polyserve-test-orphan-{os.getpid()}-{i}",
             str(i / 10)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(1, 11)
    ]  # fmt: skip
    servers = [int(m.communicate(timeout=60)[0]) for m in masters]
    try:
        until(lambda: not any(alive(pid) for pid in servers), 60, "every fork server to exit")
    finally:
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_validation_runs_in_a_child_of_the_server_not_in_it(tmp_path, server):
    """The tenant module is imported by the child of a keeper the server forked, never by
    the server itself."""
    with importing(tmp_path, lambda source: check(tmp_path, server.name, source)) as (pid, _):
        keeper = kept_by(pid)
        assert parent(keeper) == server.proc.pid and server.proc.pid not in (pid, keeper)


def the_spares(server: forkserver.ForkServer, other_than: set[int] = frozenset()) -> set[int]:
    """The server's children while no validation runs: the keepers of the spares it forked
    ahead, once there are as many as it keeps (and none of them is in `other_than`)."""

    def all_of_them() -> set[int] | None:
        found = set(children(server.proc.pid))
        return found if len(found) == forkserver.SPARES and not found & other_than else None

    return until(all_of_them, what="the fork server's spare children")


def warm(spares: set[int]) -> None:
    until(lambda: all(map(waiting_for_its_request, spares)), what="the spares to be warm")


def validation_of(keeper: int) -> int:
    """The validation a spare's keeper forked (its one child)."""
    (pid,) = until(lambda: children(keeper), what="the keeper's validation")
    return pid


def waiting_for_its_request(keeper: int) -> bool:
    """Warm: the spare's validation is in the read of its request."""
    syscall = Path(f"/proc/{validation_of(keeper)}/syscall").read_text()
    return syscall.split()[0] == str(RECVMSG)


def test_validations_run_in_the_spares_forked_ahead_and_others_follow(tmp_path):
    """The server forks its next children before they are asked for: a validation runs
    in one, and one right after it in the other. Once no validation runs it forks
    spares again; stopping the server stops them too."""
    with running_forkserver() as server:
        spares = the_spares(server)
        warm(spares)
        keepers = []
        for tag in ("first", "second"):
            run = lambda source: check(tmp_path, server.name, source)  # noqa: E731
            with importing(tmp_path, run, tag) as (pid, _):
                keepers.append(kept_by(pid))
        assert set(keepers) == spares
        following = the_spares(server, other_than=spares)
    until(lambda: not any(map(alive, following)), what="the spares to go with their server")


def test_killed_spares_leave_the_server_forking_on_demand(tmp_path):
    with running_forkserver() as server:
        spares = the_spares(server)
        for pid in spares:
            os.kill(pid, signal.SIGKILL)
        until(lambda: not spares & set(children(server.proc.pid)), what="the spares reaped")
        with importing(tmp_path, lambda source: check(tmp_path, server.name, source)) as (v, _):
            keeper = kept_by(v)
            assert parent(keeper) == server.proc.pid and keeper not in spares
        the_spares(server, other_than={keeper, *spares})  # and after it, spares again


def test_stopped_spares_are_not_handed_requests_but_replaced(tmp_path):
    """A validation that can see the spares (without namespaces) may stop them: one that
    is stopped would never read its request, and another tenant's deploy would wait for
    its timeout. The server kills stopped spares, forks the request's child on demand,
    and forks new spares."""
    with running_forkserver() as server:
        spares = the_spares(server)
        warm(spares)
        stopped = [validation_of(keeper) for keeper in spares]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        # kill() returns before the signal is taken: a spare the server still sees running
        # is handed the request, and the deploy takes the slow way after _TAKE_S.
        until(lambda: all(map(sandbox.stopped, stopped)), what="the spares to be stopped")
        with importing(tmp_path, lambda source: check(tmp_path, server.name, source)) as (v, _):
            keeper = kept_by(v)
            assert parent(keeper) == server.proc.pid and keeper not in spares
        the_spares(server, other_than={keeper, *spares})


def test_a_spare_that_does_not_take_its_request_is_killed_and_reports_no_exit_status(
    monkeypatch,
):
    """A spare that has not read its request after _TAKE_S (stopped just as it was handed
    it) is killed; as when the server dies, its worker gets no exit status and validates
    in a new interpreter rather than answer 422 for the tenant's code, which never ran."""
    monkeypatch.setattr(forkspares, "_TAKE_S", 0)
    # This process is the server here: its other children are not strays to kill.
    monkeypatch.setattr(forkloop.procs, "children", lambda pid: [])
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        name = f"polyserve-test-take-{os.getpid()}"
        listener.bind("\0" + name)
        listener.listen(1)
        listener.setblocking(False)
        server = forkloop.Server(listener, os.getppid())
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # a warm spare that holds its socket and never reads what it is handed
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # nothing of this test's output may wait for it
                os.dup2(null, fd)
            os.closerange(3, theirs.fileno())
            os.closerange(theirs.fileno() + 1, 1 << 16)
            signal.pause()
            os._exit(0)
        theirs.close()
        try:
            until(lambda: os.getsid(pid) == pid, what="the spare's group")  # what is killed
            pidfd = os.pidfd_open(pid)
            server.selector.register(pidfd, selectors.EVENT_READ, pid)
            ours.setblocking(False)
            server.selector.register(ours, selectors.EVENT_READ, ("spare", pid))
            server.spares.ahead[pid] = forkspares.Spare(ours, pidfd, warm=True)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
                client.connect("\0" + name)
                out_r, out_w = os.pipe()
                request = json.dumps({"argv": ["/nonexistent", "main.py", "64", "1"]})
                socket.send_fds(client, [request.encode()], [out_w, out_w])
                os.close(out_w)
                server.step(5)  # the connection
                server.step(5)  # its request, handed to the spare
                assert json.loads(client.recv(1024)) == {"pid": pid}
                server.kill_overdue()  # past _TAKE_S: killed
                until(lambda: server.step(0) or not server.spares.untaken, what="the spare reaped")
                assert client.recv(1024) == b""  # no exit status: the end of the connection
                os.close(out_r)
        finally:
            if pid in server.spares.ahead or pid in server.children:  # not reaped: still its pid
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        server.selector.close()


def test_the_spares_hold_none_of_the_servers_sockets(server):
    """Their sockets are their own (the one a request comes on, their event loop's): the
    listener and the clients' sockets stay the server's, so tenant code reaches none."""

    def sockets(pid: int) -> set[str]:
        links = (os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
        return {link for link in links if link.startswith("socket:")}

    spares = the_spares(server)
    warm(spares)
    for keeper in spares:
        assert not sockets(keeper), "a keeper holds a socket"
        pid = validation_of(keeper)
        assert sockets(pid), "a spare has no socket to read its request on"
        assert not sockets(pid) & sockets(server.proc.pid)


def test_a_client_that_never_asks_delays_no_validation(tmp_path, server):
    """A connection that sends nothing leaves the server forking for everyone else."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as idle:
        idle.connect("\0" + server.name)
        assert check(tmp_path, server.name, GOOD)["kind"] == "handle"


def test_validations_run_side_by_side(tmp_path, server):
    """Two validations asked for at once run at the same time (each waits for the other)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    (a / "main.py").write_text(waits_for(tmp_path / "a-started", tmp_path / "b-started"))
    (b / "main.py").write_text(waits_for(tmp_path / "b-started", tmp_path / "a-started"))

    async def both() -> list[dict[str, object]]:
        return await asyncio.gather(
            *(validate(d, "main.py", 20, 4096, forkserver=server.name) for d in (a, b))
        )

    assert [r["kind"] for r in asyncio.run(both())] == ["handle", "handle"]


def test_a_fork_cancelled_mid_handshake_leaves_no_descriptor_open(server):
    """A deploy given up while the server forks closes every pipe and socket it opened."""

    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    async def cancelled_forks() -> None:
        for delay in (0, 0.0005, 0.002, 0.01):
            task = asyncio.ensure_future(
                forkclient.fork(server.name, ["/nonexistent", "main.py", "64", "1"], None)
            )
            await asyncio.sleep(delay)
            task.cancel()
            forked = None
            with contextlib.suppress(asyncio.CancelledError):
                forked = await task
            if forked is not None:  # it finished before the cancel: close it as a caller does
                forked.close()
        await asyncio.sleep(0)  # let closed transports finish closing

    before = open_fds()
    asyncio.run(cancelled_forks())
    assert open_fds() == before


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_a_process_of_another_user_gets_no_child(tmp_path, server):
    """The abstract socket has no file permissions: the server checks the peer's uid."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.setuid(65534)  # nobody
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect("\0" + server.name)
                _, out_w = os.pipe()
                request = json.dumps({"argv": [str(tmp_path), "main.py", "64", "1"]}).encode()
                socket.send_fds(s, [request], [out_w, out_w])
                os.write(write, b"answer: " + s.recv(1024))
        except OSError as exc:  # the server hung up on it
            os.write(write, f"refused: {exc!r}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    got = os.read(read, 1024)
    os.close(read)
    assert got == b"answer: " or got.startswith(b"refused: "), got


def test_a_validation_whose_server_is_killed_still_answers(tmp_path):
    """SIGKILL of the server mid-validation: the deploy validates in a new interpreter."""
    held, go = tmp_path / "held", tmp_path / "go"
    held.touch()
    (tmp_path / "main.py").write_text(
        "import os, time\n"
        f"_held = open({str(held)!r})\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.01)\n" + GOOD
    )
    keepers = []
    with running_forkserver() as s:

        async def kill_then_release() -> dict[str, object]:
            task = asyncio.create_task(validate(tmp_path, "main.py", 20, 4096, forkserver=s.name))
            while not (importing := holders(held)):
                await asyncio.sleep(0.01)
            (first,) = importing
            keepers.append((kept_by(first), parent(kept_by(first))))
            os.kill(s.proc.pid, signal.SIGKILL)
            # The first validation dies with its server, but may hold the file a moment
            # longer, orphaned: only a holder other than it is the new interpreter.
            while alive(s.proc.pid) or alive(first):
                await asyncio.sleep(0.01)
            while not (importing := holders(held) - {first}):
                await asyncio.sleep(0.01)
            (second,) = importing
            keepers.append((kept_by(second), parent(kept_by(second))))
            go.touch()
            return await task

        assert asyncio.run(kill_then_release())["kind"] == "handle"
    # First forked by the server, then spawned by this process.
    assert [by for _, by in keepers] == [s.proc.pid, os.getpid()]


# -- through a host -------------------------------------------------------------------


def test_a_deploy_validates_in_a_child_of_the_hosts_fork_server(fs_host, tmp_path):
    """The deploy's validation is forked by the master's fork server, which imports nothing
    of the tenant's: the process that imports the module is its keeper's child."""
    server = fs_host.forkserver_pid()  # once warm: until then, deploys spawn
    deploy = lambda source: fs_host.deploy("fs/who", source, headers=AUTH)  # noqa: E731
    with importing(tmp_path, deploy) as (pid, answers):
        keeper = kept_by(pid)
        assert parent(keeper) == server and server not in (pid, keeper)
    assert answers[0].status_code == 200, answers[0].text


def test_the_validation_child_sees_no_host_secret(fs_host, tmp_path):
    """Neither os.environ nor the environment block the child started with holds the token."""
    seen = tmp_path / "seen"
    source = (
        "import os\n"
        # Imported once: no request loads it in the worker.
        f"with open({str(seen)!r}, 'w') as f:\n"
        "    f.write(open('/proc/self/environ').read().replace('\\0', '\\n'))\n"
        "    f.write('\\n'.join(os.environ))\n" + GOOD
    )
    fs_host.forkserver_pid()
    r = fs_host.deploy("fs/env", source, headers=AUTH)
    assert r.status_code == 200, r.text
    text = seen.read_text()
    assert "PATH" in text and "POLYSERVE_DEPLOY_TOKEN" not in text and ADMIN not in text


@pytest.mark.parametrize(
    "source,what",
    [
        ("def handle(r):\n  return (\n", "SyntaxError"),
        ("1 / 0\n", "ZeroDivisionError"),
        ("import time\ntime.sleep(60)\n", "within 3 s"),
        ("import os\nos._exit(7)\n", "exit code 7"),
        ("import ctypes\nctypes.string_at(0)\n", "SIGSEGV"),
        ("blob = bytearray(8 << 30)\n", "address-space limit"),
    ],
    ids=["syntax", "exception", "hang", "os._exit", "segfault", "memory"],
)
def test_a_failing_validation_leaves_the_fork_server_and_host_serving(fs_host, source, what):
    """Each failure is a clear 422; the same fork server then validates the next deploy,
    and the host serves it."""
    server = fs_host.forkserver_pid()
    assert fs_host.deploy("fs/bad", GOOD, headers=AUTH).status_code == 200
    r = fs_host.deploy("fs/bad", source, headers=AUTH)
    assert r.status_code == 422 and what in r.json()["error"], r.text
    assert fs_host.get("/s/fs/bad/").text == "ok"  # the previous version still serves
    assert fs_host.forkserver_pid() == server
    r = fs_host.deploy("fs/bad", GOOD.replace("'ok'", "'next'"), headers=AUTH)
    assert r.status_code == 200 and fs_host.get("/s/fs/bad/").text == "next"


def test_concurrent_deploys_validate_side_by_side(fs_host, tmp_path):
    """Two deploys to one worker at once: both validations run at the same time."""
    fs_host.forkserver_pid()  # warm, so both are forked
    a, b = tmp_path / "a", tmp_path / "b"
    sources = {"fs/left": waits_for(a, b), "fs/right": waits_for(b, a)}
    codes: dict[str, int] = {}

    def deploy(space: str) -> None:
        codes[space] = fs_host.deploy(space, sources[space], headers=AUTH).status_code

    threads = [threading.Thread(target=deploy, args=(space,)) for space in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == {"fs/left": 200, "fs/right": 200}


def test_a_deploy_right_after_the_fork_server_is_killed_answers_200(fs_host):
    """SIGKILL the fork server: the next deploy still validates (spawned, or forked by its
    replacement) and publishes."""
    os.kill(fs_host.forkserver_pid(), signal.SIGKILL)
    r = fs_host.deploy("fs/after-kill", GOOD, headers=AUTH)
    assert r.status_code == 200, r.text
    assert fs_host.get("/s/fs/after-kill/").text == "ok"


def test_the_master_starts_a_new_fork_server_when_one_dies(fs_host):
    """A killed fork server is replaced, and deploys validate through the new one."""
    old = fs_host.forkserver_pid()
    os.kill(old, signal.SIGKILL)
    until(lambda: not alive(old), what="the old fork server to go")
    assert fs_host.forkserver_pid() != old
    assert fs_host.deploy("fs/restarted", GOOD, headers=AUTH).status_code == 200


def forkserver_children(host: HostProcess) -> list[int]:
    return [pid for pid, args in host._children().items() if FORKSERVER in args]


def test_stopping_the_host_leaves_no_fork_server(host_factory):
    """The master stops its fork server on exit."""
    host = host_factory(workers=1)
    pid = host.forkserver_pid()
    host.stop()
    assert not alive(pid)


def test_a_master_killed_with_sigkill_takes_its_fork_server_along(host_factory):
    """The fork server dies with its master, however the master ends."""
    host = host_factory(workers=1)
    pid = host.forkserver_pid()
    host.proc.kill()
    host.proc.wait()
    until(lambda: not alive(pid), what="the fork server to follow its master")


def test_with_the_fork_server_off_deploys_spawn_their_validator(host_factory, tmp_path):
    """POLYSERVE_VALIDATE_FORKSERVER=0: no fork server, and the validator is a new
    interpreter whose parent is the worker."""
    host = host_factory(workers=1, POLYSERVE_VALIDATE_FORKSERVER="0")
    with importing(tmp_path, lambda source: host.deploy("fs/off", source)) as (pid, answers):
        assert parent(kept_by(pid)) in host.worker_pids() and forkserver_children(host) == []
    assert answers[0].status_code == 200
