"""Triton-style python models (written here, see tests/python_models/) served by a real daemon
process: identity and string identity through tritonclient, a decoupled mock LLM over /infer,
generate and generate_stream, a model that completes its own config, BLS calls, and a client
disconnect reaching the model as request.is_cancelled()."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support import (
    DaemonProcess,
    Reply,
    controller_repository,
    metric_samples,
    run_steps,
    start_daemon_process,
    wait_until,
)

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "python_models"


def write_repository(repo: Path) -> None:
    for source in MODELS.iterdir():
        if not source.is_dir():
            continue
        (repo / source.name / "1").mkdir(parents=True)
        shutil.copy(source / "model.py", repo / source.name / "1" / "model.py")
        if (source / "config.pbtxt").exists():
            shutil.copy(source / "config.pbtxt", repo / source.name / "config.pbtxt")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    repo = tmp_path_factory.mktemp("repo")
    write_repository(repo)
    process = start_daemon_process(
        tmp_path_factory.mktemp("edged"),
        "--model-repository",
        str(repo),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        http=True,
    )
    yield process
    process.stop()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Any]:
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
    yield client
    client.close()


def events(reply: Reply) -> list[dict[str, Any]]:
    """The JSON objects of a Server-Sent Events body."""
    assert reply.headers["content-type"].startswith("text/event-stream"), reply.body
    chunks = [c for c in reply.body.decode().split("\n\n") if c.strip()]
    assert all(c.startswith("data: ") for c in chunks), reply.body
    return [json.loads(c[len("data: ") :]) for c in chunks]


def mock_llm_body(prompt: str, stream: bool, **parameters: Any) -> dict[str, Any]:
    return {"PROMPT": prompt, "STREAM": stream, "parameters": parameters}


# --------------------------------------------------------------------------- identity models


def test_all_models_ready(daemon: DaemonProcess) -> None:
    index = daemon.post_json("/v2/repository/index", {}).json()
    assert {(m["name"], m["state"]) for m in index} == {
        (name, "READY")
        for name in (
            "auto_complete",
            "bls",
            "bls_decoupled",
            "identity_fp32",
            "mock_llm",
            "params_echo",
            "slow_stream",
            "string_identity",
        )
    }, daemon.log()


@pytest.mark.parametrize("binary", [False, True])
def test_identity_fp32_with_tritonclient(client: Any, binary: bool) -> None:
    x = np.arange(10, dtype=np.float32).reshape(2, 5) / 3
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    result = client.infer(
        "identity_fp32",
        [inp],
        outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)],
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)


def test_parameters_and_requested_outputs_reach_the_model(client: Any) -> None:
    inp = httpclient.InferInput("INPUT0", [2], "FP32")
    inp.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
    result = client.infer(
        "params_echo",
        [inp],
        outputs=[httpclient.InferRequestedOutput("PARAMS")],
        parameters={"temperature": 0.5, "tag": "t\u00e9", "n": 3, "flag": True},
    )
    # request.parameters() is Triton's JSON string, spelled as Triton 2.51 spells it (compact,
    # UTF-8 unescaped); requested_output_names() what was asked, a set as in Triton.
    assert json.loads(result.as_numpy("PARAMS")[0]) == {
        "parameters": {"temperature": 0.5, "tag": "t\u00e9", "n": 3, "flag": True},
        "requested": ["PARAMS"],
        "raw": '{"temperature":0.5,"tag":"t\u00e9","n":3,"flag":true}',
        "requested_type": "set",
    }
    assert result.as_numpy("OUTPUT0") is None


def test_string_identity_with_tritonclient(client: Any) -> None:
    text = np.array(["héllo wörld"], dtype=np.object_)
    inp = httpclient.InferInput("INPUT0", [1], "BYTES")
    inp.set_data_from_numpy(text)
    result = client.infer("string_identity", [inp])
    assert result.as_numpy("OUTPUT0").tolist() == ["héllo wörld".encode()]


# --------------------------------------------------------------------------- decoupled over /infer


def _mock_llm_inputs(prompt: str, stream: bool) -> list[Any]:
    p = httpclient.InferInput("PROMPT", [1, 1], "BYTES")
    p.set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    s = httpclient.InferInput("STREAM", [1, 1], "BOOL")
    s.set_data_from_numpy(np.array([[stream]]))
    return [p, s]


def test_decoupled_model_over_infer_one_response(client: Any) -> None:
    result = client.infer("mock_llm", _mock_llm_inputs("one two", stream=False))
    assert result.as_numpy("TEXT").tolist() == [[b"one"]]
    assert client.get_model_config("mock_llm")["model_transaction_policy"] == {"decoupled": True}


@pytest.mark.parametrize(("prompt", "count"), [("one two three", 3), ("", 0)])
def test_decoupled_model_over_infer_needs_exactly_one_response(
    client: Any, prompt: str, count: int
) -> None:
    parameters = {"COUNT": 0} if count == 0 else {}
    with pytest.raises(InferenceServerException) as info:
        client.infer("mock_llm", _mock_llm_inputs(prompt, stream=True), parameters=parameters)
    # Triton's status and text for a decoupled model on HTTP infer (it refuses even one response).
    assert info.value.status() == "501"
    assert "HTTP end point doesn't support models with decoupled transaction policy" in info.value.message()
    assert f"gave {count} responses" in info.value.message() and "generate_stream" in info.value.message()


# --------------------------------------------------------------------------- generate extension


def test_generate_stream_sends_each_response(daemon: DaemonProcess) -> None:
    def stats() -> dict[str, Any]:
        return daemon.request("GET", "/v2/models/mock_llm/stats").json()["model_stats"][0]

    before = stats()
    reply = daemon.post_json(
        "/v2/models/mock_llm/generate_stream", {"id": "r1", **mock_llm_body("the quick fox", True)}
    )
    assert reply.status == 200
    # Recorded as Triton records a decoupled request: one execution, its compute, a success.
    after = stats()
    assert after["execution_count"] == before["execution_count"] + 1
    for key in ("success", "compute_infer", "queue"):
        assert after["inference_stats"][key]["count"] == before["inference_stats"][key]["count"] + 1, key
    assert after["batch_stats"] and after["response_stats"] == {}
    assert reply.body.startswith(
        b'data: {"TEXT":"the","id":"r1","model_name":"mock_llm","model_version":"1"}\n\n'
    )
    assert events(reply) == [
        {"id": "r1", "model_name": "mock_llm", "model_version": "1", "TEXT": w}
        for w in ["the", "quick", "fox"]
    ]


def test_generate_stream_error_response_then_more(daemon: DaemonProcess) -> None:
    body = mock_llm_body("a b c d", True, ERROR_AT=1, FAIL_LAST=True)
    got = events(daemon.post_json("/v2/models/mock_llm/versions/1/generate_stream", body))
    assert [e.get("TEXT", e.get("error")) for e in got] == [
        "a",
        "bad token 1",
        "c",
        "d",
        "An Error Occurred",
    ]


def test_generate_stream_first_response_an_error(daemon: DaemonProcess) -> None:
    reply = daemon.post_json(
        "/v2/models/mock_llm/generate_stream", mock_llm_body("x", True, COUNT=0, FAIL_LAST=True)
    )
    # The first response sets the status: the error's own (INVALID_ARG -> 400), as Triton.
    assert reply.status == 400
    assert events(reply) == [{"error": "An Error Occurred"}]


def test_generate_stream_refused_before_inference_is_json(daemon: DaemonProcess) -> None:
    reply = daemon.post_json("/v2/models/mock_llm/generate_stream", {"PROMPT": "x"})
    assert reply.status == 400
    assert reply.headers["content-type"].startswith("application/json")
    assert "missing required input(s) ['STREAM']" in reply.json()["error"]


def test_generate_stream_zero_responses(daemon: DaemonProcess) -> None:
    reply = daemon.post_json(
        "/v2/models/mock_llm/generate_stream", mock_llm_body("x", True, COUNT=0)
    )
    assert reply.status == 200 and events(reply) == []


def test_generate_decoupled_exactly_one(daemon: DaemonProcess) -> None:
    one = daemon.post_json("/v2/models/mock_llm/generate", mock_llm_body("solo word", False))
    assert one.status == 200
    assert one.json() == {"model_name": "mock_llm", "model_version": "1", "TEXT": "solo"}
    many = daemon.post_json("/v2/models/mock_llm/generate", mock_llm_body("two words", True))
    assert many.status == 500
    assert many.json() == {
        "error": "generate expects model to produce exactly 1 response, use generate stream for "
        "model that generates various number of responses"
    }


def test_send_after_final_is_refused_to_the_model(daemon: DaemonProcess) -> None:
    daemon.post_json("/v2/models/mock_llm/generate", mock_llm_body("w", False, LATE_SEND=True))
    reply = daemon.post_json("/v2/models/mock_llm/generate", mock_llm_body("w", False, REPORT=True))
    assert reply.json()["TEXT"] == "Unable to send response. Response sender has been closed."


def test_generate_for_a_non_decoupled_model(daemon: DaemonProcess) -> None:
    # Keys naming inputs become tensors (dtype from the config, shape from its dims with the
    # batch dimension); other keys, top level or in "parameters", become request parameters.
    reply = daemon.post_json("/v2/models/identity_fp32/generate", {"INPUT0": [1.5, 2, -3]})
    assert reply.status == 200, reply.body
    # Byte for byte what Triton 2.51 answers (keys sorted, as its std::map writes them).
    assert (
        reply.body == b'{"OUTPUT0":[1.5,2.0,-3.0],"model_name":"identity_fp32","model_version":"1"}'
    )
    body = {"INPUT0": [1.0], "mode": "fast", "parameters": {"n": 3, "flag": True, "t": 0.5}}
    echoed = daemon.post_json("/v2/models/params_echo/generate", body).json()
    seen = json.loads(echoed["PARAMS"])
    assert {key: seen[key] for key in ("parameters", "requested")} == {
        "parameters": {"mode": "fast", "n": 3, "flag": True, "t": 0.5},
        "requested": ["OUTPUT0", "PARAMS"],
    }
    # One element comes back as a scalar; generate_stream gives the same object as one event.
    one = daemon.post_json("/v2/models/identity_fp32/generate", {"INPUT0": 7})
    assert one.json()["OUTPUT0"] == 7.0
    single = daemon.post_json(
        "/v2/models/identity_fp32/generate_stream", {"parameters": {"INPUT0": 7}}
    )
    assert [e["OUTPUT0"] for e in events(single)] == [7.0]
    text = daemon.post_json("/v2/models/string_identity/generate", {"INPUT0": "ünïcode"})
    assert text.json()["OUTPUT0"] == "ünïcode"


@pytest.mark.parametrize(
    ("model", "body", "status", "message"),
    [
        ("identity_fp32", {"INPUT0": ["a"]}, 400, "input 'INPUT0' expects FP32 values"),
        ("identity_fp32", {"INPUT0": [1.0], "x": [1, 2]}, 400, "parameter 'x' has invalid type"),
        (
            "identity_fp32",
            {"INPUT0": [1.0], "parameters": 3},
            400,
            "Expected JSON object for keyword: 'parameters'",
        ),
        (
            "identity_fp32",
            {"INPUT0": [1.0], "parameters": {"INPUT0": [2.0]}},
            400,
            "Converting keyword: 'parameters': input 'INPUT0' already exists in request",
        ),
        ("identity_fp32", {}, 400, "INPUT0"),
        (
            "string_identity",
            {"INPUT0": ["a", "b"]},
            400,
            "The schema can not convert input 'INPUT0'",
        ),
        ("string_identity", {"INPUT0": 5}, 400, "input 'INPUT0' is BYTES"),
        ("identity_fp32", {"INPUT0": [[1, 2], [3, 4]]}, 400, "not nested lists"),
        ("mock_llm", {"PROMPT": "x", "STREAM": 1}, 400, "input 'STREAM' expects BOOL values"),
        ("nope", {"INPUT0": 1.0}, 404, "Request for unknown model"),
    ],
)
def test_generate_bad_requests(
    daemon: DaemonProcess, model: str, body: dict[str, Any], status: int, message: str
) -> None:
    reply = daemon.post_json(f"/v2/models/{model}/generate", body)
    assert reply.status == status, reply.body
    assert message in reply.json()["error"]


def test_generate_gzip_body(daemon: DaemonProcess) -> None:
    import gzip

    body = gzip.compress(json.dumps({"INPUT0": [1.0, 2.0]}).encode())
    reply = daemon.request(
        "POST",
        "/v2/models/identity_fp32/generate",
        body,
        {"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert reply.status == 200, reply.body
    assert reply.json()["OUTPUT0"] == [1.0, 2.0]


def test_generate_malformed_json(daemon: DaemonProcess) -> None:
    reply = daemon.request(
        "POST", "/v2/models/identity_fp32/generate", b"{nope", {"Content-Type": "application/json"}
    )
    assert reply.status == 400 and "malformed JSON body" in reply.json()["error"]


# --------------------------------------------------------------------------- auto-complete, BLS


def test_model_completing_its_own_config(daemon: DaemonProcess, client: Any) -> None:
    config = client.get_model_config("auto_complete")
    assert config["max_batch_size"] == 4
    assert config["dynamic_batching"] is not None
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("INPUT0", "TYPE_FP32", [4]),
        ("INPUT1", "TYPE_FP32", [4]),
    ]
    assert [t["name"] for t in config["output"]] == ["OUTPUT0", "OUTPUT1"]
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.ones((2, 4), dtype=np.float32)
    inputs = [
        httpclient.InferInput("INPUT0", [2, 4], "FP32"),
        httpclient.InferInput("INPUT1", [2, 4], "FP32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("auto_complete", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    # The completed config is validated like a written one: a batch of 5 is over its limit.
    too_many = [
        httpclient.InferInput("INPUT0", [5, 4], "FP32"),
        httpclient.InferInput("INPUT1", [5, 4], "FP32"),
    ]
    for inp in too_many:
        inp.set_data_from_numpy(np.zeros((5, 4), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="batch"):
        client.infer("auto_complete", too_many)


def _bls_inputs(model_name: str, x: np.ndarray) -> list[Any]:
    name = httpclient.InferInput("MODEL_NAME", [1], "BYTES")
    name.set_data_from_numpy(np.array([model_name.encode()], dtype=np.object_))
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return [name, inp]


def test_bls_exec_and_async_exec_call_another_model(client: Any) -> None:
    x = np.array([[1.0, -2.0, 3.5]], dtype=np.float32)
    before = client.get_inference_statistics("identity_fp32")["model_stats"][0]["inference_count"]
    result = client.infer("bls", _bls_inputs("identity_fp32", x))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
    np.testing.assert_array_equal(result.as_numpy("ASYNC0"), 2 * x)
    after = client.get_inference_statistics("identity_fp32")["model_stats"][0]["inference_count"]
    # Three real requests reached identity_fp32 through the daemon (one exec, two async_exec).
    assert after - before == 3


def test_bls_error_comes_back_as_a_response_error(client: Any) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.infer("bls", _bls_inputs("no_such_model", np.zeros((1, 2), dtype=np.float32)))
    assert "Request for unknown model: 'no_such_model'" in info.value.message()
    # The error's code travelled too: NOT_FOUND is a 404, as for a direct request.
    assert info.value.status() == "404"


def test_decoupled_bls_streams_and_cancels(client: Any, tmp_path: Path) -> None:
    marker = tmp_path / "bls_marker.txt"
    prompt = httpclient.InferInput("PROMPT", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"alpha beta gamma"], dtype=np.object_))
    where = httpclient.InferInput("MARKER", [1], "BYTES")
    where.set_data_from_numpy(np.array([str(marker).encode()], dtype=np.object_))
    result = client.infer("bls_decoupled", [prompt, where])
    assert result.as_numpy("WORDS").tolist() == [b"alpha", b"beta", b"gamma"]
    assert result.as_numpy("ASYNC_WORDS").tolist() == [b"alpha", b"beta", b"gamma"]
    assert result.as_numpy("ERRORS").tolist() == [
        b"error: Request for unknown model: 'no_such_model' is not found"
    ]
    assert result.as_numpy("BEFORE_CANCEL").tolist() == [3]
    # cancel() reached the called model as request.is_cancelled().
    wait_until(marker.exists, timeout=30)
    assert marker.read_text().startswith("cancelled after ")


# --------------------------------------------------------------------------- cancellation


def test_client_disconnect_cancels_the_request_in_the_model(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    marker = tmp_path / "marker.txt"
    body = json.dumps({"MARKER": str(marker)}).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(daemon.socket))
    sock.sendall(
        b"POST /v2/models/slow_stream/generate_stream HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    received = b""
    while received.count(b"data: ") < 2:
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    assert b" 200 " in received.split(b"\r\n", 1)[0]
    sock.close()
    wait_until(marker.exists, timeout=30)
    text = marker.read_text()
    assert text.startswith("cancelled after "), text
    # The daemon is fine and the model still serves.
    assert daemon.request("GET", "/v2/models/slow_stream/ready").status == 200


_LIFECYCLE_MODEL = """\
import numpy as np
import triton_python_backend_utils as pb_utils

