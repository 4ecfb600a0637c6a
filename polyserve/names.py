"""The naming rules: a space's `owner/name`, and a pool's name (`cpu`, `gpu`, …)."""

from __future__ import annotations

import re

from polyserve.errors import ClientError

PART = "[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}"  # not starting with '.': no hidden, no '..'
_PART = re.compile(PART)
POOL = "[a-z0-9][a-z0-9-]{0,31}"  # lowercase: a provider's label or a host name takes it as is
_POOL = re.compile(POOL)
POOL_RULE = "1-32 of lowercase letters, digits and '-', starting with a letter or digit"
DEFAULT_POOL = "cpu"  # a space that names no pool, and a host that is given none


def parse_space(text: str) -> str:
    """Check an `owner/name` space name and return it, or raise a 422 that says the rule."""
    parts = text.split("/")
    if len(parts) != 2 or not all(_PART.fullmatch(p) for p in parts):
        raise ClientError(
            422,
            "invalid space name: use owner/name, each part 1-64 of letters, digits, '.', '_',"
            " '-', not starting with '.'",
            space=text[:100],
        )
    return text


def is_owner(text: str) -> bool:
    """Whether text is a valid owner (the first part of a space name)."""
    return _PART.fullmatch(text) is not None


def is_pool(text: str) -> bool:
    """Whether text is a valid pool name (POOL_RULE)."""
    return _POOL.fullmatch(text) is not None
