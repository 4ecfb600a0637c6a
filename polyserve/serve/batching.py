"""Dynamic batching: concurrent calls of one function merged into one call along the rows.

A `Batcher` owns a queue of calls. The first call to arrive when nothing runs starts a
batch at once, so a lone request never waits for company (unless `max_delay_us` asks it
to); calls that arrive while a batch runs form the next one. A batch takes queued calls
in order while their rows fit in `max_rows` and their inputs agree on everything but the
first axis (the datatype and the other dimensions of each input); a call with more rows
than `max_rows` runs alone. Each caller gets the rows of the outputs that its own inputs
made, sliced out of the batch's outputs.

A call that fails fails only its own batch: every caller in it gets the exception, and
the next batch runs. A caller cancelled while queued (its deadline, or its client gone)
leaves the queue; once its batch runs, its rows are computed and dropped.

One batch runs at a time per batcher, where its Placement puts it: on the space's
threads, so the loop keeps reading requests into the next batch, or, for a model
space's short batches, on the loop. An async batch function runs on the loop.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import tomllib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from polyserve.http.cycle import Cycle
from polyserve.logs import spacelog
from polyserve.serve.placement import Placement

MANIFEST = "polyserve.toml"
MAX_ROWS_LIMIT = 1 << 20  # a bound on the setting itself, so a typo cannot ask for more

Arrays = Sequence[np.ndarray]
F = TypeVar("F", bound=Callable[..., Any])


class ClientGone(Exception):
    """A queued call's client disconnected: its rows leave the queue."""


class BatchingError(ValueError):
    """A `[batching]` table, or a model, that cannot be batched as asked."""


@dataclass(frozen=True)
class Batching:
    """How a function's calls are merged: rows per call, and how long a batch may wait."""

    max_rows: int = 64
    max_delay_us: int = 0

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_delay_us"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise BatchingError(f"[batching] {name} must be a whole number, not {value!r}")
        if not 1 <= self.max_rows <= MAX_ROWS_LIMIT:
            raise BatchingError(f"[batching] max_rows must be 1 to {MAX_ROWS_LIMIT}")
        if not 0 <= self.max_delay_us <= 1_000_000:
            raise BatchingError("[batching] max_delay_us must be 0 to 1000000 (one second)")


def read_batching(root: Path) -> Batching | None:
    """The `[batching]` table of a version's polyserve.toml, or None without one. The
    upload's checks already read the file as TOML; this one checks the table."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    table = tomllib.loads(path.read_text("utf-8")).get("batching")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise BatchingError("[batching] must be a table: max_rows = 64, max_delay_us = 0")
    unknown = sorted(set(table) - {"max_rows", "max_delay_us"})
    if unknown:
        raise BatchingError(
            f"[batching] has no setting {unknown[0]!r}: it takes max_rows and max_delay_us"
        )
    return Batching(**table)


class _Call:
    """One caller's inputs, where its rows go, and the key its batch must share."""

    __slots__ = ("arrays", "future", "gone", "key", "queued_at", "rows")

    def __init__(self, arrays: Arrays, rows: int, future: asyncio.Future[Any]) -> None:
        self.arrays = arrays
        self.rows = rows
        self.key = tuple((a.dtype.str, a.shape[1:]) for a in arrays)
        self.future = future
        self.queued_at = time.monotonic_ns()  # its time in the queue runs from here
        # Whether its client has gone, asked before each batch (polyserve's own HTTP
        # cycle tells without a wait); None: nobody asks.
        self.gone: Callable[[], bool] | None = None


