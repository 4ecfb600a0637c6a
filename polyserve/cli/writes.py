"""The commands that change a host's spaces: deploy, rollback, release, delete, secret."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from polyserve.cli.client import BadAnswer, HostRefused, space_path
from polyserve.cli.command import (
    EXIT_LAGGING,
    EXIT_USAGE,
    SPACE,
    HostCommand,
    host_client,
    host_options,
    json_option,
    print_table,
)
from polyserve.cli.render import human_bytes, human_ms, human_time, plural


@click.command(cls=HostCommand, short_help="Deploy a .py file, a tar or a directory.")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--space", type=SPACE, required=True, help="The space to deploy to: owner/name.")
@click.option("--dry-run", is_flag=True, help="List what a directory would ship; send nothing.")
@click.option(
    "--no-current",
    is_flag=True,
    help="Store and validate it, but leave the current version serving (for a rollout).",
)
@json_option
@host_options
def deploy(
    path: Path,
    space: str,
    dry_run: bool,
    no_current: bool,
    as_json: bool,
    url: str,
    token: str,
    timeout: float,
) -> None:
    """Deploy PATH as the next version of a space.

    PATH is a .py file, a tar (plain or gzip), or a directory, packed on the fly without
    __pycache__, .git, virtualenvs and what its .polyserveignore lists (.gitignore
    syntax). Prints the version, its sha256 and how long its import took.
    """
    if path.is_dir():
        from polyserve.cli.pack import PackError, pack

        try:
            packed = pack(path)
        except PackError as exc:
            raise click.UsageError(str(exc)) from None
        filename, data = f"{path.resolve().name or 'space'}.tar.gz", packed.data
        skipped = ", ".join(packed.skipped[:6]) + (", …" if len(packed.skipped) > 6 else "")
        note = f"packed {len(packed.files)} files from {path} ({human_bytes(len(data))} gzip)"
        click.echo(note + (f"; left out {skipped}" if skipped else ""), err=True)
        if dry_run:
            for name in packed.files:
                click.echo(name)
            return
    else:
        if dry_run:
            raise click.UsageError("--dry-run lists what a directory would ship: PATH is a file")
        filename, data = path.name, path.read_bytes()
    try:
        client = host_client(url, token, timeout)
        status, body = client.deploy(space, filename, data, current=not no_current)
    except (HostRefused, BadAnswer) as exc:
        if exc.status != 413:
            raise
        raise _too_large(exc, len(data)) from None
    if as_json:
        click.echo(json.dumps(body))
    else:
        click.echo(
            f"deployed {body['space']} v{body['version']}: sha256 {body['sha256'][:12]},"
            f" import {human_ms(body.get('import_ms'))}, {body.get('kind')} in"
            f" {body.get('entry')}, {human_bytes(body.get('size'))}{_hosts(body)}"
            + (" (not current: start a rollout)" if body.get("current") is False else "")
        )
    _lagging(status, body)


def _too_large(exc: HostRefused | BadAnswer, size: int) -> HostRefused:
    """A 413 to a deploy, with the upload's size. polyserve's answer says which limit it
    passed; a proxy's page names none."""
    if isinstance(exc, HostRefused):
        return HostRefused(413, exc.error, {**exc.details, "upload": human_bytes(size)})
    return HostRefused(
        413,
        f"the upload is too large for the host at {exc.url}; the answer names no limit"
        " (a proxy's, or the host's POLYSERVE_MAX_UPLOAD_MB)",
        {"upload": human_bytes(size)},
    )


@click.command(cls=HostCommand, short_help="Make a kept version current again.")
@click.argument("space", type=SPACE)
@click.argument("version", type=click.IntRange(min=1), required=False)
@json_option
@host_options
def rollback(
    space: str, version: int | None, as_json: bool, url: str, token: str, timeout: float
) -> None:
    """Make a kept version of SPACE current again.

    Without VERSION: the version the current one replaced when it was deployed, so
    repeated rollbacks walk back through the deploys. `polyserve history` lists the
    kept versions.
    """
    payload: dict[str, object] | None = None if version is None else {"version": version}
    client = host_client(url, token, timeout)
    status, body = client.post_json(space_path(space, "rollback"), payload)
    if as_json:
        click.echo(json.dumps(body))
    else:
        click.echo(
            f"rolled back {space} to v{body['version']} (was v{body['previous']}):"
            f" sha256 {str(body.get('sha256'))[:12]}{_hosts(body)}"
        )
    _lagging(status, body)


@click.command(cls=HostCommand, short_help="Release a space in every worker now.")
@click.argument("space", type=SPACE)
@host_options
def release(space: str, url: str, token: str, timeout: float) -> None:
    """Release SPACE in every worker now: the next request imports it afresh."""
    status, body = host_client(url, token, timeout).post_json(space_path(space, "release"))
    if "workers_signalled" in body:
        others = plural(body["workers_signalled"], "other worker")
        click.echo(f"released {space} (signalled {others})")
    else:
        click.echo(f"released {space}{_hosts(body)}")
    _lagging(status, body)


