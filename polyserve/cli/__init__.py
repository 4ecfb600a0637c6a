"""The `polyserve` command: deploy and inspect spaces on a host over HTTP, and autoscale a fleet.

Exit codes, for scripts: 0 done; 1 the host refused (a 4xx: its error is printed); 2 a
usage error (bad arguments, a directory that cannot be packed, a declined
confirmation); 3 the host is unreachable or failed (a 5xx); 4 a fleet committed the
change but some live hosts have not applied it yet, or could not be read (a 202: they
are named, or the answer says why they are unknown); 5 the answer is not a polyserve
host's (not JSON, another shape, empty, cut short: a proxy's page).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from polyserve.cli.client import (
    DEFAULT_URL,
    BadAnswer,
    Client,
    HostRefused,
    HostUnavailable,
    space_path,
)
from polyserve.cli.render import human_bytes, human_ms, human_time, plural, table

EXIT_REFUSED = 1
EXIT_USAGE = 2  # click's own for a usage error
EXIT_UNAVAILABLE = 3
EXIT_LAGGING = 4
EXIT_BAD_ANSWER = 5
_CLIENT = "polyserve.cli.client"  # the command's Client, in click's context
LOGS_POLL_S = 1.0  # `logs -f`: how often the host is asked for new records

_F = TypeVar("_F", bound=Callable[..., Any])


class _HostCommand(click.Command):
    """A command that talks to a host: the host's refusals and failures become the exit
    codes above, with the host's own message on stderr."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except HostRefused as exc:
            lines = [f"error: {exc.error} (HTTP {exc.status})"]
            details = {k: v for k, v in exc.details.items() if v not in ("", None, [])}
            lines += [f"  {key}: {_plain(value)}" for key, value in details.items()]
            _fail(ctx, lines, EXIT_REFUSED)
        except HostUnavailable as exc:
            status = f" (HTTP {exc.status})" if exc.status else ""
            _fail(ctx, [f"error: {exc.error}{status}"], EXIT_UNAVAILABLE)
        except BadAnswer as exc:
            _fail(ctx, [f"error: {exc}"], EXIT_BAD_ANSWER)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            # A JSON object without the fields a command reads, or with others in their
            # place: the answer's shape is not polyserve's.
            client = ctx.meta.get(_CLIENT)
            if client is None or client.status is None:
                raise  # no answer read yet: not the host's doing
            shape = f"JSON of another shape ({type(exc).__name__}: {exc})"
            _fail(ctx, [f"error: {BadAnswer(client.url, client.status, shape)}"], EXIT_BAD_ANSWER)


def _fail(ctx: click.Context, lines: list[str], code: int) -> NoReturn:
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


def _host_options(func: _F) -> _F:
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


def _json_option(func: _F) -> _F:
    return click.option("--json", "as_json", is_flag=True, help="Print the host's raw JSON.")(func)


def _client(url: str, token: str, timeout: float) -> Client:
    try:
        client = Client(url, token, timeout)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--url") from None
    click.get_current_context().meta[_CLIENT] = client  # for _HostCommand's errors
    return client


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """polyserve: deploy, inspect and scale Python spaces.

    Every command but autoscale talks to one host (--url, or POLYSERVE_URL). Exit codes:
    0 done, 1 the host refused, 2 usage error, 3 host unreachable or failed (5xx),
    4 a fleet has not applied the change on every host yet, 5 an answer that is not
    polyserve's (a proxy's page, another server).
    """


# -- deploying and changing spaces -----------------------------------------------------


