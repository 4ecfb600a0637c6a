"""polyserve.serve.modelspace in one process: where session.run runs, and what an answer carries."""

from __future__ import annotations

import asyncio
import sys
import threading

import numpy as np
import onnxruntime as ort
import orjson

from polyserve.serve.modelspace import InferenceApp, Model
from polyserve.serve.placement import INLINE_S, SLOW_RUNS
from polyserve.serve.protocol import TensorSpec
from polyserve.serve.routes import parse
from tests.helpers import REPO
from tests.onnx_models import add

sys.path.insert(0, str(REPO / "bench"))
import matmul  # bench/matmul.py builds the weight-bound model


def session(model: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def recording_app(model: bytes, width: int) -> tuple[InferenceApp, list[int]]:
    """An app whose pre() notes the thread each run happens on."""
    threads: list[int] = []

    def pre(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        threads.append(threading.get_ident())
        return inputs

    spec = [TensorSpec("X", "FP32", (-1, width))]
    return InferenceApp(Model(session(model), pre=pre, inputs=spec)), threads


def infer(app: InferenceApp, rows: int, width: int) -> dict:
    x = np.ones((rows, width), np.float32)
    body = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "X",
                    "shape": [rows, width],
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }
    )

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    route = parse("/v2/models/m/infer", "POST", 1)
    found = asyncio.run(app.respond(scope, receive, route, 1 << 26))
    assert found.status == 200, found.body
    return orjson.loads(found.body)


def test_a_fast_model_runs_on_the_event_loop_thread():
    app, threads = recording_app(add(1.0), 4)
    for _ in range(20):
        assert infer(app, 1, 4)["outputs"][0]["data"] == [2.0] * 4
    assert set(threads) == {threading.get_ident()}
    # Not `slow == 0`: one run slowed by a busy core counts as slow, and is meant to
    # change nothing; the next run stays on the loop all the same.
    assert app._place.inline


def test_a_slow_model_moves_to_the_spaces_threads_and_one_slow_run_does_not():
    slow, threads = recording_app(matmul.model(2048, 2048), 2048)
    for _ in range(12):
        infer(slow, 64, 2048)
    assert threads[-1] != threading.get_ident(), "a model slower than INLINE_S left on the loop"
    fast, fast_threads = recording_app(add(1.0), 4)
    infer(fast, 1, 4)
    for _ in range(SLOW_RUNS - 1):  # runs that a collection or a busy core slowed down
        fast._place.timed(INLINE_S * 50)
    infer(fast, 1, 4)
    assert set(fast_threads) == {threading.get_ident()}
