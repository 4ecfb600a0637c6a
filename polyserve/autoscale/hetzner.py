"""The hetzner provider: a pool's hosts as Hetzner Cloud servers, through the hcloud SDK.

Each server boots a snapshot that holds polyserve (docs/providers.md says what it must
contain); cloud-init writes the host's environment to a root-only file and starts
polyserve under systemd, whose stop is gunicorn's graceful one. Servers carry the labels
polyserve=host and polyserve-pool=<pool>, and are named after the host's fleet id.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polyserve.autoscale import cloud
from polyserve.autoscale.provider import LABEL, POOL_LABEL, HostSpec, Machine, ProviderError
from polyserve.settings.declare import Setting, const

if TYPE_CHECKING:
    from hcloud import APIException, Client
    from hcloud.networks import BoundNetwork
    from hcloud.servers import BoundServer

log = logging.getLogger("polyserve.autoscale.hetzner")

TOKEN_VARIABLE = "HCLOUD_TOKEN"
DEFAULT_ENDPOINT = "https://api.hetzner.cloud/v1"
# "in" while a load balancer may send the server requests. take_out() sets "out", so the
# load balancer's label selector (balanced_selector) stops matching it.
TRAFFIC_LABEL = "polyserve-traffic"
ENV_FILE = "/etc/polyserve/host.env"
ADVERTISE_FILE = "/etc/polyserve/advertise.env"
ADVERTISE_SCRIPT = "/usr/local/sbin/polyserve-advertise"
UNIT = "polyserve.service"
USER_DATA_MAX = 32 * 1024  # Hetzner's limit on a server's cloud-init user data
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
        self._client = client
        self.options = options
        self.poll_s = poll_s  # between status reads while a server shuts down
        self._redact = cloud.Redactor(token)
        self._endpoint = cloud.endpoint_host(endpoint)
        self._network: BoundNetwork | None = None
        self._balanced: set[str] = set()  # pools whose load balancer target is in place

    def __repr__(self) -> str:
        return f"HetznerProvider(endpoint={self._endpoint!r}, options={self.options!r})"

    def list(self, pool: str) -> list[Machine]:
        with self._calls(f"listing pool {pool}'s servers"):
            servers = self._client.servers.get_all(label_selector=selector(pool))
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
        with self._calls(f"creating server {spec.host_id}", cloud.secret_values(spec.environment)):
            network = self._resolve_network()
            if o.load_balancer:
                self._ensure_target(spec.pool)
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
            response = self._client.servers.create(
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
        with self._calls(f"taking server {machine.host_id} out of the load balancer"):
            server = self._get(machine)
            if server is None:
                return
            labels = {**(server.labels or {}), TRAFFIC_LABEL: "out"}
            self._client.servers.update(server, labels=labels)
        log.info("pool=%s server %s taken out of the load balancer", machine.pool, machine.host_id)

    def stop(self, machine: Machine, timeout_s: float) -> None:
        what = f"stopping server {machine.host_id}"
        with self._calls(what):
            server = self._get(machine)
            if server is None or server.status == "off":
                return
            # ACPI shutdown: the OS stops polyserve.service with SIGTERM, gunicorn drains.
            self._client.servers.shutdown(server)
        log.info("pool=%s server %s shutting down", machine.pool, machine.host_id)

        def off() -> bool:
            with self._calls(what):
                now = self._get(machine)
            return now is None or now.status == "off"

        if not cloud.wait_until(off, timeout_s, self.poll_s):
            log.warning(
                "pool=%s server %s is not off after %.0f s",
                machine.pool,
                machine.host_id,
                timeout_s,
            )

    def delete(self, machine: Machine) -> None:
        from hcloud import APIException
        from hcloud.servers import Server

        with self._calls(f"deleting server {machine.host_id}"):
            try:
                self._client.servers.delete(Server(id=int(machine.id)))
            except APIException as exc:
                if not _not_found(exc):
                    raise
                log.info("pool=%s server %s was already gone", machine.pool, machine.host_id)
                return
        log.info("pool=%s deleted server %s", machine.pool, machine.host_id)

    def close(self) -> None:
        """Close the SDK's HTTP connections."""
        # hcloud keeps a requests.Session per API base and offers no close of its own;
        # reached by name, so a release that renames them only leaves them to the GC.
        for base in ("_client", "_client_hetzner"):
            session = getattr(getattr(self._client, base, None), "_session", None)
            if session is not None:
                session.close()

    # -- helpers --

    def _get(self, machine: Machine) -> BoundServer | None:
        """The server as it is now; None once it is gone."""
        from hcloud import APIException

        try:
            return self._client.servers.get_by_id(int(machine.id))
        except APIException as exc:
            if _not_found(exc):
                return None
            raise

    def _resolve_network(self) -> BoundNetwork | None:
        name = self.options.network
        if not name:
            return None
        if self._network is None:
            nets = self._client.networks
            found = nets.get_by_id(int(name)) if name.isdigit() else nets.get_by_name(name)
            if found is None:
                raise ProviderError(f"hetzner: network {name!r} not found")
            self._network = found
        return self._network

    def _ensure_target(self, pool: str) -> None:
        """Give the load balancer a label-selector target for the pool, once."""
        if pool in self._balanced:
            return
        from hcloud.load_balancers import LoadBalancerTarget, LoadBalancerTargetLabelSelector

        name, wanted = self.options.load_balancer, balanced_selector(pool)
        lb = self._client.load_balancers.get_by_name(name)
        if lb is None:
            raise ProviderError(f"hetzner: load balancer {name!r} not found")
        present = any(
            t.type == "label_selector" and t.label_selector and t.label_selector.selector == wanted
            for t in lb.targets or []
        )
        if not present:
            target = LoadBalancerTarget(
                type="label_selector",
                label_selector=LoadBalancerTargetLabelSelector(selector=wanted),
                use_private_ip=bool(self.options.network),
            )
            self._client.load_balancers.add_target(lb, target)
            log.info("load balancer %s now targets %s", name, wanted)
        self._balanced.add(pool)

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

    @contextlib.contextmanager
    def _calls(self, what: str, secrets: Iterable[str] = ()) -> Iterator[None]:
        """SDK and network errors as ProviderErrors with a message safe to log. The
        cause is dropped (from None): a traceback would carry the SDK's objects."""
        import requests
        from hcloud import APIException, HCloudException

        try:
            yield
        except APIException as exc:
            message = self._redact(exc.message, secrets)
            raise ProviderError(f"hetzner: {what} failed: {exc.code}: {message}") from None
        except HCloudException as exc:
            raise ProviderError(f"hetzner: {what} failed: {type(exc).__name__}") from None
        except requests.RequestException as exc:
            raise ProviderError(
                f"hetzner: {what} failed: cannot reach {self._endpoint} ({type(exc).__name__})"
            ) from None


