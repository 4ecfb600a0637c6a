"""A full disk during a deploy: 507, nothing activated, nothing left behind, v1 serving."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from polyserve import settings
from polyserve.app import create_app
from polyserve.state import store
from tests.helpers import make_tar

V1 = ("main.py", b"def handle(request):\n    return 'v1'\n")
V2 = ("main.py", b"def handle(request):\n    return 'v2'\n")


def client(data: Path) -> TestClient:
    s = settings.load({"POLYSERVE_DATA_DIR": str(data)})
    return TestClient(create_app(s), client=("127.0.0.1", 1))


def deploy(c: TestClient, module: tuple[str, bytes]):
    return c.post("/_polyserve/deploy", data={"space": "o/s"}, files={"module": module})


def assert_v1_only(c: TestClient, data: Path) -> None:
    assert c.get("/s/o/s/").text == "v1"
    assert os.readlink(data / "spaces/o/s/current") == "versions/1"
    assert sorted(p.name for p in (data / "spaces/o/s/versions").iterdir()) == ["1", "1.json"]
    assert not any((data / "staging").iterdir())


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: a real ENOSPC. Needs the right to mount (root, as in CI here)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_real_full_disk_answers_507_and_changes_nothing(tiny_disk):
    data = tiny_disk / "data"
    with client(data) as c:
        assert deploy(c, V1).status_code == 200
        big = make_tar({"main.py": V2[1], "weights.bin": os.urandom(3 << 20)})
        r = deploy(c, ("big.tar", big))
        assert r.status_code == 507 and "disk is full" in r.json()["error"]
        assert_v1_only(c, data)
        assert deploy(c, V2).status_code == 200  # and the disk still works afterwards
        assert c.get("/s/o/s/").text == "v2"


def test_a_full_disk_while_publishing_answers_507_and_activates_nothing(tmp_path, monkeypatch):
    data = tmp_path / "data"
    with client(data) as c:
        assert deploy(c, V1).status_code == 200
        real = store.symlink_atomic

        def full(target, link):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(store, "symlink_atomic", full)  # the very last step fails
        r = deploy(c, V2)
        assert r.status_code == 507
        assert_v1_only(c, data)
        monkeypatch.setattr(store, "symlink_atomic", real)
        assert deploy(c, V2).json()["version"] == 3  # 2 was skipped, never reused
        assert c.get("/s/o/s/").text == "v2"
