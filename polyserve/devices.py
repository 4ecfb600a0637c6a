"""The machine's GPUs through NVML: which there are, each one's memory, and a process's share.

NVML comes with the `gpu` extra (nvidia-ml-py, imported as `pynvml`) and the NVIDIA
driver (libnvidia-ml.so). Without either, every function here answers "no GPU" (an
empty tuple, None) rather than raising: a CPU host never needs them. NVML opens no CUDA
context, so the master may ask it which GPUs there are before it forks; it is shut down
again after that question, and each worker initialises it for itself, once.

NVML numbers the GPUs in PCI bus order and ignores CUDA_VISIBLE_DEVICES: the ids here,
in POLYSERVE_GPUS and in the usage answer are NVML's, and a GPU worker is started with
CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers them the same way.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any

# Set by the master in a GPU worker (and passed to its validations): the NVML index of
# the one GPU it was given, which CUDA_VISIBLE_DEVICES makes its CUDA device 0.
ENV = "POLYSERVE_DEVICE"

_initialised_in: int | None = None  # the pid that initialised NVML (a fork must again)


def _nvml() -> Any:
    """pynvml, initialised in this process; None without the package or the driver."""
    global _initialised_in
    try:
        import pynvml
    except ImportError:
        return None
    if _initialised_in != os.getpid():
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:  # no driver (libnvidia-ml.so), or no GPU
            return None
        _initialised_in = os.getpid()
    return pynvml


@functools.cache
def detected() -> tuple[int, ...]:
    """The GPUs NVML sees, by index; () without NVML. Asked once per process (every
    settings load asks), and NVML shut down after asking, so a master that forks
    afterwards hands its workers no NVML state."""
    global _initialised_in
    nvml = _nvml()
    if nvml is None:
        return ()
    try:
        return tuple(range(nvml.nvmlDeviceGetCount()))
    except nvml.NVMLError:
        return ()
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
        _initialised_in = None


def assigned() -> int | None:
    """The GPU the master gave this process (a GPU worker, or one's validation); None on
    a CPU worker."""
    value = os.environ.get(ENV, "")
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class Memory:
    """One GPU's memory, in bytes, as NVML reports it."""

    index: int
    total: int
    used: int


def memory(index: int) -> Memory | None:
    """GPU `index`'s total and used memory; None without NVML."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
    except nvml.NVMLError:
        return None
    return Memory(index, int(info.total), int(info.used))


def process_memory(index: int, pid: int | None = None) -> int | None:
    """The device memory process `pid` (default: this one) holds on GPU `index`, in bytes;
    None without NVML.

    NVML lists each process with a CUDA context on the GPU. A process not listed holds
    none (0), unless NVML lists processes none of which it can name at all: in a
    container without the host's PID namespace its pids are the host's, and then the
    GPU's used memory stands in (with one worker per GPU that is this worker's own, plus
    whatever else runs on the GPU)."""
    nvml = _nvml()
    if nvml is None:
        return None
    pid = os.getpid() if pid is None else pid
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        listed = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError:
        return None
    mine = [p.usedGpuMemory for p in listed if p.pid == pid]
    if mine:
        # None where NVML cannot tell (some virtualised GPUs): nothing to measure by.
        return sum(int(m) for m in mine if m is not None)
    if listed and not any(_exists(p.pid) for p in listed):
        found = memory(index)
        return found.used if found is not None else None
    return 0


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
