"""The `polyserve` command: deploy and inspect spaces on a host over HTTP, and autoscale a fleet.

Exit codes, for scripts: 0 done; 1 the host refused (a 4xx: its error is printed); 2 a
usage error (bad arguments, a directory that cannot be packed, a declined
confirmation); 3 the host is unreachable or failed (a 5xx); 4 a fleet committed the
change but some live hosts have not applied it yet, or could not be read (a 202: they
are named, or the answer says why they are unknown); 5 the answer is not a polyserve
host's (not JSON, another shape, empty, cut short: a proxy's page).
"""

from __future__ import annotations

import click

from polyserve.cli import dev, keys, reads, rollout, scale, writes


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """polyserve: deploy, inspect and scale Python spaces.

    Every command but autoscale talks to one host (--url, or POLYSERVE_URL). Exit codes:
    0 done, 1 the host refused, 2 usage error, 3 host unreachable or failed (5xx),
    4 a fleet has not applied the change on every host yet, 5 an answer that is not
    polyserve's (a proxy's page, another server).
    """


for command in (
    writes.deploy,
    writes.rollback,
    rollout.rollout,
    writes.release,
    writes.delete,
    writes.secret,
    reads.list_spaces,
    reads.usage,
    reads.history,
    keys.keys,
    reads.logs,
    scale.autoscale,
    dev.dev,
):
    main.add_command(command)
