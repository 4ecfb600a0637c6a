"""Malformed HTTP/1 requests, sent as raw bytes to a real host: each is refused at the door
(RFC 9110/9112, gunicorn's limit_request_* settings) and never reaches a space.

Each case is a request head (and body) in which `/T` stands for the request target: `/`
for the host, `/s/o/x/` for a deployed space. A refusal is a 400, 414 or 431 status
line, or a connection closed with no answer at all. Most cases are refused by llhttp
itself (httptools' parser, strict by default): they are here to prove it still is."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import json
import re
import socket
import struct
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gunicorn.config import Config as GunicornConfig
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from polyserve.http import strict
from tests.helpers import HostProcess, module_host

H = b"Host: a\r\n"
GET = b"GET /T HTTP/1.1\r\n" + H
POST = b"POST /T HTTP/1.1\r\n" + H
CHUNKED = POST + b"Transfer-Encoding: chunked\r\n\r\n"
LONG = b"a" * 5000


def fields(n: int) -> bytes:
    return b"".join(b"X-F%d: v\r\n" % i for i in range(n))


CASES: dict[str, bytes] = {
    # -- gunicorn's limits: limit_request_line 4094, _fields 100, _field_size 8190
    "request line over limit_request_line": b"GET /T" + LONG + b" HTTP/1.1\r\n" + H + b"\r\n",
    "query over limit_request_line": b"GET /T?q=" + LONG + b" HTTP/1.1\r\n" + H + b"\r\n",
    "101 header fields": GET + fields(100) + b"\r\n",
    "1000 header fields": GET + fields(999) + b"\r\n",
    "a header value over limit_request_field_size": GET + b"X-Big: " + b"v" * 9000 + b"\r\n\r\n",
    "a header name over limit_request_field_size": GET + b"X" * 9000 + b": v\r\n\r\n",
    # gunicorn's 008: its limit counts the whole line, CRLF included (8191 bytes here)
    "a header line one byte over limit_request_field_size": GET
    + b"X-Big: "
    + b"v" * 8182
    + b"\r\n\r\n",
    # over several reads: llhttp hands the pieces to httptools, which joins them unseen
    "a 2 MiB header value": GET + b"X-Big: " + b"v" * (2 << 20) + b"\r\n\r\n",
    "a 2 MiB request target": b"GET /T?q=" + b"q" * (2 << 20) + b" HTTP/1.1\r\n" + H + b"\r\n",
    # -- field names: RFC 9110 5.1, token = 1*tchar
    "space in a field name": GET + b"X Y: v\r\n\r\n",
    "( in a field name": GET + b"X(Y: v\r\n\r\n",
    "@ in a field name": GET + b"X@Y: v\r\n\r\n",
    '" in a field name': GET + b'X"Y: v\r\n\r\n',
    "/ in a field name": GET + b"X/Y: v\r\n\r\n",
    "[ in a field name": GET + b"X[Y: v\r\n\r\n",
    "{ in a field name": GET + b"X{Y: v\r\n\r\n",
    "= in a field name": GET + b"X=Y: v\r\n\r\n",
    ", in a field name": GET + b"X,Y: v\r\n\r\n",
    "; in a field name": GET + b"X;Y: v\r\n\r\n",
    "? in a field name": GET + b"X?Y: v\r\n\r\n",
    "a non-ASCII byte in a field name": GET + b"X\xffY: v\r\n\r\n",
    "an empty field name": GET + b": v\r\n\r\n",
    "whitespace before the colon": GET + b"X-Y : v\r\n\r\n",
    "a field line without a colon": GET + b"X-Y\r\n\r\n",
    "Content_Length": POST + b"Content_Length: 5\r\n\r\nhello",
    "content_length": POST + b"content_length: 5\r\n\r\nhello",
    "Transfer_Encoding": POST + b"Transfer_Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "Content-Length with Content_Length": POST
    + b"Content-Length: 5\r\nContent_Length: 0\r\n\r\nhello",
    # -- field values and the head: RFC 9110 5.5, RFC 9112 2.2
    "NUL in a field value": GET + b"X-Y: a\x00b\r\n\r\n",
    "SOH in a field value": GET + b"X-Y: a\x01b\r\n\r\n",
    "ESC in a field value": GET + b"X-Y: a\x1bb\r\n\r\n",
    "VT in a field value": GET + b"X-Y: a\x0bb\r\n\r\n",
    "FF in a field value": GET + b"X-Y: a\x0cb\r\n\r\n",
    "DEL in a field value": GET + b"X-Y: a\x7fb\r\n\r\n",
    "a bare CR in a field value": GET + b"X-Y: a\rb\r\n\r\n",
    "a bare LF ending a field line": GET + b"X-Y: a\n\r\n",
    "a bare LF ending the request line": b"GET /T HTTP/1.1\n" + H + b"\r\n",
    "a bare CR ending the request line": b"GET /T HTTP/1.1\r" + H + b"\r\n",
    "a bare LF ending the head": GET + b"\n",
    "NUL in the request target": b"GET /T\x00 HTTP/1.1\r\n" + H + b"\r\n",
    "NUL in the method": b"G\x00T /T HTTP/1.1\r\n" + H + b"\r\n",
    "NUL after the head's last CRLF in a field": GET + b"X-Y: a\r\n\x00\r\n\r\n",
    # -- obsolete line folding: RFC 9112 5.2
    "obs-fold with a space": GET + b"X-Y: a\r\n b\r\n\r\n",
    "obs-fold with a tab": GET + b"X-Y: a\r\n\tb\r\n\r\n",
    "whitespace before the first field line": b"GET /T HTTP/1.1\r\n " + H + b"\r\n",
    # -- Host: RFC 9112 3.2
    "two Host fields": GET + b"Host: b\r\n\r\n",
    "two Host fields with one value": GET + b"Host: a\r\n\r\n",
    "Host and host": GET + b"host: b\r\n\r\n",
    "HTTP/1.1 without Host": b"GET /T HTTP/1.1\r\n\r\n",
    # -- Content-Type, a singleton field: RFC 9110 5.3 (gunicorn's 041)
    "two Content-Type fields": GET
    + b"Content-Type: application/json\r\nContent-Type: text/html\r\n\r\n",
    "Content-Type and content-type with one value": POST
    + b"Content-Type: a/b\r\ncontent-type: a/b\r\nContent-Length: 0\r\n\r\n",
    # -- Content-Length: RFC 9110 8.6, RFC 9112 6.3
    "two Content-Lengths that differ": POST
    + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    "a Content-Length list that differs": POST + b"Content-Length: 5, 6\r\n\r\nhello!",
    "a negative Content-Length": POST + b"Content-Length: -1\r\n\r\n",
    "Content-Length with a plus sign": POST + b"Content-Length: +5\r\n\r\nhello",
    "a hexadecimal Content-Length": POST + b"Content-Length: 0x5\r\n\r\nhello",
    "a Content-Length with a space inside": POST + b"Content-Length: 1 0\r\n\r\nhellohello",
    "an empty Content-Length": POST + b"Content-Length: \r\n\r\n",
    "a Content-Length that overflows": POST + b"Content-Length: 99999999999999999999999\r\n\r\n",
    "Content-Length then Transfer-Encoding": POST
    + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "Transfer-Encoding then Content-Length": POST
    + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    # -- Transfer-Encoding: RFC 9112 6.1, 6.3
    "chunked on HTTP/1.0": b"POST /T HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "chunked not last": POST + b"Transfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n",
    "chunked in a field before gzip": POST
    + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n0\r\n\r\n",
    "a coding without chunked": POST + b"Transfer-Encoding: gzip\r\n\r\nhello",
    "identity": POST + b"Transfer-Encoding: identity\r\n\r\nhello",
    "chunked twice": POST + b"Transfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
    "xchunked": POST + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "an empty Transfer-Encoding": POST + b"Transfer-Encoding: \r\n\r\n0\r\n\r\n",
    # -- chunks: RFC 9112 7.1
    "a chunk size that is not hex": CHUNKED + b"z\r\nhello\r\n0\r\n\r\n",
    "a negative chunk size": CHUNKED + b"-1\r\nhello\r\n0\r\n\r\n",
    "a 0x chunk size": CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n",
    "a chunk size with trailing spaces": CHUNKED + b"5 \r\nhello\r\n0\r\n\r\n",
    "a chunk size that overflows": CHUNKED + b"fffffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
    "an empty chunk size": CHUNKED + b"\r\nhello\r\n0\r\n\r\n",
    "chunk data without its CRLF": CHUNKED + b"5\r\nhelloX\r\n0\r\n\r\n",
    "a chunk longer than its size": CHUNKED + b"3\r\nhello\r\n0\r\n\r\n",
    "a bare LF after a chunk size": CHUNKED + b"5\nhello\r\n0\r\n\r\n",
    "a control character in a chunk extension": CHUNKED + b"5;a\x01=b\r\nhello\r\n0\r\n\r\n",
    "no final CRLF after the last chunk": CHUNKED + b"0\r\nX\r\n\r\n",
    "a bare LF as the final CRLF": CHUNKED + b"0\r\n\n",
    "Host in a trailer": CHUNKED + b"5\r\nhello\r\n0\r\nHost: b\r\n\r\n",
    "Content-Length in a trailer": CHUNKED + b"5\r\nhello\r\n0\r\nContent-Length: 5\r\n\r\n",
    "Transfer-Encoding in a trailer": CHUNKED
    + b"5\r\nhello\r\n0\r\nTransfer-Encoding: chunked\r\n\r\n",
    "Authorization in a trailer": CHUNKED + b"5\r\nhello\r\n0\r\nAuthorization: x\r\n\r\n",
    "Content-Type in a trailer": CHUNKED + b"5\r\nhello\r\n0\r\nContent-Type: a/b\r\n\r\n",
    "a bad name in a trailer": CHUNKED + b"5\r\nhello\r\n0\r\nX Y: v\r\n\r\n",
    "a control character in a trailer": CHUNKED + b"5\r\nhello\r\n0\r\nX-Y: a\x01\r\n\r\n",
    "101 trailer fields": CHUNKED + b"5\r\nhello\r\n0\r\n" + fields(101) + b"\r\n",
    "a trailer field over limit_request_field_size": CHUNKED
    + b"5\r\nhello\r\n0\r\nX-Big: "
    + b"v" * 9000
    + b"\r\n\r\n",
    # -- the request line: RFC 9112 2.3, 3; RFC 9110 9.1
    "HTTP/1.2": b"GET /T HTTP/1.2\r\n" + H + b"\r\n",
    "HTTP/2.0 on HTTP/1": b"GET /T HTTP/2.0\r\n" + H + b"\r\n",
    "HTTP/0.9": b"GET /T HTTP/0.9\r\n" + H + b"\r\n",
    "HTTP/3.0": b"GET /T HTTP/3.0\r\n" + H + b"\r\n",
    "a lower-case version": b"GET /T http/1.1\r\n" + H + b"\r\n",
    "a version with two digits": b"GET /T HTTP/1.10\r\n" + H + b"\r\n",
    "no version": b"GET /T\r\n" + H + b"\r\n",
    "a space in the target": b"GET /T a HTTP/1.1\r\n" + H + b"\r\n",
    "a control character in the target": b"GET /T\x01 HTTP/1.1\r\n" + H + b"\r\n",
    "DEL in the target": b"GET /T\x7f HTTP/1.1\r\n" + H + b"\r\n",
    "a non-ASCII byte in the target": b"GET /T\xff HTTP/1.1\r\n" + H + b"\r\n",
    "a space after the version": b"GET /T HTTP/1.1 \r\n" + H + b"\r\n",
    "GET *": b"GET * HTTP/1.1\r\n" + H + b"\r\n",
    "POST *": b"POST * HTTP/1.1\r\n" + H + b"Content-Length: 0\r\n\r\n",
    "( in the method": b"G(T /T HTTP/1.1\r\n" + H + b"\r\n",
    "@ in the method": b"GE@T /T HTTP/1.1\r\n" + H + b"\r\n",
    "/ in the method": b"GET/ /T HTTP/1.1\r\n" + H + b"\r\n",
    "an empty method": b" /T HTTP/1.1\r\n" + H + b"\r\n",
}

AT_SPACE = {name: case for name, case in CASES.items() if b"/T" in case}

REFUSED = (b"400", b"414", b"431")

host = module_host("strict_host", workers=1)

SPACE = "o/x"
HANDLE = b"def handle(request):\n    return {'ok': True}\n"


def exchange(host: HostProcess, request: bytes) -> bytes:
    """Send `request` on a new connection; the first answer, or what came before the
    server closed the connection."""
    with socket.create_connection(("127.0.0.1", host.port), timeout=30) as s:
        # Refused mid-send (a large head): the answer may still be there to read.
        with contextlib.suppress(OSError):
            s.sendall(request)
        return read_answer(s)


def read_answer(s: socket.socket) -> bytes:
    """The next answer on `s`, or what came before the server closed the connection."""
    got = b""
    while not complete(got):
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        got += data
    return got


def complete(answer: bytes) -> bool:
    head, sep, body = answer.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    return bool(sep and length and len(body) >= int(length[1]))


def assert_refused(answer: bytes) -> None:
    """A refusal at the door: a 400, 414 or 431 whose JSON body says why, then a closed
    connection; or no answer at all (the client had not finished sending)."""
    if answer:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split(b" ")[1:2] in [[code] for code in REFUSED], answer[:300]
        assert b"\r\nconnection: close" in head, head
        assert json.loads(body)["error"], body


def counters(host: HostProcess, space: str = SPACE) -> dict[str, int]:
    """The space's usage counters that a request moves."""
    usage = host.get("/_polyserve/usage").json()["spaces"][space]
    return {k: usage[k] for k in ("requests", "busy_ms", "errors")}


