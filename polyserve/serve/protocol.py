"""The Open Inference Protocol's REST codec: request bodies to numpy arrays, arrays to answers.

This follows the KServe v2 protocol and Triton's binary tensor data extension, which is
what `tritonclient` sends and asks for by default. An infer body is one JSON object,
optionally followed by raw tensor bytes when the `Inference-Header-Content-Length` header
says where the JSON ends. Each input then names its datatype and shape, and carries
either `data` (nested or flat, row-major) or `parameters.binary_data_size` (its bytes,
little-endian and row-major, taken in the order the inputs are listed). BYTES elements
travel as a 4-byte little-endian length and the bytes.

Everything a request can get wrong is a `ProtocolError` naming what to fix, raised before
any array reaches the model. Nothing here knows HTTP or onnxruntime: `polyserve.serve.modelspace`
builds the specs from a session and sends the answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import orjson

from polyserve.serve.tensors import (
    ProtocolError,
    TensorSpec,
    as_text,
    datatype_of,
    from_binary,
    from_json,
    to_binary,
)

_ECHO = 80  # characters of a client's own text quoted back in an error
_ORJSON = orjson.OPT_SERIALIZE_NUMPY
_NO_BYTES = memoryview(b"")


class Requested(NamedTuple):
    """What an infer request asks for: its id, its inputs as arrays, and the outputs to
    return (None: all of them) with whether each goes back as binary data."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]] | None
    binary: bool  # the request's binary_data_output: the default for unnamed outputs


def decode(
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    inputs: Mapping[str, TensorSpec],
    outputs: Mapping[str, TensorSpec],
) -> Requested:
    """Parse an infer request's body against the model's inputs and outputs."""
    if header_length is None:  # all JSON: orjson reads bytes faster than a view of them
        header: bytes | bytearray | memoryview = body
        binary = _NO_BYTES
    else:
        view = memoryview(body)
        if header_length > len(view):
            raise ProtocolError(
                f"Inference-Header-Content-Length is {header_length}, but the body holds"
                f" only {len(view)} bytes"
            )
        header, binary = view[:header_length], view[header_length:]
    try:
        request = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        where = "the first Inference-Header-Content-Length bytes" if header_length else "the body"
        raise ProtocolError(f"{where} must be one JSON object: {exc}") from None
    if not isinstance(request, dict):
        raise ProtocolError("the request must be a JSON object with an `inputs` list")
    given = request.get("inputs")
    if not isinstance(given, list) or not given:
        raise ProtocolError("the request needs `inputs`: a list of tensors")
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for tensor in given:
        if not isinstance(tensor, dict):
            raise ProtocolError("each input must be a JSON object with name, shape, datatype")
        spec = _input_spec(tensor, inputs)
        if spec.name in arrays:
            raise ProtocolError(f"input {spec.name!r} is given twice")
        shape = _shape(tensor, spec)
        parameters = tensor.get("parameters")
        size = None if parameters is None else _binary_size(parameters, spec.name)
        if size is None:
            if "data" not in tensor:
                raise ProtocolError(
                    f"input {spec.name!r} has neither `data` nor `parameters.binary_data_size`"
                )
            arrays[spec.name] = from_json(tensor["data"], spec, shape)
        else:
            if offset + size > len(binary):
                raise ProtocolError(
                    f"input {spec.name!r} declares {size} bytes of binary data, but only"
                    f" {len(binary) - offset} follow the JSON"
                    + ("" if header_length else " (send Inference-Header-Content-Length)")
                )
            arrays[spec.name] = from_binary(binary[offset : offset + size], spec, shape)
            offset += size
    if offset != len(binary):
        raise ProtocolError(
            f"{len(binary) - offset} bytes follow the last input's binary data: the"
            " binary_data_size of the inputs and Inference-Header-Content-Length disagree"
        )
    if len(arrays) != len(inputs):  # every name given is one of the model's
        missing = next(name for name in inputs if name not in arrays)
        raise ProtocolError(f"missing input {missing!r}: the model takes {_names(inputs)}")
    parameters = request.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ProtocolError("`parameters` must be a JSON object")
    binary_output = parameters.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise ProtocolError("parameters.binary_data_output must be true or false")
    return Requested(
        _request_id(request.get("id")),
        arrays,
        _requested_outputs(request.get("outputs"), outputs, binary_output),
        binary_output,
    )


