"""Modules preloaded by the master before it forks: shared by the workers, frozen for the
collector, never tenant code; a space's memory is what it added itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyserve import settings
from tests.helpers import REPO, HostProcess, make_tar

# What a worker holds when its first space is imported: nothing in the worker imported
# onnxruntime before (polyserve itself never does), so only the master can have.
PROBE = """
import gc, sys
HAD_ORT = "onnxruntime" in sys.modules
HAD_MODELS = "polyserve.models" in sys.modules  # imported by the onnxruntime warm-up
FROZEN = gc.get_freeze_count()
import onnxruntime
def handle(request):
    return {"had_ort": HAD_ORT, "had_models": HAD_MODELS, "frozen": FROZEN}
"""


def mapped(pid: int, needle: str) -> bool:
    return needle in Path(f"/proc/{pid}/maps").read_text()


def test_the_master_imports_the_preload_before_forking_and_freezes_its_heap(host_factory):
    host = host_factory(workers=1)
    assert mapped(host.proc.pid, "onnxruntime_pybind11_state")  # in the master itself
    assert host.deploy("t/probe", PROBE).status_code == 200
    body = host.get("/s/t/probe/").json()
    assert body["had_ort"] is True  # inherited from the master, not imported here
    assert body["had_models"] is True  # what model spaces load with, likewise
    assert body["frozen"] > 10_000  # the master's objects, moved out of the collector's way


# A model space's import, counting the pages its session writes for the first time in
# this process (minor faults of the importing thread: copy-on-write copies, mostly).
FAULTS = """
import resource, sys
from pathlib import Path
from polyserve.models import onnx_session
before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
session = onnx_session(Path(__file__).parent / "model.onnx")
FAULTS = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
OURS = [name for name in sys.modules if name.startswith("_ps_") and "t__faults" not in name]
def handle(request):
    return {"faults": FAULTS, "ours": OURS}
"""
EXAMPLE = REPO / "examples" / "python-onnx-tiny"


def test_a_worker_pays_at_boot_what_its_first_model_load_would_copy(host_factory):
    """A fresh worker's first onnx-tiny session copied ~290 of the master's pages here
    (7 µs each) before the boot warm-up, and ~120 with it (a second session, ~20). The
    warm-up's own space leaves nothing: no module, no usage, no log."""
    host = host_factory(workers=1)
    model = (EXAMPLE / "model.onnx").read_bytes()
    tar = make_tar({"main.py": FAULTS, "model.onnx": model})
    assert host.deploy("t/faults", tar, filename="faults.tar").status_code == 200
    body = host.get("/s/t/faults/").json()
    assert body["faults"] < 200, body
    assert body["ours"] == []  # the warm-up's package is forgotten
    usage = host.get("/_polyserve/usage").json()["spaces"]
    assert set(usage) == {"t/faults"}
    assert not (host.data_dir / "logs" / "polyserve").exists()
    assert not (host.data_dir / "spaces" / "polyserve").exists()


def test_an_empty_preload_preloads_nothing(host_factory):
    host = host_factory(workers=1, POLYSERVE_PRELOAD="")
    assert not mapped(host.proc.pid, "onnxruntime_pybind11_state")
    assert host.deploy("t/probe", PROBE).status_code == 200
    body = host.get("/s/t/probe/").json()
    assert (body["had_ort"], body["had_models"]) == (False, False)


@pytest.mark.gunicorn
def test_a_preload_that_cannot_be_imported_stops_the_host(tmp_path):
    host = HostProcess(tmp_path / "data", POLYSERVE_PRELOAD="numpy,no_such_module_here")
    code, logged = host.start_expecting_exit()
    assert code == 78  # EX_CONFIG, as a bad tokens file
    assert "POLYSERVE_PRELOAD: cannot import no_such_module_here" in logged


@pytest.mark.parametrize(
    ("raw", "parsed"),
    [
        ("", ()),
        ("numpy", ("numpy",)),
        (" numpy , onnxruntime.capi ", ("numpy", "onnxruntime.capi")),
    ],
)
def test_preload_setting(raw, parsed):
    assert settings.load({"POLYSERVE_PRELOAD": raw}).preload == parsed


def test_preload_default_and_bad_names():
    assert settings.load({}).preload == ("numpy", "onnxruntime")
    with pytest.raises(ValueError, match="POLYSERVE_PRELOAD='os; rm': 'os; rm' is not a module"):
        settings.load({"POLYSERVE_PRELOAD": "os; rm"})


def test_the_onnxruntime_warmup_builds_a_working_session():
    """The shipped model is valid: a warm-up that raised would stop every host."""
    import numpy as np
    import onnxruntime

    from polyserve.serve import warmup

    warmup.WARMUPS["onnxruntime"]()
    model = str(warmup.WARM_ONNX)
    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"x": np.asarray([[2.5]], dtype=np.float32)})
    assert out.tolist() == [[1.0]]  # divided by its largest value
