"""The GPU check (`make gpu-check`): real hosts on a machine with an NVIDIA GPU, what runs where.

It starts a GPU host (POLYSERVE_GPUS: the first GPU NVML sees, one worker) and a CPU
host (POLYSERVE_GPUS empty) side by side, and prints one JSON object:

- `onnx`: the batching issue's MatMul model (bench/matmul.py, 20 MiB) deployed as a model
  space on each host: the GPU host's answer (200 with the CUDA provider, or the 422
  naming the providers onnxruntime offers: refused, never run on the CPU), and the
  latency of a 64-row infer on each host that serves it;
- `torch`: the same MatMul as a torch space, on `cuda` on the GPU host and on the CPU on
  the CPU host: its device, the device memory its load added (usage's gpu_memory_kib),
  and the 64-row latency on each, with their ratio;
- `many`: 20 small torch spaces on the GPU worker: the worker's device memory over its
  boot figure (its CUDA context) against the sum of their gpu_memory_kib, and the
  processes NVML lists on the GPU (one CUDA context per GPU: the worker alone);
- `release`: every space released on demand: the worker's figure against its boot
  figure afterwards (back within 5%), or the recycle that gave it back.

`--without-gpu` runs the ONNX part alone where NVML sees no GPU (tests/test_bench.py).
Only the standard library, onnx, numpy, torch and nvidia-ml-py beside the host's own
packages: what the GPU machine of ../shared/device has. With $OUT set, the JSON is also
written to $OUT/gpu_check.json.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE)]

import matmul  # noqa: E402  (bench/matmul.py)

from polyserve import devices  # noqa: E402

ROWS = 64
CALLS = 30
SMALL = 20  # small GPU spaces on one worker
SMALL_MIB = 8

TORCH_SPACE = """
import time
import torch

DEVICE = {device!r}
g = torch.Generator().manual_seed(0)
W = torch.randn({k}, {m}, generator=g).to(DEVICE)
B = torch.randn({m}, generator=g).to(DEVICE)
X = torch.ones({rows}, {k}).to(DEVICE)


def handle(request):
    started = time.perf_counter()
    y = X @ W + B
    total = float(y.sum())  # waits for the device
    return {{"device": str(W.device), "sum": total,
            "compute_ms": (time.perf_counter() - started) * 1000}}
