"""Integration tests: a real `gunicorn -c gunicorn.conf.py` on a free loopback port."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2

from polyserve.master.hooks import EXIT_DATA_DIR_BUSY
from polyserve.state.shm import segment_name
from tests.helpers import REPO, HostProcess, make_tar, until

WHO = """
import os
VERSION = {version!r}
def handle(request):
    return {{"version": VERSION, "pid": os.getpid()}}
"""


def who(version: str) -> str:
    return WHO.format(version=version)


def all_workers(host: HostProcess, path: str) -> dict[int, object]:
    """Call `path` over fresh connections until every worker has answered once."""
    answers: dict[int, object] = {}

    def collect():
        body = host.get(path).json()
        answers[body["pid"]] = body
        return len(answers) >= host.workers

    until(collect, what=f"every worker to answer {path}")
    return answers


def test_the_walkthrough_deploy_a_py_file_and_call_it(host):
    source = (REPO / "examples" / "hello" / "hello.py").read_bytes()
    r = host.deploy("lee101/hello", source, "hello.py")
    assert r.status_code == 200, r.text
    assert r.json()["kind"] == "handle" and r.json()["version"] == 1
    r = host.get("/s/lee101/hello/")
    assert r.json() == {"hello": "world", "path": "/s/lee101/hello/"}


def test_a_starlette_tar_with_lifespan_state_routes_and_helpers(host):
    root = REPO / "examples" / "starlette-app"
    tar = make_tar({f"./{p.name}": p.read_bytes() for p in root.glob("*.py")})
    r = host.deploy("lee101/words", tar, "words.tar")
    assert r.status_code == 200 and r.json()["kind"] == "app", r.text
    assert host.get("/s/lee101/words/").json() == {
        "words": 5,
        "lookup": f"{host.url}/s/lee101/words/words/space",
    }
    assert host.get("/s/lee101/words/words/swap").json() == {"word": "swap", "known": True}
    assert host.get("/s/lee101/words/nope").status_code == 404


def test_sync_and_async_handle(host):
    assert host.deploy("t/sync", "def handle(r):\n    return {'sync': True}\n").status_code == 200
    assert host.deploy("t/async", "async def handle(r):\n    return b'raw'\n").status_code == 200
    assert host.get("/s/t/sync/").json() == {"sync": True}
    r = host.get("/s/t/async/")
    assert r.content == b"raw" and r.headers["content-type"] == "application/octet-stream"


FASTAPI_SPACE = """
from fastapi import FastAPI
app = FastAPI(title="tiny")

@app.get("/items/{item_id}")
async def item(item_id: int):
    return {"item_id": item_id}
"""


def test_a_fastapi_space_serves_its_openapi_under_the_prefix(host):
    assert host.deploy("t/fast", FASTAPI_SPACE).status_code == 200
    assert host.get("/s/t/fast/items/3").json() == {"item_id": 3}
    spec = host.get("/s/t/fast/openapi.json").json()
    assert spec["info"]["title"] == "tiny" and "/items/{item_id}" in spec["paths"]
    assert spec["servers"] == [{"url": "/s/t/fast"}]
    assert "/s/t/fast/openapi.json" in host.get("/s/t/fast/docs").text


HELPERS_MAIN = """
import helpers
def handle(request):
    import helpers as late  # imported lazily at request time
    return {"top": helpers.WHO, "late": late.WHO}
