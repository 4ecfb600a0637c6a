"""The bad-input matrix: each bad deploy is a 4xx JSON error naming the problem, writes
nothing outside a fresh staging directory, and leaves the previous version serving."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from polyserve import settings
from polyserve.app import create_app
from tests.helpers import HostProcess, dot_entries_tgz, long_name_tgz, make_tar

V1 = b"def handle(request):\n    return 'v1'\n"
OUTSIDE = Path("/tmp/polyserve-must-not-exist")  # where an escaping link would write


def tar_of(*infos: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("main.py"), io.BytesIO(b""))
        for info, data in infos:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes | None = None):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info, data if kind == tarfile.REGTYPE else None


def many_entries(n: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for i in range(n):
            tar.addfile(tarfile.TarInfo(f"f{i}.txt"), io.BytesIO(b""))
    return buf.getvalue()


def gzip_bomb(mb: int) -> bytes:
    """A gzip tar whose one member unpacks to `mb` MiB of zeros (compressed ~1000x)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("main.py")
        info.size = mb << 20
        tar.addfile(info, io.BytesIO(b"\0" * info.size))
    return gzip.compress(raw.getvalue(), compresslevel=9)


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root with its content hash (links by their target)."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "-> " + str(path.readlink())
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[rel] = "dir"
    return found


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[tuple[TestClient, Path]]:
    data = tmp_path_factory.mktemp("bad") / "data"
    s = settings.load(
        {
            "POLYSERVE_DATA_DIR": str(data),
            "POLYSERVE_IMPORT_TIMEOUT": "2",
            "POLYSERVE_IMPORT_MEMORY_MB": "1024",
            "POLYSERVE_MAX_UNPACKED_MB": "8",
        }
    )
    with TestClient(create_app(s), client=("127.0.0.1", 1)) as c:
        assert (
            c.post(
                "/_polyserve/deploy", data={"space": "o/s"}, files={"module": ("main.py", V1)}
            ).status_code
            == 200
        )
        yield c, data


def deploy(c: TestClient, space: str | None, module: tuple[str, bytes] | None):
    data = {"space": space} if space is not None else {}
    return c.post("/_polyserve/deploy", data=data, files={"module": module} if module else None)


BAD_NAMES = [
    "../x",
    "a/b/c",
    "/s",
    "o/",
    "o//s",
    "a\x01/b",
    "o/s\n",
    "a b/c",
    "o/s s",
    "x" * 300,
    "o/" + "n" * 300,
    ".o/s",
    "o/.s",
    "o/..",
    "",
    "o",
]

MODULES = [
    # (case id, file name, content, expected status, expected words in the error)
    ("empty-py", "main.py", b"   \n", 422, "empty"),
    ("non-utf8-py", "main.py", b"\xff\xfe\x00def", 422, "UTF-8"),
    ("neither-app-nor-handle", "main.py", b"x = 1\n", 422, "neither `app`"),
    ("syntax-error", "main.py", b"def handle(r):\n    return (\n", 422, "main.py, line 2"),
    ("exception-at-import", "main.py", b"raise ValueError('no weights')\n", 422, "no weights"),
    ("hangs", "main.py", b"import time\ntime.sleep(60)\n", 422, "within 2 s"),
    ("allocates-without-bound", "main.py", b"x = bytearray(8 << 30)\n", 422, "address-space limit"),
    ("os-exit", "main.py", b"import os\nos._exit(9)\n", 422, "exit code 9"),
    ("segfault", "main.py", b"import ctypes\nctypes.string_at(0)\n", 422, "SIGSEGV"),
    ("not-a-tar", "space.tar", b"plain bytes", 422, "valid tar"),
    ("truncated-tar", "space.tar", make_tar({"main.py": "x" * 9000})[:3000], 422, "valid tar"),
    ("dotdot-member", "space.tar", make_tar({"../evil.py": ""}), 422, "'..'"),
    ("nested-dotdot", "space.tar", make_tar({"a/../../evil.py": ""}), 422, "'..'"),
    ("absolute-member", "space.tar", make_tar({"/tmp/evil.py": ""}), 422, "absolute"),
    (
        "symlink-out",
        "space.tar",
        tar_of(entry("out", tarfile.SYMTYPE, str(OUTSIDE))),
        422,
        "regular files",
    ),
    (
        "symlink-relative-out",
        "space.tar",
        tar_of(entry("up", tarfile.SYMTYPE, "../../..")),
        422,
        "regular files",
    ),
    (
        "hardlink-out",
        "space.tar",
        tar_of(entry("h", tarfile.LNKTYPE, "/etc/passwd")),
        422,
        "regular files",
    ),
    (
        "empty-named-symlink-chain",
        "space.tar",
        tar_of(entry("", tarfile.SYMTYPE, "."), entry("a", tarfile.SYMTYPE, "/")),
        422,
        "regular files",
    ),
    ("char-device", "space.tar", tar_of(entry("tty", tarfile.CHRTYPE)), 422, "character"),
    ("block-device", "space.tar", tar_of(entry("sda", tarfile.BLKTYPE)), 422, "block"),
    ("fifo", "space.tar", tar_of(entry("pipe", tarfile.FIFOTYPE)), 422, "fifo"),
    ("no-entry", "space.tar", make_tar({"lib.py": ""}), 422, "no entry module"),
    ("gzip-bomb", "space.tar.gz", gzip_bomb(64), 413, "unpacks to more than 8 MiB"),
]


