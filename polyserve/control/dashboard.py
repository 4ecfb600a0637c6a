"""The dashboard at /_polyserve/: one self-contained page that reads the host's JSON routes."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

from starlette.responses import Response

PAGE = (Path(__file__).with_name("dashboard.html")).read_bytes()


def _inline_hash(tag: bytes) -> str:
    """The CSP source that allows the page's one inline <script> or <style>, by hash."""
    found = re.search(rb"<%s>(.*?)</%s>" % (tag, tag), PAGE, re.DOTALL)
    assert found is not None, f"dashboard.html has no <{tag.decode()}>"
    digest = base64.b64encode(hashlib.sha256(found.group(1)).digest()).decode()
    return f"'sha256-{digest}'"


# Only the page's own script and style run, and it talks only to this host: a log line
# that slipped past the escaping could still run nothing (no inline handler, no remote
# script), and no data leaves for another origin.
POLICY = "; ".join(
    (
        "default-src 'none'",
        f"script-src {_inline_hash(b'script')}",
        f"style-src {_inline_hash(b'style')}",
        "connect-src 'self'",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def response() -> Response:
    return Response(PAGE, media_type="text/html; charset=utf-8", headers=HEADERS)