class Custom(BaseException):
    pass

class TritonPythonModel:
    def initialize(self, args):
        if {initialize!r}:
            raise KeyboardInterrupt("initialize")

    def execute(self, requests):
        kind = requests[0].parameters()
        if "keyboard" in kind:
            raise KeyboardInterrupt("execute")
        if "custom" in kind:
            raise Custom("execute")
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)])]

    def finalize(self):
        if {finalize!r}:
            raise GeneratorExit("finalize")
"""


def test_base_exceptions_from_a_model_never_end_the_daemon(start_daemon, tmp_path: Path) -> None:
    """A model's KeyboardInterrupt ended the daemon (from execute, initialize or finalize), a
    custom BaseException ended the model's scheduler for good, and a GeneratorExit in
    finalize left the model UNLOADING: each is now that model's error."""
    repo = tmp_path / "repo"
    for name, initialize, finalize in (("m", False, True), ("init", True, False)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(
            'backend: "python"\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
            'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        )
        (repo / name / "1" / "model.py").write_text(_LIFECYCLE_MODEL.format(initialize=initialize, finalize=finalize))
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "m")

    def infer(kind: str) -> Reply:
        body = {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [3]}], "parameters": {kind: True}}
        return daemon.post_json("/v2/models/m/infer", body)

    for kind, raised in (("keyboard", "KeyboardInterrupt: execute"), ("custom", "Custom: execute")):
        reply = infer(kind)
        assert reply.status == 500 and raised in reply.json()["error"], reply.body
        assert infer("plain").json()["outputs"][0]["data"] == [3.0]  # the model still serves
    reply = daemon.post_json("/v2/repository/models/init/load", {})
    assert reply.status == 400 and "initialize raised KeyboardInterrupt: initialize" in reply.json()["error"]
    assert daemon.post_json("/v2/repository/models/m/unload", {}).status == 200
    assert daemon.request("GET", "/v2/models/m/ready").status == 400
    states = {row["name"]: row.get("state") for row in daemon.post_json("/v2/repository/index", {}).json()}
    assert states["m"] == "UNAVAILABLE"
    assert daemon.proc.poll() is None and daemon.request("GET", "/v2/health/live").status == 200
    assert "finalize failed" in daemon.log()


