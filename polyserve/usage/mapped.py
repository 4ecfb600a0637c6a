"""The memory a space's mapped files cost the host: each page counted once, however many map it.

A model loaded with `polyserve.models.onnx_session` keeps its weights as mapped pages of
its version's file, which the page cache shares between every worker: the host holds
one copy, while each worker's RSS counts it again. This reads every worker's
`/proc/<pid>/maps` and, per file under `spaces/<owner>/<name>/versions/`, takes the
union of the file ranges any worker maps: the bytes of the space's files the host keeps
mapped, each counted once. (`maps` rather than `smaps`: it lists mappings without walking
their pages, about ten times cheaper to read, and model weights, read by every inference,
are resident whenever they are mapped.)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

_DELETED = b" (deleted)"  # a pruned version still mapped by a draining request


def mapped_by_space(spaces_dir: Path, pids: Iterable[int]) -> dict[str, int]:
    """Bytes of each space's version files mapped by any of `pids`, each file range
    counted once. A process that is gone, or whose maps cannot be read, maps nothing."""
    prefix = str(Path(spaces_dir).resolve()).encode() + b"/"
    ranges: dict[bytes, list[tuple[int, int]]] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                maps = f.read()
        except OSError:  # a worker that exited since the table listed it
            continue
        if prefix not in maps:
            continue
        for line in maps.splitlines():
            at = line.find(prefix)
            if at < 0:
                continue
            # start-end perms offset dev inode path: the range in the file is offset on.
            span, _, offset = line.split(None, 3)[:3]
            start, end = (int(x, 16) for x in span.split(b"-"))
            first = int(offset, 16)
            path = line[at + len(prefix) :].removesuffix(_DELETED)
            ranges.setdefault(path, []).append((first, first + end - start))
    spaces: dict[str, int] = {}
    for path, spans in ranges.items():
        parts = path.split(b"/", 4)  # owner, name, "versions", number, the file
        if len(parts) < 5 or parts[2] != b"versions":
            continue
        space = (parts[0] + b"/" + parts[1]).decode()
        spaces[space] = spaces.get(space, 0) + _union(spans)
    return spaces


def _union(spans: list[tuple[int, int]]) -> int:
    """The length of the union of half-open ranges."""
    total, reach = 0, -1
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total
