"""Human output for the `polyserve` command: aligned tables and units (`1.2 s`, `3.4 MiB`)."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from collections.abc import Set as AbstractSet


def table(
    headers: list[str], rows: Iterable[list[str]], right: AbstractSet[int] = frozenset()
) -> list[str]:
    """Aligned columns: numbers (the `right` columns) right-aligned, the rest left."""
    every = [headers, *rows]
    widths = [max(len(row[i]) for row in every) for i in range(len(headers))]
    lines = []
    for row in every:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def human_ms(ms: object) -> str:
    """A duration: `0 s`, `0.34 ms`, `6.7 ms`, `37 ms`, `1.2 s`, `3.4 min`, `2.5 h`."""
    if not isinstance(ms, (int, float)):
        return "-"
    if ms == 0:
        return "0 s"
    if ms < 10:
        return f"{ms:.2f} ms" if ms < 1 else f"{ms:.1f} ms"
    if ms < 1000:
        return f"{ms:.0f} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def human_bytes(size: object) -> str:
    """A size: `209 B`, `3.4 KiB`, `12 MiB`."""
    if not isinstance(size, (int, float)):
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_time(unix: object, millis: bool = False) -> str:
    """A unix time as local time: `2026-11-29 14:03:12` (`.123` with millis)."""
    if not isinstance(unix, (int, float)):
        return "-"
    when = datetime.datetime.fromtimestamp(unix)
    return when.isoformat(" ", "milliseconds" if millis else "seconds")


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
