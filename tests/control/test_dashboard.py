"""The dashboard in a real headless Chromium: real figures, log lines, live updates, escaping."""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from polyserve.control import dashboard
from polyserve.control.auth import digest
from tests.helpers import HostProcess

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 20_000  # how long an expectation polls the page before it fails
# Set to a path to keep the test's screenshot there (docs/dashboard.png is one).
SCREENSHOT = os.environ.get("POLYSERVE_DASHBOARD_SCREENSHOT")

HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
ALPHA = f"""
import logging
log = logging.getLogger("alpha")

async def handle(request):
    n = int(request.query_params.get("n", 0))
    print(f"alpha says hi {{n}}")
    log.warning("slow cache, took %d ms", 40 + n)
    if n == 1:
        print({HOSTILE!r})
    return {{"n": n}}
"""
BETA = """
def handle(request):
    print("beta v{version} served", request.url.path)
    return "beta"
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(
            "the dashboard test drives Debian's Chromium at /usr/bin/chromium: install it"
            " with `apt-get install chromium` (.ci/run does)"
        )
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="Playwright is in the dev extra: pip install -e '.[dev]'"
    )
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield b
        finally:
            b.close()


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


def call(h: HostProcess, space: str, numbers: range) -> None:
    for n in numbers:
        assert h.get(f"/s/{space}/", params={"n": n}).status_code == 200


def watch(page: Any) -> list[str]:
    """The page's script errors and policy violations, as they happen."""
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
    page.on(
        "console",
        lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None,
    )
    return problems


BATCHED = """
import numpy as np
from polyserve.models import batched


@batched(max_rows=8)
def double(x):
    return x * 2


async def handle(request):
    return {"y": (await double(np.zeros((2, 3)))).tolist()}
"""


def test_the_dashboard_shows_real_figures_logs_and_updates_without_a_reload(
    host_factory, browser, tmp_path
):
    h = host_factory()
    for space, source in (
        ("lee101/alpha", ALPHA),
        ("lee101/beta", BETA.format(version=1)),
        ("lee101/beta", BETA.format(version=2)),
        ("lee101/gamma", BATCHED),
    ):
        assert h.deploy(space, source).status_code == 200
    call(h, "lee101/alpha", range(1, 4))
    call(h, "lee101/beta", range(5))
    call(h, "lee101/gamma", range(3))  # three batches of two rows each
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    problems = watch(page)
    page.goto(h.url + "/_polyserve/")
    alpha = page.locator('tbody[data-space="lee101/alpha"]')
    beta = page.locator('tbody[data-space="lee101/beta"]')
    expect(alpha.locator("td.requests")).to_have_text("3", timeout=WAIT_MS)
    expect(alpha.locator("td.version")).to_have_text("v1")
    expect(alpha.locator("td.errors")).to_have_text("0")
    expect(beta.locator("td.requests")).to_have_text("5")
    expect(beta.locator("td.version")).to_have_text("v2")
    expect(page.locator("#host")).to_contain_text("workers2")
    usage = h.get("/_polyserve/usage").json()["spaces"]["lee101/beta"]
    expect(beta.locator("td.cold")).to_have_text(str(usage["cold_starts"]))
    gamma = page.locator('tbody[data-space="lee101/gamma"]')
    expect(gamma.locator("td.batch")).to_have_text("2.0")  # rows per batch
    expect(alpha.locator("td.batch")).to_have_text("\u2013")  # a dash: a space that does not batch

    # Its details: the lines the space printed and logged, the hostile one as text.
    alpha.locator("button.toggle").click()
    lines = alpha.locator(".lines")
    expect(lines).to_contain_text("alpha says hi 3", timeout=WAIT_MS)
    expect(lines).to_contain_text("slow cache, took 41 ms")
    expect(lines.locator(".m", has_text="<img src=x onerror=")).to_have_count(1)
    assert lines.locator("img, script").count() == 0
    assert page.evaluate("window.__pwned") is None

    # More calls: the page follows by itself, without a reload.
    page.evaluate("window.__same_page = true")
    call(h, "lee101/alpha", range(4, 8))
    expect(alpha.locator("td.requests")).to_have_text("7", timeout=WAIT_MS)
    expect(lines).to_contain_text("alpha says hi 7", timeout=WAIT_MS)
    assert lines.locator(".m", has_text="alpha says hi").count() == 7  # each line once
    assert page.evaluate("window.__same_page") is True

    # History and rollback come from /versions when the host has it; hidden otherwise.
    beta.locator("button.toggle").click()
    expect(beta.locator(".lines")).to_contain_text("beta v2 served", timeout=WAIT_MS)
    history = beta.locator("section.history")
    versions = h.get("/_polyserve/spaces/lee101/beta/versions").status_code == 200
    if versions:
        expect(history).to_be_visible(timeout=WAIT_MS)
        expect(history.locator("tr.current")).to_contain_text("v2")
        expect(history.locator("button", has_text="Roll back to v1")).to_be_visible()
    else:
        expect(history).to_be_hidden()
    page.locator("h1").click()  # no focus ring in the picture
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if SCREENSHOT:
        shutil.copyfile(shot, SCREENSHOT)
    if versions:  # the button rolls back, on a second click that confirms it
        history.locator("button", has_text="Roll back to v1").click()
        history.locator("button", has_text="Confirm: roll back to v1").click()
        expect(beta.locator("td.version")).to_have_text("v1", timeout=WAIT_MS)
        expect(history.locator("p.note")).to_have_text("Rolled back to v1.")
        assert h.get("/s/lee101/beta/").status_code == 200
        expect(beta.locator(".lines")).to_contain_text("beta v1 served", timeout=WAIT_MS)
    assert problems == []
    page.close()


