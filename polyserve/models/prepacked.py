"""Prepacked weights in a file: built once in a deploy's validation, mapped by every worker.

A plain onnxruntime session prepacks a MatMul's weights into the layout its kernels
read, in each process's own memory; `onnx_session` turns that off to keep one copy per
host, and pays for it on batches (docs/models.md). onnxruntime can instead save the
optimized model with its prepacked weights as external data, and a session loaded from
that file maps them like any external data: full speed on batches, one copy per host.

The packing depends on the onnxruntime release and on the CPU's kernels, so the file is
kept beside the model under a name that holds both (`.model.onnx.prepacked-<key>/`).
It is built in the validation child, while the version is still staged and writable
(`PREPARE`), so a published version is never written to. Where it is missing (a fleet
host that did not validate the version, a newer onnxruntime, another CPU) the session
is today's, unprepacked.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger("polyserve.models")

# Set by the validation child: build the prepacked file of each model a space loads.
PREPARE = False


@cache
def key() -> str:
    """What the packing depends on: the onnxruntime release and the CPU's features."""
    import onnxruntime as ort

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:  # not Linux: the release alone
        pass
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"ort{ort.__version__}-{digest}"


def location(path: Path) -> Path:
    """The prepacked model of `path` (its data file lies beside it)."""
    return path.parent / f".{path.name}.prepacked-{key()}" / path.name


def session(path: Path, options: Any, providers: Sequence[str], min_bytes: int) -> Any | None:
    """A session on the prepacked file of `path`, built first when PREPARE asks; None
    where there is none, so the caller loads the model as it would without."""
    import onnxruntime as ort

    found = location(path)
    if not found.is_file() and PREPARE:
        _build(path, found, providers, min_bytes)
    if not found.is_file():
        return None
    try:
        return ort.InferenceSession(str(found), options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own classes
        log.warning("%s: the prepacked file does not load, loading the model (%s)", path.name, exc)
        return None


def _build(path: Path, target: Path, providers: Sequence[str], min_bytes: int) -> None:
    """Save the optimized model with its prepacked weights as external data, into a
    fresh directory renamed into place whole: a reader finds both files or neither."""
    import onnxruntime as ort

    work = Path(tempfile.mkdtemp(prefix=".prepacking-", dir=path.parent))
    try:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(work / path.name)
        for name, value in (
            ("session.save_external_prepacked_constant_initializers", "1"),
            ("session.optimized_model_external_initializers_file_name", path.name + ".data"),
            ("session.optimized_model_external_initializers_min_size_in_bytes", str(min_bytes)),
        ):
            options.add_session_config_entry(name, value)
        ort.InferenceSession(str(path), options, providers=list(providers))
        if not (work / path.name).is_file():
            log.info("%s: onnxruntime wrote no prepacked model; loading it unprepacked", path.name)
            return
        os.rename(work, target.parent)
    except Exception as exc:  # onnxruntime's own classes, or a full disk
        log.warning("%s: no prepacked weights (%s); loading it unprepacked", path.name, exc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
