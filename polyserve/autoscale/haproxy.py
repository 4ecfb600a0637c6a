"""The `haproxy` hook: put each host a provider makes behind HAProxy, and take it out again.

It wraps any provider (POLYSERVE_HAPROXY_SOCKET set): once a machine has a URL, its host
is added to the backend through HAProxy's runtime API (`add server … check id N`, then
`enable health`, `enable server` and `set server … health down`, so it takes requests
once its checks pass); `take_out` drains it (`set server … state drain`:
no new requests, those in flight finish) and `delete` removes it (`state maint`, `del
server`). `list` reconciles, so a URL a cloud learns later, or an HAProxy restarted
without them, still gets the provider's hosts. Servers are named by their fleet host id;
servers of the config file (other names) are left alone.

Each added server gets an explicit id, the next free one: HAProxy 2.6 places a dynamic
server on the consistent-hash ring by its id only when the id is given on `add server`
(without it, its place differs from the same server's in a config file, so a reload
would move its spaces; bench/NOTES.md).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from polyserve.autoscale.provider import LABEL, HostSpec, Machine, Provider, ProviderError
from polyserve.settings.declare import Setting, const

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "haproxy_socket",
        str,
        const(""),
        "haproxy hook: HAProxy's admin stats socket (runtime API); empty: no hook.",
    ),
    Setting(
        "haproxy_backend",
        str,
        const("polyserve"),
        "haproxy hook: the backend the hosts are added to (contrib/haproxy.cfg's).",
    ),
)
TIMEOUT_S = 5.0
# What a new server is added with: the health check of contrib/haproxy.cfg's backend
# (its default-server line does not apply to servers added at runtime).
SERVER_OPTIONS = "check inter 2s fall 2 rise 2"
DRAIN = 0x08  # HAProxy's SRV_ADMF_FDRAIN, in `show servers state`'s srv_admin_state


class RuntimeAPI:
    """HAProxy's runtime API on a UNIX stats socket: one command per connection."""

    def __init__(self, path: str) -> None:
        self.path = path

    def command(self, line: str) -> str:
        """Send one command and return HAProxy's whole answer."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(TIMEOUT_S)
                conn.connect(self.path)
                conn.sendall(line.encode() + b"\n")
                chunks = []
                while chunk := conn.recv(65536):
                    chunks.append(chunk)
        except OSError as exc:
            raise ProviderError(f"HAProxy's socket {self.path}: {exc}") from exc
        return b"".join(chunks).decode(errors="replace")

    def servers(self, backend: str) -> dict[str, Server]:
        """The backend's servers by name (`show servers state`)."""
        answer = self.command(f"show servers state {backend}")
        found = {}
        for line in answer.splitlines():
            fields = line.split()
            # A row: be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state
            # ... srv_port (the 19th); the first line is the format version, then "#".
            if len(fields) >= 19 and fields[1] == backend and fields[2].isdigit():
                found[fields[3]] = Server(
                    fields[3],
                    int(fields[2]),
                    fields[4],
                    int(fields[18]),
                    int(fields[5]),
                    int(fields[6]),
                )
        if not found and "Can't find backend" in answer:
            raise ProviderError(f"HAProxy has no backend {backend!r}: {answer.strip()}")
        return found


@dataclass(frozen=True)
class Server:
    """One server of the backend as `show servers state` tells it."""

    name: str
    id: int
    addr: str
    port: int
    op_state: int  # 0 stopped (down, or in maintenance), 2 running, 1 starting, 3 stopping
    admin_state: int  # flags: 0x01 maintenance (`state maint`), 0x08 draining (`state drain`)

    @property
    def draining(self) -> bool:
        return bool(self.admin_state & DRAIN)


class Balanced:
    """A provider whose hosts HAProxy balances: each call delegates, then updates HAProxy."""

    def __init__(self, provider: Provider, api: RuntimeAPI, backend: str) -> None:
        self.provider, self.api, self.backend = provider, api, backend
        self.name = provider.name

    def list(self, pool: str) -> list[Machine]:
        machines = self.provider.list(pool)
        servers = self.api.servers(self.backend)
        for m in machines:
            if m.url and _address(m.url) != _at(servers.get(m.host_id)):
                self.add(m, servers)
        # A server of ours (named like the hosts the scaler makes) whose host is gone.
        listed = {m.host_id for m in machines}
        for name in servers:
            if name.startswith(f"{LABEL}-{pool}-") and name not in listed:
                self.remove(name)
        return machines

    def create(self, spec: HostSpec) -> Machine:
        machine = self.provider.create(spec)
        if machine.url:
            self.add(machine, self.api.servers(self.backend))
        return machine

    def take_out(self, machine: Machine) -> None:
        self.provider.take_out(machine)
        self._expect(f"set server {self.backend}/{machine.host_id} state drain", "")

    def stop(self, machine: Machine, timeout_s: float) -> None:
        self.provider.stop(machine, timeout_s)

    def delete(self, machine: Machine) -> None:
        self.provider.delete(machine)
        self.remove(machine.host_id)

    def add(self, machine: Machine, servers: Mapping[str, Server]) -> None:
        """Add the machine's host as a server (again, if its address changed), with the
        next free id, its health check on, in service."""
        name = f"{self.backend}/{machine.host_id}"
        if machine.host_id in servers:
            self.remove(machine.host_id)
        ids = [s.id for s in servers.values() if s.name != machine.host_id]
        host, port = _address(machine.url)
        self._expect(
            f"add server {name} {host}:{port} {SERVER_OPTIONS} id {max(ids, default=0) + 1}",
            "New server registered",
        )
        self._expect(f"enable health {name}", "")
        self._expect(f"enable server {name}", "")
        # HAProxy 2.6 counts a server that leaves maintenance as up before its first
        # check: down at once, it gets requests only once `rise` checks have passed.
        self._expect(f"set server {name} health down", "")

    def remove(self, host_id: str) -> None:
        """Take the server out of the backend for good (gone already: nothing to do)."""
        name = f"{self.backend}/{host_id}"
        answer = self.api.command(f"set server {name} state maint")
        if "No such server" in answer:
            return
        # `del server` refuses while connections are open to it: the host is deleted by
        # now, so they end with its process; the next list() tries again.
        answer = self.api.command(f"del server {name}")
        if "Server deleted" not in answer and "No such server" not in answer:
            raise ProviderError(f"HAProxy did not delete {name}: {answer.strip()}")

    def _expect(self, command: str, wanted: str) -> None:
        """Run a command whose answer is `wanted` (empty: an empty answer is success)."""
        answer = self.api.command(command).strip()
        if (wanted and wanted not in answer) or (not wanted and answer):
            raise ProviderError(f"HAProxy refused `{command}`: {answer}")


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if not parts.hostname:
        raise ProviderError(f"a host URL without a host name: {url!r}")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _at(server: Server | None) -> tuple[str, int] | None:
    return None if server is None else (server.addr, server.port)


def wrap(provider: Any, values: Mapping[str, Any]) -> Any:
    """The provider, behind HAProxy when POLYSERVE_HAPROXY_SOCKET is set."""
    if not values.get("haproxy_socket"):
        return provider
    return Balanced(provider, RuntimeAPI(values["haproxy_socket"]), values["haproxy_backend"])
