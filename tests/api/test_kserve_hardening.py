"""Hostile and unrepresentable KServe requests against a real daemon over its Unix socket
(issue 19 items 7, 9, 10; issue 10 item 6):

- per-tensor element and decoded-bytes caps, checked from the shape before allocating;
- a bounded fuzz corpus of malformed JSON and binary requests: each is a 400 naming the field,
  and the daemon keeps serving after each;
- NaN / +-Inf outputs: exact in binary; in JSON the literals Triton 2.51 writes (never `null`);
- a backend's load error names the backend once.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support import DaemonProcess, python_model, start_daemon_process

MAX_ELEMENTS = 1000
MAX_DECODED = 64 * 1024

BYTES_MODEL = """\
backend: "python"
input [{ name: "S" data_type: TYPE_STRING dims: [ -1 ] }]
output [{ name: "N" data_type: TYPE_INT64 dims: [ 1 ] }]
"""
BYTES_CODE = """\
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            s = pb_utils.get_input_tensor_by_name(r, 'S').as_numpy()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor('N', np.array([s.size], dtype=np.int64))]))
        return out
"""
NONFINITE_MODEL = """\
backend: "python"
input [{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }]
output [
  { name: "F16" data_type: TYPE_FP16 dims: [ 4 ] },
  { name: "F32" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "F64" data_type: TYPE_FP64 dims: [ 4 ] },
  { name: "FINITE" data_type: TYPE_FP32 dims: [ 4 ] }
]
"""
NONFINITE_CODE = """\
import numpy as np
import triton_python_backend_utils as pb_utils

VALUES = [float('nan'), float('inf'), -float('inf'), 1.5]

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor('F16', np.array(VALUES, dtype=np.float16)),
            pb_utils.Tensor('F32', np.array(VALUES, dtype=np.float32)),
            pb_utils.Tensor('F64', np.array(VALUES, dtype=np.float64)),
            pb_utils.Tensor('FINITE', np.array([0.5, 1.0, -2.0, 3.25], dtype=np.float32)),
        ]) for _ in requests]
"""
# FP16 and BF16 X[-1] -> Y[-1], unchanged.
HALF_MODEL = """\
backend: "python"
input [{{ name: "X" data_type: TYPE_{0} dims: [ -1 ] }}]
output [{{ name: "Y" data_type: TYPE_{0} dims: [ -1 ] }}]
"""
IDENTITY_CODE = """\
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            'Y', pb_utils.get_input_tensor_by_name(r, 'X').as_numpy())]) for r in requests]
"""
BROKEN_CODE = """\
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("no weights here")

    def execute(self, requests):
        return []