"""


def test_two_spaces_helpers_do_not_collide(host):
    for who_ in ("alice", "bob"):
        tar = make_tar({"main.py": HELPERS_MAIN, "helpers.py": f"WHO = {who_!r}\n"})
        assert host.deploy(f"{who_}/h", tar, "h.tar").status_code == 200
    for _ in range(4):  # over both workers, in either order
        for who_ in ("alice", "bob"):
            assert host.get(f"/s/{who_}/h/").json() == {"top": who_, "late": who_}


def test_after_a_deploy_answers_every_call_gets_the_new_version(host):
    assert host.deploy("t/swap", who("v1")).status_code == 200
    on_v1 = all_workers(host, "/s/t/swap/")
    assert {a["version"] for a in on_v1.values()} == {"v1"}
    assert host.deploy("t/swap", who("v2")).status_code == 200
    answers = [host.get("/s/t/swap/").json() for _ in range(100)]
    assert {a["version"] for a in answers} == {"v2"}
    assert {a["pid"] for a in answers} == set(on_v1), "both workers served after the swap"


def test_the_control_signal_swaps_workers_before_any_call(host):
    assert host.deploy("t/signal", who("v1")).status_code == 200
    all_workers(host, "/s/t/signal/")  # both workers hold v1
    assert host.deploy("t/signal", who("v2")).status_code == 200

    def every_worker_holds_v2():
        loaded = all_workers(host, "/_polyserve/health")
        return all(body["loaded"].get("t/signal") == 2 for body in loaded.values())

    # Only health is called: the swap to v2 happened through the signal alone.
    until(every_worker_holds_v2, what="both workers to load v2 after the signal")


def test_a_failed_deploy_leaves_the_previous_version_serving(host):
    assert host.deploy("t/keep", who("v1")).status_code == 200
    workers = host.worker_pids()
    bad = [
        ("def handle(r):\n    return (\n", "main.py, line 2: SyntaxError"),
        ("raise ImportError('no numpy here')\n", "ImportError: no numpy here"),
        ("import os\nos._exit(3)\n", "exit code 3"),
        ("x = 1\n", "neither `app`"),
    ]
    for source, message in bad:
        r = host.deploy("t/keep", source)
        assert r.status_code == 422 and message in r.json()["error"], r.text
    assert {host.get("/s/t/keep/").json()["version"] for _ in range(10)} == {"v1"}
    assert host.worker_pids() == workers, "no worker died"
    assert not list((host.data_dir / "staging").iterdir())


def test_delete_reaches_every_worker(host):
    assert host.deploy("t/gone", who("v1")).status_code == 200
    all_workers(host, "/s/t/gone/")
    assert host.get("/_polyserve/spaces").json()["spaces"]["t/gone"]["version"] == 1
    assert httpx_delete(host, "/_polyserve/spaces/t/gone") == 200
    assert {host.get("/s/t/gone/").status_code for _ in range(20)} == {404}


def httpx_delete(host: HostProcess, path: str) -> int:
    return httpx2.delete(host.url + path).status_code


def test_a_sleeping_sync_handler_does_not_stall_another_space(host_factory, tmp_path):
    host = host_factory("one", workers=1)
    marker, gate = tmp_path / "sleeping", tmp_path / "wake"
    # The slow handler sleeps until the test opens the gate (at most 60 s), not for a
    # fixed time that a loaded machine could outlast before the fast requests are sent.
    slow = (
        f"import pathlib, time\ndef handle(request):\n"
        f"    pathlib.Path({str(marker)!r}).touch()\n"
        f"    for _ in range(600):\n"
        f"        if pathlib.Path({str(gate)!r}).exists():\n            break\n"
        f"        time.sleep(0.1)\n    return 'slow'\n"
    )
    assert host.deploy("t/slow", slow).status_code == 200
    assert host.deploy("t/fast", "async def handle(r):\n    return 'fast'\n").status_code == 200
    result: dict[str, str] = {}
    thread = threading.Thread(target=lambda: result.update(slow=host.get("/s/t/slow/").text))
    thread.start()
    until(marker.exists, what="the slow handler to start")
    assert [host.get("/s/t/fast/").text for _ in range(5)] == ["fast"] * 5
    assert "slow" not in result, "the fast space answered while the slow one slept"
    gate.touch()
    thread.join()
    assert result["slow"] == "slow"


def test_idle_release_and_reimport(host_factory):
    host = host_factory("idle", workers=1, POLYSERVE_IDLE_TTL="0.5")
    source = "import time\nIMPORTED = time.time()\ndef handle(r):\n    return [IMPORTED]\n"
    assert host.deploy("t/idle", source).status_code == 200
    first = host.get("/s/t/idle/").json()
    assert host.get("/_polyserve/health").json()["loaded"] == {"t/idle": 1}
    until(lambda: host.get("/_polyserve/health").json()["loaded"] == {}, what="idle release")
    assert host.get("/s/t/idle/").json() > first, "imported again after the release"


IMPORT_LOGGER = """
import pathlib
with open({log!r}, "a") as f:
    f.write("imported\\n")
