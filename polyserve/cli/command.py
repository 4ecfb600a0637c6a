"""What every command that talks to a host shares: exit codes, options, the client, errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any, NoReturn, TypeVar

import click

from polyserve.cli.client import DEFAULT_URL, BadAnswer, Client, HostRefused, HostUnavailable
from polyserve.cli.render import table

# Exit codes, for scripts: polyserve/cli/__init__.py says what each means.
EXIT_REFUSED = 1
EXIT_USAGE = 2  # click's own for a usage error
EXIT_UNAVAILABLE = 3
EXIT_LAGGING = 4
EXIT_BAD_ANSWER = 5
_CLIENT = "polyserve.cli.client"  # the command's Client, in click's context

_F = TypeVar("_F", bound=Callable[..., Any])


class HostCommand(click.Command):
    """A command that talks to a host: the host's refusals and failures become the exit
    codes above, with the host's own message on stderr."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except HostRefused as exc:
            lines = [f"error: {exc.error} (HTTP {exc.status})"]
            details = {k: v for k, v in exc.details.items() if v not in ("", None, [])}
            lines += [f"  {key}: {plain(value)}" for key, value in details.items()]
            fail(ctx, lines, EXIT_REFUSED)
        except HostUnavailable as exc:
            status = f" (HTTP {exc.status})" if exc.status else ""
            fail(ctx, [f"error: {exc.error}{status}"], EXIT_UNAVAILABLE)
        except BadAnswer as exc:
            fail(ctx, [f"error: {exc}"], EXIT_BAD_ANSWER)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            # A JSON object without the fields a command reads, or with others in their
            # place: the answer's shape is not polyserve's.
            client = ctx.meta.get(_CLIENT)
            if client is None or client.status is None:
                raise  # no answer read yet: not the host's doing
            shape = f"JSON of another shape ({type(exc).__name__}: {exc})"
            fail(ctx, [f"error: {BadAnswer(client.url, client.status, shape)}"], EXIT_BAD_ANSWER)


def fail(ctx: click.Context, lines: list[str], code: int) -> NoReturn:
    for line in lines:
        click.echo(line, err=True)
    ctx.exit(code)


class _Space(click.ParamType):
    name = "owner/name"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from polyserve.errors import ClientError
        from polyserve.names import parse_space

        try:
            return parse_space(str(value))
        except ClientError as exc:
            self.fail(exc.error, param, ctx)


SPACE = _Space()


def host_options(func: _F) -> _F:
    """--url, --token and --timeout, read from POLYSERVE_URL and POLYSERVE_TOKEN too."""
    options = [
        click.option(
            "--url",
            envvar="POLYSERVE_URL",
            default=DEFAULT_URL,
            show_default=True,
            show_envvar=True,
            help="The host's URL.",
        ),
        click.option(
            "--token",
            envvar="POLYSERVE_TOKEN",
            default="",
            show_envvar=True,
            help="Bearer token for writes (prefer the variable: argv is visible to `ps`).",
        ),
        click.option(
            "--timeout",
            type=click.FloatRange(min=0, min_open=True),
            default=120.0,
            show_default=True,
            help="Seconds to wait for the host's answer.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def json_option(func: _F) -> _F:
    return click.option("--json", "as_json", is_flag=True, help="Print the host's raw JSON.")(func)


def host_client(url: str, token: str, timeout: float) -> Client:
    try:
        client = Client(url, token, timeout)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--url") from None
    click.get_current_context().meta[_CLIENT] = client  # for HostCommand's errors
    return client


def print_table(
    headers: list[str],
    rows: list[list[str]],
    right: AbstractSet[int] = frozenset(),
    empty: str = "",
) -> None:
    if not rows and empty:
        click.echo(empty)
        return
    for line in table(headers, rows, right):
        click.echo(line)


def plain(value: object) -> str:
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return value if isinstance(value, str) else json.dumps(value)
