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

CHUNK = 1 << 20  # an upload moves to and from the database in slices this long


@dataclass(frozen=True)
class Stored:
    """A version as the fleet keeps it."""

    number: int
    sha256: str
    meta: dict[str, Any]
    size: int | None  # the upload's bytes (download()); None: another pool's, not read


class Uploads(Connection):
    """A stored version's metadata and bytes, read back."""

    def fetch(self, space: str, number: int, pool: str | None = None) -> Stored | None:
        """A version and the size of its bytes; with `pool`, the size only if the version
        runs in that pool (a host does not download what it will never import)."""
        with self.session() as conn:
            row = conn.execute(
                "SELECT number, sha256, meta, CASE WHEN %s::text IS NULL"
                " OR coalesce(meta->>'pool', %s) = %s THEN length(data) END"
                " FROM polyserve_versions WHERE space = %s AND number = %s",
                (pool, DEFAULT_POOL, pool, space, number),
            ).fetchone()
        return None if row is None else Stored(*row)

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
