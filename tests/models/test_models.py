"""One copy per host: polyserve.models shares a model's weights between workers; usage says so."""

from __future__ import annotations

import importlib.util
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from polyserve import models
from polyserve.usage import mapped
from tests.helpers import REPO, module_host, until

_spec = importlib.util.spec_from_file_location("bench_matmul", REPO / "bench" / "matmul.py")
matmul = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matmul)

SMALL = (256, 512)  # 512 KiB of weights: enough for the unit tests
BIG = (2048, 5120)  # 40 MiB: "tens of MB", so a copy per worker would be plain to see
COPY = BIG[0] * BIG[1] * 4


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.onnx"
    path.write_bytes(matmul.model(*SMALL))
    return path


def plain(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


# -- the skeleton and the session --------------------------------------------------------


def test_large_initializers_point_at_their_own_bytes_in_the_file(small_model):
    """An initializer of 4 KiB or more points at its raw_data in the file; a smaller one stays."""
    skeleton, large = models.skeleton(small_model)
    w_tensor, b_tensor = onnx.ModelProto.FromString(skeleton).graph.initializer
    w, b = matmul.weights(*SMALL)  # 512 KiB and 2 KiB
    assert large == w.nbytes
    assert w_tensor.data_location == onnx.TensorProto.EXTERNAL and not w_tensor.raw_data
    where = {e.key: e.value for e in w_tensor.external_data}
    assert where["location"] == "model.onnx"
    offset, length = int(where["offset"]), int(where["length"])
    assert small_model.read_bytes()[offset : offset + length] == w.tobytes()
    assert b_tensor.data_location == onnx.TensorProto.DEFAULT and b_tensor.raw_data == b.tobytes()
    assert len(skeleton) < 4096  # the graph and the small tensor


def test_the_shared_session_answers_as_a_plain_one(small_model):
    """A session from onnx_session computes what a plain InferenceSession of the file does."""
    x = np.random.default_rng(1).standard_normal((5, SMALL[0]), dtype=np.float32)
    (shared,) = models.onnx_session(small_model).run(None, {"X": x})
    (reference,) = plain(small_model).run(None, {"X": x})
    assert np.allclose(shared, reference, rtol=1e-4, atol=1e-4)


def test_convolution_and_gemm_weights_stay_mapped_and_answer_alike(tmp_path):
    """Conv and Gemm weights are mapped from the file (as usage counts them) and answer as plain."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    conv = rng.standard_normal((64, 32, 3, 3), dtype=np.float32)
    gemm = rng.standard_normal((64, 1024), dtype=np.float32)
    nodes = [
        helper.make_node("Conv", ["X", "CW"], ["C"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["C"], ["R"]),
        helper.make_node("GlobalAveragePool", ["R"], ["P"]),
        helper.make_node("Flatten", ["P"], ["F"]),
        helper.make_node("Gemm", ["F", "GW"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 32, 8, 8])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 1024])],
        [numpy_helper.from_array(conv, "CW"), numpy_helper.from_array(gemm, "GW")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "spaces" / "o" / "n" / "versions" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(model.SerializeToString())
    x = rng.standard_normal((3, 32, 8, 8), dtype=np.float32)
    session = models.onnx_session(path)
    (y,) = session.run(None, {"X": x})
    weights = conv.nbytes + gemm.nbytes
    assert weights <= mapped.mapped_by_space(tmp_path / "spaces", [os.getpid()])["o/n"]
    assert np.allclose(y, plain(path).run(None, {"X": x})[0], rtol=1e-4, atol=1e-3)


def test_a_session_adds_no_copy_of_the_weights_to_anonymous_memory(tmp_path):
    """A shared session of 40 MiB adds under a tenth of it to RssAnon; plain or prepack=True all."""
    path = tmp_path / "model.onnx"
    path.write_bytes(matmul.model(*BIG))
    script = textwrap.dedent(
        """
        import sys, numpy as np, onnxruntime as ort
        from polyserve.models import onnx_session
        def anon():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) << 10 for l in f if l.startswith("RssAnon"))
        before = anon()
        if sys.argv[2] in ("shared", "prepacked"):
            s = onnx_session(sys.argv[1], prepack=sys.argv[2] == "prepacked")
        else:
            s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
        s.run(None, {"X": np.ones((1, __K__), np.float32)})
        print(anon() - before)
        """
    ).replace("__K__", str(BIG[0]))
    added = {
        how: int(subprocess.check_output([sys.executable, "-c", script, str(path), how], cwd=REPO))
        for how in ("shared", "plain", "prepacked")
    }
    assert added["shared"] < COPY / 10, added
    assert added["plain"] > COPY * 0.9, added
    assert added["prepacked"] > COPY * 0.9, added  # prepack=True: a copy again, by choice


def test_a_model_without_large_tensors_loads_unchanged():
    """onnx-tiny's 4 KB model has nothing to share: no skeleton, and its session is a plain one."""
    model = REPO / "examples" / "python-onnx-tiny" / "model.onnx"
    assert models.skeleton(model) == (None, 0)
    x = np.zeros((1, 64), np.float32)
    labels, _ = models.onnx_session(model).run(None, {"X": x})
    assert labels.tolist() == plain(model).run(None, {"X": x})[0].tolist()


