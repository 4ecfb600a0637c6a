"""`polyserve autoscale`: the fleet's autoscaler, run until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import types

import click


@click.command()
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
