"""Pack a space's directory into a gzip tar for `polyserve deploy`, leaving out what is not code.

Left out: `__pycache__`, `.git`, `.hg` and `.svn` directories, virtualenvs (any directory
holding a `pyvenv.cfg`), `.polyserveignore` itself, and what `.polyserveignore` at the top
of the directory lists, in .gitignore syntax (pathspec's GitIgnoreSpec: `*.log`, `data/`,
`/top-only.txt`, `docs/**/*.md`, `!keep.log`). Symbolic links are refused unless ignored:
the host accepts only regular files and directories, and following a link could ship
files from outside the directory. The tar is reproducible — sorted names, no times or
owners — so the same files always give the same sha256.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

IGNORE_FILE = ".polyserveignore"
SKIP_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn"})


class PackError(Exception):
    """The directory cannot be packed as it is: the message says what to change."""


@dataclass(frozen=True)
class Packed:
    data: bytes  # the gzip tar
    files: list[str]  # what it holds, relative to the directory
    skipped: list[str]  # what was left out (a directory as `name/`, not its contents)


def pack(root: Path) -> Packed:
    root = root.resolve()
    spec = _ignore_spec(root)
    files: list[str] = []
    skipped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        keep_dirs = []
        for name in sorted(dirnames):
            rel = prefix + name
            if (
                name in SKIP_DIRS
                or (here / name / "pyvenv.cfg").exists()
                or spec.match_file(rel + "/")
            ):
                skipped.append(rel + "/")
            elif (here / name).is_symlink():
                raise PackError(_link_error(rel))
            else:
                keep_dirs.append(name)
        dirnames[:] = keep_dirs  # os.walk descends only into these
        for name in sorted(filenames):
            rel = prefix + name
            if rel == IGNORE_FILE or spec.match_file(rel):
                skipped.append(rel)
                continue
            mode = os.lstat(here / name).st_mode
            if stat.S_ISLNK(mode):
                raise PackError(_link_error(rel))
            if not stat.S_ISREG(mode):
                raise PackError(f"{rel} is not a regular file: list it in {IGNORE_FILE}")
            files.append(rel)
    if not files:
        raise PackError(f"nothing to deploy in {root}: every file is left out")
    return Packed(_tar(root, sorted(files)), sorted(files), sorted(skipped))


def _ignore_spec(root: Path) -> pathspec.GitIgnoreSpec:
    try:
        lines = (root / IGNORE_FILE).read_text().splitlines()
    except FileNotFoundError:
        lines = []
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _link_error(rel: str) -> str:
    return (
        f"{rel} is a symbolic link: the host accepts only regular files and directories;"
        f" copy what it points to, or list it in {IGNORE_FILE}"
    )


def _tar(root: Path, files: list[str]) -> bytes:
    buf = io.BytesIO()
    # mtime=0: the gzip header's time would make every pack of the same files differ.
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as zipped,
        tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for rel in files:
            path = root / rel
            info = tarfile.TarInfo(rel)
            info.size = path.stat().st_size
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()
