"""The import machinery of spaces: a fresh package per version, with builtins of its own.

Each version becomes a package with a unique name (``_ps_<owner>__<name>__v<n>_<k>``)
whose ``__path__`` is the version directory, so ``from . import helpers`` works. Every
module of the version also gets its own ``__builtins__`` whose ``__import__`` maps a
top-level name that the version ships (``import helpers``) to the version's own module.
Because a function looks builtins up through its module's globals, that holds for
imports run lazily inside a handler at request time too, and costs other code nothing.

A version with dependencies (polyserve/deploy/deps.py) has its installed set as a second
directory of its package: the set's top-level names are mapped the same way, its modules
get the same builtins, so each version imports its own copy of each pure-Python
dependency, and `importlib.metadata` called from the version's code finds the set's
distributions. Compiled extension modules are loaded once per file (see
_SharedExtensionLoader).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import itertools
import os
import re
import sys
import threading
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from polyserve import secrets

_real_import = builtins.__import__
_counter = itertools.count(1)
_counter_lock = threading.Lock()
# Compiled once here, not at a worker's first load (bench/NOTES.md, figures moved out of
# code comments).
_NOT_WORD = re.compile(r"\W")
_MODULE_SUFFIXES = (".py", *importlib.machinery.EXTENSION_SUFFIXES)


def create(
    space: str, version: int, roots: list[Path], values: Mapping[str, str] | None = None
) -> str:
    """A fresh package over `roots` (the version's directory, then its dependency set's),
    registered so that its modules import with the version's builtins and read `values`
    through polyserve.secrets (the space's secrets, as this load read them); returns its
    name."""
    with _counter_lock:
        n = next(_counter)
    package = "_ps_" + _NOT_WORD.sub("_", space.replace("/", "__")) + f"__v{version}_{n}"
    names = frozenset().union(*(_top_names(r) for r in roots))
    secrets.give(package, values or {})
    _finder.packages[package] = (roots, _space_builtins(package, names))
    return package


def forget(package: str) -> None:
    """Drop every module of a version package so nothing here references it any more."""
    _finder.packages.pop(package, None)
    secrets.take(package)
    prefix = package + "."
    for name in [n for n in sys.modules if n == package or n.startswith(prefix)]:
        del sys.modules[name]


class _SpaceLoader(importlib.machinery.SourceFileLoader):
    """A source loader that hands each module the version's own builtins before exec."""

    def __init__(self, fullname: str, path: str, space_builtins: dict[str, Any]) -> None:
        super().__init__(fullname, path)
        self.space_builtins = space_builtins

    def exec_module(self, module: Any) -> None:
        module.__dict__["__builtins__"] = self.space_builtins
        super().exec_module(module)


# A C extension module cannot be initialised twice from one file: the dynamic linker
# hands back the same library (by inode), whose static state is already set up, and many
# modules (pybind11's, single-phase C ones) fail or misbehave on a second init. So every
# version that imports the same file, under whatever package name, gets the one module.
_extensions: dict[tuple[int, int], Any] = {}
_extensions_lock = threading.Lock()


class _SharedExtensionLoader(importlib.machinery.ExtensionFileLoader):
    """Loads an extension module file once per process (by device and inode)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        st = os.stat(self.path)
        self.key = (st.st_dev, st.st_ino)
        with _extensions_lock:
            self.shared = _extensions.get(self.key)
        if self.shared is not None:
            return self.shared
        return super().create_module(spec)

    def exec_module(self, module: Any) -> None:
        if self.shared is not None:
            return  # initialised already, under another version's name
        super().exec_module(module)
        with _extensions_lock:
            _extensions.setdefault(self.key, module)


class _SpaceFinder:
    """Finds the modules of registered version packages; registered once on sys.meta_path."""

    def __init__(self) -> None:
        # package -> (its directories: the version's, then its dependency set's; builtins)
        self.packages: dict[str, tuple[list[Path], dict[str, Any]]] = {}

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        top, dot, _ = fullname.partition(".")
        found = self.packages.get(top)
        if found is None:
            return None
        roots, space_builtins = found
        if not dot:  # the version package itself: a namespace over the version dir
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(root) for root in roots]
            return spec
        details: list[tuple[Any, list[str]]] = [
            (
                partial(_SpaceLoader, space_builtins=space_builtins),
                importlib.machinery.SOURCE_SUFFIXES,
            ),
            (_SharedExtensionLoader, importlib.machinery.EXTENSION_SUFFIXES),
        ]
        portions: list[str] = []
        for entry in path or ():
            module = importlib.machinery.FileFinder(entry, *details).find_spec(fullname, target)
            if module is not None and module.loader is not None:
                return module
            if module is not None:  # a directory without __init__.py: look further first
                portions += module.submodule_search_locations or ()
        if portions:  # as sys.path does: a namespace package only when nothing else matched
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = portions
            return spec
        return None

    def find_distributions(self, context: Any = None) -> Any:
        """importlib.metadata's hook: for code of a version with dependencies, the
        distributions of its set (before the host's, as they come first here)."""
        from importlib.metadata import DistributionFinder, MetadataPathFinder

        if context is not None and "path" in vars(context):
            return iter(())  # an explicit path was asked for: only that
        roots = self._caller_roots()
        if roots is None or len(roots) < 2:
            return iter(())
        name = getattr(context, "name", None)
        return MetadataPathFinder.find_distributions(
            DistributionFinder.Context(name=name, path=[str(roots[1])])
        )

    def _caller_roots(self) -> list[Path] | None:
        """The directories of the version whose code is asking, from the nearest frame
        of one of its modules; None for the host's own code."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_globals.get("__name__")
            if isinstance(name, str) and name.startswith("_ps_"):
                found = self.packages.get(name.partition(".")[0])
                if found is not None:
                    return found[0]
            frame = frame.f_back  # type: ignore[assignment]
        return None


_finder = _SpaceFinder()
sys.meta_path.insert(0, _finder)


def _space_builtins(package: str, top_names: frozenset[str]) -> dict[str, Any]:
    def space_import(
        name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
    ) -> Any:
        top = name.partition(".")[0]
        if level == 0 and top in top_names:
            module = _real_import(f"{package}.{name}", globals, locals, fromlist, 0)
            return module if fromlist else sys.modules[f"{package}.{top}"]
        return _real_import(name, globals, locals, fromlist, level)

    space = dict(builtins.__dict__)
    space["__import__"] = space_import
    return space


def _top_names(root: Path) -> frozenset[str]:
    """Module and package names at the top of a version (or of its dependency set): what
    `import x` may mean there."""
    names = set()
    with os.scandir(root) as entries:
        for entry in entries:
            name = entry.name
            if entry.is_dir():
                if name.isidentifier() and name != "__pycache__":
                    names.add(name)
            elif name.endswith(_MODULE_SUFFIXES):
                names.add(name.split(".", 1)[0])
    return frozenset(names)
