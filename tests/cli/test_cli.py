"""The `polyserve` command, run as the installed console script against real hosts (and a
loopback stand-in for the logs endpoint): what it prints, what it ships, its exit codes."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from polyserve.cli.pack import PackError, pack
from polyserve.cli.render import human_bytes, human_ms, table
from tests.helpers import HostProcess, free_port, until

_SCRIPT = Path(sys.executable).parent / "polyserve"
# The console script pip installed; `python -m polyserve.cli` where there is none.
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "polyserve.cli"]
COMMANDS = [
    "deploy",
    "list",
    "usage",
    "history",
    "rollback",
    "rollout",
    "release",
    "delete",
    "logs",
    "keys",
]


def polyserve(
    *args: str, url: str | None = None, stdin: str = "", **env: str
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("POLYSERVE_")}
    if url is not None:
        environ["POLYSERVE_URL"] = url
    return subprocess.run(
        [*CLI, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**environ, **env},
        timeout=120,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    return result.stdout


# -- without a host -----------------------------------------------------------------------


def test_human_units():
    assert [human_ms(x) for x in (0, 0.337, 6.7, 37, 1234, 204_000, 9_000_000)] == [
        "0 s",
        "0.34 ms",
        "6.7 ms",
        "37 ms",
        "1.2 s",
        "3.4 min",
        "2.5 h",
    ]
    sizes = (209, 10240, 3.4 * 2**20, 150 * 2**20, 5 * 2**30)
    assert [human_bytes(x) for x in sizes] == ["209 B", "10.0 KiB", "3.4 MiB", "150 MiB", "5.0 GiB"]
    assert human_ms(None) == human_bytes("x") == "-"


def test_tables_align_text_left_and_numbers_right():
    assert table(["NAME", "N"], [["a", "1"], ["long-name", "1,234"]], right={1}) == [
        "NAME           N",
        "a              1",
        "long-name  1,234",
    ]


def make_space(root: Path) -> Path:
    """A directory as people have them: code, caches, a repository, a virtualenv, logs."""
    files = {
        "main.py": "from lib import words\ndef handle(request):\n    return words.WORDS\n",
        "lib/words.py": "WORDS = ['shipped']\n",
        "lib/__pycache__/words.cpython-311.pyc": "stale bytecode",
        "__pycache__/main.cpython-311.pyc": "stale bytecode",
        ".git/HEAD": "ref: refs/heads/main\n",
        ".venv/pyvenv.cfg": "home = /usr/bin\n",
        ".venv/lib/site.py": "x = 1\n",
        "env2/pyvenv.cfg": "home = /usr/bin\n",  # a virtualenv by any name
        "logs/today.log": "noise\n",
        "data/big.bin": "0" * 1000,
        "data/keep.txt": "kept by a negation\n",
        "notes.secret": "do not ship\n",
        "docs/a/b.md": "doc\n",
        ".polyserveignore": "# comments and blank lines are fine\n\nlogs/\n*.secret\n"
        "data/*\n!data/keep.txt\ndocs/**/*.md\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


SHIPPED = ["data/keep.txt", "lib/words.py", "main.py"]


def test_a_directory_is_packed_without_caches_repositories_venvs_and_ignored_files(tmp_path):
    packed = pack(make_space(tmp_path / "space"))
    assert packed.files == SHIPPED
    with tarfile.open(fileobj=io.BytesIO(packed.data)) as tar:
        assert sorted(tar.getnames()) == SHIPPED
        assert all(m.isfile() and m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
    assert {".git/", ".venv/", "env2/", "__pycache__/", "lib/__pycache__/", "logs/"} <= set(
        packed.skipped
    )
    assert {"notes.secret", ".polyserveignore", "data/big.bin", "docs/a/b.md"} <= set(
        packed.skipped
    )
    # The same files pack to the same bytes: the same sha256 on the host.
    assert pack(tmp_path / "space").data == packed.data


def test_a_symbolic_link_is_refused_unless_ignored(tmp_path):
    root = make_space(tmp_path / "space")
    (root / "link.py").symlink_to("/etc/hostname")
    with pytest.raises(PackError, match=r"link\.py is a symbolic link"):
        pack(root)
    (root / ".polyserveignore").write_text("link.py\n")
    assert "link.py" not in pack(root).files


@pytest.mark.parametrize("command", [None, *COMMANDS, "autoscale"])
def test_every_command_has_help(command):
    out = ok(polyserve(*([command] if command else []), "--help"))
    assert out.startswith("Usage: polyserve")
    if command not in (None, "autoscale"):
        assert "--url" in out and "POLYSERVE_URL" in out and "POLYSERVE_TOKEN" in out


def test_an_unreachable_host_exits_3_and_says_where(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for args in (["list"], ["usage"], ["deploy", str(make_space(tmp_path)), "--space", "o/s"]):
        result = polyserve(*args, url=url)
        assert result.returncode == 3, (args, result.stderr)
        assert f"cannot reach the host at {url}" in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["rollback", "not-a-space"],
        ["rollback", "o/s", "zero"],
        ["rollback", "o/s", "0"],
        ["deploy", "/nonexistent", "--space", "o/s"],
        ["deploy", ".", "--space", "o/.s"],
        ["list", "--url", "ftp://x"],
        ["frobnicate"],
    ],
)
def test_usage_errors_exit_2_and_send_nothing(args):
    result = polyserve(*args, url=f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Error:" in result.stderr and "cannot reach" not in result.stderr


# -- logs, against a loopback stand-in serving the endpoint's contract -------------------


class Loopback(http.server.ThreadingHTTPServer):
    """A stand-in host on a free loopback port."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class LogsStandIn(Loopback):
    """GET /_polyserve/spaces/{owner}/{name}/logs?since=N as the host serves it:
    {"records": [...], "next": cursor}, newest last. Tests append to `records`."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _LogsHandler)
        self.records: list[dict] = []
        self.asked: list[str] = []


class _LogsHandler(http.server.BaseHTTPRequestHandler):
    server: LogsStandIn

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        self.server.asked.append(self.path)
        if url.path != "/_polyserve/spaces/o/s/logs":
            return self._answer(404, {"error": "Not Found"})
        since = int(urllib.parse.parse_qs(url.query).get("since", ["0"])[0])
        records = [r for r in self.server.records if r["seq"] > since]
        last = self.server.records[-1]["seq"] if self.server.records else 0
        self._answer(200, {"records": records, "next": max(since, last)})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:  # quiet: the test reads `asked`
        pass


S = TypeVar("S", bound=Loopback)


def serving(server: S) -> Iterator[S]:
    """A stand-in fixture's body: the server answering in a thread, then shut."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def logs_host() -> Iterator[LogsStandIn]:
    yield from serving(LogsStandIn())


