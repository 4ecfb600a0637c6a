"""Unit tests of polyserve.logs.spacelog: what a space says is attributed to it, bounded, echoed."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio.to_thread
import pytest

from polyserve.logs import spacelog
from polyserve.logs.logstore import LogStore
from polyserve.logs.spacelog import MESSAGE_MAX, RUNNING, Channel, Tag


@pytest.fixture
def store(tmp_path: Path) -> LogStore:
    return LogStore(tmp_path / "logs", 1 << 20)


@contextlib.contextmanager
def capturing(store: LogStore) -> Iterator[spacelog.Capture]:
    """start_capture() as a worker does. In the test's body: pytest puts its own sys.stdout in
    place when the test starts, after every fixture."""
    installed = spacelog.start_capture(store, rate=100)
    try:
        yield installed
    finally:
        spacelog.stop_capture(installed)


def records(store: LogStore, space: str) -> list[dict]:
    return store.read(space, 0)[0]


def test_interleaved_tasks_and_threads_of_two_spaces_each_log_as_their_own(store):
    """Twenty requests of two spaces on one event loop, yielding between every line, and
    a thread each (how sync handlers run): every record lands in its own space's log."""
    with capturing(store):
        a, b = spacelog.tag("o/a", 1), spacelog.tag("o/b", 7)
        tenant = logging.getLogger("tenant")

        async def request(tag: Tag, i: int) -> None:
            token = RUNNING.set(tag)
            try:
                for step in range(3):
                    print(f"{tag.space} print {i}.{step}")
                    tenant.info("%s log %d.%d", tag.space, i, step)
                    await asyncio.sleep(0)
                await anyio.to_thread.run_sync(lambda: print(f"{tag.space} thread {i}"))
                try:
                    raise ValueError(f"{tag.space} boom {i}")
                except ValueError as exc:
                    tag.exception(exc, "a test")
            finally:
                RUNNING.reset(token)

        async def main() -> None:
            await asyncio.gather(*(request(t, i) for i in range(10) for t in (a, b)))

        asyncio.run(main())
        for tag in (a, b):
            found = records(store, tag.space)
            assert len(found) == 10 * 8
            assert all(tag.space in r["message"] for r in found), found
            assert {r["version"] for r in found} == {tag.version}
            streams = {(r["stream"], r["level"]) for r in found}
            assert streams == {("stdout", "INFO"), ("logging", "INFO"), ("stderr", "ERROR")}
            assert sum(f"ValueError: {tag.space} boom" in r["message"] for r in found) == 10


def test_what_the_host_writes_and_logs_passes_through_unchanged(store, capsys):
    with capturing(store):
        print("the host speaks")
        sys.stderr.write("host stderr\n")
        assert capsys.readouterr() == ("the host speaks\n", "host stderr\n")
        assert not store.root.exists() or not any(store.root.iterdir())


def test_a_host_record_no_handler_takes_still_goes_to_the_last_resort(store, capsys, monkeypatch):
    # pytest's own handlers are gone while it runs; patched before start_capture() adds its
    # handler, so that restoring the list at teardown does not bring that handler back.
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    with capturing(store):
        logging.getLogger("some.library").warning("library warning")
        logging.getLogger("some.library").info("library info")  # below the last resort's level
        assert capsys.readouterr().err == "library warning\n"


def test_the_echo_to_the_host_log_names_space_version_and_pid(store, caplog):
    with capturing(store) as capture:
        tag = spacelog.tag("o/echo", 3)
        token = RUNNING.set(tag)
        try:
            print("hello from the space")
        finally:
            RUNNING.reset(token)
        assert f"[space o/echo v3 pid {capture.pid}] hello from the space" in caplog.text


FORGERIES = {
    "a line feed": ("a\n[polyserve] forged", "a\\n[polyserve] forged"),
    "a carriage return": ("b\r[polyserve] forged", "b\\r[polyserve] forged"),
    "an ANSI escape": ("c\x1b[2K\x1b[1G[polyserve] forged", "c\\x1b[2K\\x1b[1G[polyserve] forged"),
    "a C1 CSI": ("d\x9b2K[polyserve] forged", "d\\x9b2K[polyserve] forged"),
    "other controls": ("e\x00\x07\x08\t\x0b\x0c\x7f", "e\\x00\\x07\\x08\\t\\x0b\\x0c\\x7f"),
    "a Unicode line separator": ("f\u2028[polyserve] forged", "f\\u2028[polyserve] forged"),
    "a backslash and non-ASCII": ("g C:\\tmp é ✓", "g C:\\tmp é ✓"),
}


