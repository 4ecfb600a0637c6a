"""Smoke tests: the benchmarks run (one short round); their figures are not checked here."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.postgres import INSTALL_HINT, find_bindir


def run_bench(script: str, *args: str) -> dict:
    argv = [sys.executable, f"bench/{script}", *args]
    return json.loads(
        subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=True).stdout
    )


def test_meter_bench_runs_one_short_round():
    result = run_bench("meter_bench.py", "--rounds", "1", "--n", "1000")
    assert result["scenario"] == "metering" and result["rounds"] == 1
    assert result["metered_ns_p50"] > 0 and result["baseline_ns_p50"] > 0


def test_split_bench_runs_one_short_round():
    result = run_bench("split_bench.py", "--rounds", "1", "--n", "1000")
    assert set(result) == {"none", "drawn", "sticky"}


def test_logs_bench_runs_one_short_round():
    result = run_bench("logs_bench.py", "--rounds", "1", "--n", "10000")
    assert result["scenario"] == "logs" and result["rounds"] == 1
    assert result["kept_print_us_p50"] > 0 and result["dropped_print_us_p50"] > 0


def test_cold_start_bench_runs_one_short_round():
    result = run_bench("cold_start.py", "--cycles", "4", "--processes", "1")
    assert result["reimport"]["n"] == 4 and result["fresh_worker"]["n"] == 1
    assert result["reimport_second_half"]["modules_growth"] == 0


def test_inprocess_bench_runs_one_short_round():
    """polyserve's worker app and the plain Starlette app, in one process, both answer."""
    result = run_bench("inprocess.py", "--rounds", "2", "--requests", "20")
    assert result["rounds"] == 2 and result["a_median_us"] > 0 and result["b_median_us"] > 0


def test_pinned_bench_runs_one_short_round():
    """A kept version by name, the plain path and the current one by name all answer."""
    result = run_bench("pinned.py", "--rounds", "3", "--requests", "20")
    assert result["rounds"] == 3 and result["kept_median_us"] > 0
    assert result["lease_kept_ns"] > 0 and result["lease_plain_ns"] > 0


@pytest.mark.gunicorn  # polyserve dev starts a host
def test_dev_save_bench_runs_one_short_round():
    """A few saves under `polyserve dev`: each is served, and Ctrl-C ends it cleanly."""
    result = run_bench("dev_save.py", "--saves", "2")
    assert result["scenario"] == "dev save" and result["saves"] == 2
    assert result["save_to_serving_ms_p50"] > 0 and result["exit_status"] == 0


@pytest.mark.gunicorn  # starts two one-worker hosts
def test_memory_cap_bench_runs_one_short_round():
    """A few spaces, capped and not: both runs answer every request."""
    result = run_bench("memory_cap.py", "--spaces", "12", "--mib", "4", "--passes", "1")
    capped, uncapped = result["capped"], result["uncapped"]
    assert capped["requests"] == uncapped["requests"] == 12
    assert capped["cold_starts"] == uncapped["cold_starts"] == 12


@pytest.mark.gunicorn  # bench/run.py starts hosts
@pytest.mark.skipif(
    shutil.which("wrk") is None,
    reason="make bench drives load with wrk: install it with `apt-get install wrk` (.ci/run does)",
)
def test_make_bench_runs_one_short_round(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "bench/run.py",
            "--rounds",
            "1",
            "--ab-rounds",
            "1",
            "--seconds",
            "1",
            "--only",
            "dispatch overhead",
            "--out",
            str(tmp_path),
            "--report",
            str(tmp_path / "BENCHMARKS.md"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert list(json.loads(out)) == ["dispatch overhead"]
    (results,) = tmp_path.glob("*.json")
    scenario = json.loads(results.read_text())["scenarios"]["dispatch overhead"]
    assert len(scenario["c32"]["rps_ratio_per_round"]) == 1 and scenario["c32"]["a_rps"] > 0
    assert "## dispatch overhead" in (tmp_path / "BENCHMARKS.md").read_text()
    assert next(tmp_path.glob("*.png")).stat().st_size > 0


@pytest.mark.gunicorn  # bench/sharing.py starts two hosts
def test_sharing_bench_runs_one_short_round():
    result = run_bench("sharing.py", "--workers", "2", "--calls", "2")
    assert result["workers"] == 2 and result["calls"] == 2
    assert result["shared"]["mapped_kib"] > 0 and result["plain"]["mapped_kib"] == 0
    assert set(result["ratios"]) == {
        "first_after_release",
        "warm_1_rows",
        "warm_8_rows",
        "warm_64_rows",
    }


@pytest.mark.gunicorn
def test_the_gpu_check_runs_its_onnx_part_without_a_gpu():
    """`make gpu-check`'s script, where NVML sees no GPU: a host told it has GPU 0 refuses
    the model (this onnxruntime has no CUDA provider), and the CPU host serves it."""
    result = run_bench("gpu_check.py", "--without-gpu")
    assert result["onnx"]["gpu_host"]["deploy"] == 422
    assert "CPUExecutionProvider" in result["onnx"]["gpu_host"]["refusal"]["error"]
    assert result["onnx"]["cpu_host"]["infer"]["status"] == 200


def test_gate_bench_runs_one_short_round():
    result = run_bench("gate_bench.py", "--rounds", "1", "--n", "1000")
    assert result["scenario"] == "gate" and result["rounds"] == 1
    assert result["baseline_ns_p50"] > 0 and "private_8_keys_ns_p50" in result


@pytest.mark.gunicorn  # bench/fleet_sim.py starts a real host and a single one
@pytest.mark.postgres
@pytest.mark.skipif(find_bindir() is None, reason=INSTALL_HINT)
def test_fleet_sim_runs_tiny():
    """2 real followers and 50 spaces on a real PostgreSQL: every figure is there."""
    result = run_bench(
        "fleet_sim.py", "--followers", "2", "--spaces", "50", "--deploys", "2", "--behind", "30"
    )
    assert (result["followers"], result["spaces"], result["files"]) == (2, 50, "served")
    assert [level["followers"] for level in result["levels"]] == [0, 1, 2]
    for level in result["levels"]:
        for part in ("single_host_deploy", "fleet_deploy", "acknowledged_by_all", "commit"):
            assert level[part]["p50_ms"] > 0 and level[part]["p99_ms"] >= level[part]["p50_ms"]
        assert level["connections"] > 0
    # Each follower holds connections of its own: the fleet's count grows with them.
    assert result["follower"]["connections"] > 0
    assert result["catch_up"]["versions_behind"] == 30
    # The real host served 10 of the 50: it holds their slots and files, and no others.
    assert result["served_few"] == {
        "deployed": 50,
        "served": 10,
        "slots": 10,
        "versions_on_disk": 10,
        "met": True,
    }
    assert result["catch_up"]["seconds_to_applied"] > 0
    tables = result["database"]["tables"]
    assert tables["polyserve_spaces"]["rows"] == 50 + 2  # the seeded, the two deployed
    assert tables["polyserve_hosts"]["rows"] == 3 and tables["polyserve_versions"]["bytes"] > 0
    assert result["ledger_per_boot"]["bytes_per_space"] > 0
    assert isinstance(result["met"], bool)
