"""The commands that read a host: list, usage, history, logs."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from polyserve.cli.client import HostRefused, space_path
from polyserve.cli.command import (
    SPACE,
    HostCommand,
    host_client,
    host_options,
    json_option,
    print_table,
)
from polyserve.cli.render import human_bytes, human_ms, human_time

LOGS_POLL_S = 1.0  # `logs -f`: how often the host is asked for new records


@click.command("list", cls=HostCommand, short_help="Every deployed space and its version.")
@json_option
@host_options
def list_spaces(as_json: bool, url: str, token: str, timeout: float) -> None:
    """Every deployed space with its current version."""
    answer = host_client(url, token, timeout).get("/_polyserve/spaces")
    if as_json:
        click.echo(json.dumps(answer))
        return
    rows = [
        [
            space,
            f"v{meta.get('version')}",
            str(meta.get("kind")),
            str(meta.get("entry")),
            human_bytes(meta.get("size")),
            human_ms(meta.get("import_ms")),
            human_time(meta.get("deployed_at")),
        ]
        for space, meta in sorted(answer["spaces"].items())
    ]
    headers = ["SPACE", "VERSION", "KIND", "ENTRY", "SIZE", "IMPORT", "DEPLOYED"]
    print_table(headers, rows, right={1, 4, 5}, empty="no spaces deployed")


@click.command(cls=HostCommand, short_help="Usage per space, as a table.")
@click.option("--fleet", is_flag=True, help="The fleet's ledger, summed over every host.")
@json_option
@host_options
def usage(fleet: bool, as_json: bool, url: str, token: str, timeout: float) -> None:
    """Usage per space: requests, errors, busy and warm time, cold starts, memory."""
    client = host_client(url, token, timeout)
    answer = client.get("/_polyserve/usage", **({"scope": "fleet"} if fleet else {}))
    if as_json:
        click.echo(json.dumps(answer))
        return
    spaces = sorted(answer["spaces"].items())
    if fleet:
        headers = ["SPACE", "REQUESTS", "ERRORS", "BUSY", "WARM", "COLD STARTS"]
        print_table(headers, [_billing(name, u) for name, u in spaces], right={1, 2, 3, 4, 5})
        click.echo()
        headers[0] = "HOST"
        hosts = sorted(answer["hosts"].items())
        print_table(headers, [_billing(name, u) for name, u in hosts], right={1, 2, 3, 4, 5})
        return
    rows = [
        [
            *_billing(name, u),
            str(u.get("workers_loaded", 0)),
            human_ms(u.get("last_import_ms")),
            human_bytes((u.get("memory_kib") or 0) * 1024),
            _releases(u),
        ]
        for name, u in spaces
    ]
    headers = ["SPACE", "REQUESTS", "ERRORS", "BUSY", "WARM", "COLD STARTS", "WORKERS"]
    headers += ["LAST IMPORT", "MEMORY", "RELEASED (IDLE/MEM/DEMAND)"]
    print_table(headers, rows, right=set(range(1, 10)), empty="no usage yet")
    host = answer["host"]
    click.echo(
        f"\nhost: {host['workers']} workers, up {human_ms(host['uptime_s'] * 1000)},"
        f" busy {human_ms(host['busy_ms'])}, {host['in_flight']} in flight"
    )


def _releases(u: dict[str, Any]) -> str:
    return "/".join(
        f"{u.get('released_' + reason, 0):,}" for reason in ("idle", "memory", "demand")
    )


def _billing(name: str, u: dict[str, Any]) -> list[str]:
    return [
        name,
        f"{u.get('requests', 0):,}",
        f"{u.get('errors', 0):,}",
        human_ms(u.get("busy_ms")),
        human_ms((u.get("warm_s") or 0) * 1000),
        f"{u.get('cold_starts', 0):,}",
    ]


@click.command(cls=HostCommand, short_help="A space's kept versions and what happened.")
@click.argument("space", type=SPACE)
@json_option
@host_options
def history(space: str, as_json: bool, url: str, token: str, timeout: float) -> None:
    """SPACE's kept versions (* marks the current one) and what happened to it."""
    answer = host_client(url, token, timeout).get(space_path(space, "versions"))
    if as_json:
        click.echo(json.dumps(answer))
        return
    rows = [
        [
            ("* " if v["current"] else "  ") + f"v{v['version']}",
            str(v.get("sha256"))[:12],
            human_bytes(v.get("size")),
            str(v.get("kind")),
            str(v.get("entry")),
            human_ms(v.get("import_ms")),
            human_time(v.get("deployed_at")),
        ]
        for v in answer["versions"]
    ]
    headers = ["VERSION", "SHA256", "SIZE", "KIND", "ENTRY", "IMPORT", "DEPLOYED"]
    print_table(headers, rows, right={2, 5}, empty="no version kept")
    keep = answer.get("keep_versions")
    if answer.get("store") == "fleet":
        click.echo(f"(every version the fleet stores; each host keeps up to {keep} on disk)")
    else:
        click.echo(f"(the versions this host keeps: up to {keep})")
    click.echo()
    events = [
        [
            human_time(e.get("at")),
            str(e.get("event")),
            _v(e.get("version")),
            _v(e.get("previous")),
        ]
        for e in answer["history"]
    ]
    print_table(["TIME", "EVENT", "VERSION", "PREVIOUS"], events, right={2, 3})


def _v(number: object) -> str:
    return "-" if number is None else f"v{number}"


@click.command(cls=HostCommand, short_help="What a space logged recently (-f follows).")
@click.argument("space", type=SPACE)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new records until Ctrl-C.")
@click.option(
    "--since", type=click.IntRange(min=0), default=0, help="Only records after this cursor."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON record a line.")
@host_options
def logs(
    space: str,
    follow: bool,
    since: int,
    as_json: bool,
    url: str,
    token: str,
    timeout: float,
) -> None:
    """What SPACE logged recently on this host (logging, print, exceptions), oldest first."""
    client = host_client(url, token, timeout)
    try:
        while True:
            answer = client.get(space_path(space, "logs"), since=since)
            for record in answer.get("records", []):
                click.echo(json.dumps(record) if as_json else log_line(record))
            since = int(answer.get("next", since))
            if not follow:
                return
            time.sleep(LOGS_POLL_S)
    except KeyboardInterrupt:  # how -f ends
        return
    except HostRefused as exc:
        if exc.status == 404 and exc.error == "Not Found":  # no such route: an older host
            exc.error = "this host has no per-space logs (its polyserve is older than this one)"
        raise


def log_line(record: dict[str, Any]) -> str:
    when = human_time(record.get("time"), millis=True)
    return (
        f"{when} {record.get('level', '')!s:<7} v{record.get('version')}"
        f" pid {record.get('worker')} {record.get('stream')}: {record.get('message')}"
    )
