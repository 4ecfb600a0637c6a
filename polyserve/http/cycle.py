"""uvicorn's request-response cycle, sending a fixed-length response's head with its body.

uvicorn writes a response's head as soon as the app sends `http.response.start`, and its
body at `http.response.body`: two writes, and on a TCP_NODELAY socket (uvloop sets it) two
segments and two wake-ups of the client, for an answer of a few hundred bytes. Here the
head of a response whose length is known (Content-Length, or no body: 204, 304) waits
for the first body message and leaves in the same write; over loopback that made the
onnx-tiny space ~10% faster under load (bench/NOTES.md). A head still leaves at once
where holding it would delay what a client waits for: a chunked response's (a stream,
whose first chunk may be a long way off), a HEAD response's (no body follows), and the
head of a request sent with `Expect: 100-continue` (its client may hold the body back
until it sees an answer, which the app may be reading first).

What a client may see differently: a response started and then abandoned (the app raised,
or was cancelled, before its body) now closes the connection without a byte of it, where
uvicorn sent the head and then closed. Either way the response is broken, and now the
client is never told a status that the response then fails to deliver.

A request's task also waits before it calls the app while the request's chunked body has
got no further than a chunk header (the read that carried the head ended there, often
after the last chunk, its trailer section and CRLF still to come): a body byte or the
message's end lets it through, and a connection that ends first, or trailers refused,
keep it from the app. Streaming is unchanged: a chunk's first bytes let the app in.
"""

from __future__ import annotations

from typing import Any

from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

# A body below this is copied behind its head, and uvloop sends the one buffer on its fast
# path; a larger one goes beside it in one writelines (one writev, through a write context
# uvloop builds per call), so that a large body is not copied for the sake of its head.
JOIN_BELOW = 16384


# Header fields that passed uvicorn's checks of a response head: most answers repeat the
# same few (a model's content type and length), and two regex searches a field cost a
# tiny answer more than a set lookup. Emptied when full, so a stream of distinct values
# (dates, lengths) cannot grow it.
CHECKED: set[tuple[bytes, bytes]] = set()
CHECKED_MAX = 1024


def checked(name: bytes, value: bytes) -> None:
    """Remember a field that passed the checks."""
    if len(CHECKED) >= CHECKED_MAX:
        CHECKED.clear()
    CHECKED.add((name, value))


