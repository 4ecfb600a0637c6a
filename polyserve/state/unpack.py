"""Unpack one untrusted upload (a .py file or a plain/gzip tar) into a staging directory."""

from __future__ import annotations

import gzip
import os
import re
import shutil
import tarfile
import tomllib
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, NoReturn, cast

from polyserve.errors import DISK_FULL, ClientError
from polyserve.names import DEFAULT_POOL, POOL_RULE, is_pool

MANIFEST = "polyserve.toml"
DEFAULT_ENTRIES = ("main.py", "app.py")
MODEL_FILE = "model.onnx"  # a model upload's name, and a tar's model when it has no module
MAX_TAR_ENTRIES = 10_000  # members, `./` directory entries included
MAX_NAME_BYTES = 4096  # PATH_MAX on Linux: no file a space can import needs a longer path
# Pax and GNU long-name data are read whole into memory and parsed record by record in
# Python, before a member is seen: bound each header, the chain before one member (the
# parser recurses once per header) and the whole tar, whatever the unpacked cap.
MAX_EXTENSION_BYTES = 64 << 10
MAX_EXTENSION_CHAIN = 4  # a global, a pax, a long name and a long link name at most
MAX_EXTENSION_TOTAL = 4 << 20
MAX_GLOBAL_KEYS = 64  # global pax keys are applied to, and copied into, every later member
MAX_MANIFEST_BYTES = 64 << 10
ECHO_CHARS = 200  # of any user-supplied text echoed in an error body
_SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}\.py")  # else stored as main.py
_GZIP_MAGIC = b"\x1f\x8b"
_LONG_NAMES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_EXTENSIONS = (*_LONG_NAMES, tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
_QUOTED_PATH = re.compile(r"'/[^']*'")
_TYPE_NAMES = {
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hard link",
    tarfile.CHRTYPE: "character device",
    tarfile.BLKTYPE: "block device",
    tarfile.FIFOTYPE: "fifo",
    tarfile.GNUTYPE_SPARSE: "sparse file",
}


@dataclass(frozen=True)
class Manifest:
    """What an upload says about itself: its entry module, and the pool it runs in."""

    entry: str  # a .py file at the top of the upload
    pool: str = DEFAULT_POOL


def unpack_upload(
    upload: BinaryIO, dest: Path, filename: str, max_unpacked: int
) -> tuple[Manifest, int]:
    """Write an upload into the empty directory dest and return its manifest (a single .py
    has none: its entry is itself, its pool the default) and the bytes its tar unpacked
    to as the cap counts them (0 for a .py or a model, which the cap does not cover).

    Raises ClientError (4xx) for a refused upload and lets a disk-full OSError through; the
    caller removes dest on any error, so files written before a check fails are harmless.
    """
    if filename.endswith(".py"):
        # Keep the uploaded name, so errors and tracebacks name the user's file.
        entry = filename if _SOURCE_NAME.fullmatch(filename) else "main.py"
        _write_source(upload, dest / entry, filename)
        return Manifest(entry), 0
    if filename.endswith(".onnx"):  # a model space: the host serves the file itself
        _write_model(upload, dest / MODEL_FILE, filename)
        return Manifest(MODEL_FILE), 0
    unpacked = extract_tar(upload, dest, max_unpacked, filename)
    return _read_manifest(dest), unpacked


def extract_tar(upload: BinaryIO, dest: Path, max_unpacked: int, filename: str) -> int:
    """Stream a plain or gzip tar into dest, member by member, within every cap; returns
    the bytes of tar read (headers included), which is what the cap counts."""
    upload.seek(0)
    compressed = upload.read(len(_GZIP_MAGIC)) == _GZIP_MAGIC
    upload.seek(0)
    # Decompressing here rather than in tarfile lets _Counted see every byte, headers too.
    source: BinaryIO | gzip.GzipFile = upload
    if compressed:
        source = gzip.GzipFile(fileobj=upload, mode="rb")
    stream = _Counted(source, max_unpacked)
    entries = declared = 0
    current = ""
    try:
        # Stream mode reads strictly forward and never holds more than one member's data.
        with _BoundedTarFile.open(fileobj=cast(IO[bytes], stream), mode="r|") as tar:
            while (m := tar.next()) is not None:
                tar.members.clear()  # type: ignore[attr-defined]  # tarfile keeps every member it has read: drop them
                entries += 1
                if entries > MAX_TAR_ENTRIES:
                    raise ClientError(422, f"tar has more than {MAX_TAR_ENTRIES} entries")
                current = m.name
                name = _checked(m)
                if not name:
                    continue  # the "." directory entry (counted above)
                if m.isreg():
                    # Refuse on the header's word, before its data is read or written.
                    declared += m.size
                    if declared > max_unpacked:
                        raise _too_big(max_unpacked)
                # The data filter is a second layer under the checks above.
                tar.extract(m.replace(name=name, deep=False), dest, filter="data")
    except ClientError:
        raise
    # ValueError: tarfile's int() of an over-long pax number, or a NUL in a pax path.
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error) as exc:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            raise
        details = {"member": _clip(current)} if current else {}
        raise ClientError(
            422,
            "module must be a .py file or a valid tar (plain or gzip): "
            + _error_message(exc, dest),
            filename=_clip(filename),
            **details,
        ) from None
    finally:
        if compressed:
            source.close()  # not the upload: GzipFile leaves a passed-in file open
    return stream.count


