"""What polyserve's strict HTTP protocol costs per request: uvicorn's httptools protocol
and polyserve's (polyserve/http/strict.py) serve the same keep-alive GETs in-process, on uvloop,
in alternating rounds; prints one JSON object (median µs per request of each, and the
difference).

No sockets: a transport that only collects what is written, so what is measured is the
protocol (parsing, the scope, the task) and a trivial ASGI app, nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from gunicorn.config import Config as GunicornConfig
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from polyserve.http import strict

# What wrk sends to the dispatch-overhead scenario's space, byte for byte.
REQUEST = b"GET /s/lee101/hello/ HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n\r\n"


async def app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.kept: list[bytes] | None = None  # when a list, what is written, to compare
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes += 1
        if self.kept is not None:
            self.kept.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Connection:
    """One keep-alive connection served by `protocol_class`."""

    def __init__(self, protocol_class: type[HttpToolsProtocol]) -> None:
        config = Config(app=app, lifespan="off", log_level="warning", access_log=False)
        config.load()
        self.protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        self.transport = Transport()
        self.protocol.connection_made(self.transport)

    async def per_request_us(self, n: int) -> tuple[float, float]:
        """µs per request for `n` GETs: the whole request (CPU time, so that other
        processes on the machine do not count), and data_received alone (where every
        check of the strict protocol runs; the task's part is uvicorn's on both sides)."""
        data_received, writes = self.protocol.data_received, self.transport.writes
        clock = time.perf_counter_ns
        parsing = 0
        start = time.process_time()
        for _ in range(n):
            t = clock()
            data_received(REQUEST)
            parsing += clock() - t
            await asyncio.sleep(0)  # the request's task runs to its end in one step
        elapsed = time.process_time() - start
        answered = self.transport.writes - writes
        assert answered >= n and not self.transport.closed, "requests were not answered"
        return elapsed / n * 1e6, parsing / n / 1e3


def summary(a: str, a_us: list[float], b: str, b_us: list[float], what: str) -> dict[str, float]:
    """Best round (the least disturbed on a shared machine) and median of each side, and
    B's extra cost: the difference of the best rounds, the median of paired rounds."""
    return {
        f"{a}_{what}_best_us": round(min(a_us), 2),
        f"{b}_{what}_best_us": round(min(b_us), 2),
        f"{b}_minus_{a}_{what}_best_us": round(min(b_us) - min(a_us), 2),
        f"{a}_{what}_median_us": round(statistics.median(a_us), 2),
        f"{b}_{what}_median_us": round(statistics.median(b_us), 2),
        f"{b}_minus_{a}_{what}_median_us": round(
            statistics.median([y - x for x, y in zip(a_us, b_us, strict=True)]), 2
        ),
    }


async def rounds(
    sides: dict[str, type[HttpToolsProtocol]], count: int, n: int
) -> dict[str, object]:
    """`count` rounds of `n` requests on each side, the order alternating; short rounds
    so that both sides see the same machine (it is shared)."""
    connections = {side: Connection(cls) for side, cls in sides.items()}
    for connection in connections.values():  # warm up
        await connection.per_request_us(n)
    got: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for round_ in range(count):
        order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
        for side in order:
            got[side].append(await connections[side].per_request_us(n))
    a, b = sides
    return {
        "requests_per_round": n,
        "rounds": count,
        **summary(a, [r for r, _ in got[a]], b, [r for r, _ in got[b]], "request"),
        **summary(a, [p for _, p in got[a]], b, [p for _, p in got[b]], "data_received"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--requests", type=int, default=1000, help="per round and side")
    args = parser.parse_args()
    sides = {"plain": HttpToolsProtocol, "strict": strict.protocol(GunicornConfig())}
    print(json.dumps(uvloop.run(rounds(sides, args.rounds, args.requests)), indent=1))


if __name__ == "__main__":
    main()