def test_a_model_already_in_external_data_is_left_as_it_is(tmp_path, small_model):
    """A model saved with external data needs no skeleton, and still loads through the helper."""
    onnx.save_model(
        onnx.load(small_model), tmp_path / "ext.onnx", save_as_external_data=True, location="w.bin"
    )
    skeleton, large = models.skeleton(tmp_path / "ext.onnx")
    assert skeleton is None and large == sum(a.nbytes for a in matmul.weights(*SMALL))
    x = np.ones((2, SMALL[0]), np.float32)
    (y,) = models.onnx_session(tmp_path / "ext.onnx").run(None, {"X": x})
    assert np.allclose(y, plain(small_model).run(None, {"X": x})[0], rtol=1e-4, atol=1e-4)


def test_a_file_that_is_not_a_model_gets_onnxruntimes_own_error(tmp_path):
    """Bytes that are not a protobuf: skeleton() says so; the session raises onnxruntime's error."""
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not an ONNX protobuf"):
        models.skeleton(bad)
    with pytest.raises(Exception, match=r"(?i)protobuf|load model"):
        models.onnx_session(bad)


# -- counting mapped files once ----------------------------------------------------------


def test_mapped_bytes_count_each_file_range_once(tmp_path):
    """One file range mapped twice counts once, each space its own; a gone pid maps nothing."""
    spaces = tmp_path / "spaces"
    files = {}
    for space, size in (("a/x", 3 << 20), ("b/y", 1 << 20)):
        path = spaces / space / "versions" / "1" / "model.onnx"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"\0" * size)
        files[space] = path
    held = []
    for path in (files["a/x"], files["a/x"], files["b/y"]):
        with open(path, "rb") as f:
            held.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        found = mapped.mapped_by_space(spaces, [os.getpid(), gone.pid])
    finally:
        for m in held:
            m.close()
    assert found == {"a/x": 3 << 20, "b/y": 1 << 20}
    assert mapped.mapped_by_space(spaces, [os.getpid()]) == {}


# -- a real host with 4 workers ------------------------------------------------------------


host4 = module_host("host4", workers=4)


def workers_memory(host) -> dict[str, int]:
    """Pss, its file-backed part, and anonymous memory (bytes), summed over the workers."""
    totals = {"Pss": 0, "Pss_File": 0, "Anonymous": 0}
    for pid in host.worker_pids():
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in totals:
                totals[key] += int(value.split()[0]) << 10
    return totals


def file_pss(host, path: Path) -> int:
    """The Pss (bytes) of the workers' mappings of one file, summed: its pages counted once."""
    total = 0
    for pid in host.worker_pids():
        inside = False
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            if not line[:1].isupper():  # a mapping's header: address range, perms, … path
                inside = line.endswith(str(path))
            elif inside and line.startswith("Pss:"):
                total += int(line.split()[1]) << 10
    return total


def served_by_every_worker(host, space: str) -> list[dict]:
    """Call the space on fresh connections until each worker has answered it."""
    answers: list[dict] = []

    def all_answered() -> bool:
        answers.append(host.get(f"/s/{space}/").json())
        return {a["pid"] for a in answers} >= host.worker_pids()

    until(all_answered, what=f"every worker to serve {space}")
    return answers


def mappers(host, path: Path, anywhere: bool = False) -> set[int]:
    """Processes of the host (master, workers), or any process we can see, that map `path`."""
    if anywhere:
        pids = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    else:
        pids = {host.proc.pid, *host.worker_pids()}
    found = set()
    for pid in pids:
        try:
            if str(path) in Path(f"/proc/{pid}/maps").read_text():
                found.add(pid)
        except OSError:  # gone, or not ours to read
            continue
    return found


@pytest.fixture(scope="module")
def big_tar() -> bytes:
    return matmul.space_tar(matmul.model(*BIG, seed=0))


def version_dir(host, space: str, number: int) -> Path:
    return (host.data_dir / "spaces" / space / "versions" / str(number)).resolve()


def weights(version: Path) -> Path:
    """The file the workers map a version's weights from: the prepacked data its validation
    built (polyserve.models.prepacked), found beside model.onnx."""
    (found,) = version.glob(".model.onnx.prepacked-*/model.onnx.data")
    return found


