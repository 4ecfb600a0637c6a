"""For spaces: `polyserve.secrets.get("KEY")`, the calling space's own secrets (docs/secrets.md).

A worker reads a space's secrets once per load, when it imports the space, and hands
them here under the name of the package that load imports into
(polyserve.serve.namespace.create); `get` finds the calling space from its caller's
module. A change (``polyserve secret set``) reloads the space: the new values are
those of its next import. The values are never in ``os.environ``.

This keeps a space's values from other spaces' calls of this API; it is no wall
between tenants of one process, which can read each other's memory (docs/secrets.md).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import overload

__all__ = ["NotInSpace", "get"]

# package name of a loaded version -> its secrets (read-only), while it is loaded
_loaded: dict[str, Mapping[str, str]] = {}
_NONE: Mapping[str, str] = MappingProxyType({})


class NotInSpace(RuntimeError):
    """`get` was called from code that is not a space's own module."""


@overload
def get(name: str) -> str | None: ...
@overload
def get(name: str, default: str) -> str: ...
def get(name: str, default: str | None = None) -> str | None:
    """The calling space's secret `name`, or `default` when it has none by that name.
    Call it from your space's own modules (at import or in a request); from any other
    code it raises NotInSpace."""
    values = _caller(sys._getframe(1).f_globals)
    return values.get(name, default)


def _caller(found: dict[str, object]) -> Mapping[str, str]:
    """The secrets of the space whose module's globals are `found`."""
    module = found.get("__name__")
    if isinstance(module, str):
        values = _loaded.get(module.partition(".")[0])
        # The globals must be that module's own: a dict that merely says the name is
        # not the space's code (a cheap check; see the module docstring for its limit).
        loaded = sys.modules.get(module)
        if values is not None and loaded is not None and vars(loaded) is found:
            return values
    raise NotInSpace(
        "polyserve.secrets.get() reads the calling space's secrets: call it from a module"
        " of your space (at import or in a request), not from other code"
    )


def give(package: str, values: Mapping[str, str]) -> None:
    """The host's side: the package `package` (a version being loaded) reads `values`."""
    _loaded[package] = MappingProxyType(dict(values)) if values else _NONE


def of(package: str) -> Mapping[str, str]:
    """The host's side: what the package reads (read-only; empty when nothing)."""
    return _loaded.get(package, _NONE)


def take(package: str) -> None:
    """The host's side: the package is forgotten (its version released)."""
    _loaded.pop(package, None)
