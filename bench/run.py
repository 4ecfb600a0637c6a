"""`make bench`: polyserve side by side with what a user would pick instead.

Each scenario runs A (polyserve) and B (the baseline) alternately for several rounds
on this machine, reports medians and the A/B ratio of every round, and checks it
against its goal. Writes bench/results/<date>.json, BENCHMARKS.md and a PNG chart.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import REPO, bare_gunicorn, deploy, polyserve, uvicorn_server, wrk

EXAMPLE = REPO / "examples" / "python-onnx-tiny"
HELLO = (REPO / "examples" / "hello" / "hello.py").read_bytes()


def tar_of(folder: Path | None, extra: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(folder.iterdir()) if folder else ():
            if path.is_file():
                tar.add(path, arcname=path.name)
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def onnx_tiny_tar() -> bytes:
    return tar_of(EXAMPLE)


def heavy_tar() -> bytes:
    return tar_of(
        REPO / "bench" / "apps" / "heavy", {"model.onnx": (EXAMPLE / "model.onnx").read_bytes()}
    )


# -- A/B rounds ------------------------------------------------------------------------


def ab_rounds(
    a_url: str,
    b_url: str,
    args: argparse.Namespace,
    connections: tuple[int, ...] = (1, 32),
    scripts: tuple[Path | None, Path | None] = (None, None),
) -> dict[str, object]:
    """A and B alternately (A first in even rounds, B first in odd ones) for each
    connection count: -c 1 for latency, -c 32 for throughput. `scripts` are each
    side's wrk Lua script (a POST's body), if any."""
    sides = {"a": (a_url, scripts[0]), "b": (b_url, scripts[1])}
    for url, script in sides.values():  # warm up: imports, caches, connection pools
        wrk(url, 32, 1, script)
    runs: dict[int, list[tuple[dict, dict]]] = {c: [] for c in connections}
    for round_ in range(args.ab_rounds):
        for c in connections:
            order = ["a", "b"] if round_ % 2 == 0 else ["b", "a"]
            got = {}
            for side in order:
                url, script = sides[side]
                got[side] = wrk(url, c, args.seconds, script)
            runs[c].append((got["a"], got["b"]))
    out: dict[str, object] = {}
    for c, pairs in runs.items():
        out[f"c{c}"] = {
            "a_rps": harness.median([a["rps"] for a, _ in pairs]),
            "b_rps": harness.median([b["rps"] for _, b in pairs]),
            "a_p50_ms": harness.median([a["p50_ms"] for a, _ in pairs]),
            "b_p50_ms": harness.median([b["p50_ms"] for _, b in pairs]),
            "a_p99_ms": harness.median([a["p99_ms"] for a, _ in pairs]),
            "b_p99_ms": harness.median([b["p99_ms"] for _, b in pairs]),
            "rps_ratio_per_round": [round(a["rps"] / b["rps"], 3) for a, b in pairs],
            "p50_ratio_per_round": [round(a["p50_ms"] / b["p50_ms"], 3) for a, b in pairs],
            "errors": sum(a["non_2xx"] + b["non_2xx"] for a, b in pairs),
        }
        out[f"c{c}"]["rps_ratio"] = harness.median(out[f"c{c}"]["rps_ratio_per_round"])
        out[f"c{c}"]["p50_ratio"] = harness.median(out[f"c{c}"]["p50_ratio_per_round"])
    return out


def against_baseline(
    args,
    tmp: Path,
    space: str,
    upload: tuple[str, bytes],
    baseline: Callable[[], contextlib.AbstractContextManager[harness.Server]],
) -> dict:
    """`space` deployed on polyserve (A) against `baseline` serving it at / (B)."""
    with polyserve(args.workers, tmp / space.replace("/", "-")) as a, baseline() as b:
        deploy(a.url, space, *upload)
        return ab_rounds(a.url + f"/s/{space}/", b.url + "/", args)


@contextlib.contextmanager
def model_server_stack(workers: int) -> Iterator[harness.Server]:
    """What a model-server stack looks like: a front that forwards to a model server."""
    with (
        uvicorn_server("baseline_model:app", workers) as server,
        bare_gunicorn("model_front:app", workers, MODEL_SERVER_URL=server.url) as front,
    ):
        yield front


def scenario_dispatch(args, tmp: Path) -> dict:
    runs = against_baseline(
        args,
        tmp,
        "lee101/hello",
        ("hello.py", HELLO),
        lambda: bare_gunicorn("baseline_hello:app", args.workers),
    )
    return {
        "a": "a handle() hello space on polyserve",
        "b": "the same handler as a plain Starlette app on bare gunicorn",
        "goal": "throughput ratio >= 0.95",
        "met": runs["c32"]["rps_ratio"] >= 0.95,
        **runs,
    }


def scenario_model_server(args, tmp: Path) -> dict:
    runs = against_baseline(
        args,
        tmp,
        "lee101/onnx-tiny",
        ("onnx-tiny.tar", onnx_tiny_tar()),
        lambda: model_server_stack(args.workers),
    )
    return {
        "a": "the onnx-tiny space on polyserve",
        "b": "gunicorn front -> keep-alive HTTP client -> a separate uvicorn model server"
        " running the same model",
        "goal": ">= 10x throughput, p50 <= 0.2x",
        "met": runs["c32"]["rps_ratio"] >= 10 and runs["c1"]["p50_ratio"] <= 0.2,
        **runs,
    }


def scenario_model_inprocess(args, tmp: Path) -> dict:
    inprocess = run_script("inprocess.py", "--rounds", str(max(100, args.rounds * 40)))
    runs = against_baseline(
        args,
        tmp,
        "lee101/onnx-tiny",
        ("onnx-tiny.tar", onnx_tiny_tar()),
        lambda: bare_gunicorn("baseline_model:app", args.workers),
    )
    return {
        "a": "the onnx-tiny space on polyserve",
        "b": "the same model in a plain Starlette app on bare gunicorn; in-process, the"
        " two apps behind their protocols alone (bench/inprocess.py)",
        "goal": "throughput ratio >= 1.0",  # issue 14: no slower than the plain app
        "met": runs["c32"]["rps_ratio"] >= 1.0,
        "in_process": inprocess,
        **runs,
    }


def scenario_scaling(args, tmp: Path) -> dict:
    tar = heavy_tar()
    every_core = sorted(os.sched_getaffinity(0))  # 2 workers need 2 cores; wrk shares them
    with (
        polyserve(2, tmp / "two", cpus=every_core) as a,
        polyserve(1, tmp / "one", cpus=every_core) as b,
    ):
        for host in (a, b):
            deploy(host.url, "bench/heavy", "heavy.tar", tar)
        runs = ab_rounds(
            a.url + "/s/bench/heavy/", b.url + "/s/bench/heavy/", args, connections=(32,)
        )
    ratio = runs["c32"]["rps_ratio"]
    return {
        "a": "2 workers, a CPU-bound space (the model on 2,000 rows a call)",
        "b": "1 worker, the same space",
        "goal": ">= 1.7x",
        "met": ratio >= 1.7,
        **runs,
    }


def scenario_inference(args, tmp: Path) -> dict:
    """The onnx-tiny model deployed as model.onnx, over the Open Inference Protocol."""
    import inference

    body = inference.bodies(tmp)
    v2 = "/v2/models/lee101/digits/infer"
    with polyserve(1, tmp / "inference") as a:
        deploy(a.url, "lee101/digits", "model.onnx", inference.MODEL.read_bytes())
        deploy(a.url, "lee101/onnx-tiny", "onnx-tiny.tar", onnx_tiny_tar())
        own = a.url + "/s/lee101/onnx-tiny/"
        for name, url in (("v2_json", a.url + v2), ("v2_binary", a.url + v2), ("own_json", own)):
            body[name].check(url)
        memory = inference.memory(a.url, ("lee101/digits", "lee101/onnx-tiny"), args.rounds * 4)
        with inference.mlserver(tmp) as b:
            mlserver_url = b.url + "/v2/models/digits/infer"
            body["v2_json"].check(mlserver_url)
            vs_mlserver = ab_rounds(
                a.url + v2, mlserver_url, args, scripts=(body["v2_json"].script,) * 2
            )
            # The ceilings: what this stack does with no model server's work, and with the
            # least of it; polyserve's ratio can be no higher than theirs.
            answer = tmp / "v2_json.answer"
            answer.write_bytes(body["v2_json"].check(a.url + v2))
            ceiling = {}
            for name, app, env in (
                ("answer", "bare_answer:app", {"BARE_ANSWER": str(answer)}),
                ("model", "bare_model:app", {"BARE_MODEL": str(inference.MODEL)}),
            ):
                with bare_gunicorn(app, 1, **env) as bare:
                    body["v2_json"].check(bare.url)
                    ceiling[name] = ab_rounds(
                        bare.url,
                        mlserver_url,
                        args,
                        connections=(32,),
                        scripts=(body["v2_json"].script,) * 2,
                    )
        vs_own = ab_rounds(
            a.url + v2,
            own,
            args,
            connections=(32,),
            scripts=(body["v2_json"].script, body["own_json"].script),
        )
        binary = ab_rounds(
            a.url + v2,
            a.url + v2,
            args,
            connections=(32,),
            scripts=(body["v2_binary"].script, body["v2_json"].script),
        )
    goals = {
        "mlserver_rps": vs_mlserver["c32"]["rps_ratio"] >= 10,
        "mlserver_p50": vs_mlserver["c1"]["p50_ratio"] <= 0.1,
        "own_json_rps": vs_own["c32"]["rps_ratio"] >= 1.5,
        "binary_rps": binary["c32"]["rps_ratio"] >= 1.2,
        "memory": memory["ratio"] <= 1.0,
    }
    return {
        "a": "the onnx-tiny model deployed as model.onnx: V2 JSON infers on polyserve",
        "b": f"{inference.MLSERVER} with a custom ONNX runtime class, one process; then"
        " the example's hand-written JSON POST (same host); then V2 JSON against V2 binary",
        "goal": "vs MLServer >= 10x throughput (-c 32), p50 <= 0.1x (-c 1); >= 1.5x the"
        " example's JSON POST; binary >= 1.2x JSON; memory <= the Python space's (ceilings:"
        " an ASGI app answering fixed bytes, and a model server that checks nothing, on"
        " the same stack, against MLServer)",
        "met": all(goals.values()),
        "goals": goals,
        **vs_mlserver,
        "ceiling": ceiling,
        "vs_own_json": vs_own,
        "binary_vs_json": binary,
        "memory": memory,
    }


SWEEP = (1, 2, 4, 8, 16, 32, 64)


def scenario_batching(args, tmp: Path) -> dict:
    """A weight-bound model with [batching] against the same model without, one worker."""
    import batching
    import inference
    import matmul

    model = matmul.model()
    body = batching.body(tmp)
    with polyserve(1, tmp / "batching") as a:
        for space, batched in (("lee101/batched", True), ("lee101/plain", False)):
            deploy(a.url, space, "m.tar", batching.model_tar(model, batched))
        on, off = (a.url + f"/v2/models/lee101/{s}/infer" for s in ("batched", "plain"))
        for url in (on, off):
            body.check(url)
        # Fewer rounds than an A/B of one connection count: seven counts, side by side.
        sweep_args = argparse.Namespace(**{**vars(args), "ab_rounds": args.rounds})
        sweep = ab_rounds(on, off, sweep_args, connections=SWEEP, scripts=(body.script,) * 2)
        usage = httpx2.get(a.url + "/_polyserve/usage").json()["spaces"]["lee101/batched"]
        json_body = batching.json_body(tmp)
        # Adaptive batching up to the same rows, waiting at most 1 ms (its smallest useful).
        adaptive = {"max_batch_size": batching.MAX_ROWS, "max_batch_time": 0.001}
        with inference.mlserver(tmp, "matmul", model, **adaptive) as b:
            mlserver_url = b.url + "/v2/models/matmul/infer"
            json_body.check(mlserver_url)
            vs_mlserver = ab_rounds(
                on, mlserver_url, args, connections=(32,), scripts=(body.script, json_body.script)
            )
    path = tmp / "matmul.onnx"
    path.write_bytes(model)
    rows8 = batching.eight_rows(path)
    c1, c32 = sweep["c1"], sweep["c32"]
    p99 = c32["a_p99_ms"] / c32["b_p99_ms"]
    goals = {
        "rps_c32": c32["rps_ratio"] >= 6,
        "p99_c32": p99 <= 0.5,
        "p50_c1": c1["p50_ratio"] <= 1.05,
        "mlserver_rps_c32": vs_mlserver["c32"]["rps_ratio"] >= 5,
        "eight_rows": rows8["ratio"] <= 1.1,
    }
    return {
        "a": "a 20 MiB MatMul model space with [batching] max_rows = 64, binary V2 infers of"
        " one row, 1 worker",
        "b": "the same model space without [batching] (same host); then MLServer 1.7.1 with"
        " adaptive batching (max_batch_size 64, max_batch_time 1 ms) over V2 JSON",
        "goal": ">= 6x throughput and p99 <= 0.5x at -c 32, p50 within 5% at -c 1; >= 5x"
        " MLServer at -c 32; an 8-row call within 10% of a plain prepacked session's",
        "met": all(goals.values()),
        "goals": goals,
        "p99_ratio_c32": round(p99, 3),
        **sweep,
        "vs_mlserver": vs_mlserver,
        "eight_rows": rows8,
        "usage": {k: usage.get(k) for k in ("requests", "batches")},
    }


# -- cold start, density, deploy, metering ---------------------------------------------


def run_script(name: str, *argv: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / name), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if done.returncode:  # say why: the traceback is in the script's stderr
        sys.stderr.write(done.stderr)
        done.check_returncode()
    return json.loads(done.stdout)


def percentile(values: list[float], q: int) -> float:
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


def scenario_cold_start(args, tmp: Path) -> dict:
    inproc = run_script(
        "cold_start.py", "--cycles", str(args.cold_cycles), "--processes", str(args.fresh_processes)
    )
    # The same through a real 1-worker host: release on demand, then one timed call.
    times = []
    with polyserve(1, tmp / "cold") as host:
        deploy(host.url, "lee101/onnx-tiny", "onnx-tiny.tar", onnx_tiny_tar())
        with httpx2.Client(base_url=host.url) as client:
            client.get("/s/lee101/onnx-tiny/")
            for _ in range(args.cold_cycles):
                client.post("/_polyserve/spaces/lee101/onnx-tiny/release").raise_for_status()
                t0 = time.perf_counter()
                client.get("/s/lee101/onnx-tiny/").raise_for_status()
                times.append((time.perf_counter() - t0) * 1000)
            warm = []
            for _ in range(args.cold_cycles):
                t0 = time.perf_counter()
                client.get("/s/lee101/onnx-tiny/").raise_for_status()
                warm.append((time.perf_counter() - t0) * 1000)
    http = {
        "n": len(times),
        "p50_ms": harness.median(times),
        "p99_ms": percentile(times, 99),
        "warm_call_p50_ms": harness.median(warm),
    }
    reimport = inproc["reimport"]
    met = reimport["p50_ms"] <= 5 and reimport["p99_ms"] <= 20
    return {
        "a": "re-import after a release, and the first load in a fresh worker",
        "b": "the product note's 500 ms budget",
        "goal": "p50 <= 5 ms, p99 <= 20 ms",
        "met": met,
        **inproc,
        "through_http_after_release": http,
    }


def scenario_density(args, tmp: Path) -> dict:
    density = run_script("density.py", "--spaces", str(args.density_spaces))
    usage = usage_with_many(tmp / "usage", args.usage_spaces)
    met = density["kib_per_space"] <= 256 and usage["p50_ms"] <= 20
    return {
        "a": f"{args.density_spaces} distinct onnx-tiny spaces loaded in one worker",
        "b": "the worker's RSS before",
        "goal": "<= 256 KiB per loaded space;"
        f" usage answer <= 20 ms with {args.usage_spaces} deployed",
        "met": met,
        **density,
        "usage_answer": usage,
    }


def usage_with_many(data_dir: Path, spaces: int) -> dict:
    """GET /_polyserve/usage on a real host whose store holds `spaces` spaces."""
    data_dir.mkdir(parents=True)
    # The slot map as deploys would have written it (publishing 10,000 real versions
    # would only time the validator).
    (data_dir / "slots.log").write_text("".join(f"{i}\tbench/s{i}\n" for i in range(spaces)))
    times = []
    with (
        polyserve(1, data_dir, POLYSERVE_MAX_SPACES=str(spaces)) as host,
        httpx2.Client(base_url=host.url) as client,
    ):
        body = client.get("/_polyserve/usage").json()
        assert len(body["spaces"]) == spaces
        for _ in range(30):
            t0 = time.perf_counter()
            client.get("/_polyserve/usage").raise_for_status()
            times.append((time.perf_counter() - t0) * 1000)
    return {"spaces": spaces, "p50_ms": harness.median(times), "p99_ms": percentile(times, 99)}


def scenario_deploy(args, tmp: Path) -> dict:
    blob = os.urandom(3 << 20)

    def source(n: int) -> bytes:
        return f"def handle(request):\n    return {{'v': {n}}}\n".encode()

    uploads = {  # kind -> (space, upload of version n)
        ".py": ("bench/py", lambda n: ("v.py", source(n))),
        "3 MB tar": (
            "bench/tar",
            lambda n: ("v.tar", tar_of(None, {"main.py": source(n), "weights.bin": blob})),
        ),
    }
    results = {}
    # Two workers on every core: "no stale answer after the 200" is about other workers.
    every_core = sorted(os.sched_getaffinity(0))
    with polyserve(2, tmp / "deploy", cpus=every_core) as host:
        harness.forkserver_pid(host)  # warm: deploys would spawn validators until then
        for kind, (space, upload) in uploads.items():
            times, stale, calls = [], 0, 0
            for n in range(1, args.deploys + 1):
                filename, content = upload(n)
                t0 = time.perf_counter()
                deploy(host.url, space, filename, content)
                times.append((time.perf_counter() - t0) * 1000)
                for _ in range(8):  # fresh connections reach both workers
                    got = httpx2.get(
                        host.url + f"/s/{space}/", headers={"Connection": "close"}
                    ).json()
                    calls += 1
                    stale += got != {"v": n}
            results[kind] = {
                "deploys": len(times),
                "p50_ms": harness.median(times),
                "p99_ms": percentile(times, 99),
                "calls_after_200": calls,
                "stale": stale,
            }
    met = all(r["p50_ms"] <= 300 and r["stale"] == 0 for r in results.values())
    onnx = deploy_onnx_tiny(args, tmp)
    after = onnx["forkserver"]
    met = met and after["p50_ms"] <= 50 and 0.5 <= onnx["import_to_worker_load"] <= 2
    return {
        "a": "deploy -> 200, then calls on every worker; onnx-tiny: validation forked from"
        " the fork server (POLYSERVE_VALIDATE_FORKSERVER=1, the default)",
        "b": "onnx-tiny: a new interpreter per validation (POLYSERVE_VALIDATE_FORKSERVER=0),"
        " deploys alternated with A's",
        "goal": "p50 <= 300 ms, 0 stale answers after the 200; onnx-tiny p50 <= 50 ms with"
        " its import_ms within 2x of a worker's own load of it",
        "met": met,
        **results,
        "onnx-tiny": onnx,
    }


def deploy_onnx_tiny(args, tmp: Path) -> dict:
    """onnx-tiny deploys on a host whose validations fork from the fork server, alternated
    with a host that spawns a new interpreter per validation; after each deploy, one call
    loads the new version in the worker, whose own import time is read from usage."""
    files = {p.name: p.read_bytes() for p in sorted(EXAMPLE.iterdir()) if p.is_file()}
    space = "lee101/onnx-tiny"
    sides = {"forkserver": "1", "spawn": "0"}
    every_core = sorted(os.sched_getaffinity(0))
    rows: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    with contextlib.ExitStack() as stack:
        hosts = {
            side: stack.enter_context(
                polyserve(
                    1, tmp / f"onnx-{side}", cpus=every_core, POLYSERVE_VALIDATE_FORKSERVER=on
                )
            )
            for side, on in sides.items()
        }
        harness.forkserver_pid(hosts["forkserver"])  # warm: deploys would spawn until then
        for n in range(args.deploys + 1):  # deploy 0 warms both hosts up: not counted
            order = list(sides) if n % 2 else list(reversed(sides))
            for side in order:
                url = hosts[side].url
                content = tar_of(None, {**files, "main.py": files["main.py"] + f"# {n}\n".encode()})
                t0 = time.perf_counter()
                answer = deploy(url, space, "onnx-tiny.tar", content)
                took = (time.perf_counter() - t0) * 1000
                httpx2.get(url + f"/s/{space}/", timeout=30).raise_for_status()
                usage = httpx2.get(url + "/_polyserve/usage", timeout=30).json()
                if n:
                    rows[side].append(
                        {
                            "ms": took,
                            "import_ms": answer["import_ms"],
                            "worker_load_ms": usage["spaces"][space]["last_import_ms"],
                        }
                    )
    out: dict[str, dict[str, float]] = {}
    for side, got in rows.items():
        times = [r["ms"] for r in got]
        out[side] = {
            "deploys": len(got),
            "p50_ms": harness.median(times),
            "p99_ms": percentile(times, 99),
            "import_ms_p50": harness.median([r["import_ms"] for r in got]),
            "worker_load_ms_p50": harness.median([r["worker_load_ms"] for r in got]),
        }
    a, b = out["forkserver"], out["spawn"]
    return {
        **out,
        "p50_ratio": round(a["p50_ms"] / b["p50_ms"], 3),
        "import_to_worker_load": round(a["import_ms_p50"] / a["worker_load_ms_p50"], 2),
    }


def scenario_metering(args, tmp: Path) -> dict:
    result = run_script("meter_bench.py", "--rounds", str(max(3, args.rounds)))
    return {
        "a": "meter writes per request (begin + end)",
        "b": "the same loop without them",
        "goal": "<= 1 us",
        "met": result["meter_writes_ns_p50"] <= 1000,
        **result,
    }


def scenario_strict(args, tmp: Path) -> dict:
    inprocess = run_script("strict_bench.py", "--rounds", str(max(100, args.rounds * 40)))
    plain = {"GUNICORN_CMD_ARGS": f"-k plain_worker.PlainWorker --pythonpath {harness.APPS}"}
    with (
        polyserve(args.workers, tmp / "strict") as a,
        polyserve(args.workers, tmp / "plain", **plain) as b,
    ):
        for host in (a, b):
            deploy(host.url, "lee101/hello", "hello.py", HELLO)
        runs = ab_rounds(a.url + "/s/lee101/hello/", b.url + "/s/lee101/hello/", args)
    return {
        "a": "the hello space on polyserve, whose worker refuses malformed requests"
        " (polyserve/http/strict.py)",
        "b": "the same on polyserve with uvicorn's own httptools protocol"
        " (bench/apps/plain_worker.py); in-process, the two protocols alone",
        "goal": "in-process <= 1.5 us more per request (data_received, median), -c 32 ratio"
        " >= 0.97",
        "met": inprocess["strict_minus_plain_data_received_median_us"] <= 1.5
        and runs["c32"]["rps_ratio"] >= 0.97,
        "in_process": inprocess,
        **runs,
    }


def scenario_fleet(args, tmp: Path) -> dict:
    result = run_script(
        "fleet.py", "--deploys", str(args.deploys), "--spaces", str(args.usage_spaces)
    )
    if "skipped" in result:
        return {"a": "-", "b": "-", "goal": "-", "met": False, **result}
    return {
        "a": "a fleet of 3 hosts on one PostgreSQL (1 worker each)",
        "b": "a single host (no database), deploys alternated with the fleet's",
        "goal": "fleet deploy p50 <= 2x a single host's; catch-up >= 200 versions/s;"
        " fleet usage <= 100 ms with 3 hosts x 10,000 spaces",
        "met": all(part["met"] for part in result.values()),
        **result,
    }


def scenario_fleet_size(args, tmp: Path) -> dict:
    # Small enough for make bench (about a minute); the fleet at full size is
    # `python bench/fleet_sim.py --followers 50 --spaces 100000` (bench/NOTES.md).
    result = run_script("fleet_sim.py", "--followers", "20", "--spaces", "1000", "--deploys", "10")
    if "skipped" in result:
        return {"a": "-", "b": "-", "goal": "-", "met": False, **result}
    return {
        "a": "a deploy acknowledged by 20 follower processes (no workers) and one real host"
        " on one PostgreSQL, 1,000 spaces",
        "b": "a single host (no database), deploys alternated with the fleet's",
        **result,
    }


def scenario_preload(args, tmp: Path) -> dict:
    result = run_script("preload.py", "--samples", str(max(5, args.rounds * 4)))
    a = result["preload"]
    return {
        "a": "POLYSERVE_PRELOAD=numpy,onnxruntime (the default): a fresh worker's first load",
        "b": "POLYSERVE_PRELOAD= (nothing preloaded), fresh workers alternated with A's",
        "goal": "first onnx-tiny load in a fresh worker p50 <= 5 ms, p99 <= 20 ms,"
        " billed memory <= 2 MiB",
        "met": a["first_load_p50_ms"] <= 5
        and a["first_load_p99_ms"] <= 20
        and a["memory_kib_p50"] <= 2048,
        **result,
    }


def scenario_sharing(args, tmp: Path) -> dict:
    result = run_script("sharing.py", "--calls", str(max(20, args.rounds * 10)))
    shared, ratios = result["shared"], result["ratios"]
    return {
        "a": "a generated 20 MiB MatMul model on 8 workers, loaded with"
        " polyserve.models.onnx_session",
        "b": "the same model as a plain onnxruntime.InferenceSession (a copy per worker),"
        " on a second 8-worker host, calls alternated with A's",
        "goal": "the host's memory for the model <= 1.5 copies; first request after a release"
        " and warm 1-row request within 10% of B's (or faster)",
        "met": shared["host_memory_copies"] <= 1.5
        and ratios["first_after_release"] <= 1.1
        and ratios["warm_1_rows"] <= 1.1,
        **result,
    }


def scenario_dependencies(args, tmp: Path) -> dict:
    result = run_script("deps.py", "--rounds", str(max(5, args.rounds * 2)))
    return {
        "a": "a deploy whose requirements.txt set is installed already (cached); and one"
        " whose set is new (fresh: uv installs it, its cache warm)",
        "b": "the same deploy without requirements.txt; and pip install --target of the set",
        "goal": "cached-set deploy p50 within 20 ms of the deploy without dependencies",
        "met": result["cached_overhead_p50_ms"] <= 20,
        **result,
    }


def scenario_autoscale(args, tmp: Path) -> dict:
    result = run_script("autoscale.py", "--rounds", str(max(5, args.rounds * 2)))
    if "skipped" in result:
        return {"a": "-", "b": "-", "goal": "-", "met": False, **result}
    w = {k.removeprefix("POLYSERVE_").lower(): float(v) for k, v in result["windows"].items()}
    # What the machinery may add to the windows: one interval to notice, a host's boot
    # (measured as b) to start, and for a scale-down the drain and a graceful stop.
    up_bound = w["scale_up_window_s"] + 2 * w["scale_interval_s"] + 2 * result["host_boot_s"]
    down_bound = w["scale_down_window_s"] + 2 * w["scale_interval_s"] + w["drain_s"] + 5
    return {
        "a": "`polyserve autoscale`, local provider, 1..2 hosts of 1 worker, 6 clients",
        "b": "one fleet host started by hand (boot to answering)",
        "goal": "new host serving <= up window + 2 intervals + 2 boots; back at the minimum"
        " <= down window + 2 intervals + drain + 5 s",
        "met": result["load_to_new_host_serving_s"] <= up_bound
        and result["load_stopped_to_minimum_s"] <= down_bound,
        **result,
    }


def scenario_memory_cap(args, tmp: Path) -> dict:
    out = run_script(
        "memory_cap.py", "--spaces", str(args.memcap_spaces), "--cap-mb", str(args.memcap_mb)
    )
    capped, uncapped = out["capped"], out["uncapped"]
    # The cap bounds anonymous memory; the goal is on the whole RSS (the worker's VmHWM),
    # within 10% of the cap: checked around loads, not at every byte, and plus the
    # worker's file-backed pages.
    met = capped["errors"] == 0 and capped["peak_rss_mb"] <= 1.1 * args.memcap_mb
    return {
        "a": f"{out['spaces']} spaces of {out['mib']} MiB round-robin, one worker capped at"
        f" {args.memcap_mb} MiB",
        "b": "the same without a cap (POLYSERVE_WORKER_MEMORY_MB=0)",
        "goal": "peak RSS <= cap + 10%, 0 errors; hit rate and cold-start p99 reported",
        "met": met,
        "peak_rss_over_cap": round(capped["peak_rss_mb"] / args.memcap_mb, 3),
        "cold_start_p99_ratio": round(
            capped["cold_start_p99_ms"] / max(uncapped["cold_start_p99_ms"], 1e-9), 2
        ),
        **out,
    }


SCENARIOS: dict[str, Callable[[argparse.Namespace, Path], dict]] = {
    "dispatch overhead": scenario_dispatch,
    "in-process vs a model server": scenario_model_server,
    "model in-process": scenario_model_inprocess,
    "cold start": scenario_cold_start,
    "density": scenario_density,
    "deploy": scenario_deploy,
    "scaling": scenario_scaling,
    "metering": scenario_metering,
    "strict HTTP": scenario_strict,
    "fleet": scenario_fleet,
    "fleet at size": scenario_fleet_size,
    "preload": scenario_preload,
    "autoscale": scenario_autoscale,
    "dependencies": scenario_dependencies,
    "model sharing": scenario_sharing,
    "memory cap": scenario_memory_cap,
    "inference protocol": scenario_inference,
    "batching": scenario_batching,
}


# -- the machine and the report ---------------------------------------------------------


def machine() -> dict[str, object]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 // 1024
    wrk_version = (
        subprocess.run([harness.wrk_path(), "-v"], capture_output=True, text=True)
        .stdout.split("[")[0]
        .strip()
    )
    from importlib.metadata import version

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "wrk": wrk_version,
        "packages": {
            p: version(p)
            for p in (
                "gunicorn",
                "uvicorn",
                "uvicorn-worker",
                "starlette",
                "onnxruntime",
                "uvloop",
                "httptools",
            )
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="the repeats' scale (samples, runs)")
    # Many short wrk rounds, not a few long ones: a round's A/B ratio scatters by ~13% on
    # this machine, whether it lasts 1 s or 3 s, so only their number narrows the median
    # (bench/NOTES.md, "How many rounds an A/B needs").
    parser.add_argument("--ab-rounds", type=int, help="wrk A/B rounds (default: 4x --rounds)")
    parser.add_argument("--seconds", type=int, default=1, help="per wrk run")
    # As many workers as the servers' cores (one here) for A and B alike; wrk gets the rest.
    parser.add_argument("--workers", type=int, default=len(harness.SERVER_CPUS))
    parser.add_argument("--cold-cycles", type=int, default=200)
    parser.add_argument("--fresh-processes", type=int, default=20)
    parser.add_argument("--density-spaces", type=int, default=1000)
    parser.add_argument("--usage-spaces", type=int, default=10_000)
    parser.add_argument("--deploys", type=int, default=20)
    parser.add_argument("--memcap-spaces", type=int, default=3000)
    parser.add_argument("--memcap-mb", type=int, default=512)
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(SCENARIOS),
        help="run only these scenarios (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--report", type=Path, default=REPO / "BENCHMARKS.md")
    args = parser.parse_args()
    args.ab_rounds = args.ab_rounds or 4 * args.rounds
    harness.wrk_path()  # says how to install wrk before anything starts
    date = datetime.date.today().isoformat()
    path = args.out / f"{date}.json"
    results = {"date": date, "machine": machine(), "commands": [], "scenarios": {}}
    if args.only and path.exists():  # a partial run updates the day's results, in place
        results = json.loads(path.read_text())
    results["commands"].append(" ".join(sys.argv))
    with tempfile.TemporaryDirectory(prefix="polyserve-bench-") as tmp:
        for name, scenario in SCENARIOS.items():
            if args.only and name not in args.only:
                continue
            print(f"-- {name}", file=sys.stderr, flush=True)
            results["scenarios"][name] = scenario(args, Path(tmp))
            # After each scenario: one that fails keeps what ran before it, and
            # `--only` of the rest then completes the day's results.
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=1) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    import report

    chart = report.chart(results, args.out / f"{date}.png")
    args.report.write_text(report.markdown(results, chart, args.report.parent))
    print(json.dumps({n: s["met"] for n, s in results["scenarios"].items()}))


if __name__ == "__main__":
    main()
