"""polyserve.state.files: a file or symlink replaced whole, and nothing left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polyserve.state import files


def test_a_file_is_replaced_whole_and_no_temporary_file_stays(tmp_path):
    target = tmp_path / "f.json"
    target.write_bytes(b"old")
    files.write_atomic(target, b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "f.json"
    target.write_bytes(b"old")

    def failing(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", failing)
    with pytest.raises(OSError):
        files.write_atomic(target, b"new")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.json"]


@pytest.mark.parametrize("fsync", [False, True])
def test_the_bytes_are_synced_only_when_asked(tmp_path, monkeypatch, fsync):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: synced.append(fd) or real(fd))
    files.write_atomic(tmp_path / "f", b"x", fsync=fsync)
    assert len(synced) == (1 if fsync else 0)


def test_a_symlink_is_replaced_in_one_rename(tmp_path):
    link = tmp_path / "current"
    files.symlink_atomic("versions/1", link)
    files.symlink_atomic("versions/2", link)
    assert os.readlink(link) == "versions/2" and sorted(os.listdir(tmp_path)) == ["current"]


def test_the_temporary_name_is_hidden_and_never_a_finished_file(tmp_path):
    """Readers list `*.log` and `*.json`: a leftover temporary file is neither."""
    name = files._beside(Path(tmp_path / "current.log")).name
    assert name.startswith(".") and not name.endswith((".log", ".json"))


def test_a_short_text_is_a_symlinks_target_and_read_from_a_file_too(tmp_path):
    """write_short keeps it in a symlink (no data block to allocate and flush on each
    change); read_short also reads the file an earlier polyserve wrote in its place."""
    mark = tmp_path / "fleet.applied"
    with pytest.raises(FileNotFoundError):
        files.read_short(mark)
    mark.write_text("7 a-token")  # as written before marks were symlinks
    assert files.read_short(mark) == "7 a-token"
    files.write_short(mark, "8 another-token")
    assert mark.is_symlink() and files.read_short(mark) == "8 another-token"
    assert os.listdir(tmp_path) == ["fleet.applied"]
