"""`polyserve dev DIR` under a real pseudo-terminal: the URL it prints serves DIR, saves are
redeployed, a refused save keeps the last good version, Ctrl-C leaves no process."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from polyserve.cli.dev import default_space
from polyserve.state.shm import segment_name
from tests.cli.test_cli import CLI
from tests.helpers import alive, descendants, until

pytestmark = pytest.mark.gunicorn  # the command starts a real gunicorn host

SPACE_CODE = """\
def handle(request):
    print("answering {answer}")
    return {{"answer": {answer}}}
"""
BROKEN = 'def handle(request):\n    return {"answer": \n'
SAVED_WITHIN_S = 30.0  # the poll's bound only: the measured figure is in bench/NOTES.md


class Terminal:
    """A command run with a pseudo-terminal as its controlling terminal, as a shell would:
    what it writes is collected, and Ctrl-C is a keystroke."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        fd, tty = os.openpty()
        self.fd = fd
        self.proc = subprocess.Popen(
            argv,
            stdin=tty,
            stdout=tty,
            stderr=tty,
            env=env,
            cwd=cwd,
            start_new_session=True,
            # The new session's leader takes the terminal, so the line discipline sends
            # it (its foreground group) SIGINT for a ^C.
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(tty)
        self.output = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: every holder of the terminal's other end closed it
                return
            if not chunk:
                return
            self.output += chunk.decode(errors="replace").replace("\r\n", "\n")

    def expect(self, pattern: str, after: int = 0, timeout: float = 60.0) -> re.Match[str]:
        """The first match of `pattern` in what was written from offset `after` on."""
        return until(
            lambda: re.compile(pattern).search(self.output, after),
            timeout,
            f"{pattern!r} in the terminal; it shows:\n{self.output}",
        )

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)
        os.close(self.fd)


def save(path: Path, text: str, scratch: Path) -> float:
    """Save as an editor that writes a copy and renames it does; the time of the save."""
    copy = scratch / path.name
    copy.write_text(text)
    os.replace(copy, path)
    return time.monotonic()


def answer(url: str) -> object:
    with contextlib.suppress(httpx.TransportError, ValueError):
        return httpx.get(url, headers={"Connection": "close"}, timeout=10).json()
    return None


class Dev:
    def __init__(self, root: Path) -> None:
        self.app = root / "my app"  # a name to be made a valid space name
        self.app.mkdir()
        self.scratch = root / "scratch"
        self.scratch.mkdir()
        self.tmp = root / "tmp"  # the command's TMPDIR: its data directory goes here
        self.tmp.mkdir()
        (self.app / "main.py").write_text(SPACE_CODE.format(answer=1))
        env = {k: v for k, v in os.environ.items() if not k.startswith("POLYSERVE_")}
        env["TMPDIR"] = str(self.tmp)
        self.term = Terminal([*CLI, "dev", str(self.app)], env, root)
        self.url = self.term.expect(r"at (http://127\.0\.0\.1:\d+/s/local/my-app/)\n").group(1)
        self.term.expect(r"v1 serving")


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dev]:
    session = Dev(tmp_path_factory.mktemp("dev"))
    try:
        yield session
    finally:
        session.term.close()


def test_the_printed_url_serves_the_directory(dev):
    assert answer(dev.url) == {"answer": 1}
    # What the space prints reaches the same terminal, through the host's logs.
    dev.term.expect(r"v1 pid \d+ stdout: answering 1")


def test_a_save_is_served_and_its_log_follows(dev):
    mark = len(dev.term.output)
    saved = save(dev.app / "main.py", SPACE_CODE.format(answer=2), dev.scratch)
    until(lambda: answer(dev.url) == {"answer": 2}, SAVED_WITHIN_S, "the save to be served")
    print(f"save to served: {(time.monotonic() - saved) * 1000:.0f} ms")
    dev.term.expect(r"v2 serving: import .*, deployed in ", mark)
    dev.term.expect(r"v2 pid \d+ stdout: answering 2", mark)


def test_a_broken_save_prints_why_and_the_last_good_version_serves(dev):
    mark = len(dev.term.output)
    save(dev.app / "main.py", BROKEN, dev.scratch)
    dev.term.expect(r"refused \(HTTP 422\): import failed: main\.py, line 2: SyntaxError", mark)
    dev.term.expect(r"v2 keeps serving", mark)
    assert answer(dev.url) == {"answer": 2}


def test_a_fixed_save_serves_again(dev):
    mark = len(dev.term.output)
    save(dev.app / "main.py", SPACE_CODE.format(answer=3), dev.scratch)
    until(lambda: answer(dev.url) == {"answer": 3}, SAVED_WITHIN_S, "the fixed save to be served")
    dev.term.expect(r"v3 serving", mark)


def test_ctrl_c_leaves_no_process_behind(dev):
    """Run last: it ends the module's session."""
    tree = descendants(dev.term.proc.pid)
    names = " ".join(Path(f"/proc/{pid}/cmdline").read_text() for pid in tree)
    # The master, its worker, the validation fork server and its spare validations.
    assert "master" in names and "worker" in names, names
    assert "polyserve.deploy.forkserver" in names, names
    (data_dir,) = dev.tmp.glob("polyserve-dev-*/data")
    segment = Path("/dev/shm", segment_name(str(data_dir)))
    assert segment.exists()

    dev.term.ctrl_c()
    assert dev.term.proc.wait(timeout=60) == 0, dev.term.output
    dev.term.expect(r"stopping")
    left = {pid for pid in tree if alive(pid)}
    assert not left, {pid: Path(f"/proc/{pid}/cmdline").read_text() for pid in left}
    assert not segment.exists()
    assert list(dev.tmp.glob("polyserve-dev-*")) == []  # the data directory is removed
    assert answer(dev.url) is None  # nothing listens on the port


def test_the_default_space_is_local_and_the_directory_s_name(tmp_path):
    assert default_space(tmp_path / "my app") == "local/my-app"
    assert default_space(tmp_path / ".hidden") == "local/hidden"
    assert default_space(tmp_path / "x" / "..") == f"local/{tmp_path.name}"


def test_dev_has_help():
    out = subprocess.run([*CLI, "dev", "--help"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("Usage: polyserve dev [OPTIONS] DIR")
    assert "--space" in out.stdout
