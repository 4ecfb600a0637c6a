"""Process helpers written once: end a process group, die with the parent, stop a child or a tree.

The host's processes (the master, its workers, the fork server and its children, the
follower, uv) end one another in a few fixed ways; each is here so that every caller
handles the same expected races (a process or group that is already gone) the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def kill_group(pgid: int, *, denied_ok: bool = False) -> None:
    """SIGKILL every process of group `pgid`; a group that is gone already is no error.
    With `denied_ok`, neither is a group this process may not signal (EPERM), for a
    caller that must not stop over it (the fork server's loop)."""
    ignored: tuple[type[OSError], ...] = (ProcessLookupError,)
    if denied_ok:
        ignored += (PermissionError,)
    with contextlib.suppress(*ignored):
        os.killpg(pgid, signal.SIGKILL)


def die_with_parent(sig: int) -> None:
    """Have the kernel send this process `sig` when its parent thread exits, even of a
    SIGKILL. A parent that died before this call is not seen by it: the caller checks
    os.getppid() (or a pipe) afterwards."""
    _libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def stop_child(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM a child of this process and reap it; SIGKILL it after `timeout` s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def children(pid: int) -> list[int]:
    """Process `pid`'s children: from its threads' `children` lists where the kernel
    keeps them, else by a walk of /proc."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return [
            int(child)
            for task in tasks
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        ]
    except (FileNotFoundError, ProcessLookupError):  # no CONFIG_PROC_CHILDREN, or `pid` is gone
        pass
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and state_and_parent(int(name))[1] == pid:
            found.append(int(name))
    return found


def state_and_parent(pid: int) -> tuple[str, int]:
    """Process `pid`'s state letter and parent pid; ("", 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return "", 0
    state, ppid = stat[stat.rindex(b")") + 2 :].split(None, 2)[:2]
    return state.decode(), int(ppid)


def descendants(pid: int) -> set[int]:
    """Process `pid`'s children, theirs, and so on (those still running)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def become_subreaper() -> None:
    """Have this process's orphaned descendants reparented to it rather than to init, so
    that it can still find (descendants) and end them after their parent exits."""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def end_descendants(timeout: float = 10.0) -> None:
    """SIGKILL every descendant of this process and reap them (a subreaper's children
    include the orphans), round after round: each finds what the last one's forked."""
    deadline = time.monotonic() + timeout
    while (pids := descendants(os.getpid())) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
        with contextlib.suppress(ChildProcessError):  # no child left to reap
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