@click.command(cls=HostCommand, short_help="Undeploy a space (asks first).")
@click.argument("space", type=SPACE)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@host_options
def delete(space: str, yes: bool, url: str, token: str, timeout: float) -> None:
    """Undeploy SPACE: its requests answer 404; its usage stays readable."""
    client = host_client(url, token, timeout)
    if not yes:
        try:
            confirmed = click.confirm(f"delete {space} from {client.url}?", default=False)
        except click.Abort:  # no answer (no terminal, end of input)
            click.echo(err=True)  # end the prompt's line
            confirmed = False
        if not confirmed:
            click.echo("not deleted (pass --yes to delete without asking)", err=True)
            sys.exit(EXIT_USAGE)
    status, body = client.call("DELETE", space_path(space))
    click.echo(f"deleted {space}{_hosts(body)}")
    _lagging(status, body)


@click.group(short_help="Set, list and unset a space's secrets.")
def secret() -> None:
    """A space's secrets, which its code reads with polyserve.secrets.get("NAME").

    Values are never printed back: `list` shows names and when each was set. A change
    reloads the space; once the command returns, every worker serves the new value.
    """


@secret.command("set", cls=HostCommand, short_help="Set a secret (value from stdin).")
@click.argument("space", type=SPACE)
@click.argument("name")
@click.option(
    "--value",
    help="The value (it then shows in your shell's history and `ps`: prefer stdin).",
)
@host_options
def secret_set(
    space: str, name: str, value: str | None, url: str, token: str, timeout: float
) -> None:
    """Set secret NAME of SPACE. The value is read from stdin (one trailing newline
    dropped), asked for without echo on a terminal, or given with --value."""
    if value is None:
        if sys.stdin.isatty():
            value = click.prompt(f"value of {name}", hide_input=True, err=True)
        else:
            value = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
            value = value.removesuffix("\n").removesuffix("\r")
    data = value.encode("utf-8", "surrogateescape")
    client = host_client(url, token, timeout)
    status, body = client.call(
        "PUT",
        space_path(space, "secrets", name),
        body=data,
        content_type="text/plain; charset=utf-8",
    )
    click.echo(f"set secret {name} of {space} ({plural(len(data), 'byte')}){_hosts(body)}")
    _lagging(status, body)


@secret.command("list", cls=HostCommand, short_help="A space's secrets: names, never values.")
@click.argument("space", type=SPACE)
@json_option
@host_options
def secret_list(space: str, as_json: bool, url: str, token: str, timeout: float) -> None:
    """The names of SPACE's secrets and when each was set."""
    answer = host_client(url, token, timeout).get(space_path(space, "secrets"))
    if as_json:
        click.echo(json.dumps(answer))
        return
    rows = [[s["name"], human_time(s.get("updated_at"))] for s in answer["secrets"]]
    print_table(["NAME", "UPDATED"], rows, empty=f"{space} has no secrets")


@secret.command("unset", cls=HostCommand, short_help="Remove a secret.")
@click.argument("space", type=SPACE)
@click.argument("name")
@host_options
def secret_unset(space: str, name: str, url: str, token: str, timeout: float) -> None:
    """Remove secret NAME of SPACE."""
    client = host_client(url, token, timeout)
    status, body = client.call("DELETE", space_path(space, "secrets", name))
    click.echo(f"unset secret {name} of {space}{_hosts(body)}")
    _lagging(status, body)


def _hosts(body: dict[str, Any]) -> str:
    """In a fleet: how many live hosts have applied the change."""
    hosts = body.get("hosts")
    if not isinstance(hosts, dict):
        return ""
    if hosts.get("unknown"):
        return "; which hosts applied it is unknown"
    return f"; applied on {hosts.get('applied')} of {hosts.get('live')} live hosts"


def _lagging(status: int, body: dict[str, Any]) -> None:
    """A 202: committed, not yet confirmed everywhere. Not a failure (running the
    command again would make the change twice), so not exit 3: exit 4, and why."""
    if status == 202:
        hosts = body.get("hosts", {})
        if hosts.get("unknown"):
            warning = hosts.get("error") or "committed, but which hosts applied it is unknown"
            click.echo(f"warning: {warning}", err=True)
        if hosts.get("lagging"):
            lagging = ", ".join(hosts["lagging"])
            click.echo(
                f"warning: committed, but these live hosts have not applied it yet: {lagging}",
                err=True,
            )
        for host, error in hosts.get("skipped", {}).items():
            click.echo(f"warning: committed, but host {host} cannot apply it: {error}", err=True)
        sys.exit(EXIT_LAGGING)
