"""`polyserve dev`'s save-to-serving time: from a save until the URL answers the new code.

Starts `polyserve dev` on a temporary directory holding a handle() space, then saves
the module `--saves` times (as an editor that writes a copy and renames it does) and
polls the printed URL every `--poll-ms` until it answers the saved version's value.
The figure covers the watch's quiet time, the pack, the deploy (upload, validation,
publish) and the first request's import in the worker. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

SPACE_CODE = "def handle(request):\n    return {{'save': {n}}}\n"
_SCRIPT = Path(sys.executable).parent / "polyserve"
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "polyserve.cli"]


def answer(url: str) -> object:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def until(predicate: object, timeout: float, poll_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(poll_s)
    raise SystemExit(f"timed out waiting for {what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--poll-ms", type=float, default=5.0)
    args = parser.parse_args()
    poll_s = args.poll_ms / 1000
    with tempfile.TemporaryDirectory(prefix="dev-save-") as tmp:
        app, scratch = Path(tmp, "app"), Path(tmp, "scratch")
        app.mkdir()
        scratch.mkdir()
        (app / "main.py").write_text(SPACE_CODE.format(n=0))
        env = {k: v for k, v in os.environ.items() if not k.startswith("POLYSERVE_")}
        started = time.monotonic()
        proc = subprocess.Popen(
            [*CLI, "dev", str(app)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: list[str] = []
        assert proc.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        try:
            found: list[str] = []

            def printed_url() -> bool:
                found[:] = [m.group(1) for m in map(URL.search, list(lines)) if m]
                return bool(found)

            until(printed_url, 120, 0.01, "the URL")
            url = found[0]
            until(lambda: answer(url) == {"save": 0}, 120, poll_s, "the first version")
            first_s = time.monotonic() - started
            times = []
            for n in range(1, args.saves + 1):
                copy = scratch / "main.py"
                copy.write_text(SPACE_CODE.format(n=n))
                saved = time.monotonic()
                os.replace(copy, app / "main.py")
                until(lambda n=n: answer(url) == {"save": n}, 60, poll_s, f"save {n}")
                times.append((time.monotonic() - saved) * 1000)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
            reader.join(timeout=5)
    result = {
        "scenario": "dev save",
        "saves": len(times),
        "first_serving_s": round(first_s, 2),
        "save_to_serving_ms_p50": round(statistics.median(times), 1),
        "save_to_serving_ms_min": round(min(times), 1),
        "save_to_serving_ms_max": round(max(times), 1),
        "exit_status": proc.returncode,
    }
    print(json.dumps(result))


URL = re.compile(r"at (http://127\.0\.0\.1:\d+/s/\S+/)$")

if __name__ == "__main__":
    main()
