"""The protocol's tensors: datatypes, their numpy dtypes, and elements from JSON or bytes.

Every datatype but BYTES is a little-endian numpy dtype, as the binary tensor data
extension requires; BYTES is an object array of str, which onnxruntime's string tensors
take, and travels as 4-byte little-endian lengths and the bytes. Each conversion checks
what a client sent against the input's spec and raises ProtocolError naming what to fix.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

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

    def tensor_metadata(self) -> dict[str, object]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def datatype_of(dtype: np.dtype[Any]) -> str:
    """The protocol's name for a numpy dtype (str and bytes arrays are BYTES)."""
    if dtype.kind in "OSU":
        return "BYTES"
    name = _BY_KIND.get(dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype)
    if name is None:
        raise ProtocolError(f"the model returned {dtype}, which the protocol cannot carry")
    return name


def from_json(data: object, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
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


def from_binary(raw: memoryview, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
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


def to_binary(array: np.ndarray, datatype: str) -> bytes:
    if datatype != "BYTES":
        if array.dtype.byteorder == ">":  # the extension's bytes are little-endian
            array = array.astype(array.dtype.newbyteorder("<"))
        return array.tobytes()  # row-major, whatever the array's strides
    parts: list[bytes] = []
    for item in array.ravel().tolist():
        raw = item if isinstance(item, bytes) else str(item).encode()
        parts += (_LENGTH.pack(len(raw)), raw)
    return b"".join(parts)


def as_text(item: object) -> str:
    """A BYTES element in JSON: its text (bytes as UTF-8, what is not valid replaced)."""
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
