"""`polyserve rollout`: start a space's rollout and watch it, pause, resume, abort, show it."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from polyserve.cli.client import Client, space_path
from polyserve.cli.command import (
    EXIT_REFUSED,
    SPACE,
    HostCommand,
    fail,
    host_client,
    host_options,
    json_option,
)

_OVER = ("rolled_back", "completed", "aborted")
POLL_S = 0.5


def _steps(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(p) for p in value.split(",")]
    except ValueError:
        raise click.BadParameter("percents separated by commas, e.g. 5,25,50,100") from None


@click.command(cls=HostCommand, short_help="Move a space to a new version by steps of percent.")
@click.argument("space", type=SPACE)
@click.option("--version", type=click.IntRange(min=1), help="Start one: the new version.")
@click.option("--steps", callback=_steps, help="Percents, e.g. 5,25,50,100 (the default).")
@click.option("--step-s", type=float, help="Seconds per step (60).")
@click.option("--max-error-rate", type=float, help="How much more the new one may fail (0.05).")
@click.option("--sticky-header", help="A header that keeps one client on one version.")
@click.option("--pause", "act", flag_value="pause", help="Pause the running rollout.")
@click.option("--resume", "act", flag_value="resume", help="Resume a paused rollout.")
@click.option("--abort", "act", flag_value="abort", help="Abort it: the new version gets 0%.")
@click.option("--no-watch", is_flag=True, help="Start it and return; do not watch it.")
@json_option
@host_options
def rollout(
    space: str,
    version: int | None,
    steps: list[int] | None,
    step_s: float | None,
    max_error_rate: float | None,
    sticky_header: str | None,
    act: str | None,
    no_watch: bool,
    as_json: bool,
    url: str,
    token: str,
    timeout: float,
) -> None:
    """Start, watch, pause, resume or abort the rollout of SPACE, or show it.

    With --version N (deployed with `polyserve deploy --no-current`), start one and
    print a line per step until it is over; it exits 1 when it was rolled back or
    aborted. Without options, show the space's rollout (docs/rollouts.md).
    """
    client = host_client(url, token, timeout)
    if act is not None:
        _, body = client.post_json(space_path(space, "rollout", act))
        _show(body, as_json)
        return
    if version is None:
        _show(client.get(space_path(space, "rollout")), as_json)
        return
    asked: dict[str, object] = {"version": version}
    for key, value in (
        ("steps", steps),
        ("step_s", step_s),
        ("max_error_rate", max_error_rate),
        ("sticky_header", sticky_header),
    ):
        if value is not None:
            asked[key] = value
    _, body = client.post_json(space_path(space, "rollout"), asked)
    if no_watch:
        _show(body, as_json)
        return
    body = _watch(client, space, body, as_json)
    if body["status"] != "completed":
        fail(click.get_current_context(), [f"error: {body.get('reason')}"], EXIT_REFUSED)


def _watch(client: Client, space: str, body: dict[str, Any], as_json: bool) -> dict[str, Any]:
    """A line each time the step or the status changes, until the rollout is over."""
    seen: tuple[object, object] | None = None
    while True:
        now = (body["step"], body["status"])
        if now != seen:
            seen = now
            _show(body, as_json)
        if body["status"] in _OVER:
            return body
        time.sleep(POLL_S)
        body = client.get(space_path(space, "rollout"))


def _show(body: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(body))
        return
    counts = body.get("versions", {})
    figures = ", ".join(
        f"v{v} {c['requests']} requests {c['errors']} errors" for v, c in counts.items()
    )
    weights = " / ".join(f"v{v} {w}%" for v, w in body.get("weights", {}).items())
    steps = body.get("steps", [])
    line = (
        f"{body['space']} v{body['old']} -> v{body['version']}: {body['status']},"
        f" step {min(body['step'] + 1, len(steps))}/{len(steps)} ({weights}); {figures}"
    )
    click.echo(line)
    if body["status"] in _OVER and body.get("reason"):
        click.echo(f"  {body['reason']}")
