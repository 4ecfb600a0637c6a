"""The writes: deploy, undeploy, release, rollback — stage, validate, publish, bump, announce.

Nothing here knows HTTP: the control plane's handlers and tests call these (and read a
space's versions and history here). Each change happens under the store lock, bumps the
space's generation word and then signals the other workers (polyserve.state.apply, the
one step a fleet's follower takes too), so "after the answer, no worker starts a new
request on an older version" holds whoever made the change.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, BinaryIO, TypeVar

import anyio
import anyio.to_thread

from polyserve.deploy import deps, requirements
from polyserve.deploy.keys import Keys
from polyserve.deploy.validate import validate
from polyserve.errors import ClientError, json_fields
from polyserve.names import parse_space
from polyserve.settings import Settings, scrubbed_environ
from polyserve.state.apply import Changes
from polyserve.state.broadcast import Broadcast
from polyserve.state.history import version_summary
from polyserve.state.secrets import unknown_secret
from polyserve.state.shm import Table
from polyserve.state.store import Staged, Store

if TYPE_CHECKING:  # the fleet's modules import psycopg: only a fleet host pays for that
    from polyserve.fleet.changes import Change
    from polyserve.fleet.client import FleetClient

_T = TypeVar("_T")
HISTORY_LIMIT = 100  # events in a versions answer: the most recent ones


class Deploys:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        broadcast: Broadcast,
        table: Table,
        host_limiter: anyio.CapacityLimiter | None,
        refresh: Callable[[], None],
        fleet: FleetClient | None = None,
        floor: Callable[[], int | None] = lambda: None,
        forkserver: str | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        # Every local change is the state wing's one step, which reads the table through
        # the broadcast: `table` is no longer read here.
        self.changes = Changes(store, broadcast, refresh, fleet=fleet is not None)
        self.host_limiter = host_limiter  # the host's own threads: no tenant can exhaust them
        self.fleet = fleet  # with POLYSERVE_DATABASE_URL: the fleet's database decides
        self.floor = floor  # a worker's memory holding no space, once its registry knows
        self.forkserver = forkserver  # the master's fork server's socket name, if it runs one
        self.keys = Keys(self.changes, host_limiter, fleet)  # who may call a space

    async def deploy(
        self, space: str, upload: BinaryIO, filename: str, current: bool = True
    ) -> tuple[int, dict[str, object]]:
        """Publish an upload (a .py file or a tar) as the space's next version; returns
        the answer's status and body. A failure at any step publishes nothing. With
        current=False the version is stored and validated but `current` stays where it
        is (a rollout's new version, docs/rollouts.md)."""
        s = self.settings
        staged = await self._run(self.store.stage, upload, filename, s.max_unpacked_mb << 20)
        try:
            installed = await self._dependencies(staged)
            checked = await validate(
                staged.dir,
                staged.entry,
                s.import_timeout,
                s.import_memory_mb,
                env=scrubbed_environ(),
                # Its own secrets (not in its environment), as a worker's load reads them.
                secrets=await self._secret_values(space),
                deps=installed.site if installed is not None else None,
                forkserver=self.forkserver,
                namespaces=s.validate_namespaces,
            )
            self._fits(staged.entry, int(checked.pop("memory_bytes", 0)))  # type: ignore[call-overload]
            if installed is not None:
                checked["dependencies"] = installed.answer()
            if self.fleet is None:
                publish = partial(self.changes.publish, current=current)
                number = await self._run(publish, space, staged, checked)
            else:  # validated here; every host (this one too) applies it from the fleet
                meta = {**checked, "space": space, "sha256": staged.sha256, "size": staged.size}
                meta |= {"entry": staged.entry, "pool": staged.pool, "upload": filename}
                meta["deployed_at"] = time.time()
                commit = partial(self.fleet.deploy, current=current)
                change = await self.fleet.run(
                    commit, space, upload, staged.sha256, meta, staged.unpacked
                )
                number = change.version or 0
        finally:
            self.store.discard(staged)  # after a publish the directory has moved: a no-op
        body = {**staged.fields(space, number), **checked}
        if not current:
            body["current"] = False
        if self.fleet is None:
            self.changes.announce()
            return 200, body
        status, body["hosts"] = await self.fleet.applied(change)
        return status, body

    async def _secret_values(self, space: str) -> dict[str, str]:
        """The space's secrets for its validation: in a fleet, the database's (this host
        keeps a file only for its own pool's spaces)."""
        if self.fleet is None:
            return await self._run(self.store.secrets.values, space)
        found = await self.fleet.run(self.fleet.db.secrets, space)
        return {name: str(entry["value"]) for name, entry in found.get(space, {}).items()}

    def _fits(self, entry: str, need: int) -> None:
        """Refuse a version whose load alone would take a worker past its memory cap: it
        would deploy, then answer 503 to every request. A worker holding no space holds
        `floor` already (the least its registry measured, when it has)."""
        cap = self.settings.worker_memory_mb << 20
        if not cap:
            return
        floor = self.floor() or 0
        if floor + need <= cap:
            return
        held = f", beside the {floor >> 20} MiB a worker holds with no space," if floor else ""
        raise ClientError(
            422,
            f"loading {entry} takes {-(-need >> 20)} MiB of memory{held} and a worker may hold"
            f" {cap >> 20} MiB (POLYSERVE_WORKER_MEMORY_MB): no worker could load it; make"
            " its import smaller or raise the cap",
            memory_mib=-(-need >> 20),
            cap_mib=cap >> 20,
        )

    async def _dependencies(self, staged: Staged) -> deps.Installed | None:
        """The staged version's dependency set, installed (or found installed), or None
        when it declares none. Refusals are ClientErrors; nothing is published yet. In a
        fleet this host resolves it once: the metadata's `dependencies` carries the pins,
        which every other host installs before it applies the version (fleet/catchup.py)."""
        requested = await self._run(requirements.read, staged.dir, self.settings)
        if requested is None:
            return None
        return await deps.install(requested, self.store.root, self.settings)

    async def undeploy(self, space: str) -> tuple[int, dict[str, object]]:
        """Unpublish: requests then answer 404; the files go once nobody uses them."""
        if self.fleet is not None:
            return await self._fleet_change(space, self.fleet.db.delete)
        await self._change(space, self.changes.delete)
        return 200, {}

    async def release(self, space: str) -> tuple[int, dict[str, object]]:
        """What the idle reaper does, now and in every worker (every host's, in a fleet):
        the next request imports the space afresh."""
        if self.fleet is not None:
            return await self._fleet_change(space, self.fleet.db.release)
        return 200, {"workers_signalled": await self._change(space, self.changes.release)}

    async def secret_names(self, space: str) -> dict[str, object]:
        """A deployed space's secrets: each name and when it was set, never a value."""
        if self.fleet is not None:
            names = await self.fleet.run(self.fleet.db.secret_names, space)
        else:
            names = await self._run(self._local_secret_names, space)
        if names is None:
            raise ClientError(404, f"space {space} is not deployed", space=space)
        return {"space": space, "secrets": names}

    def _local_secret_names(self, space: str) -> list[dict[str, object]] | None:
        if self.store.current(space) is None:
            return None
        return self.store.secrets.names(space)

    async def set_secret(self, space: str, name: str, value: str) -> tuple[int, dict[str, object]]:
        """Store a secret of a deployed space and reload the space: once this answers
        200, every worker (every host, in a fleet) serves it with the new value."""
        body: dict[str, object] = {"space": space, "secret": name, "set": True}
        if self.fleet is not None:
            commit = partial(self.fleet.db.set_secret, name=name, value=value)
            status, hosts = await self._fleet_change(space, commit)
            return status, {**body, **hosts}

        def write() -> None:
            found = self.store.secrets.read(space)
            found[name] = {"value": value, "updated_at": time.time()}
            self.store.secrets.write(space, found)

        signalled = await self._change(space, partial(self.changes.secrets, write=write))
        return 200, {**body, "workers_signalled": signalled}

    async def unset_secret(self, space: str, name: str) -> tuple[int, dict[str, object]]:
        """Remove a secret (ClientError 404 when the space has none by that name) and
        reload the space, as set_secret does."""
        body: dict[str, object] = {"space": space, "secret": name, "unset": True}
        if self.fleet is not None:
            commit = partial(self.fleet.db.unset_secret, name=name)
            status, hosts = await self._fleet_change(space, commit)
            return status, {**body, **hosts}

        def write() -> None:
            found = self.store.secrets.read(space)
            if found.pop(name, None) is None:
                raise unknown_secret(space, name)
            self.store.secrets.write(space, found)

        signalled = await self._change(space, partial(self.changes.secrets, write=write))
        return 200, {**body, "workers_signalled": signalled}

    async def rollback(self, space: str, asked: int | None) -> tuple[int, dict[str, object]]:
        """Make a kept version current again (`asked`, or the one the current version
        replaced), with a deploy's contract: once this answers 200, no worker (no host,
        in a fleet) starts a new request on another version."""
        if self.fleet is not None:
            change, previous, meta = await self.fleet.run(self.fleet.db.rollback, space, asked)
            status, hosts = await self.fleet.applied(change)
            return status, {**_rolled_back(space, meta, change.version, previous), "hosts": hosts}
        number, previous, meta = await self._run(self.changes.rollback, space, asked)
        self.changes.announce()
        return 200, _rolled_back(space, meta, number, previous)

    async def versions(self, space: str) -> dict[str, object]:
        """The space's kept versions (in a fleet: every version the fleet store keeps)
        and its recent history; ClientError 404 for a space never deployed."""
        parse_space(space)
        if self.fleet is not None:
            current, versions, history = await self.fleet.run(
                self.fleet.db.versions, space, HISTORY_LIMIT
            )
            where = "fleet"
        else:
            current, versions, history = await self._run(self._local_versions, space)
            where = "host"
        if not versions and not history:
            raise ClientError(404, f"space {space} was never deployed", space=space)
        return {
            "space": space,
            "current": current,
            "store": where,
            "keep_versions": self.settings.keep_versions,
            "versions": versions,
            "history": history,
        }

    def _local_versions(
        self, space: str
    ) -> tuple[int | None, list[dict[str, object]], list[dict[str, object]]]:
        version = self.store.current(space)
        history = self.store.history.read(space, HISTORY_LIMIT)
        return (version.number if version else None), self.store.versions(space), history

    async def _fleet_change(
        self, space: str, commit: Callable[[str], Change | None]
    ) -> tuple[int, dict[str, object]]:
        assert self.fleet is not None
        change = await self.fleet.run(commit, space)
        if change is None:
            raise ClientError(404, f"space {space} is not deployed", space=space)
        status, hosts = await self.fleet.applied(change)
        return status, {"hosts": hosts}

    async def _change(self, space: str, change: Callable[[str], bool]) -> int:
        if not await self._run(change, space):
            raise ClientError(404, f"space {space} is not deployed", space=space)
        return self.changes.announce()

    async def _run(self, func: Callable[..., _T], *args: object) -> _T:
        return await anyio.to_thread.run_sync(func, *args, limiter=self.host_limiter)


def _rolled_back(
    space: str, meta: dict[str, object], number: int | None, previous: int | None
) -> dict[str, object]:
    body = version_summary(meta, number or 0, number)
    del body["current"]  # it is, by now
    return {"space": space, **body, "previous": previous}


def rollback_request(body: bytes) -> int | None:
    """The version a rollback's body asks for: nothing (or `{}`) for the default, else
    `{"version": N}`. Raises ClientError 422 saying what to send instead."""
    expected = 'send no body (the version the current one replaced) or {"version": N}'
    asked = json_fields(body, {"version"}, expected)
    version = None if asked is None else asked.get("version")
    if version is None:
        return None
    # bool is an int to Python, never a version to a person
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ClientError(
            422, f"`version` must be a whole number from 1 up, got {json.dumps(version)[:40]}"
        )
    return version
