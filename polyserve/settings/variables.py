"""Every POLYSERVE_* variable of the host, declared once: env name, parser, default and doc."""

from __future__ import annotations

import os
import re
import socket
from typing import Any

from polyserve.names import DEFAULT_POOL
from polyserve.settings.declare import (
    Setting,
    const,
    flag,
    non_negative_int,
    pool_name,
    positive_float,
    positive_int,
    token_sha256,
)

# The default worker memory cap: this share of the machine's memory, split among the
# workers, leaves the rest to the master, the page cache and everything else on the host.
MEMORY_SHARE = 0.5


def memory_total_mb(meminfo: str = "/proc/meminfo") -> int:
    """The machine's memory (MemTotal) in MiB; 0 where /proc/meminfo is not there."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def cgroup_limit_mb(memory_max: str = "/sys/fs/cgroup/memory.max") -> int:
    """The cgroup v2 memory limit in MiB; 0 where none is set ("max") or readable."""
    try:
        with open(memory_max) as f:
            text = f.read().strip()
    except OSError:
        return 0
    return int(text) >> 20 if text.isdigit() else 0


def memory_limit_mb(
    meminfo: str = "/proc/meminfo", memory_max: str = "/sys/fs/cgroup/memory.max"
) -> int:
    """The memory this host may use, in MiB: MemTotal, or the cgroup's limit where that is
    smaller (in a container MemTotal is the whole machine's); 0 if neither is known."""
    known = [mb for mb in (memory_total_mb(meminfo), cgroup_limit_mb(memory_max)) if mb]
    return min(known, default=0)


def default_worker_memory_mb(values: dict[str, Any]) -> int:
    return int(memory_limit_mb() * MEMORY_SHARE) // values["workers"]


def _gpu_ids(text: str) -> tuple[int, ...]:
    ids: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"{part!r} is not a GPU index: list NVML's indices, as 0,1")
        if int(part) in ids:
            raise ValueError(f"GPU {part} is listed twice")
        ids.append(int(part))
    return tuple(ids)


def _detected_gpus(_: dict[str, Any]) -> tuple[int, ...]:
    from polyserve import devices  # NVML, only when the setting is not given

    return devices.detected()


def _default_workers(values: dict[str, Any]) -> int:
    return len(values["gpus"]) or os.cpu_count() or 1


def _directories(text: str) -> tuple[str, ...]:
    return tuple(d for d in text.split(":") if d)


def _index_url(text: str) -> str:
    if not re.fullmatch(r"(https?|file)://\S+", text):
        raise ValueError("must be an http(s):// or file:// URL of a package index (PEP 503)")
    return text.rstrip("/")


def _fleet_files(text: str) -> str:
    if text not in ("served", "all"):
        raise ValueError("must be `served` or `all`")
    return text


def _module_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
            raise ValueError(f"{name!r} is not a module name")
    return names


