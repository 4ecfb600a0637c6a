"""Latency a real host reports: streams' time to first byte, and p50/p99 in usage."""

from __future__ import annotations

import httpx2 as httpx

from tests.helpers import metrics_histogram, module_host

host = module_host("host", workers=2)

STREAMS = """
import asyncio

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route


async def chunks():
    for i in range(3):
        await asyncio.sleep(0.01)
        yield f"chunk {i}\\n".encode()


async def stream(request):
    return StreamingResponse(chunks(), media_type="text/plain")


async def plain(request):
    return PlainTextResponse("whole")


app = Starlette(routes=[Route("/stream", stream), Route("/plain", plain)])
"""


def test_time_to_first_byte_counts_the_streams_answered_and_only_them(host):
    assert host.deploy("l/streams", STREAMS).status_code == 200
    for _ in range(5):
        with httpx.stream("GET", f"{host.url}/s/l/streams/stream", timeout=30) as r:
            assert r.status_code == 200
            assert r.read() == b"chunk 0\nchunk 1\nchunk 2\n"
    for _ in range(7):
        assert host.get("/s/l/streams/plain").text == "whole"
    first = metrics_histogram(host, "polyserve_space_first_byte_seconds", "l/streams")
    assert first["count"] == first["+Inf"] == 5, first
    # Each stream's first chunk came after one 10 ms sleep, before its whole answer.
    assert first["0.005"] == 0 and first["sum"] > 0
    durations = metrics_histogram(host, "polyserve_space_request_duration_seconds", "l/streams")
    assert durations["count"] == 12
    assert first["sum"] < durations["sum"]


SLEEPER = """
import asyncio


async def handle(request):
    await asyncio.sleep(0.12)
    return {"slept": 0.12}
"""


def test_usage_has_p50_and_p99_in_the_bucket_of_a_known_sleep(host):
    """Every request sleeps 120 ms: both quantiles fall in the (100 ms, 250 ms] bucket,
    whichever worker answers, and a space that answered nothing has none."""
    assert host.deploy("l/sleeper", SLEEPER).status_code == 200
    assert host.deploy("l/idle", SLEEPER).status_code == 200
    for _ in range(12):
        assert host.get("/s/l/sleeper/").json() == {"slept": 0.12}
    for _ in range(4):  # a fresh connection each: both workers answer
        usage = host.get("/_polyserve/usage").json()
        seen = usage["spaces"]["l/sleeper"]
        assert 100 < seen["p50_ms"] <= 250 and 100 < seen["p99_ms"] <= 250, seen
        assert seen["p50_ms"] <= seen["p99_ms"]
        idle = usage["spaces"]["l/idle"]
        assert idle["p50_ms"] is None and idle["p99_ms"] is None
        assert 0 < usage["host"]["latency_window_s"] <= 65
