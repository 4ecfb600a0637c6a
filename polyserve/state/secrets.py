"""Each space's secrets on disk: one file per space, readable by the host's user alone.

Layout: ``secrets/<owner>/<name>.json`` under the data directory, mode 0600 in
directories of mode 0700, replaced whole (a reader sees the old file or the new one).
It maps each secret's name to ``{"value": str, "updated_at": epoch seconds}``. The
files are outside every version: no upload, history, deploy answer or usage holds a
value. Writes hold the store lock (polyserve.state.apply.Changes.secrets); a worker
reads a space's file once per load (polyserve.serve.loading).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

from polyserve.errors import ClientError
from polyserve.names import parse_space

NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")
MAX_VALUE = 64 << 10  # bytes of one value
MAX_SECRETS = 100  # secrets of one space


def entry(value: bytes, updated_at: float) -> dict[str, Any]:
    """One secret as a space's file holds it, from the fleet's row of it."""
    return {"value": bytes(value).decode(), "updated_at": updated_at}


def check_name(name: str) -> str:
    """The name, or ClientError 400 saying what a name may be."""
    if not NAME.fullmatch(name):
        raise ClientError(
            400,
            "a secret's name is 1 to 64 of A-Z, 0-9 and _, not starting with a digit"
            f" (like API_KEY); got {name[:80]!r}",
            name=name[:80],
        )
    return name


def too_large(size: int | None) -> ClientError:
    """The 413 for a value past MAX_VALUE (`size`: its length, when known)."""
    this = f"; this one is {size} bytes" if size is not None else ""
    return ClientError(413, f"a secret's value is at most {MAX_VALUE >> 10} KiB{this}")


def check_value(value: bytes) -> str:
    """The value as text, or ClientError 413 (too large) or 400 (not UTF-8)."""
    if len(value) > MAX_VALUE:
        raise too_large(len(value))
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise ClientError(
            400, "a secret's value must be UTF-8 text: encode binary values (base64)"
        ) from None


def unknown_secret(space: str, name: str) -> ClientError:
    return ClientError(
        404,
        f"space {space} has no secret {name}: `polyserve secret list {space}` shows its names",
        space=space,
        secret=name,
    )


class SecretFiles:
    """The secrets directory of one data directory."""

    def __init__(self, root: Path) -> None:
        self.root = root  # <data>/secrets

    def path(self, space: str) -> Path:
        return self.root / f"{parse_space(space)}.json"  # the rule keeps it under root

    def read(self, space: str) -> dict[str, dict[str, Any]]:
        """The space's secrets, by name: {"value", "updated_at"}; {} when it has none."""
        try:
            found = json.loads(self.path(space).read_bytes())
        except FileNotFoundError:
            return {}
        return found if isinstance(found, dict) else {}

    def values(self, space: str) -> dict[str, str]:
        """What the space's code reads: each name's value."""
        return {name: str(entry["value"]) for name, entry in self.read(space).items()}

    def names(self, space: str) -> list[dict[str, object]]:
        """Each secret's name and when it was last set, by name: never a value."""
        found = self.read(space)
        return [{"name": name, "updated_at": found[name]["updated_at"]} for name in sorted(found)]

    def write(self, space: str, secrets: dict[str, dict[str, Any]]) -> None:
        """Replace the space's file with `secrets` (none: the file goes). Hold the store
        lock."""
        path = self.path(space)
        if not secrets:
            path.unlink(missing_ok=True)
            return
        if len(secrets) > MAX_SECRETS:
            raise ClientError(
                409, f"a space has at most {MAX_SECRETS} secrets: unset one first", space=space
            )
        for directory in (self.root, path.parent):
            directory.mkdir(mode=0o700, exist_ok=True)
            os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
        _write_private(path, json.dumps(secrets, sort_keys=True).encode())

    def drop(self, space: str) -> None:
        """A deleted space's secrets go with it. Hold the store lock."""
        self.path(space).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: the owner's other spaces' files
            self.path(space).parent.rmdir()

    def clear(self) -> None:
        """Every space's secrets (a fleet host taking the fleet's, which are the truth)."""
        shutil.rmtree(self.root, ignore_errors=True)


def _write_private(path: Path, data: bytes) -> None:
    """Replace `path` whole with `data`, in a file no other user may read at any time."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):  # left by a writer killed midway
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
