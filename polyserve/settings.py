"""Every POLYSERVE_* setting, declared once: env name, type, default and one-line doc."""

from __future__ import annotations

import hashlib
import os
import re
import socket
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyserve.names import DEFAULT_POOL, POOL_RULE, is_pool


@dataclass(frozen=True)
class Setting:
    name: str  # attribute name on Settings; the env var is POLYSERVE_<NAME>
    parse: Callable[[str], Any]
    # Called with the values read so far, so a default may follow an earlier setting.
    default: Callable[[dict[str, Any]], Any]
    doc: str
    default_doc: str = ""  # shown in docs/settings.md when the default is computed
    # Most settings take an empty value as unset; one that means "none" when empty
    # (POLYSERVE_PRELOAD) says so here.
    empty_is_value: bool = False

    @property
    def env(self) -> str:
        return "POLYSERVE_" + self.name.upper()


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be 0 or more, got {value}")
    return value


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


def positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")
    return value


def pool_name(text: str) -> str:
    if not is_pool(text):
        raise ValueError(f"must be a pool name: {POOL_RULE}")
    return text


def flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 1/true/yes/on or 0/false/no/off")


def _directories(text: str) -> tuple[str, ...]:
    return tuple(d for d in text.split(":") if d)


def _index_url(text: str) -> str:
    if not re.fullmatch(r"(https?|file)://\S+", text):
        raise ValueError("must be an http(s):// or file:// URL of a package index (PEP 503)")
    return text.rstrip("/")


def _module_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
            raise ValueError(f"{name!r} is not a module name")
    return names


