"""Model spaces on a real host: a `.onnx` deploy, called with tritonclient over the protocol."""

from __future__ import annotations

import gzip
import json
import shlex
import subprocess
import sys
import threading

import httpx2 as httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.helpers import REPO, HostProcess, make_tar, module_host, until
from tests.onnx_models import ELEMENTS, add, identities

DIGITS = (REPO / "examples" / "python-onnx-tiny" / "model.onnx").read_bytes()
META = json.loads((REPO / "examples" / "python-onnx-tiny" / "model.json").read_text())
SAMPLE = np.asarray([META["sample"]["inputs"]], dtype=np.float32)
MAX_INFER_MB = 1

host = module_host("host", POLYSERVE_MAX_INFER_MB=str(MAX_INFER_MB))


def local(model: bytes, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feed)


def deploy_model(host: HostProcess, space: str, model: bytes = DIGITS) -> dict:
    answer = host.deploy(space, model, filename="model.onnx")
    assert answer.status_code == 200, answer.text
    return answer.json()


def clients(host: HostProcess, space: str) -> list[tuple[triton.InferenceServerClient, str]]:
    """The two URL forms: the host's root with owner/name, and the space's prefix."""
    root = f"127.0.0.1:{host.port}"
    name = space.split("/")[1]
    return [
        (triton.InferenceServerClient(root), space),
        (triton.InferenceServerClient(f"{root}/s/{space}"), name),
    ]


def usage(host: HostProcess, space: str) -> dict:
    return host.get("/_polyserve/usage").json()["spaces"].get(space, {})


def infer_json(host: HostProcess, path: str, payload: object, **headers: str) -> httpx.Response:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return httpx.post(host.url + path, content=content, headers=headers, timeout=30)


def test_a_model_file_deploys_as_a_model_space_that_lists_its_tensors(host):
    found = deploy_model(host, "lee/digits")
    assert (found["kind"], found["entry"], found["version"]) == ("model", "model.onnx", 1)
    assert found["inputs"] == [{"name": "X", "datatype": "FP32", "shape": [-1, 64]}]
    assert found["outputs"] == [
        {"name": "label", "datatype": "INT64", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]},
    ]
    spaces = host.get("/_polyserve/spaces").json()["spaces"]
    assert spaces["lee/digits"]["kind"] == "model"


def test_a_tar_holding_only_a_model_is_a_model_space(host):
    found = host.deploy("lee/tarred", make_tar({"model.onnx": DIGITS}), filename="m.tar")
    assert found.status_code == 200, found.text
    assert (found.json()["kind"], found.json()["entry"]) == ("model", "model.onnx")
    client = triton.InferenceServerClient(f"127.0.0.1:{host.port}")
    x = triton.InferInput("X", [1, 64], "FP32")
    x.set_data_from_numpy(SAMPLE)
    assert client.infer("lee/tarred", [x]).as_numpy("label").tolist() == [META["sample"]["label"]]


def test_tritonclient_with_its_defaults_gets_the_sessions_outputs_by_both_urls(host):
    deploy_model(host, "lee/binary")
    rows = np.random.default_rng(0).uniform(0, 16, (5, 64)).astype(np.float32)
    label, probabilities = local(DIGITS, {"X": rows})
    for client, name in clients(host, "lee/binary"):
        x = triton.InferInput("X", list(rows.shape), "FP32")
        x.set_data_from_numpy(rows)  # binary, and binary outputs asked for: the defaults
        result = client.infer(name, [x], request_id="req-7")
        answer = result.get_response()
        assert (answer["model_name"], answer["model_version"], answer["id"]) == (name, "1", "req-7")
        assert all("binary_data_size" in out["parameters"] for out in answer["outputs"])
        assert result.as_numpy("label").tolist() == label.tolist()
        assert np.array_equal(result.as_numpy("probabilities"), probabilities)


def test_tritonclient_json_only_gets_the_same_outputs_by_both_urls(host):
    deploy_model(host, "lee/json")
    label, probabilities = local(DIGITS, {"X": SAMPLE})
    for client, name in clients(host, "lee/json"):
        x = triton.InferInput("X", [1, 64], "FP32")
        x.set_data_from_numpy(SAMPLE, binary_data=False)
        outputs = [
            triton.InferRequestedOutput("probabilities", binary_data=False),
            triton.InferRequestedOutput("label", binary_data=False),
        ]
        result = client.infer(name, [x], outputs=outputs)
        answer = result.get_response()
        assert [out["name"] for out in answer["outputs"]] == ["probabilities", "label"]
        assert all("data" in out for out in answer["outputs"])
        assert result.as_numpy("label").tolist() == label.tolist()
        assert np.allclose(result.as_numpy("probabilities"), probabilities, rtol=1e-6)


