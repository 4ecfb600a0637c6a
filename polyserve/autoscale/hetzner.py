"""The hetzner provider: a pool's hosts as Hetzner Cloud servers, through the hcloud SDK.

Each server boots a snapshot that holds polyserve (docs/providers.md says what it must
contain); its cloud-init user data (polyserve/autoscale/hetznerboot.py) writes the
host's environment to a root-only file and starts polyserve under systemd, whose stop is
gunicorn's graceful one. Servers carry the labels polyserve=host and
polyserve-pool=<pool>, and are named after the host's fleet id. The API calls and their
errors are polyserve/autoscale/hetznerapi.py's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polyserve.autoscale import cloud
from polyserve.autoscale.hetznerapi import HetznerAPI
from polyserve.autoscale.hetznerboot import USER_DATA_MAX, cloud_init
from polyserve.autoscale.provider import LABEL, POOL_LABEL, HostSpec, Machine, ProviderError
from polyserve.settings.declare import Setting, const

if TYPE_CHECKING:
    from hcloud import Client
    from hcloud.servers import BoundServer

log = logging.getLogger("polyserve.autoscale.hetzner")

TOKEN_VARIABLE = "HCLOUD_TOKEN"
DEFAULT_ENDPOINT = "https://api.hetzner.cloud/v1"
# "in" while a load balancer may send the server requests. take_out() sets "out", so the
# load balancer's label selector (balanced_selector) stops matching it.
TRAFFIC_LABEL = "polyserve-traffic"
# What Hetzner takes as a server name (an RFC 1123 host name) and as a label value.
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*",
    re.IGNORECASE,
)
_LABEL_VALUE = re.compile(r"[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?", re.IGNORECASE)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "hetzner_server_type",
        str,
        const("cx22"),
        "Hetzner server type of a CPU host (`hcloud server-type list`).",
    ),
    Setting(
        "hetzner_image",
        str,
        const(""),
        "Snapshot id or image name new hosts boot from; it must hold polyserve"
        " (docs/providers.md). Required.",
    ),
    Setting(
        "hetzner_location",
        str,
        const("nbg1"),
        "Hetzner location of new hosts (nbg1, fsn1, hel1, …: `hcloud location list`).",
    ),
    Setting(
        "hetzner_ssh_keys",
        str,
        const(""),
        "Comma-separated names of Hetzner SSH keys to install on new hosts (empty: none).",
    ),
    Setting(
        "hetzner_network",
        str,
        const(""),
        "Private network (name or id) new hosts join; they then advertise their address"
        " in it (empty: their public IPv4).",
    ),
    Setting(
        "hetzner_load_balancer",
        str,
        const(""),
        "Load balancer (name) kept in front of each pool by a label selector (empty: none).",
    ),
    Setting("hetzner_endpoint", str, const(DEFAULT_ENDPOINT), "Hetzner Cloud API endpoint."),
    Setting(
        "hetzner_port",
        cloud.port,
        const(8441),
        "Port a host listens on (0.0.0.0:PORT) and advertises.",
    ),
    Setting(
        "hetzner_workdir",
        str,
        const("/opt/polyserve"),
        "Directory in the image holding gunicorn.conf.py: the host's working directory.",
    ),
    Setting(
        "hetzner_command",
        str,
        const("/opt/polyserve/.venv/bin/gunicorn -c gunicorn.conf.py"),
        "Command systemd starts the host with, run in POLYSERVE_HETZNER_WORKDIR.",
    ),
    Setting(
        "hetzner_user",
        str,
        const("polyserve"),
        "User the host runs as (the image must have it); the env file stays root's.",
    ),
)


@dataclass(frozen=True)
class Options:
    """How a pool's servers are made; built by make() from the settings."""

    server_type: str
    image: str  # a snapshot's id (digits) or an image's name
    location: str = ""
    ssh_keys: tuple[str, ...] = ()
    network: str = ""  # name or id
    load_balancer: str = ""  # name
    port: int = 8441
    workdir: str = "/opt/polyserve"
    command: str = "/opt/polyserve/.venv/bin/gunicorn -c gunicorn.conf.py"
    user: str = "polyserve"
    stop_timeout_s: float = 60.0  # systemd's TimeoutStopSec: the autoscaler's own


