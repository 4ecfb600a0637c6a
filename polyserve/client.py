"""The `polyserve` command's HTTP client: one host's control plane, over the stdlib's urllib.

Why urllib and not a client library: the command makes a handful of one-shot calls (one
upload, a few small JSON reads and writes, a poll once a second for `logs -f`) and is
installed with every host. httpx is not a host dependency (the tests use httpx2), and
requests would add four packages to every host for those calls. What urllib lacks is a
multipart encoder: `_multipart` below, for the deploy form's two fields.
"""

from __future__ import annotations

import json
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


class Client:
    def __init__(self, url: str, token: str = "", timeout: float = 120.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"the host URL must be http(s)://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

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
        """One request: (status, the JSON answer) for a 2xx; HostRefused for a 4xx;
        HostUnavailable for a 5xx or no answer."""
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        request = urllib.request.Request(url, data=body, method=method)
        if content_type:
            request.add_header("Content-Type", content_type)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as exc:  # an answer, 4xx or 5xx
            with exc:
                answer = _json(exc.read())
            error, details = _error_of(answer, exc.code)
            if exc.code >= 500:
                raise HostUnavailable(error, exc.code) from None
            raise HostRefused(exc.code, error, details) from None
        except (TimeoutError, urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise HostUnavailable(f"cannot reach the host at {self.url}: {reason}") from None

    def post_json(self, path: str, payload: dict[str, object] | None = None) -> tuple[int, Any]:
        body = b"" if payload is None else json.dumps(payload).encode()
        return self.call("POST", path, body=body, content_type="application/json")

    def deploy(self, space: str, filename: str, data: bytes) -> tuple[int, Any]:
        body, content_type = _multipart({"space": space}, "module", filename, data)
        return self.call("POST", "/_polyserve/deploy", body=body, content_type=content_type)


def space_path(space: str, *rest: str) -> str:
    return "/".join(["/_polyserve/spaces", space, *rest])


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except ValueError:  # not ours (a proxy's HTML page): show its start
        return {"error": raw[:200].decode(errors="replace").strip()}


def _error_of(answer: Any, status: int) -> tuple[str, dict[str, Any]]:
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return answer["error"], {k: v for k, v in answer.items() if k != "error"}
    return f"HTTP {status}", {}


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