class _Counted:
    """The decompressed tar as tarfile reads it: a 413 once it passes the unpacked cap."""

    def __init__(self, source: BinaryIO | gzip.GzipFile, cap: int) -> None:
        self.source = source
        self.cap = cap
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        # Never ask the decompressor for more than one byte past the cap, whatever the size.
        room = self.cap + 1 - self.count
        data = self.source.read(room if size < 0 else min(size, room))
        self.count += len(data)
        if self.count > self.cap:
            raise _too_big(self.cap)
        return data


class _CheckedInfo(tarfile.TarInfo):
    """Headers whose data tarfile would read whole are checked before it does.

    _proc_member is the hook tarfile documents for subclasses. The _proc_gnusparse_*
    methods are overridden too: a pax sparse map becomes a Python list of ints, several
    times its bytes (bench/NOTES.md, "Figures moved out of code comments"), bounded only
    by the stream, and no space needs a sparse file.
    """

    def _proc_member(self, tar: _BoundedTarFile) -> tarfile.TarInfo:
        if self.type == tarfile.GNUTYPE_SPARSE:
            _refuse_type(self)
        if self.type not in _EXTENSIONS:
            return super()._proc_member(tar)  # type: ignore[misc]
        if self.type in _LONG_NAMES:  # the name and its NUL terminator
            if not 0 <= self.size <= MAX_NAME_BYTES + 1:
                raise ClientError(422, f"tar has a member name longer than {MAX_NAME_BYTES} bytes")
        elif not 0 <= self.size <= MAX_EXTENSION_BYTES:
            raise ClientError(
                422, f"tar has a pax header larger than {MAX_EXTENSION_BYTES >> 10} KiB"
            )
        tar.extension_bytes += self.size
        if tar.extension_bytes > MAX_EXTENSION_TOTAL:
            raise ClientError(
                422, f"tar has more than {MAX_EXTENSION_TOTAL >> 20} MiB of pax/long-name headers"
            )
        if tar.extension_depth >= MAX_EXTENSION_CHAIN:
            raise ClientError(
                422, f"tar has more than {MAX_EXTENSION_CHAIN} extension headers in a row"
            )
        tar.extension_depth += 1
        try:
            member = super()._proc_member(tar)  # type: ignore[misc]  # reads the data, then the next header
        finally:
            tar.extension_depth -= 1
        if len(tar.pax_headers) > MAX_GLOBAL_KEYS:
            raise ClientError(422, f"tar has more than {MAX_GLOBAL_KEYS} global pax keys")
        return member

    def _refuse_sparse(self, *args: object) -> NoReturn:
        raise ClientError(
            422, "tar may only hold regular files and directories", type="sparse file"
        )

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


class _BoundedTarFile(tarfile.TarFile):
    tarinfo = _CheckedInfo
    # Class defaults, because TarFile.__init__ already reads the first header; each
    # instance gets its own values on the first +=.
    extension_bytes = 0
    extension_depth = 0


