"""KServe v2 wire codec: JSON and binary requests/responses, against numpy and tritonclient."""

from __future__ import annotations

import json
import random
import struct
from typing import Any

import numpy as np
import pytest

from daemon.api.kserve_codec import Codec, DecodedInfer, encode_error, parse_header_length
from daemon.backend import NUMPY_DTYPES, InferRequest, InferResponse
from daemon.errors import InvalidArgument
from daemon.model_config import ModelConfig, TensorConfig

# One sample per datatype: (datatype, numpy array as decoded, JSON data to send).
SAMPLES: list[tuple[str, np.ndarray, list[Any]]] = [
    ("BOOL", np.array([[True, False], [False, True]]), [[True, False], [False, True]]),
    ("UINT8", np.array([[0, 255], [7, 8]], np.uint8), [[0, 255], [7, 8]]),
    ("UINT16", np.array([[0, 65535], [7, 8]], np.uint16), [[0, 65535], [7, 8]]),
    ("UINT32", np.array([[0, 2**32 - 1], [7, 8]], np.uint32), [[0, 2**32 - 1], [7, 8]]),
    ("UINT64", np.array([[0, 2**64 - 1], [7, 8]], np.uint64), [[0, 2**64 - 1], [7, 8]]),
    ("INT8", np.array([[-128, 127], [0, 1]], np.int8), [[-128, 127], [0, 1]]),
    ("INT16", np.array([[-32768, 32767], [0, 1]], np.int16), [[-32768, 32767], [0, 1]]),
    ("INT32", np.array([[-(2**31), 2**31 - 1], [0, 1]], np.int32), [[-(2**31), 2**31 - 1], [0, 1]]),
    ("INT64", np.array([[-(2**63), 2**63 - 1], [0, 1]], np.int64), [[-(2**63), 2**63 - 1], [0, 1]]),
    ("FP16", np.array([[0.5, -2.0], [65504.0, 1.0]], np.float16), [[0.5, -2.0], [65504.0, 1]]),
    ("FP32", np.array([[0.25, -1.5], [3.0, 1e-3]], np.float32), [[0.25, -1.5], [3, 1e-3]]),
    ("FP64", np.array([[0.1, -1.5], [3.0, 1e300]], np.float64), [[0.1, -1.5], [3, 1e300]]),
    # bf16 bit patterns of 1.0, -2.0, 0.5, 3.140625 (all exact in bf16).
    (
        "BF16",
        np.array([[0x3F80, 0xC000], [0x3F00, 0x4049]], np.uint16),
        [[1.0, -2.0], [0.5, 3.140625]],
    ),
    (
        "BYTES",
        np.array([[b"a", b""], ["é".encode(), b"longer text"]], dtype=object),
        [["a", ""], ["é", "longer text"]],
    ),
]


@pytest.fixture
def codec() -> Codec:
    return Codec()


def json_body(header: dict[str, Any]) -> bytes:
    return json.dumps(header).encode()


