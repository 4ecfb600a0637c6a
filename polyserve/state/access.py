"""Who may call a space: its access file (private or not, its keys as sha256 digests) and the edits.

`<data>/access/<owner>/<name>.json` holds ``{"private": bool, "keys": [{"id", "sha256",
"rate", "created", "cell"}]}``; a space without a file is public. A key itself is shown
once, in the answer that minted it, and kept only as its digest. `cell` is the key's
place among the space's KEY_CELLS usage cells (polyserve.usage.meter), and `base` (a
host's own, never in the fleet's database) that cell's count when the key took it, so a
key that takes a revoked key's cell starts from zero.

The edits are pure: a change of access is one edit of the current value, written under
the store lock by polyserve.state.apply (locally) or in the fleet's transaction.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyserve.errors import ClientError, json_fields
from polyserve.state.files import write_atomic

MAX_KEYS = 8  # per space: each has one of the space's usage cells (meter.KEY_CELLS)
MAX_RATE = 1_000_000.0  # requests per second; past it a limit means nothing
KEY_PREFIX = "ps_"


def key_sha256(key: str | bytes) -> str:
    """What a key is kept and compared as."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


@dataclass
class Access:
    """A space's access: private or not, and its keys (digests, never the keys)."""

    private: bool = False
    keys: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self, local: bool = True) -> dict[str, Any]:
        """As the file holds it; `local=False` without the host's own bases (the fleet's)."""
        keys = self.keys if local else [_shared(k) for k in self.keys]
        return {"private": self.private, "keys": keys}

    @classmethod
    def from_json(cls, data: Any) -> Access:
        if not isinstance(data, dict):
            return cls()
        keys = data.get("keys")
        return cls(bool(data.get("private")), list(keys) if isinstance(keys, list) else [])

    def view(self, space: str) -> dict[str, Any]:
        """The answer of a read: never a digest, never a key."""
        keys = [
            {"id": k["id"], "rate": k.get("rate"), "created": k.get("created")} for k in self.keys
        ]
        return {"space": space, "private": self.private, "keys": keys}


def _shared(key: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in key.items() if k != "base"}


def path_of(root: Path, space: str) -> Path:
    owner, _, name = space.partition("/")
    return root / "access" / owner / f"{name}.json"


def read(root: Path, space: str) -> Access | None:
    """The space's access file, or None when it has none (public)."""
    try:
        return Access.from_json(json.loads(path_of(root, space).read_bytes()))
    except FileNotFoundError:
        return None
    except ValueError:  # a torn or hand-edited file: refused by the gate as private
        return Access(private=True)


def write(root: Path, space: str, access: Access) -> None:
    """Replace the space's access file atomically (hold the store lock)."""
    path = path_of(root, space)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(access.to_json()).encode(), fsync=True)


def drop(root: Path, space: str) -> None:
    """A deleted space's access goes with it (hold the store lock)."""
    with contextlib.suppress(FileNotFoundError):  # it was public
        os.unlink(path_of(root, space))


def listed(root: Path) -> dict[str, Access]:
    """Every space with an access file."""
    found: dict[str, Access] = {}
    base = root / "access"
    if not base.is_dir():
        return found
    for owner in os.listdir(base):
        for entry in os.listdir(base / owner):
            if entry.endswith(".json"):
                space = f"{owner}/{entry[: -len('.json')]}"
                access = read(root, space)
                if access is not None:
                    found[space] = access
    return found


# -- the edits ----------------------------------------------------------------------


def parse_rate(body: bytes) -> float | None:
    """A mint's body: nothing, or {"rate": requests per second}. ClientError 422 else."""
    expected = 'send no body (no limit) or {"rate": N}, N requests per second'
    asked = json_fields(body, {"rate"}, expected)
    rate = None if asked is None else asked.get("rate")
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate <= MAX_RATE:
        raise ClientError(
            422,
            f"`rate` must be a number of requests per second above 0 and at most"
            f" {MAX_RATE:g}, got {json.dumps(rate)[:40]}",
        )
    return float(rate)


def parse_private(body: bytes) -> bool:
    """An access body: {"private": true|false}. ClientError 422 else."""
    expected = 'send {"private": true} or {"private": false}'
    asked = json_fields(body, {"private"}, expected)
    if asked is None or not isinstance(asked.get("private"), bool):
        raise ClientError(422, f"`private` must be true or false: {expected}")
    return bool(asked["private"])


def mint(access: Access, space: str, rate: float | None) -> tuple[Access, dict[str, Any]]:
    """A new key for the space: (the access with its digest, the answer with the key,
    shown this once). ClientError 409 past MAX_KEYS."""
    if len(access.keys) >= MAX_KEYS:
        raise ClientError(
            409,
            f"space {space} has {MAX_KEYS} keys, the most it may: revoke one"
            f" (DELETE /_polyserve/spaces/{space}/keys/ID) first",
            space=space,
        )
    taken = {k.get("cell") for k in access.keys}
    cell = min(c for c in range(MAX_KEYS) if c not in taken)
    key = KEY_PREFIX + secrets.token_urlsafe(24)
    record = {
        "id": secrets.token_hex(4),
        "sha256": key_sha256(key),
        "rate": rate,
        "created": round(time.time(), 3),
        "cell": cell,
    }
    minted = Access(access.private, [*access.keys, record])
    answer = {"space": space, "id": record["id"], "key": key, "rate": rate}
    answer |= {"created": record["created"], "private": access.private}
    return minted, answer


def revoke(access: Access, space: str, key_id: str) -> Access:
    """The access without the key `key_id`; ClientError 404 when it has no such key."""
    kept = [k for k in access.keys if k.get("id") != key_id]
    if len(kept) == len(access.keys):
        ids = [k.get("id") for k in access.keys]
        raise ClientError(404, f"space {space} has no key {key_id[:40]!r}", space=space, keys=ids)
    return Access(access.private, kept)


def set_private(access: Access, private: bool) -> Access:
    return Access(private, list(access.keys))