@pytest.fixture(scope="module")
def space(strict_host: HostProcess) -> HostProcess:
    r = strict_host.deploy(SPACE, HANDLE)
    assert r.status_code == 200, r.text
    return strict_host


READER = "o/reader"  # a space that reads the whole body before it answers


@pytest.fixture(scope="module")
def reader(space: HostProcess) -> HostProcess:
    handle = b"async def handle(request):\n    return {'n': len(await request.body())}\n"
    r = space.deploy(READER, handle)
    assert r.status_code == 200, r.text
    return space


def test_enough_distinct_cases():
    """The table holds at least 60 distinct malformed requests."""
    assert len(set(CASES.values())) == len(CASES) >= 60


@pytest.mark.parametrize("request_", CASES.values(), ids=CASES.keys())
def test_refused_at_the_door(strict_host, request_):
    """Each malformed request is refused, and the host serves the next connection."""
    assert_refused(exchange(strict_host, request_.replace(b"/T", b"/")))
    assert strict_host.get("/_polyserve/health").status_code == 200


@pytest.mark.parametrize("request_", AT_SPACE.values(), ids=AT_SPACE.keys())
def test_never_reaches_a_space(space, request_):
    """Each malformed request at a space is refused and moves none of its counters."""
    before = counters(space)
    assert_refused(exchange(space, request_.replace(b"/T", b"/s/o/x/")))
    assert counters(space) == before
    assert space.get("/s/o/x/").json() == {"ok": True}  # and the space still answers
    assert counters(space)["requests"] == before["requests"] + 1


