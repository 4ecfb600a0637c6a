"""The settings tables of the docs, generated from the declarations: `make settings-table`."""

from __future__ import annotations

from typing import Any

from polyserve.settings.declare import Setting
from polyserve.settings.variables import SETTINGS


def markdown_table(declared: tuple[Setting, ...] = SETTINGS) -> str:
    """docs/settings.md's settings table, generated from the declarations."""
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
