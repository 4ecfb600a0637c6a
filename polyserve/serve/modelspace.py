"""A model space: an onnxruntime session answering the Open Inference Protocol under its prefix.

The host builds one for a deployed `.onnx` file (polyserve.serve.loader), and a Python space
builds one with `polyserve.models.inference_app(session, pre=..., post=...)`. Either way the
version's app is an `InferenceApp`, its kind is "model", and the request path reads the
body straight into numpy arrays (polyserve.serve.protocol) without a Starlette Request.

Dispatch calls `InferenceApp.respond` and sends the answer itself, so it can bill an
infer as a request of the space (a refused one as an error too) and leave metadata and
health reads unbilled. `InferenceApp.__call__` is the same as a plain ASGI app, for a
space mounted anywhere else.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from starlette.types import Receive, Scope, Send

from polyserve.serve import protocol, routes
from polyserve.serve.batching import Batcher, Batching, ClientGone
from polyserve.serve.placement import Placement
from polyserve.serve.routes import (
    Answer,
    Route,
    check_version,
    error_answer,
    json_answer,
    kept_models,
    parse,
    server_metadata,
)
from polyserve.serve.tensors import ProtocolError, TensorSpec

log = logging.getLogger("polyserve.space")

# onnxruntime's type strings and the protocol's datatypes.
ORT_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}
MAX_BODY_MB = 64  # an infer body's bound outside a host (POLYSERVE_MAX_INFER_MB's default)


class ModelError(Exception):
    """A model the protocol cannot serve (a non-tensor input, a type it cannot carry)."""


def tensor_specs(args: Sequence[Any], what: str, strict: bool) -> list[TensorSpec]:
    """The protocol's view of a session's inputs or outputs. A non-tensor one (a sequence
    or a map) is a ModelError when `strict` (inputs), and left out otherwise (outputs)."""
    found = []
    for arg in args:
        datatype = ORT_DATATYPES.get(arg.type)
        if datatype is None:
            if strict:
                raise ModelError(
                    f"{what} {arg.name!r} is {arg.type}: the inference protocol carries"
                    " tensors of BOOL, INT8-64, UINT8-64, FP16, FP32, FP64 and BYTES only"
                )
            log.warning(
                "%s %r is %s: the protocol cannot carry it; left out", what, arg.name, arg.type
            )
            continue
        shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or ()))
        found.append(TensorSpec(arg.name, datatype, shape))
    return found


class Model:
    """A session and the tensors the protocol offers of it: the session's own, or, with
    `pre` and `post`, the ones those functions take and give."""

    def __init__(
        self,
        session: Any,
        *,
        pre: Callable[[dict[str, np.ndarray]], Mapping[str, Any]] | None = None,
        post: Callable[[dict[str, np.ndarray]], Mapping[str, Any]] | None = None,
        inputs: Sequence[TensorSpec] | None = None,
        outputs: Sequence[TensorSpec] | None = None,
    ) -> None:
        self.session = session
        self.pre, self.post = pre, post
        own_inputs = tensor_specs(session.get_inputs(), "input", strict=pre is None)
        own_outputs = tensor_specs(session.get_outputs(), "output", strict=False)
        if not own_outputs:
            raise ModelError("the model has no tensor output the protocol can carry")
        if pre is not None and inputs is None:
            raise ModelError("with `pre`, say the inputs it takes: inputs=[Tensor(...), ...]")
        if post is not None and outputs is None:
            raise ModelError("with `post`, say the outputs it gives: outputs=[Tensor(...), ...]")
        self.inputs = {s.name: s for s in (inputs if inputs is not None else own_inputs)}
        self.outputs = {s.name: s for s in (outputs if outputs is not None else own_outputs)}
        self._session_outputs = [s.name for s in own_outputs]

    def check_batchable(self) -> None:
        """Refuse batching for a model whose tensors have no dynamic first axis to merge
        requests along: the error names the first such input or output."""
        for what, specs in (("input", self.inputs), ("output", self.outputs)):
            for spec in specs.values():
                if not spec.shape or spec.shape[0] != -1:
                    first = spec.shape[0] if spec.shape else "none: a scalar"
                    raise ModelError(
                        f"[batching]: {what} {spec.name!r} has shape {list(spec.shape)}: batching"
                        f" merges requests along a dynamic first dimension, and its first is"
                        f" {first}. Export the model with a dynamic batch axis, or remove"
                        " [batching] from polyserve.toml"
                    )

    def tensor_metadata(self) -> dict[str, object]:
        """The inputs and outputs, as a deploy answer and a version's metadata list them."""
        return {
            "inputs": [s.tensor_metadata() for s in self.inputs.values()],
            "outputs": [s.tensor_metadata() for s in self.outputs.values()],
        }

    def run(self, arrays: dict[str, np.ndarray], wanted: list[str]) -> dict[str, np.ndarray]:
        """The outputs named in `wanted` for one request's inputs."""
        feed = dict(self.pre(arrays)) if self.pre is not None else arrays
        if self.post is None:
            return dict(zip(wanted, self.session.run(wanted, feed), strict=True))
        raw = dict(
            zip(self._session_outputs, self.session.run(self._session_outputs, feed), strict=True)
        )
        given = self.post(raw)
        missing = [name for name in wanted if name not in given]
        if missing:
            raise TypeError(f"post() returned no output {missing[0]!r}")
        return {name: np.asarray(given[name]) for name in wanted}