@pytest.mark.parametrize(
    "request_",
    [
        b"GET /s/o/x/ HTTP/1.1\r\nHost: a\r\nX-Tab: a\tb\r\n\r\n",
        b"GET /s/o/x/ HTTP/1.0\r\n\r\n",
        b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
        b"POST /s/o/x/ HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"POST /s/o/x/ HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n0\r\nX-Checksum: 1\r\n\r\n",
        b"GET /s/o/x/ HTTP/1.1\r\nHost: a\r\n"
        + fields(98)
        + b"X-Big: "
        + b"v" * 8000
        + b"\r\n\r\n",
        b"GET /s/o/x/?" + b"q" * 4000 + b" HTTP/1.1\r\nHost: a\r\n\r\n",
        # 8190 bytes with its CRLF: gunicorn's limit_request_field_size exactly
        b"GET /s/o/x/ HTTP/1.1\r\nHost: a\r\nX-Big: " + b"v" * 8181 + b"\r\n\r\n",
        b"POST /s/o/x/ HTTP/1.1\r\nHost: a\r\nContent-Type: a/b\r\nContent-Length: 0\r\n\r\n",
    ],
    ids=[
        "tab",
        "1.0",
        "options-star",
        "gzip-chunked",
        "trailer",
        "at-limits",
        "line",
        "field-line-at-limit",
        "one-content-type",
    ],
)
def test_valid_requests_still_pass(space, request_):
    """Requests at the edge of what is allowed are served."""
    answer = exchange(space, request_)
    status = answer.split(b" ")[1:2]
    assert status and status[0][:1] in (b"2", b"4") and status[0] not in REFUSED, answer[:300]


