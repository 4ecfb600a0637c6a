"""The client-facing error: what any layer raises when a request cannot proceed."""

from __future__ import annotations

import contextlib
import errno
import json
from collections.abc import Iterator

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class ClientError(Exception):
    """A request that cannot proceed: `status` is its HTTP answer, and the JSON body is
    `{"error": what to fix, **details}` (the control plane renders it)."""

    def __init__(self, status: int, error: str, **details: object) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.details = details

    def body(self) -> dict[str, object]:
        return {"error": self.error, **self.details}


def json_fields(body: bytes, fields: set[str], expected: str) -> dict[str, object] | None:
    """A small JSON body of the control plane: None when it is empty, else a JSON object
    with no field but `fields`; a ClientError 422 that ends with `expected` otherwise."""
    if not body.strip():
        return None
    try:
        asked = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested past the stack
        raise ClientError(422, f"the body is not JSON: {expected}") from None
    if not isinstance(asked, dict):
        raise ClientError(422, f"the body must be a JSON object: {expected}")
    unknown = sorted(set(asked) - fields)
    if unknown:
        raise ClientError(422, f"unknown field {unknown[0]!r}: {expected}", unknown=unknown)
    return asked


def disk_full() -> ClientError:
    """The answer to a deploy that found the data disk full: a 507, nothing published."""
    return ClientError(
        507,
        "the data disk is full: nothing was published; free space under POLYSERVE_DATA_DIR"
        " and deploy again",
    )


@contextlib.contextmanager
def disk_full_is_507() -> Iterator[None]:
    """Answer a full disk (ENOSPC, EDQUOT) met in the block with disk_full(); any other
    error passes through."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        raise disk_full() from None
