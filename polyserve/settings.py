"""Every POLYSERVE_* setting, declared once: env name, type, default and one-line doc."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    name: str  # attribute name on Settings; the env var is POLYSERVE_<NAME>
    parse: Callable[[str], Any]
    # Called with the values read so far, so a default may follow an earlier setting.
    default: Callable[[dict[str, Any]], Any]
    doc: str
    default_doc: str = ""  # shown in the README when the default is computed

    @property
    def env(self) -> str:
        return "POLYSERVE_" + self.name.upper()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")
    return value


def _const(value: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda _: value


SETTINGS: tuple[Setting, ...] = (
    Setting("bind", str, _const("127.0.0.1:8441"), "Address the host listens on (host:port)."),
    Setting(
        "workers",
        _positive_int,
        lambda _: os.cpu_count() or 1,
        "Number of pre-forked worker processes.",
        "CPU count",
    ),
    Setting(
        "data_dir",
        str,
        _const("./polyserve-data"),
        "Shared store directory: published versions, slot map, usage checkpoint.",
    ),
    Setting(
        "idle_ttl",
        _positive_float,
        _const(900.0),
        "Seconds a space may sit unused in a worker before it is released.",
    ),
    Setting(
        "request_timeout",
        _positive_float,
        _const(300.0),
        "Seconds a request may take in a space before it is answered 504.",
    ),
    Setting(
        "worker_timeout",
        _positive_int,  # gunicorn takes whole seconds
        _const(30),
        "gunicorn's timeout: a worker whose event loop is blocked this long is replaced.",
    ),
    Setting(
        "deploy_token",
        str,
        _const(""),
        "Admin bearer token for deploys and deletes of any space (empty: none).",
    ),
    Setting(
        "tokens_file",
        str,
        _const(""),
        "File of `owner sha256(token)` lines: each token may deploy its owner's spaces.",
    ),
    Setting(
        "import_timeout",
        _positive_float,
        _const(30.0),
        "Seconds a deploy's validation import may take before it is killed.",
    ),
    Setting(
        "import_memory_mb",
        _positive_int,
        _const(4096),
        "Address-space limit (MiB) of the validation subprocess.",
    ),
    Setting(
        "max_spaces",
        _positive_int,
        _const(4096),
        "Space slots in the shared table; a deploy of a new space past it answers 507.",
    ),
    Setting(
        "checkpoint_interval",
        _positive_float,
        _const(5.0),
        "Seconds between the master's checkpoints of the usage totals to the data dir.",
    ),
    Setting(
        "max_upload_mb",
        _positive_int,
        _const(64),
        "Largest accepted deploy upload (MiB).",
    ),
    Setting(
        "max_unpacked_mb",
        _positive_int,
        lambda v: 4 * v["max_upload_mb"],
        "Largest total size (MiB) a tar may unpack to; it caps each file too.",
        "4 * POLYSERVE_MAX_UPLOAD_MB",
    ),
)


@dataclass(frozen=True)
class Settings:
    bind: str
    workers: int
    data_dir: str
    idle_ttl: float
    request_timeout: float
    worker_timeout: int
    deploy_token: str
    tokens_file: str
    import_timeout: float
    import_memory_mb: int
    max_spaces: int
    checkpoint_interval: float
    max_upload_mb: int
    max_unpacked_mb: int


def load(env: Mapping[str, str] | None = None) -> Settings:
    """Read every setting from env (default: os.environ); a bad value names its variable."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for s in SETTINGS:
        raw = env.get(s.env)
        if raw is None or raw == "":
            values[s.name] = s.default(values)
            continue
        try:
            values[s.name] = s.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{s.env}={raw!r}: {exc}") from None
    return Settings(**values)


def markdown_table() -> str:
    """The README's settings table, generated from the declarations above."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    defaults = vars(load({}))
    for s in SETTINGS:
        default = s.default_doc or str(defaults[s.name])
        shown = f"`{default}`" if default else "(empty)"
        rows.append(f"| `{s.env}` | {shown} | {s.doc} |")
    return "\n".join(rows)


def write_readme(path: str = "README.md") -> None:
    """Replace the table between the README's settings markers with a fresh one."""
    begin, end = "<!-- settings:begin -->\n", "<!-- settings:end -->"
    with open(path) as f:
        text = f.read()
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    with open(path, "w") as f:
        f.write(f"{head}{begin}{markdown_table()}\n{end}{tail}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--readme"]:
        write_readme()
    else:
        print(markdown_table())