# struct tcp_info's tcpi_data_segs_in (Linux 4.6 and later): segments received with data.
DATA_SEGS_IN = 152


def data_segments_in(s: socket.socket) -> int:
    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < DATA_SEGS_IN + 4:
        pytest.skip("this kernel's tcp_info has no tcpi_data_segs_in: Linux 4.6 or later")
    return struct.unpack_from("I", info, DATA_SEGS_IN)[0]


def test_a_small_answer_arrives_in_one_segment(space):
    """A handle() answer's head and body leave in one write (polyserve/http/cycle.py): over a
    real socket, each of 20 keep-alive answers is one TCP segment, not two."""
    with socket.create_connection(("127.0.0.1", space.port), timeout=30) as s:
        before = data_segments_in(s)
        for _ in range(20):
            s.sendall(b"GET /s/o/x/ HTTP/1.1\r\nHost: a\r\n\r\n")
            answer = read_answer(s)
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"ok":true}')
        assert data_segments_in(s) - before == 20


def tight_host(host_factory: Any, fields: int) -> HostProcess:
    """A host with small limit_request_* settings: a line of 200, `fields`, 300 a field."""
    limits = ("--limit-request-line", "200", "--limit-request-fields", str(fields))
    return host_factory(workers=1, args=(*limits, "--limit-request-field_size", "300"))


