"""The requests sent unchanged to tritonserver and to edged.

Each case says how far the two answers must agree: always the status; for errors the body's
shape (`{"error": str}`) and the phrases a client or Triton's own tests match on (`needles`,
which must appear in both texts); for successes the header semantics and every tensor.
A case with `deviation` documents a deliberate difference (docs/compatibility.md): there the
test asserts edged's own status instead of Triton's.
"""

from __future__ import annotations

import base64
import gzip
import json
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from compat.models import IDENTITY

JSON = {"Content-Type": "application/json"}

# Deliberate differences, each explained in docs/compatibility.md.
BAD_INPUT_500 = (400, "Triton 2.51 answers 500 to this malformed request; bad input is a 400 here")
NESTING = (400, "Triton >= 2.58 rejects data nested 100 deep (400); 2.51 accepts any depth")
NO_WRAP = (400, "Triton wraps out-of-range integers silently; edged refuses to change a value")
NO_FFFD = (400, "Triton 2.51 writes non-UTF-8 bytes into JSON (invalid JSON); edged says to use binary")
NOT_IGNORED = (400, "Triton ignores this parameter; edged never accepts and ignores one")
UNKNOWN_404 = (404, "Triton answers 500 for a model the repository does not have; edged 404")
ONE_RESPONSE = (200, "edged answers a decoupled model's single response on HTTP infer; Triton refuses any (501)")
ERROR_STATUS = (500, "Triton 2.51 sends this error of generate with status 200; edged with an error status")
TYPED_ID = (400, "Triton 2.51 takes a string sequence_id for a UINT64 CORRID control; edged names the mismatch")
DECODED = (200, "edged decodes percent-escapes in the path (tritonclient quotes names); Triton 2.51 does not")
HEAD_OK = (200, "edged answers HEAD wherever GET is served (RFC 9110); Triton 2.51 answers 405")
CODING_NAMES = (200, "edged reads content codings as RFC 9110 names them (any case, raw deflate); Triton 2.51 refuses")
FRAMING = (400, "a body framed two ways, or by a Transfer-Encoding other than chunked, is refused (RFC 9112); Triton 2.51 reads it")
ENSEMBLE_CONFIG = (400, "Triton 2.51 answers 500 'failed to poll from model repository' to an ensemble config it refuses; edged 400 with the reason")
WIDE_COUNT = (200, "Triton 2.51 reads a classification count as 32 bits (2**40 is 0: no classes); edged gives them all")
HEALTH_BODY = (200, "edged's health answers carry the Open Inference Protocol's JSON (KServe's client reads it); Triton's are empty")


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # Phrases both error texts must contain (case-sensitive).
    needles: tuple[str, ...] = ()
    # Compare only these top-level keys of a JSON success body (None: the infer comparison).
    keys: tuple[str, ...] | None = None
    # A deliberate difference: (edged's status, why). Documented in docs/compatibility.md.
    deviation: tuple[int, str] | None = None
    # A repository index compared row by row: name, version and a settled state (Triton
    # unloads in the background), not the reason texts, without these models.
    index_without: tuple[str, ...] | None = None
    # The body is sent with `Transfer-Encoding: chunked` (no Content-Length).
    chunked: bool = False


def _body(payload: object) -> bytes:
    return json.dumps(payload).encode()


def _tensor(name: str, datatype: str, shape: list[int], data: object) -> dict[str, object]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def _add_sub(a: object = (1, 2, 3, 4), b: object = (10, 20, 30, 40), shape: tuple[int, ...] = (1, 4),
             **extra: object) -> dict[str, object]:
    return {"inputs": [_tensor("INPUT0", "INT32", list(shape), list(a)),
                       _tensor("INPUT1", "INT32", list(shape), list(b))], **extra}


def _binary(header: dict[str, object], *chunks: bytes, extra: dict[str, str] | None = None) -> tuple[bytes, dict[str, str]]:
    head = _body(header)
    return head + b"".join(chunks), {"Inference-Header-Content-Length": str(len(head)),
                                     "Content-Type": "application/octet-stream", **(extra or {})}


