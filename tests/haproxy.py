"""A real HAProxy for the load-balancer tests: Debian's haproxy started with
contrib/haproxy.cfg on a free loopback port, its runtime API on a socket of its own.

The config is the one operators copy: a test changes only the address it binds, the
stats socket's path and the `server` lines. Fixtures live in the test modules; tests
import from here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from polyserve.autoscale.haproxy import RuntimeAPI, Server
from tests.helpers import REPO, free_port, until

CONFIG = REPO / "contrib" / "haproxy.cfg"
BACKEND = "polyserve"
INSTALL_HINT = (
    "HAProxy is not installed (no haproxy on PATH or in /usr/sbin): install it with"
    " `apt-get install haproxy` (Debian/Ubuntu)"
)


def find_haproxy() -> str | None:
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


class HAProxy:
    """contrib/haproxy.cfg with `servers` ({name: (port, id)}), started by a test and
    stopped by its PID."""

    def __init__(self, binary: str, root: Path, servers: dict[str, tuple[int, int]]) -> None:
        self.binary, self.root = binary, root
        self.port = free_port()
        self.socket = root / "haproxy.sock"
        self.config = root / "haproxy.cfg"
        self.log = root / "haproxy.log"
        text = CONFIG.read_text()
        text = text.replace("/run/haproxy/polyserve.sock", str(self.socket))
        text = text.replace("bind :80", f"bind 127.0.0.1:{self.port}")
        lines = [f"    server {n} 127.0.0.1:{port} id {i}" for n, (port, i) in servers.items()]
        text = re.sub(r"(\n    server [^\n]*)+", "\n" + "\n".join(lines) if lines else "", text)
        self.config.write_text(text)
        self.api = RuntimeAPI(str(self.socket))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HAProxy:
        # -db: stay in the foreground, so the PID is HAProxy's and stop() ends it.
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "-db", "-f", str(self.config)], stdout=log, stderr=log
            )
        until(lambda: self.socket.exists() or self.proc.poll() is not None, what="HAProxy")
        assert self.proc.poll() is None, self.log.read_text()
        return self

    def servers(self) -> dict[str, Server]:
        return self.api.servers(BACKEND)

    def up(self) -> set[str]:
        """The servers HAProxy's health checks find running (op_state 2)."""
        return {name for name, s in self.servers().items() if s.op_state == 2}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