def selector(pool: str) -> str:
    """The label selector of a pool's servers, whatever their traffic."""
    return f"{LABEL}=host,{POOL_LABEL}={pool}"


def balanced_selector(pool: str) -> str:
    """The load balancer's selector: the pool's servers not taken out."""
    return f"{selector(pool)},{TRAFFIC_LABEL}=in"


class HetznerProvider:
    """A pool's hosts as Hetzner Cloud servers. Every SDK or network error becomes a
    ProviderError whose message holds neither the token nor the host's secrets."""

    name = "hetzner"

    def __init__(
        self, client: Client, options: Options, *, token: str, endpoint: str, poll_s: float = 2.0
    ) -> None:
        self.api = HetznerAPI(client, token=token, endpoint=endpoint)
        self.options = options
        self.poll_s = poll_s  # between status reads while a server shuts down
        self._balanced: set[str] = set()  # pools whose load balancer target is in place

    def __repr__(self) -> str:
        return f"HetznerProvider(endpoint={self.api.endpoint!r}, options={self.options!r})"

    def list(self, pool: str) -> list[Machine]:
        with self.api.calls(f"listing pool {pool}'s servers"):
            servers = self.api.client.servers.get_all(label_selector=selector(pool))
        return [self._machine(s) for s in servers]

    def create(self, spec: HostSpec) -> Machine:
        if not _HOSTNAME.fullmatch(spec.host_id):
            raise ProviderError(f"hetzner: host id {spec.host_id!r} is not a valid server name")
        if not _LABEL_VALUE.fullmatch(spec.pool):
            raise ProviderError(f"hetzner: pool {spec.pool!r} is not a valid label value")
        cloud.check_environment(spec.environment)
        from hcloud.images import Image
        from hcloud.locations import Location
        from hcloud.server_types import ServerType
        from hcloud.ssh_keys import SSHKey

        o = self.options
        secrets = cloud.secret_values(spec.environment)
        with self.api.calls(f"creating server {spec.host_id}", secrets):
            network = self.api.network(o.network) if o.network else None
            if o.load_balancer and spec.pool not in self._balanced:
                self.api.ensure_target(
                    o.load_balancer, balanced_selector(spec.pool), bool(o.network)
                )
                self._balanced.add(spec.pool)
            network_range = ""  # the host advertises its public IPv4
            if network is not None:
                if not network.ip_range:
                    raise ProviderError(f"hetzner: network {o.network!r} has no IP range")
                network_range = network.ip_range
            user_data = cloud_init(spec.environment, o, network_range)
            if len(user_data.encode()) > USER_DATA_MAX:
                raise ProviderError(
                    f"hetzner: the user data for {spec.host_id} is over Hetzner's 32 KiB"
                )
            response = self.api.client.servers.create(
                name=spec.host_id,
                server_type=ServerType(name=o.server_type),
                image=Image(id=int(o.image)) if o.image.isdigit() else Image(name=o.image),
                location=Location(name=o.location) if o.location else None,
                ssh_keys=[SSHKey(name=k) for k in o.ssh_keys] or None,
                networks=[network] if network else None,
                user_data=user_data,
                labels={LABEL: "host", POOL_LABEL: spec.pool, TRAFFIC_LABEL: "in"},
            )
        server = response.server
        log.info("pool=%s created server %s (id %s)", spec.pool, server.name, server.id)
        return self._machine(server)

    def take_out(self, machine: Machine) -> None:
        if not self.options.load_balancer:
            return  # nothing sits in front of the hosts
        with self.api.calls(f"taking server {machine.host_id} out of the load balancer"):
            server = self.api.server(machine.id)
            if server is None:
                return
            labels = {**(server.labels or {}), TRAFFIC_LABEL: "out"}
            self.api.client.servers.update(server, labels=labels)
        log.info("pool=%s server %s taken out of the load balancer", machine.pool, machine.host_id)

    def stop(self, machine: Machine, timeout_s: float) -> None:
        what = f"stopping server {machine.host_id}"
        with self.api.calls(what):
            server = self.api.server(machine.id)
            if server is None or server.status == "off":
                return
            # ACPI shutdown: the OS stops polyserve.service with SIGTERM, gunicorn drains.
            self.api.client.servers.shutdown(server)
        log.info("pool=%s server %s shutting down", machine.pool, machine.host_id)

        def off() -> bool:
            with self.api.calls(what):
                now = self.api.server(machine.id)
            return now is None or now.status == "off"

        if not cloud.wait_until(off, timeout_s, self.poll_s):
            log.warning(
                "pool=%s server %s is not off after %.0f s",
                machine.pool,
                machine.host_id,
                timeout_s,
            )

    def delete(self, machine: Machine) -> None:
        with self.api.calls(f"deleting server {machine.host_id}"):
            if not self.api.delete_server(machine.id):
                log.info("pool=%s server %s was already gone", machine.pool, machine.host_id)
                return
        log.info("pool=%s deleted server %s", machine.pool, machine.host_id)

    def close(self) -> None:
        """Close the SDK's HTTP connections."""
        self.api.close()

    def _machine(self, server: BoundServer) -> Machine:
        labels = server.labels or {}
        return Machine(
            id=str(server.id),
            host_id=server.name or "",
            pool=labels.get(POOL_LABEL, ""),
            url=self._url(server),
            created_at=server.created.timestamp() if server.created else 0.0,
            state=server.status or "",
        )

    def _url(self, server: BoundServer) -> str:
        """http://<ip>:<port>, the address the host advertises: in the private network
        if there is one (empty until Hetzner has attached it), else the public IPv4."""
        if self.options.network:
            ips = [p.ip for p in server.private_net or [] if p.ip]
        else:
            ipv4 = server.public_net.ipv4 if server.public_net else None
            ips = [ipv4.ip] if ipv4 and ipv4.ip else []
        return f"http://{ips[0]}:{self.options.port}" if ips else ""


