"""`polyserve dev DIR`: DIR served by a local host of its own, redeployed on each save.

The host is a real one (`gunicorn -c polyserve/master/config.py`, the file of the
installed package) on a free loopback port, with a fresh data directory under the
system's temporary directory, removed on exit: what a dev run deployed is not kept. A
deploy is what `polyserve deploy DIR` sends (pack.py, then Client.deploy), so a save
that fails the host's validation is refused with its 422 and the last good version keeps
serving. Ctrl-C (SIGINT; SIGTERM and SIGHUP too) stops the master and then ends every
process still left under this one: the command is their subreaper, so even a process
its parent left behind is found.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import click

from polyserve.cli.client import Client, HostRefused, HostUnavailable, space_path
from polyserve.cli.command import EXIT_UNAVAILABLE, SPACE, plain
from polyserve.cli.reads import log_line
from polyserve.cli.render import human_ms

DEFAULT_OWNER = "local"
READY_TIMEOUT_S = 60.0  # a first start imports onnxruntime and numpy: seconds on a slow machine
STOP_TIMEOUT_S = 10.0  # for the master's own shutdown, before every process left is killed
LOGS_POLL_S = 0.2  # how often the host is asked for the space's new log records
WATCH_STEP_MS = 50  # quiet time that ends a burst of changes (an editor's save is several)
WATCH_DEBOUNCE_MS = 800  # the longest a burst is grouped before it is deployed anyway
WATCH_TIMEOUT_MS = 250  # how often the watch, when nothing changes, checks the host is up
# Variables that would make the dev host something else than a loopback host of its own:
# a fleet's member, or one whose writes need a token the command does not have.
NOT_HANDED = (
    "POLYSERVE_DATABASE_URL",
    "POLYSERVE_DATABASE_URL_FILE",
    "POLYSERVE_HOST_ID",
    "POLYSERVE_ADVERTISE_URL",
    "POLYSERVE_POOL",
    "POLYSERVE_DEPLOY_TOKEN",
    "POLYSERVE_DEPLOY_TOKEN_SHA256",
    "POLYSERVE_TOKENS_FILE",
)


def default_space(directory: Path) -> str:
    """`local/<DIR's name>`, its name made a valid space name part."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", directory.resolve().name).lstrip(".")[:64]
    return f"{DEFAULT_OWNER}/{name or 'space'}"


