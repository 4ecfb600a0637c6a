"""Small ONNX models built for the inference protocol's tests, with the `onnx` package."""

from __future__ import annotations

import itertools

import numpy as np
from onnx import TensorProto, helper, numpy_helper

# Every datatype of the protocol, with the ONNX element type that carries it.
ELEMENTS = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}


def _model(graph: helper.GraphProto) -> bytes:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what onnxruntime 1.17 and later all read
    return model.SerializeToString()


def identities() -> bytes:
    """One Identity per datatype: input `in_<TYPE>` of shape [-1, 3] gives `out_<TYPE>`."""
    inputs, outputs, nodes = [], [], []
    for name, element in ELEMENTS.items():
        inputs.append(helper.make_tensor_value_info(f"in_{name}", element, ["rows", 3]))
        outputs.append(helper.make_tensor_value_info(f"out_{name}", element, ["rows", 3]))
        nodes.append(helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]))
    return _model(helper.make_graph(nodes, "identities", inputs, outputs))


def add(value: float, width: int = 4) -> bytes:
    """Y = X + value, X of shape [-1, width] FP32: a model whose answer says its version."""
    constant = numpy_helper.from_array(np.full((width,), value, dtype=np.float32), "c")
    node = helper.make_node("Add", ["X", "c"], ["Y"])
    graph = helper.make_graph(
        [node],
        "add",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, width])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, width])],
        [constant],
    )
    return _model(graph)


def matmul(k: int = 256, m: int = 320, seed: int = 0, fixed_rows: int | None = None) -> bytes:
    """Y = X @ W + B, X of shape [rows, k] FP32 and W a (k, m) initializer of random
    normals: a weight-bound model, large enough (k·m·4 bytes) to be mapped and prepacked.
    `fixed_rows` fixes X's first dimension (a model that cannot be batched)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, m), dtype=np.float32)
    b = rng.standard_normal(m, dtype=np.float32)
    rows = fixed_rows if fixed_rows is not None else "rows"
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["H"]), helper.make_node("Add", ["H", "B"], ["Y"])],
        "matmul",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [rows, m])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    return _model(graph)


def chain(k: int = 512, depth: int = 100, seed: int = 0) -> bytes:
    """Y = X @ W @ W ... (`depth` times), X of shape [rows, k] FP32 and W one orthogonal
    (k, k) initializer: a model whose run is slow for its small weights and input, and
    whose values keep their size however deep."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((k, k)))
    names = ["X", *(f"H{i}" for i in range(1, depth)), "Y"]
    nodes = [helper.make_node("MatMul", [a, "W"], [b]) for a, b in itertools.pairwise(names)]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", k])],
        [numpy_helper.from_array(q.astype(np.float32), "W")],
    )
    return _model(graph)
