"""gunicorn server hooks: the master owns the data-dir lock, the shared table, its checkpoints."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from polyserve import devices
from polyserve import settings as settings_mod
from polyserve.control import auth
from polyserve.deploy.forkserver import ForkServer
from polyserve.master.leftover import Leftover
from polyserve.procs import die_with_parent, stop_child
from polyserve.serve import warmup
from polyserve.state import handoff, rollouts
from polyserve.state.apply import Changes
from polyserve.state.broadcast import Broadcast
from polyserve.state.handoff import Handoff
from polyserve.state.shm import H_STARTED, Table, segment_name
from polyserve.state.store import Store
from polyserve.usage import meter

# sysexits.h's "try again later" (gunicorn's own codes are 1, 3 and 4, APP_LOAD_ERROR).
EXIT_DATA_DIR_BUSY = os.EX_TEMPFAIL  # 75: another master serves this data directory
EXIT_BAD_CONFIG = os.EX_CONFIG  # 78: as a bad tokens file (auth.EXIT_BAD_TOKENS_FILE)
CHECKPOINT = "usage.json"
_FOLLOWER_STOP_S = 15.0  # for the fleet follower's last usage write and leave


class _Master:
    """What the master holds for its lifetime; forked workers inherit it with the memory."""

    def __init__(
        self,
        s: settings_mod.Settings,
        store: Store,
        table: Table,
        leftover: Leftover | None = None,
        log: Any = None,
    ) -> None:
        self.settings = s
        self.store = store
        self.table = table
        self.leftover = leftover  # until its workers are gone and their counts folded
        self.log = log or logging.getLogger("polyserve")
        self.checkpoint_path = store.root / CHECKPOINT
        self.lock = threading.Lock()  # checkpoint reads vs folding a dead worker's row
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None  # the checkpoint thread
        self.follower: subprocess.Popen[bytes] | None = None  # with POLYSERVE_DATABASE_URL
        # Validations fork from it (polyserve/deploy/forkserver.py): a process of its own, started
        # fresh with the environment tenant code gets, not a fork of this master.
        self.forkserver = (
            ForkServer(s.preload, settings_mod.scrubbed_environ(), s.validate_namespaces)
            if s.validate_forkserver
            else None
        )

    def forkserve(self) -> None:
        """Start the fork server (again, if it died or stopped answering: workers spawn
        validators meanwhile)."""
        if self.forkserver is None or self.stop.is_set():
            return
        why = self.forkserver.ensure()
        if why is not None and why != "started":
            self.log.error("the validation fork server %s: starting a new one", why)

    def follow(self) -> None:
        """Start the fleet follower (again, if it died). A process of its own: the
        master forks workers at any time, and a forked child must not inherit its
        database connections."""
        if not self.settings.database_url or self.stop.is_set():
            return
        if self.follower is None or self.follower.poll() is not None:
            if self.follower is not None:
                self.log.error(
                    "the fleet follower exited (%s): starting it again", self.follower.returncode
                )
            self.follower = _start_follower(self.settings.database_url)

    def unfollow(self) -> None:
        """At exit, after the workers: the follower writes the last usage and leaves."""
        if self.follower is not None:
            stop_child(self.follower, _FOLLOWER_STOP_S)

    def checkpoint(self) -> None:
        """Write the totals; first fold in the late counts of a dead master's workers,
        once they are all gone. A checkpoint written before that fold holds everything
        but those late counts (the base row already carries what was taken at start):
        a crash before the fold loses them, nothing else."""
        with self.lock:
            if self.leftover is not None and self.leftover.drained():
                leftover, self.leftover = self.leftover, None  # folded at most once
                leftover.fold_into(self.table)
                self.log.info("counted what the workers of the master that died answered since")
            meter.checkpoint(
                self.table, self.store.slots.ledger(), self.checkpoint_path, meter.now_us()
            )

    def drain(self, timeout: float) -> None:
        """At exit: the dead master's workers get `timeout` s more (see Leftover.stop)."""
        if self.leftover is not None:
            self.leftover.stop(timeout, self.log, self.lock)

    def checkpoints(self) -> None:
        """The checkpoint thread: a master killed with -9 loses at most one interval."""
        while not self.stop.wait(self.settings.checkpoint_interval):
            try:
                self.checkpoint()
                self.follow()
                self.forkserve()
            except Exception:  # a full disk must not end the thread: try again next time
                logging.getLogger("polyserve").exception("usage checkpoint failed")