class Cycle(RequestResponseCycle):
    """What polyserve.http.strict's protocol creates for each request, in place of uvicorn's."""

    # The head held back until the body (a class attribute: no per-request __init__).
    head: bytes | None = None
    # The body's length plus one when the protocol parsed this request's latest chunk
    # header (polyserve.http.strict's on_chunk_header); 0 until it does. While the length is
    # unchanged the body has got no further than that header.
    chunk_mark = 0

    async def run_asgi(self, app: ASGI3Application) -> None:
        # uvicorn's run_asgi (tests/http/test_cycle.py checks that it still is), after a wait
        # at the door for a request whose chunked body stands at a chunk header. A GET's
        # body has ended by now: `more_body`, an instance attribute, is the cheaper test.
        if self.more_body and self.chunk_mark and not await self.past_chunk_header():
            return
        try:
            result = await app(  # type: ignore[func-returns-value]
                self.scope, self.receive, self.send
            )
        except BaseException as exc:
            msg = "Exception in ASGI application\n"
            self.logger.error(msg, exc_info=exc)
            if not self.response_started:
                await self.send_500_response()
            else:
                self.transport.close()
        else:
            if result is not None:
                msg = "ASGI callable should return None, but returned '%s'."
                self.logger.error(msg, result)
                self.transport.close()
            elif not self.response_started and not self.disconnected:
                msg = "ASGI callable returned without starting response."
                self.logger.error(msg)
                await self.send_500_response()
            elif not self.response_complete and not self.disconnected:
                msg = "ASGI callable returned without completing response."
                self.logger.error(msg)
                self.transport.close()
        finally:
            self.on_response = lambda: None

    async def past_chunk_header(self) -> bool:
        """Wait while the body stands at its latest chunk header: True once a body byte
        or the message's end has come, False if the connection ends first."""
        while self.more_body and self.chunk_mark == len(self.body) + 1:
            if self.disconnected:
                return False
            # A large body before the header may have paused reading; receive() resumes
            # it, and the app is not receiving yet.
            self.flow.resume_reading()
            self.message_event.clear()
            await self.message_event.wait()
        return not self.disconnected

    async def send(self, message: Any) -> None:
        # uvicorn's send (tests/http/test_cycle.py checks that it still is), holding back the head
        # where the comments that begin "polyserve:" say so; nothing else differs.
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()  # pragma: full coverage

        if self.disconnected:
            return  # pragma: full coverage

        if not self.response_started:
            # Sending response status line and headers
            if message["type"] != "http.response.start":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.start', but got '{message['type']}'."
                )

            self.response_started = True
            expecting = self.waiting_for_100_continue  # polyserve: see below
            self.waiting_for_100_continue = False

            status_code = message["status"]
            headers = self.default_headers + list(message.get("headers", []))

            if self.access_log:
                self.access_logger.info(
                    '%s - "%s %s HTTP/%s" %d',
                    get_client_addr(self.scope),
                    self.scope["method"],
                    get_path_with_query_string(self.scope),
                    self.scope["http_version"],
                    status_code,
                )

            # Write response status line and headers
            content = [STATUS_LINE[status_code]]
            has_connection_close = False

            for name, value in headers:
                # polyserve: a field already checked is not searched again (CHECKED).
                if (name, value) not in CHECKED:
                    if HEADER_RE.search(name):
                        raise RuntimeError("Invalid HTTP header name.")  # pragma: full coverage
                    if HEADER_VALUE_RE.search(value):
                        raise RuntimeError("Invalid HTTP header value.")
                    checked(name, value)

                name = name.lower()
                if name == b"content-length" and self.chunked_encoding is None:
                    self.expected_content_length = int(value.decode())
                    self.chunked_encoding = False
                elif name == b"transfer-encoding" and value.lower() == b"chunked":
                    self.expected_content_length = 0
                    self.chunked_encoding = True
                elif name == b"connection":
                    connection = [token.lower().strip() for token in value.split(b",")]
                    if b"close" in connection:
                        self.keep_alive = False
                        has_connection_close = True
                content.extend([name, b": ", value, b"\r\n"])

            if not self.keep_alive and not has_connection_close:
                content.append(b"connection: close\r\n")

            if (
                self.chunked_encoding is None
                and self.scope["method"] != "HEAD"
                and status_code not in (204, 304)
            ):
                # Neither content-length nor transfer-encoding specified
                self.chunked_encoding = True
                content.append(b"transfer-encoding: chunked\r\n")

            content.append(b"\r\n")
            # polyserve: a fixed-length response's head leaves with its body. Now: a
            # stream's; a HEAD's, which no body byte follows; and one whose client waits
            # for a 100 Continue, or this head, before it sends the body the app reads.
            if self.chunked_encoding or expecting or self.scope["method"] == "HEAD":
                self.transport.write(b"".join(content))
            else:
                self.head = b"".join(content)

        elif not self.response_complete:
            # Sending response body
            if message["type"] != "http.response.body":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.body', but got '{message['type']}'."
                )

            body = message.get("body", b"")
            more_body = message.get("more_body", False)

            # Write response body
            if self.scope["method"] == "HEAD":
                self.expected_content_length = 0
            elif self.chunked_encoding:
                content = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
                if not more_body:
                    content.append(b"0\r\n\r\n")
                self.transport.write(b"".join(content))
            else:
                num_bytes = len(body)
                if num_bytes > self.expected_content_length:
                    raise RuntimeError("Response content longer than Content-Length")
                else:
                    self.expected_content_length -= num_bytes
                # polyserve: the held head, if still held, and the body in one write.
                head = self.head
                if head is None:
                    self.transport.write(body)
                else:
                    self.head = None
                    if num_bytes < JOIN_BELOW:
                        self.transport.write(head + body)
                    else:
                        self.transport.writelines((head, body))  # one writev, no copy

            # Handle response completion
            if not more_body:
                if self.expected_content_length != 0:
                    raise RuntimeError("Response content shorter than Content-Length")
                self.response_complete = True
                self.message_event.set()
                if not self.keep_alive:
                    self.transport.close()
                self.on_response()

        else:
            # Response already sent
            raise RuntimeError(
                f"Unexpected ASGI message '{message['type']}' sent, after response already"
                " completed."
            )
