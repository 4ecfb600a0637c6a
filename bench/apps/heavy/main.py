"""A CPU-bound space for the scaling scenario: the onnx-tiny model on 2,000 rows a call."""

from pathlib import Path

import numpy as np
import onnxruntime as ort

HERE = Path(__file__).resolve().parent
options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.inter_op_num_threads = 1
session = ort.InferenceSession(
    str(HERE / "model.onnx"), options, providers=["CPUExecutionProvider"]
)
BATCH = np.random.default_rng(0).uniform(0, 16, (2000, 64)).astype(np.float32)


async def handle(request):
    labels, _ = session.run(None, {"X": BATCH})
    return {"rows": len(labels), "first": int(labels[0])}