SLEEPER = """
import asyncio


async def handle(request):
    await asyncio.sleep(0.12)
    return "slept"
"""


def test_the_chart_draws_requests_per_second_and_p99_from_the_live_figures(host_factory, browser):
    """While a space whose every request sleeps 120 ms is called, each poll adds a point
    to its requests-per-second line and its p99 line, and the key reads the usage
    answer's p99, in the (100, 250] ms bucket. A space that answers nothing draws a
    rate line at zero and no p99."""
    h = host_factory(workers=1)
    assert h.deploy("lee101/sleeper", SLEEPER).status_code == 200
    assert h.deploy("lee101/quiet", SLEEPER).status_code == 200
    page = browser.new_page(viewport={"width": 1280, "height": 600})
    problems = watch(page)
    page.goto(h.url + "/_polyserve/")
    sleeper = page.locator('tbody[data-space="lee101/sleeper"] td.chart')
    quiet = page.locator('tbody[data-space="lee101/quiet"] td.chart')
    expect(sleeper.locator("svg.spark")).to_have_count(1, timeout=WAIT_MS)
    stop = threading.Event()

    def calls() -> None:
        while not stop.is_set():
            assert h.get("/s/lee101/sleeper/").text == "slept"

    caller = threading.Thread(target=calls)
    caller.start()
    try:
        three = re.compile(r"^\S+,\S+ \S+,\S+ \S+,\S+")  # three polls' points at least
        expect(sleeper.locator("polyline.rps")).to_have_attribute("points", three, timeout=WAIT_MS)
        expect(sleeper.locator("polyline.p99")).to_have_attribute("points", three, timeout=WAIT_MS)
    finally:
        stop.set()
        caller.join()
    tail = sleeper.locator(".key .p99").text_content() or ""
    found = re.fullmatch(r"p99 (\d+) ms", tail)
    assert found and 100 < int(found.group(1)) <= 250, tail
    rate = sleeper.locator(".key .rps").text_content() or ""
    assert re.fullmatch(r"\d+\.\d/s", rate), rate
    # Points drawn inside the chart's box, the rate above its baseline at some poll.
    points = [
        tuple(map(float, p.split(",")))
        for p in (sleeper.locator("polyline.rps").get_attribute("points") or "").split()
    ]
    assert all(0 <= x <= 120 and 0 <= y <= 26 for x, y in points)
    assert min(y for _, y in points) < 25
    expect(quiet.locator(".key .p99")).to_have_text("p99 \u2013")
    assert quiet.locator("polyline.p99").get_attribute("points") == ""
    assert problems == []
    page.close()


