"""Per-space logs on a real host: attribution, tailing, both workers, bounds, auth, deletion."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
from starlette.testclient import TestClient

from polyserve import settings
from polyserve.app import create_app
from polyserve.control.auth import digest
from tests.helpers import HostProcess, module_host, until

host = module_host("host")
# A small log (64 KiB a space) at the default rate, for the bounds.
small_logs = module_host("small_logs", POLYSERVE_LOG_KB="64")

# An async handle(): logs, prints, yields to the event loop between lines (so requests
# of both spaces interleave in a worker), and raises when asked.
ASYNC_SPACE = """
import asyncio, logging, os, sys
log = logging.getLogger(__name__)
NAME = {name!r}
print(f"{{NAME}} imported")

async def handle(request):
    n = request.query_params["n"]
    log.info("%s logging %s", NAME, n)
    await asyncio.sleep(0.005)
    print(f"{{NAME}} print {{n}}")
    await asyncio.sleep(0.005)
    print(f"{{NAME}} stderr {{n}}", file=sys.stderr)
    if request.query_params.get("boom"):
        raise ValueError(f"{{NAME}} boom {{n}}")
    return {{"pid": os.getpid()}}
"""

# The same from a sync handle(), which runs on a worker thread.
SYNC_SPACE = """
import logging, os, sys, time
log = logging.getLogger(__name__)
NAME = {name!r}

def handle(request):
    n = request.query_params["n"]
    log.warning("%s logging %s", NAME, n)
    time.sleep(0.005)
    print(f"{{NAME}} print {{n}}")
    print(f"{{NAME}} stderr {{n}}", file=sys.stderr)
    if request.query_params.get("boom"):
        raise ValueError(f"{{NAME}} boom {{n}}")
    return {{"pid": os.getpid()}}
"""


def logs(
    h: HostProcess, space: str, since: int = 0, headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.get(
        f"{h.url}/_polyserve/spaces/{space}/logs",
        params={"since": since},
        headers={"Connection": "close", **(headers or {})},
        timeout=30,
    )


def records(h: HostProcess, space: str, since: int = 0) -> list[dict]:
    r = logs(h, space, since)
    assert r.status_code == 200, r.text
    return r.json()["records"]


def deploy(h: HostProcess, space: str, source: str) -> int:
    r = h.deploy(space, source)
    assert r.status_code == 200, r.text
    return r.json()["version"]


def test_two_spaces_at_once_log_print_and_raise_each_under_its_own_name(host):
    """An async and a sync space, called at once from 8 clients (requests interleave in
    both workers): every record is its own space's, with its version and the worker that
    served the request; an exception dispatch turned into a 500 is there with its
    traceback; and the host's log carries the same lines, tagged."""
    deploy(host, "t/alpha", ASYNC_SPACE.format(name="alpha"))
    deploy(host, "t/beta", SYNC_SPACE.format(name="beta"))
    version = deploy(host, "t/beta", SYNC_SPACE.format(name="beta"))  # v2
    calls = [(space, n, n % 5 == 4) for n in range(20) for space in ("alpha", "beta")]

    def call(space: str, n: int, boom: bool) -> tuple[str, int, int, int | None]:
        params = {"n": n, **({"boom": 1} if boom else {})}
        r = host.get(f"/s/t/{space}/", params=params)
        return space, n, r.status_code, (r.json()["pid"] if r.status_code == 200 else None)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda c: call(*c), calls))
    assert sorted(status for _, _, status, _ in answers) == [200] * 32 + [500] * 8
    workers = host.worker_pids()
    for space, expected_version in (("alpha", 1), ("beta", version)):
        found = records(host, f"t/{space}")
        assert all(space in r["message"] for r in found), [r["message"] for r in found]
        assert {r["version"] for r in found} == {expected_version}
        assert {r["worker"] for r in found} <= workers
        seqs = [r["seq"] for r in found]
        assert seqs == sorted(set(seqs))
        level = "INFO" if space == "alpha" else "WARNING"  # log.info(), log.warning()
        for _, n, _, pid in (a for a in answers if a[0] == space):
            mine = {r["message"]: r for r in found if r["message"].endswith(f" {n}")}
            logged = mine[f"{space} logging {n}"]
            assert (logged["stream"], logged["level"]) == ("logging", level)
            assert mine[f"{space} print {n}"]["stream"] == "stdout"
            assert mine[f"{space} stderr {n}"]["stream"] == "stderr"
            if pid is not None:  # the worker that answered wrote its records
                assert {mine[m]["worker"] for m in mine} == {pid}
        errors = [r for r in found if r["level"] == "ERROR"]
        assert len(errors) == 4
        for r in errors:
            assert r["message"].startswith(f"Exception in GET /s/t/{space}/\nTraceback")
            assert r["stream"] == "stderr" and f"ValueError: {space} boom" in r["message"]
            assert 'File "main.py", line' in r["message"]  # the space's frame, relative
    assert any(r["message"] == "alpha imported" for r in records(host, "t/alpha"))
    # The host's own log (gunicorn's error log, here the test's log file), tagged.
    text = until(lambda: host.log.read_text() if "beta boom 19" in host.log.read_text() else "")
    for space, v in (("alpha", 1), ("beta", version)):
        assert any(f"[space t/{space} v{v} pid {pid}] {space} print " in text for pid in workers), (
            space
        )
    assert "ValueError: beta boom 19" in text