def binary_body(header: dict[str, Any], *chunks: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + b"".join(chunks), len(head)


def bytes_wire(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def wire_of(datatype: str, array: np.ndarray) -> bytes:
    if datatype == "BYTES":
        return bytes_wire(list(array.ravel()))
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    if want.dtype == object:
        assert got.ravel().tolist() == want.ravel().tolist()
        assert all(type(x) is bytes for x in got.ravel())
    else:
        np.testing.assert_array_equal(got, want)


def decode_error(codec: Codec, body: bytes, header_length: int | None = None, **kw: Any) -> str:
    with pytest.raises(InvalidArgument) as info:
        codec.decode_infer_request(body, header_length, **kw)
    return info.value.message


# --------------------------------------------------------------------------- requests


@pytest.mark.parametrize(("datatype", "want", "data"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_json_input_every_datatype(
    codec: Codec, datatype: str, want: np.ndarray, data: list[Any]
) -> None:
    body = json_body(
        {"inputs": [{"name": "X", "shape": [2, 2], "datatype": datatype, "data": data}]}
    )
    decoded = codec.decode_infer_request(body, None)
    assert_same(decoded.request.inputs["X"], want)


@pytest.mark.parametrize(("datatype", "want", "data"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_json_flat_equals_nested(
    codec: Codec, datatype: str, want: np.ndarray, data: list[Any]
) -> None:
    flat = [x for row in data for x in row]
    body = json_body(
        {"inputs": [{"name": "X", "shape": [2, 2], "datatype": datatype, "data": flat}]}
    )
    assert_same(codec.decode_infer_request(body, None).request.inputs["X"], want)


@pytest.mark.parametrize(("datatype", "want", "data"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_binary_input_every_datatype(
    codec: Codec, datatype: str, want: np.ndarray, data: list[Any]
) -> None:
    wire = wire_of(datatype, want)
    header = {
        "inputs": [
            {
                "name": "X",
                "shape": [2, 2],
                "datatype": datatype,
                "parameters": {"binary_data_size": len(wire)},
            }
        ]
    }
    body, length = binary_body(header, wire)
    got = codec.decode_infer_request(body, length).request.inputs["X"]
    assert_same(got, want)
    assert got.flags.aligned


def test_json_nested_row_major_and_ragged_nesting(codec: Codec) -> None:
    nested = [[[1, 2, 3], [4, 5, 6]]]
    body = json_body(
        {"inputs": [{"name": "X", "shape": [3, 2], "datatype": "INT32", "data": nested}]}
    )
    got = codec.decode_infer_request(body, None).request.inputs["X"]
    np.testing.assert_array_equal(got, np.arange(1, 7, dtype=np.int32).reshape(3, 2))
    # Triton walks nested arrays in order whatever their nesting; so do we.
    ragged = [[1, 2], [3], [[4, 5], 6]]
    body = json_body({"inputs": [{"name": "X", "shape": [6], "datatype": "FP32", "data": ragged}]})
    got = codec.decode_infer_request(body, None).request.inputs["X"]
    np.testing.assert_array_equal(got, np.arange(1, 7, dtype=np.float32))


def test_json_bf16_rounds_to_nearest_even(codec: Codec) -> None:
    # 1 + 2^-8 is halfway between bf16 1.0 (0x3F80) and 1 + 2^-7 (0x3F81): ties go to even.
    # 1 + 3 * 2^-8 is halfway between 0x3F81 and 0x3F82: even again, so up.
    # 1 + 2^-8 + 2^-20 is just above halfway: up to 0x3F81.
    data = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -0.0]
    body = json_body({"inputs": [{"name": "X", "shape": [4], "datatype": "BF16", "data": data}]})
    got = codec.decode_infer_request(body, None).request.inputs["X"]
    assert got.tolist() == [0x3F80, 0x3F82, 0x3F81, 0x8000]


def test_binary_bytes_zero_length_and_non_utf8(codec: Codec) -> None:
    items = [b"", b"\xff\xfe\x00", b"plain", b""]
    wire = bytes_wire(items)
    header = {
        "inputs": [
            {
                "name": "S",
                "shape": [2, 2],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": len(wire)},
            }
        ]
    }
    body, length = binary_body(header, wire)
    got = codec.decode_infer_request(body, length).request.inputs["S"]
    assert got.shape == (2, 2)
    assert got.ravel().tolist() == items


def test_mixed_json_and_binary_inputs_in_order(codec: Codec) -> None:
    a = np.arange(4, dtype=np.float32)
    b = np.array([True, False, True])
    header = {
        "inputs": [
            {"name": "A", "shape": [4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
            {"name": "J", "shape": [2], "datatype": "INT64", "data": [5, 6]},
            {"name": "B", "shape": [3], "datatype": "BOOL", "parameters": {"binary_data_size": 3}},
        ]
    }
    body, length = binary_body(header, a.tobytes(), b.tobytes())
    inputs = codec.decode_infer_request(body, length).request.inputs
    assert list(inputs) == ["A", "J", "B"]
    np.testing.assert_array_equal(inputs["A"], a)
    np.testing.assert_array_equal(inputs["J"], np.array([5, 6], np.int64))
    np.testing.assert_array_equal(inputs["B"], b)


def test_request_fields_and_parameters(codec: Codec) -> None:
    body = json_body(
        {
            "id": "req-7",
            "model_name": "ignored",
            "parameters": {
                "priority": 2,
                "timeout": 1500,
                "binary_data_output": True,
                "sequence_id": 9,
                "custom": "x",
            },
            "inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}],
            "outputs": [
                {"name": "Y", "parameters": {"binary_data": False}},
                {"name": "Z"},
            ],
        }
    )
    decoded = codec.decode_infer_request(body, None)
    request = decoded.request
    assert request.id == "req-7"
    assert request.priority == 2
    assert request.timeout_us == 1500
    assert request.requested_outputs == ("Y", "Z")
    # Reserved parameters are Triton's, not the backend's.
    assert request.parameters == {"custom": "x"}
    assert decoded.binary_default is True
    # As in Triton: a listed output is binary only by its own flag; binary_data_output
    # decides for the outputs the request does not list.
    assert decoded.output_is_binary("Y") is False
    assert decoded.output_is_binary("Z") is False
    assert decoded.output_is_binary("W") is True


def test_defaults_without_parameters(codec: Codec) -> None:
    body = json_body({"inputs": [{"name": "X", "shape": [], "datatype": "INT32", "data": 5}]})
    decoded = codec.decode_infer_request(body, None)
    assert decoded.request.inputs["X"].shape == ()
    assert int(decoded.request.inputs["X"]) == 5
    assert decoded.request.priority == 0 and decoded.request.timeout_us == 0
    assert decoded.request.requested_outputs == ()
    assert decoded.output_is_binary("anything") is False


# --------------------------------------------------------------------------- raw body


def test_raw_body_deduces_variable_dim(codec: Codec) -> None:
    data = np.arange(6, dtype=np.float32)
    single = TensorConfig(name="IN", data_type="TYPE_FP32", dims=[-1, 3])
    decoded = codec.decode_infer_request(data.tobytes(), 0, single_input=single, max_batch_size=4)
    got = decoded.request.inputs["IN"]
    np.testing.assert_array_equal(got, data.reshape(1, 2, 3))
    assert decoded.request.requested_outputs == ()
    # Triton answers a raw request in binary.
    assert decoded.output_is_binary("OUT") is True


def test_raw_body_fixed_shape_without_batching(codec: Codec) -> None:
    data = np.array([[1, 2], [3, 4]], np.int16)
    single = TensorConfig(name="IN", data_type="INT16", dims=[2, 2])
    got = codec.decode_infer_request(data.tobytes(), 0, single_input=single).request.inputs["IN"]
    np.testing.assert_array_equal(got, data)


def test_raw_body_bytes_is_one_element(codec: Codec) -> None:
    single = TensorConfig(name="IN", data_type="BYTES", dims=[1])
    raw = b"\x00\xffany bytes"
    got = codec.decode_infer_request(raw, 0, single_input=single, max_batch_size=8).request.inputs[
        "IN"
    ]
    assert got.shape == (1, 1)
    assert got[0, 0] == raw


@pytest.mark.parametrize(
    ("single", "body", "message"),
    [
        (None, b"1234", "Raw request must only have 1 input (found 1) to be deduced"),
        (
            TensorConfig(name="IN", data_type="FP32", dims=[-1]),
            b"12345",
            "5-byte body does not fit",
        ),
        (
            TensorConfig(name="IN", data_type="FP32", dims=[2]),
            b"1234",
            "binary_data_size 4 does not match shape [2]",
        ),
        # Triton's wording (its L0_http tests match it).
        (
            TensorConfig(name="IN", data_type="FP32", dims=[-1, -1]),
            b"1234",
            "The shape of the raw input 'IN' can not be deduced because there are more than one "
            "variable-sized dimension",
        ),
        (
            TensorConfig(name="IN", data_type="BYTES", dims=[2]),
            b"ab",
            "For BYTE datatype raw input 'IN', the model must have input shape [1]",
        ),
    ],
)
def test_raw_body_errors(
    codec: Codec, single: TensorConfig | None, body: bytes, message: str
) -> None:
    assert message in decode_error(codec, body, 0, single_input=single)


def test_raw_body_with_several_inputs_names_the_model(codec: Codec) -> None:
    config = ModelConfig(name="three", input=[
        TensorConfig(name=f"IN{i}", data_type="FP32", dims=[8]) for i in range(3)
    ])
    assert decode_error(codec, b"1234", 0, config=config) == (
        "Raw request must only have 1 input (found 1) to be deduced but got 3 inputs in "
        "'three' model configuration"
    )


# --------------------------------------------------------------------------- malformed requests


def one_input(**fields: Any) -> dict[str, Any]:
    tensor = {"name": "INPUT0", "shape": [2, 16], "datatype": "FP32"}
    tensor.update(fields)
    return {"inputs": [tensor]}


MALFORMED_JSON: list[tuple[str, dict[str, Any], str]] = [
    (
        "element count",
        one_input(data=[0.0] * 31),
        "input 'INPUT0': expected 32 elements for shape [2, 16], got 31",
    ),
    (
        "unknown datatype",
        one_input(datatype="FLOAT", data=[]),
        "input 'INPUT0': unknown datatype 'FLOAT'",
    ),
    (
        "negative dim",
        one_input(shape=[2, -1], data=[]),
        "input 'INPUT0': shape [2, -1] has a negative dimension",
    ),
    ("no data", one_input(), "input 'INPUT0': has neither 'data' nor binary_data_size"),
    (
        "both data and binary",
        one_input(data=[1.0], parameters={"binary_data_size": 0}),
        "input 'INPUT0': has both 'data' and binary_data_size",
    ),
    (
        "string in FP32",
        one_input(shape=[2], data=["1", "2"]),
        "input 'INPUT0': FP32 data must be JSON numbers",
    ),
    ("bool in FP32", one_input(shape=[2], data=[True, False]), "FP32 data must be JSON numbers"),
    (
        "float in INT32",
        one_input(shape=[2], datatype="INT32", data=[1, 2.5]),
        "input 'INPUT0': INT32 data must be JSON integers in [-2147483648, 2147483647]",
    ),
    (
        "int out of range",
        one_input(shape=[1], datatype="UINT8", data=[256]),
        "UINT8 data must be JSON integers in [0, 255]",
    ),
    (
        "negative in UINT64",
        one_input(shape=[1], datatype="UINT64", data=[-1]),
        "UINT64 data must be JSON integers",
    ),
    (
        "int beyond 64 bits",
        one_input(shape=[2], datatype="INT64", data=[2**64, 1]),
        "INT64 data must be JSON integers in [-9223372036854775808, 9223372036854775807]",
    ),
    (
        "int in BOOL",
        one_input(shape=[2], datatype="BOOL", data=[1, 0]),
        "input 'INPUT0': BOOL data must be JSON true/false",
    ),
    (
        "number in BYTES",
        one_input(shape=[2], datatype="BYTES", data=["a", 3]),
        "input 'INPUT0': BYTES element 1 must be a JSON string, got int",
    ),
    ("null data element", one_input(shape=[2], data=[1.0, None]), "FP32 data must be JSON numbers"),
    (
        "binary size not an int",
        one_input(parameters={"binary_data_size": "12"}),
        "input 'INPUT0': binary_data_size must be a non-negative integer, got '12'",
    ),
    (
        "binary without header length",
        one_input(parameters={"binary_data_size": 0}),
        "input 'INPUT0': binary_data_size needs the Inference-Header-Content-Length header",
    ),
    (
        "shared memory without byte size",
        one_input(parameters={"shared_memory_region": "r"}),
        "input 'INPUT0': 'shared_memory_region' needs 'shared_memory_byte_size'",
    ),
    (
        "duplicate input",
        {"inputs": [one_input(shape=[0], data=[])["inputs"][0]] * 2},
        "input 'INPUT0' appears more than once",
    ),
    (
        "classification",
        {
            **one_input(shape=[0], data=[]),
            "outputs": [{"name": "Y", "parameters": {"classification": "3"}}],
        },
        "output 'Y': 'classification' must be a non-negative integer, got '3'",
    ),
    (
        "binary_data not bool",
        {
            **one_input(shape=[0], data=[]),
            "outputs": [{"name": "Y", "parameters": {"binary_data": 1}}],
        },
        "Unable to parse 'binary_data': expected a boolean, got 1",
    ),
    (
        "priority negative",
        {**one_input(shape=[0], data=[]), "parameters": {"priority": -1}},
        "Unable to parse 'priority': expected a non-negative integer, got -1",
    ),
    (
        "timeout not int",
        {**one_input(shape=[0], data=[]), "parameters": {"timeout": "soon"}},
        "Unable to parse 'timeout': expected a non-negative integer, got 'soon'",
    ),
    (
        "binary_data_output not bool",
        {**one_input(shape=[0], data=[]), "parameters": {"binary_data_output": "yes"}},
        "Unable to parse 'binary_data_output': expected a boolean, got 'yes'",
    ),
    # Triton's reserved request parameters and its wording.
    (
        "sequence_id float",
        {**one_input(shape=[0], data=[]), "parameters": {"sequence_id": 1.5}},
        "Unable to parse 'sequence_id': expected a non-negative integer or a string, got 1.5",
    ),
    (
        "sequence_start not bool",
        {**one_input(shape=[0], data=[]), "parameters": {"sequence_start": 1}},
        "Unable to parse 'sequence_start': expected a boolean, got 1",
    ),
    (
        "triton_ prefix",
        {**one_input(shape=[0], data=[]), "parameters": {"triton_x": True}},
        "parameter keys starting with 'triton_' are reserved for Triton usage and should not "
        "be specified.",
    ),
    (
        "null parameter",
        {**one_input(shape=[0], data=[]), "parameters": {"p": None}},
        "parameter 'p' has invalid type. It should be either 'int', 'bool', or 'string'.",
    ),
    # msgspec's own messages carry the JSON path of the bad field.
    (
        "wrong type in shape",
        one_input(shape=[2, "16"], data=[]),
        "malformed JSON request header: Expected `int`, got `str` - at `$.inputs[0].shape[1]`",
    ),
    (
        "unknown field",
        one_input(data=[], bogus=1),
        "malformed JSON request header: Object contains unknown field `bogus` - at `$.inputs[0]`",
    ),
    (
        "missing inputs",
        {"id": "x"},
        "malformed JSON request header: Object missing required field `inputs`",
    ),
    (
        "nested parameter",
        {**one_input(shape=[0], data=[]), "parameters": {"p": {"a": 1}}},
        "parameter 'p' has invalid type. It should be either 'int', 'bool', or 'string'.",
    ),
]


@pytest.mark.parametrize(
    ("header", "message"), [c[1:] for c in MALFORMED_JSON], ids=[c[0] for c in MALFORMED_JSON]
)
def test_malformed_json_requests(codec: Codec, header: dict[str, Any], message: str) -> None:
    assert message in decode_error(codec, json_body(header))


def test_malformed_json_syntax(codec: Codec) -> None:
    message = decode_error(codec, b'{"inputs": [')
    assert message.startswith("malformed JSON request header: ")


def binary_input(
    size: Any, datatype: str = "FP32", shape: list[int] | None = None
) -> dict[str, Any]:
    return {
        "inputs": [
            {
                "name": "X",
                "shape": shape if shape is not None else [4],
                "datatype": datatype,
                "parameters": {"binary_data_size": size},
            }
        ]
    }


MALFORMED_BINARY: list[tuple[str, dict[str, Any], bytes, str]] = [
    (
        "size exceeds body",
        binary_input(64),
        b"\x00" * 10,
        "input 'X': binary_data_size 64 exceeds the 10 bytes left in the body",
    ),
    (
        "size vs shape",
        binary_input(12),
        b"\x00" * 12,
        "input 'X': binary_data_size 12 does not match shape [4] of FP32 (16 bytes expected)",
    ),
    (
        "extra bytes",
        binary_input(16),
        b"\x00" * 20,
        "4 bytes after the JSON header are not claimed by any input's binary_data_size",
    ),
    (
        "bytes element count",
        binary_input(14, "BYTES"),
        bytes_wire([b"a", b"b", b""]),
        "input 'X': expected 4 BYTES elements, got 3 in 14 bytes of binary data",
    ),
    (
        "bytes length prefix exceeds",
        binary_input(22, "BYTES"),
        bytes_wire([b"a", b"b", b""]) + struct.pack("<I", 1000) + b"xyzw",
        "input 'X': BYTES element 3 length prefix 1000 exceeds remaining 4 bytes",
    ),
    (
        "bytes truncated prefix",
        binary_input(16, "BYTES"),
        bytes_wire([b"a", b"b", b""]) + b"\x01\x00",
        "input 'X': BYTES element 3 has a truncated length prefix (2 bytes left)",
    ),
    (
        "bytes too many elements",
        binary_input(15, "BYTES", [2]),
        bytes_wire([b"a", b"b", b"c"]),
        "input 'X': expected 2 BYTES elements, got 3 in 15 bytes of binary data",
    ),
    (
        "bool not 0/1",
        binary_input(4, "BOOL"),
        b"\x00\x01\x02\x00",
        "input 'X': BOOL bytes must be 0 or 1",
    ),
]


@pytest.mark.parametrize(
    ("header", "tail", "message"),
    [c[1:] for c in MALFORMED_BINARY],
    ids=[c[0] for c in MALFORMED_BINARY],
)
def test_malformed_binary_requests(
    codec: Codec, header: dict[str, Any], tail: bytes, message: str
) -> None:
    body, length = binary_body(header, tail)
    assert message in decode_error(codec, body, length)


def test_bytes_after_json_only_request(codec: Codec) -> None:
    body, length = binary_body(one_input(shape=[1], data=[1.0]), b"\x00\x00")
    message = decode_error(codec, body, length)
    assert (
        message == "2 bytes after the JSON header are not claimed by any input's binary_data_size"
    )


def test_header_length_out_of_range(codec: Codec) -> None:
    body = json_body(one_input(shape=[0], data=[]))
    message = decode_error(codec, body, len(body) + 1)
    # Triton's wording.
    assert message == f"inference header size should be in range (0, {len(body)}), got: {len(body) + 1}"
    assert decode_error(codec, body, -1).endswith("got: -1")


def test_parse_header_length() -> None:
    assert parse_header_length(None) is None
    assert parse_header_length(" 12 ") == 12
    with pytest.raises(InvalidArgument, match=r"^Unable to parse Inference-Header-Content-Length, got: abc$"):
        parse_header_length("abc")
    with pytest.raises(InvalidArgument, match=r"in range \(0, 5\), got: 6"):
        parse_header_length("6", 5)


def test_duplicate_output_is_answered_once(codec: Codec) -> None:
    """Triton keeps one entry per output name."""
    body = json_body({**one_input(shape=[0], data=[]), "outputs": [{"name": "Y"}, {"name": "Y"}]})
    assert codec.decode_infer_request(body, None).request.requested_outputs == ("Y",)


def test_reserved_parameters_do_not_reach_the_backend(codec: Codec) -> None:
    params = {"sequence_id": "corr-1", "sequence_start": True, "sequence_end": False, "n": 2.5}
    body = json_body({**one_input(shape=[0], data=[]), "parameters": params})
    assert codec.decode_infer_request(body, None).request.parameters == {"n": 2.5}


def _nested(depth: int) -> str:
    return "[" * (depth - 1) + "[1.0]" + "]" * (depth - 1)


def _fp32_body(shape: list[int], data: str) -> bytes:
    # Built as text: json.dumps itself recurses on deep nesting.
    head = f'{{"inputs": [{{"name": "INPUT0", "shape": {shape}, "datatype": "FP32", "data": '
    return (head + data + "}]}").encode()


@pytest.mark.parametrize("depth", [100, 120, 5000])
def test_json_nesting_limit(codec: Codec, depth: int) -> None:
    """Triton (>= 2.58) rejects data nested 100 arrays deep; never a RecursionError 500."""
    body = _fp32_body([1], _nested(depth))
    assert decode_error(codec, body) == "JSON nesting depth exceeds maximum allowed limit (100)"


def test_json_nesting_ragged_deep_branch(codec: Codec) -> None:
    data = "[1.0, " + _nested(150) + "]"
    body = _fp32_body([2], data)
    assert decode_error(codec, body) == "JSON nesting depth exceeds maximum allowed limit (100)"


def test_json_nesting_99_is_accepted(codec: Codec) -> None:
    body = _fp32_body([1], _nested(99))
    assert codec.decode_infer_request(body, None).request.inputs["INPUT0"].tolist() == [1.0]


def test_header_length_cuts_json_short(codec: Codec) -> None:
    body = json_body(one_input(shape=[0], data=[]))
    assert decode_error(codec, body, len(body) - 2).startswith("malformed JSON request header: ")


def test_request_size_cap() -> None:
    codec = Codec(max_request_bytes=100)
    body = json_body(one_input(shape=[40], data=[0.0] * 40))
    with pytest.raises(
        InvalidArgument,
        match=f"^request size of {len(body)} bytes exceeds the maximum allowed input size of 100 bytes$",
    ):
        codec.decode_infer_request(body, None)


# --------------------------------------------------------------------------- responses


def decoded_for(
    binary: dict[str, bool] | None = None, default: bool = False, request_id: str = ""
) -> DecodedInfer:
    return DecodedInfer(InferRequest(inputs={}, id=request_id), binary or {}, default)


def split_response(body: bytes, length: int | None) -> tuple[dict[str, Any], bytes]:
    if length is None:
        return json.loads(body), b""
    return json.loads(body[:length]), body[length:]


@pytest.mark.parametrize(("datatype", "array", "data"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_encode_json_every_datatype(
    codec: Codec, datatype: str, array: np.ndarray, data: list[Any]
) -> None:
    config = ModelConfig(name="m", output=[TensorConfig(name="Y", data_type=datatype, dims=[2, 2])])
    body, length = codec.encode_infer_response(
        "m", "3", decoded_for(), InferResponse({"Y": array}), config
    )
    assert length is None
    doc = json.loads(body)
    assert doc["model_name"] == "m" and doc["model_version"] == "3"
    assert "id" not in doc and "parameters" not in doc
    (out,) = doc["outputs"]
    assert out["name"] == "Y" and out["datatype"] == datatype and out["shape"] == [2, 2]
    flat = [x for row in data for x in row]
    if datatype == "BF16":
        np.testing.assert_array_equal(np.array(out["data"]), np.array(flat))
    elif datatype in ("FP16", "FP32", "FP64"):
        # JSON carries the exact value of each element; reading it back as the same dtype
        # must give the same bits.
        np.testing.assert_array_equal(np.array(out["data"], array.dtype), array.ravel())
    else:
        assert out["data"] == flat


@pytest.mark.parametrize(("datatype", "array", "data"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_encode_binary_every_datatype(
    codec: Codec, datatype: str, array: np.ndarray, data: list[Any]
) -> None:
    config = ModelConfig(name="m", output=[TensorConfig(name="Y", data_type=datatype, dims=[2, 2])])
    body, length = codec.encode_infer_response(
        "m", "1", decoded_for(default=True), InferResponse({"Y": array}), config
    )
    assert length is not None
    doc, tail = split_response(body, length)
    (out,) = doc["outputs"]
    assert out["datatype"] == datatype
    assert "data" not in out
    assert out["parameters"] == {"binary_data_size": len(tail)}
    assert tail == wire_of(datatype, array)


def test_encode_mixed_outputs_id_parameters(codec: Codec) -> None:
    response = InferResponse(
        {
            "A": np.arange(6, dtype=np.float32).reshape(2, 3),
            "S": np.array([b"", b"\xff\x00ok"], dtype=object),
            "J": np.array([[1, 2]], np.int64),
        },
        parameters={"sequence_id": np.int64(4), "note": "hi"},
    )
    decoded = decoded_for({"A": True, "S": True, "J": False}, request_id="r1")
    body, length = codec.encode_infer_response("m", "1", decoded, response)
    doc, tail = split_response(body, length)
    assert doc["id"] == "r1"
    assert doc["parameters"] == {"sequence_id": 4, "note": "hi"}
    a, s, j = doc["outputs"]
    assert a["parameters"]["binary_data_size"] == 24
    assert s["parameters"]["binary_data_size"] == 4 + 4 + 4
    assert j["data"] == [1, 2] and j["shape"] == [1, 2]
    assert tail[:24] == np.arange(6, dtype=np.float32).tobytes()
    assert tail[24:] == b"\x00\x00\x00\x00" + b"\x04\x00\x00\x00\xff\x00ok"


def test_encode_json_bytes_refuses_invalid_utf8(codec: Codec) -> None:
    """Never a U+FFFD: a 400 naming the output and the remedy."""
    response = InferResponse({"S": np.array([b"ok", b"\xff"], dtype=object)})
    with pytest.raises(InvalidArgument) as caught:
        codec.encode_infer_response("m", "1", decoded_for(), response)
    assert caught.value.message.startswith("output 'S' holds BYTES that are not valid UTF-8")
    assert '"binary_data": true' in caught.value.message
    # The same output in binary is fine, byte for byte.
    body, length = codec.encode_infer_response("m", "1", decoded_for({"S": True}), response)
    assert length is not None and body[length:] == b"\x02\x00\x00\x00ok\x01\x00\x00\x00\xff"


def test_encode_json_str_arrays(codec: Codec) -> None:
    response = InferResponse({"U": np.array(["x", "yz"])})
    body, length = codec.encode_infer_response("m", "1", decoded_for(), response)
    assert length is None
    assert json.loads(body)["outputs"][0]["data"] == ["x", "yz"]


def test_encode_uint16_without_config_is_uint16(codec: Codec) -> None:
    body, _ = codec.encode_infer_response(
        "m", "1", decoded_for(), InferResponse({"Y": np.array([0x3F80], np.uint16)})
    )
    assert json.loads(body)["outputs"][0] == {
        "name": "Y",
        "datatype": "UINT16",
        "shape": [1],
        "data": [0x3F80],
    }


def test_encode_non_contiguous_and_big_endian_binary(codec: Codec) -> None:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    response = InferResponse({"T": base.T, "B": base.astype(">f4")})
    body, length = codec.encode_infer_response("m", "1", decoded_for(default=True), response)
    _, tail = split_response(body, length)
    assert tail[:48] == np.ascontiguousarray(base.T).tobytes()
    assert tail[48:] == base.tobytes()


def test_encode_error() -> None:
    assert json.loads(encode_error('bad "thing"')) == {"error": 'bad "thing"'}


# --------------------------------------------------------------------------- tritonclient


def test_tritonclient_request_body_decodes(codec: Codec) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    rng = np.random.default_rng(0)
    fp32 = rng.standard_normal((2, 3)).astype(np.float32)
    fp16 = rng.standard_normal((4,)).astype(np.float16)
    int8 = np.array([[-3, 4]], np.int8)
    flags = np.array([True, False, True])
    text = np.array([b"", b"\xff\xfe", "héllo".encode()], dtype=object)
    json_text = np.array([b"abc", "ünï".encode()], dtype=object)
    u64 = np.array([2**64 - 1, 0], np.uint64)
    arrays = {
        "FP32": (fp32, "FP32", True),
        "FP16": (fp16, "FP16", True),
        "INT8": (int8, "INT8", False),
        "BOOL": (flags, "BOOL", True),
        "TEXT": (text, "BYTES", True),
        "JTEXT": (json_text, "BYTES", False),
        "U64": (u64, "UINT64", False),
        "JF32": (fp32, "FP32", False),
    }
    inputs = []
    for name, (array, datatype, binary) in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    outputs = [
        httpclient.InferRequestedOutput("OUT_BIN", binary_data=True),
        httpclient.InferRequestedOutput("OUT_JSON", binary_data=False),
    ]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs, request_id="abc", priority=3, timeout=250
    )
    assert json_size is not None
    decoded = codec.decode_infer_request(body, json_size)
    request = decoded.request
    assert request.id == "abc" and request.priority == 3 and request.timeout_us == 250
    assert request.requested_outputs == ("OUT_BIN", "OUT_JSON")
    assert decoded.output_is_binary("OUT_BIN") is True
    assert decoded.output_is_binary("OUT_JSON") is False
    for name, (array, _, _) in arrays.items():
        got = request.inputs[name]
        assert got.shape == array.shape, name
        if array.dtype == object:
            assert got.ravel().tolist() == array.ravel().tolist(), name
        else:
            assert got.dtype == array.dtype, name
            np.testing.assert_array_equal(got, array)


def test_tritonclient_bf16_request(codec: Codec) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = np.array([1.0, -2.5, 3.140625, 0.15625], np.float32)  # exact in bf16
    tensor = httpclient.InferInput("B", [4], "BF16")
    tensor.set_data_from_numpy(values.astype(ml_dtypes.bfloat16), binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor])
    got = codec.decode_infer_request(body, json_size).request.inputs["B"]
    assert got.dtype == np.uint16
    assert got.tolist() == [0x3F80, 0xC020, 0x4049, 0x3E20]


def test_tritonclient_parses_our_response(codec: Codec) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    outputs: dict[str, np.ndarray] = {}
    binary: dict[str, bool] = {}
    for datatype, array, _ in SAMPLES:
        if datatype == "BF16":
            continue  # checked on its own below: tritonclient returns bf16 as float32
        for mode in ("bin", "json"):
            name = f"{datatype}_{mode}"
            outputs[name] = array
            binary[name] = mode == "bin"
    decoded = decoded_for(binary, request_id="rid")
    body, length = codec.encode_infer_response("m", "2", decoded, InferResponse(outputs))
    result = httpclient.InferenceServerClient.parse_response_body(body, header_length=length)
    response = result.get_response()
    assert (
        response["model_name"] == "m"
        and response["model_version"] == "2"
        and response["id"] == "rid"
    )
    for name, array in outputs.items():
        got = result.as_numpy(name)
        assert got is not None, name
        assert got.shape == array.shape, name
        if array.dtype == object:
            want = array.ravel().tolist()
            if name.endswith("_json"):
                want = [x.decode() for x in want]  # JSON strings come back as str
            assert got.ravel().tolist() == want, name
        else:
            assert got.dtype == array.dtype, name
            np.testing.assert_array_equal(got, array)


def test_tritonclient_parses_bf16_output(codec: Codec) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    bits = np.array([[0x3F80, 0xC000], [0x3F00, 0x4049]], np.uint16)
    want = np.array([[1.0, -2.0], [0.5, 3.140625]], np.float32)
    config = ModelConfig(name="m", output=[TensorConfig(name="Y", data_type="BF16", dims=[2, 2])])
    for binary in (True, False):
        body, length = codec.encode_infer_response(
            "m", "1", decoded_for(default=binary), InferResponse({"Y": bits}), config
        )
        assert (length is not None) == binary
        result = httpclient.InferenceServerClient.parse_response_body(body, header_length=length)
        assert result.get_output("Y")["datatype"] == "BF16"
        got = result.as_numpy("Y")
        assert got.shape == (2, 2)
        np.testing.assert_array_equal(got.astype(np.float32), want)


# --------------------------------------------------------------------------- limits, NaN/Inf


def test_element_cap_applies_to_json_binary_and_shared_memory_inputs() -> None:
    codec = Codec(max_tensor_elements=4)
    ok = {"inputs": [{"name": "X", "shape": [2, 2], "datatype": "INT8", "data": [1, 2, 3, 4]}]}
    assert codec.decode_infer_request(json.dumps(ok).encode(), None).request.inputs["X"].size == 4
    for parameters in ({}, {"binary_data_size": 5}, {"shared_memory_region": "r"}):
        tensor = {"name": "X", "shape": [5], "datatype": "INT8", "parameters": parameters}
        if not parameters:
            tensor["data"] = [1, 2, 3, 4, 5]
        body = json.dumps({"inputs": [tensor]}).encode()
        header = len(body)
        if "binary_data_size" in parameters:
            body += b"\0" * 5
        with pytest.raises(InvalidArgument, match=r"input 'X': shape \[5\] has 5 elements, "
                           r"more than the 4 allowed per tensor \(server max-tensor-elements\)"):
            codec.decode_infer_request(body, header)


def test_decoded_bytes_cap_sums_over_inputs() -> None:
    codec = Codec(max_decoded_bytes=1024)
    half = {"shape": [64], "datatype": "FP64", "data": [0.0] * 64}  # 512 bytes each
    body = {"inputs": [{"name": "A", **half}, {"name": "B", **half}]}
    assert len(codec.decode_infer_request(json.dumps(body).encode(), None).request.inputs) == 2
    body["inputs"].append({"name": "C", "shape": [1], "datatype": "INT8", "data": [1]})
    with pytest.raises(InvalidArgument, match="input 'C': decoding the request's inputs would "
                       "take 1025 bytes, more than the 1024 allowed"):
        codec.decode_infer_request(json.dumps(body).encode(), None)


@pytest.mark.parametrize("datatype", ["FP32", "INT32"])
def test_json_booleans_in_number_tensors_are_refused(datatype: str) -> None:
    body = {"inputs": [{"name": "X", "shape": [2], "datatype": datatype, "data": [True, 0]}]}
    with pytest.raises(InvalidArgument, match=f"{datatype} data must be JSON numbers, got a JSON boolean"):
        Codec().decode_infer_request(json.dumps(body).encode(), None)


@pytest.mark.parametrize("count", [3, 65, 300])  # checked in Python up to 64 numbers, by numpy above
def test_json_number_checks_hold_for_few_and_many_numbers(count: int) -> None:
    def decode(datatype: str, data: list[object]) -> np.ndarray:
        body = {"inputs": [{"name": "X", "shape": [len(data)], "datatype": datatype, "data": data}]}
        return Codec().decode_infer_request(json.dumps(body).encode(), None).request.inputs["X"]

    edges = [-128, 127] + [0] * (count - 2)
    decoded = decode("INT8", edges)
    assert decoded.dtype == np.int8 and decoded.tolist() == edges
    with pytest.raises(InvalidArgument, match=r"INT8 data must be JSON integers in \[-128, 127\]"):
        decode("INT8", [*edges[:-1], 128])
    with pytest.raises(InvalidArgument, match=r"INT8 data must be JSON integers in \[-128, 127\]"):
        decode("INT8", [-129, *edges[1:]])
    with pytest.raises(InvalidArgument, match="UINT64 data must be JSON integers"):
        decode("UINT64", [2, *[5] * (count - 2), -1])
    for datatype in ("INT32", "FP32"):
        with pytest.raises(InvalidArgument, match=f"{datatype} data must be JSON numbers, got a JSON boolean"):
            decode(datatype, [*[7] * (count - 1), True])
    floats = [0.5 * i for i in range(count)]
    assert decode("FP32", floats).tolist() == floats


@pytest.mark.parametrize("datatype", ["INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"])
def test_json_integers_decode_exactly_to_each_edge_of_their_datatype(datatype: str) -> None:
    dtype = NUMPY_DTYPES[datatype]
    low, high = int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)

    def decode(data: list[object], shape: list[int]) -> np.ndarray:
        body = {"inputs": [{"name": "X", "shape": shape, "datatype": datatype, "data": data}]}
        return Codec().decode_infer_request(json.dumps(body).encode(), None).request.inputs["X"]

    edges = [low, high, 0, 1]
    for data, shape in ((edges, [4]), (edges, [2, 2]), ([[low, high], [0, 1]], [2, 2])):
        decoded = decode(data, shape)
        assert decoded.dtype == dtype and decoded.shape == tuple(shape) and decoded.ravel().tolist() == edges
    for outside in (low - 1, high + 1):
        with pytest.raises(InvalidArgument, match=rf"{datatype} data must be JSON integers in \[{low}, {high}\]"):
            decode([0, outside], [2])
    with pytest.raises(InvalidArgument, match=f"{datatype} data must be JSON numbers, got a JSON boolean"):
        decode([1, True], [2])
    with pytest.raises(InvalidArgument, match=r"expected 3 elements for shape \[3\], got 2"):
        decode([1, 2], [3])


@pytest.mark.parametrize("datatype", ["INT32", "UINT8", "FP32", "FP16"])
def test_ragged_json_data_beginning_with_a_number_is_read_in_order(datatype: str) -> None:
    """Triton walks raggedly nested data in order (tests/compat: the same answers). Such data
    once failed with a 500 for integer datatypes, and past 64 numbers a boolean inside it was
    read as 1."""
    def decode(data: list[object], count: int) -> np.ndarray:
        body = {"inputs": [{"name": "X", "shape": [count], "datatype": datatype, "data": data}]}
        return Codec().decode_infer_request(json.dumps(body).encode(), None).request.inputs["X"]

    assert decode([1, [2, 3], [[4]], 5], 5).tolist() == [1, 2, 3, 4, 5]
    assert decode([1, [2] * 40, [3] * 40], 81).tolist() == [1] + [2] * 40 + [3] * 40
    for hidden, count in (([1, [True, 3]], 3), ([1, [2] * 40, [True] + [3] * 39], 81)):
        with pytest.raises(InvalidArgument, match=f"{datatype} data must be JSON numbers, got a JSON boolean"):
            decode(hidden, count)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nonfinite_json_outputs_are_nan_and_infinity_literals(dtype: type) -> None:
    decoded = DecodedInfer(InferRequest(inputs={}))
    response = InferResponse(outputs={"Y": np.array([[np.nan, 1.0], [np.inf, -np.inf]], dtype=dtype)})
    body, length = Codec().encode_infer_response("m", "1", decoded, response)
    assert length is None
    assert b'"data":[NaN,1.0,Infinity,-Infinity]' in body


# --------------------------------------------------------------------------- repeated headers
# A client sends the same JSON header for every request of one shape; the codec decodes such a
# header once and cuts later bodies along what it found. These check that a warm codec answers
# exactly what a fresh one does, body by body.


def _fields(decoded: DecodedInfer) -> tuple[Any, ...]:
    request = decoded.request
    return (
        {name: (a.dtype, a.shape, a.tolist()) for name, a in request.inputs.items()},
        request.id, request.requested_outputs, request.parameters, request.priority,
        request.timeout_us, request.correlation_id, request.flags,
        decoded.binary_outputs, decoded.binary_default,
    )


def _mixed_body(x: np.ndarray, flags: np.ndarray, words: list[bytes]) -> tuple[bytes, int]:
    wire = bytes_wire(words)
    header = {
        "id": "same",
        "parameters": {"priority": 1, "timeout": 7, "custom": "c", "binary_data_output": True},
        "inputs": [
            {"name": "X", "shape": [2, 2], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
            {"name": "F", "shape": [3], "datatype": "BOOL", "parameters": {"binary_data_size": 3}},
            {"name": "W", "shape": [len(words)], "datatype": "BYTES", "parameters": {"binary_data_size": len(wire)}},
        ],
        "outputs": [{"name": "Y", "parameters": {"binary_data": False}}, {"name": "Z"}],
    }
    return binary_body(header, x.astype("<f4").tobytes(), flags.astype(np.bool_).tobytes(), wire)


def test_a_repeated_header_decodes_each_body_as_a_fresh_codec_does(codec: Codec) -> None:
    rng = np.random.default_rng(3)
    seen = []
    for round_ in range(4):
        x = rng.random((2, 2), dtype=np.float32)
        flags = rng.integers(0, 2, 3).astype(bool)
        words = [b"ab", bytes([round_]) * 2]  # same lengths: the header's bytes are the same
        body, length = _mixed_body(x, flags, words)
        warm = codec.decode_infer_request(body, length)
        cold = Codec().decode_infer_request(body, length)
        assert _fields(warm) == _fields(cold)
        assert np.array_equal(warm.request.inputs["X"], x) and warm.request.inputs["X"].flags.aligned
        assert warm.request.inputs["W"].tolist() == words
        seen.append(warm)
    # Each request owns its parameters and output flags: a backend changing one's changes no other.
    seen[1].request.parameters["custom"] = "changed"
    seen[1].binary_outputs["Y"] = True
    again = codec.decode_infer_request(*_mixed_body(np.zeros((2, 2)), np.zeros(3), [b"ab", b"cd"]))
    assert again.request.parameters == {"custom": "c"}
    assert again.binary_outputs == {"Y": False, "Z": False}


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (b"\x00", "1 bytes after the JSON header are not claimed by any input's binary_data_size"),
        (None, "input 'W': binary_data_size 12 exceeds the 11 bytes left in the body"),
    ],
)
def test_a_repeated_header_still_checks_the_body_length(codec: Codec, tail: bytes | None, message: str) -> None:
    body, length = _mixed_body(np.ones((2, 2)), np.ones(3), [b"ab", b"cd"])
    codec.decode_infer_request(body, length)
    changed = body + tail if tail is not None else body[:-1]
    assert decode_error(codec, changed, length) == message
    assert decode_error(Codec(), changed, length) == message


def test_a_repeated_header_still_checks_the_data(codec: Codec) -> None:
    body, length = _mixed_body(np.ones((2, 2)), np.ones(3), [b"ab", b"cd"])
    codec.decode_infer_request(body, length)
    bad_bool = bytearray(body)
    bad_bool[length + 16] = 2
    assert decode_error(codec, bytes(bad_bool), length) == "input 'F': BOOL bytes must be 0 or 1"
    bad_bytes = bytearray(body)
    bad_bytes[length + 19] = 9  # W's first length prefix: 9 where 2 bytes follow
    assert "input 'W': BYTES element 0 length prefix 9 exceeds remaining" in decode_error(codec, bytes(bad_bytes), length)


class _CountingLookup:
    """Shared memory as a dict of bytearrays; counts the leases taken."""

    def __init__(self, regions: dict[str, bytearray]) -> None:
        self.regions = regions
        self.acquired = 0

    def acquire(self, name: str, offset: int, byte_size: int) -> Any:
        self.acquired += 1
        region = self.regions[name]

        class _Lease:
            buffer = region
            start = offset
            released = False

            def release(self) -> None:
                self.released = True

        return _Lease()


def test_a_shared_memory_header_takes_its_region_every_time(codec: Codec) -> None:
    region = bytearray(np.arange(4, dtype="<f4").tobytes())
    lookup = _CountingLookup({"r": region})
    header = {
        "inputs": [
            {"name": "S", "shape": [4], "datatype": "FP32",
             "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16}},
            {"name": "X", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}},
        ]
    }
    body, length = binary_body(header, np.float32(5).tobytes())
    for round_ in range(3):
        region[:4] = np.float32(round_).tobytes()
        decoded = codec.decode_infer_request(body, length, shm=lookup)
        assert decoded.request.inputs["S"].tolist() == [round_, 1, 2, 3]
        assert len(decoded.leases) == 1
        decoded.release()
    assert lookup.acquired == 3


def _random_request(rng: np.random.Generator) -> tuple[bytes, int]:
    """A binary request with random inputs and outputs, then maybe one corruption of its body."""
    inputs, chunks, offset = [], [], 0
    for index in range(int(rng.integers(1, 4))):
        datatype = str(rng.choice(["FP32", "INT8", "BOOL", "BYTES", "FP16", "UINT64"]))
        shape = [int(d) for d in rng.integers(0, 3, int(rng.integers(1, 3)))]
        count = int(np.prod(shape))
        if datatype == "BYTES":
            wire = bytes_wire([bytes(rng.integers(0, 256, int(rng.integers(0, 4)), dtype=np.uint8)) for _ in range(count)])
        else:
            wire = wire_of(datatype, rng.integers(0, 2, count).astype(np.dtype(datatype.lower().replace("fp", "float")) if datatype != "BOOL" else np.bool_))
        inputs.append({"name": f"I{index}", "shape": shape, "datatype": datatype,
                       "parameters": {"binary_data_size": len(wire)}})
        chunks.append(wire)
        offset += len(wire)
    header: dict[str, Any] = {"inputs": inputs}
    if rng.random() < 0.5:
        header["outputs"] = [{"name": "O", "parameters": {"binary_data": bool(rng.random() < 0.5)}}]
    if rng.random() < 0.3:
        header["parameters"] = {"priority": int(rng.integers(0, 3)), "k": "v"}
    body, length = binary_body(header, *chunks)
    corruption = rng.integers(0, 4)
    if corruption == 1 and len(body) > length:
        body = body[:-1]
    elif corruption == 2:
        body += b"\x07"
    elif corruption == 3 and len(body) > length:
        at = int(rng.integers(length, len(body)))
        body = body[:at] + bytes([int(rng.integers(2, 256))]) + body[at + 1 :]
    return body, length


def _outcome(codec: Codec, body: bytes, length: int) -> Any:
    try:
        return _fields(codec.decode_infer_request(body, length))
    except InvalidArgument as exc:
        return exc.message


def test_remembered_headers_answer_random_bodies_as_a_fresh_codec() -> None:
    rng = np.random.default_rng(11)
    warm = Codec()
    seen = []
    for _ in range(300):
        # Half the time a body whose header the warm codec has seen, with new data.
        body, length = seen[int(rng.integers(len(seen)))] if seen and rng.random() < 0.5 else _random_request(rng)
        if rng.random() < 0.5 and len(body) > length:
            data = bytearray(body)
            data[int(rng.integers(length, len(body)))] ^= 1
            body = bytes(data)
        seen.append((body, length))
        assert _outcome(warm, body, length) == _outcome(Codec(), body, length)
    assert len(warm._plans) > 10  # the warm codec did take the remembered path


# --------------------------------------------------------------------------- unrepresentable values


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("FP16", [1e6, 1], "input 'X': FP16 data element 0 (1000000.0) is outside the FP16 range "
                           "[-65504, 65504]"),
        ("FP16", [1, -65520], "input 'X': FP16 data element 1 (-65520) is outside"),
        ("FP16", [1, 100000], "input 'X': FP16 data element 1 (100000) is outside"),
        # Past float32 too, and past bfloat16 only (float32 holds it, rounding it overflows).
        ("BF16", [1e39, 1], "input 'X': BF16 data element 0 (1e+39) is outside the BF16 range "
                            "[-3.38953e+38, 3.38953e+38]"),
        ("BF16", [1, -3.4e38], "input 'X': BF16 data element 1 (-3.4e+38) is outside"),
        # Triton makes this FP32 an infinity; edged never changes a value silently.
        ("FP32", [1e300, 1], "input 'X': FP32 data element 0 (1e+300) is outside the FP32 range "
                             "[-3.40282e+38, 3.40282e+38]"),
    ],
)
def test_json_half_floats_past_their_range_are_refused(
    codec: Codec, datatype: str, data: list[Any], message: str
) -> None:
    """JSON FP16 and BF16 are edged's extension; a finite number must not become infinity."""
    body = json_body({"inputs": [{"name": "X", "shape": [2], "datatype": datatype, "data": data}]})
    assert decode_error(codec, body).startswith(message)


def test_json_half_floats_at_their_range_are_kept(codec: Codec) -> None:
    # 65519 rounds down to 65504, the largest FP16; 3.3895e38 rounds to the largest BF16.
    body = json_body({"inputs": [
        {"name": "H", "shape": [3], "datatype": "FP16", "data": [65504, -65519, 1]},
        {"name": "B", "shape": [2], "datatype": "BF16", "data": [3.3895e38, -3.3895e38]},
        {"name": "F", "shape": [2], "datatype": "FP32", "data": [3.4028234e38, -1e-50]},
        # Past the largest FP32 as a double, yet rounding down to it.
        {"name": "G", "shape": [2], "datatype": "FP32", "data": [-3.4028235e38, 1]},
    ]})
    inputs = codec.decode_infer_request(body, None).request.inputs
    assert inputs["H"].tolist() == [65504.0, -65504.0, 1.0]
    assert inputs["B"].tolist() == [0x7F7F, 0xFF7F]
    assert inputs["F"].dtype == np.float32 and inputs["F"][0] == np.float32(3.4028234e38)
    assert inputs["G"].tolist() == [-float(np.finfo(np.float32).max), 1.0]


def test_json_integers_past_64_bits_are_numbers_for_float_datatypes(codec: Codec) -> None:
    """numpy holds them as Python objects; Triton reads any JSON number as a double."""
    body = json_body({"inputs": [
        {"name": "F", "shape": [2], "datatype": "FP32", "data": [2**70, -1]},
        {"name": "D", "shape": [1, 2], "datatype": "FP64", "data": [[2**64, 3]]},
    ]})
    inputs = codec.decode_infer_request(body, None).request.inputs
    assert inputs["F"].dtype == np.float32 and inputs["F"].tolist() == [2.0**70, -1.0]
    assert inputs["D"].dtype == np.float64 and inputs["D"].tolist() == [[2.0**64, 3.0]]
    for datatype, data, message in [
        ("FP32", [1, 2**200], "input 'X': FP32 data element 1 (1.6069380442589903e+60) is outside the FP32 range"),
        ("FP64", [1, 10**400], "input 'X': FP64 data element 1 (an integer of 1329 bits) is outside the FP64 "
                               "range [-1.79769e+308, 1.79769e+308]"),
        ("FP32", [2**70, "a"], "input 'X': FP32 data must be JSON numbers"),
    ]:
        body = json_body({"inputs": [{"name": "X", "shape": [2], "datatype": datatype, "data": data}]})
        assert decode_error(codec, body).startswith(message), datatype


UINT64_MAX = 2**64 - 1


@pytest.mark.parametrize(
    ("parameters", "outputs", "message"),
    [
        ({"sequence_id": 2**64}, None,
         f"Unable to parse 'sequence_id': expected at most {UINT64_MAX} (uint64), got {2**64}"),
        ({"sequence_id": 10**400, "sequence_start": True}, None,
         f"Unable to parse 'sequence_id': expected at most {UINT64_MAX} (uint64), got an "
         "integer of 1329 bits"),
        ({"sequence_id": -(10**400)}, None,
         "Unable to parse 'sequence_id': expected a non-negative integer or a string, got an "
         "integer of 1329 bits"),
        ({"priority": 2**70}, None,
         f"Unable to parse 'priority': expected at most {UINT64_MAX} (uint64), got {2**70}"),
        ({"timeout": 2**70}, None,
         f"Unable to parse 'timeout': expected at most {UINT64_MAX} (uint64), got {2**70}"),
        (None, [{"name": "Y", "parameters": {"classification": 2**64}}],
         f"output 'Y': 'classification' expected at most {UINT64_MAX} (uint64), got {2**64}"),
    ],
    ids=["sequence_id", "sequence_id-huge", "sequence_id-huge-negative", "priority", "timeout",
         "classification"],
)
def test_uint64_fields_past_uint64_are_refused(
    codec: Codec, parameters: dict[str, Any] | None, outputs: list[Any] | None, message: str
) -> None:
    """Triton holds these as uint64 and refuses larger JSON integers."""
    header: dict[str, Any] = one_input(shape=[0], data=[])
    if parameters is not None:
        header["parameters"] = parameters
    if outputs is not None:
        header["outputs"] = outputs
    assert decode_error(codec, json_body(header)) == message


def test_uint64_fields_at_uint64_max_are_kept(codec: Codec) -> None:
    header = {
        **one_input(shape=[0], data=[]),
        "parameters": {"sequence_id": UINT64_MAX, "priority": UINT64_MAX, "timeout": UINT64_MAX},
        "outputs": [{"name": "Y", "parameters": {"classification": UINT64_MAX}}],
    }
    decoded = codec.decode_infer_request(json_body(header), None)
    request = decoded.request
    assert (request.correlation_id, request.priority, request.timeout_us) == (UINT64_MAX,) * 3
    assert decoded.classification == {"Y": UINT64_MAX}


@pytest.mark.parametrize(
    "value", ["1_0", "+10", "-1_0", "--1", "1 0", "\x0c10", "\u0661\u0660", "0x10", "", "-"]
)
def test_header_length_is_ascii_digits_only(value: str) -> None:
    """int() reads all of these (but "1 0", "0x10" and ""); none is what the client meant."""
    with pytest.raises(InvalidArgument) as info:
        parse_header_length(value)
    assert info.value.message == f"Unable to parse Inference-Header-Content-Length, got: {value}"


def test_header_length_around_http_whitespace() -> None:
    assert parse_header_length("\t10 ") == 10
    assert parse_header_length("0010") == 10
    # Negative: refused by the decoder with Triton's range error, which names the body's size.
    assert parse_header_length("-5") == -5


def _bf16_header(name: str = "INPUT0") -> tuple[bytes, int]:
    return binary_body(
        {"inputs": [{"name": name, "shape": [2], "datatype": "BF16",
                     "parameters": {"binary_data_size": 4}}]},
        b"\x80\x3f\x00\x40",
    )


def _one_input_config(model: str, datatype: str) -> ModelConfig:
    return ModelConfig(name=model, input=[TensorConfig(name="INPUT0", data_type=datatype, dims=[-1])])


def test_input_datatype_mismatch_names_the_datatype_sent(codec: Codec) -> None:
    """BF16 decodes to uint16: checked after decoding, it would be called UINT16."""
    body, length = _bf16_header()
    fp32 = _one_input_config("mlp", "FP32")
    assert decode_error(codec, body, length, config=fp32) == (
        "inference input 'INPUT0' data-type is 'BF16', but model 'mlp' expects 'FP32'"
    )
    # The same bytes as UINT16 would pass a check of the decoded array against a BF16 model.
    uint16 = body.replace(b'"BF16"', b'"UINT16"')
    assert decode_error(codec, uint16, length + 2, config=_one_input_config("b", "BF16")) == (
        "inference input 'INPUT0' data-type is 'UINT16', but model 'b' expects 'BF16'"
    )
    json_bf16 = json_body({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BF16", "data": [1]}]})
    assert "data-type is 'BF16'" in decode_error(codec, json_bf16, config=fp32)


def test_remembered_header_is_checked_against_each_model(codec: Codec) -> None:
    body, length = _bf16_header()
    decoded = codec.decode_infer_request(body, length, config=_one_input_config("b", "BF16"))
    assert decoded.request.inputs["INPUT0"].tolist() == [0x3F80, 0x4000]
    assert codec._plans  # the header is remembered: the next request takes the plan's path
    assert decode_error(codec, body, length, config=_one_input_config("mlp", "FP32")) == (
        "inference input 'INPUT0' data-type is 'BF16', but model 'mlp' expects 'FP32'"
    )



# --------------------------------------------------------------------------- JSON data, at random

_EDGE_INTS = [0, 1, -1, 127, 128, 255, 256, -129, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63),
              -(2**63) - 1, 2**70]
_EDGE_FLOATS = [0.5, -0.0, 1e300, -1e300, 65504.0, 65520.0, 3.4e38, 3.5e38, 1e-50]
_ALL_DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                  "FP16", "FP32", "FP64", "BF16", "BYTES"]


def _random_item(rng: random.Random, datatype: str, stray: float) -> Any:
    """An element of `datatype`'s kind (numbers at the edges of the datatypes), or with
    probability `stray` anything JSON holds."""
    if rng.random() < stray:
        return rng.choice([*_EDGE_INTS, *_EDGE_FLOATS, True, False, "a", "", None, {"a": 1}])
    if datatype == "BOOL":
        return rng.choice([True, False])
    if datatype == "BYTES":
        return rng.choice(["a", "", "é"])
    if datatype.startswith(("INT", "UINT")):
        return rng.choice([*_EDGE_INTS, rng.randint(-1000, 1000)])
    return rng.choice([*_EDGE_FLOATS, rng.uniform(-1e3, 1e3), rng.randint(-1000, 1000)])


def _random_data(rng: random.Random, datatype: str, stray: float, depth: int = 0) -> list[Any]:
    """A JSON array of such elements, nested raggedly, sometimes past the few numbers checked
    in Python."""
    out: list[Any] = []
    for _ in range(rng.randint(0 if depth else 1, 5)):
        if depth < 4 and rng.random() < 0.25:
            out.append(_random_data(rng, datatype, stray, depth + 1))
        else:
            out.append(_random_item(rng, datatype, stray))
    if rng.random() < 0.15:
        out.append([_random_item(rng, datatype, stray / 20) for _ in range(70)])
    return out


def _walk(data: Any) -> list[Any]:
    return [item for element in data for item in _walk(element)] if isinstance(data, list) else [data]


@pytest.mark.parametrize("seed", range(4))
def test_random_json_data_decodes_as_read_in_order_or_is_refused(seed: int) -> None:
    """Whatever `data` holds, the answer is a 400 or exactly the values in order, of the
    datatype's kind and range (found this way: a 500, and booleans read as 1, in ragged data)."""
    rng = random.Random(seed)
    codec = Codec()
    decoded = refused = 0
    for _ in range(1500):
        datatype = rng.choice(_ALL_DATATYPES)
        data = _random_data(rng, datatype, stray=rng.choice([0.0, 0.05, 0.5]))
        flat = _walk(data)
        body = {"inputs": [{"name": "X", "shape": [len(flat)], "datatype": datatype, "data": data}]}
        try:
            array = codec.decode_infer_request(json.dumps(body).encode(), None).request.inputs["X"]
        except InvalidArgument:
            refused += 1
            continue
        decoded += 1
        kinds = {type(item) for item in flat}
        if datatype == "BYTES":
            assert kinds <= {str} and array.tolist() == [item.encode() for item in flat], data
        elif datatype == "BOOL":
            assert kinds <= {bool} and array.tolist() == flat, data
        elif datatype in ("FP16", "FP32", "FP64"):
            assert kinds <= {int, float}, data
            expected = np.array([float(item) for item in flat]).astype(NUMPY_DTYPES[datatype])
            assert np.isfinite(array).all() and array.tolist() == expected.tolist(), data
        elif datatype != "BF16":
            assert kinds <= {int} and array.tolist() == flat, data
    assert decoded > 300 and refused > 300  # both kinds of documents were checked