def test_gunicorn_limit_settings_are_honoured(host_factory):
    """gunicorn's limit_request_* settings, given on its command line, are applied."""
    tight = tight_host(host_factory, fields=5)
    line = b"GET /?" + b"q" * 200 + b" HTTP/1.1\r\nHost: a\r\n\r\n"
    assert exchange(tight, line).startswith(b"HTTP/1.1 414 ")
    assert exchange(tight, GET.replace(b"/T", b"/") + fields(5) + b"\r\n").startswith(
        b"HTTP/1.1 431 "
    )
    big = GET.replace(b"/T", b"/") + b"X-Big: " + b"v" * 300 + b"\r\n\r\n"
    assert exchange(tight, big).startswith(b"HTTP/1.1 431 ")
    # A field's line with its CRLF, as gunicorn counts it: 300 bytes pass, 301 do not.
    at_limit = GET.replace(b"/T", b"/_polyserve/health") + b"X-B: " + b"v" * 293 + b"\r\n\r\n"
    assert exchange(tight, at_limit).startswith(b"HTTP/1.1 200 ")
    over = at_limit.replace(b"X-B: ", b"X-B: v")
    assert exchange(tight, over).startswith(b"HTTP/1.1 431 ")
    ok = GET.replace(b"/T", b"/_polyserve/health") + fields(3) + b"X-B: " + b"v" * 200 + b"\r\n\r\n"
    assert exchange(tight, ok).startswith(b"HTTP/1.1 200 ")


def read_to_close(s: socket.socket) -> bytes:
    """What the server sends until it closes the connection (or resets it)."""
    answer = b""
    with contextlib.suppress(OSError):
        while data := s.recv(65536):
            answer += data
    return answer


