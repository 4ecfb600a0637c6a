"""One copy per host: an onnxruntime session whose weights stay file-backed pages of the model.

`onnx_session(path)` loads an ONNX model so that every worker serving the space shares
one copy of its weights through the page cache, instead of each holding its own:

1. `skeleton(path)` rewrites the model's protobuf without its large tensors: each graph
   initializer of `min_bytes` or more stored as `raw_data` becomes ONNX external data
   (`data_location = EXTERNAL`, with `location`, `offset`, `length`) pointing at its own
   bytes *inside the original file*, where `raw_data` is one contiguous run. Nothing is
   converted or written: the version directory stays as it was deployed, and no second
   copy exists on disk. The protobuf is walked by hand (a few tags), so neither the `onnx`
   package nor a parse of the whole model is needed.
2. onnxruntime loads the skeleton from bytes with the model's directory as its external
   data folder, and memory-maps each tensor from the file (MAP_PRIVATE, read-only in
   practice: file-backed pages every process shares).
3. Prepacking is off (`session.disable_prepacking`): it is what copies weights into
   anonymous memory, per process. Graph optimization stops at ORT_ENABLE_EXTENDED: the
   layout transformations above it rewrite weights into new buffers.

The price is speed on larger batches (no prepacked weights): see docs/models.md for the
figures. A model with no large initializer (a 4 KB one) is loaded exactly as
`onnxruntime.InferenceSession(path)` would: there is nothing to share. A file this
module cannot walk is handed to onnxruntime as a path, which loads it (one copy per
worker) or says what is wrong with it.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from polyserve import devices
from polyserve.models import prepacked
from polyserve.serve import gpu
from polyserve.serve.batching import batched
from polyserve.serve.modelspace import InferenceApp, inference_app
from polyserve.serve.tensors import TensorSpec as Tensor

log = logging.getLogger("polyserve.models")

__all__ = ["InferenceApp", "Tensor", "batched", "inference_app", "onnx_session", "skeleton"]

MIN_BYTES = 4096  # smaller tensors stay inline: a page or less, not worth a mapping

# Field numbers of onnx.proto3 (stable since ONNX 1.0; the file is the format's spec).
_MODEL_GRAPH = 7  # ModelProto.graph
_GRAPH_INITIALIZER = 5  # GraphProto.initializer
_TENSOR_RAW_DATA = 9  # TensorProto.raw_data
_TENSOR_EXTERNAL_DATA = 13  # TensorProto.external_data (StringStringEntryProto)
_TENSOR_DATA_LOCATION = 14  # TensorProto.data_location: 1 = EXTERNAL
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def onnx_session(
    path: str | os.PathLike[str],
    options: Any = None,
    providers: Sequence[Any] | None = None,
    *,
    prepack: bool = False,
    min_bytes: int = MIN_BYTES,
    gpu_memory_mb: int | None = None,
) -> Any:
    """An `onnxruntime.InferenceSession` for the model at `path` whose large weights are
    shared by every process on the host (see the module docstring).

    `options` is an `onnxruntime.SessionOptions` (default: one intra-op and one inter-op
    thread, as a space should have); its optimization level is capped at
    ORT_ENABLE_EXTENDED, and the settings sharing needs are added to it (it is changed
    in place). `prepack=True` gives back prepacked weights, faster on batches
    of several rows, at one private copy of them per process.

    `providers` defaults to the worker's: on a GPU worker the CUDA provider, with the
    options of polyserve.serve.gpu and `gpu_memory_mb` as its limit (default: the
    host's POLYSERVE_GPU_SPACE_MEMORY_MB), and one warm-up run; elsewhere the CPU. A
    session that asked for CUDA and did not get it raises gpu.DeviceRefused, naming
    the providers onnxruntime gave: it never runs on the CPU instead (docs/gpu.md)."""
    import onnxruntime as ort

    if providers is None:
        if devices.assigned() is None:
            providers = ("CPUExecutionProvider",)
        else:
            limit = gpu.space_memory_mb(None) if gpu_memory_mb is None else gpu_memory_mb
            providers = gpu.providers(limit)
    if gpu.asks_cuda(providers):
        return _on_device(ort, Path(path).resolve(), options, providers)

    def defaults() -> Any:
        fresh = ort.SessionOptions()
        # The default starts a thread pool per session: hundreds of threads for
        # hundreds of spaces, and a worker serves one request at a time per space.
        fresh.intra_op_num_threads = 1
        fresh.inter_op_num_threads = 1
        return fresh

    path = Path(path).resolve()
    given = options is not None
    if options is None:
        options = defaults()
    try:
        rewritten, large = skeleton(path, min_bytes)
    except (ValueError, OSError) as exc:
        # Not a protobuf we can walk: onnxruntime says what is wrong, or loads it as is.
        log.warning("%s: loading the model unshared (%s)", path.name, exc)
        return ort.InferenceSession(str(path), options, providers=list(providers))
    if large == 0:  # nothing worth sharing: exactly the session a plain load gives
        return ort.InferenceSession(str(path), options, providers=list(providers))
    extended = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    if int(options.graph_optimization_level) > int(extended):
        options.graph_optimization_level = extended
    if not prepack:
        # Prepacked weights in a file the validation built, mapped: batches at full speed.
        found = prepacked.session(path, options, providers, min_bytes)
        if found is not None:
            return found
        options.add_session_config_entry("session.disable_prepacking", "1")
    if rewritten is None:  # every large tensor is external data already: mapped as it is
        return ort.InferenceSession(str(path), options, providers=list(providers))
    # Loaded from bytes, the session has no model path: external data is found here.
    options.add_session_config_entry(
        "session.model_external_initializers_file_folder_path", str(path.parent)
    )
    try:
        return ort.InferenceSession(rewritten, options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own classes, not exported alike
        # An onnxruntime without that setting (an older release) cannot place the
        # external data: the model loads from its path, unshared, or raises its own error.
        log.warning("%s: loading the model unshared (%s)", path.name, exc)
        # Unshared, it may as well prepack: fresh options, unless the caller gave some.
        return ort.InferenceSession(
            str(path), options if given else defaults(), providers=list(providers)
        )


def _on_device(ort: Any, path: Path, options: Any, providers: Sequence[Any]) -> Any:
    """A session on the CUDA provider, refused (gpu.DeviceRefused) unless onnxruntime
    gave it that provider, and run once. Loaded from its path: its weights are copied to
    the device, so mapping them from the file would share nothing."""
    gpu.refuse_unavailable(ort)  # the CPU build: it would warn, then run on the CPU
    if options is None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # for the CPU's share of the nodes: see above
        options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=list(providers))
    gpu.check(session)
    gpu.warm_up(session)
    return session


def skeleton(path: str | os.PathLike[str], min_bytes: int = MIN_BYTES) -> tuple[bytes | None, int]:
    """The model at `path` with every top-level graph initializer of `min_bytes` or more
    held in `raw_data` turned into external data at its own offset in that file, and
    the bytes of large tensors the model then keeps out of line (these, and any already
    external). The skeleton is None when nothing needed rewriting. Raises ValueError for
    a file that is not an ONNX protobuf this walk understands."""
    path = Path(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError("the model file is empty")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mapped)
    try:
        # The walk reads tags and lengths only: the tensors' pages are never touched.
        walk = _Walk(view, path.name, min_bytes)
        rewritten = walk.model()
    except IndexError:
        raise ValueError("the file ends inside a field: not an ONNX protobuf") from None
    finally:
        view.release()  # before close(), which refuses while a view is exported
        mapped.close()
    return (rewritten if walk.moved else None), walk.large


class _Walk:
    """One pass over a model's bytes: copies what it keeps, re-encodes what it rewrites."""

    def __init__(self, buf: memoryview, location: str, min_bytes: int) -> None:
        self.buf = buf
        self.location = location.encode()
        self.min_bytes = min_bytes
        self.moved = 0  # tensors rewritten to point into the file
        self.large = 0  # bytes of large tensors kept out of line

    def model(self) -> bytes:
        out = []
        for number, wire, tag, start, end in _fields(self.buf, 0, len(self.buf)):
            if number == _MODEL_GRAPH and wire == _LEN:
                out.append(_length_delimited(number, self._graph(start, end)))
            else:
                out.append(bytes(self.buf[tag:end]))
        return b"".join(out)

    def _graph(self, start: int, end: int) -> bytes:
        out = []
        for number, wire, tag, value, stop in _fields(self.buf, start, end):
            if number == _GRAPH_INITIALIZER and wire == _LEN:
                tensor = self._tensor(value, stop)
                if tensor is not None:
                    out.append(_length_delimited(number, tensor))
                    continue
            out.append(bytes(self.buf[tag:stop]))
        return b"".join(out)

    def _tensor(self, start: int, end: int) -> bytes | None:
        """The tensor pointing at its raw_data in the file, or None to keep it as is."""
        kept, raw = [], None
        for number, wire, tag, value, stop in _fields(self.buf, start, end):
            if number == _TENSOR_DATA_LOCATION and wire == _VARINT:
                if _varint(self.buf, value)[0] == 1:  # external already
                    self.large += self._external_length(start, end)
                    return None
            elif number == _TENSOR_RAW_DATA and wire == _LEN:
                raw = (value, stop)
                continue
            kept.append(bytes(self.buf[tag:stop]))
        if raw is None or raw[1] - raw[0] < self.min_bytes:
            return None  # typed fields (float_data, …) or small: stays inline
        offset, length = raw[0], raw[1] - raw[0]
        self.moved += 1
        self.large += length
        kept.append(_tag(_TENSOR_DATA_LOCATION, _VARINT) + _encode_varint(1))
        where = (
            (b"location", self.location),
            (b"offset", b"%d" % offset),
            (b"length", b"%d" % length),
        )
        kept += (_entry(key, value) for key, value in where)
        return b"".join(kept)

    def _external_length(self, start: int, end: int) -> int:
        """The `length` an already external tensor declares (0 when it has none)."""
        for number, wire, _, value, stop in _fields(self.buf, start, end):
            if number != _TENSOR_EXTERNAL_DATA or wire != _LEN:
                continue
            entry = {n: bytes(self.buf[v:s]) for n, w, _, v, s in _fields(self.buf, value, stop)}
            if entry.get(1) == b"length":
                return int(entry.get(2, b"0"))
        return 0


# -- the protobuf wire format: varints, tags, length-delimited fields -------------------


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    """The varint at buf[i] and the index after it."""
    result = shift = 0
    while True:
        byte = buf[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes: not an ONNX protobuf")


def _fields(buf: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Each field of the message in buf[start:end]: (number, wire type, where its tag
    starts, where its value starts, where it ends). A length-delimited value is its
    payload, without the length."""
    i = start
    while i < end:
        tag = i
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value = i
            _, i = _varint(buf, i)
        elif wire == _LEN:
            length, value = _varint(buf, i)
            i = value + length
        elif wire in (_I64, _I32):
            value = i
            i += 8 if wire == _I64 else 4
        else:  # groups (3, 4) are not used by ONNX; anything else is not a protobuf
            raise ValueError(f"wire type {wire} at byte {tag}: not an ONNX protobuf")
        if number == 0 or i > end:
            raise ValueError(f"a field at byte {tag} runs past its message: not an ONNX protobuf")
        yield number, wire, tag, value, i


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(number: int, wire: int) -> bytes:
    return _encode_varint(number << 3 | wire)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _tag(number, _LEN) + _encode_varint(len(payload)) + payload


def _entry(key: bytes, value: bytes) -> bytes:
    """One TensorProto.external_data entry (StringStringEntryProto: key = 1, value = 2)."""
    return _length_delimited(
        _TENSOR_EXTERNAL_DATA, _length_delimited(1, key) + _length_delimited(2, value)
    )