def _start_follower(url: str) -> subprocess.Popen[bytes]:
    """The follower, handed the fleet's URL through a pipe it reads at start (as
    POLYSERVE_DATABASE_URL_FILE): in its environment, /proc/<pid>/environ would show the
    URL to any process of the host's user, a validation's included."""
    read, write = os.pipe()
    with os.fdopen(write, "wb") as pipe:
        pipe.write(url.encode())  # far less than a pipe holds: this never blocks
    try:
        env = {**os.environ, "POLYSERVE_DATABASE_URL_FILE": f"/dev/fd/{read}"}
        return subprocess.Popen(
            [sys.executable, "-m", "polyserve.fleet.follower"], env=env, pass_fds=(read,)
        )
    finally:
        os.close(read)


_master: _Master | None = None
_starting: tuple[settings_mod.Settings, Store] | None = None  # on_starting -> when_ready
_lock_file: Any = None  # host.lock, flock'd: the master's alone (post_fork closes it)


def worker_rows(workers: int) -> int:
    """How many worker rows the table gets for `workers` workers."""
    # A HUP starts a full set of new workers before the old ones leave.
    return max(2 * workers + 2, 8)


def on_starting(server: Any) -> None:
    """Check the settings and lock the data directory; create nothing (see when_ready)."""
    global _starting, _lock_file
    s = settings_mod.load()
    auth.on_starting(server, s)  # a bad tokens file stops the host: EXIT_BAD_TOKENS_FILE
    # Before anything is started or forked: see settings.withhold.
    settings_mod.withhold(s.database_url)
    store = Store(s.data_dir, s.max_spaces)
    _lock_file = open(store.root / "host.lock", "a")  # noqa: SIM115 - held for the master's life
    try:
        fcntl.flock(_lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        server.log.error(
            "another polyserve host is using %s; give each host its own POLYSERVE_DATA_DIR",
            store.root,
        )
        sys.exit(EXIT_DATA_DIR_BUSY)
    _starting = (s, store)
    os.environ.pop(devices.ENV, None)  # the master runs on no GPU: see post_fork
    _preload(server, s.preload)


def _preload(server: Any, modules: tuple[str, ...]) -> None:
    """Import POLYSERVE_PRELOAD's modules in the master, before any fork: every worker
    then shares their pages copy-on-write and its first load of a space that imports
    them costs the space's own work only. Never tenant code. A module that fails to
    import is a configuration error: the host does not start."""
    for name in modules:
        started = time.perf_counter()
        try:
            importlib.import_module(name)
            if name in warmup.WARMUPS:
                warmup.WARMUPS[name]()
        except Exception as exc:
            server.log.error("POLYSERVE_PRELOAD: cannot import %s: %s", name, exc)
            sys.exit(EXIT_BAD_CONFIG)
        server.log.info("preloaded %s in %.0f ms", name, (time.perf_counter() - started) * 1000)


def when_ready(server: Any) -> None:
    """The listeners are bound and no worker is forked yet: create the table now.

    Not in on_starting, which runs before gunicorn binds: a start that fails there (a
    port in use makes gunicorn exit without calling on_exit) or in any check before this
    point has then created nothing in /dev/shm, and has left a killed master's segment
    untouched for the next start to recover. Creating it here rather than undoing it at
    exit needs no cleanup that forked workers would inherit (atexit, guarded by pid).
    gunicorn calls when_ready once per master, last in Arbiter.start: a HUP reloads the
    configuration without it, and the first pre_fork comes after it.
    """
    global _master
    assert _starting is not None
    s, store = _starting
    _master = _Master(s, store, *_create_table(server, s, store), log=server.log)
    if s.gpus:
        server.log.info("GPU host: %s", spread(s.gpus, s.workers))
    try:
        if s.database_url:  # imported here: psycopg is a fleet host's alone to import
            from polyserve.fleet import follower

            # A killed master's segment may still grow by its workers' late answers.
            follower.start_boot(store, _master.table, settled=_master.leftover is None)
            _master.follow()
        _master.forkserve()  # it warms up while the workers boot
        _master.thread = threading.Thread(
            target=_master.checkpoints, name="usage-checkpoint", daemon=True
        )
        _master.thread.start()
        # One process moves every rollout's steps: this master, not each worker.
        kept = Store(s.data_dir, s.max_spaces, s.keep_versions)  # its prune keeps as workers'
        # On a fleet host the follower moves the steps (polyserve/fleet/rollouts.py): this
        # thread keeps the table's words and a restarted boot's bases only.
        changes = None if s.database_url else Changes(kept, Broadcast(_master.table, None))
        driver = rollouts.Driver(kept, _master.table, changes)
        threading.Thread(
            target=driver.run, args=(_master.stop,), name="rollouts", daemon=True
        ).start()
    except BaseException:
        on_exit(server)  # gunicorn calls no on_exit for a failed start: checkpoint, unlink
        raise


def _create_table(
    server: Any, s: settings_mod.Settings, store: Store
) -> tuple[Table, Leftover | None]:
    """A fresh table whose base row carries the usage of every earlier run: from the
    segment a killed master left (exact), else from the last checkpoint. That segment
    comes along while the workers it left still answer (see `Leftover`)."""
    name = segment_name(str(store.root))
    attached = Table.attach(name)
    leftover = None
    earlier: np.ndarray | None
    if attached is not None:
        earlier = meter.leftover_totals(attached)
        leftover = Leftover(attached, name, earlier)  # unlinks its name
        server.log.warning("recovered usage from the segment of a master that died")
    else:
        earlier = meter.checkpoint_totals(store.root / CHECKPOINT, store.slots.ledger())
    table = Table.create(name, worker_rows(s.workers), s.max_spaces, meter.CELLS)
    table.set_header(H_STARTED, time.time_ns() // 1000)
    if earlier is not None:
        meter.set_base(table, earlier)
    return table, leftover


def pre_fork(server: Any, worker: Any) -> None:
    """Give the new worker the lowest free row; a replacement reuses its predecessor's."""
    assert _master is not None
    # Everything the master holds now (the preloaded modules above all) moves to the
    # collector's permanent generation: a worker's collections then never walk those
    # objects, whose headers they would write and so copy out of the shared pages.
    gc.freeze()
    used = {getattr(w, "polyserve_row", None) for w in server.WORKERS.values()}
    free = [i for i in range(_master.table.worker_rows) if i not in used]
    worker.polyserve_row = free[0] if free else None
    gpus = _master.settings.gpus
    worker.polyserve_gpu = gpu_for(gpus, server.WORKERS.values()) if gpus else None
    if not free:
        # More workers than usage rows (TTIN past the table): a worker that cannot be
        # metered must not serve. Stop asking for it; it exits in post_fork.
        server.log.error(
            "no free usage row for another worker: the table has %d rows",
            _master.table.worker_rows,
        )
        server.num_workers = len(server.WORKERS)


def gpu_for(gpus: tuple[int, ...], live: Any) -> int:
    """The GPU a new worker gets: the listed one the fewest live workers use, the first
    listed of those on a tie. A replacement so takes the GPU of the worker it replaces
    (the one left with a worker fewer), no two live workers share one while there are no
    more workers than GPUs, and more are spread round the list (the first GPUs listed get
    one more when they do not divide evenly). A HUP's new workers share with the old ones
    until those leave."""
    count = dict.fromkeys(gpus, 0)
    for other in live:
        gpu = getattr(other, "polyserve_gpu", None)
        if gpu in count:
            count[gpu] += 1
    return min(gpus, key=lambda gpu: count[gpu])


def spread(gpus: tuple[int, ...], workers: int) -> str:
    """How `workers` workers spread over `gpus`, as the master logs it at start."""
    per = {gpu: workers // len(gpus) + (i < workers % len(gpus)) for i, gpu in enumerate(gpus)}
    shown = ", ".join(f"GPU {gpu}: {n}" for gpu, n in per.items())
    shared = " (more workers than GPUs: some share one)" if workers > len(gpus) else ""
    return f"{workers} workers on {len(gpus)} GPUs, {shown}{shared}"


def _give_gpu(gpu: int | None) -> None:
    """In a new worker, before its app is loaded and anything can open CUDA: the one GPU
    it may use (CUDA_VISIBLE_DEVICES, numbered as NVML numbers them), and devices.ENV
    naming it, which its validations inherit. A CPU worker gets none, whatever the
    environment said."""
    if gpu is None:
        os.environ.pop(devices.ENV, None)
        return
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    os.environ[devices.ENV] = str(gpu)


def post_fork(server: Any, worker: Any) -> None:
    global _lock_file
    _give_gpu(getattr(worker, "polyserve_gpu", None))
    # The data-dir lock is the master's alone: a worker that a master killed with -9
    # leaves draining must not refuse the restart, nor must anything tenant code forks.
    # flock belongs to the open file description, which fork shares, so closing this
    # copy releases nothing while the master holds its own (never LOCK_UN here: that
    # would unlock the master's). It goes before the app is loaded, so no tenant fork
    # inherits it; exec'd children never do (open() makes non-inheritable fds).
    if _lock_file is not None:
        _lock_file.close()
        _lock_file = None
    # Nor is a killed master's segment a worker's: drop the mapping fork copied, so that
    # only the dead master's own workers hold it (Leftover.drained looks for them).
    if _master is not None and _master.leftover is not None:
        with contextlib.suppress(BufferError):  # a view the fork copied: it stays mapped
            _master.leftover.table.close()
        _master.leftover = None
    if worker.polyserve_row is None:
        sys.exit(0)
    assert _master is not None
    forkserver = _master.forkserver.name if _master.forkserver is not None else None
    handoff.hand(Handoff(_master.table, worker.polyserve_row, forkserver))
    # A worker outlives a master killed with -9 unless told: uvicorn-worker does not
    # watch its parent. SIGTERM makes it finish its requests and fold its usage.
    die_with_parent(signal.SIGTERM)
    if os.getppid() != server.pid:  # the master died before prctl took effect
        sys.exit(0)
    # polyserve logs where gunicorn's error log goes, as uvicorn-worker does for uvicorn.
    logger = logging.getLogger("polyserve")
    logger.handlers = server.log.error_log.handlers
    logger.setLevel(server.log.error_log.level)
    logger.propagate = False


def worker_exit(server: Any, worker: Any) -> None:
    """In the worker, last thing before it exits: exit now, with its status, without the
    C-level exit handlers. Those belong to the master: a library the master loaded
    before the fork (onnxruntime) destroys at exit a condition variable that a thread of
    the master waits on — a thread the fork did not copy — and waits for it forever.
    A forked child that exits with os._exit, as multiprocessing's do, never runs them."""
    raised = sys.exc_info()[1]  # gunicorn calls this while the worker's exit propagates
    code = raised.code if isinstance(raised, SystemExit) else 1
    status = 0 if code is None else code if isinstance(code, int) else 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def child_exit(server: Any, worker: Any) -> None:
    """A worker is gone (any cause): its counts stay; close its open residency."""
    row = getattr(worker, "polyserve_row", None)
    if _master is None or row is None:
        return
    with _master.lock:
        meter.fold_row(_master.table, row, meter.now_us())
        if _master.table.pids[row] == worker.pid:
            _master.table.pids[row] = 0


def on_exit(server: Any) -> None:
    """After every worker has exited (and a killed master's, see _Master.drain): the
    final checkpoint, then unlink the segment."""
    if _master is not None:
        _master.stop.set()
        if _master.thread is not None:
            _master.thread.join()  # its checkpoint, if one is under way, comes first
        _master.drain(server.cfg.graceful_timeout)
        _master.checkpoint()
        _master.unfollow()
        if _master.forkserver is not None:  # after the workers: no deploy needs it now
            _master.forkserver.stop()
        _master.table.close(unlink=True)
    if _lock_file is not None:
        _lock_file.close()
