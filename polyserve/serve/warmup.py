"""Warm what a first use sets up: in the master, so that forks inherit it, and again in
each worker at boot, so that its copy-on-write faults are not a space's first load's."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("polyserve")

WARM = Path(__file__).parent / "warm"  # a space of our own, and the model it loads
# warm/model.onnx: an Identity node and an ai.onnx.ml Normalizer (float[1,1] -> float[1,1]).
# A first session of a model from a domain builds that domain's registries, and ai.onnx.ml
# is the one of scikit-learn's converted models: declaring it shortens a fresh worker's
# first onnx-tiny load (bench/NOTES.md, figures moved out of code comments).
# Made with the onnx package (not a host dependency):
#   x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1]); y = the same for "y"
#   nodes = [helper.make_node("Identity", ["x"], ["h"]),
#            helper.make_node("Normalizer", ["h"], ["y"], domain="ai.onnx.ml", norm="MAX")]
#   helper.make_model(helper.make_graph(nodes, "warm", [x], [y]), ir_version=8,
#                     opset_imports=[helper.make_opsetid("", 17),
#                                    helper.make_opsetid("ai.onnx.ml", 1)],
#                     producer_name="polyserve").SerializeToString()
WARM_ONNX = WARM / "model.onnx"


def _onnxruntime() -> None:
    """onnxruntime builds its environment (logging, kernel registries, the CPU execution
    provider, its allocators) at the first InferenceSession of a process, which every
    fresh worker's first model load paid. One throwaway session, loaded as
    model spaces load theirs (polyserve.models, docs/models.md), builds it in the
    master. With one thread per pool it starts no thread, so the fork stays as safe as
    importing onnxruntime was. polyserve.models is imported here for the same reason: a
    worker's own import of it was half of a first onnx-tiny load (most of it compiling
    where no bytecode is written, as under PYTHONDONTWRITEBYTECODE). The session is not
    run: a run's allocations cost each loaded worker more private memory, for a first
    load no faster. The figures are in bench/NOTES.md (figures moved out of code
    comments)."""
    from polyserve.models import onnx_session

    # On the CPU even in a GPU worker: the master must never open CUDA (its forks could
    # not use it), and a worker opens its GPU's context by itself (in_worker).
    onnx_session(WARM_ONNX, providers=("CPUExecutionProvider",))


# Preloaded module -> its warm-up. A module without one is only imported.
WARMUPS: dict[str, Callable[[], None]] = {"onnxruntime": _onnxruntime}


def in_worker(modules: tuple[str, ...]) -> None:
    """In a worker at boot, on the thread that will import its spaces: run the preloaded
    modules' warm-ups again, then import a space of our own and forget it.

    What the master built before the fork is shared copy-on-write, and a first write to
    any of those pages copies it. A first onnxruntime session writes hundreds of them
    (malloc's arenas, onnxruntime's registries, reference counts), and a first import of
    a space more (the loader's paths, pathlib's, importlib's): a share of a fresh
    worker's first onnx-tiny load, billed to its space. Paid here, that load costs its
    own work, for a little more private memory per worker (bench/NOTES.md, figures moved
    out of code comments)."""
    for name in modules:
        if name in WARMUPS:
            WARMUPS[name]()
    from polyserve.serve import gpu

    if gpu.on_gpu() and not gpu.open_context():
        log.warning(
            "GPU %s: no CUDA context could be opened (no NVIDIA driver's libcuda):"
            " its first space pays for it",
            os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
    from polyserve.serve import loader  # the worker's module: not the master's to import

    imported = loader.import_version("polyserve/serve/warm-up", 0, WARM, "main.py")
    loader.forget(imported.package)
