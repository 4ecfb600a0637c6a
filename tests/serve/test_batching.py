"""polyserve.serve.batching in one process: how calls merge, and what each caller gets."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polyserve.models import batched
from polyserve.serve.batching import Batcher, Batching, BatchingError, read_batching


class Gate:
    """A batch function that blocks until released, so a test can queue calls behind it."""

    def __init__(self, fail_on: float | None = None) -> None:
        self.release = threading.Event()
        self.calls: list[int] = []
        self.fail_on = fail_on

    def __call__(self, merged: list[np.ndarray]) -> list[np.ndarray]:
        self.calls.append(len(merged[0]))
        if len(self.calls) == 1:
            self.release.wait(10)
        (x,) = merged
        if self.fail_on is not None and (x == self.fail_on).any():
            raise RuntimeError("the batch function failed")
        return [x * 2, x.sum(axis=1)]


def rows(*values: float, width: int = 3) -> np.ndarray:
    return np.array([[v] * width for v in values], dtype=np.float32)


async def until_calls(gate: Gate, n: int) -> None:
    while len(gate.calls) < n:
        await asyncio.sleep(0.001)


def test_calls_that_arrive_while_a_batch_runs_form_the_next_one():
    gate = Gate()

    async def go() -> list[list[np.ndarray]]:
        batcher = Batcher(gate, Batching(max_rows=8))
        first = asyncio.ensure_future(batcher.submit([rows(1)]))
        await until_calls(gate, 1)  # the lone first call ran at once, alone
        queued = [asyncio.ensure_future(batcher.submit([rows(v, v + 0.5)])) for v in (2, 3, 4)]
        await asyncio.sleep(0.01)
        gate.release.set()
        results = await asyncio.gather(first, *queued)
        assert batcher.batches == 2
        return results

    results = asyncio.run(go())
    assert gate.calls == [1, 6]
    np.testing.assert_array_equal(results[0][0], rows(1) * 2)
    for (doubled, summed), v in zip(results[1:], (2, 3, 4), strict=True):
        np.testing.assert_array_equal(doubled, rows(v, v + 0.5) * 2)
        np.testing.assert_array_equal(summed, rows(v, v + 0.5).sum(axis=1))


def test_a_batch_holds_at_most_max_rows_and_a_larger_call_runs_alone():
    gate = Gate()

    async def go() -> None:
        batcher = Batcher(gate, Batching(max_rows=4))
        first = asyncio.ensure_future(batcher.submit([rows(0)]))
        await until_calls(gate, 1)
        calls = [batcher.submit([rows(*range(n))]) for n in (3, 2, 6, 1)]
        queued = [asyncio.ensure_future(c) for c in calls]
        await asyncio.sleep(0.01)
        gate.release.set()
        await asyncio.gather(first, *queued)

    asyncio.run(go())
    # 3 rows and the 1 that fits beside them (the 2 does not), then the 2, then 6 alone.
    assert gate.calls == [1, 4, 2, 6]


def test_calls_whose_other_dimensions_differ_never_share_a_batch():
    gate = Gate()

    async def go() -> list[list[np.ndarray]]:
        batcher = Batcher(gate, Batching(max_rows=64))
        first = asyncio.ensure_future(batcher.submit([rows(0)]))
        await until_calls(gate, 1)
        wide = asyncio.ensure_future(batcher.submit([rows(1, width=5)]))
        narrow = asyncio.ensure_future(batcher.submit([rows(2)]))
        as_ints = asyncio.ensure_future(batcher.submit([rows(3).astype(np.int64)]))
        await asyncio.sleep(0.01)
        gate.release.set()
        return await asyncio.gather(first, wide, narrow, as_ints)

    results = asyncio.run(go())
    assert gate.calls == [1, 1, 1, 1]
    assert results[1][0].shape == (1, 5) and results[3][0].dtype == np.int64


def test_a_failing_batch_fails_its_callers_only_and_the_next_batch_runs():
    gate = Gate(fail_on=13)

    async def go() -> list[object]:
        batcher = Batcher(gate, Batching(max_rows=2))
        first = asyncio.ensure_future(batcher.submit([rows(0)]))
        await until_calls(gate, 1)
        queued = [asyncio.ensure_future(batcher.submit([rows(v)])) for v in (13, 1, 2, 3)]
        await asyncio.sleep(0.01)
        gate.release.set()
        return await asyncio.gather(first, *queued, return_exceptions=True)

    results = asyncio.run(go())
    assert gate.calls == [1, 2, 2]
    failed = [isinstance(r, RuntimeError) for r in results]
    assert failed == [False, True, True, False, False]  # 13 and 1 shared the failing batch
    np.testing.assert_array_equal(results[4][0], rows(3) * 2)  # type: ignore[index]


def test_a_caller_cancelled_while_queued_leaves_the_queue():
    gate = Gate()

    async def go() -> None:
        batcher = Batcher(gate, Batching(max_rows=8))
        first = asyncio.ensure_future(batcher.submit([rows(0)]))
        await until_calls(gate, 1)
        leaving = asyncio.ensure_future(batcher.submit([rows(*range(5))]))
        staying = asyncio.ensure_future(batcher.submit([rows(7)]))
        await asyncio.sleep(0.01)
        leaving.cancel()
        await asyncio.sleep(0)
        gate.release.set()
        await asyncio.gather(first, staying)
        assert leaving.cancelled()

    asyncio.run(go())
    assert gate.calls == [1, 1]  # the cancelled five rows were never run


def test_a_function_that_gives_the_wrong_rows_fails_its_batch():
    async def go() -> None:
        batcher = Batcher(lambda merged: [merged[0][:1]], Batching(max_rows=8))
        with pytest.raises(ValueError, match="one row per input row"):
            await batcher.submit([rows(1, 2)])

    asyncio.run(go())


def test_max_delay_waits_for_company_up_to_its_bound():
    seen: list[int] = []

    async def run(merged: list[np.ndarray]) -> list[np.ndarray]:
        seen.append(len(merged[0]))
        return merged

    async def go() -> None:
        batcher = Batcher(run, Batching(max_rows=3, max_delay_us=200_000))
        # Three calls fill the batch before the delay ends; the fourth waits out the bound.
        await asyncio.gather(*(batcher.submit([rows(v)]) for v in range(4)))

    asyncio.run(go())
    assert seen == [3, 1]


@pytest.mark.parametrize("is_async", [False, True])
def test_batched_merges_calls_and_keeps_the_functions_result_shape(is_async):
    sizes: list[int] = []

    def compute(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        sizes.append(len(x))
        return {"sum": x + y, "max": np.maximum(x, y).max(axis=1)}

    if is_async:

        async def function(x, y):
            return compute(x, y)
    else:

        def function(x, y):
            return compute(x, y)

    f = batched(max_rows=64)(function)

    async def go() -> list[dict[str, np.ndarray]]:
        return await asyncio.gather(*(f(rows(v), rows(10 * v)) for v in range(20)))

    results = asyncio.run(go())
    assert sum(sizes) == 20 and len(sizes) < 20
    for v, got in enumerate(results):
        np.testing.assert_array_equal(got["sum"], rows(11 * v))
        np.testing.assert_array_equal(got["max"], [10 * v])


def test_batched_gives_back_an_array_or_a_tuple_as_the_function_did():
    one = batched()(lambda x: x + 1)
    two = batched()(lambda x: (x, -x))

    async def go() -> tuple[object, object]:
        return await one(rows(1)), await two(rows(2))

    a, b = asyncio.run(go())
    np.testing.assert_array_equal(a, rows(2))  # type: ignore[arg-type]
    assert isinstance(b, tuple) and len(b) == 2
    np.testing.assert_array_equal(b[1], -rows(2))


def test_inputs_that_disagree_on_their_rows_are_refused_before_they_queue():
    f = batched()(lambda x, y: x)

    async def go() -> None:
        with pytest.raises(ValueError, match="disagree on their rows"):
            await f(rows(1, 2), rows(1))

    asyncio.run(go())


def test_the_batching_table_is_read_and_checked(tmp_path: Path):
    assert read_batching(tmp_path) is None
    (tmp_path / "polyserve.toml").write_text("[batching]\nmax_rows = 16\nmax_delay_us = 500\n")
    assert read_batching(tmp_path) == Batching(16, 500)
    for text, said in (
        ("[batching]\nmax_rows = 0\n", "max_rows must be 1"),
        ("[batching]\nmax_rows = 'many'\n", "whole number"),
        ("[batching]\nmax_delay_us = -1\n", "max_delay_us must be 0"),
        ("[batching]\nmax_row = 8\n", "no setting 'max_row'"),
        ("batching = 8\n", "must be a table"),
    ):
        (tmp_path / "polyserve.toml").write_text(text)
        with pytest.raises(BatchingError, match=said):
            read_batching(tmp_path)


def test_a_client_gone_while_queued_takes_its_rows_out_of_the_queue():
    from polyserve.serve.batching import ClientGone

    gate = Gate()

    async def go() -> None:
        gone = asyncio.Event()

        async def receive() -> dict[str, str]:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def stays() -> dict[str, str]:
            await asyncio.Event().wait()  # a client that never leaves
            return {"type": "http.disconnect"}

        batcher = Batcher(gate, Batching(max_rows=8))
        first = asyncio.ensure_future(batcher.submit([rows(0)], stays))
        await until_calls(gate, 1)
        leaving = asyncio.ensure_future(batcher.submit([rows(*range(5))], receive))
        staying = asyncio.ensure_future(batcher.submit([rows(7)], stays))
        await asyncio.sleep(0.01)
        gone.set()
        with pytest.raises(ClientGone):
            await leaving
        gate.release.set()
        (got,) = [await first, await staying][1][:1]
        np.testing.assert_array_equal(got, rows(7) * 2)

    asyncio.run(go())
    assert gate.calls == [1, 1]  # the five rows of the client that left never ran


def test_a_client_gone_from_polyserves_own_cycle_leaves_the_queue_without_a_watcher():
    """Behind a running batch, a call on polyserve's HTTP cycle is not watched by a task
    of its own: the cycle says its client has gone when the next batch is formed, and the
    call's rows never run."""
    from gunicorn.config import Config as GunicornConfig

    from polyserve.http import strict
    from polyserve.serve.batching import ClientGone
    from tests.http.test_cycle import connection

    gate = Gate()
    ended: dict[bytes, object] = {}

    async def go() -> None:
        batcher = Batcher(gate, Batching(max_rows=8))

        async def app(scope: Any, receive: Any, send: Any) -> None:
            body = (await receive())["body"]
            values = [float(v) for v in body.split(b",")]
            try:
                got = await batcher.submit([rows(*values)], receive)
            except ClientGone as exc:
                ended[body] = exc
                return
            ended[body] = got[0]
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        def post(body: bytes) -> Any:
            protocol, _ = connection(strict.protocol(GunicornConfig()), app)
            head = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % len(body)
            protocol.data_received(head + body)
            return protocol

        post(b"0")
        await until_calls(gate, 1)
        leaving = post(b"1,2,3,4,5")
        post(b"7")
        for _ in range(20):
            await asyncio.sleep(0)
        # This one, the three requests and the drain: no watcher task for the queued two.
        assert len(asyncio.all_tasks()) == 5
        leaving.connection_lost(None)
        gate.release.set()
        while len(ended) < 3:
            await asyncio.sleep(0.001)

    asyncio.run(go())
    assert isinstance(ended[b"1,2,3,4,5"], ClientGone)
    np.testing.assert_array_equal(ended[b"7"], rows(7) * 2)
    assert gate.calls == [1, 1]  # the five rows of the client that left never ran