FORGING_SPACE = r"""
import logging, sys
def handle(request):
    print("a\n[polyserve] forged by print")
    print("b\x1b[2K\r[polyserve] forged by ANSI")
    logging.getLogger("t").warning("c\n[polyserve] forged by logging")
    raise ValueError("d\n[polyserve] forged by an exception")
"""


def test_a_space_cannot_forge_lines_of_the_host_log(host):
    """Each record it says is one line of the host's log, after its tag; the line breaks
    and escapes in it are written as backslash sequences. Its own log keeps the text."""
    deploy(host, "t/forge", FORGING_SPACE)
    assert host.get("/s/t/forge/").status_code == 500

    def logged() -> str:
        text = host.log.read_text()
        return text if "forged by an exception" in text else ""

    text = until(logged, what="the exception's echo")
    lines = [line for line in text.splitlines() if "forged" in line]
    assert len(lines) == 4, lines  # one a record (print's line feed made two: "a" is one)
    tag = r"\[space t/forge v1 pid \d+\] "
    assert all(re.search(tag, line.split("forged")[0]) for line in lines), lines
    assert not any(line.startswith("[polyserve]") for line in text.splitlines())
    assert "\x1b" not in text and "\r" not in text
    assert re.search(tag + r"b\\x1b\[2K\\r\[polyserve\] forged by ANSI$", text, re.M)
    assert re.search(tag + r"c\\n\[polyserve\] forged by logging$", text, re.M)
    assert re.search(tag + r"Exception in GET /s/t/forge/\\nTraceback .*\\nValueError: d\\n", text)
    kept = [r["message"] for r in records(host, "t/forge")]
    assert "b\x1b[2K\r[polyserve] forged by ANSI" in kept
    assert "c\n[polyserve] forged by logging" in kept


def test_since_tails_the_log(host):
    deploy(host, "t/tail", ASYNC_SPACE.format(name="tail"))
    # Every worker loads the space first, so the tailed request adds only its own lines
    # (a worker's first request also logs "tail imported").
    served: set[int] = set()

    def call() -> bool:
        served.add(host.get("/s/t/tail/", params={"n": len(served)}).json()["pid"])
        return len(served) == host.workers

    until(call, what="every worker to serve t/tail")
    first = logs(host, "t/tail").json()
    assert [r["message"] for r in first["records"]][-1].startswith("tail stderr ")
    assert logs(host, "t/tail", first["next"]).json() == {"records": [], "next": first["next"]}
    host.get("/s/t/tail/", params={"n": "last"})
    more = logs(host, "t/tail", first["next"]).json()
    assert [r["message"] for r in more["records"]] == [
        "tail logging last",
        "tail print last",
        "tail stderr last",
    ]
    assert more["records"][0]["seq"] >= first["next"] and more["next"] > first["next"]
    # Everything again from 0; a cursor from another log's life answers where this one is.
    assert len(records(host, "t/tail")) == len(first["records"]) + 3
    assert logs(host, "t/tail", 10**15).json() == {"records": [], "next": more["next"]}
    for bad in ("-1", "x", "1.5", "", "1e3", "99999999999999999999"):
        r = host.get("/_polyserve/spaces/t/tail/logs", params={"since": bad})
        assert r.status_code == 422 and "since" in r.json()["error"], (bad, r.text)


