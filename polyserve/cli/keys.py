"""The `keys` command: make a space private or public, mint, revoke and list its keys."""

from __future__ import annotations

import json
from typing import Any

import click

from polyserve.cli.client import Client, space_path
from polyserve.cli.command import (
    SPACE,
    HostCommand,
    host_client,
    host_options,
    json_option,
    print_table,
)
from polyserve.cli.render import human_time
from polyserve.cli.writes import _hosts, _lagging


@click.command(cls=HostCommand, short_help="Private spaces: mint, revoke and list keys.")
@click.argument("space", type=SPACE)
@click.option("--add", is_flag=True, help="Mint a key: it is printed this once, never again.")
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    help="With --add: the key's limit, requests per second per worker (429 past it).",
)
@click.option("--revoke", "revoke_id", metavar="ID", help="Revoke the key ID.")
@click.option(
    "--private/--public",
    "private",
    default=None,
    help="Make the space private (only its keys pass) or public (anyone).",
)
@json_option
@host_options
def keys(
    space: str,
    add: bool,
    rate: float | None,
    revoke_id: str | None,
    private: bool | None,
    as_json: bool,
    url: str,
    token: str,
    timeout: float,
) -> None:
    """List SPACE's keys and whether it is private; or change them.

    A private space's routes take `Authorization: Bearer KEY` (docs/private-spaces.md).
    --private/--public first, then --add, then --revoke, each in force on every worker
    (every live host, in a fleet) once the host answers.
    """
    if rate is not None and not add:
        raise click.UsageError("--rate goes with --add: it is the new key's limit")
    client = host_client(url, token, timeout)
    if private is not None:
        _access(client, space, private, as_json)
    if add:
        _mint(client, space, rate, as_json)
    if revoke_id is not None:
        _revoke(client, space, revoke_id, as_json)
    if private is None and not add and revoke_id is None:
        _list(client, space, as_json)


def _access(client: Client, space: str, private: bool, as_json: bool) -> None:
    body = json.dumps({"private": private}).encode()
    status, answer = client.call(
        "PUT", space_path(space, "access"), body=body, content_type="application/json"
    )
    if as_json:
        click.echo(json.dumps(answer))
    else:
        what = "private: only its keys pass" if private else "public: anyone may call it"
        click.echo(f"{space} is {what}{_hosts(answer)}")
    _lagging(status, answer)


def _mint(client: Client, space: str, rate: float | None, as_json: bool) -> None:
    payload: dict[str, object] | None = None if rate is None else {"rate": rate}
    status, answer = client.post_json(space_path(space, "keys"), payload)
    if as_json:
        click.echo(json.dumps(answer))
    else:
        limit = f", {answer['rate']:g} requests/s per worker" if answer.get("rate") else ""
        click.echo(f"minted key {answer['id']} for {space}{limit}{_hosts(answer)}")
        click.echo(f"key: {answer['key']}")
        click.echo("(shown this once: only its sha256 is kept)", err=True)
        if not answer.get("private"):
            click.echo(f"note: {space} is public: `polyserve keys {space} --private`", err=True)
    _lagging(status, answer)


def _revoke(client: Client, space: str, key_id: str, as_json: bool) -> None:
    status, answer = client.call("DELETE", space_path(space, "keys", key_id))
    if as_json:
        click.echo(json.dumps(answer))
    else:
        click.echo(f"revoked key {key_id} of {space}{_hosts(answer)}")
    _lagging(status, answer)


def _list(client: Client, space: str, as_json: bool) -> None:
    answer: dict[str, Any] = client.get(space_path(space, "keys"))
    if as_json:
        click.echo(json.dumps(answer))
        return
    click.echo(f"{space} is {'private' if answer['private'] else 'public'}")
    rows = [
        [
            str(k["id"]),
            "-" if k.get("rate") is None else f"{k['rate']:g}/s",
            human_time(k.get("created")),
        ]
        for k in answer["keys"]
    ]
    print_table(["ID", "RATE", "CREATED"], rows, empty="no keys: `polyserve keys SPACE --add`")
