"""Build step of the onnx-tiny example: train a digits classifier and export it to ONNX.

Deterministic (fixed split and solver), offline (the digits set ships inside
scikit-learn), and run by `make build`. Writes model.onnx and model.json next to it, and
infer.json: the sample as an Open Inference Protocol request (docs/inference-protocol.md).
Needs the build extra: pip install -e '.[build]'.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from skl2onnx import to_onnx
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

HERE = Path(__file__).resolve().parent
SEED = 0
TEST_SIZE = 0.25


def split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed train/held-out split: 1,797 8x8 images, 64 features in 0..16."""
    digits = load_digits()
    x = digits.data.astype(np.float32)
    return train_test_split(
        x, digits.target, test_size=TEST_SIZE, random_state=SEED, stratify=digits.target
    )


def train() -> tuple[bytes, dict]:
    x_train, x_test, y_train, y_test = split()
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    model.fit(x_train, y_train)
    accuracy = float((model.predict(x_test) == y_test).mean())
    # zipmap=False: probabilities come out as one float tensor, not a list of dicts.
    onx = to_onnx(model, x_train[:1], options={id(model): {"zipmap": False}}, target_opset=17)
    meta = {
        "model": "digits classifier: standard scaler + multinomial logistic regression",
        "dataset": "scikit-learn digits (1,797 8x8 images), 25% held out, stratified, seed 0",
        "input": {
            "name": onx.graph.input[0].name,
            "shape": [None, 64],
            "dtype": "float32",
            "range": [0, 16],
        },
        "classes": [int(c) for c in model.classes_],
        "held_out_accuracy": round(accuracy, 4),
        "held_out_size": len(y_test),
        "sample": {"inputs": x_test[0].tolist(), "label": int(y_test[0])},
    }
    return onx.SerializeToString(), meta


def infer_request(meta: dict) -> dict:
    """The sample row as the body of a V2 infer: `curl -d @infer.json .../infer`."""
    x = {"name": meta["input"]["name"], "shape": [1, 64], "datatype": "FP32"}
    return {"inputs": [{**x, "data": meta["sample"]["inputs"]}]}


def main() -> None:
    model, meta = train()
    (HERE / "model.onnx").write_bytes(model)
    (HERE / "model.json").write_text(json.dumps(meta, indent=1) + "\n")
    (HERE / "infer.json").write_text(json.dumps(infer_request(meta)) + "\n")
    print(
        f"model.onnx: {len(model)} bytes, held-out accuracy {meta['held_out_accuracy']:.4f}"
        f" on {meta['held_out_size']} images"
    )


if __name__ == "__main__":
    main()
