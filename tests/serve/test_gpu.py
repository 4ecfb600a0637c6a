"""Unit tests of a GPU host's parts that need no GPU: the setting, the spread of workers
over GPUs, the CUDA provider's options, and a session refused that would run on the CPU."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from polyserve import devices, settings
from polyserve.master.hooks import gpu_for, spread
from polyserve.models import onnx_session
from polyserve.serve import gpu
from tests.onnx_models import matmul


def test_gpus_are_listed_by_index_and_set_the_default_workers():
    s = settings.load({"POLYSERVE_GPUS": "1, 0"})
    assert s.gpus == (1, 0) and s.workers == 2
    assert settings.load({"POLYSERVE_GPUS": "0", "POLYSERVE_WORKERS": "3"}).workers == 3


def test_an_empty_gpu_list_is_a_cpu_host_whatever_nvml_sees():
    s = settings.load({"POLYSERVE_GPUS": ""})
    assert s.gpus == () and s.workers == (os.cpu_count() or 1)


@pytest.mark.parametrize(("bad", "says"), [("gpu0", "not a GPU index"), ("0,0", "twice")])
def test_a_bad_gpu_list_names_the_variable(bad, says):
    with pytest.raises(ValueError, match=f"POLYSERVE_GPUS={bad!r}: .*{says}"):
        settings.load({"POLYSERVE_GPUS": bad})


def workers(*gpus: int | None) -> list[SimpleNamespace]:
    return [SimpleNamespace(polyserve_gpu=g) for g in gpus]


def test_a_new_worker_gets_the_gpu_fewest_workers_use():
    assert gpu_for((0, 1), workers()) == 0
    assert gpu_for((0, 1), workers(0)) == 1
    assert gpu_for((0, 1), workers(1)) == 0  # the replacement of GPU 0's worker
    assert gpu_for((0, 1), workers(0, 1, 0)) == 1  # more workers than GPUs: round the list


def test_the_spread_is_logged_with_what_shares_a_gpu():
    assert spread((0, 1), 2) == "2 workers on 2 GPUs, GPU 0: 1, GPU 1: 1"
    assert spread((0, 1), 3) == (
        "3 workers on 2 GPUs, GPU 0: 2, GPU 1: 1 (more workers than GPUs: some share one)"
    )


def test_the_cuda_provider_is_asked_for_with_options_for_small_models():
    (name, options), cpu = gpu.providers(512)
    assert (name, cpu) == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert options == {
        "device_id": "0",
        "arena_extend_strategy": "kSameAsRequested",
        "cudnn_conv_algo_search": "HEURISTIC",
        "gpu_mem_limit": str(512 << 20),
    }
    assert "gpu_mem_limit" not in gpu.providers(0)[0][1]


def test_a_spaces_gpu_memory_limit_comes_from_its_manifest_else_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv(gpu.SPACE_MEMORY_ENV, "256")
    assert gpu.space_memory_mb(tmp_path) == 256
    (tmp_path / "polyserve.toml").write_text("[gpu]\nmemory_mb = 64\n")
    assert gpu.space_memory_mb(tmp_path) == 64
    (tmp_path / "polyserve.toml").write_text("[gpu]\nmemory_mb = -1\n")
    with pytest.raises(gpu.BadManifest, match=r"\[gpu\] memory_mb"):
        gpu.space_memory_mb(tmp_path)


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(matmul(8, 4))
    return path


def test_on_a_gpu_worker_a_session_the_cpu_build_would_run_on_the_cpu_is_refused(
    model, monkeypatch
):
    """onnx_session on a GPU worker asks for CUDA; this onnxruntime (the CPU build) has
    none, so it raises, naming what onnxruntime offers, instead of a CPU session."""
    monkeypatch.setenv(devices.ENV, "0")
    with pytest.raises(gpu.DeviceRefused, match=r"on GPU 0.*CPUExecutionProvider") as refused:
        onnx_session(model)
    assert "CPUExecutionProvider" in refused.value.providers
    assert "CUDAExecutionProvider" not in refused.value.providers


def test_anywhere_a_session_asking_for_cuda_is_never_a_cpu_one(model, monkeypatch):
    monkeypatch.delenv(devices.ENV, raising=False)
    with pytest.raises(gpu.DeviceRefused, match="CPUExecutionProvider"):
        onnx_session(model, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


def test_a_cpu_worker_loads_on_the_cpu_as_before(model, monkeypatch):
    monkeypatch.delenv(devices.ENV, raising=False)
    assert onnx_session(model).get_providers() == ["CPUExecutionProvider"]


def test_a_session_whose_providers_lack_cuda_fails_the_check():
    """The silent fall back (CUDA offered, its libraries missing): get_providers() tells."""
    fell_back = SimpleNamespace(get_providers=lambda: ["CPUExecutionProvider"])
    with pytest.raises(gpu.DeviceRefused, match="gave the session CPUExecutionProvider only"):
        gpu.check(fell_back)
    gpu.check(
        SimpleNamespace(get_providers=lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    )


def test_without_nvml_there_is_no_gpu_and_no_figure():
    """This machine's case (no driver): nothing raises, nothing is made up."""
    if devices.detected():
        pytest.skip("NVML sees a GPU here")
    assert devices.memory(0) is None and devices.process_memory(0) is None