def memory_kb(pid: int) -> int:
    """The peak resident memory of process `pid` (VmHWM), in kB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1])  # type: ignore[index]


def test_a_trailer_field_that_never_ends_is_refused(reader):
    """A chunked body's last trailer field, streamed without an end, is refused within a
    head's budget: the worker does not hold what was sent, the request never reaches the
    space, and the worker serves the next request."""
    (pid,) = reader.worker_pids()
    assert reader.get("/s/o/reader/").json() == {"n": 0}
    before, peak = counters(reader, READER), memory_kb(pid)
    sent, piece = 0, b"v" * (1 << 20)
    with socket.create_connection(("127.0.0.1", reader.port), timeout=30) as s:
        with contextlib.suppress(OSError):
            s.sendall(CHUNKED.replace(b"/T", b"/s/o/reader/") + b"5\r\nhello\r\n0\r\nX-Foo: ")
            for _ in range(32):  # 32 MiB, in writes of 1 MiB: many reads of the worker's
                s.sendall(piece)
                sent += len(piece)
        grown = memory_kb(pid) - peak  # before the socket closes: held, or not
        answer = read_to_close(s)
    assert grown < (32 << 10) // 4, f"the worker's peak memory grew by {grown} kB"
    assert sent < 32 << 20, "the worker read all 32 MiB without refusing"
    assert_refused(answer)
    # Its last chunk came in the read that carried its head: held at the door until the
    # trailer section ends (polyserve/http/cycle.py), it never reached the space.
    assert counters(reader, READER) == before
    assert reader.worker_pids() == {pid}
    assert reader.get("/s/o/reader/").json() == {"n": 0}


# gunicorn's rfc9112_chunked_missing_final_crlf_01, and the same end after a chunk's data
# and after a trailer field: what follows a chunked head, then the client stops sending.
CUT_SHORT = {
    "the last chunk": b"0\r\n",
    "data and the last chunk": b"5\r\nhello\r\n0\r\n",
    "a trailer field": b"5\r\nhello\r\n0\r\nX-Checksum: 1\r\n",
}


@pytest.mark.parametrize("space_", [SPACE, READER], ids=["answers-at-once", "reads-the-body"])
@pytest.mark.parametrize("rest", CUT_SHORT.values(), ids=CUT_SHORT.keys())
def test_a_chunked_body_without_its_final_crlf_never_reaches_a_space(reader, space_, rest):
    """A chunked body whose client stops sending before the CRLF that ends it is answered
    400, as gunicorn answers ChunkMissingTerminator, and moves none of the space's
    counters: neither a space that answers without the body nor one that reads it."""
    before = counters(reader, space_)
    with socket.create_connection(("127.0.0.1", reader.port), timeout=30) as s:
        s.sendall(CHUNKED.replace(b"/T", f"/s/{space_}/".encode()) + rest)
        s.shutdown(socket.SHUT_WR)  # the end of what the client sends, as in the fixture
        answer = read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert_refused(answer)
    assert b"chunked body" in answer
    assert counters(reader, space_) == before
    assert reader.get(f"/s/{space_}/").status_code == 200


def test_a_chunked_upload_still_reaches_the_space_before_its_end(space):
    """A chunked body is streamed to the space, not held until it ends: a space that
    answers after its first chunk answers while the rest is still to be sent."""
    first = b"async def handle(request):\n    async for chunk in request.stream():\n"
    first += b"        return {'first': len(chunk)}\n"
    assert space.deploy("o/first", first).status_code == 200
    before = counters(space, "o/first")
    with socket.create_connection(("127.0.0.1", space.port), timeout=30) as s:
        s.sendall(CHUNKED.replace(b"/T", b"/s/o/first/") + b"5\r\nhello\r\n")
        answer = read_answer(s)
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"first":5}'), answer
        s.sendall(b"0\r\n\r\n")
    assert counters(space, "o/first")["requests"] == before["requests"] + 1


def test_a_large_chunked_upload_is_read_whole(reader):
    """A chunked upload of 8 MiB, each chunk's size line written apart from its data, is
    read whole by a space that reads the body: a read that ends at a chunk header holds
    the request only until the data comes."""

    def chunks() -> Iterator[bytes]:
        for _ in range(128):
            yield b"%x\r\n" % (64 << 10)  # the size line alone: the read may end after it
            yield b"b" * (64 << 10) + b"\r\n"
        yield b"0\r\n\r\n"

    with socket.create_connection(("127.0.0.1", reader.port), timeout=30) as s:
        s.sendall(CHUNKED.replace(b"/T", b"/s/o/reader/"))
        for piece in chunks():
            s.sendall(piece)
        answer = read_answer(s)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"n":8388608}'), answer


def test_many_small_trailer_fields_over_several_reads_are_refused(reader):
    """Small trailer fields streamed past limit_request_fields are refused, the space
    unaffected."""
    trailers = fields(101) + b"\r\n"  # the 101st is refused once the section ends
    with socket.create_connection(("127.0.0.1", reader.port), timeout=30) as s:
        s.sendall(CHUNKED.replace(b"/T", b"/s/o/reader/") + b"5\r\nhello\r\n0\r\n")
        # In several writes, but none after the refusal: what the worker has not read
        # when it closes would reset the connection, and the answer with it.
        for start in range(0, len(trailers), 256):
            s.sendall(trailers[start : start + 256])
        answer = read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:300]
    assert b"limit_request_fields" in answer
    assert reader.get("/s/o/reader/").json() == {"n": 0}


def test_pipelined_bodies_do_not_count_against_the_next_head(host_factory):
    """Under small limit_request_* settings, a pipelined request's body read with the next
    head's first bytes does not count as that head's: both requests are answered."""
    tight = tight_host(host_factory, fields=10)  # a head's budget: 200 + 10 * 302 bytes
    assert tight.deploy(SPACE, HANDLE).status_code == 200
    post = b"POST /s/o/x/ HTTP/1.1\r\nHost: a\r\nContent-Length: 8000\r\n\r\n" + b"b" * 8000
    head = post[: post.index(b"\r\n\r\n")]
    with socket.create_connection(("127.0.0.1", tight.port), timeout=30) as s:
        # One write: the first request, then the second's head but its last CRLF.
        s.sendall(post + head)
        first = read_answer(s)
        assert first.startswith(b"HTTP/1.1 200 "), first[:300]
        s.sendall(post[len(head) :])
        second = read_answer(s)
        assert second.startswith(b"HTTP/1.1 200 "), second[:300]


# uvicorn 0.54's HttpToolsProtocol methods that StrictHttpToolsProtocol copies.
UPSTREAM_DATA_RECEIVED = """
def data_received(self, data: bytes) -> None:
    self._unset_keepalive_if_required()

    try:
        self.parser.feed_data(data)
    except httptools.HttpParserError:
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)
        return
    except httptools.HttpParserUpgrade:
        if self._should_upgrade():
            self.handle_websocket_upgrade()
        else:
            self._unsupported_upgrade_warning()