def _not_found(exc: APIException) -> bool:
    # A JSON error says "not_found"; a bare 404 (a proxy's) only has its status.
    return exc.code in ("not_found", 404)


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


# -- what a server runs at its first boot --


def cloud_init(environment: Mapping[str, str], options: Options, network_range: str) -> str:
    """The server's cloud-init user data: the host's environment in a file only root
    reads, the script that finds the URL to advertise, the systemd unit, and its start."""
    import yaml

    env = {**environment, "POLYSERVE_BIND": f"0.0.0.0:{options.port}"}
    files = [
        (ENV_FILE, "0600", env_file(env)),
        (ADVERTISE_SCRIPT, "0755", ADVERTISE_PY),
        (f"/etc/systemd/system/{UNIT}", "0644", systemd_unit(options)),
    ]
    config = {
        "write_files": [
            {"path": path, "owner": "root:root", "permissions": mode, "content": content}
            for path, mode, content in files
        ],
        "runcmd": [
            [ADVERTISE_SCRIPT, network_range, str(options.port), ADVERTISE_FILE],
            ["systemctl", "daemon-reload"],
            ["systemctl", "enable", "--now", UNIT],
        ],
    }

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
        # Files as literal blocks, readable in the Hetzner console and on the server.
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, text)
    return "#cloud-config\n" + yaml.dump(config, Dumper=Dumper, sort_keys=False, width=1000)


def env_file(env: Mapping[str, str]) -> str:
    """KEY="value" lines, read alike by systemd's EnvironmentFile= and a POSIX shell:
    inside double quotes both take \\ " ` $ literally when escaped with a backslash."""
    return "".join(f"{k}={_quoted(v)}\n" for k, v in env.items())


_SPECIAL = re.compile(r'[\\"`$]')


def _quoted(value: str) -> str:
    return '"' + _SPECIAL.sub(r"\\\g<0>", value) + '"'


def systemd_unit(options: Options) -> str:
    """polyserve.service: gunicorn in the install directory, as options.user."""
    return f"""\
[Unit]
Description=polyserve host
Wants=network-online.target
After=network-online.target

[Service]
User={options.user}
WorkingDirectory={options.workdir}
StateDirectory=polyserve
Environment=POLYSERVE_DATA_DIR=/var/lib/polyserve
# systemd reads these as root before it becomes {options.user}: the first stays root's.
EnvironmentFile={ENV_FILE}
EnvironmentFile={ADVERTISE_FILE}
ExecStart={options.command}
# gunicorn's graceful stop: SIGTERM to the master alone, which lets its workers finish
# what they accepted and write their last usage; what is left after TimeoutStopSec dies.
KillMode=mixed
KillSignal=SIGTERM
TimeoutStopSec={math.ceil(options.stop_timeout_s)}
Restart=on-failure
RestartSec=5

[Install]
WantedBy=multi-user.target
"""


ADVERTISE_PY = r'''#!/usr/bin/env python3
"""Write POLYSERVE_ADVERTISE_URL=http://ADDRESS:PORT to FILE: ADDRESS is this server's
IPv4 address in NETWORK (a CIDR range), or with NETWORK empty its public IPv4.

usage: polyserve-advertise NETWORK PORT FILE   (run once by polyserve's cloud-init)"""
import ipaddress
import json
import subprocess
import sys
import time

network, port, path = sys.argv[1:4]
wanted = ipaddress.ip_network(network) if network else None
# A private network's interface can come up after cloud-init starts: retry 2 minutes.
for _ in range(60):
    out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True)
    addresses = [
        ipaddress.ip_address(a["local"])
        for link in json.loads(out.stdout or "[]")
        for a in link.get("addr_info", [])
    ]
    found = [a for a in addresses if (a in wanted if wanted else a.is_global)]
    if found:
        with open(path, "w") as f:
            f.write(f"POLYSERVE_ADVERTISE_URL=http://{found[0]}:{port}\n")
        sys.exit(0)
    time.sleep(2)
sys.exit(f"polyserve-advertise: no IPv4 address {'in ' + network if network else 'is public'}")
'''
