"""onnx-tiny: a 4 KB digits classifier served in-process with onnxruntime.

GET  /  what the model is, its input shape, and a prediction on a built-in sample.
POST /  {"inputs": [[64 numbers 0..16], ...]} -> labels and class probabilities.
"""

import json
from pathlib import Path

import numpy as np
from starlette.responses import JSONResponse

from polyserve.models import onnx_session

HERE = Path(__file__).resolve().parent
META = json.loads((HERE / "model.json").read_text())
MAX_BATCH = 1024
FEATURES = 64

# One copy per host: a model's large weights stay pages of model.onnx that every worker
# shares (docs/models.md); a 4 KB model like this one loads as a plain session. One
# intra-op and one inter-op thread: the default starts a pool per session (hundreds of
# threads for hundreds of spaces), and a 4 KB model has no work to split.
session = onnx_session(HERE / "model.onnx")
INPUT = session.get_inputs()[0].name


def predict(x: np.ndarray) -> dict:
    labels, probabilities = session.run(None, {INPUT: x})
    # float64 before rounding, or float32 noise comes back (0.0795430019...).
    return {
        "labels": labels.tolist(),
        "probabilities": probabilities.astype(np.float64).round(6).tolist(),
    }


SAMPLE = np.asarray([META["sample"]["inputs"]], dtype=np.float32)


def unprocessable(problem: str) -> JSONResponse:
    expected = f'{{"inputs": [[{FEATURES} numbers in 0..16], ...]}} with 1 to {MAX_BATCH} rows'
    return JSONResponse({"error": problem, "expected": expected}, status_code=422)


def parse(body: bytes) -> np.ndarray | JSONResponse:
    try:
        inputs = json.loads(body)["inputs"]
    except (ValueError, TypeError, KeyError):
        return unprocessable('the body must be a JSON object with an "inputs" list')
    if not isinstance(inputs, list) or not inputs:
        return unprocessable('"inputs" must be a non-empty list of rows')
    if len(inputs) > MAX_BATCH:
        return unprocessable(f"at most {MAX_BATCH} rows per request, got {len(inputs)}")
    try:
        x = np.asarray(inputs)  # no dtype: strings and bools must not be coerced
    except ValueError:
        return unprocessable("every row must be a list of the same length")
    if x.dtype.kind not in "iuf":
        return unprocessable("every value must be a number")
    if x.ndim != 2 or x.shape[1] != FEATURES:
        return unprocessable(f"each row must hold {FEATURES} numbers, got shape {list(x.shape)}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        return unprocessable("values must be finite")
    return x


# async: inference takes microseconds, so a threadpool hop would cost more than it does.
async def handle(request):
    if request.method == "GET":
        return {
            "model": META["model"],
            "input": META["input"],
            "classes": META["classes"],
            "held_out_accuracy": META["held_out_accuracy"],
            "sample": {"label": META["sample"]["label"], **predict(SAMPLE)},
        }
    if request.method != "POST":
        return JSONResponse({"error": "use GET or POST"}, status_code=405)
    x = parse(await request.body())
    if isinstance(x, JSONResponse):
        return x
    return predict(x)
