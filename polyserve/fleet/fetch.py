"""A fleet version's files onto this host: streamed, checked, unpacked and byte-compiled."""

from __future__ import annotations

import compileall
import fcntl
import tempfile

from polyserve.errors import DISK_FULL, ClientError
from polyserve.fleet.db import FleetDB
from polyserve.fleet.uploads import Stored
from polyserve.state.store import Staged, Store, Version


def fetch_version(db: FleetDB, store: Store, version: Version, max_unpacked: int) -> None:
    """Put a version's files in place from the fleet, on first use (a worker).

    One fetch of a version at a time on this host: its metadata file is locked for the
    fetch, so the host's other workers wanting it wait, then find the files in place."""
    meta = store.space_dir(version.space) / "versions" / f"{version.number}.json"
    try:
        held = open(meta, "rb")  # noqa: SIM115 (closed below)
    except FileNotFoundError:  # pruned, or the space deleted, since the request found it
        raise ClientError(404, f"{version.space} v{version.number} is no longer here") from None
    with held:
        fcntl.flock(held, fcntl.LOCK_EX)
        _fetch_version(db, store, version, max_unpacked)


def _fetch_version(db: FleetDB, store: Store, version: Version, max_unpacked: int) -> None:
    stored = db.fetch(version.space, version.number)
    if stored is None:
        raise ClientError(404, f"{version.space} v{version.number} is not in the fleet store")
    staged = download(db, store, version.space, stored, max_unpacked)
    if staged is not None:
        try:
            with store.locked():
                store.place(version.space, stored.number, staged)
        finally:
            store.discard(staged)


def download(
    db: FleetDB, store: Store, space: str, stored: Stored, max_unpacked: int
) -> Staged | None:
    """A fleet version's files, staged: its bytes streamed to a file while hashed (never
    whole in memory), the sha256 checked, unpacked from the file as an upload is (the
    same caps), byte-compiled. None when they are on disk already."""
    if store.has_files(space, stored.number, stored.sha256):
        return None
    try:
        with tempfile.TemporaryFile(dir=store.staging_dir) as spool:
            if db.download(space, stored, spool) != stored.sha256:
                raise ClientError(
                    500, f"{space} v{stored.number}: sha256 mismatch in the fleet store"
                )
            upload = str(stored.meta.get("upload") or "space.tar")
            staged = store.stage(spool, upload, max_unpacked)
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        raise ClientError(507, f"{space} v{stored.number}: the data disk is full") from None
    try:
        compileall.compile_dir(str(staged.dir), quiet=2, workers=1)
    except BaseException:
        store.discard(staged)
        raise
    return staged