def encode(
    model_name: str,
    model_version: str,
    request_id: str | None,
    results: Iterable[tuple[str, np.ndarray, bool]],
) -> tuple[bytes, int | None]:
    """An infer answer: (the body, the JSON header's length when binary data follows it).
    Each result is (output name, array, send as binary)."""
    outputs: list[dict[str, object]] = []
    chunks: list[bytes] = []
    for name, array, binary in results:
        datatype = datatype_of(array.dtype)
        out: dict[str, object] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            raw = to_binary(array, datatype)
            out["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif datatype == "BYTES":
            out["data"] = [as_text(item) for item in array.ravel().tolist()]
        else:
            # orjson writes a C-contiguous array's numbers straight from its buffer, and
            # ravel() is one: a view of a contiguous array, else a contiguous copy.
            out["data"] = array.ravel()
        outputs.append(out)
    answer: dict[str, object] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        answer["id"] = request_id
    answer["outputs"] = outputs
    header = orjson.dumps(answer, option=_ORJSON)
    if not chunks:
        return header, None
    return b"".join((header, *chunks)), len(header)


def metadata(
    name: str, versions: Sequence[int], inputs: Iterable[TensorSpec], outputs: Iterable[TensorSpec]
) -> dict[str, object]:
    """The model metadata answer (`GET /v2/models/{name}`)."""
    return {
        "name": name,
        "versions": [str(v) for v in versions],
        "platform": "onnx_onnxv1",
        "inputs": [spec.tensor_metadata() for spec in inputs],
        "outputs": [spec.tensor_metadata() for spec in outputs],
    }


def specs(listed: object) -> dict[str, TensorSpec]:
    """TensorSpecs back from a version's stored `inputs` or `outputs` list."""
    found: dict[str, TensorSpec] = {}
    for item in listed if isinstance(listed, list) else ():
        spec = TensorSpec(str(item["name"]), str(item["datatype"]), tuple(item["shape"]))
        found[spec.name] = spec
    return found


# -- the parts of a request ---------------------------------------------------------------


def _input_spec(tensor: dict[str, Any], inputs: Mapping[str, TensorSpec]) -> TensorSpec:
    name = tensor.get("name")
    if not isinstance(name, str):
        raise ProtocolError("each input needs a `name` (a string)")
    spec = inputs.get(name)
    if spec is None:
        raise ProtocolError(f"unknown input {_quote(name)}: the model takes {_names(inputs)}")
    datatype = tensor.get("datatype")
    if datatype != spec.datatype:
        raise ProtocolError(f"input {name!r} has datatype {spec.datatype}, got {_quote(datatype)}")
    return spec


def _shape(tensor: dict[str, Any], spec: TensorSpec) -> tuple[int, ...]:
    shape: Any = tensor.get("shape")
    expected = spec.shape
    if not isinstance(shape, list) or len(shape) != len(expected):
        fits = False
    else:
        fits = True
        for d, e in zip(shape, expected, strict=True):
            # bool is an int to Python, never a dimension here
            if type(d) is not int or d < 0:
                raise ProtocolError(
                    f"input {spec.name!r} needs `shape`: a list of whole numbers of at least 0"
                )
            if e != -1 and d != e:
                fits = False
    if not fits:
        raise ProtocolError(
            f"input {spec.name!r} has shape {list(expected)} (-1: any size), got {shape!r:.200}"
        )
    return tuple(shape)


def _binary_size(parameters: object, name: str) -> int | None:
    if not isinstance(parameters, dict):
        raise ProtocolError(f"the parameters of input {name!r} must be a JSON object")
    size = parameters.get("binary_data_size")
    if size is None:
        return None
    if type(size) is not int or size < 0:
        raise ProtocolError(f"binary_data_size of input {name!r} must be a whole number")
    return size


def _requested_outputs(
    asked: object, outputs: Mapping[str, TensorSpec], binary_default: bool
) -> list[tuple[str, bool]] | None:
    if asked is None:
        return None
    if not isinstance(asked, list):
        raise ProtocolError('`outputs` must be a list of {"name": ...} objects')
    chosen: list[tuple[str, bool]] = []
    for item in asked:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str):
            raise ProtocolError("each requested output needs a `name` (a string)")
        if name not in outputs:
            raise ProtocolError(f"unknown output {_quote(name)}: the model gives {_names(outputs)}")
        parameters = item.get("parameters") or {}
        binary = (
            parameters.get("binary_data", binary_default) if isinstance(parameters, dict) else None
        )
        if not isinstance(binary, bool):
            raise ProtocolError(f"parameters.binary_data of output {name!r} must be true or false")
        chosen.append((name, binary))
    return chosen


def _request_id(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProtocolError("`id` must be a string")
    return value


# -- the parts of an answer ---------------------------------------------------------------


def _names(specs: Mapping[str, TensorSpec]) -> str:
    return ", ".join(repr(name) for name in specs)


def _quote(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _ECHO else text[:_ECHO] + "…"
