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

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson

# The protocol's datatypes and the numpy dtype each decodes to (BYTES: an object array
# of str, which is what onnxruntime's string tensors take). Every other dtype is
# little-endian, as the extension requires.
DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}
_BY_KIND = {dtype: name for name, dtype in DTYPES.items() if name != "BYTES"}
_INTEGER = frozenset(name for name in DTYPES if "INT" in name)
_FLOAT = frozenset(("FP16", "FP32", "FP64"))
_LENGTH = struct.Struct("<I")
_ECHO = 80  # characters of a client's own text quoted back in an error
_ORJSON = orjson.OPT_SERIALIZE_NUMPY


class ProtocolError(Exception):
    """A request the protocol refuses: its status (400, or 404 for an unknown model or
    version) and the message the `{"error": ...}` body carries."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def body(self) -> bytes:
        return orjson.dumps({"error": str(self)})


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as the model declares it; -1 marks a dynamic dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


class Requested(NamedTuple):
    """What an infer request asks for: its id, its inputs as arrays, and the outputs to
    return (None: all of them) with whether each goes back as binary data."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]] | None
    binary: bool  # the request's binary_data_output: the default for unnamed outputs


def datatype_of(dtype: np.dtype[Any]) -> str:
    """The protocol's name for a numpy dtype (str and bytes arrays are BYTES)."""
    if dtype.kind in "OSU":
        return "BYTES"
    name = _BY_KIND.get(dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype)
    if name is None:
        raise ProtocolError(f"the model returned {dtype}, which the protocol cannot carry")
    return name


def decode(
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    inputs: Mapping[str, TensorSpec],
    outputs: Mapping[str, TensorSpec],
) -> Requested:
    """Parse an infer request's body against the model's inputs and outputs."""
    view = memoryview(body)
    if header_length is None:
        header, binary = view, view[len(view) :]
    else:
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
        size = _binary_size(tensor.get("parameters"), spec.name)
        if size is None:
            if "data" not in tensor:
                raise ProtocolError(
                    f"input {spec.name!r} has neither `data` nor `parameters.binary_data_size`"
                )
            arrays[spec.name] = _from_json(tensor["data"], spec, shape)
        else:
            if offset + size > len(binary):
                raise ProtocolError(
                    f"input {spec.name!r} declares {size} bytes of binary data, but only"
                    f" {len(binary) - offset} follow the JSON"
                    + ("" if header_length else " (send Inference-Header-Content-Length)")
                )
            arrays[spec.name] = _from_binary(binary[offset : offset + size], spec, shape)
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
    described: list[dict[str, object]] = []
    chunks: list[bytes] = []
    for name, array, binary in results:
        datatype = datatype_of(array.dtype)
        out: dict[str, object] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            raw = _to_binary(array, datatype)
            out["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif datatype == "BYTES":
            out["data"] = [_text(item) for item in array.ravel().tolist()]
        else:
            # orjson writes a C-contiguous array's numbers straight from its buffer.
            out["data"] = np.ascontiguousarray(array).ravel()
        described.append(out)
    answer: dict[str, object] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        answer["id"] = request_id
    answer["outputs"] = described
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
        "inputs": [spec.describe() for spec in inputs],
        "outputs": [spec.describe() for spec in outputs],
    }


def specs(described: object) -> dict[str, TensorSpec]:
    """TensorSpecs back from a version's stored `inputs` or `outputs` list."""
    found: dict[str, TensorSpec] = {}
    for item in described if isinstance(described, list) else ():
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
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        raise ProtocolError(f"the parameters of input {name!r} must be a JSON object")
    size = parameters.get("binary_data_size")
    if size is None:
        return None
    if type(size) is not int or size < 0:
        raise ProtocolError(f"binary_data_size of input {name!r} must be a whole number")
    return size


