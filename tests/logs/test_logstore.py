"""Unit tests of polyserve.logs.logstore: a space's log segments, bound, cursors, rotation."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import orjson
import pytest

from polyserve.logs.logstore import OPEN_SEGMENT, LogStore

SPACE = "o/s"


def line(message: str, **fields: object) -> bytes:
    return orjson.dumps({"time": 1.0, "level": "INFO", "message": message, **fields}) + b"\n"


@pytest.fixture
def store(tmp_path: Path) -> LogStore:
    s = LogStore(tmp_path / "logs", 1 << 20)
    s.open(SPACE)
    return s


def messages(records: list[dict]) -> list[str]:
    return [r["message"] for r in records]


def read_all(store: LogStore, since: int = 0, limit: int = 1 << 20) -> tuple[list[dict], int]:
    """Every record from `since`, page by page as a client follows `next`."""
    found: list[dict] = []
    while True:
        records, after = store.read(SPACE, since, limit)
        found += records
        if not records:
            return found, after
        since = after


def test_records_come_back_in_order_with_growing_seqs_and_a_cursor(store):
    for i in range(5):
        assert store.append(SPACE, line(f"m{i}"))
    records, after = store.read(SPACE, 0)
    assert messages(records) == [f"m{i}" for i in range(5)]
    seqs = [r["seq"] for r in records]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    assert store.read(SPACE, after) == ([], after)
    store.append(SPACE, line("m5"))
    assert messages(store.read(SPACE, after)[0]) == ["m5"]
    # A seq is a cursor too: from it, that record and what follows.
    assert messages(store.read(SPACE, seqs[3])[0]) == ["m3", "m4", "m5"]


def test_a_cursor_inside_a_record_starts_at_the_next_one(store):
    for i in range(3):
        store.append(SPACE, line(f"m{i}"))
    first, second = (r["seq"] for r in store.read(SPACE, 0)[0][:2])
    for inside in range(first + 1, second):
        assert messages(store.read(SPACE, inside)[0]) == ["m1", "m2"]


def test_a_cursor_past_the_end_answers_nothing_and_the_end(store):
    store.append(SPACE, line("m"))
    _, end = store.read(SPACE, 0)
    assert store.read(SPACE, end + 10_000) == ([], end)


def test_a_space_without_records_answers_nothing(tmp_path):
    store = LogStore(tmp_path / "logs", 4096)
    assert store.read(SPACE, 0) == ([], 0)
    store.open(SPACE)
    assert store.read(SPACE, 0) == ([], 0)


def test_the_log_keeps_its_newest_records_within_its_bound(tmp_path):
    bound = 4096
    store = LogStore(tmp_path / "logs", bound)
    store.open(SPACE)
    sent = [f"record {i:04d} " + "x" * 40 for i in range(1000)]
    for message in sent:
        assert store.append(SPACE, line(message))
    on_disk = sum(p.stat().st_size for p in store.dir(SPACE).iterdir())
    biggest = len(line(sent[0]))
    assert on_disk <= bound + 2 * biggest + 64  # the bound, the records that crossed it, headers
    assert len(list(store.dir(SPACE).glob("*.log"))) == 2
    records, end = read_all(store)
    assert store.read(SPACE, 0) == (records, end)  # one answer holds the whole log
    kept = messages(records)
    # The newest, whole and in order, with nothing missing between them.
    assert kept == sent[-len(kept) :] and len(kept) >= (bound // 2) // biggest


def test_a_client_that_fell_behind_a_rotation_resumes_at_the_oldest_kept(tmp_path):
    store = LogStore(tmp_path / "logs", 2048)
    store.open(SPACE)
    store.append(SPACE, line("first"))
    _, after_first = store.read(SPACE, 0)
    for i in range(200):
        store.append(SPACE, line(f"m{i}"))
    records, _ = store.read(SPACE, after_first)
    assert records[0]["seq"] > after_first and messages(records)[-1] == "m199"


def test_pages_follow_each_other_without_loss_or_repeat(tmp_path):
    store = LogStore(tmp_path / "logs", 1 << 20)
    store.open(SPACE)
    sent = [f"m{i}" for i in range(300)]
    for message in sent:
        store.append(SPACE, line(message))
    pages = 0
    since, found = 0, []
    while records := store.read(SPACE, since, limit=1000)[0]:
        pages += 1
        found += records
        since = store.read(SPACE, since, limit=1000)[1]
    assert messages(found) == sent and pages > 5


def test_a_deleted_spaces_late_records_do_not_bring_its_log_back(store):
    store.append(SPACE, line("before"))
    store.remove(SPACE)
    assert not store.append(SPACE, line("late"))
    assert not store.dir(SPACE).exists()
    assert store.read(SPACE, 0) == ([], 0)


def test_a_segment_left_full_by_a_writer_that_died_is_rotated_by_the_next(tmp_path):
    store = LogStore(tmp_path / "logs", 1024)
    store.open(SPACE)
    store.append(SPACE, line("first"))
    with open(store.dir(SPACE) / OPEN_SEGMENT, "ab") as f:  # full, and nobody rotated it
        f.write(line("x" * 600))
    assert store.append(SPACE, line("after"))
    assert messages(store.read(SPACE, 0)[0]) == ["first", "x" * 600, "after"]


def test_a_line_that_is_not_a_record_is_skipped(store):
    store.append(SPACE, line("one"))
    with open(store.dir(SPACE) / OPEN_SEGMENT, "ab") as f:
        f.write(b'{"time": 1.0, "message": "torn{"time": 2.0}\n[1, 2]\n\xff\n')
    store.append(SPACE, line("two"))
    assert messages(store.read(SPACE, 0)[0]) == ["one", "two"]


def test_a_write_the_disk_took_only_part_of_is_cut_off(store, monkeypatch):
    store.append(SPACE, line("one"))
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:5]))
    with pytest.raises(OSError):
        store.append(SPACE, line("torn"))
    monkeypatch.undo()
    store.append(SPACE, line("two"))
    assert messages(store.read(SPACE, 0)[0]) == ["one", "two"]


def test_a_record_being_written_is_left_for_the_next_read(store):
    store.append(SPACE, line("one"))
    with open(store.dir(SPACE) / OPEN_SEGMENT, "ab") as f:
        f.write(b'{"time": 1.0, "message": "half')
    records, after = store.read(SPACE, 0)
    assert messages(records) == ["one"]
    with open(store.dir(SPACE) / OPEN_SEGMENT, "ab") as f:
        f.write(b' done"}\n')
    assert messages(store.read(SPACE, after)[0]) == ["half done"]


def _writer(root: str, bound: int, who: int, count: int) -> None:
    store = LogStore(Path(root), bound)
    for i in range(count):
        store.append(SPACE, line(f"{who}:{i}", worker=who))


@pytest.mark.parametrize("bound", [1 << 20, 8192])
def test_processes_appending_at_once_lose_and_tear_nothing(tmp_path, bound):
    """Four processes (a host's workers) append to one space's log; with a bound small
    enough to rotate it many times under them."""
    root = tmp_path / "logs"
    LogStore(root, bound).open(SPACE)
    count = 500
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(root), bound, w, count)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    records, _ = read_all(LogStore(root, bound))
    seqs = [r["seq"] for r in records]
    assert seqs == sorted(set(seqs))
    for w in range(4):
        mine = [int(r["message"].split(":")[1]) for r in records if r["worker"] == w]
        # Each writer's records in its own order, none missing from the oldest kept on.
        assert mine == list(range(count - len(mine), count)), (w, mine[:5])
    if bound == 1 << 20:
        assert len(records) == 4 * count
    raw = b"".join(p.read_bytes() for p in sorted(LogStore(root, bound).dir(SPACE).iterdir()))
    assert all(orjson.loads(x) for x in raw.splitlines())  # every line whole


def test_the_store_holds_no_descriptor_between_writes(store):
    before = len(os.listdir("/proc/self/fd"))
    for i in range(50):
        store.append(SPACE, line(f"m{i}"))
    store.read(SPACE, 0)
    assert len(os.listdir("/proc/self/fd")) == before
