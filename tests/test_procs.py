"""polyserve.procs: a process group killed, a child that dies with its parent, a child
stopped, each with the expected races (a process already gone) handled."""

from __future__ import annotations

import signal
import subprocess
import sys

from polyserve import procs
from tests.helpers import alive, until

# A parent that forks a child which asks to die with it (SIGTERM), says the child's pid
# once the child has asked, and exits without waiting for it.
ORPHANING = """
import os, signal, time
from polyserve import procs
asked_r, asked_w = os.pipe()
pid = os.fork()
if pid == 0:
    procs.die_with_parent(signal.SIGTERM)
    os.write(asked_w, b"x")
    time.sleep(60)
    os._exit(0)
os.read(asked_r, 1)
print(pid, flush=True)
os._exit(0)
"""


def test_a_group_is_killed_whole():
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    procs.kill_group(shell.pid)
    assert shell.wait(timeout=10) == -signal.SIGKILL


def test_a_group_that_is_gone_is_no_error():
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    procs.kill_group(proc.pid)
    procs.kill_group(proc.pid, denied_ok=True)


def test_a_child_that_asked_dies_with_its_parent():
    parent = subprocess.run(
        [sys.executable, "-c", ORPHANING], capture_output=True, text=True, timeout=30
    )
    child = int(parent.stdout.split()[-1])
    until(lambda: not alive(child), 10, "the orphan to die with its parent")


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(15, signal.SIG_IGN); "
         "print(flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.readline()  # SIGTERM is ignored from here on
    procs.stop_child(proc, 0.2)
    assert proc.returncode == -signal.SIGKILL
    procs.stop_child(proc, 0.2)  # reaped already: nothing to do
    proc.stdout.close()
