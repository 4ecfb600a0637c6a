"""Warm, in the master, what preloaded modules set up on first use, so forks inherit it."""

from __future__ import annotations

from collections.abc import Callable

# An ONNX model with one Identity node (float[1] -> float[1]), 79 bytes. Made with the
# onnx package (not a host dependency):
#   x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]); y = the same for "y"
#   g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "warm", [x], [y])
#   helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8,
#                     producer_name="polyserve").SerializeToString()
IDENTITY_ONNX = (
    b'\x08\x08\x12\tpolyserve::\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x04warmZ\x0f\n\x01x'
    b"\x12\n\n\x08\x08\x01\x12\x04\n\x02\x08\x01b\x0f\n\x01y\x12\n\n\x08\x08\x01\x12\x04\n"
    b"\x02\x08\x01B\x04\n\x00\x10\r"
)


def _onnxruntime() -> None:
    """onnxruntime builds its environment (logging, kernel registries, the CPU execution
    provider, its allocators) at the first InferenceSession of a process: 6-10 ms here,
    which every fresh worker's first model load paid. One throwaway session in the
    master builds it once. With one thread per pool it starts no thread, so the fork
    stays as safe as importing onnxruntime was. polyserve.models, what model spaces
    load with (docs/models.md), is imported too: a worker's own import of it was half
    of a first onnx-tiny load (~5 ms, most of it compiling where no bytecode is
    written, as under PYTHONDONTWRITEBYTECODE)."""
    import onnxruntime

    import polyserve.models  # noqa: F401

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    onnxruntime.InferenceSession(IDENTITY_ONNX, options, providers=["CPUExecutionProvider"])


# Preloaded module -> its warm-up. A module without one is only imported.
WARMUPS: dict[str, Callable[[], None]] = {"onnxruntime": _onnxruntime}
