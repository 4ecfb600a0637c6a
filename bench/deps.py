"""Per-space dependencies, measured on a real 1-worker host with no network: a deploy
whose set is installed already (cached) and one whose set is new (fresh, uv's cache
warm), each against the same deploy without dependencies, alternated in one run; and
`pip install --target` of the same set beside uv's fresh install.

Prints one JSON object. Run by `make bench` (scenario "dependencies"), or alone:
`python bench/deps.py --rounds 10`.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import harness
import httpx2

sys.path.insert(0, str(harness.REPO))
from tests.wheels import make_testpkg, wheel  # the repo root, just added

MODULES = 200  # a pure-Python package of this many modules, ~1 MiB: a small real library
MAIN = (
    "def handle(request):\n"
    "    import polyserve_benchpkg, polyserve_testpkg  # used lazily: the same import work\n"
    "    return polyserve_testpkg.__version__\n"
)
REQUIREMENTS = "polyserve-testpkg==1.0\npolyserve-benchpkg==1.0\n"


def wheelhouse(directory: Path) -> Path:
    directory.mkdir(parents=True)
    make_testpkg(directory, "1.0")
    body = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(200))
    files = {f"polyserve_benchpkg/m{i}.py": body for i in range(MODULES)}
    files["polyserve_benchpkg/__init__.py"] = "__version__ = '1.0'\n"
    wheel(directory, "polyserve-benchpkg", "1.0", files)
    return directory


def tar(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def timed_deploy(url: str, space: str, content: bytes) -> tuple[float, dict]:
    started = time.perf_counter()
    r = httpx2.post(
        url + "/_polyserve/deploy",
        data={"space": space},
        files={"module": ("space.tar", content)},
        timeout=120,
    )
    elapsed = (time.perf_counter() - started) * 1000
    r.raise_for_status()
    return elapsed, r.json()


def pip_target(wheels: Path, target: Path) -> float:
    """pip's own install of the set, bytecode compiled as uv's (--compile-bytecode) is."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
         str(wheels), "--target", str(target), "--disable-pip-version-check",
         *REQUIREMENTS.split()],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return (time.perf_counter() - started) * 1000


def p50(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"none": [], "cached": [], "fresh": [], "pip": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        wheels = wheelhouse(root / "wheels")
        data = root / "data"
        with harness.polyserve(
            1,
            data,
            POLYSERVE_DEPS_OFFLINE="1",
            POLYSERVE_DEPS_FIND_LINKS=str(wheels),
        ) as host:
            without = tar({"main.py": MAIN})
            with_deps = tar({"main.py": MAIN, "requirements.txt": REQUIREMENTS})
            timed_deploy(host.url, "bench/warm", with_deps)  # uv's cache, the host's reads
            for round_ in range(args.rounds):
                order = ["none", "cached", "fresh", "pip"]
                if round_ % 2:
                    order.reverse()
                for kind in order:
                    if kind == "none":
                        ms, _ = timed_deploy(host.url, "bench/none", without)
                    elif kind == "cached":
                        ms, answer = timed_deploy(host.url, "bench/cached", with_deps)
                        assert answer["dependencies"]["cached"], answer
                    elif kind == "fresh":
                        # A new set: the installed sets and the request cache are
                        # removed, uv's own cache stays (as on a host that has
                        # installed these packages for another set before).
                        for d in ("sets", "requests"):
                            shutil.rmtree(data / "deps" / d, ignore_errors=True)
                        ms, answer = timed_deploy(host.url, "bench/fresh", with_deps)
                        assert not answer["dependencies"]["cached"], answer
                        times.setdefault("fresh_install", []).append(
                            answer["dependencies"]["install_ms"]
                        )
                    else:
                        target = root / f"pip-{round_}"
                        ms = pip_target(wheels, target)
                        shutil.rmtree(target)
                    times[kind].append(ms)
    overhead = [c - n for c, n in zip(times["cached"], times["none"], strict=True)]
    result = {
        "rounds": args.rounds,
        "set": REQUIREMENTS.split(),
        "deploy_without_deps_p50_ms": p50(times["none"]),
        "deploy_cached_set_p50_ms": p50(times["cached"]),
        "cached_overhead_p50_ms": p50(overhead),
        "deploy_fresh_set_p50_ms": p50(times["fresh"]),
        "uv_install_fresh_p50_ms": p50(times["fresh_install"]),
        "pip_install_target_p50_ms": p50(times["pip"]),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
