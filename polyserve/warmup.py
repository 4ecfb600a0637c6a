"""Warm what a first use sets up: in the master, so that forks inherit it, and again in
each worker at boot, so that its copy-on-write faults are not a space's first load's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

WARM = Path(__file__).parent / "warm"  # a space of our own, and the model it loads
# warm/identity.onnx: one Identity node (float[1] -> float[1]), 79 bytes. Made with the
# onnx package (not a host dependency):
#   x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]); y = the same for "y"
#   g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "warm", [x], [y])
#   helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8,
#                     producer_name="polyserve").SerializeToString()
IDENTITY_ONNX = WARM / "identity.onnx"


def _onnxruntime() -> None:
    """onnxruntime builds its environment (logging, kernel registries, the CPU execution
    provider, its allocators) at the first InferenceSession of a process: 6-10 ms here,
    which every fresh worker's first model load paid. One throwaway session, loaded as
    model spaces load theirs (polyserve.models, docs/models.md), builds it in the
    master. With one thread per pool it starts no thread, so the fork stays as safe as
    importing onnxruntime was. polyserve.models is imported here for the same reason: a
    worker's own import of it was half of a first onnx-tiny load (~5 ms, most of it
    compiling where no bytecode is written, as under PYTHONDONTWRITEBYTECODE). The
    session is not run: a run's allocations cost each loaded worker 1 MiB more private
    memory, for a first load no faster."""
    from polyserve.models import onnx_session

    onnx_session(IDENTITY_ONNX)


# Preloaded module -> its warm-up. A module without one is only imported.
WARMUPS: dict[str, Callable[[], None]] = {"onnxruntime": _onnxruntime}


def in_worker(modules: tuple[str, ...]) -> None:
    """In a worker at boot, on the thread that will import its spaces: run the preloaded
    modules' warm-ups again, then import a space of our own and forget it.

    What the master built before the fork is shared copy-on-write, and a first write to
    any of those pages copies it: ~7 µs each here. A first onnxruntime session writes
    ~400 (malloc's arenas, onnxruntime's registries, reference counts), and a first
    import of a space another ~100 (the loader's paths, pathlib's, importlib's): 2 ms of
    a fresh worker's first onnx-tiny load, billed to its space. Paid here, that load
    costs its own work. The price: ~0.2-0.4 MiB more private memory per worker."""
    for name in modules:
        if name in WARMUPS:
            WARMUPS[name]()
    from polyserve import loader  # the worker's module: not the master's to import

    imported = loader.import_version("polyserve/warm-up", 0, WARM, "main.py")
    loader.forget(imported.package)