def record(seq: int, message: str, stream: str = "logging") -> dict:
    return {
        "seq": seq,
        "time": 1_796_000_000.25 + seq,
        "level": "INFO" if stream == "logging" else "",
        "version": 3,
        "worker": 4242,
        "stream": stream,
        "message": message,
    }


def test_logs_prints_the_records_oldest_first(logs_host):
    logs_host.records += [record(1, "loaded model"), record(2, "hello", "stdout")]
    out = ok(polyserve("logs", "o/s", url=logs_host.url)).splitlines()
    assert len(out) == 2
    assert out[0].endswith("INFO    v3 pid 4242 logging: loaded model")
    assert out[1].endswith("v3 pid 4242 stdout: hello")
    lines = ok(polyserve("logs", "o/s", "--json", url=logs_host.url)).splitlines()
    assert [json.loads(line) for line in lines] == logs_host.records
    assert polyserve("logs", "o/other", url=logs_host.url).returncode == 1


def test_logs_follow_passes_the_cursor_back_until_ctrl_c(logs_host):
    logs_host.records.append(record(1, "first"))
    lines: list[str] = []
    with subprocess.Popen(
        [*CLI, "logs", "o/s", "-f", "--url", logs_host.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
            reader.start()
            until(lambda: any("first" in line for line in lines), what="the first record")
            logs_host.records += [record(2, "second"), record(3, "third")]
            until(lambda: any("third" in line for line in lines), what="the later records")
            until(lambda: any("since=3" in p for p in logs_host.asked), what="a poll from 3")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0
            reader.join(10)
            errors = proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert [line.split(": ", 1)[1].strip() for line in lines] == ["first", "second", "third"]
    assert "Traceback" not in errors


# -- against a real host ----------------------------------------------------------------------


def test_deploy_a_directory_ships_only_the_space(host: HostProcess, tmp_path):
    root = make_space(tmp_path / "words")
    out = ok(polyserve("deploy", str(root), "--space", "cli/words", url=host.url))
    assert out.startswith("deployed cli/words v1: sha256 ")
    assert "import " in out and " ms" in out and "handle in main.py" in out
    version_dir = host.data_dir / "spaces" / "cli" / "words" / "versions" / "1"
    arrived = sorted(
        p.relative_to(version_dir).as_posix()
        for p in version_dir.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts  # the host compiles its own
    )
    assert arrived == SHIPPED
    assert host.get("/s/cli/words/").json() == ["shipped"]
    # The sha256 printed is the upload's, which the host reports too.
    meta = json.loads((version_dir.parent / "1.json").read_text())
    assert meta["sha256"].startswith(out.split("sha256 ")[1][:12])
    assert meta["sha256"] == hashlib.sha256(pack(root).data).hexdigest()


def test_deploy_a_file_and_a_tar_and_print_json(host: HostProcess, tmp_path):
    hello = tmp_path / "hello.py"
    hello.write_text("def handle(request):\n    return 'hi'\n")
    body = json.loads(
        ok(polyserve("deploy", str(hello), "--space", "cli/f", "--json", url=host.url))
    )
    assert (body["version"], body["entry"], body["kind"]) == (1, "hello.py", "handle")
    tar = tmp_path / "s.tar"
    with tarfile.open(tar, "w") as t:
        t.add(hello, arcname="main.py")
    assert "cli/f v2" in ok(polyserve("deploy", str(tar), "--space", "cli/f", url=host.url))
    assert host.get("/s/cli/f/").text == "hi"


def test_a_refused_deploy_exits_1_with_the_hosts_message(host: HostProcess, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def handle(request:\n")
    result = polyserve("deploy", str(broken), "--space", "cli/broken", url=host.url)
    assert result.returncode == 1
    assert "error: import failed: broken.py, line 1" in result.stderr
    assert "(HTTP 422)" in result.stderr and result.stdout == ""


def test_list_usage_history_rollback_release_delete(host: HostProcess, tmp_path):
    space = tmp_path / "v.py"
    for v in (1, 2, 3):
        space.write_text(f"def handle(request):\n    return {{'v': {v}}}\n")
        ok(polyserve("deploy", str(space), "--space", "cli/life", url=host.url))
    assert host.get("/s/cli/life/").json() == {"v": 3}

    listed = ok(polyserve("list", url=host.url)).splitlines()
    assert listed[0].split() == ["SPACE", "VERSION", "KIND", "ENTRY", "SIZE", "IMPORT", "DEPLOYED"]
    (row,) = [line for line in listed if line.startswith("cli/life ")]
    assert row.split()[1:4] == ["v3", "handle", "v.py"]
    raw = json.loads(ok(polyserve("list", "--json", url=host.url)))
    assert raw["spaces"]["cli/life"]["version"] == 3

    usage = ok(polyserve("usage", url=host.url)).splitlines()
    assert usage[0].split()[:3] == ["SPACE", "REQUESTS", "ERRORS"]
    (row,) = [line for line in usage if line.startswith("cli/life ")]
    assert row.split()[1:3] == ["1", "0"]
    assert usage[-1].startswith("host: 2 workers, up ")
    raw = json.loads(ok(polyserve("usage", "--json", url=host.url)))
    assert raw["spaces"]["cli/life"]["requests"] == 1

    out = ok(polyserve("rollback", "cli/life", url=host.url))
    assert out.startswith("rolled back cli/life to v2 (was v3)")
    assert host.get("/s/cli/life/").json() == {"v": 2}
    out = ok(polyserve("rollback", "cli/life", "1", url=host.url))
    assert out.startswith("rolled back cli/life to v1 (was v2)")
    assert host.get("/s/cli/life/").json() == {"v": 1}

    history = ok(polyserve("history", "cli/life", url=host.url)).splitlines()
    assert history[0].split()[:3] == ["VERSION", "SHA256", "SIZE"]
    assert [line[:4] for line in history[1:4]] == ["* v1", "  v2", "  v3"]
    events = [line.split()[2:] for line in history if "deploy" in line or "rollback" in line]
    assert events == [
        ["deploy", "v1", "-"],
        ["deploy", "v2", "v1"],
        ["deploy", "v3", "v2"],
        ["rollback", "v2", "v3"],
        ["rollback", "v1", "v2"],
    ]

    result = polyserve("rollback", "cli/life", "9", url=host.url)
    assert result.returncode == 1
    assert "cli/life v9 is not kept" in result.stderr and "kept: 1, 2, 3" in result.stderr

    assert ok(polyserve("release", "cli/life", url=host.url)).startswith("released cli/life")

    declined = polyserve("delete", "cli/life", url=host.url, stdin="n\n")
    assert declined.returncode == 2 and "not deleted" in declined.stderr
    no_answer = polyserve("delete", "cli/life", url=host.url)  # end of input: no
    assert no_answer.returncode == 2
    assert host.get("/s/cli/life/").status_code == 200
    assert ok(polyserve("delete", "cli/life", url=host.url, stdin="y\n")).endswith(
        "deleted cli/life\n"
    )
    assert host.get("/s/cli/life/").status_code == 404
    result = polyserve("delete", "cli/life", "--yes", url=host.url)
    assert result.returncode == 1 and "not deployed (HTTP 404)" in result.stderr


def test_logs_on_a_host_without_the_endpoint_says_so(host: HostProcess, tmp_path):
    """A host from before per-space logs answers 404 for the route itself: the command
    says that, rather than the bare "Not Found". (Once the endpoint is merged this
    host serves it, and the stand-in tests above hold for its answers.)"""
    hello = tmp_path / "hello.py"
    hello.write_text("def handle(request):\n    return 'hi'\n")
    ok(polyserve("deploy", str(hello), "--space", "cli/loggy", url=host.url))
    result = polyserve("logs", "cli/loggy", url=host.url)
    assert result.returncode in (0, 1), result.stderr
    if result.returncode == 1:
        assert "this host has no per-space logs" in result.stderr


ADMIN = "admin-token-for-the-cli-tests"


def test_the_token_comes_from_the_option_or_the_variable(host_factory, tmp_path):
    host = host_factory(workers=1, POLYSERVE_DEPLOY_TOKEN=ADMIN)
    hello = tmp_path / "hello.py"
    hello.write_text("def handle(request):\n    return 'hi'\n")
    result = polyserve("deploy", str(hello), "--space", "t/s", url=host.url)
    assert result.returncode == 1 and "requires a token" in result.stderr
    result = polyserve("deploy", str(hello), "--space", "t/s", "--token", "wrong", url=host.url)
    assert result.returncode == 1 and "invalid token (HTTP 401)" in result.stderr
    ok(polyserve("deploy", str(hello), "--space", "t/s", "--token", ADMIN, url=host.url))
    ok(polyserve("deploy", str(hello), "--space", "t/s", url=host.url, POLYSERVE_TOKEN=ADMIN))
    assert "t/s" in ok(polyserve("list", url=host.url))  # reads need no token


# -- answers that are not polyserve's, from a loopback stand-in ----------------------------


class Garbler(Loopback):
    """Answers every request with `answer`: (status, Content-Type, body, the
    Content-Length it declares; None: the body's own). A declared length longer than the
    body cuts the answer short: the server closes after what it has."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _GarblerHandler)
        self.answer: tuple[int, str, bytes, int | None] = (200, "", b"", None)


class _GarblerHandler(http.server.BaseHTTPRequestHandler):
    server: Garbler

    def do_GET(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, content_type, body, length = self.server.answer
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    do_POST = do_DELETE = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def garbler() -> Iterator[Garbler]:
    yield from serving(Garbler())


PROXY_PAGE = (
    b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body></html>"
)
GARBLED = {
    "not JSON": ((200, "text/plain", b"hello, world", None), "text/plain 'hello, world'"),
    "a proxy's HTML page": (
        (502, "text/html", PROXY_PAGE, None),
        "an HTML page ('502 Bad Gateway')",
    ),
    "an HTML 404 without a type": (
        (404, "", b"<!DOCTYPE html><html><title>Not here</title></html>", None),
        "an HTML page ('Not here')",
    ),
    "an empty body": ((200, "application/json", b"", None), "an empty body"),
    "a truncated body": (
        (200, "application/json", b'{"spaces": {"a/b": {', 100),
        "a body cut short (20 of 100 bytes)",
    ),
    "truncated JSON": ((200, "application/json", b'{"spaces": {"a/b": {', None), '\'{"spaces"'),
    "JSON not an object": ((200, "application/json", b"[1, 2]", None), "JSON list"),
    "JSON without the field": ((200, "application/json", b'{"x": 1}', None), "'spaces'"),
    "JSON with another type": (
        (200, "application/json", b'{"spaces": [1]}', None),
        "JSON of another shape (AttributeError",
    ),
    "an error without `error`": ((400, "application/json", b"[]", None), "without an `error`"),
    "a 5xx without `error`": ((503, "application/json", b'{"e": 1}', None), "without an `error`"),
}


@pytest.mark.parametrize(("answer", "said"), GARBLED.values(), ids=GARBLED.keys())
def test_an_answer_that_is_not_polyserves_exits_5_with_one_line_naming_host_and_status(
    garbler, answer, said
):
    garbler.answer = answer
    result = polyserve("list", url=garbler.url)
    assert result.returncode == 5, (result.stdout, result.stderr)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: the host at {garbler.url} answered HTTP {answer[0]} with ")
    assert said in line and line.endswith(", not polyserve's JSON"), line
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "body"),
    [
        (["usage"], {"spaces": {}, "host": "busy"}),
        (["history", "o/s"], {"versions": [{"current": True}], "history": []}),
        (["logs", "o/s"], {"records": [], "next": "later"}),
        (["rollback", "o/s"], {"space": "o/s"}),
        (["deploy", "FILE", "--space", "o/s"], {"space": "o/s", "version": 1, "sha256": 7}),
    ],
)
def test_every_command_reading_an_answer_of_another_shape_exits_5(garbler, tmp_path, args, body):
    hello = tmp_path / "hello.py"
    hello.write_text("def handle(request):\n    return 'hi'\n")
    garbler.answer = (200, "application/json", json.dumps(body).encode(), None)
    result = polyserve(*[str(hello) if a == "FILE" else a for a in args], url=garbler.url)
    assert result.returncode == 5, (result.stdout, result.stderr)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: the host at {garbler.url} answered HTTP 200 with JSON of")
    assert "Traceback" not in result.stderr


def test_a_proxys_413_to_a_deploy_says_the_upload_is_too_large(garbler, tmp_path):
    hello = tmp_path / "hello.py"
    hello.write_text("def handle(request):\n    return 'hi'\n")
    page = b"<html><head><title>413 Request Entity Too Large</title></head></html>"
    garbler.answer = (413, "text/html", page, None)
    result = polyserve("deploy", str(hello), "--space", "o/s", url=garbler.url)
    assert result.returncode == 1, result.stderr
    assert f"error: the upload is too large for the host at {garbler.url}" in result.stderr
    assert "names no limit" in result.stderr and "(HTTP 413)" in result.stderr
    assert "  upload: " in result.stderr


def test_an_oversize_upload_says_it_is_too_large_and_the_hosts_limit(host_factory, tmp_path):
    """The host refuses it by its Content-Length before reading it and closes, so the
    client's send fails halfway: the command still reads the 413 that came."""
    host = host_factory(workers=1, POLYSERVE_MAX_UPLOAD_MB="1")
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" + "#" * (20 << 20))
    result = polyserve("deploy", str(big), "--space", "cli/big", url=host.url)
    assert result.returncode == 1, result.stderr
    assert "error: upload is larger than 1 MiB (POLYSERVE_MAX_UPLOAD_MB) (HTTP 413)" in (
        result.stderr
    )
    assert "  upload: 20.0 MiB" in result.stderr
    assert "cannot reach" not in result.stderr and "Traceback" not in result.stderr
    assert host.get("/_polyserve/spaces").json()["spaces"] == {}