def make(values: Mapping[str, Any]) -> HetznerProvider:
    """The provider from the settings read; the token from HCLOUD_TOKEN only."""
    token = cloud.credential(TOKEN_VARIABLE, "hetzner")
    if not values["hetzner_image"]:
        raise ProviderError(
            "POLYSERVE_HETZNER_IMAGE is empty: set it to the id of a snapshot that holds"
            " polyserve (docs/providers.md)"
        )
    try:
        from hcloud import Client
    except ImportError:
        raise ProviderError(
            "the hetzner provider needs the hcloud package: pip install 'polyserve[hetzner]'"
        ) from None
    from polyserve import __version__

    options = Options(
        server_type=values["hetzner_server_type"],
        image=values["hetzner_image"],
        location=values["hetzner_location"],
        ssh_keys=cloud.names(values["hetzner_ssh_keys"]),
        network=values["hetzner_network"],
        load_balancer=values["hetzner_load_balancer"],
        port=values["hetzner_port"],
        workdir=values["hetzner_workdir"],
        command=values["hetzner_command"],
        user=values["hetzner_user"],
        stop_timeout_s=values.get("stop_timeout_s", 60.0),
    )
    client = Client(
        token=token,
        api_endpoint=values["hetzner_endpoint"],
        application_name="polyserve",
        application_version=__version__,
        timeout=(5.0, 30.0),  # connect, read: the SDK waits forever without one
    )
    return HetznerProvider(client, options, token=token, endpoint=values["hetzner_endpoint"])