def const(value: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda _: value


def token_sha256(token: str) -> str:
    """How the admin token and the owner tokens are kept: their SHA-256, in hex."""
    # Tokens are 256-bit random strings, so a plain SHA-256 is enough to keep them out
    # of files and memory; a slow password hash would only slow every deploy down.
    return hashlib.sha256(token.encode()).hexdigest()


def _sha256_hex(text: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise ValueError("must be a SHA-256 in hex (64 digits): `make token` prints one")
    return text.lower()


# Never echoed in an error, never handed to a subprocess by scrubbed_environ(). The
# hash is not secret for a random token, but it is where a plaintext token pasted into
# the wrong variable would end up.
SECRETS = (
    "POLYSERVE_DEPLOY_TOKEN",
    "POLYSERVE_DEPLOY_TOKEN_SHA256",
    "POLYSERVE_DATABASE_URL",
    "POLYSERVE_DATABASE_URL_FILE",  # a path, where a validation would know to look
)
# The fleet's URL once the master has taken it out of its environment (withhold): workers
# inherit it with the master's memory, and read it from here.
_withheld: dict[str, str] = {}


SETTINGS: tuple[Setting, ...] = (
    Setting("bind", str, const("127.0.0.1:8441"), "Address the host listens on (host:port)."),
    Setting(
        "workers",
        positive_int,
        lambda _: os.cpu_count() or 1,
        "Number of pre-forked worker processes.",
        "CPU count",
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
        "Space slots in the shared table; a deploy of a new space past it answers 507.",
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


@dataclass(frozen=True)
class Settings:
    bind: str
    workers: int
    data_dir: str
    idle_ttl: float
    worker_memory_mb: int
    request_timeout: float
    worker_timeout: int
    deploy_token_sha256: str  # from either token variable; the plaintext is never kept
    tokens_file: str
    import_timeout: float
    import_memory_mb: int
    validate_forkserver: bool
    validate_namespaces: bool
    max_spaces: int
    keep_versions: int
    checkpoint_interval: float
    max_upload_mb: int
    max_unpacked_mb: int
    max_infer_mb: int
    space_threads: int
    preload: tuple[str, ...]
    log_kb: int
    log_rate: int
    database_url: str
    host_id: str
    advertise_url: str
    pool: str
    pool_retry_after_s: int
    fleet_poll_s: float
    fleet_live_s: float
    fleet_timeout_s: float
    deploy_wait_s: float
    deps_index_url: str
    deps_find_links: tuple[str, ...]
    deps_offline: bool
    deps_timeout: float
    deps_max_mb: int


def load(env: Mapping[str, str] | None = None) -> Settings:
    """Read every setting from env (default: os.environ); a bad value names its variable.

    Reading os.environ also replaces a plaintext POLYSERVE_DEPLOY_TOKEN there by
    POLYSERVE_DEPLOY_TOKEN_SHA256, so later loads (the gunicorn config, on_starting, each
    worker's app) get the same digest and spaces and child processes never see the token.
    """
    env = os.environ if env is None else env
    values = read(SETTINGS, {**env, **_withheld} if env is os.environ else env)
    values["database_url"] = _database_url(values.pop("database_url_file"), values)
    admin = values.pop("deploy_token")  # already its digest
    if admin and values["deploy_token_sha256"]:
        raise ValueError(
            "POLYSERVE_DEPLOY_TOKEN and POLYSERVE_DEPLOY_TOKEN_SHA256 are both set: keep only"
            " POLYSERVE_DEPLOY_TOKEN_SHA256 (`make token` prints a token and its hash)"
        )
    values["deploy_token_sha256"] = admin or values["deploy_token_sha256"]
    if env is os.environ:
        forget_token(os.environ)
    return Settings(**values)


def _database_url(path: str, values: dict[str, Any]) -> str:
    """The fleet's URL: POLYSERVE_DATABASE_URL's, or the contents of the file it names."""
    if not path:
        return str(values["database_url"])
    if values["database_url"]:
        raise ValueError(
            "POLYSERVE_DATABASE_URL and POLYSERVE_DATABASE_URL_FILE are both set: keep one"
        )
    try:
        url = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"POLYSERVE_DATABASE_URL_FILE: cannot read it: {exc}") from None
    if not url:
        raise ValueError("POLYSERVE_DATABASE_URL_FILE: the file is empty")
    return url


def withhold(url: str, environ: MutableMapping[str, str] | None = None) -> None:
    """The master's, once at start: take the fleet's URL (and the file naming it) out of
    environ (default: os.environ), so no child process and no space's os.environ gets
    it; load() still returns it in this process and in the workers it forks. The kernel's
    copy of the environment the master was started with (/proc/<pid>/environ) is
    overwritten by the process title gunicorn sets."""
    environ = os.environ if environ is None else environ
    for name in ("POLYSERVE_DATABASE_URL", "POLYSERVE_DATABASE_URL_FILE"):
        environ.pop(name, None)
    if url and environ is os.environ:
        _withheld["POLYSERVE_DATABASE_URL"] = url


def read(declared: tuple[Setting, ...], env: Mapping[str, str]) -> dict[str, Any]:
    """Each declared setting's value from env, or its default; a bad value names its
    variable (and hides a secret's value)."""
    values: dict[str, Any] = {}
    for s in declared:
        raw = env.get(s.env)
        if raw is None or (raw == "" and not s.empty_is_value):
            values[s.name] = s.default(values)
            continue
        try:
            values[s.name] = s.parse(raw)
        except ValueError as exc:
            shown = "<not shown>" if s.env in SECRETS else repr(raw)
            raise ValueError(f"{s.env}={shown}: {exc}") from None
    return values


def forget_token(environ: MutableMapping[str, str]) -> None:
    """Replace a plaintext POLYSERVE_DEPLOY_TOKEN in environ by its SHA-256.

    On os.environ this unsets the C environment's variable too, so child processes and a
    space's os.environ no longer hold it. /proc/self/environ shows the environment block
    the process started with until gunicorn writes its process title over it
    (setproctitle). Only starting the host with POLYSERVE_DEPLOY_TOKEN_SHA256 keeps the
    token out of the host's processes altogether.
    """
    plain = environ.pop("POLYSERVE_DEPLOY_TOKEN", None)
    if plain:
        environ["POLYSERVE_DEPLOY_TOKEN_SHA256"] = token_sha256(plain)


def scrubbed_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """environ (default: os.environ) without the admin token variables (SECRETS): the
    environment to give a subprocess that runs tenant code."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k not in SECRETS}


def markdown_table(declared: tuple[Setting, ...] = SETTINGS) -> str:
    """docs/settings.md's settings table, generated from the declarations above."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    defaults: dict[str, Any] = {}
    for s in declared:
        defaults[s.name] = s.default(defaults)
        default = s.default_doc or str(defaults[s.name])
        shown = f"`{default}`" if default else "(empty)"
        rows.append(f"| `{s.env}` | {shown} | {s.doc} |")
    return "\n".join(rows)


def write_readme(path: str = "docs/settings.md", declared: tuple[Setting, ...] = SETTINGS) -> None:
    """Replace the table between a page's settings markers with a fresh one."""
    begin, end = "<!-- settings:begin -->\n", "<!-- settings:end -->"
    with open(path) as f:
        text = f.read()
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    with open(path, "w") as f:
        f.write(f"{head}{begin}{markdown_table(declared)}\n{end}{tail}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--readme"]:
        write_readme()
    else:
        print(markdown_table())
