"""Hostile tars against polyserve.state.unpack: headers count toward the caps as they are read,
memory stays bounded, and error bodies are short and name no host path."""

from __future__ import annotations

import bz2
import io
import json
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest

from polyserve.errors import ClientError
from polyserve.state.store import Store
from polyserve.state.unpack import MAX_NAME_BYTES, MAX_TAR_ENTRIES, extract_tar
from tests.helpers import (
    BIG,
    MAIN,
    REPO,
    GzipWriter,
    dot_entries_tgz,
    long_name_tgz,
    make_tar,
    tar_header,
)

CAP = 1 << 20  # the unpacked cap every test passes: 1 MiB


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "data", max_spaces=4)


def refused(store: Store, content: bytes, filename: str = "space.tgz", cap: int = CAP):
    """Stage an upload that must be refused; check the staging is empty and return the error."""
    with pytest.raises(ClientError) as err:
        store.stage(io.BytesIO(content), filename, cap)
    assert list(store.staging_dir.iterdir()) == []
    return err.value


def assert_short_and_pathless(err: ClientError, tmp_path: Path) -> None:
    body = json.dumps(err.body(), ensure_ascii=False)
    assert len(body) < 1000, body[:300]
    assert str(tmp_path) not in body and "/tmp" not in body, body


def tar_of(
    *infos: tuple[tarfile.TarInfo, bytes],
    fmt: int = tarfile.PAX_FORMAT,
    gzip: bool = True,
    **kw: object,
) -> bytes:
    buf = io.BytesIO()
    if gzip:
        kw["compresslevel"] = 1
    with tarfile.open(fileobj=buf, mode="w:gz" if gzip else "w", format=fmt, **kw) as tar:
        for info, data in infos:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, **pax: str):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.pax_headers = pax
    return info, data


