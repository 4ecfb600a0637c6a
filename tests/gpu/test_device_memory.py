"""On a real GPU (marked `gpu`, skipped without one): device memory metered per space, given
back at release (torch's cache emptied), a worker recycled when it is not, and the cap."""

from __future__ import annotations

import httpx2 as httpx
import pytest

from polyserve import devices
from tests.helpers import HostProcess, until

pytestmark = [pytest.mark.gpu, pytest.mark.gunicorn]

MIB = 1 << 20
SPACE_MIB = 256  # far above what NVML's rounding and torch's blocks can blur


def torch_space(mib: int = SPACE_MIB, leak: bool = False) -> str:
    """A space holding `mib` MiB of device memory in a torch tensor; with `leak`, the
    tensor is kept where the space's release cannot free it (on the torch module)."""
    keep = "torch._polyserve_leak = W\n" if leak else ""
    return (
        "import torch\n"
        f"W = torch.ones({mib} * 262144, device='cuda')\n"  # float32: 4 bytes each
        f"{keep}"
        "def handle(request):\n"
        "    return {'device': str(W.device), 'sum': float(W[:4].sum())}\n"
    )


def worker(host: HostProcess) -> int:
    (pid,) = host.worker_pids()
    return pid


def on_device(pid: int) -> int:
    """What the worker `pid` holds on GPU 0, in bytes (NVML)."""
    found = devices.process_memory(0, pid)
    assert found is not None
    return found


def release(host: HostProcess, space: str) -> None:
    answer = httpx.post(f"{host.url}/_polyserve/spaces/{space}/release", timeout=30)
    assert answer.status_code == 200, answer.text


def gpu_host(tmp_path, name: str = "data", **env: str) -> HostProcess:
    return HostProcess(tmp_path / name, workers=1, POLYSERVE_GPUS="0", **env).start()


def test_a_torch_space_is_metered_and_its_release_gives_the_memory_back(tmp_path):
    """gpu_memory_kib is what the load added; after a release (and torch's empty_cache)
    the worker is back within 5% of its boot figure, without a recycle."""
    host = gpu_host(tmp_path)
    try:
        pid = worker(host)
        baseline = on_device(pid)
        assert baseline > 0, "the worker opens its GPU's CUDA context at boot"
        assert host.deploy("gpu/torch", torch_space()).status_code == 200
        answer = host.get("/s/gpu/torch/").json()
        assert answer["device"] == "cuda:0"
        usage = host.get("/_polyserve/usage").json()
        kib = usage["spaces"]["gpu/torch"]["gpu_memory_kib"]
        assert SPACE_MIB * 1024 <= kib < 2 * SPACE_MIB * 1024, kib
        assert usage["host"]["gpus"][0]["total_kib"] > usage["host"]["gpus"][0]["used_kib"] > 0
        release(host, "gpu/torch")
        until(lambda: on_device(pid) <= baseline * 1.05, what="the device memory to be back")
        assert worker(host) == pid
        assert host.get("/_polyserve/usage").json()["host"]["recycles"] == 0
    finally:
        host.stop()


def test_a_release_that_keeps_device_memory_recycles_the_worker(tmp_path):
    """A space whose memory outlives it (kept on the torch module): after its release the
    worker is recycled, counted, and its replacement serves the space again on GPU 0."""
    host = gpu_host(tmp_path)
    try:
        pid = worker(host)
        assert host.deploy("gpu/leaky", torch_space(leak=True)).status_code == 200
        assert host.get("/s/gpu/leaky/").json()["device"] == "cuda:0"
        release(host, "gpu/leaky")
        until(
            lambda: pid not in (pids := host.worker_pids()) and len(pids) == 1,
            what="the recycle",
        )
        host.wait_ready()
        usage = host.get("/_polyserve/usage").json()
        assert usage["spaces"]["gpu/leaky"]["recycled"] == 1
        assert usage["host"]["recycles"] == 1
        assert host.get("/s/gpu/leaky/").json()["device"] == "cuda:0"
    finally:
        host.stop()


def test_the_device_cap_releases_the_least_recently_used_gpu_space(tmp_path):
    """Under POLYSERVE_WORKER_GPU_MEMORY_MB with room for one space over the worker's own
    figure, loading a second releases the first (released_memory), and both serve."""
    probe = gpu_host(tmp_path, "probe")
    try:
        own = on_device(worker(probe))
    finally:
        probe.stop()
    cap_mb = own // MIB + SPACE_MIB * 3 // 2
    host = gpu_host(tmp_path, POLYSERVE_WORKER_GPU_MEMORY_MB=str(cap_mb))
    try:
        for space in ("gpu/first", "gpu/second"):
            assert host.deploy(space, torch_space()).status_code == 200
            assert host.get(f"/s/{space}/").status_code == 200
        usage = host.get("/_polyserve/usage").json()["spaces"]
        assert usage["gpu/first"]["released_memory"] == 1
        assert usage["gpu/second"]["released_memory"] == 0
        assert on_device(worker(host)) <= cap_mb * MIB
    finally:
        host.stop()