def test_a_running_rollout_shows_on_its_space_row(host_factory, browser):
    """The version cell says the new version and its percent while a rollout runs, and
    only the current version once it is aborted."""
    h = host_factory(workers=1)
    assert h.deploy("lee101/roll", BETA.format(version=1)).status_code == 200
    kept = httpx.post(
        h.url + "/_polyserve/deploy",
        data={"space": "lee101/roll", "current": "false"},
        files={"module": ("main.py", BETA.format(version=2).encode())},
        timeout=60,
    )
    assert kept.status_code == 200, kept.text
    started = httpx.post(
        h.url + "/_polyserve/spaces/lee101/roll/rollout",
        json={"version": 2, "steps": [25, 100], "step_s": 3600},
    )
    assert started.status_code == 200, started.text
    page = browser.new_page(viewport={"width": 1280, "height": 600})
    problems = watch(page)
    page.goto(h.url + "/_polyserve/")
    cell = page.locator('tbody[data-space="lee101/roll"] td.version')
    expect(cell).to_have_text("v1 \u2192 v2 25%", timeout=WAIT_MS)
    assert "step 1 of 2" in (cell.get_attribute("title") or "")
    aborted = httpx.post(h.url + "/_polyserve/spaces/lee101/roll/rollout/abort")
    assert aborted.status_code == 200, aborted.text
    expect(cell).to_have_text("v1", timeout=WAIT_MS)
    assert problems == []
    page.close()


ADMIN = "dashboard-admin-token"


def test_logs_need_a_token_that_the_page_keeps_for_the_session(host_factory, browser):
    h = host_factory(workers=1, POLYSERVE_DEPLOY_TOKEN_SHA256=digest(ADMIN))
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert h.deploy("lee101/alpha", ALPHA, headers=auth).status_code == 200
    call(h, "lee101/alpha", range(1, 3))
    page = browser.new_page()
    problems = watch(page)
    page.goto(h.url + "/_polyserve/")
    alpha = page.locator('tbody[data-space="lee101/alpha"]')
    expect(alpha.locator("td.requests")).to_have_text("2", timeout=WAIT_MS)
    alpha.locator("button.toggle").click()
    expect(alpha.locator("p.note").last).to_contain_text("takes a token", timeout=WAIT_MS)
    assert alpha.locator(".lines .line").count() == 0
    page.fill("#token", ADMIN)
    page.click("#use")
    expect(alpha.locator(".lines")).to_contain_text("alpha says hi 2", timeout=WAIT_MS)
    assert page.evaluate("sessionStorage.getItem('polyserve-token')") == ADMIN
    page.reload()  # kept for the tab's session
    expect(alpha.locator(".lines")).to_contain_text("alpha says hi 2", timeout=WAIT_MS)
    page.click("#forget")
    expect(alpha.locator("p.note").last).to_contain_text("takes a token", timeout=WAIT_MS)
    assert problems == []
    page.close()


def test_the_page_is_small_self_contained_and_locked_down(host_factory):
    h = host_factory(workers=1)
    r = httpx.get(h.url + "/_polyserve/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert len(r.content) < 24 * 1024
    page = r.text
    # Nothing from elsewhere, and no markup built from strings.
    assert "http://" not in page and "https://" not in page
    for parses_html in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):
        assert parses_html not in page
    policy = r.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "unsafe-inline" not in policy and policy == dashboard.POLICY
    # /_polyserve without the slash finds it too.
    assert httpx.get(h.url + "/_polyserve", timeout=30, follow_redirects=True).text == page
