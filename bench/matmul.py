"""A generated ONNX MatMul model of any size, and a space that serves it (tests and bench).

`model(k, m, seed)`: Y = X @ W + B with W a (k, m) float32 initializer of random
normals (20 MiB for the default 2048 x 2560), built with the `onnx` package of the
`build` extra. `space_tar(model)`: a space whose `GET ?rows=N` runs it on N rows of ones
and answers the sum of Y and the pid of the worker that answered; `shared=False` loads
it as a plain `onnxruntime.InferenceSession` (one copy per worker) instead of with
`polyserve.models.onnx_session`.
"""

from __future__ import annotations

import io
import tarfile

import numpy as np

K, M = 2048, 2560  # W: 20 MiB of float32

SPACE = '''"""A generated MatMul model: GET ?rows=N runs it on N rows of ones."""

import os
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if {shared}:
    from polyserve.models import onnx_session

    session = onnx_session(HERE / "model.onnx")
else:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(
        str(HERE / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )
K = session.get_inputs()[0].shape[1]


async def handle(request):
    rows = int(request.query_params.get("rows", "1"))
    (y,) = session.run(None, {{"X": np.ones((rows, K), np.float32)}})
    return {{"sum": float(y.astype(np.float64).sum()), "pid": os.getpid()}}
'''


def weights(k: int = K, m: int = M, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((k, m), dtype=np.float32), rng.standard_normal(m, dtype=np.float32)


def expected_sum(k: int = K, m: int = M, seed: int = 0, rows: int = 1) -> float:
    """What the space answers for `rows` rows of ones (up to float32 rounding)."""
    w, b = weights(k, m, seed)
    return rows * float(w.astype(np.float64).sum() + b.astype(np.float64).sum())


def model(k: int = K, m: int = M, seed: int = 0) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    w, b = weights(k, m, seed)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["H"]), helper.make_node("Add", ["H", "B"], ["Y"])],
        "matmul",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, m])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built.ir_version = 8  # what onnxruntime 1.17, the oldest the host allows, reads
    return built.SerializeToString()


def space_tar(model_bytes: bytes, shared: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (
            ("main.py", SPACE.format(shared=shared).encode()),
            ("model.onnx", model_bytes),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