def _checked(m: tarfile.TarInfo) -> str:
    """The member's normalized name, or a ClientError for anything but a plain file or dir."""
    if not (m.isreg() or m.isdir()):
        # Links and special files are refused outright rather than checked: the tarfile
        # filter bypasses of 2024-2025 all went through links.
        _refuse_type(m)
    if len(m.name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        raise ClientError(
            422, f"tar member name is longer than {MAX_NAME_BYTES} bytes", member=_clip(m.name)
        )
    if m.size < 0:  # base-256 and pax sizes can be negative, which would undercount
        raise ClientError(422, "tar member has a negative size", member=_clip(m.name))
    name = _member_name(m.name)
    if not name and not m.isdir():
        raise ClientError(422, "tar member has an empty name", member=_clip(m.name))
    return name


def _refuse_type(m: tarfile.TarInfo) -> NoReturn:
    raise ClientError(
        422,
        "tar may only hold regular files and directories",
        member=_clip(m.name),
        type=_TYPE_NAMES.get(m.type, repr(m.type)),
    )


def _member_name(raw: str) -> str:
    """Normalize a tar member name (`tar -C dir .` writes `./main.py`); reject escapes."""
    if raw.startswith("/") or "\\" in raw:
        raise ClientError(422, "tar member has an absolute or backslash path", member=_clip(raw))
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ClientError(422, "tar member path contains '..'", member=_clip(raw))
    return "/".join(parts)


def _too_big(cap: int) -> ClientError:
    size = f"{cap >> 20} MiB" if cap % (1 << 20) == 0 else f"{cap} bytes"
    return ClientError(
        413, f"tar unpacks to more than {size}, headers included (POLYSERVE_MAX_UNPACKED_MB)"
    )


def _error_message(exc: BaseException, dest: Path) -> str:
    """An error message fit for the client: no host path, no unbounded echo."""
    # An OSError's str() adds the file name, a path under dest: keep its strerror only.
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    # Filter errors name the destination; nothing else under / is the client's business.
    for path in {str(dest), os.path.realpath(dest)}:
        text = text.replace(path, "<staging>")
    return _clip(_QUOTED_PATH.sub("'<path>'", text))


def _clip(text: object, width: int = ECHO_CHARS) -> str:
    text = text if isinstance(text, str) else repr(text)
    return text if len(text) <= width else text[:width] + "…"


def _write_source(upload: BinaryIO, dest: Path, filename: str) -> None:
    data = upload.read()  # a .py is at most POLYSERVE_MAX_UPLOAD_MB: it fits in memory
    name = _clip(filename)
    if not data.strip():
        raise ClientError(422, f"{name} is empty: upload a module that defines app or handle")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ClientError(422, f"{name} is not UTF-8 text: {exc}") from None
    dest.write_bytes(data)


def _write_model(upload: BinaryIO, dest: Path, filename: str) -> None:
    """A model upload, copied as it streams in (onnxruntime checks it at validation)."""
    upload.seek(0)
    with open(dest, "wb") as out:
        shutil.copyfileobj(upload, out, 1 << 20)
        empty = out.tell() == 0
    if empty:
        raise ClientError(422, f"{_clip(filename)} is empty: upload an ONNX model file")


def _read_manifest(root: Path) -> Manifest:
    """The tar's polyserve.toml (`entry`, `pool`: both optional), or the defaults."""
    manifest = root / MANIFEST
    if not manifest.is_file():
        return Manifest(_default_entry(root))
    if manifest.stat().st_size > MAX_MANIFEST_BYTES:
        raise ClientError(422, f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES >> 10} KiB")
    try:
        table = tomllib.loads(manifest.read_text("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ClientError(422, f"{MANIFEST} is not valid TOML: {_clip(str(exc))}") from None
    pool = _pool(table.get("pool", DEFAULT_POOL))
    entry = table.get("entry")
    if entry is None:
        return Manifest(_default_entry(root), pool)
    if not isinstance(entry, str) or "/" in entry or not entry.endswith((".py", ".onnx")):
        raise ClientError(
            422,
            f"{MANIFEST}: entry must name a .py file (or an .onnx model) at the top of the tar",
            field="entry",
            entry=_clip(entry),
        )
    # Over NAME_MAX, is_file() would raise ENAMETOOLONG rather than say False.
    if len(entry.encode("utf-8", "surrogatepass")) > 255 or not (root / entry).is_file():
        raise ClientError(422, f"{MANIFEST}: entry {_clip(entry)} is not in the tar", field="entry")
    return Manifest(entry, pool)


def _pool(value: Any) -> str:
    """The manifest's `pool`, checked: a 422 naming the field says the rule otherwise."""
    if not isinstance(value, str):
        raise ClientError(
            422,
            f'{MANIFEST}: pool must be a string such as pool = "gpu", not {_toml_type(value)}',
            field="pool",
            pool=_clip(value),
        )
    if not is_pool(value):
        raise ClientError(
            422,
            f'{MANIFEST}: pool must be a pool name, {POOL_RULE} (e.g. "gpu"; without it,'
            f" {DEFAULT_POOL})",
            field="pool",
            pool=_clip(value),
        )
    return value


def _toml_type(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", list: "an array"}
    return names.get(type(value), "a table" if isinstance(value, dict) else "a date or time")


def _default_entry(root: Path) -> str:
    for name in (*DEFAULT_ENTRIES, MODEL_FILE):  # a model only where no module is the entry
        if (root / name).is_file():
            return name
    top = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())[:10]
    raise ClientError(
        422,
        f"no entry module: put main.py or app.py (or a model, as {MODEL_FILE}) at the top of"
        " the tar (create it with"
        f" `tar -cf space.tar -C yourdir .`) or name one in {MANIFEST}",
        found=[_clip(name, 60) for name in top],  # ten names in a short body
    )