_COUNTING_MODEL = """\
import numpy as np
FACTOR = 1
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily("requests_seen", "Requests the model saw", pb_utils.MetricFamily.COUNTER)
        self.seen = self.family.Metric(labels={"model": args["model_name"]})
        self.sizes = pb_utils.MetricFamily("request_size", "Elements per request", pb_utils.MetricFamily.HISTOGRAM)
        self.size = self.sizes.Metric(labels={"model": args["model_name"]}, buckets=[1.0, 4.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            self.seen.increment(1)
            self.size.observe(x.size)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * FACTOR)]))
        return responses
"""


def test_a_models_own_metrics_are_served_kept_across_a_reload_and_gone_with_it(start_daemon, tmp_path: Path) -> None:
    """pb_utils.MetricFamily series in the daemon's /metrics: both instances of the model add
    to one series, a reload (the new version opens the family before the old one closes)
    keeps the counts, an unload takes them away."""
    repo = tmp_path / "repo"
    (repo / "counted" / "1").mkdir(parents=True)
    (repo / "counted" / "config.pbtxt").write_text(
        'backend: "python"\ninstance_group [{ count: 2 kind: KIND_CPU }]\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
    )
    (repo / "counted" / "1" / "model.py").write_text(_COUNTING_MODEL)
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "counted")

    def infer(n: int) -> list[float]:
        body = {"inputs": [{"name": "X", "shape": [n], "datatype": "FP32", "data": list(range(n))}]}
        reply = daemon.post_json("/v2/models/counted/infer", body)
        assert reply.status == 200, reply.body
        return list(reply.json()["outputs"][0]["data"])

    def samples() -> dict[str, Any]:
        reply = daemon.request("GET", "/metrics")
        assert reply.status == 200
        text = reply.body.decode()
        if "requests_seen" in text:
            assert "# HELP requests_seen Requests the model saw\n# TYPE requests_seen counter\n" in text
            assert "# TYPE request_size histogram\n" in text
        return metric_samples(text, ("requests_seen", "request_size"))

    model = (("model", "counted"),)
    for n in (1, 3, 6):
        infer(n)
    assert samples() == {
        "requests_seen": {model: 3.0},
        "request_size_bucket": {(("le", "1.0"), *model): 1.0, (("le", "4.0"), *model): 2.0, (("le", "+Inf"), *model): 3.0},
        "request_size_count": {model: 3.0},
        "request_size_sum": {model: 10.0},
    }
    # A new model file, so that the load really replaces the version that serves.
    (repo / "counted" / "1" / "model.py").write_text(_COUNTING_MODEL.replace("FACTOR = 1", "FACTOR = 2"))
    assert daemon.post_json("/v2/repository/models/counted/load", {}).status == 200
    assert infer(2) == [0.0, 2.0]
    after = samples()
    assert after["requests_seen"] == {model: 4.0}
    assert after["request_size_sum"] == {model: 12.0}
    assert daemon.post_json("/v2/repository/models/counted/unload", {}).status == 200
    wait_until(lambda: samples() == {})


