"""uvicorn's httptools protocol, with what llhttp lets through refused at the door.

llhttp (under httptools) already refuses bad field names and values, bare CR/LF, obs-fold,
duplicated Content-Length, Content-Length with Transfer-Encoding, bad chunk framing and
bad methods. What it lets through is checked here, in the callbacks that already see each
piece of a request, before any application sees it:

- gunicorn's `limit_request_line` (414), `limit_request_fields` and
  `limit_request_field_size` (431), which uvicorn's worker ignores;
- `Content_Length` / `Transfer_Encoding` (a smuggling vector: proxies read them as the
  real ones), a duplicated `Host`, an HTTP/1.1 request without `Host`;
- Transfer-Encoding on HTTP/1.0 (RFC 9112 6.1: faulty framing);
- versions other than 1.0 and 1.1, and `*` as the target of a method other than OPTIONS;
- trailer fields that may not be trailers (RFC 9110 6.5.1); the others are dropped rather
  than merged into the header list the application already holds.

A request with a body starts its application only once the data that carried its head
has been parsed, so that a body llhttp refuses in the same read (bad chunk sizes, missing
CRLFs, forbidden trailers) never reaches a space; a body whose bad part arrives in a later
read finds the application started, which then sees the client disconnect.
"""

from __future__ import annotations

from typing import Any, ClassVar

import httptools
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

# gunicorn's ceilings (gunicorn.http.message): what its own parser applies to its settings.
MAX_REQUEST_LINE = 8190
MAX_HEADERS = 32768
DEFAULT_MAX_HEADERFIELD_SIZE = 8190

SMUGGLING_NAMES = frozenset({b"content_length", b"transfer_encoding"})

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
    """Raised from a parser callback: httptools stops and re-raises it as the context of
    its HttpParserCallbackError."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


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
    return {"max_line": line, "max_fields": fields, "max_field_size": field_size}


def protocol(cfg: Any) -> type[StrictHttpToolsProtocol]:
    """The protocol class for uvicorn's `config.http`, with gunicorn's limits in `cfg`."""
    return type("StrictHttpToolsProtocol", (StrictHttpToolsProtocol,), limits(cfg))


class StrictHttpToolsProtocol(HttpToolsProtocol):
    max_line: ClassVar[int] = 4094  # 0: unlimited
    max_fields: ClassVar[int] = 100
    max_field_size: ClassVar[int] = DEFAULT_MAX_HEADERFIELD_SIZE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.feeding = False  # inside parser.feed_data
        self.held: list[tuple[RequestResponseCycle, ASGI3Application]] = []
        self.in_head = False
        self.in_trailers = False
        self.head_bytes = 0
        self.fields = 0
        self.host = False
        self.body = False  # Content-Length or Transfer-Encoding seen
        self.transfer_encoding = False
        # What a head may take at most, CRLFs included: beyond it, a field is too large.
        self.head_budget = (self.max_line or 1 << 20) + self.max_fields * (self.max_field_size + 2)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        self.feeding = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.feeding = False
            self._release()
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            self.held.clear()
            refused = exc.__context__
            if isinstance(refused, Refused):
                self.refuse(refused.status, refused.message)
            else:
                self.refuse(400, "Invalid HTTP request received.")
            return
        finally:
            self.feeding = False
        if self.held:
            self._release()
        if self.in_head:
            self.head_bytes += len(data)
            if self.head_bytes > self.head_budget:
                self.refuse(431, "Request header fields too large.")

    def refuse(self, status: int, message: str) -> None:
        """uvicorn's send_400_response, for any status: answer, and close."""
        self.logger.warning("Refused an HTTP request (%d): %s", status, message)
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        body = message.encode("ascii")
        content.extend(
            [
                b"content-type: text/plain; charset=utf-8\r\n",
                b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                b"connection: close\r\n",
                b"\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.refuse(400, msg)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        # A request with a body waits for the end of the read that carried its head.
        if self.feeding and self.body:
            self.held.append((cycle, app))
        else:
            super()._start_asgi_task(cycle, app)

    def _release(self) -> None:
        held, self.held = self.held, []
        for cycle, app in held:
            super()._start_asgi_task(cycle, app)

    # -- parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_head, self.in_trailers = True, False
        self.head_bytes = self.fields = 0
        self.host = self.body = self.transfer_encoding = False

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.max_line > 0:
            raise Refused(414, "Request line too long.")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) + 2 > self.max_field_size:
            raise Refused(431, "Request header field too large.")
        name = name.lower()
        if self.in_trailers:
            if name in NOT_IN_TRAILERS:
                raise Refused(400, "Field not allowed in a trailer.")
            return  # never merged into the headers the application already has
        self.fields += 1
        if self.fields > self.max_fields:
            raise Refused(431, "Too many request header fields.")
        if name == b"host":
            if self.host:
                raise Refused(400, "Duplicate Host.")
            self.host = True
        elif name == b"content-length":
            self.body = True
        elif name == b"transfer-encoding":
            self.body = self.transfer_encoding = True
        elif name in SMUGGLING_NAMES:
            raise Refused(400, "Invalid header name.")
        elif name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))  # uvicorn's on_header, without a second lower()

    def on_headers_complete(self) -> None:
        self.in_head, self.in_trailers = False, True
        version = self.parser.get_http_version()
        if version != "1.1":
            if version != "1.0":
                raise Refused(400, "Unsupported HTTP version.")
            if self.transfer_encoding:
                raise Refused(400, "Transfer-Encoding on HTTP/1.0.")
        elif not self.host:
            raise Refused(400, "Missing Host.")
        method = self.parser.get_method()
        if len(method) + len(self.url) + 10 > self.max_line > 0:
            raise Refused(414, "Request line too long.")
        if self.url == b"*" and method != b"OPTIONS":
            raise Refused(400, "* is a target for OPTIONS only.")
        super().on_headers_complete()