def test_the_records_of_both_workers_are_merged_in_one_order(host):
    deploy(host, "t/both", ASYNC_SPACE.format(name="both"))
    served: set[int] = set()

    def call() -> bool:
        served.add(host.get("/s/t/both/", params={"n": len(served)}).json()["pid"])
        return len(served) == host.workers

    until(call, what="both workers to serve t/both")
    found = records(host, "t/both")
    assert {r["worker"] for r in found} == served
    assert [r["seq"] for r in found] == sorted({r["seq"] for r in found})
    assert sum(r["message"] == "both imported" for r in found) == 2  # one import each


def test_import_and_lifespan_output_and_an_import_that_fails_only_in_a_worker(host):
    app = """
import sys
from contextlib import asynccontextmanager
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

print("module level")

@asynccontextmanager
async def lifespan(app):
    print("lifespan startup")
    yield
    print("lifespan shutdown")

async def home(request):
    return PlainTextResponse("hi")

app = Starlette(routes=[Route("/", home)], lifespan=lifespan)
"""
    deploy(host, "t/life", app)
    assert host.get("/s/t/life/").text == "hi"
    messages = [r["message"] for r in records(host, "t/life")]
    assert messages[:2] == ["module level", "lifespan startup"]
    # The deploy's validation imports in a process of its own, where this module works.
    flaky = (
        "import sys\n"
        "if 'polyserve.serve.dispatch' in sys.modules:\n"
        "    raise RuntimeError('no model file in this worker')\n"
        "def handle(request):\n"
        "    return 'ok'\n"
    )
    deploy(host, "t/flaky", flaky)
    assert host.get("/s/t/flaky/").status_code == 500
    record = next(r for r in records(host, "t/flaky") if r["level"] == "ERROR")
    assert record["message"].startswith("Exception in the import of main.py\nTraceback")
    assert "RuntimeError: no model file in this worker" in record["message"]


def test_records_outlive_the_worker_that_wrote_them(host):
    deploy(host, "t/dies", ASYNC_SPACE.format(name="dies"))
    pid = host.get("/s/t/dies/", params={"n": 1}).json()["pid"]
    os.kill(pid, signal.SIGKILL)
    until(
        lambda: pid not in host.worker_pids() and len(host.worker_pids()) == host.workers,
        what="gunicorn to replace the killed worker",
    )
    mine = {r["message"] for r in records(host, "t/dies") if r["worker"] == pid}
    assert mine >= {"dies logging 1", "dies print 1", "dies stderr 1"}


def test_a_deleted_spaces_logs_are_gone(host, tmp_path):
    deploy(host, "t/gone", ASYNC_SPACE.format(name="gone"))
    host.get("/s/t/gone/", params={"n": 1})
    assert records(host, "t/gone")
    data = host.data_dir
    assert (data / "logs" / "t" / "gone").is_dir()
    r = httpx.delete(host.url + "/_polyserve/spaces/t/gone", timeout=30)
    assert r.status_code == 200, r.text
    assert logs(host, "t/gone").status_code == 404
    assert not (data / "logs" / "t" / "gone").exists()
    # Deployed again, it starts a new log.
    deploy(host, "t/gone", ASYNC_SPACE.format(name="again"))
    host.get("/s/t/gone/", params={"n": 2})
    assert {r["message"] for r in records(host, "t/gone")} >= {"again print 2"}
    assert not any("gone" in r["message"] for r in records(host, "t/gone"))


def test_an_unknown_space_is_a_404_and_a_bad_name_a_422(host):
    assert logs(host, "t/never").status_code == 404
    assert host.get("/_polyserve/spaces/t/..bad/logs").status_code == 422


NOISY = """
def handle(request):
    for i in range(100_000):
        print(f"noisy line {i:06d}")
    return "done"
"""

QUIET = """
import logging
log = logging.getLogger("quiet")

def handle(request):
    log.warning("quiet %s", request.query_params["n"])
    return "ok"
"""