@pytest.fixture
def unchanged(world):
    """Asserts after the test: nothing written outside staging, staging empty, v1 serves."""
    c, data = world
    before = snapshot(data)
    yield c
    assert snapshot(data) == before
    assert not any((data / "staging").iterdir())
    assert c.get("/s/o/s/").text == "v1"
    assert not OUTSIDE.exists()


def test_missing_space(unchanged):
    r = deploy(unchanged, None, ("main.py", V1))
    assert r.status_code == 422 and "missing form field `space`" in r.json()["error"]


def test_missing_module(unchanged):
    r = deploy(unchanged, "o/s", None)
    assert r.status_code == 422 and "missing file field `module`" in r.json()["error"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:20] for n in BAD_NAMES])
def test_bad_space_name(unchanged, name):
    r = deploy(unchanged, name, ("main.py", V1))
    assert r.status_code == 422
    assert "invalid space name" in r.json()["error"] or "missing form field" in r.json()["error"]


@pytest.mark.parametrize("case,filename,content,status,words", MODULES, ids=[m[0] for m in MODULES])
def test_bad_module(unchanged, case, filename, content, status, words):
    r = deploy(unchanged, "o/s", (filename, content))
    assert r.status_code == status, r.text
    assert words in str(r.json()), r.json()


def test_a_100k_entry_tar_stops_at_the_entry_cap(unchanged):
    r = deploy(unchanged, "o/s", ("many.tar.gz", many_entries(100_000)))
    assert r.status_code == 422 and "more than 10000 entries" in r.json()["error"]


def test_a_link_refused_in_one_deploy_cannot_be_written_through_by_the_next(unchanged):
    planted = tar_of(entry("lib", tarfile.SYMTYPE, str(OUTSIDE)))
    assert deploy(unchanged, "o/s", ("plant.tar", planted)).status_code == 422
    through = make_tar({"main.py": "", "lib/evil.py": "x = 1\n"})
    r = deploy(unchanged, "o/t", ("through.tar", through))
    assert r.status_code == 422  # no app or handle; the point is where lib/ went
    assert not OUTSIDE.exists()


def peak_rss(host: HostProcess) -> dict[int, int]:
    """Each worker's high-water RSS in bytes, by pid."""
    peaks = {}
    for pid in host.worker_pids():
        status = Path(f"/proc/{pid}/status").read_text()
        peaks[pid] = int(status.split("VmHWM:")[1].split()[0]) * 1024
    return peaks


def test_tar_header_bombs_through_a_real_host(host_factory, tmp_path):
    """Through gunicorn: a 64 MiB long name and 20,000 `./` entries, each a small .tgz, are
    short JSON 422s naming no path; no worker's peak RSS grows past a few times the cap;
    nothing under spaces/ changes and v1 still serves."""
    cap = 16 << 20
    host = host_factory(POLYSERVE_MAX_UNPACKED_MB=str(cap >> 20))
    assert host.deploy("o/hdr", V1).status_code == 200
    bombs = [
        (long_name_tgz(tmp_path / "long-name.tgz"), "longer than 4096 bytes"),
        (dot_entries_tgz(tmp_path / "dots.tgz", 20_000), "more than 10000 entries"),
    ]
    spaces = snapshot(host.data_dir / "spaces")
    peaks = peak_rss(host)
    for path, words in bombs:
        assert path.stat().st_size < 200_000
        r = host.deploy("o/hdr", path.read_bytes(), path.name)
        assert r.status_code == 422 and len(r.content) < 1000, r.text[:300]
        assert b"/tmp" not in r.content and str(host.data_dir).encode() not in r.content
        assert words in r.json()["error"]
    assert snapshot(host.data_dir / "spaces") == spaces
    assert not any((host.data_dir / "staging").iterdir())
    after = peak_rss(host)
    assert after.keys() == peaks.keys(), "a worker died"
    for pid, peak in after.items():
        assert peak - peaks[pid] <= 4 * cap, f"worker {pid} peak RSS grew {peak - peaks[pid]} B"
    assert host.get("/s/o/hdr/").text == "v1"