def _bytes_elements(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


def _nested_body(depth: int) -> bytes:
    """add_sub's request with INPUT0's data nested `depth` arrays deep (built as text:
    json.dumps itself recurses)."""
    template = _body({"inputs": [_tensor("INPUT0", "INT32", [1, 4], "@"),
                                 _tensor("INPUT1", "INT32", [1, 4], [1, 1, 1, 1])]})
    data = "[" * (depth - 1) + "[1, 2, 3, 4]" + "]" * (depth - 1)
    return template.replace(b'"@"', data.encode())


def cases() -> list[Case]:
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=np.int32)
    b = np.array([[1, 1, 1, 1], [2, 2, 2, 2]], dtype=np.int32)
    bin_inputs = [
        {"name": "INPUT0", "datatype": "INT32", "shape": [2, 4], "parameters": {"binary_data_size": a.nbytes}},
        {"name": "INPUT1", "datatype": "INT32", "shape": [2, 4], "parameters": {"binary_data_size": b.nbytes}},
    ]
    infer = "/v2/models/add_sub/infer"
    out: list[Case] = []

    def post(id_: str, payload: object, path: str = infer, **kw: object) -> None:
        out.append(Case(id_, "POST", path, _body(payload), dict(JSON), **kw))  # type: ignore[arg-type]

    def post_bin(id_: str, header: dict[str, object], *chunks: bytes, path: str = infer, **kw: object) -> None:
        body, headers = _binary(header, *chunks)
        out.append(Case(id_, "POST", path, body, headers, **kw))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ valid inference
    post("json-flat", _add_sub(id="r1"))
    post("json-nested", {"inputs": [_tensor("INPUT0", "INT32", [2, 4], a.tolist()),
                                    _tensor("INPUT1", "INT32", [2, 4], b.tolist())]})
    # The document's own object and array levels count too: data at depth 97 is 100 levels.
    out.append(Case("json-nested-100", "POST", infer, _nested_body(97), dict(JSON)))
    post("json-output-subset", _add_sub(outputs=[{"name": "OUTPUT1"}]))
    post("json-binary-data-output", _add_sub(parameters={"binary_data_output": True}))
    post("json-bdo-true-output-false", _add_sub(
        parameters={"binary_data_output": True},
        outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": False}}, {"name": "OUTPUT1"}]))
    post("json-bdo-false-output-true", _add_sub(
        parameters={"binary_data_output": False},
        outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}]))
    post("json-bdo-true-outputs-listed-no-flag", _add_sub(
        parameters={"binary_data_output": True}, outputs=[{"name": "OUTPUT0"}]))
    post("json-custom-parameters", _add_sub(parameters={"my_string": "x", "my_int": 3, "my_bool": True}))
    post("json-id-echo", _add_sub(id="request-42"))
    post("json-model-name-in-body", _add_sub(model_name="add_sub"))
    post("json-priority-timeout", _add_sub(parameters={"priority": 0, "timeout": 100000000}))
    post("json-versioned-path", _add_sub(), path="/v2/models/add_sub/versions/1/infer")
    post_bin("binary-inputs-json-outputs", {"inputs": bin_inputs}, a.tobytes(), b.tobytes())
    post_bin("binary-inputs-binary-outputs", {"inputs": bin_inputs, "parameters": {"binary_data_output": True}},
             a.tobytes(), b.tobytes())
    post_bin("binary-output-flag", {"inputs": bin_inputs, "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]},
             a.tobytes(), b.tobytes())
    gz = gzip.compress(_body(_add_sub()))
    out.append(Case("gzip-body", "POST", infer, gz, {**JSON, "Content-Encoding": "gzip"}))
    fp = np.array([1.5, -2.25, 3.0], dtype=np.float32)
    out.append(Case("raw-body-header-0", "POST", "/v2/models/identity_fp32/infer", fp.tobytes(),
                    {"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"}))
    post("fp32-json", {"inputs": [_tensor("INPUT0", "FP32", [3], fp.tolist())]}, path="/v2/models/identity_fp32/infer")
    post("fp32-json-ints", {"inputs": [_tensor("INPUT0", "FP32", [2], [1, 2])]}, path="/v2/models/identity_fp32/infer")
    post("bytes-json", {"inputs": [_tensor("INPUT0", "BYTES", [2], ["héllo", ""])]}, path="/v2/models/identity_bytes/infer")
    raw = _bytes_elements(b"ok", b"\xff\xfe\x00")
    bytes_bin = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": len(raw)}}]}
    post_bin("bytes-non-utf8-binary-out", {**bytes_bin, "parameters": {"binary_data_output": True}}, raw,
             path="/v2/models/identity_bytes/infer")
    post_bin("bytes-non-utf8-json-out", bytes_bin, raw, path="/v2/models/identity_bytes/infer",
             needles=("OUTPUT0", "binary_data"), deviation=NO_FFFD)
    # Ragged nesting that begins with a number (Triton walks the elements in order).
    post("json-ragged-leading-number-int32", {"inputs": [_tensor("INPUT0", "INT32", [5], [1, [2, 3], [[4]], 5])]},
         path="/v2/models/identity_int32/infer")
    post("json-ragged-leading-number-fp32", {"inputs": [_tensor("INPUT0", "FP32", [3], [1.5, [-2.25, [3.0]]])]},
         path="/v2/models/identity_fp32/infer")
    post("json-ragged-many-int32", {"inputs": [_tensor("INPUT0", "INT32", [81], [1, [2] * 40, [3] * 40])]},
         path="/v2/models/identity_int32/infer")
    post("json-ragged-hidden-bool-int32",
         {"inputs": [_tensor("INPUT0", "INT32", [81], [1, [2] * 40, [True] + [3] * 39])]},
         path="/v2/models/identity_int32/infer", needles=("data",), deviation=BAD_INPUT_500)
    post("mixed-json", {"inputs": [_tensor("INPUT0", "INT32", [1, 2], [1, -2]),
                                   _tensor("INPUT1", "FP32", [1, 2], [0.5, 1e30]),
                                   _tensor("INPUT2", "BYTES", [1, 1], ["z"])]},
         path="/v2/models/identity_mixed/infer")

    # ------------------------------------------------------------------ malformed inference
    out.append(Case("json-syntax", "POST", infer, b'{"inputs": [', dict(JSON), deviation=BAD_INPUT_500))
    out.append(Case("json-empty-body", "POST", infer, b"", dict(JSON)))
    out.append(Case("json-nested-101", "POST", infer, _nested_body(101), dict(JSON), deviation=NESTING))
    out.append(Case("json-nested-120", "POST", infer, _nested_body(120), dict(JSON), deviation=NESTING))
    out.append(Case("json-nested-1500", "POST", infer, _nested_body(1500), dict(JSON), deviation=NESTING))
    post("missing-inputs-field", {"id": "x"}, deviation=BAD_INPUT_500)
    post("inputs-not-array", {"inputs": {}}, deviation=BAD_INPUT_500)
    post("missing-one-input", {"inputs": [_tensor("INPUT0", "INT32", [1, 4], [1, 2, 3, 4])]},
         needles=("INPUT1",))
    post("unknown-input", {"inputs": [*_add_sub()["inputs"], _tensor("INPUTX", "INT32", [1, 4], [1, 2, 3, 4])]},  # type: ignore[list-item]
         needles=("INPUTX",))
    post("duplicate-input", {"inputs": [*_add_sub()["inputs"], _tensor("INPUT0", "INT32", [1, 4], [1, 2, 3, 4])]},  # type: ignore[list-item]
         needles=("INPUT0",))
    post("unknown-datatype", {"inputs": [_tensor("INPUT0", "INT33", [1, 4], [1, 2, 3, 4]),
                                         _tensor("INPUT1", "INT32", [1, 4], [1, 2, 3, 4])]})
    post("wrong-datatype", {"inputs": [_tensor("INPUT0", "FP32", [1, 4], [1, 2, 3, 4]),
                                       _tensor("INPUT1", "INT32", [1, 4], [1, 2, 3, 4])]},
         needles=("INPUT0", "data-type is 'FP32', but model 'add_sub' expects 'INT32'"))
    post("shape-mismatch", _add_sub(a=(1, 2, 3), b=(1, 2, 3), shape=(1, 3)),
         needles=("unexpected shape for input", "for model 'add_sub'. Expected [-1,4], got [1,3]"))
    post("count-mismatch", _add_sub(a=(1, 2, 3), shape=(1, 4)), deviation=BAD_INPUT_500)
    post("batch-too-large", _add_sub(a=[1] * 36, b=[1] * 36, shape=(9, 4)),
         needles=("inference request batch-size must be <= 8 for 'add_sub'",))
    post("negative-shape", _add_sub(shape=(-1, 4)), deviation=BAD_INPUT_500)
    post("float-for-int", _add_sub(a=(1.5, 2, 3, 4)), deviation=BAD_INPUT_500)
    post("string-for-int", _add_sub(a=("1", 2, 3, 4)), deviation=BAD_INPUT_500)
    post("int32-overflow", _add_sub(a=(2**31, 2, 3, 4)), deviation=NO_WRAP)
    post("bytes-data-number", {"inputs": [_tensor("INPUT0", "BYTES", [1], [5])]}, path="/v2/models/identity_bytes/infer", deviation=BAD_INPUT_500)
    post("data-and-binary-size", {"inputs": [{**_tensor("INPUT0", "FP32", [1], [1.0]), "parameters": {"binary_data_size": 4}}]},
         path="/v2/models/identity_fp32/infer")
    post("no-data", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1]}]}, path="/v2/models/identity_fp32/infer")
    post("duplicate-output", _add_sub(outputs=[{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]), needles=("OUTPUT0",))
    post("unknown-output", _add_sub(outputs=[{"name": "OUTPUTX"}]), needles=("OUTPUTX",))
    post("output-binary-data-not-bool", _add_sub(outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": "yes"}}]),
         needles=("binary_data",), deviation=BAD_INPUT_500)
    # Reserved request parameters.
    post("param-sequence-id-non-sequence", _add_sub(parameters={"sequence_id": 7}))
    post("param-sequence-id-string", _add_sub(parameters={"sequence_id": "abc"}))
    post("param-sequence-id-float", _add_sub(parameters={"sequence_id": 1.5}), needles=("sequence_id",), deviation=BAD_INPUT_500)
    post("param-sequence-start-not-bool", _add_sub(parameters={"sequence_start": 1}), needles=("sequence_start",), deviation=BAD_INPUT_500)
    post("param-sequence-end-false", _add_sub(parameters={"sequence_end": False}))
    post("param-priority-string", _add_sub(parameters={"priority": "high"}), needles=("priority",), deviation=BAD_INPUT_500)
    post("param-priority-negative", _add_sub(parameters={"priority": -1}), needles=("priority",), deviation=BAD_INPUT_500)
    post("param-timeout-string", _add_sub(parameters={"timeout": "1s"}), needles=("timeout",), deviation=BAD_INPUT_500)
    post("param-bdo-not-bool", _add_sub(parameters={"binary_data_output": 1}), needles=("binary_data_output",), deviation=BAD_INPUT_500)
    post("param-triton-prefix", _add_sub(parameters={"triton_enable_empty_final_response": True}),
         needles=("triton_",))
    post("param-array-value", _add_sub(parameters={"mine": [1, 2]}), needles=("mine",))
    post("param-null-value", _add_sub(parameters={"mine": None}), needles=("mine",))
    post("param-headers", _add_sub(parameters={"headers": {"a": "b"}}))
    post("parameters-not-object", _add_sub(parameters=[1]), deviation=BAD_INPUT_500)
    # Binary framing.
    post_bin("binary-size-beyond-body", {"inputs": [bin_inputs[0], {**bin_inputs[1], "parameters": {"binary_data_size": 64}}]},
             a.tobytes(), b.tobytes())
    post_bin("binary-extra-bytes", {"inputs": bin_inputs}, a.tobytes(), b.tobytes(), b"xx")
    post_bin("binary-size-wrong-for-shape", {"inputs": [{**bin_inputs[0], "parameters": {"binary_data_size": 28}},
                                                         {**bin_inputs[1], "parameters": {"binary_data_size": 36}}]},
             a.tobytes(), b.tobytes())
    head = _body({"inputs": bin_inputs})
    out.append(Case("header-length-too-big", "POST", infer, head + a.tobytes() + b.tobytes(),
                    {"Inference-Header-Content-Length": str(len(head) + 1000)}))
    bin_body = head + a.tobytes() + b.tobytes()
    # The range names the body's size; a chunked body's is known only once it is read.
    out.append(Case("header-length-negative", "POST", infer, bin_body, {"Inference-Header-Content-Length": "-5"},
                    needles=(f"inference header size should be in range (0, {len(bin_body)}), got: -5",)))
    out.append(Case("header-length-negative-chunked", "POST", infer, bin_body,
                    {"Inference-Header-Content-Length": "-5"}, chunked=True,
                    needles=(f"inference header size should be in range (0, {len(bin_body)}), got: -5",)))
    out.append(Case("header-length-garbage", "POST", infer, head + a.tobytes() + b.tobytes(),
                    {"Inference-Header-Content-Length": "abc"}))
    out.append(Case("binary-without-header-length", "POST", infer, head + a.tobytes() + b.tobytes(), dict(JSON), deviation=BAD_INPUT_500))
    out.append(Case("raw-body-two-input-model", "POST", infer, a.tobytes(), {"Inference-Header-Content-Length": "0"},
                    needles=("Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in "
                             "'add_sub' model configuration",)))
    out.append(Case("raw-body-bytes-many-elements", "POST", "/v2/models/identity_bytes/infer", b"427",
                    {"Inference-Header-Content-Length": "0"},
                    needles=("For BYTE datatype raw input 'INPUT0', the model must have input shape [1]",)))
    out.append(Case("raw-body-bad-size", "POST", "/v2/models/identity_fp32/infer", b"abcde",
                    {"Inference-Header-Content-Length": "0"}))
    out.append(Case("unknown-content-encoding", "POST", infer, _body(_add_sub()), {**JSON, "Content-Encoding": "br"}))
    out.append(Case("bad-gzip", "POST", infer, b"not gzip", {**JSON, "Content-Encoding": "gzip"}))
    out.append(Case("content-encoding-upper-case", "POST", infer, gz, {**JSON, "Content-Encoding": "GZIP"},
                    deviation=CODING_NAMES))
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    out.append(Case("deflate-raw-body", "POST", infer, raw_deflate.compress(_body(_add_sub())) + raw_deflate.flush(),
                    {**JSON, "Content-Encoding": "deflate"}, deviation=CODING_NAMES))
    framed = _body(_add_sub())
    framed = b"%x\r\n%s\r\n0\r\n\r\n" % (len(framed), framed)
    # (http.client adds no Content-Length where a Transfer-Encoding is given.)
    out.append(Case("content-length-and-chunked", "POST", infer, framed,
                    {**JSON, "Transfer-Encoding": "chunked", "Content-Length": str(len(framed))},
                    needles=("Content-Length",), deviation=FRAMING))
    out.append(Case("transfer-encoding-not-chunked", "POST", infer, _body(_add_sub()),
                    {**JSON, "Transfer-Encoding": "gzip", "Content-Length": str(len(_body(_add_sub())))},
                    deviation=FRAMING))
    # Triton answers 100 Continue to any expectation and then the request, never 417.
    out.append(Case("expect-unknown", "POST", infer, _body(_add_sub()), {**JSON, "Expect": "something"}))
    # Triton's zlib reads a gzip or a zlib stream under either label.
    out.append(Case("gzip-label-zlib-body", "POST", infer, zlib.compress(_body(_add_sub())),
                    {**JSON, "Content-Encoding": "gzip"}))
    out.append(Case("deflate-label-gzip-body", "POST", infer, gz, {**JSON, "Content-Encoding": "deflate"}))
    # Routing.
    post("unknown-model", _add_sub(), path="/v2/models/nope/infer", needles=("Request for unknown model",))
    post("unknown-version", _add_sub(), path="/v2/models/add_sub/versions/9/infer")
    post("bad-version", _add_sub(), path="/v2/models/add_sub/versions/x/infer")
    out.append(Case("get-on-infer", "GET", infer))
    out.append(Case("unknown-route", "GET", "/v2/nothing"))
    post("version-leading-zero", _add_sub(), path="/v2/models/add_sub/versions/01/infer")
    post("version-zero", _add_sub(), path="/v2/models/add_sub/versions/0/infer")
    post("version-huge", _add_sub(), path="/v2/models/add_sub/versions/99999999999999999999/infer",
         needles=("failed to get model version from specified version string '99999999999999999999'",))
    post("version-negative", _add_sub(), path="/v2/models/add_sub/versions/-1/infer")
    post("version-empty", _add_sub(), path="/v2/models/add_sub/versions//infer")
    post("trailing-slash", _add_sub(), path="/v2/models/add_sub/infer/")
    post("query-string", _add_sub(), path="/v2/models/add_sub/infer?x=1")
    post("double-slash", _add_sub(), path="/v2//models/add_sub/infer")
    post("encoded-model-name", _add_sub(), path="/v2/models/add%5Fsub/infer", deviation=DECODED)
    post("model-name-case", _add_sub(), path="/v2/models/ADD_SUB/infer")
    out.append(Case("put-on-infer", "PUT", infer, _body(_add_sub()), dict(JSON)))
    out.append(Case("delete-on-model", "DELETE", "/v2/models/add_sub"))
    out.append(Case("post-on-health", "POST", "/v2/health/live", b"", dict(JSON)))
    out.append(Case("head-on-infer", "HEAD", infer))
    out.append(Case("head-on-health", "HEAD", "/v2/health/live", deviation=HEAD_OK))
    out.append(Case("head-on-metadata", "HEAD", "/v2/models/add_sub", deviation=HEAD_OK))
    out.append(Case("health-query", "GET", "/v2/health/ready?verbose=1", deviation=HEALTH_BODY))
    out.append(Case("server-metadata-slash", "GET", "/v2/"))
    out.append(Case("metadata-versioned", "GET", "/v2/models/add_sub/versions/1",
                    keys=("name", "versions", "platform", "inputs", "outputs")))
    out.append(Case("config-versioned", "GET", "/v2/models/add_sub/versions/1/config",
                    keys=("name", "backend", "max_batch_size")))
    out.append(Case("config-unknown-version", "GET", "/v2/models/add_sub/versions/9/config"))
    out.append(Case("config-unknown-model", "GET", "/v2/models/nope/config"))
    out.append(Case("metadata-unknown-version", "GET", "/v2/models/add_sub/versions/9"))
    out.append(Case("ready-version-huge", "GET", "/v2/models/add_sub/versions/99999999999999999999/ready"))
    out.append(Case("metadata-version-huge", "GET", "/v2/models/add_sub/versions/99999999999999999999"))
    out.append(Case("stats-version-huge", "GET", "/v2/models/add_sub/versions/99999999999999999999/stats"))
    post("version-int64-max", _add_sub(), path="/v2/models/add_sub/versions/9223372036854775807/infer")
    post("version-int64-max-plus-1", _add_sub(), path="/v2/models/add_sub/versions/9223372036854775808/infer")
    out.append(Case("metadata-encoded-name", "GET", "/v2/models/add%5Fsub", deviation=DECODED))
    out.append(Case("ready-encoded-name", "GET", "/v2/models/add%5Fsub/ready", deviation=DECODED))

    # ------------------------------------------------------------------ other routes
    out.append(Case("health-live", "GET", "/v2/health/live", deviation=HEALTH_BODY))
    out.append(Case("health-ready", "GET", "/v2/health/ready", deviation=HEALTH_BODY))
    out.append(Case("model-ready", "GET", "/v2/models/add_sub/ready"))
    out.append(Case("model-ready-unknown-version", "GET", "/v2/models/add_sub/versions/3/ready"))
    out.append(Case("model-ready-unknown", "GET", "/v2/models/nope/ready"))
    out.append(Case("model-metadata", "GET", "/v2/models/add_sub",
                    keys=("name", "versions", "platform", "inputs", "outputs")))
    out.append(Case("model-metadata-bytes", "GET", "/v2/models/identity_bytes",
                    keys=("name", "versions", "platform", "inputs", "outputs")))
    out.append(Case("model-metadata-unknown", "GET", "/v2/models/nope", needles=("Request for unknown model",)))
    out.append(Case("model-config", "GET", "/v2/models/add_sub/config",
                    keys=("name", "backend", "platform", "max_batch_size", "version_policy")))
    out.append(Case("repository-index", "POST", "/v2/repository/index", b"{}", dict(JSON)))
    out.append(Case("repository-index-ready", "POST", "/v2/repository/index", _body({"ready": True}), dict(JSON)))
    out.append(Case("repository-index-ready-not-bool", "POST", "/v2/repository/index", _body({"ready": "yes"}),
                    dict(JSON), deviation=BAD_INPUT_500))
    out.append(Case("repository-index-unknown-key", "POST", "/v2/repository/index", _body({"bogus": 1}),
                    dict(JSON), needles=("bogus",), deviation=NOT_IGNORED))
    out.append(Case("repository-index-not-object", "POST", "/v2/repository/index", _body([1]), dict(JSON),
                    deviation=NOT_IGNORED))
    out.append(Case("repository-index-bad-body", "POST", "/v2/repository/index", b"{", dict(JSON), deviation=BAD_INPUT_500))
    load = "/v2/repository/models/scratch/load"
    out.append(Case("load-unknown-parameter", "POST", load, _body({"parameters": {"bogus": 1}}), dict(JSON), deviation=BAD_INPUT_500))
    out.append(Case("load-config-not-string", "POST", load, _body({"parameters": {"config": 5}}), dict(JSON), deviation=BAD_INPUT_500))
    out.append(Case("load-config-bad-json", "POST", load, _body({"parameters": {"config": "{"}}), dict(JSON), deviation=BAD_INPUT_500))
    out.append(Case("load-file-without-config", "POST", "/v2/repository/models/scratch_files/load",
                    _body({"parameters": {"file:1/model.py": "aGVsbG8="}}), dict(JSON), deviation=BAD_INPUT_500))
    out.append(Case("load-file-bad-base64", "POST", "/v2/repository/models/scratch_files/load",
                    _body({"parameters": {"config": "{}", "file:1/model.py": "!!!"}}), dict(JSON)))
    out.append(Case("load-unknown-model", "POST", "/v2/repository/models/nope/load", b"", dict(JSON),
                    needles=("failed to load 'nope'",), deviation=UNKNOWN_404))
    out.append(Case("load-unknown-string-parameter", "POST", load, _body({"parameters": {"bogus": "x"}}),
                    dict(JSON), needles=("bogus",), deviation=BAD_INPUT_500))
    out.append(Case("load-broken", "POST", "/v2/repository/models/broken/load", b"", dict(JSON),
                    needles=("load failed for model 'broken'", "this model refuses to load")))
    out.append(Case("load-bls-in-initialize", "POST", "/v2/repository/models/bls_in_initialize/load", b"",
                    dict(JSON), needles=("load failed for model 'bls_in_initialize'",
                                         "BLS is only supported during the 'execute' function")))
    one = {"inputs": [_tensor("INPUT0", "FP32", [1], [1.0])]}

    def in_state(state: str, model: str) -> None:
        """What every model route answers for `model` in `state`, with and without a version."""
        base = f"/v2/models/{model}"
        post(f"infer-{state}", one, path=base + "/infer")
        post(f"infer-versioned-{state}", one, path=base + "/versions/1/infer")
        for route, suffix in (("metadata", ""), ("ready", "/ready"), ("stats", "/stats"), ("config", "/config")):
            out.append(Case(f"{route}-{state}", "GET", base + suffix))
            out.append(Case(f"{route}-versioned-{state}", "GET", f"{base}/versions/1{suffix}"))

    in_state("never-loaded", "scratch")
    in_state("load-failed", "broken")
    out.append(Case("load-ok", "POST", load, b"", dict(JSON)))
    out.append(Case("load-ok-again", "POST", load, b"", dict(JSON)))
    uploaded_config = json.dumps({
        "name": "uploaded", "backend": "python", "max_batch_size": 0,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    })
    code = base64.b64encode(IDENTITY.encode()).decode()
    out.append(Case("load-files", "POST", "/v2/repository/models/uploaded/load",
                    _body({"parameters": {"config": uploaded_config, "file:1/model.py": code}}), dict(JSON)))
    post("infer-uploaded", {"inputs": [_tensor("INPUT0", "FP32", [2], [0.25, -8.0])]},
         path="/v2/models/uploaded/infer")
    out.append(Case("unload-unknown-parameter", "POST", "/v2/repository/models/scratch/unload",
                    _body({"parameters": {"bogus": 1}}), dict(JSON), deviation=NOT_IGNORED))
    out.append(Case("unload-ok", "POST", "/v2/repository/models/scratch/unload", b"", dict(JSON)))
    in_state("unloaded", "scratch")
    out.append(Case("unload-again", "POST", "/v2/repository/models/scratch/unload", b"", dict(JSON)))
    # "uploaded" came from load parameters, not the repository: Triton 2.51 does not list it.
    out.append(Case("repository-index-after-unload", "POST", "/v2/repository/index", b"{}", dict(JSON),
                    index_without=("uploaded",)))
    out.append(Case("repository-index-ready-after-unload", "POST", "/v2/repository/index",
                    _body({"ready": True}), dict(JSON), index_without=("uploaded",)))
    out.append(Case("unload-unknown-model", "POST", "/v2/repository/models/nope/unload", b"", dict(JSON)))
    trace_keys = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_mode")
    out.append(Case("trace-get", "GET", "/v2/trace/setting", keys=trace_keys))
    out.append(Case("trace-get-model", "GET", "/v2/models/add_sub/trace/setting", keys=trace_keys))
    out.append(Case("trace-get-unknown-model", "GET", "/v2/models/nope/trace/setting",
                    needles=("Request for unknown model : nope",)))
    out.append(Case("trace-timestamps-without-file", "POST", "/v2/trace/setting",
                    _body({"trace_level": ["TIMESTAMPS"]}), dict(JSON), needles=("trace file name is not given",)))
    out.append(Case("trace-set-file", "POST", "/v2/trace/setting", _body({"trace_file": "/tmp/x"}), dict(JSON),
                    needles=("trace file location can not be updated through network protocol",)))
    out.append(Case("trace-bad-rate", "POST", "/v2/trace/setting", _body({"trace_rate": "abc"}), dict(JSON),
                    needles=("Unable to parse 'trace_rate', got: abc",)))
    out.append(Case("trace-model-rate", "POST", "/v2/models/identity_mixed/trace/setting",
                    _body({"trace_rate": "5", "trace_count": "3"}), dict(JSON), keys=trace_keys))
    out.append(Case("trace-model-clear", "POST", "/v2/models/identity_mixed/trace/setting",
                    _body({"trace_rate": None, "trace_count": None}), dict(JSON), keys=trace_keys))
    out.append(Case("trace-unknown-key", "POST", "/v2/trace/setting", _body({"bogus": "1"}), dict(JSON),
                    needles=("bogus",), deviation=NOT_IGNORED))
    out.append(Case("trace-negative-rate", "POST", "/v2/trace/setting", _body({"trace_rate": "-1"}), dict(JSON),
                    needles=("trace_rate",), deviation=NO_WRAP))
    # Generate extension on tensor models: JSON fields are the inputs, outputs come back as fields.
    gen = "/v2/models/add_sub/generate"
    out.append(Case("generate-tensor", "POST", gen, _body({"INPUT0": [[1, 2, 3, 4]], "INPUT1": [[10, 20, 30, 40]]}),
                    dict(JSON), keys=("model_name", "model_version", "OUTPUT0", "OUTPUT1")))
    out.append(Case("generate-tensor-flat", "POST", gen, _body({"INPUT0": [1, 2, 3, 4], "INPUT1": [10, 20, 30, 40]}),
                    dict(JSON), keys=("model_name", "model_version", "OUTPUT0", "OUTPUT1")))
    out.append(Case("generate-tensor-missing-input", "POST", gen, _body({"INPUT0": [[1, 2, 3, 4]]}), dict(JSON)))
    out.append(Case("generate-tensor-unknown-field", "POST", gen,
                    _body({"INPUT0": [1, 2, 3, 4], "INPUT1": [1, 2, 3, 4], "bogus": 1}), dict(JSON)))
    out.append(Case("generate-tensor-short", "POST", gen, _body({"INPUT0": [1, 2, 3], "INPUT1": [1, 2, 3]}), dict(JSON)))
    out.append(Case("generate-tensor-scalar", "POST", gen, _body({"INPUT0": 1, "INPUT1": 2}), dict(JSON)))
    out.append(Case("generate-tensor-parameters", "POST", gen,
                    _body({"INPUT0": [1, 2, 3, 4], "INPUT1": [1, 2, 3, 4], "parameters": {"x": 1}}), dict(JSON)))
    out.append(Case("generate-tensor-wrong-type", "POST", gen, _body({"INPUT0": "abc", "INPUT1": [[1, 2, 3, 4]]}),
                    dict(JSON)))
    out.append(Case("generate-tensor-bad-json", "POST", gen, b"{", dict(JSON), deviation=BAD_INPUT_500))
    out.append(Case("generate-unknown-model", "POST", "/v2/models/nope/generate", _body({"x": 1}), dict(JSON)))
    out.append(Case("generate-bytes", "POST", "/v2/models/identity_bytes/generate", _body({"INPUT0": ["hello"]}),
                    dict(JSON), keys=("model_name", "OUTPUT0")))
    out.append(Case("generate-stream-tensor", "POST", "/v2/models/add_sub/generate_stream",
                    _body({"INPUT0": [1, 2, 3, 4], "INPUT1": [10, 20, 30, 40]}), dict(JSON)))
    # Classification extension: the top-k of an output as "score:index" strings.
    post("classification-json", _add_sub(outputs=[{"name": "OUTPUT0", "parameters": {"classification": 2}}]))
    post("classification-all", _add_sub(outputs=[{"name": "OUTPUT1", "parameters": {"classification": 9}}]))
    post("classification-binary", _add_sub(
        outputs=[{"name": "OUTPUT0", "parameters": {"classification": 3, "binary_data": True}}]))
    post("classification-zero", _add_sub(outputs=[{"name": "OUTPUT0", "parameters": {"classification": 0}}]))
    post("classification-past-32-bits",
         _add_sub(outputs=[{"name": "OUTPUT0", "parameters": {"classification": 2**40}}]), deviation=WIDE_COUNT)
    post("output-shm-size-without-region", _add_sub(outputs=[{"name": "OUTPUT0", "parameters": {
        "shared_memory_byte_size": 64}}]), needles=(), deviation=NOT_IGNORED)
    post("classification-negative", _add_sub(outputs=[{"name": "OUTPUT0", "parameters": {"classification": -1}}]),
         needles=("classification",), deviation=BAD_INPUT_500)
    post("classification-string", _add_sub(outputs=[{"name": "OUTPUT0", "parameters": {"classification": "2"}}]),
         needles=("classification",), deviation=BAD_INPUT_500)
    # Not here: classification of a BYTES output ends tritonserver 2.51 (the connection closes,
    # the process is gone); edged answers 400 "class result not available for output due to
    # unsupported type 'BYTES'", the refusal tests/api/test_classification.py checks for BOOL.
    # A decoupled model: any number of responses, streamed; plain infer and generate want one.
    count = "/v2/models/countdown"
    decoupled = "HTTP end point doesn't support models with decoupled transaction policy"
    for n in (0, 1, 3):
        out.append(Case(f"generate-stream-decoupled-{n}", "POST", count + "/generate_stream", _body({"IN": n}), dict(JSON)))
        out.append(Case(f"generate-decoupled-{n}", "POST", count + "/generate", _body({"IN": n}), dict(JSON),
                        needles=("generate expects model to produce exactly 1 response",) if n != 1 else (),
                        deviation=ERROR_STATUS if n != 1 else None))
        post(f"infer-decoupled-{n}", {"inputs": [_tensor("IN", "INT32", [1], [n])]}, path=count + "/infer",
             needles=(decoupled,) if n != 1 else (), deviation=ONE_RESPONSE if n == 1 else None)
    # An ensemble over the decoupled model, and a step after it: one answer per response.
    pipe = "/v2/models/count_pipe"
    for n in (0, 1, 3):
        out.append(Case(f"ensemble-generate-stream-decoupled-{n}", "POST", pipe + "/generate_stream",
                        _body({"N": n}), dict(JSON)))
        out.append(Case(f"ensemble-generate-decoupled-{n}", "POST", pipe + "/generate", _body({"N": n}), dict(JSON),
                        needles=("generate expects model to produce exactly 1 response",) if n != 1 else (),
                        deviation=ERROR_STATUS if n != 1 else None))
    post("ensemble-infer-decoupled-3", {"inputs": [_tensor("N", "INT32", [1], [3])]}, path=pipe + "/infer",
         needles=(decoupled,))
    # An ensemble (two add_sub steps).
    ens = "/v2/models/twice/infer"

    def pair(a: object = (1, 2, 3, 4), b: object = (10, 20, 30, 40), shape: tuple[int, ...] = (1, 4),
             **extra: object) -> dict[str, object]:
        return {"inputs": [_tensor("A", "INT32", list(shape), list(a)), _tensor("B", "INT32", list(shape), list(b))],
                **extra}

    post("ensemble-json", pair(id="e1"), path=ens)
    post("ensemble-batch", pair(range(8), range(8, 16), shape=(2, 4)), path=ens)
    post("ensemble-output-subset", pair(outputs=[{"name": "OUT2"}]), path=ens)
    post("ensemble-binary-output", pair(outputs=[{"name": "OUT", "parameters": {"binary_data": True}}]), path=ens)
    post("ensemble-missing-input", {"inputs": [_tensor("A", "INT32", [1, 4], [1, 2, 3, 4])]}, path=ens)
    post("ensemble-wrong-shape", pair((1, 2, 3), (1, 2, 3), shape=(1, 3)), path=ens)
    post("ensemble-unknown-output", pair(outputs=[{"name": "sum"}]), path=ens)
    post("ensemble-classification", pair(outputs=[{"name": "OUT", "parameters": {"classification": 2}}]), path=ens)
    # Pruning: only the steps leading to the requested outputs run (a zero fails `faulty`).
    fork = "/v2/models/fork/infer"
    for values, tag in (([1, 2], "ok"), ([0, 2], "zero")):
        x = [_tensor("X", "FP32", [2], values)]
        post(f"ensemble-fork-all-{tag}", {"inputs": x}, path=fork)
        post(f"ensemble-fork-kept-{tag}", {"inputs": x, "outputs": [{"name": "kept"}]}, path=fork)
        post(f"ensemble-fork-dropped-{tag}", {"inputs": x, "outputs": [{"name": "dropped2"}]}, path=fork)
    # Between batching and non-batching models (a batch of one loses or gains its dimension).
    bou = "/v2/models/batched_over_unbatched/infer"
    post("ensemble-batched-over-unbatched-1", {"inputs": [_tensor("X", "FP32", [1, 4], [1, 2, 3, 4])]}, path=bou)
    post("ensemble-batched-over-unbatched-2", {"inputs": [_tensor("X", "FP32", [2, 4], list(range(8)))]}, path=bou,
         needles=("unexpected shape for input 'INPUT0' for model 'identity_fp32'",))
    post("ensemble-unbatched-over-batched", {"inputs": [_tensor("A", "INT32", [4], [1, 2, 3, 4]),
                                                         _tensor("B", "INT32", [4], [10, 20, 30, 40])]},
         path="/v2/models/unbatched_over_batched/infer")
    out.append(Case("ensemble-metadata", "GET", "/v2/models/twice",
                    keys=("name", "versions", "platform", "inputs", "outputs")))
    out.append(Case("ensemble-config", "GET", "/v2/models/twice/config",
                    keys=("name", "platform", "max_batch_size", "input", "output")))
    out.append(Case("ensemble-ready", "GET", "/v2/models/twice/ready"))
    # Version policies: which versions load, which one an unversioned request runs.
    for name in ("versions_latest", "versions_all", "versions_specific"):
        base = f"/v2/models/{name}"
        one = {"inputs": [_tensor("INPUT0", "INT32", [1], [10])]}
        out.append(Case(f"{name}-metadata", "GET", base, keys=("name", "versions")))
        post(f"{name}-infer", one, path=base + "/infer")
        for version in (1, 2, 3, 4):
            post(f"{name}-infer-v{version}", one, path=f"{base}/versions/{version}/infer")
            out.append(Case(f"{name}-ready-v{version}", "GET", f"{base}/versions/{version}/ready"))
        out.append(Case(f"{name}-stats", "GET", base + "/stats", keys=()))
    out.append(Case("repository-index-versions", "POST", "/v2/repository/index", b"{}", dict(JSON),
                    index_without=("uploaded",)))
    # The sequence batcher: one sequence across cases (the model keeps running sums), and the
    # requests it refuses.
    def step(id_: str, value: int, *, model: str = "py_accumulator", input_: str = "INPUT", **parameters: object) -> None:
        post(id_, {"inputs": [_tensor(input_, "INT32", [1, 1], [value])], "parameters": parameters},
             path=f"/v2/models/{model}/infer")

    step("sequence-start", 5, sequence_id=7, sequence_start=True)
    step("sequence-middle", 3, sequence_id=7)
    step("sequence-other-start", 100, sequence_id=8, sequence_start=True)
    step("sequence-other-middle", 1, sequence_id=8)
    step("sequence-end", 2, sequence_id=7, sequence_end=True)
    step("sequence-after-end", 1, sequence_id=7)
    step("sequence-never-started", 1, sequence_id=99)
    step("sequence-no-id", 1)
    step("sequence-zero-id", 1, sequence_id=0, sequence_start=True)
    step("sequence-empty-id", 1, sequence_id="", sequence_start=True)
    step("sequence-start-and-end", 4, sequence_id=9, sequence_start=True, sequence_end=True)
    # Through an ensemble.
    pipe = {"model": "sequence_pipe", "input_": "IN"}
    step("ensemble-sequence-start", 5, **pipe, sequence_id=21, sequence_start=True)
    step("ensemble-sequence-middle", 3, **pipe, sequence_id=21)
    step("ensemble-sequence-end", 2, **pipe, sequence_id=21, sequence_end=True)
    step("ensemble-sequence-after-end", 1, **pipe, sequence_id=21)
    step("ensemble-sequence-no-id", 1, **pipe)
    step("sequence-other-end", 1, sequence_id=8, sequence_end=True)
    post("sequence-string-id-uint64-corrid", {"inputs": [_tensor("INPUT", "INT32", [1, 1], [1])], "parameters": {
        "sequence_id": "user-a", "sequence_start": True}}, path="/v2/models/py_accumulator/infer", needles=("UINT64",), deviation=TYPED_ID)
    # Shared memory and logging extensions.
    out.append(Case("shm-status", "GET", "/v2/systemsharedmemory/status", keys=()))
    out.append(Case("shm-region-status-unknown", "GET", "/v2/systemsharedmemory/region/nope/status"))
    out.append(Case("shm-unregister-unknown", "POST", "/v2/systemsharedmemory/region/nope/unregister", b"", dict(JSON)))
    out.append(Case("shm-unregister-all", "POST", "/v2/systemsharedmemory/unregister", b"", dict(JSON)))
    out.append(Case("shm-register-missing-key", "POST", "/v2/systemsharedmemory/region/r/register",
                    _body({"offset": 0, "byte_size": 16}), dict(JSON)))
    out.append(Case("shm-register-no-such-key", "POST", "/v2/systemsharedmemory/region/r/register",
                    _body({"key": "/edged-compat-none", "offset": 0, "byte_size": 16}), dict(JSON),
                    needles=("Unable to open shared memory region: '/edged-compat-none'",), deviation=BAD_INPUT_500))
    out.append(Case("shm-register-bad-json", "POST", "/v2/systemsharedmemory/region/r/register", b"{", dict(JSON),
                    deviation=BAD_INPUT_500))
    out.append(Case("cuda-shm-status", "GET", "/v2/cudasharedmemory/status", keys=()))
    out.append(Case("cuda-shm-register", "POST", "/v2/cudasharedmemory/region/r/register",
                    _body({"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 16}), dict(JSON)))
    out.append(Case("cuda-shm-unregister-unknown", "POST", "/v2/cudasharedmemory/region/nope/unregister", b"", dict(JSON)))
    out.append(Case("logging-get", "GET", "/v2/logging", keys=("log_info", "log_warning", "log_error")))
    out.append(Case("logging-bad-type", "POST", "/v2/logging", _body({"log_info": "yes"}), dict(JSON),
                    needles=("log_info",), deviation=BAD_INPUT_500))
    out.append(Case("logging-unknown-key", "POST", "/v2/logging", _body({"bogus": True}), dict(JSON),
                    needles=("bogus",), deviation=NOT_IGNORED))
    out.append(Case("logging-bad-json", "POST", "/v2/logging", b"{", dict(JSON), deviation=BAD_INPUT_500))
    out.append(Case("stats-unknown-version", "GET", "/v2/models/add_sub/versions/9/stats"))
    out.append(Case("stats-versioned", "GET", "/v2/models/add_sub/versions/1/stats", keys=()))  # counts differ
    out.append(Case("stats-unknown-model", "GET", "/v2/models/nope/stats",
                    needles=("requested model 'nope' is not available",)))
    # Explicit loads of ensembles (last: they change the repository index). Loading one loads
    # its steps, through nested ensembles; unloading a step unloads the ensembles over it.
    x = {"inputs": [_tensor("X", "FP32", [2], [1.5, -2.0])]}
    out.append(Case("ensemble-load-with-steps", "POST", "/v2/repository/models/chain_outer/load", b"", dict(JSON)))
    for name in ("chain_outer", "chain", "chain_step"):
        out.append(Case(f"ensemble-load-with-steps-ready-{name}", "GET", f"/v2/models/{name}/ready"))
    post("ensemble-load-with-steps-infer", x, path="/v2/models/chain_outer/infer")
    out.append(Case("ensemble-step-unload", "POST", "/v2/repository/models/chain_step/unload", b"", dict(JSON)))
    for name in ("chain_outer", "chain"):
        out.append(Case(f"ensemble-step-unload-ready-{name}", "GET", f"/v2/models/{name}/ready"))
    for name, needle in (
        ("ens_missing_step", "ensemble ens_missing_step contains models that are not available or ambiguous: no_such_model"),
        ("ens_broken_step", "ensemble 'ens_broken_step' depends on 'broken' which has no loaded version"),
        ("ens_bad_input_key", "in ensemble ens_bad_input_key, ensemble tensor X is mapping to non-existing input NOPE in model identity_fp32"),
        ("ens_bad_output_key", "in ensemble ens_bad_output_key, ensemble tensor Y is mapped from non-existing output NOPE in model identity_fp32"),
        ("ens_mixed_origins", "in ensemble ens_mixed_origins, step of model 'ens_mixed_origins' receives inputs "
                              "originated from different decoupled models"),
        ("ens_bad_shape", "in ensemble ens_bad_shape, ensemble tensor A: inconsistent shape: [3] is inferred from "
                          "model ens_bad_shape while [-1,4] is inferred from model add_sub"),
        ("ens_unmapped_input", "in ensemble ens_unmapped_input, input INPUT1 in model add_sub is not mapped to any "
                               "ensemble tensors"),
        ("ens_batch_too_big", "ensemble ens_batch_too_big allows maximum batch size 16, but it contains model add_sub "
                              "which only allows maximum batch size to be 8"),
        ("ens_bad_type", "in ensemble ens_bad_type, ensemble tensor X: inconsistent data type: TYPE_INT32 is inferred from model ens_bad_type while TYPE_FP32 is inferred from model identity_fp32"),
    ):
        out.append(Case(f"ensemble-load-refused-{name}", "POST", f"/v2/repository/models/{name}/load", b"", dict(JSON),
                        needles=(needle,)))
    for name in ("ens_unused_input", "ens_unused_tensor", "ens_produced_twice"):
        out.append(Case(f"ensemble-load-refused-{name}", "POST", f"/v2/repository/models/{name}/load", b"", dict(JSON),
                        deviation=ENSEMBLE_CONFIG))
    return out
