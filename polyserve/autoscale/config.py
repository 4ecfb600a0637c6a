"""Every autoscaler setting, declared like the host's: env name, type, default, doc."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polyserve.settings.declare import Setting, const, non_negative_int, positive_float, read

POOLS = ("cpu", "gpu")
# Provider name -> module; each module declares SETTINGS and make(values) -> Provider,
# and imports its cloud SDK only inside make(), so these settings load without them.
PROVIDERS = {
    "local": "polyserve.autoscale.local",
    "hetzner": "polyserve.autoscale.hetzner",
    "runpod": "polyserve.autoscale.runpod",
}
# The hook that puts every provider's hosts behind a load balancer (its settings too).
HOOK = "polyserve.autoscale.haproxy"


def _provider(text: str) -> str:
    if text not in ("none", *PROVIDERS):
        raise ValueError(f"must be one of none, {', '.join(PROVIDERS)}")
    return text


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(f"must be a fraction in (0, 1], got {value}")
    return value


def _window(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(f"must be 0 or more seconds, got {value}")
    return value


CORE: tuple[Setting, ...] = (
    Setting(
        "cpu_provider",
        _provider,
        const("local"),
        "Provider of the CPU pool's hosts: local, hetzner, or none.",
    ),
    Setting(
        "cpu_min_workers", non_negative_int, const(1), "Fewest hosts in the CPU pool (MIN_WORKERS)."
    ),
    Setting(
        "cpu_max_workers", non_negative_int, const(4), "Most hosts in the CPU pool (MAX_WORKERS)."
    ),
    Setting(
        "gpu_provider",
        _provider,
        const("none"),
        "Provider of the GPU pool's hosts: runpod, local (a stand-in), or none.",
    ),
    Setting(
        "gpu_min_workers", non_negative_int, const(0), "Fewest hosts in the GPU pool (MIN_WORKERS)."
    ),
    Setting(
        "gpu_max_workers", non_negative_int, const(2), "Most hosts in the GPU pool (MAX_WORKERS)."
    ),
    Setting(
        "scale_interval_s",
        positive_float,
        const(15.0),
        "Seconds between scrapes of every host's usage, and between decisions.",
    ),
    Setting(
        "target_busy_ratio",
        _ratio,
        const(0.6),
        "Busy time per second of worker capacity the pools are sized for.",
    ),
    Setting(
        "scale_up_window_s",
        _window,
        const(30.0),
        "A scale-up waits until the load asked for it over this many seconds.",
    ),
    Setting(
        "scale_down_window_s",
        _window,
        const(600.0),
        "A scale-down waits until the load asked for it over this many seconds.",
    ),
    Setting(
        "drain_s",
        _window,
        const(10.0),
        "Seconds a host taken out of the fleet keeps serving before its graceful stop.",
    ),
    Setting(
        "stop_timeout_s",
        positive_float,
        const(60.0),
        "Seconds a host's graceful stop may take before it is deleted anyway.",
    ),
    Setting(
        "unhealthy_s",
        positive_float,
        const(120.0),
        "Seconds a host may go unanswered (after its boot grace) before it is replaced.",
    ),
    Setting(
        "boot_grace_s",
        positive_float,
        const(300.0),
        "Seconds a new host may take to start answering before it counts as unhealthy.",
    ),
    Setting(
        "autoscale_bind",
        str,
        const("127.0.0.1:8442"),
        "Address of the autoscaler's own /metrics (host:port).",
    ),
)


@dataclass(frozen=True)
class Pool:
    name: str
    provider: str  # "none": the pool is not scaled
    min_workers: int
    max_workers: int


@dataclass(frozen=True)
class Config:
    database_url: str
    deploy_token_sha256: str
    pools: tuple[Pool, ...]
    scale_interval_s: float
    target_busy_ratio: float
    scale_up_window_s: float
    scale_down_window_s: float
    drain_s: float
    stop_timeout_s: float
    unhealthy_s: float
    boot_grace_s: float
    autoscale_bind: str
    values: Mapping[str, Any]  # every setting read, the providers' included


def declared() -> tuple[Setting, ...]:
    """The core settings, then each provider's."""
    found = list(CORE)
    for module in (*PROVIDERS.values(), HOOK):
        found.extend(importlib.import_module(module).SETTINGS)
    return tuple(found)


def load(env: Mapping[str, str] | None = None) -> Config:
    """Read the autoscaler's settings; the fleet's database URL and the hosts' deploy
    token hash are the host's own settings (POLYSERVE_DATABASE_URL, …_TOKEN_SHA256)."""
    from polyserve import settings as host_settings

    env = os.environ if env is None else env
    host = host_settings.load(env)
    if not host.database_url:
        raise ValueError("POLYSERVE_DATABASE_URL is empty: the autoscaler scales a fleet")
    values = read(declared(), env)
    pools = tuple(
        Pool(p, values[f"{p}_provider"], values[f"{p}_min_workers"], values[f"{p}_max_workers"])
        for p in POOLS
    )
    for pool in pools:
        if pool.min_workers > pool.max_workers:
            raise ValueError(
                f"POLYSERVE_{pool.name.upper()}_MIN_WORKERS={pool.min_workers} is above"
                f" POLYSERVE_{pool.name.upper()}_MAX_WORKERS={pool.max_workers}"
            )
    return Config(
        database_url=host.database_url,
        deploy_token_sha256=host.deploy_token_sha256,
        pools=pools,
        values=values,
        **{k: values[k] for k in _SCALARS},
    )


_SCALARS = (
    "scale_interval_s",
    "target_busy_ratio",
    "scale_up_window_s",
    "scale_down_window_s",
    "drain_s",
    "stop_timeout_s",
    "unhealthy_s",
    "boot_grace_s",
    "autoscale_bind",
)


def make_provider(name: str, values: Mapping[str, Any]) -> Any:
    """The named provider, built from the settings read (behind HAProxy, with the hook's
    settings)."""
    provider = importlib.import_module(PROVIDERS[name]).make(values)
    return importlib.import_module(HOOK).wrap(provider, values)


if __name__ == "__main__":
    import sys

    from polyserve.settings.docs import markdown_table, write_readme

    if sys.argv[1:] == ["--docs"]:
        write_readme("docs/autoscale.md", declared())
    else:
        print(markdown_table(declared()))
