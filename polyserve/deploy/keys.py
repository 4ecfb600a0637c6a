"""The access writes: make a space private or public, mint a key, revoke one, list them.

Nothing here knows HTTP. A change is one edit of the space's access
(polyserve.state.access), applied by the state wing's one step (Changes.access: the
file under the store lock, the access word bumped, the workers signalled) or, in a
fleet, committed to the change log and applied by every host, whose answers are awaited
as a deploy's are: once a revoke answers 200, no worker of any live host takes the key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from polyserve.errors import ClientError
from polyserve.state import access as access_mod
from polyserve.state.access import Access
from polyserve.state.apply import Changes

if TYPE_CHECKING:  # the fleet's modules import psycopg: only a fleet host pays for that
    from polyserve.fleet.client import FleetClient

_T = TypeVar("_T")


class Keys:
    """One worker's access writes and reads, local or through the fleet."""

    def __init__(
        self,
        changes: Changes,
        host_limiter: anyio.CapacityLimiter | None,
        fleet: FleetClient | None = None,
    ) -> None:
        self.changes = changes
        self.store = changes.store
        self.host_limiter = host_limiter
        self.fleet = fleet

    async def read(self, space: str) -> dict[str, Any]:
        """The space's access, its keys without their digests; 404 when not deployed."""
        if self.fleet is not None:
            found = await self.fleet.run(self.fleet.db.access_of, space, True)
        else:
            found = await self._run(self._local_read, space)
        if found is None:
            raise _not_deployed(space)
        return found.view(space)

    async def mint(self, space: str, rate: float | None) -> tuple[int, dict[str, Any]]:
        minted: dict[str, Any] = {}

        def edit(before: Access) -> Access:
            after, answer = access_mod.mint(before, space, rate)
            minted.clear()
            minted.update(answer)
            return after

        status, hosts = await self._change(space, edit)
        return status, {**minted, **hosts}

    async def revoke(self, space: str, key_id: str) -> tuple[int, dict[str, Any]]:
        status, hosts = await self._change(
            space, lambda before: access_mod.revoke(before, space, key_id)
        )
        return status, {"space": space, "id": key_id, "revoked": True, **hosts}

    async def set_private(self, space: str, private: bool) -> tuple[int, dict[str, Any]]:
        changed: list[Access] = []

        def edit(before: Access) -> Access:
            after = access_mod.set_private(before, private)
            changed[:] = [after]
            return after

        status, hosts = await self._change(space, edit)
        return status, {**changed[0].view(space), **hosts}

    async def _change(
        self, space: str, edit: Callable[[Access], Access]
    ) -> tuple[int, dict[str, Any]]:
        if self.fleet is not None:
            change = await self.fleet.run(self.fleet.db.access, space, edit)
            if change is None:
                raise _not_deployed(space)
            status, hosts = await self.fleet.applied(change)
            return status, {"hosts": hosts}
        if await self._run(self.changes.access, space, edit) is None:
            raise _not_deployed(space)
        return 200, {"workers_signalled": self.changes.announce()}

    def _local_read(self, space: str) -> Access | None:
        if self.store.current(space) is None:
            return None
        return access_mod.read(self.store.root, space) or Access()

    async def _run(self, func: Callable[..., _T], *args: object) -> _T:
        return await anyio.to_thread.run_sync(func, *args, limiter=self.host_limiter)


def _not_deployed(space: str) -> ClientError:
    return ClientError(
        404, f"space {space} is not deployed: deploy it, then set its access", space=space
    )
