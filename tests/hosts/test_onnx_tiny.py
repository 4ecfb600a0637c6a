"""examples/python-onnx-tiny: the seed walkthrough verbatim, the model, and its 422s."""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from starlette.testclient import TestClient

from polyserve.serve import loader
from tests.helpers import REPO

EXAMPLE = REPO / "examples" / "python-onnx-tiny"
META = json.loads((EXAMPLE / "model.json").read_text())
# The walkthrough exactly as the seed and the README write it.
WALKTHROUGH = """\
tar -cf onnx-tiny.tar -C examples/python-onnx-tiny .
curl -X POST localhost:8441/_polyserve/deploy -F space=lee101/onnx-tiny -F module=@onnx-tiny.tar
curl localhost:8441/s/lee101/onnx-tiny/
curl localhost:8441/_polyserve/usage
"""


def session(path: Path = EXAMPLE / "model.onnx") -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def train_module():
    spec = importlib.util.spec_from_file_location("onnx_tiny_train", EXAMPLE / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_seed_walkthrough_works_as_written(host, tmp_path):
    assert f"\n{WALKTHROUGH}" in (REPO / "README.md").read_text().replace("$ ", "")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    outputs = []
    for line in WALKTHROUGH.splitlines():
        argv = shlex.split(line.replace("localhost:8441", f"localhost:{host.port}"))
        if argv[0] == "curl":
            argv[1:1] = ["-sS", "--fail-with-body"]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (line, done.stdout, done.stderr)
        outputs.append(done.stdout)
    deployed, called, usage = (json.loads(o) for o in outputs[1:])
    assert {k: deployed[k] for k in ("space", "entry", "kind")} == {
        "space": "lee101/onnx-tiny",
        "entry": "main.py",
        "kind": "handle",
    }
    x = np.asarray([META["sample"]["inputs"]], dtype=np.float32)
    labels, probabilities = session().run(None, {"X": x})
    assert called["sample"]["labels"] == labels.tolist()
    assert np.allclose(called["sample"]["probabilities"], probabilities, atol=1e-6)
    assert called["held_out_accuracy"] == META["held_out_accuracy"]
    space = usage["spaces"]["lee101/onnx-tiny"]
    assert space["requests"] == 1 and space["loaded"] is True
    assert isinstance(space["busy_ms"], int) and isinstance(space["warm_s"], int)
    assert space["last_import_ms"] > 0


@pytest.fixture(scope="module")
def client():
    imported = loader.import_version("lee101/onnx-tiny", 1, EXAMPLE, "main.py")
    yield TestClient(imported.app)
    loader.forget(imported.package)


def test_a_batch_is_classified_like_onnxruntime_does(client):
    train = train_module()
    _, x_test, _, _ = train.split()
    batch = x_test[:50]
    r = client.post("/", json={"inputs": batch.tolist()})
    assert r.status_code == 200
    labels, probabilities = session().run(None, {"X": batch})
    assert r.json()["labels"] == labels.tolist()
    assert np.allclose(r.json()["probabilities"], probabilities, atol=1e-6)
    assert all(math.isclose(sum(p), 1, abs_tol=1e-4) for p in r.json()["probabilities"])


def test_integer_pixels_are_accepted(client):
    r = client.post("/", json={"inputs": [[0] * 32 + [16] * 32]})
    assert r.status_code == 200 and len(r.json()["labels"]) == 1


@pytest.mark.parametrize(
    "body,problem",
    [
        (b"not json", "JSON object"),
        (b"[1, 2]", "JSON object"),
        (b'{"rows": []}', "JSON object"),
        (b'{"inputs": []}', "non-empty"),
        (b'{"inputs": 3}', "non-empty"),
        (b'{"inputs": [[1, 2, 3]]}', "64 numbers, got shape [1, 3]"),
        (b'{"inputs": [1, 2, 3]}', "got shape [3]"),
        (json.dumps({"inputs": [[0] * 64, [0] * 63]}).encode(), "same length"),
        (json.dumps({"inputs": [["1"] * 64]}).encode(), "number"),
        (json.dumps({"inputs": [[True] * 64]}).encode(), "number"),
        (json.dumps({"inputs": [[None] * 64]}).encode(), "number"),
        (b'{"inputs": [[' + b", ".join([b"NaN"] * 64) + b"]]}", "finite"),
        (json.dumps({"inputs": [[0] * 64] * 1025}).encode(), "at most 1024 rows"),
    ],
)
def test_bad_input_is_a_422_that_says_what_is_expected(client, body, problem):
    r = client.post("/", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert problem in r.json()["error"]
    assert "64 numbers" in r.json()["expected"]


def test_other_methods_are_refused(client):
    assert client.put("/", content=b"{}").status_code == 405


def test_the_committed_model_is_what_the_build_produces(tmp_path):
    train = train_module()
    built, meta = train.train()
    (tmp_path / "model.onnx").write_bytes(built)
    _, x_test, _, _ = train.split()
    committed_labels, committed_p = session().run(None, {"X": x_test})
    built_labels, built_p = session(tmp_path / "model.onnx").run(None, {"X": x_test})
    assert (committed_labels == built_labels).all()
    assert np.allclose(committed_p, built_p, atol=1e-5)
    assert meta["held_out_accuracy"] == META["held_out_accuracy"]
    infer = json.loads((EXAMPLE / "infer.json").read_text())
    assert infer == train.infer_request(META)


def test_the_held_out_accuracy_is_what_the_readme_says():
    _, x_test, _, y_test = train_module().split()
    labels, _ = session().run(None, {"X": x_test})
    accuracy = float((labels == y_test).mean())
    assert round(accuracy, 4) == META["held_out_accuracy"] == 0.9689
    assert len(y_test) == META["held_out_size"] == 450
    assert "96.89% on the 450 held-out images" in (REPO / "README.md").read_text()