def test_a_space_printing_100k_lines_keeps_its_bound_and_leaves_the_others_be(small_logs):
    """POLYSERVE_LOG_KB=64 at the default rate: the noisy space keeps at most 64 KiB of
    its newest records, says it dropped some, and the quiet space's records and request
    counts are all there."""
    deploy(small_logs, "t/noisy", NOISY)
    deploy(small_logs, "t/quiet", QUIET)
    quiet_calls = 0

    def quiet() -> None:
        nonlocal quiet_calls
        assert small_logs.get("/s/t/quiet/", params={"n": quiet_calls}).text == "ok"
        quiet_calls += 1

    for _ in range(5):
        quiet()
    with ThreadPoolExecutor(2) as pool:
        noisy = pool.submit(small_logs.get, "/s/t/noisy/")
        while not noisy.done() and quiet_calls < 100:  # well within its own bound
            quiet()
        assert noisy.result().text == "done"
    for _ in range(5):
        quiet()
    found = records(small_logs, "t/noisy")
    lines = [r["message"] for r in found if r["message"].startswith("noisy line ")]
    on_disk = sum(p.stat().st_size for p in (small_logs.data_dir / "logs/t/noisy").iterdir())
    assert on_disk <= 64 * 1024 + 2 * 200 + 64  # the bound, two records past it, headers
    assert 0 < len(lines) < 64 * 1024 / 100  # every record here is over 100 bytes
    assert lines == sorted(lines) and "noisy line 000000" not in lines  # the newest kept
    assert any("over POLYSERVE_LOG_RATE" in r["message"] for r in found)
    assert [r["message"] for r in records(small_logs, "t/quiet")] == [
        f"quiet {n}" for n in range(quiet_calls)
    ]
    usage = small_logs.get("/_polyserve/usage").json()["spaces"]
    assert usage["t/quiet"]["requests"] == quiet_calls and usage["t/quiet"]["errors"] == 0
    assert usage["t/noisy"]["requests"] == 1


ADMIN = "admin-token-for-logs"
ALICE = "alice-token-for-logs"


def test_reading_logs_takes_the_right_to_deploy_the_space(host_factory, tmp_path: Path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"alice {digest(ALICE)}\n")
    h = host_factory(
        workers=1, POLYSERVE_TOKENS_FILE=str(tokens), POLYSERVE_DEPLOY_TOKEN_SHA256=digest(ADMIN)
    )
    admin = {"Authorization": f"Bearer {ADMIN}"}
    alice = {"Authorization": f"Bearer {ALICE}"}
    for space in ("alice/app", "bob/app"):
        assert h.deploy(space, QUIET, headers=admin).status_code == 200
        assert h.get(f"/s/{space}/", params={"n": 1}).status_code == 200
    assert logs(h, "alice/app", headers=alice).json()["records"][0]["message"] == "quiet 1"
    assert logs(h, "bob/app", headers=alice).status_code == 403
    assert logs(h, "bob/app", headers=admin).status_code == 200
    assert logs(h, "bob/app").status_code == 401  # a loopback client too, once tokens exist
    assert logs(h, "bob/app", headers={"Authorization": "Bearer nope"}).status_code == 401
    # Who may not read a space cannot learn whether it exists either.
    assert logs(h, "bob/nothing", headers=alice).status_code == 403
    assert logs(h, "alice/nothing", headers=alice).status_code == 404


def test_a_host_without_tokens_lets_only_loopback_clients_read_logs(tmp_path):
    s = settings.load({"POLYSERVE_DATA_DIR": str(tmp_path / "data")})
    with TestClient(create_app(s), client=("127.0.0.1", 5000)) as local:
        r = local.post(
            "/_polyserve/deploy", data={"space": "t/open"}, files={"module": ("main.py", QUIET)}
        )
        assert r.status_code == 200, r.text
        assert local.get("/_polyserve/spaces/t/open/logs").json() == {"records": [], "next": 0}
    with TestClient(create_app(s), client=("192.0.2.7", 5000)) as remote:
        r = remote.get("/_polyserve/spaces/t/open/logs")
        assert r.status_code == 403 and "token" in r.json()["error"]
