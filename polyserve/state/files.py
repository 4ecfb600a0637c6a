"""Files replaced whole: a reader sees the old bytes or the new, never a part of either.

Each write goes to a temporary file beside its target, then one os.replace() puts it in
place (a rename within one directory is atomic). The temporary name is hidden, names
its target, and is unique to the writing process and thread, so concurrent writers of
one file never write into each other's; it never ends in `.log` or `.json`, so nothing
that lists a directory for those takes it for a finished file.

A short text rewritten on every change (a space's last number, the fleet's last change
applied) is kept as a symlink's target instead (`write_short`): the kernel stores it in
the inode, so replacing it allocates no data block, and ext4 does not flush a block on
a rename over the old one as it does for a file (bench/NOTES.md, "A follower's CPU per
change"). readlink() reads it whole, as a rename replaces it whole.
"""

from __future__ import annotations

import contextlib
import errno
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


def write_short(path: Path, text: str) -> None:
    """Replace the short text kept at `path` (a symlink's target, see above)."""
    symlink_atomic(text, path)


def read_short(path: Path) -> str:
    """The short text kept at `path`, as write_short wrote it or, from a data directory
    an earlier polyserve wrote, as a file's bytes. FileNotFoundError when there is none."""
    try:
        return os.readlink(path)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: a file, not a symlink
            raise
    return path.read_text()