class InferenceApp:
    """A model served over the Open Inference Protocol, as the app of its space."""

    def __init__(self, model: Model, *, threads: int = 8, batching: Batching | None = None) -> None:
        self.model = model
        self.version: int | None = None  # set by the loader: the version it serves
        self.versions_dir: Path | None = None  # and where its space's versions are kept
        self.threads = threads
        self.batching = batching
        if batching is not None:
            model.check_batchable()
        self.batcher: Batcher | None = None  # made on the loop, at first use
        self._place = Placement(threads)  # on the loop while runs are short
        # What an infer that names no outputs gets: every output, binary or JSON as the
        # request's binary_data_output says; built once, not per request.
        self._every_output = {b: [(out, b) for out in model.outputs] for b in (False, True)}
        self._output_names = list(model.outputs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        found = await self.respond(scope, receive, None, MAX_BODY_MB << 20)
        await send(
            {"type": "http.response.start", "status": found.status, "headers": found.headers}
        )
        await send({"type": "http.response.body", "body": found.body})

    async def respond(
        self, scope: Scope, receive: Receive, route: Route | None, max_body: int
    ) -> Answer:
        """The answer to one request under the space's prefix (or to `route`, which the
        host parsed at its root), reading a body of at most `max_body` bytes. A bad
        request is a 4xx in the protocol's error form."""
        name = route.model if route is not None and route.model else routes.model_name(scope)
        billed = False
        try:
            if route is None:
                path = scope["path"][len(scope.get("root_path", "")) :]
                if path in ("", "/"):
                    return json_answer(200, self.metadata(name))
                route = parse(path, scope["method"], 1)
                if route is None:
                    raise ProtocolError(
                        "a model space answers the inference protocol under /v2", 404
                    )
                if route.model is not None and route.model != name:
                    raise ProtocolError(
                        f"this space's model is named {name!r} under its prefix,"
                        f" not {route.model!r}",
                        404,
                    )
            billed = route.billed
            self._check_version(route, name)
            if route.op == "infer":
                return await self._infer(scope, receive, name, max_body)
            if route.op == "model":
                return json_answer(200, self.metadata(name))
            if route.op == "model_ready":
                return json_answer(200, {"name": name, "ready": True})
            if route.op == "server":
                return json_answer(200, server_metadata())
            if route.op in ("live", "ready"):
                return json_answer(200, {route.op: True})
            raise ProtocolError("the repository routes are the host's: call them at its root", 404)
        except ProtocolError as exc:
            return error_answer(exc, billed)

    def metadata(self, name: str) -> dict[str, object]:
        if self.versions_dir is not None:
            versions = kept_models(self.versions_dir)
        else:
            versions = [self.version] if self.version is not None else []
        return protocol.metadata(
            name, versions, self.model.inputs.values(), self.model.outputs.values()
        )

    def _check_version(self, route: Route, name: str) -> None:
        if self.version is not None:
            check_version(name, route, self.version)

    async def _infer(self, scope: Scope, receive: Receive, name: str, max_body: int) -> Answer:
        body, header_length = await _read(scope, receive, max_body)
        request = protocol.decode(body, header_length, self.model.inputs, self.model.outputs)
        chosen = request.outputs
        if chosen is None:
            chosen, wanted = self._every_output[request.binary], self._output_names
        else:
            wanted = [out for out, _ in chosen]
        try:
            results = await self._run(request.inputs, wanted, receive)
        except Exception as exc:
            # onnxruntime refuses values it cannot compute with as InvalidArgument, and a
            # space's pre() raises ValueError for input it cannot use: the client's to
            # fix. Anything else is the model's, a 500.
            if type(exc).__name__ == "InvalidArgument" or isinstance(exc, ValueError):
                raise ProtocolError(f"the model refused the inputs: {str(exc)[:500]}") from None
            raise
        encoded, json_length = protocol.encode(
            name,
            str(self.version if self.version is not None else 1),
            request.id,
            ((out, results[out], binary) for out, binary in chosen),
        )
        if json_length is None:
            return routes.answer(200, encoded, routes.JSON, True)
        extra = [(b"inference-header-content-length", b"%d" % json_length)]
        return routes.answer(200, encoded, b"application/octet-stream", True, extra)

    async def _run(
        self, arrays: dict[str, np.ndarray], wanted: list[str], receive: Receive
    ) -> dict[str, np.ndarray]:
        """One session.run: on the loop while runs are short, else on the space's threads;
        with batching, one batch's share."""
        if self.batching is not None and arrays.keys() == self.model.inputs.keys():
            return await self._batched(arrays, wanted, receive)
        return await self._place.run(self.model.run, arrays, wanted)

    async def _batched(
        self, arrays: dict[str, np.ndarray], wanted: list[str], receive: Receive
    ) -> dict[str, np.ndarray]:
        """This request's rows of a batch: every output is computed for the whole batch,
        since requests beside it may want others, and this one takes those it asked for."""
        names, outputs = list(self.model.inputs), list(self.model.outputs)
        if self.batcher is None:
            assert self.batching is not None

            def run(merged: list[np.ndarray]) -> list[np.ndarray]:
                results = self.model.run(dict(zip(names, merged, strict=True)), outputs)
                return [results[name] for name in outputs]

            self.batcher = Batcher(run, self.batching, place=self._place)
        try:
            rows = await self.batcher.submit([arrays[name] for name in names], receive)
        except ClientGone as exc:
            raise ProtocolError(str(exc)) from None
        given = dict(zip(outputs, rows, strict=True))
        return {name: given[name] for name in wanted}


async def _read(scope: Scope, receive: Receive, max_body: int) -> tuple[bytes, int | None]:
    """The body, within the cap and decompressed, and Inference-Header-Content-Length."""
    header_length: int | None = None
    encoding = b""
    for key, value in scope["headers"]:
        if key == b"inference-header-content-length":
            if not value.isdigit() or len(value) > 18:
                raise ProtocolError("Inference-Header-Content-Length must be a whole number")
            header_length = int(value)
        elif key == b"content-length" and value.isdigit() and int(value) > max_body:
            raise ProtocolError(_too_large(max_body))
        elif key == b"content-encoding":
            encoding = value.strip().lower()
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ProtocolError("the client went away before its body ended")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_body:
            raise ProtocolError(_too_large(max_body))
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if encoding in (b"", b"identity"):
        return body, header_length
    return _decompressed(body, encoding, max_body), header_length


def _decompressed(body: bytes, encoding: bytes, max_body: int) -> bytes:
    if encoding not in (b"gzip", b"deflate"):
        raise ProtocolError(
            f"Content-Encoding {encoding.decode('latin-1')[:20]!r} is not supported: send"
            " gzip, deflate or none"
        )
    wbits = 16 + zlib.MAX_WBITS if encoding == b"gzip" else zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        # Bounded, so a small compressed body cannot inflate past the cap.
        out = inflater.decompress(body, max_body + 1)
    except zlib.error as exc:
        raise ProtocolError(f"the body is not valid {encoding.decode()}: {exc}") from None
    if len(out) > max_body:
        raise ProtocolError(_too_large(max_body))
    return out


def _too_large(max_body: int) -> str:
    return f"an infer body is at most {max_body >> 20} MiB"


def inference_app(
    session: Any,
    *,
    pre: Callable[[dict[str, np.ndarray]], Mapping[str, Any]] | None = None,
    post: Callable[[dict[str, np.ndarray]], Mapping[str, Any]] | None = None,
    inputs: Sequence[TensorSpec] | None = None,
    outputs: Sequence[TensorSpec] | None = None,
) -> InferenceApp:
    """A space's `app` that serves `session` over the Open Inference Protocol.

    `pre` maps the request's arrays (by input name) to the session's inputs, and `post`
    maps the session's outputs to the answer's; with either, `inputs` or `outputs` say
    what the protocol offers instead of the session's own (`Tensor(name, datatype,
    shape)`, -1 for a dynamic dimension)."""
    return InferenceApp(Model(session, pre=pre, post=post, inputs=inputs, outputs=outputs))