"""


UPSTREAM_ON_HEADERS_COMPLETE = """
def on_headers_complete(self) -> None:
    http_version = self.parser.get_http_version()
    method = self.parser.get_method()
    self.scope["method"] = method.decode("ascii")
    if http_version != "1.1":
        self.scope["http_version"] = http_version
    if self.parser.should_upgrade() and self._should_upgrade():
        return
    parsed_url = httptools.parse_url(self.url)
    raw_path = parsed_url.path
    path = raw_path.decode("ascii")
    if "%" in path:
        path = urllib.parse.unquote(path)
    full_path = self.root_path + path
    full_raw_path = self.root_path.encode("ascii") + raw_path
    self.scope["path"] = full_path
    self.scope["raw_path"] = full_raw_path
    self.scope["query_string"] = parsed_url.query or b""

    # Handle 503 responses when 'limit_concurrency' is exceeded.
    if self.limit_concurrency is not None and (
        len(self.connections) >= self.limit_concurrency or len(self.tasks) >= self.limit_concurrency
    ):
        app = service_unavailable
        message = "Exceeded concurrency limit."
        self.logger.warning(message)
    else:
        app = self.app

    existing_cycle = self.cycle
    self.cycle = RequestResponseCycle(
        scope=self.scope,
        transport=self.transport,
        flow=self.flow,
        logger=self.logger,
        access_logger=self.access_logger,
        access_log=self.access_log,
        default_headers=self.server_state.default_headers,
        message_event=asyncio.Event(),
        expect_100_continue=self.expect_100_continue,
        keep_alive=http_version != "1.0" and self.parser.should_keep_alive(),
        on_response=self.on_response_complete,
    )
    if existing_cycle is None or existing_cycle.response_complete:
        # Standard case - start processing the request.
        self._start_asgi_task(self.cycle, app)
    else:
        # Pipelined HTTP requests need to be queued up.
        self.flow.pause_reading()
        self.pipeline.appendleft((self.cycle, app))
"""


UPSTREAM_ON_BODY = """
def on_body(self, body: bytes) -> None:
    if (self.parser.should_upgrade() and self._should_upgrade()) or self.cycle.response_complete:
        return
    self.cycle.body += body
    if len(self.cycle.body) > HIGH_WATER_LIMIT:
        self.flow.pause_reading()
    self.cycle.message_event.set()
"""


UPSTREAM_ON_MESSAGE_COMPLETE = """
def on_message_complete(self) -> None:
    if (self.parser.should_upgrade() and self._should_upgrade()) or self.cycle.response_complete:
        return
    self.cycle.more_body = False
    self.cycle.message_event.set()
"""


@pytest.mark.parametrize(
    ("method", "copied"),
    [
        ("data_received", UPSTREAM_DATA_RECEIVED),
        ("on_headers_complete", UPSTREAM_ON_HEADERS_COMPLETE),
        ("on_body", UPSTREAM_ON_BODY),
        ("on_message_complete", UPSTREAM_ON_MESSAGE_COMPLETE),
    ],
)
def test_upstream_methods_are_what_strict_py_copied(method, copied):
    """uvicorn's methods that polyserve/http/strict.py copies are still the ones it copied."""
    upstream = textwrap.dedent(inspect.getsource(getattr(HttpToolsProtocol, method)))
    assert ast.dump(ast.parse(upstream)) == ast.dump(ast.parse(copied)), (
        f"uvicorn's HttpToolsProtocol.{method} changed: bring polyserve/http/strict.py's copy in"
        f" step, then its text here. It is now:\n{upstream}"
    )


class _Transport(asyncio.Transport):
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return False


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def _attributes_after_a_request(protocol_class: type[HttpToolsProtocol]) -> set[str]:
    config = Config(app=_ok, lifespan="off", log_level="warning")
    config.load()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(_Transport())
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    await asyncio.sleep(0)
    assert protocol.cycle.response_complete
    return set(vars(protocol))


def test_strict_protocol_adds_no_instance_attribute():
    """The strict protocol keeps its state in slots: past 30 instance attributes, CPython
    stops sharing an instance's keys with its class, which slowed every request."""
    plain = asyncio.run(_attributes_after_a_request(HttpToolsProtocol))
    ours = asyncio.run(_attributes_after_a_request(strict.protocol(GunicornConfig())))
    assert ours == plain


