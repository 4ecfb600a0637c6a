"""A validation's sandbox: a keeper per validation, and namespaces where the host allows.

`contain()` is called in the process that is about to run a validation (a fork of the
fork server, or the spawned validator). That process becomes the validation's **keeper**:
it forks the validation and never runs tenant code itself. Where the host may make them,
the keeper first moves its future children into a PID and a mount namespace of their own
(with a user namespace when it lacks CAP_SYS_ADMIN): the validation is then process 1 of
a namespace that holds only what it started, sees a /proc of that namespace only, and can
neither see nor signal the fork server, its spares or any other host process. When it
ends, the kernel kills everything left in its namespace, however it was detached.

Where no namespace can be made, the keeper is a child subreaper: whatever the validation
double-forks and detaches (setsid() escapes the process group, not a subreaper) is
reparented to the keeper, which kills every child it has left once the validation ends.
The fork server is a subreaper too, and kills any child it did not fork itself: what a
validation left when its keeper was killed first.

Either way the validation runs with no capabilities and `no_new_privs`, and the keeper
exits as the validation did (its exit code, or the signal that ended it), so its parent
reads the validation's status from it. SIGTERM to the keeper ends the validation: it
kills it and what it left, then exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import select
import signal
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from polyserve import procs

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_PR_CAPBSET_DROP = 24
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_CAPABILITY_V3 = 0x20080522
EXIT_KEEPER_GONE = 70  # EX_SOFTWARE: the keeper died before the validation could start

_libc = ctypes.CDLL(None, use_errno=True)


def subreaper() -> None:
    """Make this process the reaper of its descendants' orphans."""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def contain(namespaces: bool, forked: Callable[[int], object] | None = None) -> bool:
    """Split this single-threaded process into a keeper and the validation; returns in
    the validation only: True when it runs in namespaces of its own. `forked` is called in
    the keeper with the validation's pid before the keeper closes every descriptor."""
    subreaper()
    isolated = namespaces and _unshare()
    alive_r, alive_w = os.pipe()  # ends when the keeper does
    pid = os.fork()
    if pid:
        os.close(alive_r)
        if forked is not None:
            with contextlib.suppress(OSError):
                forked(pid)
        _keep(pid, alive_w)
    os.close(alive_w)
    procs.die_with_parent(signal.SIGKILL)
    if select.select([alive_r], [], [], 0)[0]:  # the keeper died before the prctl
        os._exit(EXIT_KEEPER_GONE)
    os.close(alive_r)
    if isolated:
        _own_proc()
    _drop_privileges()
    return isolated


def _unshare() -> bool:
    """Give this process's next child PID and mount namespaces of its own: directly with
    CAP_SYS_ADMIN, else inside a user namespace that maps this user to itself."""
    if _libc.unshare(_CLONE_NEWPID | _CLONE_NEWNS) == 0:
        return True
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWNS) != 0:
        return False  # no user namespaces here (or a seccomp filter): processes only
    # A process may map its own ids in the namespace it has just made; until then it
    # would be nobody. setgroups must be denied before an unprivileged gid_map.
    try:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    except OSError as exc:  # there is no way back out of the namespace
        os.write(2, f"polyserve sandbox: cannot map the user namespace: {exc}\n".encode())
        os._exit(EXIT_KEEPER_GONE)
    return True


def _own_proc() -> None:
    """In the new mount namespace, a /proc of the new PID namespace: the validation sees
    its own processes only. Mounts are made private first, so nothing propagates back to
    the host's. Where that fails, /proc stays the host's (its pids still name nothing
    the validation can signal)."""
    if _libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return
    _libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)


def _drop_privileges() -> None:
    """No capabilities (in the bounding set either) and no gaining any by exec: a
    validation of a host run as root, or one in a user namespace, cannot undo its
    namespaces, unmount its /proc, or trace what it can reach."""
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):  # fails without CAP_SETPCAP: then there is none to drop
        _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_V3, 0)
    _libc.capset(header, (ctypes.c_uint32 * 6)())
    _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _keep(child: int, alive: int) -> NoReturn:
    """The keeper: wait for the validation, kill what it left, and exit as it did."""
    # SIGTERM is taken when waited for, never in a handler: one that ran while the
    # validation was being reaped could not tell whether its pid still named it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD, signal.SIGTERM})
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the validation's pipes must end when its own copies do
        os.dup2(null, fd)
    # Nothing of its parent's either: the server's sockets, a request's descriptors.
    os.closerange(3, alive)
    os.closerange(alive + 1, 2**31 - 1)
    status = None
    while status is None:
        while True:  # an orphan it adopted that ended by itself, or the validation
            pid, found = os.waitpid(-1, os.WNOHANG)
            if pid == 0 or pid == child:
                break
        if pid == child:
            status = found
        elif signal.sigwaitinfo({signal.SIGCHLD, signal.SIGTERM}).si_signo == signal.SIGTERM:
            os.kill(child, signal.SIGKILL)  # not reaped yet: the pid is still its
    _reap_all()
    _exit_as(status)


def _reap_all() -> None:
    """Kill and reap every child left: orphans the validation's processes left here. With
    a PID namespace there are none (the kernel killed its namespace with it)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left: the usual answer, without a look at /proc
        if pid:
            continue
        for orphan in procs.children(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(orphan, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, 0)


def _exit_as(status: int) -> NoReturn:
    """Exit as the validation did: its code, or by the signal that ended it."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core of this process
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set: no need
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else EXIT_KEEPER_GONE)


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, or a tracer): it answers nothing."""
    return procs.state_and_parent(pid)[0] in ("T", "t")