def test_a_python_model_loads_and_unloads_other_models(start_daemon, tmp_path: Path) -> None:
    """pb_utils.load_model / unload_model / is_model_ready from a model's code, explicit mode:
    what Triton 2.51 answers (tests/compat compares the two), and the refusals that are edged's."""
    repo = tmp_path / "repo"
    controller_repository(repo, at_start=True)
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "controller")

    def failed(verb: str, message: str) -> list[str]:
        return ["TritonModelException", f"{verb}: Failed to process the request for model 'controller_0', message: {message}"]

    seen = run_steps(daemon.post_json, ["ready", "run", "load", "ready", "ready_versions", "run"])
    assert seen["at_start"] == ["ok", False]  # initialize runs before its own model is served
    assert seen["done"] == [
        ["ready", "ok", False], ["run", "ok", "error"], ["load", "ok", None], ["ready", "ok", True],
        ["ready_versions", "ok", [True, False]], ["run", "ok", [3.0]],
    ]
    done = run_steps(daemon.post_json, [
        "load_files", "run", "ready_bad_version", "load_unknown", "load_files_without_config",
        "load_file_not_named_file", "load_text_file", "load_itself", "unload_itself", "run",
    ])["done"]
    assert done == [
        ["load_files", "ok", None],
        ["run", "ok", [4.5]],  # the model the request sent, with its config
        ["ready_bad_version", *failed(
            "Failed to check model readiness",
            "failed to get model version from specified version string 'abc': version should be an integral value > 0",
        )],
        ["load_unknown", *failed("Failed to load model", "failed to load 'nope', failed to poll from model repository")],
        ["load_files_without_config", *failed(
            "Failed to load model",
            "load parameters 'file:...' need the model configuration in the 'config' parameter too",
        )],
        ["load_file_not_named_file", *failed(
            "Failed to load model",
            "load parameter '1/model.py': the file path must be relative to the model directory, like 'file:1/model.onnx'",
        )],
        ["load_text_file", "TypeError", "Object of type 'str' is not an instance of 'bytes'"],
        ["load_itself", *failed("Failed to load model", "model 'controller' cannot load itself")],
        ["unload_itself", *failed("Failed to unload model", "model 'controller' cannot unload itself")],
        ["run", "ok", [4.5]],  # the failed loads left the loaded model serving
    ]
    assert run_steps(daemon.post_json, ["unload", "ready", "run", "unload_unknown"])["done"] == [
        ["unload", "ok", None], ["ready", "ok", False], ["run", "ok", "error"], ["unload_unknown", "ok", None],
    ]
    states = {row["name"]: row.get("state") for row in daemon.post_json("/v2/repository/index", {}).json()}
    assert states == {"controller": "READY", "other": "UNAVAILABLE"}
    assert daemon.post_json("/v2/repository/models/controller/unload", {}).status == 200
    # finalize has no model control, as in Triton.
    wait_until(lambda: "finalize: [\"TritonModelException\"" in daemon.log())
    assert "(not in finalize, auto_complete_config or a thread the model starts)" in daemon.log()


def test_the_model_loading_api_needs_explicit_model_control(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    controller_repository(repo)
    daemon = start_daemon("--model-repository", str(repo))
    done = run_steps(daemon.post_json, ["load", "ready"])["done"]
    assert done == [
        ["load", "TritonModelException", "Failed to load model: Failed to process the request for model "
         "'controller_0', message: explicit model load / unload is not allowed if model control mode is none"],
        ["ready", "ok", True],  # mode none loads every model of the repository
    ]
