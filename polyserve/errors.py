"""The client-facing error: what any layer raises when a request cannot proceed."""

from __future__ import annotations

import errno

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
