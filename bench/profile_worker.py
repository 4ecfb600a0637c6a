"""Where a saturated worker's time goes: py-spy samples one polyserve worker serving the
onnx-tiny space under wrk -c 32, and the samples are grouped by component.

Needs py-spy (the bench extra) and wrk. Prints one JSON object: percent per component.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # bench/ is a folder of scripts, not a package
import run

# Innermost frame that names a component decides a sample's bucket; samples with none
# are the event loop and socket I/O (uvloop is C, invisible to py-spy).
BUCKETS = (
    ("onnxruntime", "onnxruntime inference"),
    ("json", "JSON encoding"),
    ("starlette/responses", "building the response"),
    ("polyserve/", "polyserve (dispatch, metering, await chain)"),
    ("uvicorn", "uvicorn HTTP protocol"),
    ("starlette", "starlette (request object)"),
    ("main.py", "the space's own code"),
)


def group(raw: Path) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if "UvicornWorker.run" not in stack:  # the event-loop thread only
            continue
        for frame in reversed(stack.split(";")):
            name = next((b for key, b in BUCKETS if key in frame), None)
            if name:
                counts[name] += int(n)
                break
        else:
            counts["event loop and sockets (C)"] += int(n)
    total = sum(counts.values())
    return {k: round(100 * v / total, 1) for k, v in counts.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, harness.polyserve(1, Path(tmp) / "d") as host:
        harness.deploy(host.url, "lee101/onnx-tiny", "onnx-tiny.tar", run.onnx_tiny_tar())
        url = host.url + "/s/lee101/onnx-tiny/"
        harness.wrk(url, 32, 1)
        worker = subprocess.run(
            ["pgrep", "-P", str(host.proc.pid)], capture_output=True, text=True, check=True
        ).stdout.split()[0]
        load = subprocess.Popen(
            harness.pinned(
                [harness.wrk_path(), "-t1", "-c32", f"-d{args.seconds + 3}s", url], harness.WRK_CPUS
            ),
            stdout=subprocess.DEVNULL,
        )
        raw = Path(tmp) / "samples.txt"
        subprocess.run(
            [
                str(Path(sys.executable).with_name("py-spy")),  # a binary, beside python
                "record",
                "--pid",
                worker,
                "-d",
                str(args.seconds),
                "-r",
                "500",
                "--format",
                "raw",
                "-o",
                str(raw),
                "--nonblocking",
            ],
            capture_output=True,
            check=True,
        )
        load.wait()
        print(json.dumps(group(raw)))


if __name__ == "__main__":
    main()