def test_four_workers_hold_one_copy_of_a_model(host4, big_tar):
    """After 4 workers serve a 40 MiB model, their memory grows by about one copy, not four."""
    r = host4.deploy("models/one-copy", big_tar, "space.tar")
    assert r.status_code == 200, r.text
    before = workers_memory(host4)
    answers = served_by_every_worker(host4, "models/one-copy")
    after = workers_memory(host4)
    grown = {key: (after[key] - before[key]) / COPY for key in before}
    model = weights(version_dir(host4, "models/one-copy", 1))
    assert 0.9 < file_pss(host4, model) / COPY < 1.1  # the weights: resident, counted once
    assert grown["Anonymous"] < 0.25, grown  # a copy per worker would be 4
    # All of it: the weights, and onnxruntime's code pages the first inference faults in.
    assert grown["Pss"] < 1.5, grown
    assert all(
        a["sum"] == pytest.approx(matmul.expected_sum(*BIG, seed=0), rel=1e-4) for a in answers
    )
    usage = host4.get("/_polyserve/usage").json()["spaces"]["models/one-copy"]
    assert usage["workers_loaded"] == 4
    assert abs(usage["mapped_kib"] * 1024 - COPY) < COPY / 100  # counted once, not 4 times
    assert usage["memory_kib"] * 1024 < COPY / 10
    metric = 'polyserve_space_mapped_bytes{space="models/one-copy"} '
    (line,) = [x for x in host4.get("/metrics").text.splitlines() if x.startswith(metric)]
    assert float(line.split()[-1]) // 1024 == usage["mapped_kib"]


def test_a_model_below_the_heaps_mmap_threshold_adds_no_copy_either(host4):
    """A 20 MiB model: onnxruntime's transient read of its prepacked weights is a block
    below the worker's fixed mmap threshold (polyserve.serve.heap), which would stay
    resident in the importing thread's arena, a copy per worker, were it not mapped."""
    shape = (2048, 2560)
    size = shape[0] * shape[1] * 4
    tar = matmul.space_tar(matmul.model(*shape, seed=1))
    assert host4.deploy("models/small-copy", tar, "space.tar").status_code == 200
    before = workers_memory(host4)
    served_by_every_worker(host4, "models/small-copy")
    grown = (workers_memory(host4)["Anonymous"] - before["Anonymous"]) / size
    assert grown < 0.25, f"the workers' anonymous memory grew by {grown:.2f} copies"
    usage = host4.get("/_polyserve/usage").json()["spaces"]["models/small-copy"]
    assert usage["memory_kib"] * 1024 < size / 10, usage


def test_the_validators_import_leaves_no_copy_behind(host4, big_tar):
    """After a deploy's 200 no process maps the model; the version holds the upload and its
    prepacked weights."""

    def big_files() -> set[Path]:
        found = (p.resolve() for p in host4.data_dir.rglob("*") if p.is_file())
        return {p for p in found if p.stat().st_size > COPY}

    before, big_before = workers_memory(host4), big_files()
    r = host4.deploy("models/validated", big_tar, "space.tar")
    assert r.status_code == 200, r.text
    version = version_dir(host4, "models/validated", 1)
    packed = weights(version)
    assert mappers(host4, version / "model.onnx", anywhere=True) == set()  # validator gone
    assert mappers(host4, packed, anywhere=True) == set()
    # The upload's files, their bytecode, and the prepacked weights the validation built.
    assert {p.name for p in version.iterdir()} <= {
        "main.py",
        "model.onnx",
        "__pycache__",
        packed.parent.name,
    }
    assert big_files() - big_before == {version / "model.onnx", packed}
    assert (workers_memory(host4)["Pss"] - before["Pss"]) < COPY / 4


def test_a_hot_swap_serves_the_new_model_and_frees_the_old_pages(host4):
    """After the 200 of v2, every answer is v2's, and no worker maps v1's model any more."""
    space = "models/swap"
    shape = (1024, 4096)  # 16 MiB: two versions of it in one test
    copy = shape[0] * shape[1] * 4
    assert host4.deploy(space, matmul.space_tar(matmul.model(*shape, seed=1)), "s.tar").is_success
    served_by_every_worker(host4, space)
    old = weights(version_dir(host4, space, 1))
    assert len(mappers(host4, old)) == 4
    mapped_v1 = workers_memory(host4)["Pss_File"]
    r = host4.deploy(space, matmul.space_tar(matmul.model(*shape, seed=2)), "s.tar")
    assert r.status_code == 200 and r.json()["version"] == 2
    new_sum, old_sum = (matmul.expected_sum(*shape, seed=s) for s in (2, 1))
    answers = [host4.get(f"/s/{space}/").json()["sum"] for _ in range(40)]
    assert all(a == pytest.approx(new_sum, rel=1e-4) for a in answers), (answers, old_sum)
    until(lambda: not mappers(host4, old), what="every worker to unmap v1's model")
    new = weights(version_dir(host4, space, 2))
    until(lambda: len(mappers(host4, new)) == 4, what="every worker to map v2's model")
    # v1's pages left the workers: their file-backed memory is back where it was.
    assert abs(workers_memory(host4)["Pss_File"] - mapped_v1) < copy / 4
    usage = host4.get("/_polyserve/usage").json()["spaces"][space]
    assert abs(usage["mapped_kib"] * 1024 - copy) < copy / 100
