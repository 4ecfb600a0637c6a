"""What the cloud providers share: their API credential, safe error text, and waiting."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import unquote, urlsplit

from polyserve.autoscale.provider import ProviderError
from polyserve.settings.declare import SECRETS

# A variable whose name says it holds a secret: its value never reaches a message.
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|DATABASE_URL|DSN", re.IGNORECASE)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MESSAGE_MAX = 300  # characters of a cloud's own error message kept in ours


def port(text: str) -> int:
    """A TCP port number, parsed from a setting."""
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(f"must be a port number (1-65535), got {value}")
    return value


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list, parsed from a setting; blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def credential(variable: str, provider: str) -> str:
    """The provider's API credential, from its usual environment variable only."""
    value = os.environ.get(variable, "").strip()
    if not value:
        raise ProviderError(
            f"{variable} is not set: the {provider} provider reads its API credential"
            f" from the environment variable {variable} and nowhere else"
        )
    return value


def secret_values(environment: Mapping[str, str]) -> list[str]:
    """The values in a host's environment that must never appear in a message, each
    also as an API may quote it back: JSON-escaped, and a URL's password alone."""
    found = []
    for name, value in environment.items():
        if name in SECRETS or _SECRET_NAME.search(name):
            found += [value, json.dumps(value)[1:-1]]
            with contextlib.suppress(ValueError):
                found.append(unquote(urlsplit(value).password or ""))
    return [v for v in found if v]


def check_environment(environment: Mapping[str, str]) -> None:
    """Refuse names a shell or systemd would misread, and values no env file can hold."""
    for name, value in environment.items():
        if not _ENV_NAME.fullmatch(name):
            raise ProviderError(f"environment variable name {name!r} is not a valid name")
        if any(c in value for c in "\0\r\n"):
            # Named, never shown: the value may be a secret.
            raise ProviderError(f"the value of {name} holds a line break or NUL byte")


class Redactor:
    """Removes known secrets from text that may be logged, and caps its length."""

    def __init__(self, *secrets: str) -> None:
        self._secrets = [s for s in secrets if s]

    def __call__(self, text: object, extra: Iterable[str] = ()) -> str:
        out = str(text)
        # Longest first, so a secret that contains another is removed whole.
        for secret in sorted([*self._secrets, *extra], key=len, reverse=True):
            # Short values (a pool name, "1") would blank out ordinary words.
            if len(secret) >= 6:
                out = out.replace(secret, "<redacted>")
        if len(out) > MESSAGE_MAX:
            out = out[:MESSAGE_MAX] + "…"
        return out

    def __repr__(self) -> str:
        return f"Redactor({len(self._secrets)} secrets)"


def endpoint_host(url: str) -> str:
    """An API URL's host and port, without any user:password@ it may carry."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{host}:{parts.port}" if parts.port else host


def wait_until(
    done: Callable[[], bool],
    timeout_s: float,
    poll_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Call done() every poll_s seconds until it is true (True) or timeout_s passed (False)."""
    deadline = clock() + timeout_s
    while True:
        if done():
            return True
        left = deadline - clock()
        if left <= 0:
            return False
        sleep(min(poll_s, left))
