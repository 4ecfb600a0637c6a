"""The `batching` scenario's parts: a weight-bound model, its bodies, an in-process check.

The model is bench/matmul.py's 20 MiB MatMul (Y = X @ W + B, X of [rows, 2048]): one row
reads every weight, so a batch of rows costs little more than one. polyserve serves it
twice from one host, as a model space with `[batching]` and as one without; MLServer
serves it with its adaptive batching (`max_batch_size`, `max_batch_time`), through the
same custom runtime as the `inference protocol` scenario.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

import matmul
import numpy as np
from inference import Body

MAX_ROWS = 64


def model_tar(model: bytes, batching: bool) -> bytes:
    """A model space of `model`, with a [batching] table or without."""
    files = {"model.onnx": model}
    if batching:
        files["polyserve.toml"] = f"[batching]\nmax_rows = {MAX_ROWS}\n".encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def body(tmp: Path) -> Body:
    """One row of ones as a binary V2 request (what tritonclient sends by default)."""
    x = np.ones((1, matmul.K), np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "X",
                    "shape": [1, matmul.K],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    data = tmp / "matmul.body"
    data.write_bytes(header + x.tobytes())
    script = tmp / "matmul.lua"
    script.write_text(
        "\n".join(
            [
                f'local f = io.open("{data}", "rb")',
                'wrk.method = "POST"',
                'wrk.body = f:read("*all")',
                "f:close()",
                *(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items()),
            ]
        )
        + "\n"
    )
    return Body(data.read_bytes(), headers, script)


def json_body(tmp: Path) -> Body:
    """The same row as V2 JSON: MLServer's codec has no binary tensors."""
    row = [1.0] * matmul.K
    payload = json.dumps(
        {"inputs": [{"name": "X", "shape": [1, matmul.K], "datatype": "FP32", "data": row}]}
    ).encode()
    data = tmp / "matmul-json.body"
    data.write_bytes(payload)
    script = tmp / "matmul-json.lua"
    script.write_text(
        f'local f = io.open("{data}", "rb")\nwrk.method = "POST"\nwrk.body = f:read("*all")\n'
        'f:close()\nwrk.headers["Content-Type"] = "application/json"\n'
    )
    return Body(payload, {"Content-Type": "application/json"}, script)


def eight_rows(model_path: Path, rounds: int = 5, calls: int = 30) -> dict[str, float]:
    """An 8-row call (best of `rounds` x `calls`, ms) on the session a model space gets
    (onnx_session over its prepacked file) against a plain prepacked session."""
    import onnxruntime as ort

    from polyserve.models import onnx_session, prepacked

    prepacked.PREPARE = True  # build the file as a deploy's validation does
    shared = onnx_session(model_path)
    prepacked.PREPARE = False
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    plain = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    x = {"X": np.ones((8, matmul.K), np.float32)}
    best = {"shared_ms": float("inf"), "plain_ms": float("inf")}
    for _ in range(rounds):
        for name, session in (("shared_ms", shared), ("plain_ms", plain)):
            started = time.perf_counter()
            for _ in range(calls):
                session.run(None, x)
            best[name] = min(best[name], (time.perf_counter() - started) / calls * 1000)
    return {k: round(v, 3) for k, v in best.items()} | {
        "ratio": round(best["shared_ms"] / best["plain_ms"], 3)
    }