def _from_json(data: object, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
    count = math.prod(shape)
    if not isinstance(data, list):
        raise ProtocolError(f"the data of input {spec.name!r} must be a list")
    try:
        # No dtype: the values' own kinds are checked before anything is converted.
        found = np.asarray(data)
    except ValueError:
        raise ProtocolError(
            f"the data of input {spec.name!r} is ragged: nest it as its shape {list(shape)}"
            " or give it flat, in row-major order"
        ) from None
    array = _converted(found, spec)
    if array.size != count:
        raise ProtocolError(
            f"input {spec.name!r} of shape {list(shape)} needs {count} elements,"
            f" its data holds {array.size}"
        )
    if array.ndim != 1 and array.shape != shape:
        raise ProtocolError(
            f"the data of input {spec.name!r} is nested as {list(array.shape)}, its shape"
            f" is {list(shape)}: nest it as its shape, or give it flat"
        )
    return array.reshape(shape)


def _converted(found: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """JSON numbers as the input's dtype, refusing what would change their value."""
    datatype, dtype = spec.datatype, DTYPES[spec.datatype]
    kind = found.dtype.kind
    if found.size == 0:
        return found.astype(dtype)
    if datatype == "BYTES":
        if kind != "U":
            raise ProtocolError(f"input {spec.name!r} is BYTES: its data must be strings")
        return found.astype(object)  # onnxruntime's string tensors take str objects
    if datatype == "BOOL":
        if kind != "b":
            raise ProtocolError(f"input {spec.name!r} is BOOL: its data must be true or false")
        return found
    if kind not in "iu" and not (kind == "f" and datatype in _FLOAT):
        wanted = "whole numbers" if datatype in _INTEGER else "numbers"
        raise ProtocolError(f"input {spec.name!r} is {datatype}: its data must be {wanted}")
    if datatype in _INTEGER:
        info = np.iinfo(dtype)
        if found.min() < info.min or found.max() > info.max:
            raise ProtocolError(
                f"input {spec.name!r} is {datatype}: its values must lie in {info.min}..{info.max}"
            )
    return found.astype(dtype, copy=False)


def _from_binary(raw: memoryview, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
    count = math.prod(shape)
    if spec.datatype == "BYTES":
        return _bytes_elements(raw, spec.name, count).reshape(shape)
    dtype = DTYPES[spec.datatype]
    if len(raw) != count * dtype.itemsize:
        raise ProtocolError(
            f"input {spec.name!r} of shape {list(shape)} and datatype {spec.datatype} is"
            f" {count * dtype.itemsize} bytes, binary_data_size says {len(raw)}"
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if spec.datatype == "BOOL" and array.view(np.uint8).max(initial=0) > 1:
        raise ProtocolError(f"input {spec.name!r} is BOOL: each byte must be 0 or 1")
    return array


def _bytes_elements(raw: memoryview, name: str, count: int) -> np.ndarray:
    array = np.empty(count, dtype=object)
    at = 0
    for i in range(count):
        if at + 4 > len(raw):
            raise ProtocolError(
                f"input {name!r}: its binary data ends before element {i} of {count}"
                " (each BYTES element is a 4-byte little-endian length, then the bytes)"
            )
        (length,) = _LENGTH.unpack_from(raw, at)
        at += 4
        if at + length > len(raw):
            raise ProtocolError(f"input {name!r}: element {i} runs past its binary data")
        try:
            # onnxruntime's string tensors hold text: str objects, not bytes.
            array[i] = str(raw[at : at + length], "utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(
                f"input {name!r}: element {i} is not UTF-8 text, which a string tensor holds"
            ) from None
        at += length
    if at != len(raw):
        raise ProtocolError(
            f"input {name!r}: {len(raw) - at} bytes follow its {count} BYTES elements"
        )
    return array


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


def _to_binary(array: np.ndarray, datatype: str) -> bytes:
    if datatype != "BYTES":
        if array.dtype.byteorder == ">":  # the extension's bytes are little-endian
            array = array.astype(array.dtype.newbyteorder("<"))
        return array.tobytes()  # row-major, whatever the array's strides
    parts: list[bytes] = []
    for item in array.ravel().tolist():
        raw = item if isinstance(item, bytes) else str(item).encode()
        parts += (_LENGTH.pack(len(raw)), raw)
    return b"".join(parts)


def _text(item: object) -> str:
    """A BYTES element in JSON: its text (bytes as UTF-8, what is not valid replaced)."""
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)


def _names(specs: Mapping[str, TensorSpec]) -> str:
    return ", ".join(repr(name) for name in specs)


def _quote(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _ECHO else text[:_ECHO] + "…"