"""

SMALL_SPACE = """
import torch
W = torch.ones({mib} * 262144, device="cuda")
def handle(request):
    return {{"device": str(W.device)}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Host:
    """`gunicorn -c gunicorn.conf.py` on a free loopback port, stopped by its PID."""

    def __init__(self, root: Path, name: str, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"{name}.log"
        full = {
            **os.environ,
            "POLYSERVE_BIND": f"127.0.0.1:{self.port}",
            "POLYSERVE_DATA_DIR": str(root / name),
            "POLYSERVE_IDLE_TTL": "3600",
            **env,
        }
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py"],
                cwd=REPO,
                env=full,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} host exited:\n{self.log.read_text()[-3000:]}")
            try:
                self.pid = self.call("GET", "/_polyserve/health")[1]["pid"]
                return
            except (OSError, ValueError):
                time.sleep(0.1)
        raise SystemExit(f"{name} host did not start:\n{self.log.read_text()[-3000:]}")

    def call(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[int, Any]:
        request = urllib.request.Request(
            self.url + path, data=body, method=method, headers=headers or {}
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def deploy(self, space: str, filename: str, content: bytes) -> tuple[int, Any]:
        boundary = uuid.uuid4().hex
        parts = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="space"\r\n\r\n{space}\r\n',
            f'--{boundary}\r\nContent-Disposition: form-data; name="module";'
            f' filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n',
        ]
        body = parts[0].encode() + parts[1].encode() + content + f"\r\n--{boundary}--\r\n".encode()
        kind = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        return self.call("POST", "/_polyserve/deploy", body, kind)

    def usage(self) -> dict[str, Any]:
        return self.call("GET", "/_polyserve/usage")[1]

    def worker(self) -> int:
        return int(self.call("GET", "/_polyserve/health")[1]["pid"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def latency_ms(host: Host, method: str, path: str, body: bytes | None = None) -> dict[str, Any]:
    """Median and spread of CALLS calls, after one warm call."""
    headers = {"Content-Type": "application/json"} if body else {}
    status, answer = host.call(method, path, body, headers)
    if status != 200:
        return {"status": status, "answer": answer}
    took = []
    for _ in range(CALLS):
        started = time.perf_counter()
        host.call(method, path, body, headers)
        took.append((time.perf_counter() - started) * 1000)
    return {
        "status": 200,
        "p50_ms": round(statistics.median(took), 3),
        "min_ms": round(min(took), 3),
    }


def infer_body() -> bytes:
    data = [1.0] * (ROWS * matmul.K)
    return json.dumps(
        {"inputs": [{"name": "X", "shape": [ROWS, matmul.K], "datatype": "FP32", "data": data}]}
    ).encode()


def until(predicate: Any, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def main(without_gpu: bool = False) -> dict[str, Any]:
    """The check; `without_gpu` (no NVML here) runs its ONNX part alone, against a host
    told it has GPU 0: the plumbing, and the refusal, on any machine."""
    gpus = devices.detected()
    if not gpus and not without_gpu:
        raise SystemExit("no GPU: NVML (nvidia-ml-py and the NVIDIA driver) sees none")
    gpu = gpus[0] if gpus else 0
    import onnxruntime

    result: dict[str, Any] = {
        "gpu": gpu,
        "onnxruntime": {
            "version": onnxruntime.__version__,
            "providers": onnxruntime.get_available_providers(),
        },
    }
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    on_gpu = Host(root, "gpu", POLYSERVE_GPUS=str(gpu), POLYSERVE_WORKERS="1")
    # torch's CUDA build maps its libraries at import, past the validation's default
    # 4 GiB address-space limit on a CPU host (a GPU host's validations have none).
    on_cpu = Host(
        root, "cpu", POLYSERVE_GPUS="", POLYSERVE_WORKERS="1", POLYSERVE_IMPORT_MEMORY_MB="65536"
    )
    try:
        worker = on_gpu.worker()
        boot = devices.process_memory(gpu, worker) or 0
        result["worker_boot_kib"] = boot // 1024

        model = matmul.model()
        onnx: dict[str, Any] = {}
        for name, host in (("gpu_host", on_gpu), ("cpu_host", on_cpu)):
            status, answer = host.deploy("check/onnx", "model.onnx", model)
            onnx[name] = {"deploy": status}
            if status != 200:
                onnx[name]["refusal"] = answer
                continue
            onnx[name]["infer"] = latency_ms(
                host, "POST", "/v2/models/check/onnx/infer", infer_body()
            )
            onnx[name]["gpu_memory_kib"] = host.usage()["spaces"]["check/onnx"].get(
                "gpu_memory_kib"
            )
        result["onnx"] = onnx
        if not gpus:
            return result

        torch: dict[str, Any] = {}
        for name, host, device in (("gpu_host", on_gpu, "cuda"), ("cpu_host", on_cpu, "cpu")):
            source = TORCH_SPACE.format(device=device, k=matmul.K, m=matmul.M, rows=ROWS)
            status, answer = host.deploy("check/torch", "main.py", source.encode())
            torch[name] = {"deploy": status}
            if status != 200:
                torch[name]["refusal"] = answer
                continue
            torch[name]["first"] = host.call("GET", "/s/check/torch/")[1]
            torch[name]["http"] = latency_ms(host, "GET", "/s/check/torch/")
            compute = [host.call("GET", "/s/check/torch/")[1]["compute_ms"] for _ in range(CALLS)]
            torch[name]["compute_p50_ms"] = round(statistics.median(compute), 3)
            torch[name]["gpu_memory_kib"] = host.usage()["spaces"]["check/torch"].get(
                "gpu_memory_kib"
            )
        if all("compute_p50_ms" in torch[n] for n in ("gpu_host", "cpu_host")):
            torch["cpu_over_gpu_compute"] = round(
                torch["cpu_host"]["compute_p50_ms"] / torch["gpu_host"]["compute_p50_ms"], 2
            )
        result["torch"] = torch

        many: dict[str, Any] = {"spaces": SMALL, "mib_each": SMALL_MIB, "deploys": []}
        for i in range(SMALL):
            source = SMALL_SPACE.format(mib=SMALL_MIB).encode()
            many["deploys"].append(on_gpu.deploy(f"check/small{i}", "main.py", source)[0])
            on_gpu.call("GET", f"/s/check/small{i}/")
        spaces = on_gpu.usage()["spaces"]
        many["sum_gpu_memory_kib"] = sum(
            spaces[n].get("gpu_memory_kib") or 0 for n in spaces if n.startswith("check/")
        )
        many["worker_over_boot_kib"] = ((devices.process_memory(gpu, worker) or 0) - boot) // 1024
        nvml = devices._nvml()
        handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
        listed = [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        many["gpu_processes"] = len(listed)
        many["worker_listed"] = worker in listed
        result["many"] = many

        names = [n for n in on_gpu.usage()["spaces"] if n.startswith("check/")]
        for name in names:
            on_gpu.call("POST", f"/_polyserve/spaces/{name}/release")

        def back() -> bool:
            try:
                now = on_gpu.worker()
            except OSError:
                return False
            return now != worker or (devices.process_memory(gpu, worker) or 0) <= boot * 1.05

        release: dict[str, Any] = {"back_within_5pct_or_recycled": until(back, 120)}
        now = on_gpu.worker()  # the replacement's, if the worker was recycled
        release["worker_replaced"] = now != worker
        release["worker_after_kib"] = (devices.process_memory(gpu, now) or 0) // 1024
        release["recycles"] = on_gpu.usage()["host"]["recycles"]
        result["release"] = release
        result["host_gpus"] = on_gpu.usage()["host"]["gpus"]
    finally:
        on_gpu.stop()
        on_cpu.stop()
    return result


if __name__ == "__main__":
    found = main(without_gpu="--without-gpu" in sys.argv[1:])
    text = json.dumps(found, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(text)