def test_the_metadata_is_the_sessions_by_both_urls(host):
    deploy_model(host, "lee/meta")
    session = ort.InferenceSession(DIGITS, providers=["CPUExecutionProvider"])
    for client, name in clients(host, "lee/meta"):
        meta = client.get_model_metadata(name)
        assert (meta["name"], meta["platform"], meta["versions"]) == (name, "onnx_onnxv1", ["1"])
        assert [i["name"] for i in meta["inputs"]] == [i.name for i in session.get_inputs()]
        assert [o["name"] for o in meta["outputs"]] == [o.name for o in session.get_outputs()]
        assert [i["shape"] for i in meta["inputs"]] == [[-1, 64]]
        assert [o["datatype"] for o in meta["outputs"]] == ["INT64", "FP32"]
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready(name)
        server = client.get_server_metadata()
        assert server["name"] == "polyserve" and "binary_tensor_data" in server["extensions"]
    assert not triton.InferenceServerClient(f"127.0.0.1:{host.port}").is_model_ready("lee/none")


def test_every_datatype_goes_through_binary_and_json(host):
    deploy_model(host, "lee/types", identities())
    rng = np.random.default_rng(1)
    arrays: dict[str, np.ndarray] = {}
    for name in ELEMENTS:
        if name == "BYTES":
            arrays[name] = np.array([["a", "bé", ""], ["xyz", "1", "2"]], dtype=object)
        elif name == "BOOL":
            arrays[name] = rng.integers(0, 2, (2, 3)).astype(bool)
        else:  # the client's own table of numpy dtypes
            arrays[name] = rng.uniform(0, 100, (2, 3)).astype(triton.triton_to_np_dtype(name))
    for client, model in clients(host, "lee/types"):
        for binary in (True, False):
            inputs = []
            for name, array in arrays.items():
                tensor = triton.InferInput(f"in_{name}", list(array.shape), name)
                # The JSON form has no 16-bit float: tritonclient sends FP16 binary only.
                tensor.set_data_from_numpy(array, binary_data=binary or name == "FP16")
                inputs.append(tensor)
            outputs = [
                triton.InferRequestedOutput(f"out_{name}", binary_data=binary or name == "FP16")
                for name in arrays
            ]
            result = client.infer(model, inputs, outputs=outputs)
            for name, array in arrays.items():
                got = result.as_numpy(f"out_{name}")
                if name == "BYTES":  # tritonclient gives BYTES back as bytes
                    got = np.vectorize(lambda b: b.decode() if isinstance(b, bytes) else b)(got)
                assert got.tolist() == array.tolist(), (name, binary)


BAD = [
    (
        "an unknown input",
        {"inputs": [{"name": "W", "shape": [1, 64], "datatype": "FP32", "data": [0] * 64}]},
        "unknown input 'W'",
    ),
    (
        "a wrong datatype",
        {"inputs": [{"name": "X", "shape": [1, 64], "datatype": "FP64", "data": [0] * 64}]},
        "datatype FP32",
    ),
    (
        "a wrong shape",
        {"inputs": [{"name": "X", "shape": [1, 63], "datatype": "FP32", "data": [0] * 63}]},
        "shape [-1, 64]",
    ),
    ("no input", {"inputs": []}, "needs `inputs`"),
    (
        "data that does not fill the shape",
        {"inputs": [{"name": "X", "shape": [2, 64], "datatype": "FP32", "data": [0] * 64}]},
        "needs 128 elements",
    ),
    (
        "strings for numbers",
        {"inputs": [{"name": "X", "shape": [1, 64], "datatype": "FP32", "data": ["a"] * 64}]},
        "must be numbers",
    ),
    (
        "an unknown output",
        {
            "inputs": [{"name": "X", "shape": [1, 64], "datatype": "FP32", "data": [0] * 64}],
            "outputs": [{"name": "nope"}],
        },
        "unknown output 'nope'",
    ),
]


