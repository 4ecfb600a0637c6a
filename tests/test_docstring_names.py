"""Every dotted name a docstring under polyserve/ writes resolves to a real module or attribute.

Modules move and classes get renamed; a docstring that still says `store.Ledger` sends
its reader to something that is not there. This collects, from every module's, class's
and function's docstring, the names written in backticks (`Registry.lease`,
`_Leftover`), and, written plainly, `polyserve.x.y`, `module.Name` where `module` is one
of polyserve's own modules, `Class.attribute` and private names (`_add_late_counts`),
and resolves each: imported from polyserve (by its full path or by a module's last name,
`store` for polyserve.state.store), from the docstring's own module (what it defines or
imports), as a class of polyserve's (`Dispatch._call`), as a private name defined
anywhere in polyserve (an instance's `self._loading` too), or as a top-level module
(`os.environ`). A name that starts with none of those (`request.state`, `self.proc`) is
left alone: it names a local, or another library's class. No host starts and no tenant
code is imported.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
import re
from collections.abc import Iterator
from functools import cache
from types import ModuleType
from typing import Any

import pytest

import polyserve
from tests.helpers import REPO

# Names that look dotted or private but are not Python: files, formats, settings.
NOT_PYTHON = {
    "__pycache__",  # a directory
    "Content_Length",  # header names with an underscore, which the door refuses
    "Transfer_Encoding",
    "http.response.body",  # ASGI message types
    "http.response.start",
    "polyserve.service",  # the systemd unit a cloud host runs
}
FILE_SUFFIXES = (".py", ".toml", ".json", ".html", ".onnx", ".txt", ".md", ".log", ".ctl", ".lock")

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(polyserve.__path__, "polyserve.")
    if not m.name.endswith(".__main__")  # running it is what importing it does
)
BY_LAST_NAME: dict[str, list[str]] = {}
for _name in ["polyserve", *MODULES]:
    BY_LAST_NAME.setdefault(_name.rsplit(".", 1)[-1], []).append(_name)

BACKTICKED = re.compile(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`")
FULL = re.compile(r"(?<![\w.`/])polyserve(?:\.\w+)+")
DOTTED = re.compile(r"(?<![\w.`/])([a-z_]\w*)\.([A-Za-z_]\w*(?:\.\w+)*)")
CLASS_DOTTED = re.compile(r"(?<![\w.`/])[A-Z]\w*[a-z]\w*\.[A-Za-z_]\w*(?:\.\w+)*")  # Meter.end
# _Leftover, _load; not a pattern such as _proc_gnusparse_*
PRIVATE = re.compile(r"(?<![\w.`/])_[A-Za-z]\w*(?:\.\w+)*(?![\w*])")


def docstrings(path: str) -> Iterator[tuple[int, str]]:
    """(line, docstring) of a source file's module, classes and functions."""
    tree = ast.parse((REPO / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield getattr(node, "lineno", 1), text


def names(text: str) -> set[str]:
    """The names a docstring refers to, as written (without a trailing call)."""
    found = {m.group(1).rstrip(".") for m in BACKTICKED.finditer(text)}
    found |= {m.group(0).rstrip(".") for m in FULL.finditer(text)}
    found |= {m.group(0) for m in DOTTED.finditer(text) if m.group(1) in BY_LAST_NAME}
    found |= {m.group(0).rstrip(".") for m in PRIVATE.finditer(text)}
    found |= {m.group(0).rstrip(".") for m in CLASS_DOTTED.finditer(text)}
    return {
        n
        for n in found
        if n not in NOT_PYTHON
        and not n.endswith(FILE_SUFFIXES)
        and ("." in n or n.startswith("_") or n[:1].isupper())
        and not n.isupper()  # a constant's or a setting's name, e.g. POLYSERVE_IDLE_TTL
    }


def walk(obj: Any, module: str, parts: list[str]) -> bool:
    """Whether parts resolve from obj: attributes, or submodules of the module named."""
    for part in parts:
        if hasattr(obj, part):
            obj = getattr(obj, part)
            module = f"{module}.{part}" if isinstance(obj, ModuleType) else ""
            continue
        if not module:
            return False
        try:
            obj = importlib.import_module(f"{module}.{part}")
        except ModuleNotFoundError:
            return False
        module = obj.__name__
    return True


@cache
def top_level(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def resolves(name: str, home: ModuleType) -> bool | None:
    """True or False; None when the name starts with nothing this test knows (a local)."""
    head, *rest = name.split(".")
    known = False
    for module in BY_LAST_NAME.get(head, []):
        known = True
        if walk(importlib.import_module(module), module, rest):
            return True
    if hasattr(home, head) or hasattr(builtins, head):
        known = True
        obj = getattr(home, head) if hasattr(home, head) else getattr(builtins, head)
        if walk(obj, obj.__name__ if isinstance(obj, ModuleType) else "", rest):
            return True
    if not known and head[:1].isupper() and rest:
        # A class of polyserve's that this module does not import (Dispatch._call).
        for module in MODULES:
            obj = getattr(importlib.import_module(module), head, None)
            if isinstance(obj, type) and obj.__module__.startswith("polyserve."):
                known = True
                if walk(obj, "", rest):
                    return True
    if not known and "." not in name:
        # A private or capitalised name the module does not hold: it may be a class's
        # attribute (`_lock`), so look for it anywhere in polyserve before calling it gone.
        known = True
        if any(_defined_anywhere(head)):
            return True
    if not known and (module := top_level(head)) is not None:
        return walk(module, head, rest)
    return False if known else None


def _defined_anywhere(name: str) -> Iterator[bool]:
    """True for each module, class or instance (`self.name = ...` in a source) that has
    the name."""
    yield from (re.search(rf"\bself\.{name}\b\s*[:=]", src) is not None for src in SOURCE_TEXT)
    for module in MODULES:
        mod = importlib.import_module(module)
        if hasattr(mod, name):
            yield True
        for value in vars(mod).values():
            if isinstance(value, type) and value.__module__ == module and hasattr(value, name):
                yield True


def home_module(path: str) -> ModuleType:
    """The module whose names a file's docstrings may use: its own (a package's, for
    __main__.py and __init__.py)."""
    dotted = path.removesuffix(".py").replace("/", ".")
    return importlib.import_module(dotted.removesuffix(".__init__").removesuffix(".__main__"))


SOURCES = sorted(str(p.relative_to(REPO)) for p in (REPO / "polyserve").rglob("*.py"))
SOURCE_TEXT = [(REPO / p).read_text() for p in SOURCES]


def unresolved(path: str, home: ModuleType) -> list[str]:
    return [
        f"{path}:{line}: {name}"
        for line, text in docstrings(path)
        for name in sorted(names(text))
        if resolves(name, home) is False
    ]


@pytest.mark.parametrize("path", SOURCES)
def test_every_name_a_docstring_writes_exists(path):
    assert unresolved(path, home_module(path)) == []


def test_a_name_that_is_gone_is_caught():
    """The check itself: a docstring naming a class that no longer exists fails it."""
    home = importlib.import_module("polyserve.usage.meter")
    assert resolves("polyserve.store.Ledger", home) is False
    assert resolves("store.Ledger", home) is False
    assert resolves("_Leftover", home) is False
    assert resolves("__import__", home) is True  # a builtin
    assert resolves("polyserve.state.slots.Ledger", home) is True
    assert resolves("slots.Ledger", home) is True
    assert resolves("request.state", home) is None  # a local: not this test's to judge
    assert names("see `polyserve.store.Ledger`, store.Ledger and _Leftover.drained") == {
        "polyserve.store.Ledger",
        "store.Ledger",
        "_Leftover.drained",
    }