def _sha256_hex(text: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise ValueError("must be a SHA-256 in hex (64 digits): `make token` prints one")
    return text.lower()


SETTINGS: tuple[Setting, ...] = (
    Setting("bind", str, const("127.0.0.1:8441"), "Address the host listens on (host:port)."),
    Setting(
        "gpus",
        _gpu_ids,
        _detected_gpus,
        "GPUs this host runs models on, as NVML's indices (comma-separated; empty: none,"
        " a CPU host). Each worker is given one (CUDA_VISIBLE_DEVICES), spread evenly"
        " (docs/gpu.md).",
        "every GPU NVML sees with the gpu extra; none without it",
        empty_is_value=True,
    ),
    Setting(
        "workers",
        positive_int,
        _default_workers,
        "Number of pre-forked worker processes.",
        "one per GPU on a GPU host, else CPU count",
    ),
    Setting(
        "data_dir",
        str,
        const("./polyserve-data"),
        "Shared store directory: published versions, slot map, usage checkpoint.",
    ),
    Setting(
        "idle_ttl",
        positive_float,
        const(900.0),
        "Seconds a space may sit unused in a worker before it is released.",
    ),
    Setting(
        "worker_memory_mb",
        non_negative_int,
        default_worker_memory_mb,
        "Memory cap (MiB of anonymous RSS) of each worker: past it, a load first releases the"
        " least recently used idle spaces, then waits for the loads in flight and (up to"
        " 1 s) for other spaces' requests to end; a load that still does not fit is answered"
        " 503 with Retry-After (0: no cap). The default takes the smaller of MemTotal and"
        " the cgroup v2 limit (/sys/fs/cgroup/memory.max) when one is set.",
        "min(MemTotal, memory.max) / 2 / POLYSERVE_WORKERS",
    ),
    Setting(
        "worker_gpu_memory_mb",
        non_negative_int,
        const(0),
        "Device memory cap (MiB, NVML's figure for the worker's process) of each GPU"
        " worker: past it, a load first releases the least recently used idle spaces that"
        " hold device memory; one that still does not fit is answered 503 (0: no cap).",
    ),
    Setting(
        "gpu_space_memory_mb",
        non_negative_int,
        const(0),
        "onnxruntime's gpu_mem_limit (MiB) for a model space's session on a GPU worker,"
        " unless its polyserve.toml's [gpu] memory_mb says otherwise (0: no limit).",
    ),
    Setting(
        "request_timeout",
        positive_float,
        const(300.0),
        "Seconds a request may wait for its response to start, a cold load of its space"
        " included, before it is answered 504.",
    ),
    Setting(
        "worker_timeout",
        positive_int,  # gunicorn takes whole seconds
        const(30),
        "gunicorn's timeout: a worker whose event loop is blocked this long is replaced.",
    ),
    Setting(
        "deploy_token",
        token_sha256,  # only its digest is kept: see load()
        const(""),
        "Admin bearer token for deploys and deletes of any space (empty: none); kept only"
        " as its SHA-256. Prefer POLYSERVE_DEPLOY_TOKEN_SHA256.",
    ),
    Setting(
        "deploy_token_sha256",
        _sha256_hex,
        const(""),
        "The admin token's SHA-256 (64 hex digits) in place of the token, which the host"
        " then never sees: `make token` prints both. Not with POLYSERVE_DEPLOY_TOKEN.",
    ),
    Setting(
        "tokens_file",
        str,
        const(""),
        "File of `owner sha256(token)` lines: each token may deploy its owner's spaces."
        " A bad file stops the host at start.",
    ),
    Setting(
        "import_timeout",
        positive_float,
        const(30.0),
        "Seconds a deploy's validation import may take before it is killed.",
    ),
    Setting(
        "import_memory_mb",
        positive_int,
        const(4096),
        "Address-space limit (MiB) of the validation subprocess.",
    ),
    Setting(
        "validate_forkserver",
        flag,
        const(True),
        "Fork each deploy's validation from one warm process that has imported"
        " POLYSERVE_PRELOAD (0: start a new interpreter per deploy).",
        "1",
    ),
    Setting(
        "validate_namespaces",
        flag,
        const(True),
        "Run each validation in PID and mount namespaces of its own where the host may"
        " make them (in a user namespace where it is not privileged): it then sees and"
        " signals no other process (0: track and kill its processes only;"
        " docs/sandbox.md).",
        "1",
    ),
    Setting(
        "max_spaces",
        positive_int,
        const(4096),
        "Space slots in the shared table; a deploy of a new space past it answers 507. On a"
        " fleet host with POLYSERVE_FLEET_FILES=served: the spaces it serves at once (a"
        " space takes a slot on its first request there, the slot of one no worker holds"
        " when the table is full, else a 503).",
    ),
    Setting(
        "keep_versions",
        positive_int,
        const(10),
        "Published versions kept per space for rollbacks (the most recently current ones);"
        " a version a worker still uses stays until it is let go.",
    ),
    Setting(
        "checkpoint_interval",
        positive_float,
        const(5.0),
        "Seconds between the master's checkpoints of the usage totals to the data dir.",
    ),
    Setting(
        "max_upload_mb",
        positive_int,
        const(64),
        "Largest accepted deploy upload (MiB).",
    ),
    Setting(
        "max_unpacked_mb",
        positive_int,
        lambda v: 4 * v["max_upload_mb"],
        "Largest total size (MiB) a tar may unpack to; it caps each file too.",
        "4 * POLYSERVE_MAX_UPLOAD_MB",
    ),
    Setting(
        "max_infer_mb",
        positive_int,
        const(64),
        "Largest inference protocol request body (MiB, after decompression); a larger one"
        " is a 400.",
    ),
    Setting(
        "space_threads",
        positive_int,
        const(8),
        "Threads a space's sync handle() may use at once, per worker (its own limit).",
    ),
    Setting(
        "preload",
        _module_names,
        const(("numpy", "onnxruntime")),
        "Modules the master imports before it forks, shared by every worker copy-on-write"
        " (comma-separated; empty: none). Tenant code is never preloaded.",
        "numpy,onnxruntime",
        empty_is_value=True,
    ),
    Setting(
        "log_kb",
        positive_int,
        const(1024),
        "KiB of its newest log records each space keeps on disk, all workers together"
        " (docs/logs.md).",
    ),
    Setting(
        "log_rate",
        positive_int,
        const(100),
        "Log records a second each worker keeps from one space, after a burst of ten"
        " seconds' worth; the rest are dropped and counted.",
    ),
    Setting(
        "database_url",
        str,
        const(""),
        "PostgreSQL URL of the fleet this host joins (empty: a single host); libpq's"
        " PG* variables fill in what it leaves out. Never logged.",
    ),
    Setting(
        "database_url_file",
        str,
        const(""),
        "A file holding POLYSERVE_DATABASE_URL instead (not with it), read once at start:"
        " the URL is then in no process's environment.",
    ),
    Setting(
        "host_id",
        str,
        lambda v: f"{socket.gethostname()}:{v['bind'].rsplit(':', 1)[-1]}",
        "This host's id in the fleet, stable across restarts.",
        "hostname:port",
    ),
    Setting(
        "advertise_url",
        str,
        lambda v: f"http://{v['bind']}",
        "The URL other hosts and the autoscaler reach this host at.",
        "http://POLYSERVE_BIND",
    ),
    Setting(
        "pool",
        pool_name,
        const(DEFAULT_POOL),
        "The fleet pool this host serves in (cpu, gpu, …): in a fleet it imports only the"
        " spaces whose manifest names this pool.",
    ),
    Setting(
        "pool_retry_after_s",
        positive_int,  # Retry-After takes whole seconds
        const(30),
        "Retry-After (s) of the 503 for a space whose pool has no live host yet.",
    ),
    Setting(
        "fleet_poll_s",
        positive_float,
        const(1.0),
        "Seconds between the follower's polls of the fleet, the backstop for a lost NOTIFY.",
    ),
    Setting(
        "fleet_live_s",
        positive_float,
        const(10.0),
        "Seconds a host that stopped answering still counts as live in the fleet.",
    ),
    Setting(
        "fleet_files",
        _fleet_files,
        const("served"),
        "Which spaces' files a fleet host fetches as each deploy arrives: `served` (those"
        " it has files of, from serving them; another's on its first request here) or"
        " `all` (every space's, so it serves them all through a database outage).",
    ),
    Setting(
        "disk_budget_mb",
        non_negative_int,
        const(0),
        "MiB the version files of a fleet host may take (0: no limit): past it, the files"
        " of the versions no worker holds go, least recently loaded first, and are fetched"
        " again on their next load. Needs POLYSERVE_DATABASE_URL and"
        " POLYSERVE_FLEET_FILES=served.",
    ),
    Setting(
        "fleet_timeout_s",
        positive_float,
        const(10.0),
        "Seconds one call to the fleet's database may take (its statements, lock waits, a"
        " server that stopped answering) before it fails: a write then answers 503.",
    ),
    Setting(
        "deploy_wait_s",
        positive_float,
        const(10.0),
        "Seconds a fleet deploy waits for every live host to apply it (then: 202).",
    ),
    Setting(
        "deps_index_url",
        _index_url,
        const(""),
        "Package index (PEP 503 simple API) a space's dependencies are resolved from"
        " (empty: uv's default, PyPI).",
    ),
    Setting(
        "deps_find_links",
        _directories,
        const(()),
        "Directories of wheels (colon-separated) searched for a space's dependencies too.",
    ),
    Setting(
        "deps_offline",
        flag,
        const(False),
        "Install a space's dependencies from POLYSERVE_DEPS_FIND_LINKS only, never an index.",
        "0",
    ),
    Setting(
        "deps_timeout",
        positive_float,
        const(120.0),
        "Seconds a deploy may spend resolving, downloading and building a new dependency set.",
    ),
    Setting(
        "deps_max_mb",
        positive_int,
        const(1024),
        "Largest size (MiB) one installed dependency set may take on disk.",
    ),
)