@main.command(cls=_HostCommand, short_help="Deploy a .py file, a tar or a directory.")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--space", type=SPACE, required=True, help="The space to deploy to: owner/name.")
@click.option("--dry-run", is_flag=True, help="List what a directory would ship; send nothing.")
@_json_option
@_host_options
def deploy(
    path: Path, space: str, dry_run: bool, as_json: bool, url: str, token: str, timeout: float
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
        status, body = _client(url, token, timeout).deploy(space, filename, data)
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


@main.command(cls=_HostCommand, short_help="Make a kept version current again.")
@click.argument("space", type=SPACE)
@click.argument("version", type=click.IntRange(min=1), required=False)
@_json_option
@_host_options
def rollback(
    space: str, version: int | None, as_json: bool, url: str, token: str, timeout: float
) -> None:
    """Make a kept version of SPACE current again.

    Without VERSION: the version the current one replaced when it was deployed, so
    repeated rollbacks walk back through the deploys. `polyserve history` lists the
    kept versions.
    """
    payload: dict[str, object] | None = None if version is None else {"version": version}
    client = _client(url, token, timeout)
    status, body = client.post_json(space_path(space, "rollback"), payload)
    if as_json:
        click.echo(json.dumps(body))
    else:
        click.echo(
            f"rolled back {space} to v{body['version']} (was v{body['previous']}):"
            f" sha256 {str(body.get('sha256'))[:12]}{_hosts(body)}"
        )
    _lagging(status, body)


@main.command(cls=_HostCommand, short_help="Release a space in every worker now.")
@click.argument("space", type=SPACE)
@_host_options
def release(space: str, url: str, token: str, timeout: float) -> None:
    """Release SPACE in every worker now: the next request imports it afresh."""
    status, body = _client(url, token, timeout).post_json(space_path(space, "release"))
    if "workers_signalled" in body:
        others = plural(body["workers_signalled"], "other worker")
        click.echo(f"released {space} (signalled {others})")
    else:
        click.echo(f"released {space}{_hosts(body)}")
    _lagging(status, body)


@main.command(cls=_HostCommand, short_help="Undeploy a space (asks first).")
@click.argument("space", type=SPACE)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@_host_options
def delete(space: str, yes: bool, url: str, token: str, timeout: float) -> None:
    """Undeploy SPACE: its requests answer 404; its usage stays readable."""
    client = _client(url, token, timeout)
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


# -- reading ---------------------------------------------------------------------------


@main.command("list", cls=_HostCommand, short_help="Every deployed space and its version.")
@_json_option
@_host_options
def list_spaces(as_json: bool, url: str, token: str, timeout: float) -> None:
    """Every deployed space with its current version."""
    answer = _client(url, token, timeout).get("/_polyserve/spaces")
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
    _print_table(headers, rows, right={1, 4, 5}, empty="no spaces deployed")


@main.command(cls=_HostCommand, short_help="Usage per space, as a table.")
@click.option("--fleet", is_flag=True, help="The fleet's ledger, summed over every host.")
@_json_option
@_host_options
def usage(fleet: bool, as_json: bool, url: str, token: str, timeout: float) -> None:
    """Usage per space: requests, errors, busy and warm time, cold starts, memory."""
    client = _client(url, token, timeout)
    answer = client.get("/_polyserve/usage", **({"scope": "fleet"} if fleet else {}))
    if as_json:
        click.echo(json.dumps(answer))
        return
    spaces = sorted(answer["spaces"].items())
    if fleet:
        headers = ["SPACE", "REQUESTS", "ERRORS", "BUSY", "WARM", "COLD STARTS"]
        _print_table(headers, [_billing(name, u) for name, u in spaces], right={1, 2, 3, 4, 5})
        click.echo()
        headers[0] = "HOST"
        hosts = sorted(answer["hosts"].items())
        _print_table(headers, [_billing(name, u) for name, u in hosts], right={1, 2, 3, 4, 5})
        return
    rows = [
        [
            *_billing(name, u),
            str(u.get("workers_loaded", 0)),
            human_ms(u.get("last_import_ms")),
            human_bytes((u.get("memory_kib") or 0) * 1024),
            _evictions(u),
        ]
        for name, u in spaces
    ]
    headers = ["SPACE", "REQUESTS", "ERRORS", "BUSY", "WARM", "COLD STARTS", "WORKERS"]
    headers += ["LAST IMPORT", "MEMORY", "EVICTED (IDLE/MEM/DEMAND)"]
    _print_table(headers, rows, right=set(range(1, 10)), empty="no usage yet")
    host = answer["host"]
    click.echo(
        f"\nhost: {host['workers']} workers, up {human_ms(host['uptime_s'] * 1000)},"
        f" busy {human_ms(host['busy_ms'])}, {host['in_flight']} in flight"
    )


def _evictions(u: dict[str, Any]) -> str:
    return "/".join(f"{u.get('evicted_' + reason, 0):,}" for reason in ("idle", "memory", "demand"))


def _billing(name: str, u: dict[str, Any]) -> list[str]:
    return [
        name,
        f"{u.get('requests', 0):,}",
        f"{u.get('errors', 0):,}",
        human_ms(u.get("busy_ms")),
        human_ms((u.get("warm_s") or 0) * 1000),
        f"{u.get('cold_starts', 0):,}",
    ]


@main.command(cls=_HostCommand, short_help="A space's kept versions and what happened.")
@click.argument("space", type=SPACE)
@_json_option
@_host_options
def history(space: str, as_json: bool, url: str, token: str, timeout: float) -> None:
    """SPACE's kept versions (* marks the current one) and what happened to it."""
    answer = _client(url, token, timeout).get(space_path(space, "versions"))
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
    _print_table(headers, rows, right={2, 5}, empty="no version kept")
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
    _print_table(["TIME", "EVENT", "VERSION", "PREVIOUS"], events, right={2, 3})


def _v(number: object) -> str:
    return "-" if number is None else f"v{number}"


@main.command(cls=_HostCommand, short_help="What a space logged recently (-f follows).")
@click.argument("space", type=SPACE)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new records until Ctrl-C.")
@click.option(
    "--since", type=click.IntRange(min=0), default=0, help="Only records after this cursor."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON record a line.")
@_host_options
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
    client = _client(url, token, timeout)
    try:
        while True:
            answer = client.get(space_path(space, "logs"), since=since)
            for record in answer.get("records", []):
                click.echo(json.dumps(record) if as_json else _log_line(record))
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


def _print_table(
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


def _plain(value: object) -> str:
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return value if isinstance(value, str) else json.dumps(value)


def _log_line(record: dict[str, Any]) -> str:
    when = human_time(record.get("time"), millis=True)
    return (
        f"{when} {record.get('level', '')!s:<7} v{record.get('version')}"
        f" pid {record.get('worker')} {record.get('stream')}: {record.get('message')}"
    )


# -- the fleet's autoscaler ---------------------------------------------------------------


@main.command()
@click.option("--dry-run", is_flag=True, help="Decide and log every interval; change nothing.")
@click.option("--once", is_flag=True, help="One interval, then exit.")
def autoscale(dry_run: bool, once: bool) -> None:
    """Scale the fleet's pools between their MIN_WORKERS and MAX_WORKERS by busy ratio.

    Settings come from POLYSERVE_* variables (docs/autoscale.md); it stops cleanly on
    SIGTERM and SIGINT, letting retirements in progress finish.
    """
    from polyserve.autoscale import config as config_mod
    from polyserve.autoscale.provider import ProviderError
    from polyserve.autoscale.scaler import Scaler
    from polyserve.fleet.db import FleetDB

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_mod.load()
        providers = {
            p.name: config_mod.make_provider(p.provider, config.values)
            for p in config.pools
            if p.provider != "none"
        }
    except (ValueError, ProviderError) as exc:  # a bad setting, a missing credential
        raise click.UsageError(str(exc)) from None
    stop = threading.Event()

    def on_signal(signum: int, frame: types.FrameType | None) -> None:
        stop.set()  # only note it: the loop ends at its next wait

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    scaler = Scaler(config, FleetDB(config.database_url), providers, dry_run=dry_run)
    server = scaler.metrics.serve(config.autoscale_bind)
    log = logging.getLogger("polyserve.autoscale")
    log.info(
        "autoscaling pools %s every %.1f s%s; metrics on http://%s/metrics",
        ", ".join(f"{p.name}:{p.provider}[{p.min_workers}..{p.max_workers}]" for p in config.pools),
        config.scale_interval_s,
        " (dry run)" if dry_run else "",
        config.autoscale_bind,
    )
    try:
        while not stop.is_set():
            try:
                scaler.step()
            except Exception:
                log.exception("interval failed; retrying at the next one")
            if once:
                break
            stop.wait(config.scale_interval_s)
    finally:
        log.info("stopping: waiting for retirements in progress")
        scaler.close(config.drain_s + config.stop_timeout_s + 10)
        server.shutdown()
    sys.exit(0)