def _strict(app: Any, transport: asyncio.Transport) -> Any:
    """polyserve's protocol at gunicorn's default limits, serving `app` on `transport`."""
    config = Config(app=app, lifespan="off", log_level="critical")
    config.load()
    protocol = strict.protocol(GunicornConfig())(
        config=config, server_state=ServerState(), app_state={}
    )
    protocol.connection_made(transport)
    return protocol


async def _scope_of(request: bytes) -> dict[str, Any]:
    protocol = _strict(_ok, _Transport())
    protocol.data_received(request)
    await asyncio.sleep(0)
    assert protocol.cycle.response_complete
    return protocol.cycle.scope


def test_allowed_trailer_fields_are_dropped():
    """A trailer field that may be one is not merged into the headers the app was given."""
    scope = asyncio.run(
        _scope_of(
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\nX-Checksum: 1\r\n\r\n"
        )
    )
    assert scope["headers"] == [(b"host", b"a"), (b"transfer-encoding", b"chunked")]


class _Recording(_Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True


async def _refused_after_the_answer() -> _Recording:
    transport = _Recording()
    protocol = _strict(_ok, transport)
    # A chunk's data lets the request in to the app, which answers at once.
    protocol.data_received(CHUNKED.replace(b"/T", b"/") + b"5\r\nhello\r\n")
    await asyncio.sleep(0)
    assert protocol.cycle.response_complete and b" 200 " in transport.written
    protocol.data_received(b"0\r\nX-Foo: ")
    for _ in range(20):  # a trailer field without an end, 1.3 MB: past the budget
        if not transport.closed:
            protocol.data_received(b"v" * 65536)
    return transport


def test_a_refusal_after_the_answer_only_closes():
    """Trailers refused after the app answered close the connection: no second status
    line follows the answer."""
    transport = asyncio.run(_refused_after_the_answer())
    assert transport.closed
    assert transport.written.count(b"HTTP/1.1 ") == 1, transport.written


async def _what_the_app_saw(parts: list[bytes], end: str = "") -> tuple[list[Any], _Recording]:
    """Feed `parts` to one connection, the loop run after each, then end it ("eof": the
    client stops sending, "lost": the connection is gone): what the app saw after each
    part ("called", then what it received; None: not called yet), and the transport."""
    messages: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        messages.append("called")
        while True:
            messages.append(message := await receive())
            if message["type"] == "http.disconnect" or not message["more_body"]:
                break
        await _ok(scope, receive, send)

    transport = _Recording()
    protocol = _strict(app, transport)
    seen: list[Any] = []
    for part in parts:
        protocol.data_received(part)
        for _ in range(5):
            await asyncio.sleep(0)
        seen.append(list(messages) or None)
    if end == "eof":
        protocol.eof_received()
    if end:
        protocol.connection_lost(None)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not protocol.tasks, "the request's task is still running"
        seen.append(list(messages) or None)
    return seen, transport


def _body(data: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


def test_a_chunk_header_holds_the_request_until_its_data():
    """A read that ends at a chunk header leaves the app uncalled; the chunk's first
    bytes let it in, and it streams the body as before."""
    seen, _ = asyncio.run(
        _what_the_app_saw([CHUNKED.replace(b"/T", b"/") + b"5\r\n", b"hel", b"lo\r\n0\r\n\r\n"])
    )
    assert seen == [
        None,
        ["called", _body(b"hel", True)],
        ["called", _body(b"hel", True), _body(b"lo", False)],
    ]


def test_the_last_chunk_holds_the_request_until_its_trailers_end():
    """After the last chunk the app is not called until the trailer section's CRLF: it
    then gets the whole body at once."""
    seen, _ = asyncio.run(
        _what_the_app_saw(
            [CHUNKED.replace(b"/T", b"/") + b"5\r\nhello\r\n0\r\n", b"X-A: b\r\n", b"\r\n"]
        )
    )
    assert seen == [None, None, ["called", _body(b"hello", False)]]


@pytest.mark.parametrize("end", ["eof", "lost"])
def test_a_held_request_whose_connection_ends_never_reaches_the_app(end):
    """A request held after its last chunk never reaches the app when the connection
    ends; a client that only stopped sending is answered 400, as gunicorn answers."""
    seen, transport = asyncio.run(
        _what_the_app_saw([CHUNKED.replace(b"/T", b"/") + b"5\r\nhello\r\n0\r\n"], end)
    )
    assert seen == [None, None]
    assert transport.closed
    if end == "eof":
        assert transport.written.startswith(b"HTTP/1.1 400 "), transport.written
        assert b"chunked body" in transport.written
    else:
        assert transport.written == b""