def deep_path(nbytes: int, leaf: str = "f.py") -> str:
    """A relative path of about nbytes in 200-byte directories (each under NAME_MAX)."""
    parts = ["d" * 199 + str(i % 10) for i in range(nbytes // 201)]
    return "/".join([*parts, leaf])


# -- more payloads built header by header (helpers.GzipWriter): never held whole in memory --


def pax_value_tgz(path: Path, size: int = BIG) -> Path:
    """A pax (`x`) header holding one `comment` record of `size` bytes, then main.py."""
    out = GzipWriter(path)
    record = len(" comment=\n") + size
    record += len(str(record + len(str(record))))  # the length counts its own digits
    out.write(tar_header("PaxHeader", record, tarfile.XHDTYPE))
    out.write(f"{record} comment=".encode())
    out.repeat(b"c", size)
    out.write(b"\n")
    out.pad()
    out.write(tar_header("main.py", 0))
    out.close()
    return path


def zeros_tgz(path: Path, size: int = BIG) -> Path:
    """A classic gzip bomb: one member of `size` zero bytes."""
    out = GzipWriter(path)
    out.write(tar_header("main.py", size))
    out.repeat(b"\0", size)
    out.close()
    return path


def header_bomb_tgz(path: Path, count: int = 4000) -> Path:
    """Empty members behind 16 KiB pax comments: only headers, never a declared byte."""
    out = GzipWriter(path)
    record = b"16397 comment=" + b"h" * 16382 + b"\n"
    assert len(record) == 16397
    for i in range(count):
        out.write(tar_header("PaxHeader", len(record), tarfile.XHDTYPE) + record)
        out.pad()
        out.write(tar_header(f"f{i}.py", 0))
    out.close()
    return path


# -- the header caps -------------------------------------------------------------------


def test_a_gnu_long_name_of_megabytes_is_refused_unread(store, tmp_path):
    err = refused(store, tar_of(member("a" * (8 << 20)), fmt=tarfile.GNU_FORMAT))
    assert err.status == 422 and f"longer than {MAX_NAME_BYTES} bytes" in err.error
    assert_short_and_pathless(err, tmp_path)


def test_a_pax_header_with_a_huge_value_is_refused(store, tmp_path):
    err = refused(store, tar_of(member("main.py", MAIN, comment="v" * (8 << 20))))
    assert err.status == 422 and "pax header" in err.error
    assert_short_and_pathless(err, tmp_path)


def test_a_pax_path_over_the_name_cap_is_refused(store, tmp_path):
    err = refused(store, tar_of(member("main.py", MAIN), member(deep_path(MAX_NAME_BYTES + 500))))
    assert err.status == 422 and f"longer than {MAX_NAME_BYTES} bytes" in err.error
    assert_short_and_pathless(err, tmp_path)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_paths_under_the_name_cap_still_unpack(store, fmt):
    path = deep_path(MAX_NAME_BYTES - 300)
    staged = store.stage(
        io.BytesIO(tar_of(member("main.py", MAIN), member(path, b"x = 1\n"), fmt=fmt)), "s.tgz", CAP
    )
    assert (staged.dir / path).read_bytes() == b"x = 1\n"


def test_every_dot_entry_counts_toward_the_entry_cap(store, tmp_path):
    cap = 16 << 20  # room for the headers (512 bytes each): this is about the entry count
    content = dot_entries_tgz(tmp_path / "dots.tgz", MAX_TAR_ENTRIES).read_bytes()
    err = refused(store, content, cap=cap)  # MAX_TAR_ENTRIES `./` and main.py: one too many
    assert err.status == 422 and f"more than {MAX_TAR_ENTRIES} entries" in err.error
    content = dot_entries_tgz(tmp_path / "fits.tgz", MAX_TAR_ENTRIES - 1).read_bytes()
    assert store.stage(io.BytesIO(content), "fits.tgz", cap).entry == "main.py"


def test_header_bytes_count_toward_the_unpacked_cap(store, tmp_path):
    err = refused(store, header_bomb_tgz(tmp_path / "bomb.tgz").read_bytes())
    assert err.status == 413 and "headers included" in err.error
    assert_short_and_pathless(err, tmp_path)


def test_bytes_are_counted_as_they_are_read(tmp_path):
    """A plain tar is read straight from the upload: reading stops just past the cap."""
    upload = io.BytesIO(zlib.decompress(header_bomb_tgz(tmp_path / "b.tgz").read_bytes(), 31))
    assert len(upload.getvalue()) > 50 * CAP
    (tmp_path / "dest").mkdir()
    with pytest.raises(ClientError) as err:
        extract_tar(upload, tmp_path / "dest", CAP, "b.tar")
    assert err.value.status == 413
    assert upload.tell() <= CAP + 1


def test_a_chain_of_extension_headers_is_a_422_not_a_crash(store, tmp_path):
    """tarfile recurses once per extension header: 2,000 in a row used to be a 500."""
    out = GzipWriter(tmp_path / "chain.tgz")
    for _ in range(2000):
        out.write(tar_header("././@LongLink", 2, tarfile.GNUTYPE_LONGNAME) + b"a\0")
        out.pad()
    out.write(tar_header("main.py", 0))
    out.close()
    err = refused(store, (tmp_path / "chain.tgz").read_bytes())
    assert err.status == 422 and "extension headers in a row" in err.error


def test_pax_headers_have_a_total_budget_whatever_the_unpacked_cap(store, tmp_path):
    """Pax records are parsed one by one in Python: 4 MiB of them is about a second."""
    files = [member(f"f{i}.py", comment="c" * 60_000) for i in range(80)]
    err = refused(store, tar_of(member("main.py", MAIN), *files), cap=64 << 20)
    assert err.status == 422 and "MiB of pax/long-name headers" in err.error


def test_global_pax_keys_are_capped(store, tmp_path):
    """Global keys are applied to every later member: 1,000 of them cost each member."""
    keys = {f"k{i}": "v" for i in range(1000)}
    err = refused(store, tar_of(member("main.py", MAIN), pax_headers=keys))
    assert err.status == 422 and "global pax keys" in err.error


def test_a_git_archive_style_global_comment_is_fine(store):
    content = tar_of(member("main.py", MAIN), pax_headers={"comment": "0" * 40})
    assert store.stage(io.BytesIO(content), "git.tar.gz", CAP).entry == "main.py"


def test_sparse_files_are_refused(store):
    err = refused(
        store,
        tar_of(
            member("main.py", MAIN),
            member("s", b"", tarfile.GNUTYPE_SPARSE),
            fmt=tarfile.GNU_FORMAT,
        ),
    )
    assert err.status == 422 and err.details["type"] == "sparse file"


def test_a_negative_size_is_refused(store, tmp_path):
    """GNU base-256 sizes can be negative, which would take bytes off the declared total."""
    main = tar_header("main.py", len(MAIN)) + MAIN.ljust(tarfile.BLOCKSIZE, b"\0")
    blob = tar_header("blob", 2 * CAP) + bytes(2 * CAP)
    content = main + tar_header("neg", -(1 << 40)) + blob + bytes(2 * tarfile.BLOCKSIZE)
    err = refused(store, content, "neg.tar")
    assert err.status == 422 and "negative size" in err.error


def test_only_plain_and_gzip_tars_are_accepted(store):
    raw = tar_of(member("main.py", MAIN), gzip=False)
    store.discard(store.stage(io.BytesIO(raw), "s.tar", CAP))
    err = refused(store, bz2.compress(raw), "s.tar.bz2")
    assert err.status == 422 and "plain or gzip" in err.error


# -- error bodies ----------------------------------------------------------------------

LONG = "n" * 3000


@pytest.mark.parametrize(
    "files,filename,words",
    [
        ([member(LONG, kind=tarfile.SYMTYPE)], "s.tgz", "regular files"),
        ([member(f"../{LONG}")], "s.tgz", "'..'"),
        ([member("x" * 300 + ".py")], "s.tgz", "File name too long"),
        ([member("a", b"1"), member("a/b.py", b"2")], "s.tgz", "directory"),
        ([member(f"{i}{'d' * 250}.py") for i in range(10)], "s.tgz", "no entry module"),
        ([member("polyserve.toml", f'entry = "{LONG}.py"'.encode())], "s.tgz", "not in the tar"),
        ([member("polyserve.toml", f"entry = {[LONG] * 5}".encode())], "s.tgz", "must name"),
        ([], "x" * 5000 + ".tgz", "valid tar"),
    ],
    ids=[
        "link",
        "dotdot",
        "name-max",
        "file-then-dir",
        "no-entry",
        "manifest-missing",
        "manifest-list",
        "long-filename",
    ],
)
def test_error_bodies_are_short_and_name_no_host_path(store, tmp_path, files, filename, words):
    content = tar_of(member("keep.txt"), *files) if files else b"not a tar" * 100
    err = refused(store, content, filename)
    assert err.status == 422 and words in json.dumps(err.body()), err.body()
    assert_short_and_pathless(err, tmp_path)


# -- memory, measured in a fresh interpreter ---------------------------------------------

# VmHWM, not ru_maxrss: after exec, ru_maxrss starts at the parent's (pytest's) peak.
MEASURE = """
import io, json, sys, tempfile
from pathlib import Path
from polyserve.errors import ClientError
from polyserve.state.store import Store

def peak_rss():
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024

def stage(store, content, name):
    try:
        store.stage(io.BytesIO(content), name, int(sys.argv[2]))
        return 200, {}
    except ClientError as exc:
        return exc.status, exc.body()

store = Store(tempfile.mkdtemp(dir=sys.argv[3]), max_spaces=4)
payload = Path(sys.argv[1]).read_bytes()
stage(store, bytes.fromhex(sys.argv[4]), "warm.tgz")  # load every code path first
before = peak_rss()
status, body = stage(store, payload, "hostile.tgz")
print(json.dumps({"status": status, "body": body, "growth": peak_rss() - before}))
"""

PAYLOADS = {
    "gnu-long-name": (long_name_tgz, 422),
    "pax-value": (pax_value_tgz, 422),
    "50001-dot-entries": (dot_entries_tgz, 413),  # 25 MiB of headers, at a 1 MiB cap
    "gzip-bomb": (zeros_tgz, 413),
    "header-bomb": (header_bomb_tgz, 413),
}


@pytest.mark.parametrize("case", PAYLOADS)
def test_peak_memory_stays_within_a_small_multiple_of_the_cap(tmp_path, case):
    build, status = PAYLOADS[case]
    payload = build(tmp_path / f"{case}.tgz")
    warm = make_tar({"main.py": MAIN.decode(), "lib/x.py": "x = 1\n"}, gzip=True)
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(payload), str(CAP), str(tmp_path), warm.hex()],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout)
    assert result["status"] == status, result
    assert len(json.dumps(result["body"])) < 1000
    assert result["growth"] <= 4 * CAP, f"peak RSS grew {result['growth'] >> 10} KiB"


def test_a_model_upload_is_stored_as_model_onnx_whatever_its_name(store):
    staged = store.stage(io.BytesIO(b"\x08\x07model bytes"), "digits-v2.onnx", CAP)
    assert staged.entry == "model.onnx"
    assert (staged.dir / "model.onnx").read_bytes() == b"\x08\x07model bytes"
    assert sorted(p.name for p in staged.dir.iterdir()) == ["model.onnx"]


def test_a_tar_with_a_model_and_no_module_has_the_model_as_its_entry(store):
    staged = store.stage(io.BytesIO(tar_of(member("model.onnx", b"m"))), "s.tar", CAP)
    assert staged.entry == "model.onnx"
    with_module = tar_of(member("model.onnx", b"m"), member("main.py", b"app = None"))
    assert store.stage(io.BytesIO(with_module), "s.tar", CAP).entry == "main.py"
    named = tar_of(member("digits.onnx", b"m"), member("polyserve.toml", b'entry = "digits.onnx"'))
    assert store.stage(io.BytesIO(named), "s.tar", CAP).entry == "digits.onnx"
