"""A GPU worker's device: the CUDA provider asked for, a session refused that fell back to
the CPU, its warm-up run, the CUDA context at boot, and torch's cache given back.

onnxruntime falls back to the CPU without an error when its CUDA provider cannot load
(a missing cuDNN, a CPU build): only `session.get_providers()` tells. On a GPU worker
such a session is a failed load (DeviceRefused: a 422 at deploy, a 503 on a request),
never a slow success. Anywhere, a session that asked for CUDA and did not get it is
refused the same way.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from polyserve import devices

log = logging.getLogger("polyserve")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
MANIFEST = "polyserve.toml"
SPACE_MEMORY_ENV = "POLYSERVE_GPU_SPACE_MEMORY_MB"  # the host's default, inherited

# For many small models in one process: the arena grows by what is asked, not by
# doubling (a 9 MB model's session took 443 MB with the default: onnxruntime#5801);
# cuDNN's heuristic picks an algorithm without the exhaustive search's trial runs and
# their workspace.
CUDA_OPTIONS = {
    "device_id": "0",  # the worker's one GPU, whatever its NVML index (CUDA_VISIBLE_DEVICES)
    "arena_extend_strategy": "kSameAsRequested",
    "cudnn_conv_algo_search": "HEURISTIC",
}


class DeviceRefused(Exception):
    """A session asked for the CUDA provider and onnxruntime gave it another: the loader
    makes it a failed load (loader.DeviceLoadError), answered 503 on a request (the
    host's to fix, not the tenant's) and 422 at deploy."""

    def __init__(self, error: str, providers: list[str]) -> None:
        super().__init__(error)
        self.providers = providers


class BadManifest(ValueError):
    """A polyserve.toml whose [gpu] table the host cannot use."""


def on_gpu() -> bool:
    """Whether this process is a GPU worker (or a GPU worker's validation)."""
    return devices.assigned() is not None


def space_memory_mb(root: Path | None) -> int:
    """The gpu_mem_limit (MiB) of a space's session: its polyserve.toml's `[gpu]
    memory_mb`, else the host's POLYSERVE_GPU_SPACE_MEMORY_MB (0: no limit)."""
    if root is not None and (root / MANIFEST).is_file():
        table = tomllib.loads((root / MANIFEST).read_text("utf-8")).get("gpu")
        if isinstance(table, dict) and "memory_mb" in table:
            value = table["memory_mb"]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadManifest(
                    f"{MANIFEST}: [gpu] memory_mb must be a whole number of MiB, 0 or more"
                )
            return value
    text = os.environ.get(SPACE_MEMORY_ENV, "")
    return int(text) if text.isdigit() else 0


def providers(memory_mb: int = 0) -> list[Any]:
    """What a session on this worker's GPU asks onnxruntime for: CUDA with the options
    above (and `memory_mb` as its gpu_mem_limit when not 0), then the CPU for the nodes
    CUDA has no kernel for, as onnxruntime always places those."""
    options = dict(CUDA_OPTIONS)
    if memory_mb:
        options["gpu_mem_limit"] = str(memory_mb << 20)
    return [(CUDA, options), CPU]


def asks_cuda(asked: Any) -> bool:
    """Whether a providers list (names, or (name, options) pairs) asks for CUDA."""
    return any((p[0] if isinstance(p, tuple | list) else p) == CUDA for p in asked)


def refuse_unavailable(ort: Any) -> None:
    """Before a session is made: DeviceRefused when this onnxruntime has no CUDA provider
    at all (the CPU build), rather than a session that would run on the CPU."""
    available = ort.get_available_providers()
    if CUDA not in available:
        raise DeviceRefused(_refusal(list(available), "offers"), list(available))


def check(session: Any) -> None:
    """After a session asked for CUDA is made: DeviceRefused unless CUDA is among the
    providers it got (onnxruntime fell back to the CPU: cuDNN or the CUDA runtime missing)."""
    got = list(session.get_providers())
    if CUDA not in got:
        raise DeviceRefused(_refusal(got, "gave the session"), got)


def _refusal(got: list[str], how: str) -> str:
    where = f"GPU {devices.assigned()}" if on_gpu() else "the CUDA provider it asked for"
    return (
        f"the session was to run on {where}, and onnxruntime {how} {', '.join(got)} only:"
        " it would run on the CPU. Install onnxruntime-gpu (the gpu extra) with the CUDA"
        " and cuDNN libraries it needs, in place of onnxruntime"
    )


def warm_up(session: Any) -> None:
    """One run at load of zeros shaped as the inputs (a dynamic dimension as 1): CUDA
    kernels, cuDNN's choice and the arena's first blocks are then the load's cost, not
    the first request's. A model that refuses zeros is still loaded (its first request
    pays instead)."""
    import numpy as np

    from polyserve.serve.modelspace import ORT_DATATYPES
    from polyserve.serve.tensors import DTYPES

    feed = {}
    for arg in session.get_inputs():
        datatype = ORT_DATATYPES.get(arg.type)
        if datatype is None:
            return  # a sequence or a map: no zeros to make
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in (arg.shape or ())]
        feed[arg.name] = np.zeros(shape, dtype=DTYPES[datatype])
    try:
        session.run(None, feed)
    except Exception as exc:  # onnxruntime's own classes: the model wanted other values
        log.info("warm-up run skipped: the model refused zeros (%s)", str(exc)[:200])


def empty_cache() -> None:
    """Give torch's cached device memory back to the driver, where a space loaded torch
    and used CUDA in this worker: after a release, its freed tensors stay in torch's cache
    (reserved, and counted by NVML) until this."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        cuda.empty_cache()


def open_context() -> bool:
    """At a GPU worker's boot: open the CUDA context of its GPU (the primary context,
    which onnxruntime and torch both use), so that its cost is the worker's once, not the
    first space's, and a space's device memory is its own. Through the driver's C API
    (libcuda), which any CUDA install has. False where it cannot (no driver)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    context = ctypes.c_void_p()
    device = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(device), 0) != 0:
        return False
    # Retained for the worker's life: never released, so it is never torn down and
    # made again between spaces.
    return bool(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0)
