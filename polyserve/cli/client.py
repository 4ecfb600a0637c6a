"""The `polyserve` command's HTTP client: one host's control plane, over the stdlib's urllib.

Why urllib and not a client library: the command makes a handful of one-shot calls (one
upload, a few small JSON reads and writes, a poll once a second for `logs -f`) and is
installed with every host. httpx is not a host dependency (the tests use httpx2), and
requests would add four packages to every host for those calls. What urllib lacks is a
multipart encoder: `_multipart` below, for the deploy form's two fields.
"""

from __future__ import annotations

import http.client
import json
import re
import secrets
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8441"


@dataclass
class HostRefused(Exception):
    """The host answered 4xx: its JSON error, and the details it gave (what to fix)."""

    status: int
    error: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class HostUnavailable(Exception):
    """The host could not be reached, or answered 5xx: nothing the request could fix."""

    error: str
    status: int | None = None  # None: no answer at all


@dataclass
class BadAnswer(Exception):
    """Something answered, but not as a polyserve host does: not JSON, another shape, an
    empty body, one cut short (a proxy's page, another server, another version)."""

    url: str
    status: int | None  # None: not even an HTTP status line
    what: str

    def __str__(self) -> str:
        what = f"HTTP {self.status} with {self.what}" if self.status else self.what
        return f"the host at {self.url} answered {what}, not polyserve's JSON"


class _Connection(http.client.HTTPConnection):
    """A connection that reads the answer a host sent before the request's body was all
    sent. A host refuses an upload over its limit at once (413) and closes, so sending
    the rest fails with a broken pipe or a reset while the answer waits to be read."""

    _unsent: OSError | None = None

    def request(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().request(*args, **kwargs)
        except (BrokenPipeError, ConnectionResetError) as exc:
            if self.sock is None:
                raise
            self._unsent = exc

    def getresponse(self) -> http.client.HTTPResponse:
        try:
            return super().getresponse()
        except (OSError, http.client.HTTPException):
            if self._unsent is not None:  # no answer came: the failed send is the news
                raise self._unsent from None
            raise


class _TLSConnection(_Connection, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_Connection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_TLSConnection, req)


class Client:
    def __init__(self, url: str, token: str = "", timeout: float = 120.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"the host URL must be http(s)://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.status: int | None = None  # of the last answer: what a malformed one says
        self._opener = urllib.request.build_opener(_HTTPHandler, _HTTPSHandler)

    def get(self, path: str, **query: object) -> Any:
        return self.call("GET", path, query=query)[1]

    def call(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, object] | None = None,
        body: bytes | None = None,
        content_type: str | None = None,
    ) -> tuple[int, Any]:
        """One request: (status, the JSON object answered) for a 2xx; HostRefused for a
        4xx; HostUnavailable for a 5xx or no answer; BadAnswer for an answer that is not
        polyserve's."""
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        request = urllib.request.Request(url, data=body, method=method)
        if content_type:
            request.add_header("Content-Type", content_type)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                self.status = response.status
                answer = self._json(response)
                if not isinstance(answer, dict):
                    raise BadAnswer(self.url, self.status, f"JSON {type(answer).__name__}")
                return response.status, answer
        except urllib.error.HTTPError as exc:  # an answer, 4xx or 5xx
            self.status = exc.code
            with exc:
                answer = self._json(exc)
            if not isinstance(answer, dict) or not isinstance(answer.get("error"), str):
                raise BadAnswer(self.url, exc.code, "JSON without an `error`") from None
            error = answer.pop("error")
            if exc.code >= 500:
                raise HostUnavailable(error, exc.code) from None
            raise HostRefused(exc.code, error, answer) from None
        except http.client.RemoteDisconnected:  # closed without a word: not an answer
            raise HostUnavailable(f"the host at {self.url} closed without answering") from None
        except (TimeoutError, urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise HostUnavailable(f"cannot reach the host at {self.url}: {reason}") from None
        except http.client.HTTPException as exc:  # a status line that is not HTTP's
            what = f"something that is not HTTP ({type(exc).__name__})"
            raise BadAnswer(self.url, None, what) from None

    def _json(self, response: Any) -> Any:
        """The answer's JSON; BadAnswer for a body that is empty, cut short or not JSON."""
        try:
            raw = response.read()
        except http.client.IncompleteRead as exc:
            got = len(exc.partial)
            size = f"{got} of {got + exc.expected}" if exc.expected else f"{got}"
            raise BadAnswer(self.url, self.status, f"a body cut short ({size} bytes)") from None
        except OSError as exc:  # a reset, a timeout, halfway through the body
            raise HostUnavailable(
                f"the host at {self.url} stopped while answering: {exc}", self.status
            ) from None
        if not raw:
            raise BadAnswer(self.url, self.status, "an empty body")
        try:
            return json.loads(raw)
        except ValueError:
            what = _body_summary(raw, response.headers.get("Content-Type", ""))
            raise BadAnswer(self.url, self.status, what) from None

    def post_json(self, path: str, payload: dict[str, object] | None = None) -> tuple[int, Any]:
        body = b"" if payload is None else json.dumps(payload).encode()
        return self.call("POST", path, body=body, content_type="application/json")

    def deploy(
        self, space: str, filename: str, data: bytes, current: bool = True
    ) -> tuple[int, Any]:
        fields = {"space": space} if current else {"space": space, "current": "false"}
        body, content_type = _multipart(fields, "module", filename, data)
        return self.call("POST", "/_polyserve/deploy", body=body, content_type=content_type)


def space_path(space: str, *rest: str) -> str:
    return "/".join(["/_polyserve/spaces", space, *rest])


def _body_summary(raw: bytes, content_type: str) -> str:
    """A body that is not JSON, in a few words: an HTML page by its title."""
    text = raw[:4096].decode(errors="replace")
    title = re.search(r"<title[^>]*>([^<]*)", text, re.IGNORECASE)
    if title or "html" in content_type.lower():
        name = " ".join((title.group(1) if title else "").split())
        return f"an HTML page ({name!r})" if name else "an HTML page"
    first = " ".join(text.split())[:60]
    return f"{content_type.split(';')[0] or 'a body'} {first!r}"


def _multipart(
    fields: dict[str, str], file_field: str, filename: str, data: bytes
) -> tuple[bytes, str]:
    """A multipart/form-data body (RFC 7578): the text fields, then one file."""
    boundary = "polyserve-" + secrets.token_hex(16)  # random: it cannot occur in the data
    parts = []
    for name, value in fields.items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        )
    quoted = filename.replace('"', "%22").replace("\r", "").replace("\n", "")
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}";'
        f' filename="{quoted}"\r\nContent-Type: application/octet-stream\r\n\r\n'
    )
    body = "".join(parts).encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"