@click.command(short_help="Serve a directory on a local host, redeployed on each save.")
@click.argument(
    "directory", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="DIR"
)
@click.option(
    "--space", type=SPACE, default=None, help="The space to serve it as. [default: local/<DIR>]"
)
@click.option(
    "--port", type=click.IntRange(0, 65535), default=0, help="Loopback port; 0: a free one."
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Workers."
)
def dev(directory: Path, space: str | None, port: int, workers: int) -> None:
    """Serve DIR on a local host of its own, redeploying it on each save.

    Starts a host on 127.0.0.1 with a temporary data directory (removed on exit),
    deploys DIR as `polyserve deploy DIR` would, prints the URL to call, then watches
    DIR: each save is packed and deployed again (a refused one prints why, and the last
    good version keeps serving), and what the space logs is printed here. Ctrl-C stops
    the host and every process it started.
    """
    space = space or default_space(directory)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    root = Path(tempfile.mkdtemp(prefix="polyserve-dev-"))
    host = _Host(root, port or _free_port(), workers)
    try:
        host.start()
        url = f"{host.url}/s/{space}/"
        click.echo(f"serving {directory} as {space} at {url}")
        click.echo("(Ctrl-C stops the host; each save redeploys)")
        session = _Session(host, directory, space)
        with session.logs():
            session.watch()
    except KeyboardInterrupt:
        click.echo("\nstopping")
    except _HostDied as exc:
        click.secho(f"error: {exc}", fg="red", err=True)
        click.echo(host.tail(), err=True)
        sys.exit(EXIT_UNAVAILABLE)
    finally:
        with _deferred_interrupts():
            host.stop()
            shutil.rmtree(root, ignore_errors=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _deferred_interrupts() -> Iterator[None]:
    """A second Ctrl-C while the host stops must not leave it half stopped."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _HostDied(Exception):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Host:
    """The dev host's gunicorn master: started, waited for, stopped with everything under it."""

    def __init__(self, root: Path, port: int, workers: int) -> None:
        self.root, self.port, self.workers = root, port, workers
        self.url = f"http://127.0.0.1:{port}"
        self.log = root / "host.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        from polyserve import procs
        from polyserve.master import config

        procs.become_subreaper()
        env = {k: v for k, v in os.environ.items() if k not in NOT_HANDED}
        env |= {
            "POLYSERVE_BIND": f"127.0.0.1:{self.port}",
            "POLYSERVE_DATA_DIR": str(self.root / "data"),
            "POLYSERVE_WORKERS": str(self.workers),
        }
        argv = [sys.executable, "-m", "gunicorn", "-c", str(Path(config.__file__))]
        with open(self.log, "ab") as log:
            # A session of its own, so the terminal's Ctrl-C reaches this command only,
            # which then stops the host in order; and a SIGTERM if this command dies.
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=lambda: procs.die_with_parent(signal.SIGTERM),
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        client = Client(self.url, timeout=5)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self.check()
            with contextlib.suppress(HostUnavailable, HostRefused):
                client.get("/_polyserve/health")
                return
            time.sleep(0.05)
        raise _HostDied(f"the host did not answer in {READY_TIMEOUT_S:.0f} s")

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise _HostDied(f"the host exited (status {self.proc.returncode}); its log:")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        from polyserve import procs

        if self.proc is not None and self.proc.poll() is None:
            # SIGTERM: gunicorn's graceful stop, whose on_exit hook stops the fork
            # server and unlinks the table's segment.
            procs.stop_child(self.proc, STOP_TIMEOUT_S)
        procs.end_descendants()


class _Session:
    """What one dev run deploys and prints: the deploys, the watch, the logs."""

    def __init__(self, host: _Host, directory: Path, space: str) -> None:
        self.host, self.directory, self.space = host, directory, space
        self.client = Client(host.url, timeout=300)
        self.serving: int | None = None  # the version that serves, once one does
        self.sent: bytes | None = None  # the last pack sent: a save that changes nothing is not

    def deploy(self, changed_at: float | None = None) -> None:
        from polyserve.cli.pack import PackError, pack

        try:
            data = pack(self.directory).data
        except PackError as exc:
            click.secho(f"cannot pack {self.directory}: {exc}", fg="red", err=True)
            return
        if data == self.sent:
            return
        self.sent = data
        try:
            _, body = self.client.deploy(self.space, f"{self.directory.name}.tar.gz", data)
        except HostRefused as exc:
            self._refused(exc)
            return
        except HostUnavailable as exc:
            self.host.check()  # a host that died ends the run
            click.secho(f"deploy failed: {exc.error}", fg="red", err=True)
            return
        self.serving = body["version"]
        line = f"v{self.serving} serving: import {human_ms(body.get('import_ms'))}"
        if changed_at is not None:
            line += f", deployed in {human_ms((time.monotonic() - changed_at) * 1000)}"
        click.echo(line)

    def _refused(self, exc: HostRefused) -> None:
        click.secho(f"refused (HTTP {exc.status}): {exc.error}", fg="red", err=True)
        for key, value in exc.details.items():
            if value not in ("", None, []):
                text = plain(value).rstrip()
                if "\n" in text:
                    click.echo(f"  {key}:", err=True)
                    for line in text.splitlines():
                        click.echo(f"    {line}", err=True)
                else:
                    click.echo(f"  {key}: {text}", err=True)
        if self.serving is None:
            click.echo("nothing serves yet: fix it and save", err=True)
        else:
            click.echo(f"v{self.serving} keeps serving", err=True)

    def watch(self) -> None:
        """Deploy DIR, then again at each change. The first deploy waits for the watch's
        first timeout: by then the watch is set up, so no save after it goes unseen."""
        import watchfiles

        first = True
        for changes in watchfiles.watch(
            self.directory,
            step=WATCH_STEP_MS,
            debounce=WATCH_DEBOUNCE_MS,
            rust_timeout=WATCH_TIMEOUT_MS,
            yield_on_timeout=True,  # an empty set at each timeout: the host is checked then
        ):
            self.host.check()
            if changes or first:
                self.deploy(None if first else time.monotonic())
                first = False

    @contextlib.contextmanager
    def logs(self) -> Iterator[None]:
        """Print the space's log records while the body runs (a thread polls the host)."""
        stop = threading.Event()
        thread = threading.Thread(target=self._follow, args=(stop,), daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=2)

    def _follow(self, stop: threading.Event) -> None:
        client = Client(self.host.url, timeout=10)  # its own: a thread of its own
        since = 0
        while not stop.wait(LOGS_POLL_S):
            try:
                answer: dict[str, Any] = client.get(space_path(self.space, "logs"), since=since)
            except (HostRefused, HostUnavailable):  # not deployed yet, or stopping
                continue
            for record in answer.get("records", []):
                click.echo(log_line(record))
            since = int(answer.get("next", since))
