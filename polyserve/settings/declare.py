"""How a setting is declared and read: its name, parser, default, doc, and its value from the env.

The host's settings (polyserve/settings/variables.py) and the autoscaler's
(polyserve/autoscale/config.py) are both declared with these, and read with `read`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from polyserve.names import POOL_RULE, is_pool


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


def const(value: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda _: value


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


def token_sha256(token: str) -> str:
    """How the admin token and the owner tokens are kept: their SHA-256, in hex."""
    # Tokens are 256-bit random strings, so a plain SHA-256 is enough to keep them out
    # of files and memory; a slow password hash would only slow every deploy down.
    return hashlib.sha256(token.encode()).hexdigest()


# Never echoed in an error, never handed to a subprocess by scrubbed_environ(). The
# hash is not secret for a random token, but it is where a plaintext token pasted into
# the wrong variable would end up.
SECRETS = (
    "POLYSERVE_DEPLOY_TOKEN",
    "POLYSERVE_DEPLOY_TOKEN_SHA256",
    "POLYSERVE_DATABASE_URL",
    "POLYSERVE_DATABASE_URL_FILE",  # a path, where a validation would know to look
)


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
