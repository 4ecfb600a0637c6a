"""A host given GPUs, on a machine that may have none: one worker per GPU, each with its own
CUDA_VISIBLE_DEVICES, and model sessions that would run on the CPU refused, never served."""

from __future__ import annotations

import os
import signal

import httpx2 as httpx
import pytest

from tests.helpers import HostProcess, make_tar, until
from tests.onnx_models import matmul

pytestmark = pytest.mark.gunicorn

DEVICE_SPACE = (
    "import os\n"
    "def handle(request):\n"
    "    return {'pid': os.getpid(), 'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'),"
    " 'order': os.environ.get('CUDA_DEVICE_ORDER')}\n"
)
MODEL = matmul(8, 4)


def devices_seen(host: HostProcess, space: str, pids: set[int]) -> dict[int, str]:
    """Call `space` on fresh connections until each worker in `pids` has answered: the
    CUDA_VISIBLE_DEVICES each one reports, by pid."""
    seen: dict[int, str] = {}

    def every() -> bool:
        answer = host.get(f"/s/{space}/").json()
        assert answer["order"] == "PCI_BUS_ID"
        seen[answer["pid"]] = answer["cuda"]
        return pids <= seen.keys()

    until(every, what=f"every worker of {sorted(pids)} to answer")
    return {pid: seen[pid] for pid in pids}


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory):
    """A host told it has GPUs 0 and 1, with POLYSERVE_WORKERS left to its default."""
    host = HostProcess(
        tmp_path_factory.mktemp("gpus") / "data",
        workers=2,
        POLYSERVE_GPUS="0,1",
        POLYSERVE_WORKERS="",
    )
    try:
        yield host.start()
    finally:
        host.stop()


def test_one_worker_per_gpu_each_with_its_own_device(gpu_host):
    """POLYSERVE_GPUS=0,1 with no POLYSERVE_WORKERS: two workers, each given one GPU."""
    assert gpu_host.deploy("gpu/devices", DEVICE_SPACE).status_code == 200
    pids = gpu_host.worker_pids()
    assert len(pids) == 2
    assert sorted(devices_seen(gpu_host, "gpu/devices", pids).values()) == ["0", "1"]
    assert "GPU host: 2 workers on 2 GPUs, GPU 0: 1, GPU 1: 1" in gpu_host.log.read_text()


def test_a_replaced_worker_gets_the_gpu_of_the_one_it_replaces(gpu_host):
    """gunicorn forks a replacement for a killed worker: it takes the freed GPU, so the
    two live workers still have one each."""
    assert gpu_host.deploy("gpu/replaced", DEVICE_SPACE).status_code == 200
    before = devices_seen(gpu_host, "gpu/replaced", gpu_host.worker_pids())
    killed = min(before)
    os.kill(killed, signal.SIGKILL)
    until(
        lambda: (
            len(gpu_host.worker_pids() - before.keys()) == 1 and len(gpu_host.worker_pids()) == 2
        ),
        what="the killed worker's replacement",
    )
    after = devices_seen(gpu_host, "gpu/replaced", gpu_host.worker_pids())
    (replacement,) = after.keys() - before.keys()
    assert after[replacement] == before[killed]
    assert sorted(after.values()) == ["0", "1"]


def test_a_model_deploy_that_would_run_on_the_cpu_is_refused_and_not_published(gpu_host):
    """The validation runs on the deploying worker's GPU: this onnxruntime (the CPU build)
    has no CUDA provider, so the deploy is a 422 naming what it offers, and the space
    never serves."""
    answer = gpu_host.deploy("gpu/model", MODEL, filename="model.onnx")
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert "CPUExecutionProvider" in error and "onnxruntime-gpu" in error, error
    assert gpu_host.get("/s/gpu/model/").status_code == 404
    assert "gpu/model" not in gpu_host.get("/_polyserve/spaces").text


def test_a_python_space_whose_own_session_would_run_on_the_cpu_is_refused(gpu_host):
    """A space's own onnx_session() at import, on a GPU worker's validation: the same 422."""
    source = (
        "from pathlib import Path\n"
        "from polyserve.models import inference_app, onnx_session\n"
        "app = inference_app(onnx_session(Path(__file__).parent / 'model.onnx'))\n"
    )
    tar = make_tar({"main.py": source, "model.onnx": MODEL})
    answer = gpu_host.deploy("gpu/pymodel", tar, filename="space.tar")
    assert answer.status_code == 422, answer.text
    assert "CPUExecutionProvider" in answer.json()["error"]
    assert "gpu/pymodel" not in gpu_host.get("/_polyserve/spaces").text


def test_a_gpu_hosts_usage_has_device_fields(gpu_host):
    """Each space has gpu_memory_kib (0: this one added no device memory) and recycled;
    the host section lists each GPU (null memory where NVML cannot read it)."""
    assert gpu_host.deploy("gpu/usage", DEVICE_SPACE).status_code == 200
    assert gpu_host.get("/s/gpu/usage/").status_code == 200
    usage = gpu_host.get("/_polyserve/usage").json()
    assert usage["spaces"]["gpu/usage"]["gpu_memory_kib"] == 0
    assert usage["spaces"]["gpu/usage"]["recycled"] == 0
    assert [g["index"] for g in usage["host"]["gpus"]] == [0, 1]
    assert usage["host"]["recycles"] == 0
    metrics = gpu_host.get("/metrics").text
    assert 'polyserve_space_gpu_memory_bytes{space="gpu/usage"} 0.0' in metrics
    assert 'polyserve_space_recycled_total{space="gpu/usage"} 0.0' in metrics


def test_a_published_model_that_would_run_on_the_cpu_is_a_503(tmp_path):
    """A model published by a CPU host, then served by the same data directory as a GPU
    host: its load is refused with a 503 naming the providers, and never answered from
    the CPU; the CPU host served it."""
    data = tmp_path / "data"
    cpu = HostProcess(data, workers=1, POLYSERVE_GPUS="").start()
    try:
        assert cpu.deploy("gpu/served", MODEL, filename="model.onnx").status_code == 200
        body = {"inputs": [{"name": "X", "shape": [1, 8], "datatype": "FP32", "data": [0.0] * 8}]}
        assert httpx.post(f"{cpu.url}/v2/models/gpu/served/infer", json=body).status_code == 200
        usage = cpu.get("/_polyserve/usage").json()
        assert "gpu_memory_kib" not in usage["spaces"]["gpu/served"]
        assert "gpus" not in usage["host"]
        assert "gpu_memory" not in cpu.get("/metrics").text
    finally:
        cpu.stop()
    gpu = HostProcess(data, workers=1, POLYSERVE_GPUS="0").start()
    try:
        answer = httpx.post(f"{gpu.url}/v2/models/gpu/served/infer", json=body)
        assert answer.status_code == 503, answer.text
        assert "CPUExecutionProvider" in answer.json()["error"]
        providers = answer.json()["providers"]
        assert "CPUExecutionProvider" in providers and "CUDAExecutionProvider" not in providers
    finally:
        gpu.stop()
