"""A space's history of changes, and what it decides: the pruning order, a rollback's target.

The history is one JSON event a line in ``spaces/<owner>/<name>/history.jsonl``: each
move of ``current`` (a deploy, a rollback, a delete) and each release. The
last ``keep_versions`` versions it names as made current are the ones pruning keeps,
whatever their numbers. `version_summary` and `rollback_target` are the same on a host and in a
fleet, whose history is its change log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from polyserve.errors import ClientError
from polyserve.state.files import write_atomic

log = logging.getLogger("polyserve")
# Events kept in a space's history file: trimmed to HISTORY_KEEP once it holds twice as
# many, so a space deployed in a loop costs a bounded file, rewritten once in a while.
HISTORY_KEEP = 500
VERSION_FIELDS = ("sha256", "size", "entry", "kind", "import_ms", "deployed_at", "replaced")
Event = Literal["deploy", "rollback", "delete", "release"]


class History:
    """Each space's history file under `spaces_dir`."""

    def __init__(self, spaces_dir: Path) -> None:
        self.spaces_dir = spaces_dir

    def record(self, space: str, event: Event, version: int | None, previous: int | None) -> None:
        """Append an event to the space's history (`previous`: the version current
        before it). Hold the store lock: one writer at a time, so the trim loses nothing."""
        path = self.spaces_dir / space / "history.jsonl"
        line = {"event": event, "version": version, "previous": previous, "at": time.time()}
        try:
            with open(path, "ab") as f:
                f.write(json.dumps(line).encode() + b"\n")
                size = f.tell()
            # Lines are under 100 bytes: only a long history is read back to be trimmed.
            if size > HISTORY_KEEP * 200:
                lines = path.read_bytes().splitlines(keepends=True)
                if len(lines) > 2 * HISTORY_KEEP:
                    write_atomic(path, b"".join(lines[-HISTORY_KEEP:]))
        except OSError as exc:
            # After the change it records (`current` has moved): failing the change now
            # would misreport it. A full disk costs a line of history, not the change.
            log.warning("%s: could not record the %s in its history: %s", space, event, exc)

    def read(self, space: str, limit: int) -> list[dict[str, object]]:
        """The last `limit` events of the space's history, oldest first."""
        return list(self._newest(space, limit))[::-1]

    def _newest(self, space: str, limit: int) -> Iterator[dict[str, object]]:
        """The last `limit` events of the space's history, newest first, each decoded
        only when asked for."""
        try:
            lines = (self.spaces_dir / space / "history.jsonl").read_bytes().splitlines()
        except FileNotFoundError:
            return
        except OSError as exc:  # unreadable: pruning then ranks by number alone
            log.warning("%s: could not read its history: %s", space, exc)
            return
        for line in reversed(lines[-limit:]):
            with contextlib.suppress(ValueError):  # a line cut by a crash mid-append
                yield json.loads(line)

    def ranked(self, space: str, numbers: set[int], first: int) -> list[int]:
        """The first `first` of `numbers`, the most recently made current first; those
        the history no longer names (or never did: a data directory from before it)
        after them, newest number first. Events are decoded from the newest only until
        `first` are ranked: every move of `current` prunes, and a space deployed in a
        loop has hundreds of them."""
        ranked: list[int] = []
        for event in self._newest(space, HISTORY_KEEP):
            if len(ranked) >= min(first, len(numbers)):
                break
            number = event.get("version")
            activated = event.get("event") in ("deploy", "rollback")
            if activated and isinstance(number, int) and number in numbers - set(ranked):
                ranked.append(number)
        rest = sorted(numbers.difference(ranked), reverse=True)
        return (ranked + rest)[:first]


def version_summary(meta: dict[str, object], number: int, current: int | None) -> dict[str, object]:
    """One version as the versions answer lists it."""
    return {
        "version": number,
        **{key: meta.get(key) for key in VERSION_FIELDS},
        "current": number == current,
    }


def rollback_target(
    space: str, current: int, meta: dict[str, object], kept: list[int], asked: int | None
) -> int:
    """The version a rollback makes current: `asked`, or else the one the current
    version replaced when it was deployed — so rollbacks without a number walk back
    through the deploys (v3 -> v2 -> v1) instead of toggling between two versions. A
    version deployed before `replaced` was recorded falls back to the newest kept one
    below it. Raises ClientError 404, listing the kept versions, when there is none."""
    what = f"{space} v{asked}"
    if asked is None:
        if "replaced" in meta:
            replaced = meta["replaced"]
            asked = replaced if isinstance(replaced, int) else None
        else:
            asked = max((n for n in kept if n < current), default=None)
        if asked is None:
            raise ClientError(
                404,
                f"{space} v{current} replaced no earlier version: name a kept one,"
                ' {"version": N}',
                space=space,
                kept=kept,
            )
        what = f"{space} v{asked} (the version v{current} replaced)"
    if asked not in kept:
        raise ClientError(
            404,
            f"{what} is not kept (pruned, or never deployed): roll back to one of `kept`",
            space=space,
            version=asked,
            kept=kept,
        )
    return asked