@pytest.mark.parametrize(("said", "echoed"), FORGERIES.values(), ids=FORGERIES.keys())
def test_the_echo_is_one_line_with_controls_escaped_and_the_log_keeps_the_text(
    store, caplog, said, echoed
):
    with capturing(store) as capture:
        tag = spacelog.tag("o/forge", 1)
        token = RUNNING.set(tag)
        try:
            logging.getLogger("tenant").warning(said)
        finally:
            RUNNING.reset(token)
        (record,) = [r for r in caplog.records if r.name == "polyserve.space"]
        assert record.getMessage() == f"[space o/forge v1 pid {capture.pid}] {echoed}"
        assert [r["message"] for r in records(store, "o/forge")] == [said]


def test_an_exception_is_echoed_as_one_line(store, caplog, tmp_path):
    with capturing(store):
        tag = spacelog.tag("o/raise", 1)
        try:
            raise ValueError("boom\n[polyserve] forged")
        except ValueError as exc:
            tag.exception(exc, "a test")
        (line,) = [r.getMessage() for r in caplog.records if r.name == "polyserve.space"]
        assert "\n" not in line and line.startswith("[space o/raise v1 pid ")
        assert "Exception in a test\\nTraceback (most recent call last):\\n" in line
        assert line.endswith("ValueError: boom\\n[polyserve] forged")
        (kept,) = records(store, "o/raise")
        assert kept["message"].endswith("ValueError: boom\n[polyserve] forged")


def test_lines_are_joined_across_writes_and_flush_ends_a_partial_one(store):
    with capturing(store):
        tag = spacelog.tag("o/p", 1)
        token = RUNNING.set(tag)
        try:
            sys.stdout.write("a")
            sys.stdout.write("b\nc")
            assert [r["message"] for r in records(store, "o/p")] == ["ab"]
            print("d", end="", flush=True)
        finally:
            RUNNING.reset(token)
        assert [r["message"] for r in records(store, "o/p")] == ["ab", "cd"]


def test_a_long_line_keeps_its_head_and_tail_with_a_marker(store):
    with capturing(store):
        tag = spacelog.tag("o/long", 1)
        token = RUNNING.set(tag)
        try:
            print("head" + "x" * 50_000 + "tail")
        finally:
            RUNNING.reset(token)
        (record,) = records(store, "o/long")
        message = record["message"]
        assert message.startswith("headx") and message.endswith("xtail")
        assert "characters cut" in message and len(message) < MESSAGE_MAX + 100


def test_the_rate_limit_drops_and_then_counts_what_it_dropped(store):
    now = [0.0]
    store.open("o/noisy")
    channel = Channel("o/noisy", store, rate=10, clock=lambda: now[0])  # a burst of 100
    tag = Tag("o/noisy", 1, channel)
    for i in range(150):
        tag.record(logging.INFO, "stdout", f"line {i}", 0.0)
    found = [r["message"] for r in records(store, "o/noisy")]
    assert found[:100] == [f"line {i}" for i in range(100)]
    assert len(found) == 101 and "over POLYSERVE_LOG_RATE" in found[100]
    now[0] = 1.0  # ten records' worth
    tag.record(logging.INFO, "stdout", "line 150", 0.0)
    found = [r["message"] for r in records(store, "o/noisy")]
    assert found[101:] == [f"50 records dropped: {tag._over_rate()}", "line 150"]


def test_an_exception_shows_the_spaces_frames_with_paths_relative_to_its_version(tmp_path):
    root = tmp_path / "version"
    root.mkdir()
    (root / "mod.py").write_text("def boom():\n    raise KeyError('missing')\n")
    spec = importlib.util.spec_from_file_location("mod_for_spacelog", root / "mod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen: list[str] = []
    tag = Tag("o/x", 2, None, root.resolve())
    tag._emit = lambda level, stream, message, created: seen.append(message)  # type: ignore[method-assign]
    try:
        module.boom()
    except KeyError as exc:
        tag.exception(exc, "GET /s/o/x/")
    (message,) = seen
    assert message.startswith("Exception in GET /s/o/x/\nTraceback (most recent call last):")
    assert 'File "mod.py", line 2, in boom' in message and message.endswith("KeyError: 'missing'")
    assert "test_spacelog.py" not in message and str(tmp_path) not in message


def test_stop_capture_puts_back_the_streams_and_the_root_logger(store):
    before = (sys.stdout, sys.stderr, logging.getLogger().level, list(logging.getLogger().handlers))
    spacelog.stop_capture(spacelog.start_capture(store, rate=100))
    after = (sys.stdout, sys.stderr, logging.getLogger().level, list(logging.getLogger().handlers))
    assert after == before
