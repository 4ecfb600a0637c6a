"""polyserve.serve.protocol: the Open Inference Protocol's codec, bodies to arrays and back."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest

from polyserve.serve.protocol import decode, encode
from polyserve.serve.routes import parse
from polyserve.serve.tensors import DTYPES, ProtocolError, TensorSpec

X = TensorSpec("X", "FP32", (-1, 4))
INPUTS = {"X": X}
OUTPUTS = {"Y": TensorSpec("Y", "FP32", (-1, 4)), "Z": TensorSpec("Z", "INT64", (-1,))}


def body(*inputs: dict, **extra: object) -> bytes:
    return orjson.dumps({"inputs": list(inputs), **extra})


def x_json(data: object, shape: list[int] | None = None, datatype: str = "FP32") -> dict:
    return {"name": "X", "shape": shape or [1, 4], "datatype": datatype, "data": data}


def test_flat_and_nested_json_data_decode_to_the_same_array():
    flat = decode(body(x_json([1, 2, 3, 4.5])), None, INPUTS, OUTPUTS)
    nested = decode(body(x_json([[1, 2, 3, 4.5]])), None, INPUTS, OUTPUTS)
    for found in (flat, nested):
        array = found.inputs["X"]
        assert array.dtype == np.float32 and array.shape == (1, 4)
        assert array.tolist() == [[1, 2, 3, 4.5]]
    assert flat.outputs is None and flat.binary is False and flat.id is None


def test_binary_inputs_are_read_in_order_after_the_json_header():
    spec = {"A": TensorSpec("A", "INT32", (2,)), "B": TensorSpec("B", "FP64", (-1,))}
    header = body(
        {"name": "B", "shape": [3], "datatype": "FP64", "parameters": {"binary_data_size": 24}},
        {"name": "A", "shape": [2], "datatype": "INT32", "parameters": {"binary_data_size": 8}},
    )
    raw = np.array([1.5, 2.5, 3.5]).tobytes() + np.array([7, -8], dtype="<i4").tobytes()
    found = decode(header + raw, len(header), spec, OUTPUTS)
    assert found.inputs["B"].tolist() == [1.5, 2.5, 3.5]
    assert found.inputs["A"].tolist() == [7, -8]


def test_bytes_elements_are_length_prefixed_text():
    spec = {"S": TensorSpec("S", "BYTES", (-1,))}
    raw = b"".join(struct.pack("<I", len(t)) + t for t in (b"", "é".encode(), b"abc"))
    header = body(
        {
            "name": "S",
            "shape": [3],
            "datatype": "BYTES",
            "parameters": {"binary_data_size": len(raw)},
        }
    )
    found = decode(header + raw, len(header), spec, OUTPUTS)
    assert found.inputs["S"].tolist() == ["", "é", "abc"]
    assert found.inputs["S"].dtype == object
    as_json = decode(
        body({"name": "S", "shape": [2], "datatype": "BYTES", "data": ["x", "y"]}),
        None,
        spec,
        OUTPUTS,
    )
    assert as_json.inputs["S"].tolist() == ["x", "y"]


@pytest.mark.parametrize(
    ("request_body", "header_length", "says"),
    [
        (b"not json", None, "must be one JSON object"),
        (b"[]", None, "JSON object"),
        (body(), None, "needs `inputs`"),
        (
            body({"name": "W", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}),
            None,
            "unknown input 'W'",
        ),
        (body(x_json([1, 2, 3, 4], datatype="FP64")), None, "has datatype FP32, got 'FP64'"),
        (body(x_json([1, 2, 3], shape=[1, 3])), None, "has shape [-1, 4]"),
        (body(x_json([1, 2, 3], shape=[1, 4])), None, "needs 4 elements, its data holds 3"),
        (body(x_json([[1, 2], [3, 4]], shape=[1, 4])), None, "nested as [2, 2]"),
        (body(x_json([[1, 2, 3, 4], [5]], shape=[2, 4])), None, "ragged"),
        (body(x_json(["a", "b", "c", "d"])), None, "must be numbers"),
        (body(x_json([True, False, True, False])), None, "must be numbers"),
        (body(x_json([1, 2, 3, 4]), x_json([1, 2, 3, 4])), None, "given twice"),
        (body({"name": "X", "shape": [1, 4], "datatype": "FP32"}), None, "neither `data`"),
        (body(x_json([1, 2, 3, 4], shape=[1, True])), None, "whole numbers"),
        (body(x_json([1, 2, 3, 4]), outputs=[{"name": "Q"}]), None, "unknown output 'Q'"),
        (body(x_json([1, 2, 3, 4]), parameters={"binary_data_output": 1}), None, "true or false"),
        (body(x_json([1, 2, 3, 4]), id=7), None, "`id` must be a string"),
        (body(x_json([1, 2, 3, 4])), 10_000, "holds only"),
    ],
)
def test_each_mistake_is_a_protocol_error_that_says_what_to_fix(request_body, header_length, says):
    with pytest.raises(ProtocolError) as refused:
        decode(request_body, header_length, INPUTS, OUTPUTS)
    assert says in str(refused.value)
    assert refused.value.status == 400
    assert orjson.loads(refused.value.body()) == {"error": str(refused.value)}


def test_a_missing_input_is_named():
    spec = {**INPUTS, "M": TensorSpec("M", "INT64", (1,))}
    with pytest.raises(ProtocolError, match="missing input 'M'"):
        decode(body(x_json([1, 2, 3, 4])), None, spec, OUTPUTS)


def test_binary_sizes_that_disagree_with_the_body_are_refused():
    header = body(
        {"name": "X", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}
    )
    raw = np.zeros(4, np.float32).tobytes()
    with pytest.raises(ProtocolError, match="only 12 follow"):
        decode(header + raw[:12], len(header), INPUTS, OUTPUTS)
    with pytest.raises(ProtocolError, match="4 bytes follow the last input"):
        decode(header + raw + b"\0" * 4, len(header), INPUTS, OUTPUTS)
    short = body(
        {"name": "X", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 12}}
    )
    with pytest.raises(ProtocolError, match="is 16 bytes, binary_data_size says 12"):
        decode(short + raw[:12], len(short), INPUTS, OUTPUTS)


def test_integers_out_of_range_and_fractions_are_refused_not_wrapped():
    spec = {"I": TensorSpec("I", "INT8", (-1,))}
    with pytest.raises(ProtocolError, match=r"-128\.\.127"):
        decode(
            body({"name": "I", "shape": [2], "datatype": "INT8", "data": [1, 300]}),
            None,
            spec,
            OUTPUTS,
        )
    with pytest.raises(ProtocolError, match="whole numbers"):
        decode(
            body({"name": "I", "shape": [1], "datatype": "INT8", "data": [1.5]}),
            None,
            spec,
            OUTPUTS,
        )


def test_a_bool_byte_other_than_0_or_1_is_refused():
    spec = {"B": TensorSpec("B", "BOOL", (-1,))}
    header = body(
        {"name": "B", "shape": [2], "datatype": "BOOL", "parameters": {"binary_data_size": 2}}
    )
    assert decode(header + b"\x01\x00", len(header), spec, OUTPUTS).inputs["B"].tolist() == [
        True,
        False,
    ]
    with pytest.raises(ProtocolError, match="0 or 1"):
        decode(header + b"\x01\x02", len(header), spec, OUTPUTS)


def test_non_utf8_bytes_elements_are_refused():
    spec = {"S": TensorSpec("S", "BYTES", (-1,))}
    raw = struct.pack("<I", 2) + b"\xff\xfe"
    header = body(
        {"name": "S", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}}
    )
    with pytest.raises(ProtocolError, match="not UTF-8"):
        decode(header + raw, len(header), spec, OUTPUTS)


def test_requested_outputs_take_their_own_binary_flag_or_the_requests():
    found = decode(
        body(
            x_json([1, 2, 3, 4]),
            outputs=[{"name": "Z"}, {"name": "Y", "parameters": {"binary_data": False}}],
            parameters={"binary_data_output": True},
        ),
        None,
        INPUTS,
        OUTPUTS,
    )
    assert found.outputs == [("Z", True), ("Y", False)]


def test_an_answer_puts_binary_outputs_after_its_json_header():
    y = np.arange(8, dtype=np.float32).reshape(2, 4)
    z = np.array([3, 4], dtype=np.int64)
    s = np.array(["é", "b"], dtype=object)
    encoded, length = encode("lee/m", "2", "r1", [("Y", y, True), ("Z", z, False), ("S", s, True)])
    assert length is not None
    header = orjson.loads(encoded[:length])
    assert (
        header["model_name"] == "lee/m" and header["model_version"] == "2" and header["id"] == "r1"
    )
    y_out, z_out, s_out = header["outputs"]
    assert y_out == {
        "name": "Y",
        "datatype": "FP32",
        "shape": [2, 4],
        "parameters": {"binary_data_size": 32},
    }
    assert z_out == {"name": "Z", "datatype": "INT64", "shape": [2], "data": [3, 4]}
    assert s_out["datatype"] == "BYTES"
    raw = encoded[length:]
    assert np.frombuffer(raw[:32], dtype="<f4").reshape(2, 4).tolist() == y.tolist()
    assert raw[32:] == struct.pack("<I", 2) + "é".encode() + struct.pack("<I", 1) + b"b"


def test_an_all_json_answer_has_no_header_length():
    encoded, length = encode("m", "1", None, [("Z", np.array([1, 2]), False)])
    assert length is None
    assert orjson.loads(encoded) == {
        "model_name": "m",
        "model_version": "1",
        "outputs": [{"name": "Z", "datatype": "INT64", "shape": [2], "data": [1, 2]}],
    }


def test_every_datatype_survives_binary_and_json():
    for datatype, dtype in DTYPES.items():
        spec = {"T": TensorSpec("T", datatype, (-1, 2))}
        if datatype == "BYTES":
            array = np.array([["a", "b"], ["c", "dé"]], dtype=object)
        elif datatype == "BOOL":
            array = np.array([[True, False], [False, True]])
        else:
            array = np.array([[0, 1], [2, 3]]).astype(dtype)
        for binary in (True, False):
            encoded, length = encode("m", "1", None, [("T", array, binary)])
            out = orjson.loads(encoded[:length] if length else encoded)["outputs"][0]
            tensor = {"name": "T", "shape": out["shape"], "datatype": out["datatype"]}
            if binary:
                tensor["parameters"] = out["parameters"]
                header = body(tensor)
                request = header + encoded[length:]
                found = decode(request, len(header), spec, OUTPUTS)
            else:
                found = decode(body({**tensor, "data": out["data"]}), None, spec, OUTPUTS)
            assert found.inputs["T"].tolist() == array.tolist(), (datatype, binary)
            assert found.inputs["T"].dtype == dtype, (datatype, binary)


@pytest.mark.parametrize(
    ("path", "method", "parts", "route"),
    [
        ("/v2", "GET", 2, ("server", None, None)),
        ("/v2/health/live", "GET", 2, ("live", None, None)),
        ("/v2/health/ready", "HEAD", 2, ("ready", None, None)),
        ("/v2/models/lee/m", "GET", 2, ("model", "lee/m", None)),
        ("/v2/models/lee/m/ready", "GET", 2, ("model_ready", "lee/m", None)),
        ("/v2/models/lee/m/versions/3/infer", "POST", 2, ("infer", "lee/m", "3")),
        ("/v2/models/m/infer", "POST", 1, ("infer", "m", None)),
        ("/v2/repository/index", "POST", 2, ("index", None, None)),
        ("/v2/repository/models/lee/m/unload", "POST", 2, ("unload", "lee/m", None)),
    ],
)
def test_protocol_paths_parse_to_their_route(path, method, parts, route):
    found = parse(path, method, parts)
    assert found is not None and (found.op, found.model, found.version) == route


def test_a_wrong_method_or_an_unknown_protocol_path_is_refused():
    with pytest.raises(ProtocolError) as wrong:
        parse("/v2/models/lee/m/infer", "GET", 2)
    assert wrong.value.status == 405
    with pytest.raises(ProtocolError) as unknown:
        parse("/v2/models/lee/m/stats", "GET", 2)
    assert unknown.value.status == 404
    assert parse("/other", "GET", 2) is None


def test_a_refusal_is_refused_again_and_a_route_is_parsed_once():
    """parse is cached per (path, method, parts): a refusal is never cached, so the same
    bad path is refused each time, and a good one is the same Route each time."""
    for _ in range(2):
        with pytest.raises(ProtocolError) as wrong:
            parse("/v2/models/lee/m/infer", "GET", 2)
        assert wrong.value.status == 405
    first = parse("/v2/models/lee/m/infer", "POST", 2)
    assert first is parse("/v2/models/lee/m/infer", "POST", 2)
    assert parse.cache_info().maxsize is not None  # bounded: odd paths cannot grow it


def test_a_strided_output_is_answered_in_row_major_order():
    """An output that is a view across its rows (a transpose, as a post() may return) is
    written in row-major order in JSON and in binary alike."""
    array = np.arange(6, dtype=np.float32).reshape(2, 3).T  # [[0, 3], [1, 4], [2, 5]]
    encoded, _ = encode("m", "1", None, [("T", array, False)])
    assert orjson.loads(encoded)["outputs"][0]["data"] == [0, 3, 1, 4, 2, 5]
    encoded, length = encode("m", "1", None, [("T", array, True)])
    assert length is not None
    assert np.frombuffer(encoded[length:], "<f4").tolist() == [0, 3, 1, 4, 2, 5]
