"""The `inference protocol` scenario's parts: MLServer beside polyserve, the bodies, wrk's scripts.

MLServer 1.7 pins Starlette below polyserve's, so it lives in a virtualenv of its own,
made here once (`bench/.mlserver/`, ignored by git) with the onnxruntime the host has.
It serves the same model file through the custom runtime in bench/apps/mlserver_onnx, in
one process (`parallel_workers` 0: no inference pool to hand each request to), pinned
to the servers' core as polyserve's one worker is.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import venv
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import httpx2
import numpy as np
from harness import APPS, REPO, Server, free_port

MLSERVER = "mlserver==1.7.1"
VENV = REPO / "bench" / ".mlserver"
EXAMPLE = REPO / "examples" / "python-onnx-tiny"
MODEL = EXAMPLE / "model.onnx"
ORT = version("onnxruntime")  # the host's: both sides run the same inference


def mlserver_bin() -> Path:
    """MLServer's command, installed into its own virtualenv the first time."""
    command = VENV / "bin" / "mlserver"
    if command.exists():
        return command
    print(f"installing {MLSERVER} into {VENV.relative_to(REPO)} (once)", file=sys.stderr)
    venv.create(VENV, with_pip=True)
    subprocess.run(
        [VENV / "bin" / "pip", "install", "--quiet", MLSERVER, f"onnxruntime=={ORT}"],
        check=True,
    )
    return command


def mlserver(
    tmp: Path, name: str = "digits", model: bytes | None = None, **extra: object
) -> Server:
    """MLServer serving `model` (default: onnx-tiny's) as `name`, on the servers' core,
    through the custom runtime; `extra` goes into its model-settings.json (batching)."""
    models = tmp / f"mlserver-{name}" / name
    models.mkdir(parents=True, exist_ok=True)
    shutil.copy(APPS / "mlserver_onnx" / "runtime.py", models / "runtime.py")
    settings = json.loads((APPS / "mlserver_onnx" / "model-settings.json").read_text())
    (models / "model-settings.json").write_text(json.dumps({**settings, "name": name, **extra}))
    (models / "model.onnx").write_bytes(model if model is not None else MODEL.read_bytes())
    port = free_port()
    env = {
        "MLSERVER_HOST": "127.0.0.1",
        "MLSERVER_HTTP_PORT": str(port),
        "MLSERVER_GRPC_PORT": str(free_port()),
        "MLSERVER_METRICS_PORT": str(free_port()),
        "MLSERVER_PARALLEL_WORKERS": "0",
        "MLSERVER_METRICS_ENDPOINT": "",
    }
    return Server(
        [str(mlserver_bin()), "start", str(models.parent)],
        port,
        env=env,
        ready=f"/v2/models/{name}/ready",
    )


@dataclass(frozen=True)
class Body:
    """A request body, its headers, and the wrk script that POSTs it."""

    data: bytes
    headers: dict[str, str]
    script: Path

    def check(self, url: str) -> bytes:
        """One request first: the scenario measures answers, not refusals. Returns the
        answer's body."""
        answer = httpx2.post(url, content=self.data, headers=self.headers, timeout=30)
        if answer.status_code != 200:
            raise RuntimeError(f"{url}: {answer.status_code} {answer.text[:300]}")
        return answer.content


def bodies(tmp: Path) -> dict[str, Body]:
    """One row, POSTed as V2 JSON, as V2 binary, and as the example's own JSON."""
    row = json.loads((EXAMPLE / "model.json").read_text())["sample"]["inputs"]
    tensor = {"name": "X", "shape": [1, 64], "datatype": "FP32"}
    header = json.dumps(
        {
            "inputs": [{**tensor, "parameters": {"binary_data_size": 256}}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    json_type = {"Content-Type": "application/json"}
    payloads = {
        "v2_json": (json.dumps({"inputs": [{**tensor, "data": row}]}).encode(), json_type),
        "v2_binary": (
            header + np.asarray(row, dtype=np.float32).tobytes(),
            {
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(header)),
            },
        ),
        "own_json": (json.dumps({"inputs": [row]}).encode(), json_type),
    }
    found = {}
    for name, (payload, headers) in payloads.items():
        data = tmp / f"{name}.body"
        data.write_bytes(payload)
        lines = [
            f'local f = io.open("{data}", "rb")',
            'wrk.method = "POST"',
            'wrk.body = f:read("*all")',
            "f:close()",
            *(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items()),
        ]
        script = tmp / f"{name}.lua"
        script.write_text("\n".join(lines) + "\n")
        found[name] = Body(payload, headers, script)
    return found


def memory(url: str, spaces: tuple[str, str], cycles: int) -> dict[str, object]:
    """What a load of each space adds to its worker (usage `memory_kib`), released and
    loaded again `cycles` times, alternately: the model space against the Python one."""
    row = json.loads((EXAMPLE / "model.json").read_text())["sample"]["inputs"]
    infer = {"inputs": [{"name": "X", "shape": [1, 64], "datatype": "FP32", "data": row}]}
    calls = {
        spaces[0]: lambda: httpx2.post(url + f"/v2/models/{spaces[0]}/infer", json=infer),
        spaces[1]: lambda: httpx2.post(url + f"/s/{spaces[1]}/", json={"inputs": [row]}),
    }
    sizes: dict[str, list[int]] = {space: [] for space in spaces}
    for _ in range(cycles):
        for space in spaces:
            httpx2.post(url + f"/_polyserve/spaces/{space}/release").raise_for_status()
            calls[space]().raise_for_status()
            usage = httpx2.get(url + "/_polyserve/usage").json()["spaces"][space]
            sizes[space].append(usage["memory_kib"])
    model, python = (statistics.median(sizes[space]) for space in spaces)
    return {
        "model_kib": model,
        "python_kib": python,
        "ratio": round(model / python, 3) if python else (0.0 if model == 0 else float("inf")),
        "samples": sizes,
    }
