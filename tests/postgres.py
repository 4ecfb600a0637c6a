"""A real PostgreSQL server for the fleet tests: Debian's initdb and pg_ctl, a throwaway
cluster on a free loopback port, trust authentication for the `polyserve` role.

As root the server runs as the `postgres` user (PostgreSQL refuses to run as root), in a
directory of its own under /tmp (pytest's tmp dirs are private to root). Fixtures live in
conftest.py; tests import from here.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import psycopg

from tests.helpers import free_port

USER = "polyserve"  # the cluster's superuser, as initdb -U names it
INSTALL_HINT = (
    "PostgreSQL is not installed (no initdb on PATH or under /usr/lib/postgresql/*/bin):"
    " install it with `apt-get install postgresql` (Debian/Ubuntu)"
)
_START_TRIES = 3  # a free port can be taken between free_port() and the server's bind


def _version_key(path: str) -> tuple[int, ...]:
    """/usr/lib/postgresql/15/bin → (15,), so the newest installed major wins."""
    major = Path(path).parent.parent.name
    return tuple(int(p) for p in major.split(".") if p.isdigit())


def find_bindir() -> Path | None:
    """The directory holding initdb and pg_ctl: on PATH (Debian puts neither there, but
    other systems and our CI image may), else the newest /usr/lib/postgresql/*/bin."""
    initdb = shutil.which("initdb")
    if initdb is not None:
        bindir = Path(os.path.realpath(initdb)).parent
        if (bindir / "pg_ctl").exists():
            return bindir
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
    for path in reversed(found):
        bindir = Path(path).parent
        if (bindir / "pg_ctl").exists():
            return bindir
    return None


class PostgresServer:
    """One throwaway cluster: start(), create_database(), stop() (and start() again)."""

    def __init__(self, bindir: Path, host: str = "127.0.0.1", netns: str | None = None) -> None:
        self.bindir = bindir
        self.host = host  # the address it listens on (and clients connect to)
        self.netns = netns  # a network namespace to run it in (Netns), else this one's
        self.root = Path(tempfile.mkdtemp(prefix="polyserve-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = 0
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:  # the server must own its directory and socket dir
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self._initdb()

    def _run(self, *args: str, timeout: float = 120, netns: str | None = None) -> str:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
                f"\n{self.tail()}"
            )
        return done.stdout

    def _initdb(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", USER, "-E", "UTF8")
        if self.host != "127.0.0.1":  # initdb trusts loopback only
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write("host all all 0.0.0.0/0 trust\n")

    def start(self) -> PostgresServer:
        """Start (again): the first start picks a free port, a restart reuses it so the
        URLs handed out stay valid."""
        tries = 1 if self.port else _START_TRIES
        for attempt in range(tries):
            # In a namespace of its own, any port is free.
            port = self.port or (5432 if self.netns else free_port())
            options = (
                f"-p {port} -k {self.root} -c listen_addresses={self.host} -c fsync=off"
                " -c full_page_writes=off -c synchronous_commit=off -c max_connections=200"
            )
            try:
                self._run(
                    "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
                    "start", netns=self.netns,
                )  # fmt: skip
            except RuntimeError:
                if attempt + 1 == tries:
                    raise
                continue
            self.port = port
            return self
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """A fast stop: every client is disconnected at once, as in an outage."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{USER}@{self.host}:{self.port}/{dbname}"

    def connect(self, dbname: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=10)

    def create_database(self) -> str:
        """A fresh, empty database (its own fleet): its URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with self.connect() as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""

    def destroy(self) -> None:
        """Stop if running, and remove every file of the cluster."""
        if self.running():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def terminate_backends(url: str, application_name: str | None = None) -> list[int]:
    """Kill the connections to `url`'s database (all but this one's own, or only those of
    one application_name): the pids terminated."""
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        query = (
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        )
        params: tuple[str, ...] = ()
        if application_name is not None:
            query += " AND application_name = %s"
            params = (application_name,)
        pids = [row[0] for row in conn.execute(query, params).fetchall()]
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    return pids


class Netns:
    """A network namespace joined to this one by a veth pair: a server run inside it is
    reachable at `inner`, until cut() takes the link down (packets vanish, as in a real
    partition: no refusal, no reset) and restore() brings it back. Needs root and
    iproute2; remove() deletes everything it made."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.name = f"polyserve-{tag}"
        self.outer_dev, self.inner_dev = f"psh{tag}", f"psn{tag}"  # at most 15 characters
        net = f"10.213.{int(tag[:2], 16)}"
        self.outer, self.inner = f"{net}.1", f"{net}.2"
        self._ip("netns", "add", self.name)  # first: if this fails, there is nothing to undo
        try:
            self._ip("link", "add", self.outer_dev, "type", "veth", "peer", "name", self.inner_dev)
            self._ip("link", "set", self.inner_dev, "netns", self.name)
            self._ip("addr", "add", f"{self.outer}/30", "dev", self.outer_dev)
            self._ip("link", "set", self.outer_dev, "up")
            self._ip("addr", "add", f"{self.inner}/30", "dev", self.inner_dev, inside=True)
            self._ip("link", "set", self.inner_dev, "up", inside=True)
            self._ip("link", "set", "lo", "up", inside=True)
        except BaseException:
            self.remove()
            raise

    def _ip(self, *args: str, inside: bool = False) -> None:
        cmd = ["ip", *(("netns", "exec", self.name, "ip") if inside else ()), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")

    def cut(self) -> None:
        self._ip("link", "set", self.inner_dev, "down", inside=True)

    def restore(self) -> None:
        self._ip("link", "set", self.inner_dev, "up", inside=True)

    def remove(self) -> None:
        """Delete the namespace (its end of the pair goes with it, and so the pair)."""
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.outer_dev], capture_output=True, timeout=30)