def test_each_bad_request_is_a_400_that_counts_as_an_error_and_the_next_succeeds(host):
    deploy_model(host, "lee/bad")
    good = {
        "inputs": [
            {"name": "X", "shape": [1, 64], "datatype": "FP32", "data": SAMPLE.ravel().tolist()}
        ]
    }
    path = "/v2/models/lee/bad/infer"
    assert infer_json(host, path, good).status_code == 200
    before = usage(host, "lee/bad")
    refused = 0
    for what, payload, says in BAD:
        answer = infer_json(host, path, payload)
        assert answer.status_code == 400, (what, answer.text)
        assert says in answer.json()["error"], (what, answer.json())
        refused += 1
        assert infer_json(host, path, good).json()["outputs"][0]["data"] == [2], what

    # A header length that lies, in both directions, and sizes that outrun the body.
    def binary(size: int) -> bytes:
        tensor = {"name": "X", "shape": [1, 64], "datatype": "FP32"}
        tensor["parameters"] = {"binary_data_size": size}
        return json.dumps({"inputs": [tensor]}).encode()

    header, raw = binary(256), SAMPLE.tobytes()
    for head, length, says in (
        (header, len(header) + 999, "holds only"),
        (header, len(header) - 5, "JSON object"),
        (binary(260), len(binary(260)), "only 256 follow"),
    ):
        answer = infer_json(
            host, path, head + raw, **{"Inference-Header-Content-Length": str(length)}
        )
        assert answer.status_code == 400 and says in answer.json()["error"], answer.text
        refused += 1
    right = infer_json(
        host, path, header + raw, **{"Inference-Header-Content-Length": str(len(header))}
    )
    assert right.status_code == 200, right.text
    # A body over POLYSERVE_MAX_INFER_MB, declared and streamed (chunked).
    big = b"{" + b" " * (MAX_INFER_MB << 20) + b"}"
    answer = infer_json(host, path, big)
    assert answer.status_code == 400 and "at most 1 MiB" in answer.json()["error"]
    chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))
    streamed = httpx.post(host.url + path, content=chunks, timeout=30)
    assert streamed.status_code == 400 and "at most 1 MiB" in streamed.json()["error"]
    refused += 2
    after = usage(host, "lee/bad")
    good_calls = len(BAD) + 1
    assert after["errors"] - before["errors"] == refused
    assert after["requests"] - before["requests"] == refused + good_calls


def test_a_gzip_request_body_is_read(host):
    deploy_model(host, "lee/gzip")
    client = triton.InferenceServerClient(f"127.0.0.1:{host.port}")
    x = triton.InferInput("X", [1, 64], "FP32")
    x.set_data_from_numpy(SAMPLE)
    result = client.infer("lee/gzip", [x], request_compression_algorithm="gzip")
    assert result.as_numpy("label").tolist() == [META["sample"]["label"]]
    bomb = gzip.compress(b" " * ((MAX_INFER_MB << 20) + 10))
    answer = infer_json(host, "/v2/models/lee/gzip/infer", bomb, **{"Content-Encoding": "gzip"})
    assert answer.status_code == 400 and "at most" in answer.json()["error"]


def test_infers_are_billed_exactly_and_metadata_and_health_are_not(host):
    deploy_model(host, "lee/billed")
    client, name = clients(host, "lee/billed")[0]
    x = triton.InferInput("X", [1, 64], "FP32")
    x.set_data_from_numpy(SAMPLE)
    for _ in range(17):
        client.infer(name, [x])
    for _ in range(5):
        client.get_model_metadata(name)
        client.is_model_ready(name)
        client.is_server_live()
        host.get("/s/lee/billed/v2/models/billed")
    found = usage(host, "lee/billed")
    assert (found["requests"], found["errors"]) == (17, 0)
    assert found["busy_ms"] >= 0 and found["cold_starts"] >= 1


def test_a_version_in_the_path_at_the_root_calls_it_and_under_a_prefix_must_match(host):
    deploy_model(host, "lee/versioned", add(1.0))
    deploy_model(host, "lee/versioned", add(2.0))
    payload = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}
    ok = infer_json(host, "/v2/models/lee/versioned/versions/2/infer", payload)
    assert ok.status_code == 200 and ok.json()["outputs"][0]["data"] == [2.0] * 4
    old = infer_json(host, "/v2/models/lee/versioned/versions/1/infer", payload)
    assert old.status_code == 200 and old.json()["outputs"][0]["data"] == [1.0] * 4
    # Under the plain prefix the current version serves: another is called as name@N.
    under = infer_json(host, "/s/lee/versioned/v2/models/versioned/versions/1/infer", payload)
    assert under.status_code == 404 and "serves version 2 here" in under.json()["error"]
    meta = host.get("/v2/models/lee/versioned").json()
    assert meta["versions"] == ["1", "2"]


