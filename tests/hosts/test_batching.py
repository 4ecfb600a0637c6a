"""Batching on a real host: concurrent infers of a model space, and a `batched` handle()."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
import onnxruntime as ort

from tests.helpers import HostProcess, make_tar, metrics_histogram, module_host, until
from tests.onnx_models import chain, matmul

host = module_host("host", workers=1)

K = 256
MODEL = matmul(K, 320)
BATCHING = "[batching]\nmax_rows = 64\n"


def concurrently(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run every call at once, each on a thread of its own, released together."""
    results: list[Any] = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        start.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def infer(host: HostProcess, space: str, x: np.ndarray) -> httpx.Response:
    body = {
        "inputs": [
            {"name": "X", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
        ]
    }
    return httpx.post(f"{host.url}/v2/models/{space}/infer", json=body, timeout=60)


def usage(host: HostProcess, space: str) -> dict:
    return host.get("/_polyserve/usage").json()["spaces"][space]


def output(answer: httpx.Response) -> np.ndarray:
    assert answer.status_code == 200, answer.text
    (y,) = answer.json()["outputs"]
    return np.asarray(y["data"], dtype=np.float32).reshape(y["shape"])


def inputs(n: int, seed: int = 7) -> list[np.ndarray]:
    """n requests of one to three distinct rows each."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1 + i % 3, K), dtype=np.float32) for i in range(n)]


def test_concurrent_infers_each_get_exactly_their_own_rows(host):
    answer = host.deploy(
        "b/mm", make_tar({"model.onnx": MODEL, "polyserve.toml": BATCHING}), filename="m.tar"
    )
    assert answer.status_code == 200, answer.text
    # The validation built the prepacked weights every worker maps.
    assert list(host.data_dir.rglob(".model.onnx.prepacked-*/model.onnx"))
    xs = inputs(64)
    rows = sum(len(x) for x in xs)
    alone = [output(infer(host, "b/mm", x)) for x in xs]  # one at a time: batches of one
    seen = usage(host, "b/mm")
    assert (seen["requests"], seen["batches"], seen["batch_rows"]) == (64, 64, rows)
    together = [output(a) for a in concurrently([lambda x=x: infer(host, "b/mm", x) for x in xs])]
    seen = usage(host, "b/mm")
    assert seen["requests"] == 128 and seen["batch_rows"] == 2 * rows
    assert seen["batches"] < 128, "no two concurrent infers shared a batch"
    metrics = host.get("/metrics").text
    assert f'polyserve_space_batches_total{{space="b/mm"}} {seen["batches"]}.0' in metrics
    # Rows per batch: one count per batch run, its sum the rows computed; the 64 alone
    # were batches of one to three rows (buckets 1, 2 and 4).
    sizes = metrics_histogram(host, "polyserve_space_batch_rows", "b/mm")
    assert (sizes["count"], sizes["sum"]) == (seen["batches"], 2 * rows)
    assert sizes["+Inf"] == seen["batches"] and sizes["4"] >= 64
    # Time queued: one count per call, each infer one call.
    queued = metrics_histogram(host, "polyserve_space_batch_queue_seconds", "b/mm")
    assert queued["count"] == queued["+Inf"] == 128 and queued["sum"] > 0
    local = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"])
    for x, one, many in zip(xs, alone, together, strict=True):
        (expected,) = local.run(None, {"X": x})
        assert np.array_equal(many, one), "a batched answer differs from the same rows alone"
        assert np.array_equal(one, expected), "the host's answer differs from onnxruntime's"


def test_a_bad_request_beside_good_ones_gets_its_400_and_they_their_answers(host):
    answer = host.deploy(
        "b/mixed", make_tar({"model.onnx": MODEL, "polyserve.toml": BATCHING}), filename="m.tar"
    )
    assert answer.status_code == 200, answer.text
    xs = inputs(24, seed=3)
    bad = np.ones((1, K + 1), np.float32)  # one column too many: refused before it queues
    calls = [lambda x=x: infer(host, "b/mixed", x) for x in xs] + [
        lambda: infer(host, "b/mixed", bad)
    ]
    *good, refused = concurrently(calls)
    assert refused.status_code == 400 and "X" in refused.json()["error"]
    local = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"])
    for x, a in zip(xs, good, strict=True):
        assert np.array_equal(output(a), local.run(None, {"X": x})[0])


def test_a_model_without_a_dynamic_first_axis_cannot_be_batched(host):
    fixed = matmul(K, 320, fixed_rows=1)
    answer = host.deploy(
        "b/fixed", make_tar({"model.onnx": fixed, "polyserve.toml": BATCHING}), filename="m.tar"
    )
    assert answer.status_code == 422, answer.text
    assert "'X'" in answer.json()["error"] and "dynamic first dimension" in answer.json()["error"]
    assert host.get("/s/b/fixed/").status_code == 404  # nothing was published
    bad = host.deploy(
        "b/fixed",
        make_tar({"model.onnx": MODEL, "polyserve.toml": "[batching]\nmax_rows = 0\n"}),
        filename="m.tar",
    )
    assert bad.status_code == 422 and "max_rows" in bad.json()["error"]


def cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has spent, all its threads together."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_clients_gone_while_queued_are_never_run_and_those_beside_them_are(host):
    """While a slow batch runs on the space's threads, requests queue behind it: those
    whose clients hang up leave the queue, so the next batch holds only the rows of the
    clients still waiting, which get their answers."""
    model = chain(512, 2000)
    settings = "[batching]\nmax_rows = 512\n"
    answer = host.deploy(
        "b/gone", make_tar({"model.onnx": model, "polyserve.toml": settings}), filename="m.tar"
    )
    assert answer.status_code == 200, answer.text
    for _ in range(3):  # three slow runs in a row: runs move off the loop to its threads
        assert infer(host, "b/gone", np.ones((1, 512), np.float32)).status_code == 200
    before = usage(host, "b/gone")

    def body(x: np.ndarray) -> bytes:
        tensor = {"name": "X", "datatype": "FP32", "shape": list(x.shape)}
        return json.dumps({"inputs": [{**tensor, "data": x.ravel().tolist()}]}).encode()

    def send(x: np.ndarray) -> socket.socket:
        """A whole request on a connection of its own, left open."""
        sock = socket.create_connection(("127.0.0.1", host.port))
        data = body(x)
        head = (
            f"POST /v2/models/b/gone/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        sock.sendall(head.encode() + data)
        return sock

    (worker,) = host.worker_pids()
    spent = cpu_seconds(worker)
    slow = send(np.ones((256, 512), np.float32))  # seconds of work, in one batch
    # Read and running once the worker has spent a fraction of it: what follows queues.
    until(lambda: cpu_seconds(worker) > spent + 0.2, what="the slow batch to run")
    rng = np.random.default_rng(5)
    kept = [rng.standard_normal((2, 512), dtype=np.float32) for _ in range(4)]
    results: list[httpx.Response] = []
    waiting = [
        threading.Thread(target=lambda x=x: results.append(infer(host, "b/gone", x))) for x in kept
    ]
    gone = [send(np.ones((3, 512), np.float32)) for _ in range(4)]
    for t in waiting:
        t.start()
    time.sleep(0.5)  # all of them read and queued behind the slow batch
    for sock in gone:
        sock.close()
    slow.settimeout(120)
    assert slow.recv(12) == b"HTTP/1.1 200"
    slow.close()
    for t in waiting:
        t.join()
    assert [a.status_code for a in results] == [200] * 4, [a.text for a in results]
    after = usage(host, "b/gone")
    ran = after["batch_rows"] - before["batch_rows"]
    assert ran == 256 + 2 * 4, "rows of clients that hung up were run"
    assert after["batches"] - before["batches"] == 2  # the slow one, then those that waited


SPACE = """
import time

import numpy as np

from polyserve.models import batched

VERSION = {version}


@batched(max_rows=16)
def compute(x):
    time.sleep({sleep})  # a slow batch, so that requests queue behind it
    if (x == -1).any():
        raise RuntimeError("a poisoned row")
    return x * 2 + VERSION, np.full(len(x), len(x))


async def handle(request):
    x = np.asarray((await request.json())["x"], dtype=np.float64)
    y, rows = await compute(x)
    return {{"y": y.tolist(), "batch_rows": int(rows[0]), "version": VERSION}}
"""


def call(host: HostProcess, space: str, x: list[list[float]]) -> httpx.Response:
    return httpx.post(f"{host.url}/s/{space}/", json={"x": x}, timeout=60)


def test_a_batched_handle_gets_its_own_rows_of_one_call_for_many(host):
    assert host.deploy("b/py", SPACE.format(version=1, sleep=0.02)).status_code == 200
    xs = [[[float(i), float(i) / 2]] for i in range(48)]
    answers = concurrently([lambda x=x: call(host, "b/py", x) for x in xs])
    sizes = []
    for x, a in zip(xs, answers, strict=True):
        assert a.status_code == 200, a.text
        assert a.json()["y"] == [[v * 2 + 1 for v in x[0]]]
        sizes.append(a.json()["batch_rows"])
    assert max(sizes) > 1, "no two concurrent calls shared a batch"
    # Alone, a call is a batch of its own rows.
    assert call(host, "b/py", [[1.0, 2.0], [3.0, 4.0]]).json()["batch_rows"] == 2
    # The histograms count what ran, across the requests that flushed them: every
    # batch by its rows, every call by its time queued.
    seen = usage(host, "b/py")
    sizes_seen = metrics_histogram(host, "polyserve_space_batch_rows", "b/py")
    assert sizes_seen["count"] == seen["batches"] and sizes_seen["sum"] == 48 + 2
    assert sizes_seen["1"] < seen["batches"]  # batches of more than one row
    queued = metrics_histogram(host, "polyserve_space_batch_queue_seconds", "b/py")
    assert queued["count"] == seen["requests"] == 49


def test_a_batch_that_raises_fails_its_callers_only_and_the_next_batch_runs(host):
    assert host.deploy("b/poison", SPACE.format(version=1, sleep=0.02)).status_code == 200
    xs = [[[float(i)]] for i in range(40)]
    xs[5] = [[-1.0]]
    answers = concurrently([lambda x=x: call(host, "b/poison", x) for x in xs])
    assert answers[5].status_code == 500
    failed = [a for a in answers if a.status_code != 200]
    assert all(a.status_code == 500 for a in failed)
    assert len(failed) <= 16, "more requests failed than one batch holds"
    for x, a in zip(xs, answers, strict=True):
        if a.status_code == 200:
            assert a.json()["y"] == [[x[0][0] * 2 + 1]]
    assert call(host, "b/poison", [[2.0]]).json()["y"] == [[5.0]]


def test_a_hot_swap_while_requests_queue_answers_each_with_the_version_that_ran_it(host):
    assert host.deploy("b/swap", SPACE.format(version=1, sleep=0.05)).status_code == 200
    assert call(host, "b/swap", [[0.0]]).status_code == 200  # loaded
    xs = [[[float(i)]] for i in range(32)]

    def swap() -> httpx.Response:
        return host.deploy("b/swap", SPACE.format(version=2, sleep=0.05))

    *answers, swapped = concurrently([lambda x=x: call(host, "b/swap", x) for x in xs] + [swap])
    assert swapped.status_code == 200, swapped.text
    # A batch runs one version: every answer is computed by the version it names.
    for x, a in zip(xs, answers, strict=True):
        assert a.status_code == 200, a.text
        version = a.json()["version"]
        assert a.json()["y"] == [[x[0][0] * 2 + version]]
    after = call(host, "b/swap", [[1.0]]).json()
    assert (after["version"], after["y"]) == (2, [[4.0]])
