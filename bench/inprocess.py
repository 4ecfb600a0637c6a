"""The onnx-tiny space against the same model in a plain Starlette app, in one process:
polyserve's whole worker app behind its own protocol (A) and the baseline app behind
uvicorn's httptools protocol (B) serve the same keep-alive GETs, in alternating rounds;
prints one JSON object (CPU µs per request of each, and the difference).

No sockets, no wrk: what is left is the two servers' own work, which wrk's A/B can only
see through a loopback round trip and a noisy machine's scheduling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "apps"))
import run  # bench/ is a folder of scripts, not a package
import uvloop
from gunicorn.config import Config as GunicornConfig
from starlette.testclient import TestClient
from strict_bench import Transport
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from polyserve import settings
from polyserve.app import HostApp, create_app
from polyserve.http import strict

SPACE = "lee101/onnx-tiny"
A_REQUEST = f"GET /s/{SPACE}/ HTTP/1.1\r\nHost: 127.0.0.1:8441\r\n\r\n".encode()
B_REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8441\r\n\r\n"


class Connection:
    """One keep-alive connection: `app` served by `protocol_class`, configured as the
    worker configures it (uvicorn-worker's defaults, gunicorn's FORWARDED_ALLOW_IPS)."""

    def __init__(self, protocol_class: type, app: Any, request: bytes, **config: Any) -> None:
        c = Config(app=app, lifespan="off", log_level="warning", access_log=False, **config)
        c.load()
        self.protocol = protocol_class(config=c, server_state=ServerState(), app_state={})
        self.transport = Transport()
        self.protocol.connection_made(self.transport)
        self.request = request
        self.writes = 0  # per answer: the head and the body, or both in one

    async def answer(self) -> None:
        before = self.transport.writes
        self.protocol.data_received(self.request)
        while self.transport.writes - before < max(self.writes, 1):
            await asyncio.sleep(0)
        self.writes = self.writes or self.transport.writes - before

    async def answer_bytes(self) -> bytes:
        """One answer, as the client receives it (in one write or several)."""
        self.transport.kept = []
        await self.answer()
        answer, self.transport.kept = b"".join(self.transport.kept), None
        return answer

    async def per_request_us(self, n: int) -> float:
        start = time.process_time()  # CPU time: other processes on the machine do not count
        for _ in range(n):
            await self.answer()
        assert not self.transport.closed, "the connection was closed"
        return (time.process_time() - start) / n * 1e6


@contextlib.asynccontextmanager
async def lifespan(app: HostApp):
    """The worker's ASGI lifespan around the block, as uvicorn runs it."""
    messages: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    started = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        assert message["type"] in ("lifespan.startup.complete", "lifespan.shutdown.complete")
        started.set()

    await messages.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.create_task(app(scope, messages.get, send))
    await started.wait()
    try:
        yield
    finally:
        await messages.put({"type": "lifespan.shutdown"})
        await task


async def rounds(count: int, n: int) -> dict[str, object]:
    import baseline_model  # B: loads the same example, after polyserve's deploy below

    host = create_app(settings.load())
    forwarded = GunicornConfig().forwarded_allow_ips
    host.trust_forwarded(forwarded)  # as polyserve.http.worker.Worker does
    async with lifespan(host):
        a = Connection(strict.protocol(GunicornConfig()), host, A_REQUEST, proxy_headers=False)
        b = Connection(
            HttpToolsProtocol, baseline_model.app, B_REQUEST, forwarded_allow_ips=forwarded
        )
        for side in (a, b):  # the load, then warm
            await side.per_request_us(n)
        answers = [await side.answer_bytes() for side in (a, b)]
        assert answers[0] == answers[1], f"A and B answered differently: {answers}"
        got: dict[str, list[float]] = {"a": [], "b": []}
        for round_ in range(count):
            order = ((a, "a"), (b, "b")) if round_ % 2 == 0 else ((b, "b"), (a, "a"))
            for side, name in order:
                got[name].append(await side.per_request_us(n))
    diffs = [x - y for x, y in zip(got["a"], got["b"], strict=True)]
    a_median, b_median = statistics.median(got["a"]), statistics.median(got["b"])
    return {
        "requests_per_round": n,
        "rounds": count,
        "a_median_us": round(a_median, 2),
        "b_median_us": round(b_median, 2),
        "a_minus_b_median_us": round(statistics.median(diffs), 2),
        "a_minus_b_best_us": round(min(got["a"]) - min(got["b"]), 2),
        "rps_ratio": round(b_median / a_median, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--requests", type=int, default=200, help="per round and side")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="polyserve-inprocess-") as data:
        os.environ["POLYSERVE_DATA_DIR"] = data
        # Deployed through the control plane, on another thread's loop, as a test does.
        with TestClient(create_app(settings.load()), client=("127.0.0.1", 50000)) as c:
            r = c.post(
                "/_polyserve/deploy",
                data={"space": SPACE},
                files={"module": ("onnx-tiny.tar", run.onnx_tiny_tar())},
            )
            assert r.status_code == 200, r.text
        print(json.dumps(uvloop.run(rounds(args.rounds, args.requests)), indent=1))


if __name__ == "__main__":
    main()