def test_a_hot_swap_serves_only_the_new_model_after_the_200(host):
    deploy_model(host, "lee/swap", add(1.0))
    payload = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}
    path = "/v2/models/lee/swap/infer"
    stop = threading.Event()
    seen: list[tuple[float, str]] = []

    def hammer() -> None:  # keeps both workers busy with v1 across the swap
        while not stop.is_set():
            answer = infer_json(host, path, payload).json()
            seen.append((answer["outputs"][0]["data"][0], answer["model_version"]))

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for thread in threads:
        thread.start()
    until(lambda: len(seen) > 20, what="requests on v1")
    deploy_model(host, "lee/swap", add(2.0))
    after = [infer_json(host, path, payload).json() for _ in range(40)]
    stop.set()
    for thread in threads:
        thread.join()
    assert {(a["outputs"][0]["data"][0], a["model_version"]) for a in after} == {(2.0, "2")}
    assert set(seen) <= {(1.0, "1"), (2.0, "2")}


def test_a_file_onnxruntime_cannot_load_is_a_422_and_changes_nothing(host):
    deploy_model(host, "lee/keep", add(5.0))
    broken = host.deploy("lee/keep", b"\x08\x07 not a model", filename="model.onnx")
    assert broken.status_code == 422
    assert "onnxruntime cannot load model.onnx" in broken.json()["error"]
    empty = host.deploy("lee/keep", b"", filename="model.onnx")
    assert empty.status_code == 422 and "empty" in empty.json()["error"]
    payload = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}
    answer = infer_json(host, "/v2/models/lee/keep/infer", payload).json()
    assert answer["model_version"] == "1" and answer["outputs"][0]["data"] == [5.0] * 4


INFERENCE_SPACE = '''
from pathlib import Path

import numpy as np

from polyserve.models import Tensor, inference_app, onnx_session

session = onnx_session(Path(__file__).resolve().parent / "model.onnx")


def pre(inputs):
    """Text rows "a,b,c,d" into the model's four floats."""
    rows = [[float(v) for v in text.split(",")] for text in inputs["csv"].tolist()]
    return {"X": np.asarray(rows, dtype=np.float32)}


app = inference_app(session, pre=pre, inputs=[Tensor("csv", "BYTES", (-1,))])
'''


def test_a_python_space_speaks_the_protocol_with_inference_app(host):
    tar = make_tar({"main.py": INFERENCE_SPACE, "model.onnx": add(10.0)})
    found = host.deploy("lee/python", tar, filename="space.tar")
    assert found.status_code == 200, found.text
    assert found.json()["kind"] == "model"
    assert found.json()["inputs"] == [{"name": "csv", "datatype": "BYTES", "shape": [-1]}]
    for client, name in clients(host, "lee/python"):
        text = triton.InferInput("csv", [2], "BYTES")
        text.set_data_from_numpy(np.array([b"1,2,3,4", b"0,0,0,0"], dtype=object))
        result = client.infer(name, [text])
        assert result.as_numpy("Y").tolist() == [[11, 12, 13, 14], [10, 10, 10, 10]]
        meta = client.get_model_metadata(name)
        assert meta["inputs"] == [{"name": "csv", "datatype": "BYTES", "shape": [-1]}]
    bad = triton.InferInput("csv", [1], "BYTES")
    bad.set_data_from_numpy(np.array([b"1,x"], dtype=object))
    with pytest.raises(InferenceServerException, match="400"):
        clients(host, "lee/python")[0][0].infer("lee/python", [bad])


def test_a_python_space_without_the_protocol_is_a_404_at_the_root_and_not_billed(host):
    assert host.deploy("lee/plain", "def handle(r):\n    return 'hi'\n").status_code == 200
    assert host.get("/s/lee/plain/").text == "hi"
    payload = {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [0]}]}
    answer = infer_json(host, "/v2/models/lee/plain/infer", payload)
    assert answer.status_code == 404 and "not a model space" in answer.json()["error"]
    assert host.get("/v2/models/lee/plain").status_code == 404
    assert usage(host, "lee/plain")["requests"] == 1
    gone = infer_json(host, "/v2/models/lee/nothing/infer", payload)
    assert gone.status_code == 404 and "not deployed" in gone.json()["error"]


def test_the_repository_lists_loads_and_unloads_model_spaces(host):
    deploy_model(host, "lee/repo")
    client = triton.InferenceServerClient(f"127.0.0.1:{host.port}")
    index = client.get_model_repository_index()
    assert {"name": "lee/repo", "version": "1", "state": "READY"} in index
    assert all(entry["name"] != "lee/plain" for entry in index)
    client.load_model("lee/repo")
    client.unload_model("lee/repo")
    x = triton.InferInput("X", [1, 64], "FP32")
    x.set_data_from_numpy(SAMPLE)
    assert client.infer("lee/repo", [x]).as_numpy("label").tolist() == [META["sample"]["label"]]
    found = usage(host, "lee/repo")
    assert found["requests"] == 1 and found["cold_starts"] >= 2  # loaded, released, loaded