"""


def _write_model(repo: Path, name: str, config: str, code: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(code)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    repo = tmp_path_factory.mktemp("repo")
    python_model(repo, "ident", "y = x")
    _write_model(repo, "strings", BYTES_MODEL, BYTES_CODE)
    _write_model(repo, "nonfinite", NONFINITE_MODEL, NONFINITE_CODE)
    # generate answers FP16 outputs with an error: a model with the FP32 one only.
    python_model(repo, "nonfinite32", "y = [float('nan'), float('inf'), -float('inf'), 1.5]")
    _write_model(repo, "half", HALF_MODEL.format("FP16"), IDENTITY_CODE)
    _write_model(repo, "bhalf", HALF_MODEL.format("BF16"), IDENTITY_CODE)
    _write_model(repo, "broken", 'backend: "python"\n' + NONFINITE_MODEL.split("\n", 1)[1],
                 BROKEN_CODE)
    base = tmp_path_factory.mktemp("edged")
    config = base / "edged.toml"
    config.write_text(
        f"[server]\nmax-tensor-elements = {MAX_ELEMENTS}\nmax-decoded-bytes = {MAX_DECODED}\n"
    )
    process = start_daemon_process(
        base, "--config", str(config), "--model-repository", str(repo),
        "--model-control-mode", "explicit", "--load-model", "ident",
        "--load-model", "strings", "--load-model", "nonfinite",
        "--load-model", "nonfinite32", "--load-model", "half", "--load-model", "bhalf",
        http=True,
    )
    yield process
    process.stop()


def _infer(daemon: DaemonProcess, model: str, body: bytes | str, header_length: int | None = None):
    headers = {"Content-Type": "application/octet-stream"}
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = str(header_length)
    return daemon.request("POST", f"/v2/models/{model}/infer", body, headers)


def _binary(header: dict[str, Any], raw: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + raw, len(head)


def _assert_serving(daemon: DaemonProcess) -> None:
    reply = daemon.post_json(
        "/v2/models/ident/infer",
        {"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [1, 2]}]},
    )
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"][0]["data"] == [1.0, 2.0]


# --------------------------------------------------------------------------- limits (item 7)


def test_bytes_elements_over_the_cap_are_refused_before_decoding(daemon: DaemonProcess) -> None:
    count = MAX_ELEMENTS + 1
    body, length = _binary(
        {"inputs": [{"name": "S", "shape": [count], "datatype": "BYTES",
                     "parameters": {"binary_data_size": 4 * count}}]},
        b"\0\0\0\0" * count,
    )
    reply = _infer(daemon, "strings", body, length)
    assert reply.status == 400
    assert reply.json()["error"] == (
        f"input 'S': shape [{count}] has {count} elements, more than the {MAX_ELEMENTS} "
        "allowed per tensor (server max-tensor-elements)"
    )
    _assert_serving(daemon)


def test_decoded_bytes_over_the_cap_are_refused(daemon: DaemonProcess) -> None:
    # 1000 elements (allowed) of 30 bytes: 1000 * 48 + 34000 binary bytes > 64 KiB.
    count, item = MAX_ELEMENTS, b"x" * 30
    raw = b"".join(struct.pack("<I", len(item)) + item for _ in range(count))
    body, length = _binary(
        {"inputs": [{"name": "S", "shape": [count], "datatype": "BYTES",
                     "parameters": {"binary_data_size": len(raw)}}]},
        raw,
    )
    reply = _infer(daemon, "strings", body, length)
    assert reply.status == 400
    error = reply.json()["error"]
    assert error.startswith("input 'S': decoding the request's inputs would take 82000 bytes")
    assert "max-decoded-bytes" in error
    # Under both caps the same tensor works.
    small = b"".join(struct.pack("<I", 1) + b"y" for _ in range(count))
    body, length = _binary(
        {"inputs": [{"name": "S", "shape": [count], "datatype": "BYTES",
                     "parameters": {"binary_data_size": len(small)}}]},
        small,
    )
    reply = _infer(daemon, "strings", body, length)
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"][0]["data"] == [count]


def test_json_data_longer_than_the_shape_is_refused(daemon: DaemonProcess) -> None:
    reply = daemon.post_json(
        "/v2/models/strings/infer",
        {"inputs": [{"name": "S", "shape": [2], "datatype": "BYTES", "data": [""] * 5000}]},
    )
    assert reply.status == 400
    assert reply.json()["error"] == (
        "input 'S': expected 2 elements for shape [2], got at least 5000"
    )


# --------------------------------------------------------------------------- fuzz (item 9)


def _json_case(inputs: Any) -> tuple[str, bytes, int | None]:
    return "ident", json.dumps({"inputs": inputs}).encode(), None


def _fp32(**fields: Any) -> dict[str, Any]:
    return {"name": "X", "shape": [2], "datatype": "FP32", "data": [1, 2], **fields}


# (id, model, body, Inference-Header-Content-Length, a fragment the 400 must contain)
CORPUS: list[tuple[str, str, bytes, int | None, str]] = [
    ("data-does-not-reshape", *_json_case([_fp32(shape=[3])]), "expected 3 elements"),
    ("ragged-nesting-wrong-count", *_json_case([_fp32(data=[[1, 2], [3]])]), "'X'"),
    ("ragged-nesting-mixed", *_json_case([_fp32(data=[1, [2, [3]]])]), "'X'"),
    ("string-in-fp32", *_json_case([_fp32(data=[1, "a"])]), "FP32 data must be JSON numbers"),
    ("null-in-fp32", *_json_case([_fp32(data=[1, None])]), "FP32 data must be JSON numbers"),
    ("object-in-fp32", *_json_case([_fp32(data=[{"a": 1}, 2])]), "'X'"),
    ("object-as-data", *_json_case([_fp32(data={"a": 1})]), "'X'"),
    ("bool-in-fp32", *_json_case([_fp32(data=[True, 1.0])]), "'X'"),
    ("string-as-data", *_json_case([_fp32(data="12")]), "'X'"),
    ("huge-int-in-fp32", *_json_case([_fp32(data=[2**200, 1])]), "'X'"),  # past FP32; 2**80 is a number
    ("rank-65", *_json_case([_fp32(shape=[1] * 65, data=[1])]), "65 dimensions"),
    ("rank-64-wrong-for-model", *_json_case([_fp32(shape=[1] * 64, data=[1])]), "'X'"),
    ("negative-dim", *_json_case([_fp32(shape=[-2])]), "negative dimension"),
    ("huge-dims", *_json_case([_fp32(shape=[2**31, 2**31])]), "max-tensor-elements"),
    ("product-overflows-int64", *_json_case([_fp32(shape=[2**62, 2**62, 4])]),
     "max-tensor-elements"),
    ("dim-beyond-uint64", *_json_case([_fp32(shape=[2**70])]), "shape"),
    ("float-dim", *_json_case([_fp32(shape=[2.5])]), "shape"),
    ("unknown-datatype", *_json_case([_fp32(datatype="FP8")]), "unknown datatype 'FP8'"),
    ("bytes-int-element", "strings", json.dumps({"inputs": [
        {"name": "S", "shape": [2], "datatype": "BYTES", "data": ["a", 1]}]}).encode(), None,
     "BYTES element 1 must be a JSON string"),
    ("not-json", "ident", b"{\"inputs\": [", None, "malformed JSON"),
    ("binary-size-mismatch", "ident", *_binary(
        {"inputs": [{"name": "X", "shape": [2], "datatype": "FP32",
                     "parameters": {"binary_data_size": 4}}]}, b"\0" * 4),
     "binary_data_size 4 does not match shape [2]"),
    ("binary-size-past-body", "ident", *_binary(
        {"inputs": [{"name": "X", "shape": [2], "datatype": "FP32",
                     "parameters": {"binary_data_size": 80}}]}, b"\0" * 8),
     "exceeds the 8 bytes left"),
    ("binary-size-negative", "ident", *_binary(
        {"inputs": [{"name": "X", "shape": [2], "datatype": "FP32",
                     "parameters": {"binary_data_size": -8}}]}, b"\0" * 8),
     "binary_data_size must be a non-negative integer"),
    ("binary-huge-dims", "ident", *_binary(
        {"inputs": [{"name": "X", "shape": [2**40], "datatype": "FP32",
                     "parameters": {"binary_data_size": 8}}]}, b"\0" * 8),
     "max-tensor-elements"),
    ("binary-bytes-truncated-prefix", "strings", *_binary(
        {"inputs": [{"name": "S", "shape": [1], "datatype": "BYTES",
                     "parameters": {"binary_data_size": 2}}]}, b"\1\0"),
     "truncated length prefix"),
    ("binary-bytes-length-past-end", "strings", *_binary(
        {"inputs": [{"name": "S", "shape": [1], "datatype": "BYTES",
                     "parameters": {"binary_data_size": 5}}]}, b"\xff\xff\xff\xffa"),
     "exceeds remaining"),
    ("binary-bytes-count-mismatch", "strings", *_binary(
        {"inputs": [{"name": "S", "shape": [3], "datatype": "BYTES",
                     "parameters": {"binary_data_size": 4}}]}, b"\0\0\0\0"),
     "expected 3 BYTES elements, got 1"),
    ("header-length-past-body", "ident", b"{}", 100, "inference header size"),
    ("trailing-bytes", "ident", *_binary(
        {"inputs": [_fp32()]}, b"junk"), "not claimed by any input"),
    ("raw-body-wrong-size", "ident", b"\0\0\0", 0, "raw input 'X'"),
]


@pytest.mark.parametrize(
    ("model", "body", "header_length", "fragment"),
    [case[1:] for case in CORPUS],
    ids=[case[0] for case in CORPUS],
)
def test_malformed_request_is_a_400_naming_the_field(
    daemon: DaemonProcess, model: str, body: bytes, header_length: int | None, fragment: str
) -> None:
    reply = _infer(daemon, model, body, header_length)
    assert reply.status == 400, reply.body
    assert fragment in reply.json()["error"]
    assert daemon.alive()
    _assert_serving(daemon)


def test_header_length_that_is_not_a_number(daemon: DaemonProcess) -> None:
    reply = daemon.request("POST", "/v2/models/ident/infer", b"{}",
                           {"Inference-Header-Content-Length": "ten"})
    assert reply.status == 400
    assert reply.json()["error"] == "Unable to parse Inference-Header-Content-Length, got: ten"
    _assert_serving(daemon)


@pytest.mark.parametrize("value", ["1_0", "+10"])
def test_header_length_with_more_than_digits(daemon: DaemonProcess, value: str) -> None:
    """int() reads "1_0" as 10: the header must be plain digits."""
    head = json.dumps({"inputs": [_fp32()]}).encode()
    body = head.ljust(10) if value == "1_0" else head
    reply = daemon.request("POST", "/v2/models/ident/infer", body,
                           {"Inference-Header-Content-Length": value})
    assert reply.status == 400, reply.body
    assert reply.json()["error"] == f"Unable to parse Inference-Header-Content-Length, got: {value}"
    _assert_serving(daemon)


# --------------------------------------------------------------------------- unrepresentable values


@pytest.mark.parametrize(
    ("model", "datatype", "data", "largest"),
    [("half", "FP16", [1e6, 1], "65504"), ("bhalf", "BF16", [-1e39, 1], "3.38953e+38")],
)
def test_json_half_float_past_its_range_is_a_400(
    daemon: DaemonProcess, model: str, datatype: str, data: list[float], largest: str
) -> None:
    """edged takes FP16 and BF16 as JSON (Triton does not), but never makes a number infinite."""
    tensor = {"name": "X", "shape": [2], "datatype": datatype, "data": data}
    reply = daemon.post_json(f"/v2/models/{model}/infer", {"inputs": [tensor]})
    assert reply.status == 400, reply.body
    assert reply.json()["error"] == (
        f"input 'X': {datatype} data element 0 ({data[0]!r}) is outside the {datatype} range "
        f"[-{largest}, {largest}]"
    )
    # In range, the same request is served.
    reply = daemon.post_json(f"/v2/models/{model}/infer", {"inputs": [{**tensor, "data": [2, 1]}]})
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"][0]["data"] == [2.0, 1.0]


def test_binary_bf16_to_an_fp32_model_names_bf16(daemon: DaemonProcess) -> None:
    body, length = _binary(
        {"inputs": [{"name": "X", "shape": [2], "datatype": "BF16",
                     "parameters": {"binary_data_size": 4}}]},
        b"\x80\x3f\x00\x40",
    )
    # First to the BF16 model, so that the header is remembered: then to the FP32 one.
    reply = _infer(daemon, "bhalf", body, length)
    assert reply.status == 200, reply.body
    for _ in range(2):
        reply = _infer(daemon, "ident", body, length)
        assert reply.status == 400, reply.body
        assert reply.json()["error"] == (
            "inference input 'X' data-type is 'BF16', but model 'ident' expects 'FP32'"
        )
    _assert_serving(daemon)


@pytest.mark.parametrize(
    ("parameters", "outputs", "field"),
    [
        ({"sequence_id": 10**400, "sequence_start": True}, None, "Unable to parse 'sequence_id'"),
        ({"sequence_id": 2**64, "sequence_start": True}, None, "Unable to parse 'sequence_id'"),
        ({"priority": 2**70}, None, "Unable to parse 'priority'"),
        ({"timeout": 2**70}, None, "Unable to parse 'timeout'"),
        ({}, [{"name": "Y", "parameters": {"classification": 2**64}}],
         "output 'Y': 'classification'"),
    ],
    ids=["sequence_id-huge", "sequence_id", "priority", "timeout", "classification"],
)
def test_uint64_field_past_uint64_is_a_400(
    daemon: DaemonProcess, parameters: dict[str, Any], outputs: list[Any] | None, field: str
) -> None:
    """Triton holds these as uint64; a larger integer is refused, not carried along."""
    request: dict[str, Any] = {"inputs": [_fp32()], "parameters": parameters}
    if outputs is not None:
        request["outputs"] = outputs
    reply = daemon.post_json("/v2/models/ident/infer", request)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error.startswith(field) and "expected at most 18446744073709551615 (uint64)" in error
    # uint64's largest is accepted.
    for key in parameters:
        if key != "sequence_start":
            parameters[key] = 2**64 - 1
    for output in outputs or ():
        output["parameters"]["classification"] = 2**64 - 1
    reply = daemon.post_json("/v2/models/ident/infer", request)
    assert reply.status == 200, reply.body
    _assert_serving(daemon)


# --------------------------------------------------------------------------- NaN / Inf (item 10)


def _nonfinite(daemon: DaemonProcess, outputs: list[dict[str, Any]]) -> Any:
    return daemon.post_json("/v2/models/nonfinite/infer", {
        "inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [0]}],
        "outputs": outputs,
    })


@pytest.mark.parametrize(("name", "dtype"), [("F16", "<f2"), ("F32", "<f4"), ("F64", "<f8")])
def test_nonfinite_outputs_travel_exactly_in_binary(
    daemon: DaemonProcess, name: str, dtype: str
) -> None:
    reply = _nonfinite(daemon, [{"name": name, "parameters": {"binary_data": True}}])
    assert reply.status == 200, reply.body
    length = int(reply.headers["inference-header-content-length"])
    values = np.frombuffer(reply.body[length:], dtype=dtype)
    assert np.isnan(values[0])
    assert values[1:].tolist() == [float("inf"), -float("inf"), 1.5]


@pytest.mark.parametrize(("name", "datatype"), [("F16", "FP16"), ("F32", "FP32"), ("F64", "FP64")])
def test_nonfinite_outputs_in_json_are_written_as_triton_writes_them(
    daemon: DaemonProcess, name: str, datatype: str
) -> None:
    reply = _nonfinite(daemon, [{"name": name}])
    assert reply.status == 200, reply.body
    # Byte for byte what Triton 2.51 answers for FP32/FP64 (checked against the oracle in
    # tests/compat): the literals NaN, Infinity, -Infinity, never null.
    assert reply.body == (
        b'{"model_name":"nonfinite","model_version":"1","outputs":[{"name":"' + name.encode()
        + b'","datatype":"' + datatype.encode() + b'","shape":[4],'
        b'"data":[NaN,Infinity,-Infinity,1.5]}]}'
    )
    values = json.loads(reply.body)["outputs"][0]["data"]  # Python's json reads them back
    assert np.isnan(values[0]) and values[1:] == [float("inf"), -float("inf"), 1.5]


@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_reads_nonfinite_outputs(daemon: DaemonProcess, binary: bool) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
    try:
        x = httpclient.InferInput("X", [1], "FP32")
        x.set_data_from_numpy(np.zeros(1, dtype=np.float32), binary_data=binary)
        outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("F32", "F64")]
        result = client.infer("nonfinite", [x], outputs=outputs)
        for name in ("F32", "F64"):
            got = result.as_numpy(name)
            assert got is not None
            assert np.isnan(got[0]) and got[1:].tolist() == [float("inf"), -float("inf"), 1.5]
    finally:
        client.close()


def test_generate_writes_nonfinite_outputs_as_literals(daemon: DaemonProcess) -> None:
    reply = daemon.post_json("/v2/models/nonfinite32/generate", {"X": [0]})
    assert reply.status == 200, reply.body
    assert reply.body == (
        b'{"Y":[NaN,Infinity,-Infinity,1.5],"model_name":"nonfinite32","model_version":"1"}'
    )


def test_finite_float_outputs_still_travel_in_json(daemon: DaemonProcess) -> None:
    reply = _nonfinite(daemon, [{"name": "FINITE"}])
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"][0]["data"] == [0.5, 1.0, -2.0, 3.25]


# --------------------------------------------------------------------------- load errors


def test_load_error_names_the_backend_once(daemon: DaemonProcess) -> None:
    reply = daemon.request("POST", "/v2/repository/models/broken/load")
    assert reply.status >= 400
    error = reply.json()["error"]
    assert "no weights here" in error
    assert "python: model 'broken'" in error
    assert "python: python:" not in error
    _assert_serving(daemon)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_body_that_does_not_decompress_is_a_400(daemon: DaemonProcess, encoding: str) -> None:
    # aiohttp raises RequestPayloadError while reading such a body.
    reply = daemon.request("POST", "/v2/models/ident/infer", b"\x1f\x8b\x08\x00garbage",
                           {"Content-Encoding": encoding, "Content-Type": "application/json"})
    assert reply.status == 400, reply.body
    assert "error" in reply.json()
    _assert_serving(daemon)