class Batcher:
    """Merges concurrent calls of `run` (arrays in, arrays out, rows along the first
    axis). `run` takes the merged inputs and gives its outputs as a sequence of arrays,
    each with one row per input row; `place` says where a sync `run` runs.

    A batch that `place` keeps on the event loop blocks it, as an unbatched model
    space's short run does: requests that arrive meanwhile wait in their sockets and
    form the next batch all the same."""

    def __init__(
        self,
        run: Callable[[list[np.ndarray]], Sequence[np.ndarray]]
        | Callable[[list[np.ndarray]], Awaitable[Sequence[np.ndarray]]],
        batching: Batching,
        *,
        place: Placement | None = None,
    ) -> None:
        self._run = run
        self._async = inspect.iscoroutinefunction(run)
        self.max_rows = batching.max_rows
        self.delay = batching.max_delay_us / 1e6
        self._place = place if place is not None else Placement(1, inline_s=0)
        self._queue: deque[_Call] = deque()
        self._queued_rows = 0
        self._filled: asyncio.Event | None = None  # set when a waiting batch is full
        self._drainer: asyncio.Task[None] | None = None  # held: the loop keeps weak references
        self.batches = 0  # calls of `run` made

    async def submit(
        self, arrays: Arrays, receive: Callable[[], Awaitable[Any]] | None = None
    ) -> list[np.ndarray]:
        """The outputs for these inputs' rows, computed with the rows queued beside them.
        With the request's ASGI `receive` (its body read), a client that goes away while
        its call is queued behind a running batch takes the call out of the queue:
        ClientGone. polyserve's own HTTP cycle is asked before each batch, so the call
        ends when the batch before it does; another server's receive() is watched, so
        the call ends at once."""
        rows = rows_of(arrays)
        loop = asyncio.get_running_loop()
        call = _Call(arrays, rows, loop.create_future())
        self._queue.append(call)
        self._queued_rows += rows
        if self._filled is not None and self._queued_rows >= self.max_rows:
            self._filled.set()
        # Behind a running batch, or the start of one. A drain's last step ends it
        # without a yield, so a drain not done yet still takes what is queued.
        queued = self._drainer is not None and not self._drainer.done()
        if not queued:
            self._drainer = loop.create_task(self._drain())
        try:
            # Only a call that waits behind a batch watches its client: a lone call
            # starts at once, and a watcher would cost it more than it could save.
            if receive is None or not queued:
                return await call.future
            call.gone = _gone(receive)
            if call.gone is not None:  # asked before each batch: no task, no wait
                return await call.future
            return await self._unless_gone(call, receive)
        except (asyncio.CancelledError, ClientGone):
            self._leave(call)
            raise

    async def _unless_gone(
        self, call: _Call, receive: Callable[[], Awaitable[Any]]
    ) -> list[np.ndarray]:
        """The call's answer, unless its client disconnects first. Once the body is read,
        the server's receive() returns only when the connection ends."""
        watcher = asyncio.ensure_future(receive())
        try:
            await asyncio.wait((call.future, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not watcher.done():
                watcher.cancel()
        if not call.future.done() and watcher.result().get("type") == "http.disconnect":
            raise ClientGone("the client went away while its request was queued")
        return await call.future

    def _leave(self, call: _Call) -> None:
        if call in self._queue:  # not yet in a batch: its rows are never run
            self._queue.remove(call)
            self._queued_rows -= call.rows

    async def _drain(self) -> None:
        """Run batches until the queue is empty; each takes what queued while the last ran."""
        while self._queue:
            if self.delay and self._queued_rows < self.max_rows:
                await self._wait_to_fill()
            elif self._place.inline and not self._async:
                # A batch on the loop blocks it: first let the requests it has read
                # already (their tasks are ready) reach the queue.
                await asyncio.sleep(0)
            self._drop_gone()
            batch = self._take() if self._queue else None
            if batch:
                await self._run_batch(batch)

    async def _wait_to_fill(self) -> None:
        self._filled = asyncio.Event()
        try:
            await asyncio.wait_for(self._filled.wait(), self.delay)
        except TimeoutError:
            pass
        finally:
            self._filled = None

    def _drop_gone(self) -> None:
        """Take the calls whose clients went away out of the queue: their rows never run."""
        for call in [c for c in self._queue if c.gone is not None and c.gone()]:
            self._queue.remove(call)
            self._queued_rows -= call.rows
            if not call.future.done():
                call.future.set_exception(
                    ClientGone("the client went away while its request was queued")
                )

    def _take(self) -> list[_Call]:
        """The next batch: the first queued call, and the calls after it that share its
        key while their rows fit. A call with more rows than max_rows goes alone."""
        first = self._queue.popleft()
        batch, rows, left = [first], first.rows, deque[_Call]()
        while self._queue and rows < self.max_rows:
            call = self._queue.popleft()
            if call.key == first.key and rows + call.rows <= self.max_rows:
                batch.append(call)
                rows += call.rows
            else:
                left.append(call)
        left.extend(self._queue)
        self._queue = left
        self._queued_rows -= rows
        return [call for call in batch if not call.future.done()]

    async def _run_batch(self, batch: list[_Call]) -> None:
        total = sum(call.rows for call in batch)
        self.batches += 1
        tag = spacelog.RUNNING.get()  # the version whose request started this drain
        if tag is not None:  # the histograms' counts, which dispatch meters
            tag.batched.ran(total, batch, time.monotonic_ns())
        try:  # whatever fails here fails this batch's callers, never the drain
            if len(batch) == 1:
                merged = list(batch[0].arrays)
            else:
                inputs = range(len(batch[0].arrays))
                merged = [np.concatenate([call.arrays[i] for call in batch]) for i in inputs]
            if self._async:
                outputs = await self._run(merged)  # type: ignore[misc]
            else:
                outputs = await self._place.run(self._run, merged)
            outputs = list(outputs)
            for out in outputs:
                if np.ndim(out) == 0 or len(out) != total:
                    raise ValueError(
                        f"the batched function gave {np.shape(out)} for {total} rows: each"
                        " output must have one row per input row"
                    )
        except Exception as exc:
            for call in batch:
                if not call.future.done():
                    call.future.set_exception(exc)
            return
        start = 0
        for call in batch:
            end = start + call.rows
            if not call.future.done():
                call.future.set_result([out[start:end] for out in outputs])
            start = end


def _gone(receive: Callable[[], Awaitable[Any]]) -> Callable[[], bool] | None:
    """Whether the client of polyserve's own HTTP cycle has gone, read from the cycle
    without awaiting its receive(); None for another server's receive."""
    cycle = getattr(receive, "__self__", None)
    if isinstance(cycle, Cycle):
        return lambda: cycle.disconnected
    return None


def rows_of(arrays: Arrays) -> int:
    """The rows of a call: the first axis, the same for every input."""
    if not arrays:
        raise ValueError("a batched call takes at least one array")
    rows = set()
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.ndim == 0:
            raise ValueError("a batched call takes arrays with rows along the first axis")
        rows.add(a.shape[0])
    if len(rows) > 1:
        raise ValueError(f"the inputs of a batched call disagree on their rows: {sorted(rows)}")
    return rows.pop()


def batched(max_rows: int = 64, max_delay_us: int = 0) -> Callable[[F], F]:
    """Merge concurrent calls of a function from arrays to arrays into one call.

    The function takes arrays with rows along the first axis and gives an array, a tuple
    or a dict of arrays with one row per input row. Each caller awaits its own rows,
    computed in one call with the rows of the callers waiting beside it. A sync function
    runs off the event loop, on a thread of its own; an async one runs on the loop.
    """
    settings = Batching(max_rows, max_delay_us)

    def decorate(fn: F) -> F:
        shapes: dict[str, Any] = {}  # how the function's result is laid out
        batchers: dict[asyncio.AbstractEventLoop, Batcher] = {}
        is_async = inspect.iscoroutinefunction(fn)

        def flat(result: Any) -> list[np.ndarray]:
            if isinstance(result, dict):
                shapes["form"] = ("dict", list(result))
                return [np.asarray(v) for v in result.values()]
            if isinstance(result, tuple):
                shapes["form"] = ("tuple", len(result))
                return [np.asarray(v) for v in result]
            shapes["form"] = ("array", 1)
            return [np.asarray(result)]

        if is_async:

            async def run_async(merged: list[np.ndarray]) -> list[np.ndarray]:
                return flat(await fn(*merged))

            run: Any = run_async
        else:

            def run_sync(merged: list[np.ndarray]) -> list[np.ndarray]:
                return flat(fn(*merged))

            run = run_sync

        async def call(*arrays: Any) -> Any:
            loop = asyncio.get_running_loop()
            batcher = batchers.get(loop)
            if batcher is None:
                batchers.clear()  # a loop of the past (a test's) holds nothing we need
                batcher = batchers[loop] = Batcher(run, settings)
            outputs = await batcher.submit([np.asarray(a) for a in arrays])
            kind, names = shapes["form"]
            if kind == "dict":
                return dict(zip(names, outputs, strict=True))
            if kind == "tuple":
                return tuple(outputs)
            return outputs[0]

        call.__name__ = getattr(fn, "__name__", "batched")
        call.__doc__ = fn.__doc__
        call.__wrapped__ = fn  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return decorate