def test_the_repositorys_writes_need_the_right_to_deploy(host_factory):
    guarded = host_factory("guarded", POLYSERVE_DEPLOY_TOKEN="s3cret-token-for-the-test")
    headers = {"Authorization": "Bearer s3cret-token-for-the-test"}
    answer = httpx.post(
        guarded.url + "/_polyserve/deploy",
        data={"space": "lee/guarded"},
        files={"module": ("model.onnx", DIGITS)},
        headers=headers,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    # A host with a token asks for it from every peer, loopback too, as a release does.
    unload = guarded.url + "/v2/repository/models/lee/guarded/unload"
    for refused in ({}, {"Authorization": "Bearer wrong"}):
        answer = httpx.post(unload, headers=refused, timeout=30)
        assert answer.status_code == 401, answer.text
        assert "token" in answer.json()["error"]
    right = httpx.post(unload, headers=headers, timeout=30)
    assert right.status_code == 200, right.text


def test_a_model_space_in_a_fleet_serves_on_every_host(host_factory, fleet_db):
    fast = {"POLYSERVE_CHECKPOINT_INTERVAL": "0.3", "POLYSERVE_FLEET_POLL_S": "0.5"}
    a, b = (
        host_factory(n, workers=1, POLYSERVE_DATABASE_URL=fleet_db, POLYSERVE_HOST_ID=n, **fast)
        for n in "ab"
    )

    def live() -> bool:
        hosts = a.get("/_polyserve/fleet").json()["hosts"]
        return {h["id"] for h in hosts if h["live"]} == {"a", "b"}

    until(live, what="both hosts live")
    found = deploy_model(a, "lee/fleet", add(3.0))
    assert found["kind"] == "model" and found["hosts"] == {"applied": 2, "live": 2}
    payload = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]}
    for each in (a, b):
        answer = infer_json(each, "/v2/models/lee/fleet/infer", payload)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [4.0] * 4
        assert each.get("/v2/models/lee/fleet").json()["inputs"][0]["name"] == "X"

    def billed() -> bool:
        spaces = a.get("/_polyserve/usage?scope=fleet").json()["spaces"]
        return spaces.get("lee/fleet", {}).get("requests") == 2

    until(billed, what="both infers in the fleet's ledger")


def test_the_walkthrough_in_the_docs_gives_the_output_it_shows(host_factory, tmp_path):
    """docs/inference-protocol.md's curl session, run as written against a fresh host."""
    fresh = host_factory("walkthrough")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    page = (REPO / "docs" / "inference-protocol.md").read_text()
    session = page.split("```console\n", 1)[1].split("```", 1)[0].splitlines()
    commands = [
        (line[2:], session[i + 1]) for i, line in enumerate(session) if line.startswith("$ curl")
    ]
    assert len(commands) == 4
    for command, shown in commands:
        argv = shlex.split(command.replace("localhost:8441", f"127.0.0.1:{fresh.port}"))
        argv[1:1] = ["-sS"]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (command, done.stderr)
        got, expected = json.loads(done.stdout), json.loads(shown)
        got.pop("import_ms", None), expected.pop("import_ms", None)  # a timing
        assert got == expected, command
    client = subprocess.run(
        [sys.executable, "examples/python-onnx-tiny/client.py", f"127.0.0.1:{fresh.port}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert client.returncode == 0, client.stderr
    shown_client = page.split("$ python examples/python-onnx-tiny/client.py localhost:8441\n")[1]
    assert client.stdout.splitlines() == shown_client.splitlines()[:3]


def test_a_rollback_and_a_release_work_for_a_model_as_for_any_space(host):
    deploy_model(host, "lee/back", add(1.0))
    deploy_model(host, "lee/back", add(2.0))
    payload = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}
    path = "/v2/models/lee/back/infer"
    assert infer_json(host, path, payload).json()["model_version"] == "2"
    back = httpx.post(host.url + "/_polyserve/spaces/lee/back/rollback", timeout=30)
    assert back.status_code == 200 and back.json()["version"] == 1
    answers = [infer_json(host, path, payload).json() for _ in range(10)]
    assert {(a["model_version"], a["outputs"][0]["data"][0]) for a in answers} == {("1", 1.0)}
    released = httpx.post(host.url + "/_polyserve/spaces/lee/back/release", timeout=30)
    assert released.status_code == 200
    loads = usage(host, "lee/back")["cold_starts"]
    assert infer_json(host, path, payload).json()["model_version"] == "1"
    assert usage(host, "lee/back")["cold_starts"] == loads + 1
