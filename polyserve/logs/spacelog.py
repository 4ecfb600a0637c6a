"""What a space says (logging, print, exceptions): attributed to it, kept, echoed to the host log.

A context variable, RUNNING, names the space version whose code is running: dispatch
sets it around each request, the loader around an import and the lifespan. Tasks a
space starts inherit it, and anyio copies it into the threads that run sync handlers,
so attribution holds with many spaces interleaved in one worker. Under the gunicorn
master, `start_capture` replaces sys.stdout and sys.stderr by streams that route a write by
that variable (the host's own writes pass through unchanged) and adds a handler to the
root logger; every record of a space is then written to its log (polyserve.logs.logstore)
as it was said, and echoed to the host's log as one line,
``[space owner/name v3 pid 1234] message``, with line breaks and control characters
escaped.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TextIO, cast

import orjson

from polyserve.logs.logstore import LogStore
from polyserve.usage.meter import BatchCounts

RUNNING: ContextVar[Tag | None] = ContextVar("polyserve_space", default=None)
MESSAGE_MAX = 8192  # characters of one record's message; longer ones lose their middle
BURST_SECONDS = 10  # a space may log this many seconds' worth of its rate at once
HOST = logging.getLogger("polyserve.space")  # the echo: gunicorn's error log in a worker
_ECHO = "[space %s v%d pid %d] %s"
# What may not reach the host's log as it is: C0 controls (line breaks, tab, ESC), DEL,
# C1 controls (which some terminals read as ESC [) and Unicode's line and paragraph
# separators. A record's echo is then one line that starts with its tag, however the
# space words it: it cannot end a line early, forge the next one, or rewrite its own.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

_busy = threading.local()  # set while a record is written: what that writes is the host's
_capture: Capture | None = None


class Channel:
    """One space's records from this worker: the rate limit, then its log on disk."""

    def __init__(
        self,
        space: str,
        store: LogStore | None,
        rate: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.space = space
        self.store = store
        self.rate = rate
        self.burst = max(rate * BURST_SECONDS, 1.0)
        self.clock = clock
        self.lock = threading.Lock()  # threads of one space log at once
        self.tokens = self.burst
        self.last = clock()
        self.dropped = 0
        self.failing = False  # the last write to its log failed (said once per run)

    def admit(self) -> tuple[bool, int]:
        """Whether one more record fits the rate (a token bucket), and how many were
        dropped before it (when it fits) or so far (when it does not)."""
        with self.lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens >= 1:
                self.tokens -= 1
                dropped, self.dropped = self.dropped, 0
                return True, dropped
            self.dropped += 1
            return False, self.dropped


class Tag:
    """One imported version of a space: what RUNNING holds while its code runs."""

    def __init__(
        self, space: str, version: int, channel: Channel | None, root: Path | None = None
    ) -> None:
        self.space = space
        self.version = version
        self.channel = channel  # None outside a worker (tests, the validator): echo only
        self.root = f"{root}{os.sep}" if root is not None else None  # the version's files
        self.partial: dict[str, str] = {}  # per stream: a line not yet ended
        self.cut: set[str] = set()  # streams whose last line was sent on before its end
        self.lock = threading.Lock()
        # The runs its batchers made (polyserve.serve.batching), their rows and their
        # calls' time queued, not yet metered: the tag is the one object of a version
        # its tasks all reach, and dispatch moves these into the worker's row after
        # each request.
        self.batched = BatchCounts()

    # -- what the space says -----------------------------------------------------

    def write(self, stream: str, text: str) -> None:
        """What the space wrote to sys.stdout or sys.stderr: one record per line."""
        with self.lock:
            lines = (self.partial.pop(stream, "") + text).split("\n")
            rest = lines.pop()
            if stream in self.cut:  # a line already sent on: its end is no new line
                self.cut.discard(stream)
                if lines and not lines[0]:
                    del lines[0]
            if len(rest) > 4 * MESSAGE_MAX:  # no newline in sight: keep memory bounded
                lines.append(rest)
                self.cut.add(stream)
            elif rest:
                self.partial[stream] = rest
        level = logging.INFO if stream == "stdout" else logging.WARNING
        now = time.time()
        for line in lines:
            self.record(level, stream, line.removesuffix("\r"), now)

    def flush(self, stream: str) -> None:
        """print(..., flush=True) ends a partial line's wait."""
        with self.lock:
            rest = self.partial.pop(stream, "")
        if rest:
            level = logging.INFO if stream == "stdout" else logging.WARNING
            self.record(level, stream, rest, time.time())

    def exception(self, exc: BaseException, where: str) -> None:
        """An exception the space raised, with its traceback from the space's first frame
        on (the host's frames that called it say nothing to its owner), and the paths of
        the version's files relative to it."""
        tb = exc.__traceback__
        if self.root is not None:
            while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(self.root):
                tb = tb.tb_next
        text = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
        if self.root is not None:
            text = text.replace(self.root, "")
        message = f"Exception in {where}\n{text.rstrip()}"
        self.record(logging.ERROR, "stderr", message, time.time())

    def record(self, level: int, stream: str, message: str, created: float) -> None:
        """Keep one record (within the space's rate) and echo it to the host's log."""
        _busy.active = True
        try:
            channel = self.channel
            if channel is not None:
                admitted, dropped = channel.admit()
                if not admitted:
                    if dropped == 1:  # the first of a run: say so once, now
                        self._emit(logging.WARNING, "logging", self._over_rate(), created)
                    return
                if dropped:
                    note = f"{dropped} records dropped: {self._over_rate()}"
                    self._emit(logging.WARNING, "logging", note, created)
            self._emit(level, stream, message, created)
        except Exception:  # a space's print must never fail because of its log
            logging.getLogger("polyserve").exception("writing a record of %s failed", self.space)
        finally:
            _busy.active = False

    def _over_rate(self) -> str:
        rate = self.channel.rate if self.channel is not None else 0
        return (
            f"over POLYSERVE_LOG_RATE ({rate:g} records a second per worker, after a burst of"
            f" {BURST_SECONDS} seconds' worth): records are dropped until the rate falls"
        )

    def _emit(self, level: int, stream: str, message: str, created: float) -> None:
        message = _bounded(message)
        pid = _capture.pid if _capture is not None else os.getpid()
        channel = self.channel
        if channel is not None and channel.store is not None:
            fields = {
                "time": round(created, 6),
                "level": logging.getLevelName(level),
                "version": self.version,
                "worker": pid,
                "stream": stream,
                "message": message,
            }
            try:
                line = orjson.dumps(fields)
            except TypeError:  # a str with lone surrogates is not UTF-8
                fields["message"] = message.encode("utf-8", "replace").decode()
                line = orjson.dumps(fields)
            try:
                channel.store.append(self.space, line + b"\n")
                channel.failing = False
            except OSError as exc:  # a full disk: the echo below still goes out
                if not channel.failing:
                    channel.failing = True
                    HOST.warning("the log of space %s cannot be written: %s", self.space, exc)
        if HOST.isEnabledFor(level):
            # makeRecord and handle: what HOST.log does, less its search of the stack for
            # a caller that would only ever be this line.
            args = (self.space, self.version, pid, escaped(message))
            HOST.handle(HOST.makeRecord(HOST.name, level, __file__, 0, _ECHO, args, None))


def _bounded(message: str) -> str:
    """At most MESSAGE_MAX characters: the head and the tail of a longer one, which keep
    a traceback's first frame and its exception."""
    if len(message) <= MESSAGE_MAX:
        return message
    head, tail = MESSAGE_MAX // 4, MESSAGE_MAX * 3 // 4
    cut = len(message) - head - tail
    return f"{message[:head]} … [{cut} characters cut] … {message[-tail:]}"


def escaped(message: str) -> str:
    r"""The message as one line a reader recognizes: a line feed as the two characters
    `\n` (and `\r`, `\t`), any other control as `\x1b`, `\x9b`, `\u2028`, … Backslashes
    themselves stay as they are."""
    if message.isprintable():  # most records: no control in them
        return message
    message = message.replace("\n", "\\n")  # a traceback's many, without a call each
    return message if message.isprintable() else _CONTROLS.sub(_escape, message)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def tag(space: str, version: int, root: Path | None = None) -> Tag:
    """The Tag a version imported from `root` speaks under (its channel once installed)."""
    capture = _capture
    return Tag(space, version, capture.channel(space) if capture is not None else None, root)


# -- the capture: sys.stdout, sys.stderr and the root logger --------------------------


class _Stream:
    """sys.stdout or sys.stderr: a space's writes become its records, the rest pass on."""

    def __init__(self, real: TextIO, name: str) -> None:
        self.real = real
        self.name = name

    def write(self, text: str) -> int:
        running = RUNNING.get()
        if running is None or getattr(_busy, "active", False):
            return self.real.write(text)
        running.write(self.name, text)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        running = RUNNING.get()
        if running is not None and not getattr(_busy, "active", False):
            running.flush(self.name)
        self.real.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, …
        return getattr(self.real, name)


class _RootHandler(logging.Handler):
    """On the root logger: a space's records become its own; any other record goes on
    as if this handler were not there."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.formatter = logging.Formatter("%(message)s")

    def handle(self, record: logging.LogRecord) -> bool:
        # No handler lock: Tag.record is thread-safe, and the lock would make every
        # space's logging wait for every other's file write.
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        running = RUNNING.get()
        if running is None or getattr(_busy, "active", False):
            self._pass_on(record)
            return
        try:
            message = self.format(record)
        except Exception:  # a space's bad format string: say what was logged anyway
            message = f"{record.msg!r} % {record.args!r}"
        running.record(record.levelno, "logging", message, record.created)

    def _pass_on(self, record: logging.LogRecord) -> None:
        """Before this handler, a record that no handler took went to logging's last
        resort (WARNING and up, to stderr); it still does."""
        last = logging.lastResort
        if last is None or record.levelno < last.level:
            return
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return
            logger = logger.parent if logger.propagate else None
        last.handle(record)


class Capture:
    """What start_capture() put in place in this process, and each space's channel."""

    def __init__(self, store: LogStore, rate: float) -> None:
        self.store = store
        self.rate = rate
        self.pid = os.getpid()
        self.channels: dict[str, Channel] = {}
        self.lock = threading.Lock()  # imports run on several threads
        self.handler = _RootHandler()
        self.level = logging.WARNING

    def channel(self, space: str) -> Channel:
        with self.lock:
            found = self.channels.get(space)
            if found is None:
                found = self.channels[space] = Channel(space, self.store, self.rate)
        self.store.open(space)
        return found


def start_capture(store: LogStore, rate: float) -> Capture:
    """Capture what spaces say in this process (a worker, after the fork)."""
    global _capture
    capture = Capture(store, rate)
    if sys.stdout is not None:
        sys.stdout = cast(TextIO, _Stream(sys.stdout, "stdout"))
    if sys.stderr is not None:
        sys.stderr = cast(TextIO, _Stream(sys.stderr, "stderr"))
    root = logging.getLogger()
    root.addHandler(capture.handler)
    capture.level = root.level
    # A space's logging.info() is kept: the default WARNING would drop it, and a space
    # cannot configure the shared root logger (basicConfig does nothing once a handler
    # is there). Other records at INFO are dropped by the handler as before.
    root.setLevel(min(root.level, logging.INFO))
    _capture = capture
    return capture


def stop_capture(capture: Capture) -> None:
    """Undo start_capture() (a worker's shutdown, and tests)."""
    global _capture
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _Stream):
            setattr(sys, name, stream.real)
    root = logging.getLogger()
    root.removeHandler(capture.handler)
    root.setLevel(capture.level)
    if _capture is capture:
        _capture = None