def handle(request):
    return "ok"
"""


def test_spaces_survive_a_restart_and_are_not_imported_at_boot(host_factory, tmp_path):
    log = tmp_path / "imports.log"
    host = host_factory("restart")
    assert host.deploy("t/boot", IMPORT_LOGGER.format(log=str(log))).status_code == 200
    assert host.deploy("t/v", who("v1")).status_code == 200
    assert host.deploy("t/v", who("v2")).status_code == 200
    host.stop()
    assert not (Path("/dev/shm") / segment_name(str(host.data_dir))).exists()
    log.unlink(missing_ok=True)  # the validator imported it once
    host.start()
    assert not log.exists(), "tenant code ran while workers booted"
    assert host.get("/s/t/boot/").text == "ok"
    assert log.read_text() == "imported\n"
    assert {host.get("/s/t/v/").json()["version"] for _ in range(10)} == {"v2"}


def test_a_second_host_on_the_same_data_dir_refuses_to_start(host_factory):
    host = host_factory("shared")
    other = HostProcess(host.data_dir)
    other.log = host.data_dir.parent / "other-gunicorn.log"
    code, log = other.start_expecting_exit()
    assert code == EXIT_DATA_DIR_BUSY, log
    assert "another polyserve host is using" in log
    assert host.get("/_polyserve/health").status_code == 200


def test_the_gunicorn_control_socket_lives_in_the_data_dir(host):
    assert (host.data_dir / "gunicorn.ctl").is_socket()


def test_a_release_drops_the_space_in_every_worker(host):
    assert host.deploy("t/release", who("v1")).status_code == 200
    all_workers(host, "/s/t/release/")  # both workers hold it
    r = httpx2.post(host.url + "/_polyserve/spaces/t/release/release")
    assert r.status_code == 200 and r.json()["workers_signalled"] == 1

    def nobody_holds_it():
        return all(
            "t/release" not in body["loaded"]
            for body in all_workers(host, "/_polyserve/health").values()
        )

    until(nobody_holds_it, what="both workers to release the space")


TAGGED = """
import helpers
TAG = {tag!r}
def handle(request):
    return {{"main": TAG, "helpers": helpers.TAG}}
"""


def test_two_deploys_of_one_space_at_once_one_wins_whole(host):
    """Concurrent deploys serialize: every answer after both 200s comes from one upload
    whole (its main.py and its helpers.py), the one published last."""
    for round_ in range(4):
        tars = {
            tag: make_tar({"main.py": TAGGED.format(tag=tag), "helpers.py": f"TAG = {tag!r}\n"})
            for tag in (f"r{round_}-a", f"r{round_}-b")
        }
        with ThreadPoolExecutor(len(tars)) as pool:
            replies = dict(
                zip(
                    tars,
                    pool.map(lambda tar: host.deploy("t/race", tar, "race.tar"), tars.values()),
                    strict=True,
                )
            )
        assert {r.status_code for r in replies.values()} == {200}
        versions = {tag: r.json()["version"] for tag, r in replies.items()}
        assert len(set(versions.values())) == 2, "each deploy got its own version"
        winner = max(versions, key=versions.get)
        answers = [host.get("/s/t/race/").json() for _ in range(20)]
        assert answers == [{"main": winner, "helpers": winner}] * 20
