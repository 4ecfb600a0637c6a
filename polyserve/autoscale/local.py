"""The `local` provider: real gunicorn hosts on this machine, each with its own port and
data directory, found again from their directories and stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polyserve.autoscale.provider import HostSpec, Machine
from polyserve.settings.declare import Setting, const, positive_int
from polyserve.state.store import write_atomic

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "local_dir",
        str,
        const("./polyserve-hosts"),
        "local provider: where each host gets its directory (data, log, PID).",
    ),
    Setting(
        "local_config",
        str,
        const("gunicorn.conf.py"),
        "local provider: the gunicorn config its hosts start with.",
    ),
    Setting("local_workers", positive_int, const(1), "local provider: workers per host."),
)
# Never handed to a host: they are the autoscaler's, not the fleet's.
CREDENTIALS = ("HCLOUD_TOKEN", "RUNPOD_API_KEY")
MACHINE = "machine.json"
_POLL_S = 0.05


def make(values: Mapping[str, Any]) -> LocalProvider:
    config = Path(values["local_config"]).resolve()
    if not config.is_file():
        raise ValueError(f"POLYSERVE_LOCAL_CONFIG: {config} is not a file")
    return LocalProvider(Path(values["local_dir"]).resolve(), config, values["local_workers"])


class LocalProvider:
    name = "local"

    def __init__(self, root: Path, config: Path, workers: int) -> None:
        self.root, self.config, self.workers = root, config, workers
        # The masters this process started, to reap them (a dropped Popen of a running
        # child is a ResourceWarning); masters of an earlier autoscaler are found by PID.
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def list(self, pool: str) -> list[Machine]:
        found = []
        for path in sorted(self.root.glob(f"*/{MACHINE}")):
            with contextlib.suppress(OSError, ValueError, KeyError):
                record = json.loads(path.read_text())
                if record["pool"] == pool:
                    found.append(self._machine(record))
        return found

    def create(self, spec: HostSpec) -> Machine:
        home = self.root / spec.host_id
        (home / "data").mkdir(parents=True, exist_ok=False)
        port = _free_port()
        bind = f"127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if k not in CREDENTIALS}
        env |= spec.environment | {
            "POLYSERVE_BIND": bind,
            "POLYSERVE_ADVERTISE_URL": f"http://{bind}",
            "POLYSERVE_DATA_DIR": str(home / "data"),
            "POLYSERVE_WORKERS": str(self.workers),
        }
        with open(home / "host.log", "ab") as log:
            # Its own session: a Ctrl-C at the autoscaler's terminal does not reach the
            # hosts, which outlive the autoscaler and are found again by list().
            proc = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "-c", str(self.config)],
                cwd=self.config.parent,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self._children[proc.pid] = proc
        record = {
            "pid": proc.pid,
            "started": _start_time(proc.pid),
            "host_id": spec.host_id,
            "pool": spec.pool,
            "url": f"http://{bind}",
            "created_at": time.time(),
        }
        write_atomic(home / MACHINE, json.dumps(record).encode())
        return self._machine(record)

    def take_out(self, machine: Machine) -> None:
        """Nothing sits in front of local hosts: callers read the fleet's live hosts."""

    def stop(self, machine: Machine, timeout_s: float) -> None:
        pid = int(machine.id)
        if not self._ours(machine):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)  # gunicorn's graceful stop
        deadline = time.monotonic() + timeout_s
        while self._ours(machine) and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def delete(self, machine: Machine) -> None:
        pid = int(machine.id)
        # The master started a session of its own, so its PID names its process group:
        # the workers and the follower too, even after a kill -9 of the master left them
        # behind. Linux does not hand out a PID still in use as a group's id, so while
        # any of them lives the group is ours; a PID reused after they all died has
        # another start time.
        if self._ours(machine) or _start_time(pid) is None:
            deadline = time.monotonic() + 10
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
                while time.monotonic() < deadline:
                    self._ours(machine)  # reaps the master if it is our child
                    os.killpg(pid, 0)  # ProcessLookupError once the group is empty
                    time.sleep(_POLL_S)
        if pid in self._children and self._children[pid].poll() is not None:
            del self._children[pid]
        home = self.root / machine.host_id
        with contextlib.suppress(FileNotFoundError):
            (home / MACHINE).unlink()
        # The data directory goes too: a deleted host's versions are in the fleet store.
        shutil.rmtree(home, ignore_errors=True)

    def _machine(self, record: dict[str, Any]) -> Machine:
        machine = Machine(
            str(record["pid"]),
            record["host_id"],
            record["pool"],
            record["url"],
            record["created_at"],
            "running",
        )
        if not self._ours(machine, record["started"]):
            return Machine(**{**machine.__dict__, "state": "exited"})
        return machine

    def _ours(self, machine: Machine, started: int | None = None) -> bool:
        """Whether the PID is still the master we started (not exited, not reaped and
        reused: its start time is the one we recorded)."""
        pid = int(machine.id)
        if pid in self._children:
            self._children[pid].poll()  # reaps it if it exited
        else:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # an earlier autoscaler's: not our child
        if started is None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                started = json.loads((self.root / machine.host_id / MACHINE).read_text())["started"]
        now = _start_time(pid)
        return now is not None and now == started


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone or a
    zombie. A PID and its start time name one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
