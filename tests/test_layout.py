"""The package's import graph: no cycle, and no worker wing imports the master's.

The graph is read from the source with `ast`: every absolute `polyserve.` import, at
module level or inside a function (a deferred import still ties the two modules), is an
edge from the importing module to the module imported (`from polyserve.a import b` names
the module `polyserve.a.b` when there is one, else `polyserve.a`). Imports under
`if TYPE_CHECKING:` are left out: they never run, so they order no imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "polyserve"
WORKER_WINGS = ("serve", "http", "control", "deploy", "state", "usage", "logs")
TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """`node` and every node below it, except the bodies of `if TYPE_CHECKING:`."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and ast.unparse(child.test) in TYPE_CHECKING:
            for other in child.orelse:
                yield from _runtime_nodes(other)
        else:
            yield from _runtime_nodes(child)


def imports(path: Path, known: set[str]) -> set[str]:
    """The polyserve modules the module at `path` imports when it runs, wherever in it."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name if name in known else node.module for name in names]
        else:
            continue
        found |= {name for name in names if name == "polyserve" or name.startswith("polyserve.")}
    return found & known


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `edges` as the list of modules around it, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for other in sorted(edges.get(name, ())):
            if (found := visit(other)) is not None:
                return found
        path.pop()
        done.add(name)
        return None

    for name in sorted(edges):
        if (found := visit(name)) is not None:
            return found
    return None


def test_the_graph_is_read_from_every_module():
    """The walk sees the package (a broken walk would pass the tests below vacuously)."""
    edges = graph()
    assert "polyserve.deploy.validate" in edges and "polyserve.master.hooks" in edges
    assert "polyserve.deploy.forkclient" in edges["polyserve.deploy.validate"]


def test_no_module_imports_itself_back_through_others():
    assert cycle(graph()) is None


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_imports_for_type_checking_only_are_not_edges(tmp_path):
    """An import under `if TYPE_CHECKING:` never runs; one in a function does."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from polyserve import app\n"
        "def later():\n"
        "    from polyserve.master import hooks\n"
    )
    (tmp_path / "m.py").write_text(source)
    known = {"polyserve.app", "polyserve.master.hooks"}
    assert imports(tmp_path / "m.py", known) == {"polyserve.master.hooks"}


def test_no_worker_wing_imports_the_master():
    """What the master sets before the fork is handed to the worker, never read back from
    the master's modules."""
    wings = tuple(f"polyserve.{wing}." for wing in WORKER_WINGS)
    found = {
        (name, other)
        for name, others in graph().items()
        if name.startswith(wings)
        for other in others
        if other == "polyserve.master" or other.startswith("polyserve.master.")
    }
    assert found == set()
