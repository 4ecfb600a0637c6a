"""Each space's recent log records on disk: two bounded segments that every worker appends to.

Layout under ``POLYSERVE_DATA_DIR/logs/<owner>/<name>/``::

    current.log     the segment being written
    <base>.log      the one before it (older ones are removed)

A segment is JSON lines. Its first line is a header, ``{"base":N}``: N is the position
of the segment's first byte in the space's whole log, and a record's ``seq`` is that
position plus its offset in the segment. Positions only grow, across segments and
across workers, so a seq is the cursor a reader passes back as ``since``.

Every worker appends to the same file: open, ``flock``, check the size, one
``write``, close. The lock makes a rotation safe (a writer that waited for it finds
the file full, which only a rotated or rotating segment is, and moves on), and
opening per record means a worker holds no descriptor per space. Readers take no
lock: they read what the headers and sizes say is contiguous, and retry when a
rotation ran under them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from polyserve.state.files import write_atomic

OPEN_SEGMENT = "current.log"
RECORD_SLACK = 64 << 10  # read past the limit, to finish the last record (under 40 KiB)
_HEADER_MAX = 64


@dataclass
class _Segment:
    base: int
    fd: int
    size: int


class LogStore:
    """The logs directory of one host; `max_bytes` bounds each space's records on disk."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self._root = str(root)  # append() joins strings: pathlib costs more than its write
        # Two segments of half the bound each: one being written, one before it.
        self.segment_bytes = max(max_bytes // 2, 1)
        # What one read may return: the whole log (the bound, plus the records that
        # crossed it), so that reading from 0 gives everything kept in one answer.
        self.read_max = max_bytes + RECORD_SLACK

    def dir(self, space: str) -> Path:
        return self.root / space  # a parsed owner/name: two safe path parts

    def open(self, space: str) -> None:
        """Make the space's directory: called when a worker imports it. append() never
        does, so records a deleted space's draining requests write are dropped rather
        than bring its log back."""
        self.dir(space).mkdir(parents=True, exist_ok=True)

    def remove(self, space: str) -> None:
        shutil.rmtree(self.dir(space), ignore_errors=True)

    # -- writing ------------------------------------------------------------------

    def append(self, space: str, line: bytes) -> bool:
        """Append one record (a line ending in a newline). False when the space's log
        directory is gone: the space was deleted."""
        path = os.path.join(self._root, space, OPEN_SEGMENT)
        for _ in range(8):  # each pass follows one rotation; more means a bug, not a race
            try:
                fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)  # read: its header
            except FileNotFoundError:
                if not self._create(space, 0):
                    return False
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                size = os.fstat(fd).st_size
                if size >= self.segment_bytes:
                    # Full: rotated while this writer waited for the lock (move on to
                    # the new one), or left full by a writer that died before rotating.
                    if _same_file(fd, path):
                        self._rotate(space, fd, size)
                    continue
                # A full disk can take part of a record: cut it off, so that the next
                # record does not join a torn line.
                try:
                    written = os.write(fd, line)
                except OSError:
                    os.ftruncate(fd, size)
                    raise
                if written != len(line):
                    os.ftruncate(fd, size)
                    raise OSError(errno.ENOSPC, "short write: the disk is full")
                if size + len(line) >= self.segment_bytes:
                    self._rotate(space, fd, size + len(line))
                return True
            finally:
                os.close(fd)  # and with it the lock
        return False

    def _create(self, space: str, base: int) -> bool:
        """A first segment, whole or not at all; False when the directory is gone."""
        directory = self.dir(space)
        tmp = directory / f".new.{os.getpid()}.{threading.get_ident()}"
        try:
            tmp.write_bytes(b'{"base":%d}\n' % base)
        except FileNotFoundError:
            return False
        try:
            os.link(tmp, directory / OPEN_SEGMENT)
        except FileExistsError:
            pass  # another writer made it first: use theirs
        finally:
            tmp.unlink()
        return True

    def _rotate(self, space: str, fd: int, size: int) -> None:
        """Under the lock of the full current segment (fd): keep it as <base>.log, put a
        fresh segment in its place, and remove what is older. `current.log` always
        exists: link, then replace, never rename away."""
        directory = self.dir(space)
        base = _header(fd)
        with contextlib.suppress(FileExistsError):  # a writer died after this step
            os.link(directory / OPEN_SEGMENT, directory / f"{base}.log")
        write_atomic(directory / OPEN_SEGMENT, b'{"base":%d}\n' % (base + size))
        for name in os.listdir(directory):
            number = name.removesuffix(".log")
            if number.isdigit() and int(number) < base:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory / name)

    # -- reading ------------------------------------------------------------------

    def read(
        self, space: str, since: int, limit: int | None = None
    ) -> tuple[list[dict[str, Any]], int]:
        """Records at or after position `since`, oldest first, and the position after the
        last one (what to pass as `since` next). At most about `limit` bytes of records
        (default: the whole log); a client pages by passing the position back. A `since`
        before the oldest record kept starts at it; one past the end (a log that was
        removed and started again) answers nothing, and the end."""
        if limit is None:
            limit = self.read_max
        segments = self._segments(space)
        try:
            if not segments:
                return [], 0
            end = segments[-1].base + segments[-1].size
            if since > end:
                return [], end
            pos = max(since, segments[0].base)
            records: list[dict[str, Any]] = []
            for i, seg in enumerate(segments):
                if seg.base + seg.size <= pos:
                    continue
                pos = max(pos, seg.base)
                after, done = _read_segment(seg, pos, i == len(segments) - 1, limit, records)
                limit -= after - pos
                pos = after
                if done or limit <= 0:
                    break
            return records, pos
        finally:
            for seg in segments:
                os.close(seg.fd)

    def _segments(self, space: str) -> list[_Segment]:
        """The segments, open and in order. A rotation between listing and opening can
        leave a gap between them; only a gap before the oldest is real (removed), so
        try again on any other."""
        for _ in range(5):
            segments = self._open_segments(space)
            if all(a.base + a.size == b.base for a, b in itertools.pairwise(segments)):
                return segments
            for seg in segments:
                os.close(seg.fd)
        return self._open_segments(space)[-1:]  # still rotating: the newest alone is whole

    def _open_segments(self, space: str) -> list[_Segment]:
        directory = self.dir(space)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        found: dict[int, _Segment] = {}
        for name in names:
            if not name.endswith(".log"):
                continue
            try:
                fd = os.open(directory / name, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # removed by a rotation since the listing
                continue
            try:
                base, size = _header(fd), os.fstat(fd).st_size
            except ValueError:  # a damaged header: nothing in it can be placed
                os.close(fd)
                continue
            if base in found:  # current.log just linked as <base>.log: the same segment
                os.close(fd)
            else:
                found[base] = _Segment(base, fd, size)
        return [found[b] for b in sorted(found)]


def _read_segment(
    seg: _Segment, pos: int, last: bool, limit: int, records: list[dict[str, Any]]
) -> tuple[int, bool]:
    """Parse the whole lines of one segment from position `pos` into records, up to about
    `limit` bytes; returns the position after the last line read and whether to stop."""
    start = pos - seg.base
    want = seg.size - start
    data = os.pread(seg.fd, min(want, limit + RECORD_SLACK), start)
    cut = len(data) < want  # the read stopped short of the segment's end
    offset = 0
    # A cursor must sit at a line's start; one that does not skips to the next line.
    if start > 0 and os.pread(seg.fd, 1, start - 1) != b"\n":
        newline = data.find(b"\n")
        offset = len(data) if newline < 0 else newline + 1
    while (newline := data.find(b"\n", offset)) >= 0:
        record = _parse(data[offset:newline])
        if record is not None:
            records.append({"seq": seg.base + start + offset, **record})
        offset = newline + 1
        if offset >= limit:
            return seg.base + start + offset, True
    if offset < len(data) and (last or cut) and not (cut and offset == 0):
        # A record still being written, or cut by the read: it starts the next answer.
        return seg.base + start + offset, True
    # Past a torn line at the end of an older segment (a writer killed mid-write), or
    # past a line longer than any record.
    return seg.base + start + len(data), cut


def _parse(line: bytes) -> dict[str, Any] | None:
    """A record, or None for the header and for what is not one (a torn line)."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict) or "message" not in record:
        return None
    return record


def _header(fd: int) -> int:
    """A segment's base position, from its first line."""
    head = os.pread(fd, _HEADER_MAX, 0).split(b"\n", 1)[0]
    try:
        header = orjson.loads(head)
        return int(header["base"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ValueError("not a log segment") from None


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
