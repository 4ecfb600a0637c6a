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
    default: Callable[[], Any]  # called lazily so a default can depend on the machine
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


SETTINGS: tuple[Setting, ...] = (
    Setting("bind", str, lambda: "127.0.0.1:8441", "Address the host listens on (host:port)."),
    Setting(
        "workers",
        _positive_int,
        lambda: os.cpu_count() or 1,
        "Number of pre-forked worker processes.",
        "CPU count",
    ),
    Setting(
        "data_dir",
        str,
        lambda: "./polyserve-data",
        "Shared store directory: published versions, slot map, control socket.",
    ),
    Setting(
        "idle_ttl",
        _positive_float,
        lambda: 900.0,
        "Seconds a space may sit unused in a worker before it is released.",
    ),
    Setting(
        "import_timeout",
        _positive_float,
        lambda: 30.0,
        "Seconds a deploy's validation import may take before it is killed.",
    ),
    Setting(
        "import_memory_mb",
        _positive_int,
        lambda: 4096,
        "Address-space limit (MiB) of the validation subprocess.",
    ),
    Setting(
        "max_spaces",
        _positive_int,
        lambda: 4096,
        "Space slots in the shared table; a deploy of a new space past it answers 507.",
    ),
    Setting(
        "checkpoint_interval",
        _positive_float,
        lambda: 5.0,
        "Seconds between the master's checkpoints of the usage totals to the data dir.",
    ),
    Setting(
        "max_upload_mb",
        _positive_int,
        lambda: 64,
        "Largest accepted deploy upload (MiB).",
    ),
)


@dataclass(frozen=True)
class Settings:
    bind: str
    workers: int
    data_dir: str
    idle_ttl: float
    import_timeout: float
    import_memory_mb: int
    max_spaces: int
    checkpoint_interval: float
    max_upload_mb: int


def load(env: Mapping[str, str] | None = None) -> Settings:
    """Read every setting from env (default: os.environ); a bad value names its variable."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for s in SETTINGS:
        raw = env.get(s.env)
        if raw is None or raw == "":
            values[s.name] = s.default()
            continue
        try:
            values[s.name] = s.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{s.env}={raw!r}: {exc}") from None
    return Settings(**values)


def markdown_table() -> str:
    """The README's settings table, generated from the declarations above."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for s in SETTINGS:
        default = s.default_doc or str(s.default())
        rows.append(f"| `{s.env}` | `{default}` | {s.doc} |")
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
