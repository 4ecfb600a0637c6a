"""uvicorn's httptools protocol, refusing at the door what a strict HTTP/1 parser refuses.

llhttp (under httptools) is strict by default, and uvicorn loosens only
`lenient_data_after_close`: it already refuses field names outside the token set, control
characters in values, bare CR/LF and NUL, obs-fold, duplicated Content-Length,
Content-Length with Transfer-Encoding, Transfer-Encoding without `chunked` last, bad chunk
framing and methods it does not know (tests/http/test_http_strict.py sends each). What it lets
through is refused here, in the parser callbacks uvicorn's protocol already has (and
on_chunk_header, which only a chunked body calls), so that a plain GET pays for a few
comparisons only and no call (data_received and on_headers_complete are uvicorn's own,
copied with the checks between their lines; tests/http/test_http_strict.py fails when uvicorn
changes them):

- gunicorn's `limit_request_line` (414), `limit_request_fields` and
  `limit_request_field_size` (431: a field's whole line, CRLF included, as gunicorn
  counts it), which uvicorn's worker ignores, trailer fields included, and a bound on the
  bytes a connection may send without the parser getting anywhere (a head or a trailer
  section still incomplete, chunk framing): httptools joins the pieces of a field with
  `+=` and calls back only once it ends;
- `Content_Length` / `Transfer_Encoding` (proxies may read them as the real ones), a
  duplicated `Host` or `Content-Type` (gunicorn's singleton fields), an HTTP/1.1 request
  without Host, Transfer-Encoding on HTTP/1.0;
- versions other than 1.0 and 1.1, and `*` as the target of a method other than OPTIONS;
- trailer fields that may not be trailers (RFC 9110 6.5.1); the others are dropped, never
  merged into the header list the application already holds.

When llhttp refuses a body in the read that carried its head (a bad chunk size, a missing
CRLF, a forbidden trailer), the request's task has been created but has not run: it is
cancelled before its first step, so the request never reaches a space. A chunked body
that has got no further than a chunk header when its task starts (the last chunk read,
its trailer section and final CRLF not yet) is held at the door until it does
(polyserve.http.cycle), and a connection that ends there is answered gunicorn's 400.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import urllib.parse
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, service_unavailable
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from polyserve.http.cycle import Cycle

# gunicorn's ceilings (gunicorn.http.message): what its own parser applies to its settings.
MAX_REQUEST_LINE = 8190
MAX_HEADERS = 32768
DEFAULT_MAX_HEADERFIELD_SIZE = 8190

# Lower-cased names (but Host) on_header looks at twice: one set lookup for the others.
WATCHED = frozenset(
    {b"content-type", b"transfer-encoding", b"expect", b"content_length", b"transfer_encoding"}
)

# RFC 9110 6.5.1: framing, routing, request modifiers, authentication, content format.
NOT_IN_TRAILERS = frozenset(
    {
        b"host",
        b"content-length",
        b"transfer-encoding",
        b"trailer",
        b"te",
        b"connection",
        b"keep-alive",
        b"upgrade",
        b"expect",
        b"max-forwards",
        b"cache-control",
        b"pragma",
        b"range",
        b"if-match",
        b"if-none-match",
        b"if-modified-since",
        b"if-unmodified-since",
        b"if-range",
        b"authorization",
        b"proxy-authorization",
        b"cookie",
        b"content-type",
        b"content-encoding",
        b"content-range",
    }
)


class Refused(Exception):
    """Raised from a parser callback: httptools stops and raises HttpParserCallbackError
    with this as its context."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Trailers(list[tuple[bytes, bytes]]):
    """What `self.headers` is once a head is complete (one per connection): on_header
    appends a chunked body's trailer fields here, which refuses those that may not be
    trailers, keeps none and counts the others, so that on_header's `len(headers)` bounds
    them by limit_request_fields, as gunicorn does."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0  # on_headers_complete resets it for each request

    def append(self, field: tuple[bytes, bytes]) -> None:
        if field[0] in NOT_IN_TRAILERS:
            raise Refused(400, f"{field[0].decode()} may not be a trailer field (RFC 9110 6.5.1)")
        self.seen += 1

    def __len__(self) -> int:
        return self.seen


def limits(cfg: Any) -> dict[str, int]:
    """gunicorn's limit_request_* settings, read the way gunicorn's own parser reads them
    (0 means unlimited for the line; the field settings fall back to their ceilings)."""
    line = cfg.limit_request_line
    if line < 0 or line >= MAX_REQUEST_LINE:
        line = MAX_REQUEST_LINE
    fields = cfg.limit_request_fields
    if fields <= 0 or fields > MAX_HEADERS:
        fields = MAX_HEADERS
    field_size = cfg.limit_request_field_size
    if field_size <= 0:
        field_size = DEFAULT_MAX_HEADERFIELD_SIZE
    return {
        "max_line": line or 1 << 30,
        "max_fields": fields,
        "max_field_size": field_size,
        # What a head (or a trailer section) may take at most, CRLFs included: beyond it, a
        # field is too large or there are too many.
        "head_budget": (line or MAX_REQUEST_LINE) + fields * (field_size + 2),
    }


def protocol(cfg: Any) -> type[StrictHttpToolsProtocol]:
    """The protocol class for uvicorn's `http` setting (`uvicorn.Config`), with gunicorn's
    limits in `cfg`."""
    return type("StrictHttpToolsProtocol", (StrictHttpToolsProtocol,), limits(cfg))


class StrictHttpToolsProtocol(HttpToolsProtocol):
    # Slots, not instance attributes: uvicorn's protocol already sets 28, and past 30 an
    # instance's attributes no longer share their class's keys (CPython's
    # SHARED_KEYS_MAX_SIZE), which made every attribute read of uvicorn's own code slower:
    # most of the first version's cost per request (bench/NOTES.md, "Strict HTTP at the
    # door").
    __slots__ = ("head_bytes", "host_of", "trailers", "type_of")

    max_line: ClassVar[int] = 4094
    max_fields: ClassVar[int] = 100
    max_field_size: ClassVar[int] = DEFAULT_MAX_HEADERFIELD_SIZE
    head_budget: ClassVar[int] = 4094 + 100 * (DEFAULT_MAX_HEADERFIELD_SIZE + 2)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Per-request state without a per-request reset: uvicorn's on_message_begin gives
        # each request a new `self.headers` list, so "this request has a Host" is
        # `self.host_of is self.headers` (and likewise `type_of` for Content-Type), and
        # "its head is complete" is `self.headers is self.trailers` (on_headers_complete
        # sets it).
        self.host_of: object = None
        self.type_of: object = None
        self.trailers = Trailers()
        # Bytes of the reads since the last one in which the parser got somewhere: a
        # message ended, a head complete, a body byte (the callbacks reset it). So it
        # counts what a head, a trailer section or chunk framing took over several reads,
        # never a previous request's bytes: the read that ends one message and begins the
        # next head counts nothing, so the bound holds within one read (256 KB on uvloop).
        self.head_bytes = 0

    def data_received(self, data: bytes) -> None:
        # uvicorn's data_received (tests/http/test_http_strict.py checks that it still is), with
        # a refusal's own status and the bound on bytes that get the parser nowhere.
        self._unset_keepalive_if_required()

        self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            refused = exc.__context__
            if isinstance(refused, Refused):
                self.refuse(refused.status, refused.message)
            else:
                self.refuse(400, f"invalid HTTP request: {exc.args[0] if exc.args else exc}")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self.head_bytes > self.head_budget:
            if self.headers is self.trailers:
                self.refuse(431, f"trailer section larger than {self.head_budget} bytes")
            else:
                self.refuse(431, f"request head larger than {self.head_budget} bytes")

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` with a JSON body that says what was wrong, and close; or only
        close, when a response has begun that the answer would land in or after."""
        self.logger.warning("Refused an HTTP request (%d): %s", status, message)
        self.cancel_unstarted()
        cycle = self.cycle
        if (
            cycle is not None
            and cycle.response_started
            # A new head's refusal may follow a previous request's complete response;
            # the body or trailers of one already answered may not.
            and (self.headers is self.trailers or not cycle.response_complete)
        ):
            self.transport.close()
            return
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        body = json.dumps({"error": message}).encode()
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                b"connection: close\r\n",
                b"\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()

    def cancel_unstarted(self) -> None:
        """Cancel the task of this connection's request if it has not taken its first
        step: its head parsed, but llhttp refused its body in the same read. Cancelled
        before it starts, a coroutine never runs a line, so no space sees the request."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        for task in self.tasks:
            coro = task.get_coro()
            if (
                inspect.iscoroutine(coro)
                and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED
                and inspect.getcoroutinelocals(coro).get("self") is cycle
            ):
                task.cancel()

    # -- parser callbacks (uvicorn's own, with the checks; no callback is added)

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.max_line:
            raise Refused(
                414, f"request line longer than {self.max_line} bytes (limit_request_line)"
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        headers = self.headers
        # gunicorn measures a field's whole line with its CRLF: name, colon, the whitespace
        # after it (httptools drops it: counted as the one space clients send), the value
        # (trailing whitespace included, as httptools keeps it) and CRLF.
        if len(headers) >= self.max_fields or len(name) + len(value) + 4 > self.max_field_size:
            if len(headers) >= self.max_fields:
                raise Refused(
                    431, f"more than {self.max_fields} header fields (limit_request_fields)"
                )
            raise Refused(
                431,
                f"a header field line longer than {self.max_field_size} bytes with its CRLF"
                " (limit_request_field_size)",
            )
        if name == b"host":  # in every request: checked here, not in a call
            if self.host_of is headers:
                raise Refused(400, "more than one Host field: send one")
            self.host_of = headers
        elif name in WATCHED:
            self.watched(name, value)
        headers.append((name, value))

    def watched(self, name: bytes, value: bytes) -> None:
        """The checks of the few other names on_header watches (and uvicorn's Expect)."""
        if name == b"content-type":
            # RFC 9110 5.3: a singleton field; two leave the request open to two readings.
            # gunicorn refuses a second Host or Content-Type (Content-Length: llhttp).
            if self.type_of is self.headers:
                raise Refused(400, "more than one Content-Type field: send one")
            self.type_of = self.headers
        elif name == b"transfer-encoding":
            # RFC 9112 6.1: an HTTP/1.0 recipient would read the body another way.
            if self.parser.get_http_version() == "1.0":
                raise Refused(
                    400, "Transfer-Encoding on HTTP/1.0: send Content-Length, or HTTP/1.1"
                )
        elif name == b"expect":
            if value.lower() == b"100-continue":
                self.expect_100_continue = True
        else:  # content_length, transfer_encoding: a smuggling vector behind a proxy
            raise Refused(
                400, f"{name.decode()}: use {name.decode().replace('_', '-')}, with a hyphen"
            )

    def on_headers_complete(self) -> None:
        # uvicorn's on_headers_complete (tests/http/test_http_strict.py checks that it still
        # is), with the checks between its lines: as a wrapper around it, the extra call
        # cost a measurable share of a request (bench/NOTES.md, "Strict HTTP at the
        # door"). A refusal here comes before the request has a task.
        http_version = self.parser.get_http_version()
        method = self.parser.get_method()
        self.scope["method"] = method.decode("ascii")
        if http_version != "1.1":
            if http_version != "1.0":
                raise Refused(400, f"HTTP/{http_version} on an HTTP/1 connection: use 1.1")
            self.scope["http_version"] = http_version
        elif self.host_of is not self.headers:
            raise Refused(400, "an HTTP/1.1 request needs a Host field (RFC 9112 3.2)")
        url = self.url
        if url == b"*" and method != b"OPTIONS":
            raise Refused(400, "* is the target of OPTIONS only")
        # on_url bounded the target; the whole line is method SP target SP HTTP/1.1.
        if len(url) > self.max_line - 30 and len(method) + len(url) + 10 > self.max_line:
            raise Refused(
                414, f"request line longer than {self.max_line} bytes (limit_request_line)"
            )
        self.head_bytes = 0
        if self.parser.should_upgrade() and self._should_upgrade():
            return  # uvicorn reads self.headers again for the upgrade
        parsed_url = httptools.parse_url(url)
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
            len(self.connections) >= self.limit_concurrency
            or len(self.tasks) >= self.limit_concurrency
        ):
            app = service_unavailable
            message = "Exceeded concurrency limit."
            self.logger.warning(message)
        else:
            app = self.app

        existing_cycle = self.cycle
        self.cycle = Cycle(  # uvicorn's, with a response's head and body in one write
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
        # The trailers of a chunked body, if any, go to self.trailers, not to the scope's
        # list.
        trailers = self.trailers
        trailers.seen = 0
        self.headers = trailers

    def on_chunk_header(self) -> None:
        # Each chunk header of a chunked body marks where the body stood; while it stands
        # there, the request's task does not call the app (Cycle.run_asgi). Only chunked
        # bodies call this: httptools looks the callback up once, at the parser's start.
        cycle: Cycle = self.cycle  # type: ignore[assignment]
        cycle.chunk_mark = len(cycle.body) + 1

    def eof_received(self) -> None:
        # The client has stopped sending (a half-close, or the start of a close): a
        # chunked body that got no further than a chunk header is cut short, which
        # gunicorn answers 400 (ChunkMissingTerminator). A request held at the door for it
        # never reaches a space. uvicorn's transport closes the connection afterwards.
        cycle: Cycle | None = self.cycle  # type: ignore[assignment]
        if cycle is not None and cycle.more_body and cycle.chunk_mark == len(cycle.body) + 1:
            self.refuse(
                400,
                "the connection ended inside the chunked body: send its last chunk (0) and"
                " the CRLF that ends its trailer section (RFC 9112 7.1)",
            )

    def on_body(self, body: bytes) -> None:
        # uvicorn's on_body (tests/http/test_http_strict.py checks that it still is), a body
        # byte resetting the count of bytes that got the parser nowhere.
        self.head_bytes = 0
        if (
            self.parser.should_upgrade() and self._should_upgrade()
        ) or self.cycle.response_complete:
            return
        self.cycle.body += body
        if len(self.cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        self.cycle.message_event.set()

    def on_message_complete(self) -> None:
        # uvicorn's on_message_complete (tests/http/test_http_strict.py checks that it still
        # is): the next head's count starts here, not with this message's last bytes.
        self.head_bytes = 0
        if (
            self.parser.should_upgrade() and self._should_upgrade()
        ) or self.cycle.response_complete:
            return
        self.cycle.more_body = False
        self.cycle.message_event.set()
