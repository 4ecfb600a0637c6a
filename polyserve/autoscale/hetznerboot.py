"""What a Hetzner server runs at its first boot: cloud-init user data that starts polyserve.

The user data writes the host's environment to a file only root reads, a script that
finds the URL the host advertises (its address in the private network, else its public
IPv4), and a systemd unit whose stop is gunicorn's graceful one; then it starts the unit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polyserve.autoscale.hetzner import Options

ENV_FILE = "/etc/polyserve/host.env"
ADVERTISE_FILE = "/etc/polyserve/advertise.env"
ADVERTISE_SCRIPT = "/usr/local/sbin/polyserve-advertise"
UNIT = "polyserve.service"
USER_DATA_MAX = 32 * 1024  # Hetzner's limit on a server's cloud-init user data


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
