"""The `inference protocol` scenario's second ceiling: the least a V2 JSON model server does.

On the same gunicorn worker, loop and parser as polyserve, it reads the body, parses it
with orjson, runs the one input through onnxruntime and writes the outputs with orjson,
checking nothing: a malformed request is a 500 here. polyserve's model space does the
same work plus the protocol's checks, metering, the deadline and the hot swap, so this
server's rate bounds what it can reach. The model is the file BARE_MODEL names.
"""

import os

import numpy as np
import onnxruntime
import orjson

_SESSION = onnxruntime.InferenceSession(os.environ["BARE_MODEL"])
_OUTPUTS = [o.name for o in _SESSION.get_outputs()]
_DATATYPES = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}
_HEADERS = [(b"content-type", b"application/json")]


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    tensor = orjson.loads(body)["inputs"][0]
    x = np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])
    results = _SESSION.run(_OUTPUTS, {tensor["name"]: x})
    outputs = [
        {"name": n, "datatype": _DATATYPES[r.dtype], "shape": list(r.shape), "data": r.ravel()}
        for n, r in zip(_OUTPUTS, results, strict=True)
    ]
    answer = {"model_name": "lee101/digits", "model_version": "1", "outputs": outputs}
    out = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    length = (b"content-length", b"%d" % len(out))
    await send({"type": "http.response.start", "status": 200, "headers": [*_HEADERS, length]})
    await send({"type": "http.response.body", "body": out})
