"""A version's upload in the fleet store: streamed in by one binary COPY, read back in slices."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import psycopg

from polyserve.fleet.connection import Connection
from polyserve.names import DEFAULT_POOL
from polyserve.state.secrets import entry

CHUNK = 1 << 20  # an upload moves to and from the database in slices this long


@dataclass(frozen=True)
class Stored:
    """A version as the fleet keeps it."""

    number: int
    sha256: str
    meta: dict[str, Any]
    size: int | None  # the upload's bytes (download()); None: another pool's, not read
    # The space's secrets as a host's file holds them, when fetched with them: none
    # unless the version runs in the pool asked for (fetch's `secrets`).
    secrets: dict[str, dict[str, Any]] | None = None


class Uploads(Connection):
    """A stored version's metadata and bytes, read back."""

    def fetch(
        self, space: str, number: int, pool: str | None = None, secrets: bool = False
    ) -> Stored | None:
        """A version and the size of its bytes; with `pool`, the size only if the version
        runs in that pool (a host does not download what it will never import). With
        `secrets`, the space's secrets too if it runs in `pool`: a follower applying a
        deploy reads both in one round trip."""
        mine = "coalesce(v.meta->>'pool', %(default)s) = %(pool)s"
        with self.session() as conn:
            row = conn.execute(
                "SELECT v.number, v.sha256, v.meta,"
                f" CASE WHEN %(pool)s::text IS NULL OR {mine} THEN length(v.data) END,"
                " s.names, s.vals, s.ats FROM polyserve_versions v LEFT JOIN LATERAL"
                " (SELECT array_agg(name) AS names, array_agg(value) AS vals,"
                " array_agg(extract(epoch FROM updated_at)::float8) AS ats"
                f" FROM polyserve_secrets WHERE %(secrets)s AND space = v.space AND {mine}) s"
                " ON true WHERE v.space = %(space)s AND v.number = %(number)s",
                {"default": DEFAULT_POOL, "pool": pool, "secrets": secrets, "space": space}
                | {"number": number},
            ).fetchone()
        if row is None:
            return None
        number, sha256, meta, size, names, values, ats = row
        rows = zip(names or [], values or [], ats or [], strict=True)
        found = {name: entry(value, at) for name, value, at in rows}
        return Stored(number, sha256, meta, size, found if secrets else None)

    def download(self, space: str, stored: Stored, out: BinaryIO) -> str:
        """Write a version's bytes to `out`, CHUNK at a time (the process never holds the
        whole upload, nor the server's hex of it), and return their sha256."""
        digest = hashlib.sha256()
        with self.session() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            for start in range(0, stored.size or 0, CHUNK):
                row = conn.execute(
                    "SELECT substring(data FROM %s FOR %s) FROM polyserve_versions"
                    " WHERE space = %s AND number = %s",
                    (start + 1, CHUNK, space, stored.number),
                    binary=True,
                ).fetchone()
                if row is None:
                    break  # gone since fetch(): the sha256 check refuses what was read
                digest.update(row[0])
                out.write(row[0])
        return digest.hexdigest()


def copy_version(
    conn: psycopg.Connection, row: tuple[str, int, str, dict[str, Any]], upload: BinaryIO, size: int
) -> None:
    """Insert a version with one binary COPY whose last field, the upload, is read from
    its file CHUNK at a time: a parameter would hold it whole, and its encoding again."""
    space, number, sha256, meta = row
    # jsonb's binary form is a version byte, 1, then the text.
    jsonb = b"\x01" + json.dumps(meta).encode()
    fields = (space.encode(), struct.pack("!i", number), sha256.encode(), jsonb)
    head = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!iih", 0, 0, 5)
    head += b"".join(struct.pack("!i", len(f)) + f for f in fields) + struct.pack("!i", size)
    upload.seek(0)
    with (
        conn.cursor() as cur,
        cur.copy(
            "COPY polyserve_versions (space, number, sha256, meta, data) FROM STDIN (FORMAT binary)"
        ) as copy,
    ):
        copy.write(head)
        sent = 0
        while chunk := upload.read(CHUNK):
            copy.write(chunk)
            sent += len(chunk)
        if sent != size:  # the file changed under us: the server would take a short row
            raise RuntimeError(f"the upload was {size} bytes, then {sent}")
        copy.write(struct.pack("!h", -1))
