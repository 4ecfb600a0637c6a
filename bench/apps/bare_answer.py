"""The `inference protocol` scenario's first ceiling: an ASGI app that answers fixed bytes.

It reads the request and does nothing else, on the same gunicorn worker, loop and parser
as polyserve, so no server built on this stack answers faster: its rate over MLServer's
bounds what any codec or model space could reach. The answer is the file BARE_ANSWER
names (polyserve's own answer to the same request, so both send the same bytes).
"""

import os
from pathlib import Path

_ANSWER = Path(os.environ["BARE_ANSWER"]).read_bytes()
_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_ANSWER))],
}
_BODY = {"type": "http.response.body", "body": _ANSWER}


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(_START)
    await send(_BODY)
