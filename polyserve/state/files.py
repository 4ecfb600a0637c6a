"""Files replaced whole: a reader sees the old bytes or the new, never a part of either.

Each write goes to a temporary file beside its target, then one os.replace() puts it in
place (a rename within one directory is atomic). The temporary name is hidden, names
its target, and is unique to the writing process and thread, so concurrent writers of
one file never write into each other's; it never ends in `.log` or `.json`, so nothing
that lists a directory for those takes it for a finished file.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def _beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def write_atomic(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """Replace the file `path` whole with `data`. With `fsync`, the bytes are on disk
    before the rename: a crash then leaves the old file or the new, never an empty one."""
    tmp = _beside(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def symlink_atomic(target: str, link: Path) -> None:
    """Point the symlink `link` at `target`, replacing whatever `link` was in one rename."""
    tmp = _beside(link)
    with contextlib.suppress(FileNotFoundError):  # left by a writer killed midway
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)
