"""KServe v2 over a real Unix socket against a real daemon process serving real ONNX Runtime and
Python models (Triton's `simple` example)."""

from __future__ import annotations

import gzip
import json
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from model_builders import write_simple_repository

from support import Reply, python_model, raw_request, read_response, wait_until


@pytest.fixture
def daemon(start_daemon: Callable[..., object], simple_repo: Path) -> object:
    return start_daemon("--model-repository", str(simple_repo))


def _simple_inputs(rows: int = 1) -> tuple[np.ndarray, np.ndarray]:
    a = np.arange(16 * rows, dtype=np.int32).reshape(rows, 16)
    b = np.full((rows, 16), 3, dtype=np.int32) * np.arange(1, rows + 1, dtype=np.int32)[:, None]
    return a, b


def _json_infer(a: np.ndarray, b: np.ndarray) -> dict[str, object]:
    return {
        "id": "req-1",
        "inputs": [
            {"name": "INPUT0", "shape": list(a.shape), "datatype": "INT32", "data": a.ravel().tolist()},
            {"name": "INPUT1", "shape": list(b.shape), "datatype": "INT32", "data": b.tolist()},
        ],
    }


def test_health_and_server_metadata(daemon) -> None:
    """Health: Triton's status codes with the Open Inference Protocol's bodies, on the lean
    front and on aiohttp's route (which serves a query string or an HTTP/1.0 request)."""
    for path in ("/v2/health/live", "/v2/health/live?verbose=1"):
        reply = daemon.request("GET", path)
        assert (reply.status, reply.json()) == (200, {"live": True}), path
    for path in ("/v2/health/ready", "/v2/health/ready?verbose=1"):
        reply = daemon.request("GET", path)
        assert (reply.status, reply.json()) == (200, {"ready": True}), path
    meta = daemon.request("GET", "/v2").json()
    assert meta["name"] == "edged"
    assert "binary_tensor_data" in meta["extensions"] and "statistics" in meta["extensions"]


@pytest.mark.parametrize("model", ["simple", "simple_python"])
def test_json_infer_matches_numpy(daemon, model: str) -> None:
    a, b = _simple_inputs(rows=3)
    reply = daemon.post_json(f"/v2/models/{model}/infer", _json_infer(a, b))
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["model_name"] == model and body["id"] == "req-1"
    outputs = {o["name"]: o for o in body["outputs"]}
    assert outputs["OUTPUT0"]["shape"] == [3, 16] and outputs["OUTPUT0"]["datatype"] == "INT32"
    np.testing.assert_array_equal(np.array(outputs["OUTPUT0"]["data"]).reshape(3, 16), a + b)
    np.testing.assert_array_equal(np.array(outputs["OUTPUT1"]["data"]).reshape(3, 16), a - b)


def test_binary_infer_and_output_selection(daemon) -> None:
    a, b = _simple_inputs(rows=2)
    header = json.dumps({
        "inputs": [
            {"name": "INPUT0", "shape": [2, 16], "datatype": "INT32", "parameters": {"binary_data_size": a.nbytes}},
            {"name": "INPUT1", "shape": [2, 16], "datatype": "INT32", "parameters": {"binary_data_size": b.nbytes}},
        ],
        "outputs": [{"name": "OUTPUT1", "parameters": {"binary_data": True}}],
    }).encode()
    reply = daemon.request(
        "POST", "/v2/models/simple/versions/1/infer", header + a.tobytes() + b.tobytes(),
        {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )
    assert reply.status == 200, reply.body
    json_len = int(reply.headers["inference-header-content-length"])
    meta = json.loads(reply.body[:json_len])
    assert [o["name"] for o in meta["outputs"]] == ["OUTPUT1"]
    size = meta["outputs"][0]["parameters"]["binary_data_size"]
    out = np.frombuffer(reply.body[json_len : json_len + size], dtype=np.int32).reshape(2, 16)
    np.testing.assert_array_equal(out, a - b)


def test_gzip_request_body(daemon) -> None:
    a, b = _simple_inputs()
    body = gzip.compress(json.dumps(_json_infer(a, b)).encode())
    reply = daemon.request("POST", "/v2/models/simple/infer", body,
                           {"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert reply.status == 200, reply.body
    out = {o["name"]: o["data"] for o in reply.json()["outputs"]}
    assert out["OUTPUT0"] == (a + b).ravel().tolist()


def test_a_body_arriving_across_a_reload_runs_on_the_version_it_addressed(start_daemon, tmp_path: Path) -> None:
    """A chunked body (aiohttp's route resolves the model before reading it) whose model is
    swapped by a reload while the body arrives: the request runs on the version it resolved,
    which is retired after it, instead of a 503 from a version already unloading."""
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x + 1")
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "poll",
                          "--repository-poll-secs", "0.1")

    def infer_y(connection_daemon) -> float:
        reply = connection_daemon.post_json("/v2/models/m/infer", {"inputs": [
            {"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]})
        assert reply.status == 200, reply.body
        return float(reply.json()["outputs"][0]["data"][0])

    assert infer_y(daemon) == 2.0
    body = json.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]}).encode()
    half = len(body) // 2
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(60)
        sock.connect(str(daemon.socket))
        head = raw_request("POST", "/v2/models/m/infer", b"",
                           ("Content-Type: application/json", "Transfer-Encoding: chunked"))
        sock.sendall(head + b"%x\r\n%s\r\n" % (half, body[:half]))
        time.sleep(0.5)  # the route has resolved the model and waits for the rest of the body
        python_model(repo, "m", "y = x + 100")
        wait_until(lambda: infer_y(daemon) == 101.0)  # swapped: other requests get the new one
        rest = body[half:]
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
        status, _, payload = read_response(sock, bytearray())
    answer = json.loads(payload)
    assert status == 200, answer
    y = answer["outputs"][0]["data"][0]
    if y == 101.0:
        pytest.skip("the route resolved the model after the swap (a slow machine): nothing to check")
    assert y == 2.0
    assert "waiting for 1 request(s) using it before unloading" in daemon.log()


def test_model_metadata_ready_config(daemon) -> None:
    meta = daemon.request("GET", "/v2/models/simple").json()
    assert meta["name"] == "simple" and meta["versions"] == ["1"]
    assert meta["backend"] == "onnxruntime"
    assert {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]} in meta["inputs"]
    assert meta["selection"]["backend"] == "onnxruntime"
    assert daemon.request("GET", "/v2/models/simple/ready").status == 200
    assert daemon.request("GET", "/v2/models/simple/versions/1/ready").status == 200
    not_ready = daemon.request("GET", "/v2/models/simple/versions/7/ready")
    assert not_ready.status == 400 and not_ready.json() == {"error": "Model version not ready"}
    config = daemon.request("GET", "/v2/models/simple/config").json()
    assert config["max_batch_size"] == 8 and config["name"] == "simple"
    # Triton fills the backend from the platform.
    assert config["platform"] == "onnxruntime_onnx" and config["backend"] == "onnxruntime"


def test_repository_index_and_stats(daemon) -> None:
    a, b = _simple_inputs()
    assert daemon.post_json("/v2/models/simple/infer", _json_infer(a, b)).status == 200
    index = daemon.post_json("/v2/repository/index", {}).json()
    assert {"name": "simple", "version": "1", "state": "READY"} in [
        {k: row[k] for k in ("name", "version", "state")} for row in index
    ]
    stats = daemon.request("GET", "/v2/models/simple/stats").json()["model_stats"][0]
    assert stats["name"] == "simple" and stats["version"] == "1"
    assert stats["inference_stats"]["success"]["count"] >= 1
    assert stats["response_stats"] == {}  # Triton 2.51 layout: its python backend keeps none
    # A version is a number: /versions/01 is version 1, as on the other model routes.
    versioned = daemon.request("GET", "/v2/models/simple/versions/01/stats").json()["model_stats"]
    assert [s["version"] for s in versioned] == ["1"]
    metrics = daemon.request("GET", "/metrics").body.decode()
    assert 'nv_inference_request_success{model="simple",version="1"}' in metrics
    assert "nv_inference_queue_duration_us" in metrics


def test_latency_summaries_over_the_socket(start_daemon, simple_repo: Path) -> None:
    """Triton's --metrics-config: summaries of each request's latencies, no duration counters."""
    daemon = start_daemon("--model-repository", str(simple_repo), "--metrics-config", "summary_latencies=true",
                          "--metrics-config", "counter_latencies=false")
    a, b = _simple_inputs()
    for _ in range(3):
        assert daemon.post_json("/v2/models/simple/infer", _json_infer(a, b)).status == 200
    metrics = daemon.request("GET", "/metrics").body.decode()
    labels = 'model="simple",version="1"'
    for name in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
        assert f"nv_inference_{name}_summary_us_count{{{labels}}} 3" in metrics
        assert f'nv_inference_{name}_summary_us{{model="simple",quantile="0.999",version="1"}}' in metrics
    assert f"nv_inference_request_success{{{labels}}} 3" in metrics
    assert "nv_inference_request_duration_us" not in metrics


def test_curl_over_unix_socket(daemon) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    a, b = _simple_inputs()
    out = subprocess.run(
        [curl, "-sS", "--unix-socket", str(daemon.socket), "-H", "Content-Type: application/json",
         "-d", json.dumps(_json_infer(a, b)), "http://localhost/v2/models/simple/infer"],
        check=True, capture_output=True, timeout=60,
    )
    outputs = {o["name"]: o["data"] for o in json.loads(out.stdout)["outputs"]}
    assert outputs["OUTPUT0"] == (a + b).ravel().tolist()


# ---------------------------------------------------------------------------- bad input


def _assert_error(reply, status: int, *needles: str) -> None:
    assert reply.status == status, (reply.status, reply.body)
    message = reply.json()["error"]
    for needle in needles:
        assert needle in message, message


def test_bad_requests_get_clear_errors_and_daemon_keeps_serving(daemon) -> None:
    a, b = _simple_inputs()
    good = _json_infer(a, b)
    fails_before = daemon.request("GET", "/v2/models/simple/stats").json()["model_stats"][0]["inference_stats"]["fail"]
    _assert_error(daemon.request("POST", "/v2/models/simple/infer", b"{not json"), 400, "JSON")
    _assert_error(daemon.post_json("/v2/models/nope/infer", good), 404, "Request for unknown model", "nope")
    _assert_error(daemon.post_json("/v2/models/simple/versions/9/infer", good), 404, "version 9")
    wrong_dtype = json.loads(json.dumps(good))
    wrong_dtype["inputs"][0]["datatype"] = "FP32"
    _assert_error(daemon.post_json("/v2/models/simple/infer", wrong_dtype), 400, "INPUT0")
    wrong_shape = json.loads(json.dumps(good))
    wrong_shape["inputs"][0]["shape"] = [1, 8]
    wrong_shape["inputs"][0]["data"] = list(range(8))
    _assert_error(daemon.post_json("/v2/models/simple/infer", wrong_shape), 400, "INPUT0")
    short = json.loads(json.dumps(good))
    short["inputs"][1]["data"] = short["inputs"][1]["data"][0][:5]
    _assert_error(daemon.post_json("/v2/models/simple/infer", short), 400, "INPUT1")
    unknown_field = json.loads(json.dumps(good))
    unknown_field["inputz"] = []
    _assert_error(daemon.post_json("/v2/models/simple/infer", unknown_field), 400, "inputz")
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}},
    ]}).encode()
    _assert_error(
        daemon.request("POST", "/v2/models/simple/infer", header + a.tobytes(),
                       {"Inference-Header-Content-Length": str(len(header))}),
        400, "INPUT1",
    )
    _assert_error(
        daemon.request("POST", "/v2/models/simple/infer", header,
                       {"Inference-Header-Content-Length": str(len(header) + 100)}),
        400, "inference header size should be in range (0, ",
    )
    _assert_error(
        daemon.request("POST", "/v2/models/simple/infer", header,
                       {"Inference-Header-Content-Length": "twelve"}),
        400, "Unable to parse Inference-Header-Content-Length, got: twelve",
    )
    # Triton's data nesting limit: a 400, never a RecursionError 500.
    for depth in (120, 5000):
        nested = json.dumps(good).replace(
            json.dumps(good["inputs"][0]["data"]),
            "[" * depth + json.dumps(good["inputs"][0]["data"]) + "]" * depth,
        )
        _assert_error(daemon.request("POST", "/v2/models/simple/infer", nested,
                                     {"Content-Type": "application/json"}),
                      400, "JSON nesting depth exceeds maximum allowed limit (100)")
    reserved = {**good, "parameters": {"triton_x": 1}}
    _assert_error(daemon.post_json("/v2/models/simple/infer", reserved), 400,
                  "parameter keys starting with 'triton_' are reserved for Triton usage")
    bad_priority = {**good, "parameters": {"priority": "high"}}
    _assert_error(daemon.post_json("/v2/models/simple/infer", bad_priority), 400, "Unable to parse 'priority'")
    _assert_error(daemon.request("POST", "/v2/models/simple/infer", json.dumps(good),
                                 {"Content-Encoding": "br"}), 501, "Unsupported compression type")
    # Triton's answers for unknown models on ready / stats, and its digits-only version routes.
    _assert_error(daemon.request("GET", "/v2/models/nope/ready"), 400, "Model version not ready")
    _assert_error(daemon.request("GET", "/v2/models/nope/stats"), 400, "requested model 'nope' is not available")
    _assert_error(daemon.post_json("/v2/models/simple/versions/x/infer", good), 404, "Not Found")
    # A version beyond 64 bits: Triton's 400, on both the lean infer path and aiohttp's routes.
    huge = "9223372036854775808"
    for reply in (daemon.post_json(f"/v2/models/simple/versions/{huge}/infer", good),
                  daemon.request("GET", f"/v2/models/simple/versions/{huge}")):
        _assert_error(reply, 400, f"failed to get model version from specified version string '{huge}'")
    _assert_error(daemon.request("GET", "/v2/nowhere"), 404, "Not Found")
    # Still serving, models unaffected.
    reply = daemon.post_json("/v2/models/simple/infer", good)
    assert reply.status == 200
    assert daemon.request("GET", "/v2/models/simple/ready").status == 200
    # As Triton: requests refused before reaching the model are not the model's failures.
    stats = daemon.request("GET", "/v2/models/simple/stats").json()["model_stats"][0]
    assert stats["inference_stats"]["fail"] == fails_before
    assert daemon.alive()


def _echo_repository(tmp_path: Path) -> Path:
    """python models returning their input: `echo` (BYTES) and `echo_fp32`, any length."""
    repo = tmp_path / "repo"
    model = repo / "echo" / "1"
    model.mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "IN" data_type: TYPE_STRING dims: [ -1 ] }]\n'
        'output [{ name: "OUT" data_type: TYPE_STRING dims: [ -1 ] }]\n'
    )
    (model / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('OUT', pb_utils.get_input_tensor_by_name(r, 'IN').as_numpy())]) for r in requests]\n"
    )
    shutil.copytree(repo / "echo", repo / "echo_fp32")
    (repo / "echo_fp32" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "IN" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        'output [{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
    )
    return repo


def test_lying_bytes_lengths(start_daemon, tmp_path: Path) -> None:
    daemon = start_daemon("--model-repository", str(_echo_repository(tmp_path)))
    elements = [b"hello", b"", b"\xff\xfe binary"]
    raw = b"".join(struct.pack("<I", len(e)) + e for e in elements)
    header = json.dumps({"inputs": [{"name": "IN", "shape": [3], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}]}).encode()
    reply = daemon.request("POST", "/v2/models/echo/infer", header + raw,
                           {"Inference-Header-Content-Length": str(len(header))})
    assert reply.status == 200, reply.body
    n = int(reply.headers["inference-header-content-length"])
    assert reply.body[n:] == raw  # BYTES round trip, length-prefixed, binary-safe
    # The same bytes asked for as JSON: a 400 naming the output and the remedy, never U+FFFD.
    as_json = json.dumps({"inputs": [{"name": "IN", "shape": [3], "datatype": "BYTES",
                                      "parameters": {"binary_data_size": len(raw)}}]}).encode()
    _assert_error(
        daemon.request("POST", "/v2/models/echo/infer", as_json + raw,
                       {"Inference-Header-Content-Length": str(len(as_json))}),
        400, "output 'OUT' holds BYTES that are not valid UTF-8", '"binary_data": true',
    )
    # Inference-Header-Content-Length 0: the body is the only input, the answer is binary.
    values = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    reply = daemon.request("POST", "/v2/models/echo_fp32/infer", values.tobytes(),
                           {"Inference-Header-Content-Length": "0"})
    assert reply.status == 200, reply.body
    n = int(reply.headers["inference-header-content-length"])
    output = json.loads(reply.body[:n])["outputs"][0]
    assert output["shape"] == [3] and output["parameters"] == {"binary_data_size": 12}
    assert reply.body[n:] == values.tobytes()
    lying = struct.pack("<I", 1000) + b"abc"
    header = json.dumps({"inputs": [{"name": "IN", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(lying)}}]}).encode()
    _assert_error(
        daemon.request("POST", "/v2/models/echo/infer", header + lying,
                       {"Inference-Header-Content-Length": str(len(header))}),
        400, "IN",
    )
    assert daemon.request("GET", "/v2/models/echo/ready").status == 200


def _bytes_request(raw: bytes, count: int) -> tuple[bytes, dict[str, str]]:
    header = json.dumps({"inputs": [{"name": "IN", "shape": [count], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}]}).encode()
    return header + raw, {"Inference-Header-Content-Length": str(len(header))}


def test_large_bodies_and_outputs_round_trip(start_daemon, tmp_path: Path) -> None:
    # Bodies and outputs of 256 KiB and more are decoded and encoded on worker threads
    # (daemon.backend.OFF_LOOP_BYTES); smaller ones on the loop. Both give the same answers,
    # errors included, on the lean front and on aiohttp's route (a gzip body goes there).
    daemon = start_daemon("--model-repository", str(_echo_repository(tmp_path)))
    rng = np.random.default_rng(3)
    for count in (3, 70_000):
        elements = [rng.bytes(int(n)) for n in rng.integers(0, 9, count)]
        raw = b"".join(struct.pack("<I", len(e)) + e for e in elements)
        body, headers = _bytes_request(raw, count)
        assert (len(body) >= 256 * 1024) == (count > 3)
        for sent, extra in ((body, {}), (gzip.compress(body), {"Content-Encoding": "gzip"})):
            reply = daemon.request("POST", "/v2/models/echo/infer", sent, headers | extra)
            assert reply.status == 200, reply.body
            n = int(reply.headers["inference-header-content-length"])
            assert reply.body[n:] == raw
        # The last element's length runs past the end: the same message either way.
        cut = raw[:-1]
        _assert_error(daemon.request("POST", "/v2/models/echo/infer", *_bytes_request(cut, count)), 400,
                      f"input 'IN': BYTES element {count - 1} length prefix")
        _assert_error(daemon.request("POST", "/v2/models/echo/infer", *_bytes_request(raw, count + 1)), 400,
                      f"input 'IN': expected {count + 1} BYTES elements, got {count} in {len(raw)} bytes")
    for count in (4, 70_000):
        values = rng.standard_normal(count).astype(np.float32)
        body = json.dumps({"inputs": [{"name": "IN", "shape": [count], "datatype": "FP32",
                                       "data": values.tolist()}]}).encode()
        assert (len(body) >= 256 * 1024) == (count > 4)
        reply = daemon.request("POST", "/v2/models/echo_fp32/infer", body, {"Content-Type": "application/json"})
        assert reply.status == 200, reply.body
        [output] = reply.json()["outputs"]
        np.testing.assert_array_equal(np.asarray(output["data"], dtype=np.float32), values)
        broken = body.replace(b'"FP32"', b'"FP33"')
        _assert_error(daemon.request("POST", "/v2/models/echo_fp32/infer", broken), 400, "'IN'", "FP33")
    assert daemon.alive()


def test_body_over_limit_is_400_as_in_triton(start_daemon, simple_repo: Path, tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text("[server]\nmax-request-bytes = 4096\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(simple_repo))
    a = np.zeros((8, 16), dtype=np.int32)
    payload = json.dumps(_json_infer(a, a)).encode() + b" " * 8192
    reply = daemon.request("POST", "/v2/models/simple/infer", payload, {"Content-Type": "application/json"})
    assert reply.status == 400, reply.body
    assert reply.json()["error"] == (
        f"request size of {len(payload)} bytes exceeds the maximum allowed input size of 4096 bytes"
    )
    # OpenAI clients expect a 413.
    openai = daemon.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
    assert openai.status == 413, openai.body
    assert daemon.post_json("/v2/models/simple/infer", _json_infer(*_simple_inputs())).status == 200


def test_failing_plugin_load_and_execute(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name, body in {
        "bad_load": "class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('weights missing')\n",
        "bad_exec": "class TritonPythonModel:\n    def execute(self, requests):\n        raise ValueError('kaboom')\n",
    }.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(
            'backend: "python"\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }]\n'
            'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }]\n'
        )
        (repo / name / "1" / "model.py").write_text(body)
    write_simple_repository(repo)
    daemon = start_daemon("--model-repository", str(repo), wait=False)
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if daemon.request("GET", "/v2/models/simple/ready", timeout=5).status == 200:
                break
        except OSError:
            pass
        time.sleep(0.1)
    assert daemon.request("GET", "/v2/health/ready").status == 400  # one model failed
    # llama-server's /health: a 503 in its shape, saying what is not ready.
    health = daemon.request("GET", "/health")
    assert health.status == 503 and health.json()["error"]["type"] == "unavailable_error"
    assert health.json()["error"]["message"].startswith("Not ready: ")
    index = {r["name"]: r for r in daemon.post_json("/v2/repository/index", {}).json()}
    assert index["bad_load"]["state"] == "UNAVAILABLE"
    assert "weights missing" in index["bad_load"]["reason"]
    x = {"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}
    _assert_error(daemon.post_json("/v2/models/bad_exec/infer", x), 500, "kaboom", "bad_exec")
    # Triton 2.51 answers 404 for a model without a loaded version (tests/compat: infer-load-failed).
    _assert_error(daemon.post_json("/v2/models/bad_load/infer", x), 404, "'bad_load' has no available versions")
    assert daemon.post_json("/v2/models/simple/infer", _json_infer(*_simple_inputs())).status == 200
    assert daemon.post_json("/v2/models/bad_exec/infer", x).status == 500  # and again: still there


def test_repository_load_parameters(start_daemon, simple_repo: Path, tmp_path: Path) -> None:
    """Triton's load parameters: `config`, `file:<version>/<name>` (base64) — anything else
    is a 400 naming it; a model that fails to load is Triton's 400 "load failed for model"."""
    import base64

    from model_builders import SIMPLE_PYTHON_MODEL

    daemon = start_daemon("--model-repository", str(simple_repo), "--model-control-mode", "explicit",
                          "--load-model", "simple")
    load = "/v2/repository/models/uploaded/load"
    _assert_error(daemon.post_json(load, {"parameters": {"bogus": "1"}}), 400, "unknown load parameter 'bogus'")
    code = base64.b64encode(SIMPLE_PYTHON_MODEL.encode()).decode()
    _assert_error(daemon.post_json(load, {"parameters": {"file:1/model.py": code}}), 400, "'config'")
    config = json.dumps({
        "name": "uploaded", "backend": "python", "max_batch_size": 8,
        "input": [{"name": f"INPUT{i}", "data_type": "TYPE_INT32", "dims": [16]} for i in (0, 1)],
        "output": [{"name": f"OUTPUT{i}", "data_type": "TYPE_INT32", "dims": [16]} for i in (0, 1)],
    })
    _assert_error(daemon.post_json(load, {"parameters": {"config": config, "file:1/model.py": "!!"}}),
                  400, "'file:1/model.py' is not valid base64")
    _assert_error(daemon.post_json(load, {"parameters": {"config": config, "file:../x.py": code}}),
                  400, "relative to the model directory")
    broken = base64.b64encode(b"raise RuntimeError('no such luck')\n").decode()
    _assert_error(daemon.post_json(load, {"parameters": {"config": config, "file:1/model.py": broken}}),
                  400, "load failed for model 'uploaded'", "no such luck")
    reply = daemon.post_json(load, {"parameters": {"config": config, "file:1/model.py": code}})
    assert reply.status == 200, reply.body
    a, b = _simple_inputs()
    body = daemon.post_json("/v2/models/uploaded/infer", _json_infer(a, b)).json()
    assert body["outputs"][0]["data"] == (a + b).ravel().tolist()
    # Unload accepts Triton's `unload_dependents` (tritonclient always sends it), nothing else.
    unload = "/v2/repository/models/uploaded/unload"
    _assert_error(daemon.post_json(unload, {"parameters": {"bogus": True}}), 400, "unknown unload parameter 'bogus'")
    assert daemon.post_json(unload, {"parameters": {"unload_dependents": False}}).status == 200
    assert daemon.request("GET", "/v2/models/uploaded/ready").status == 400
    # Triton 2.51's answers for an unloaded model (tests/compat has them side by side): unknown
    # without a version, "not at ready state" for a version it had loaded, stats refused.
    infer = _json_infer(a, b)
    _assert_error(daemon.post_json("/v2/models/uploaded/infer", infer), 404, "'uploaded' is not found")
    _assert_error(daemon.post_json("/v2/models/uploaded/versions/1/infer", infer), 503,
                  "'uploaded' version 1 is not at ready state")
    _assert_error(daemon.post_json("/v2/models/uploaded/versions/2/infer", infer), 404,
                  "'uploaded' version 2 is not found")
    _assert_error(daemon.request("GET", "/v2/models/uploaded/stats"), 400, "requested model 'uploaded' is not available")
    # As in Triton, unloading a model that is not loaded succeeds.
    assert daemon.post_json("/v2/repository/models/nope/unload", {}).status == 200


def test_uploaded_models_stay_inside_the_state_directory(start_daemon, simple_repo: Path, tmp_path: Path) -> None:
    """A load's model name and `file:` paths name directories under the state directory:
    nothing may land outside it, a failed write leaves nothing behind, and one model's load
    never prunes another's files."""
    import base64
    import urllib.parse

    from model_builders import SIMPLE_PYTHON_MODEL

    daemon = start_daemon("--model-repository", str(simple_repo), "--model-control-mode", "explicit",
                          "--load-model", "simple")
    code = base64.b64encode(SIMPLE_PYTHON_MODEL.encode()).decode()

    def config(name: str) -> str:
        return json.dumps({
            "name": name, "backend": "python", "max_batch_size": 8,
            "input": [{"name": f"INPUT{i}", "data_type": "TYPE_INT32", "dims": [16]} for i in (0, 1)],
            "output": [{"name": f"OUTPUT{i}", "data_type": "TYPE_INT32", "dims": [16]} for i in (0, 1)],
        })

    def load(name: str, files: dict[str, str]) -> Reply:
        path = "/v2/repository/models/" + urllib.parse.quote(name, safe="") + "/load"
        return daemon.post_json(path, {"parameters": {"config": config(name), **files}})

    outside = tmp_path / "escaped"
    for name in ("..", ".", f"../../../../../../../..{outside}", str(outside), "a/b", "a\0b"):
        _assert_error(load(name, {"file:1/model.py": code}), 400, "is not a directory name (no '/', NUL, '.' or '..')")
    _assert_error(load("x" * 241, {"file:1/model.py": code}), 400, "is longer than 240 bytes")
    for key in ("file:.", "file:1/a\0b"):
        _assert_error(load("m", {key: code}), 400, "relative to the model directory")
    # Paths that pass and still cannot be written: a file and a directory of one name.
    _assert_error(load("m", {"file:1/model.py": code, "file:1/model.py/x": code}), 400,
                  "load parameter 'file:1/model.py/x' cannot be written: ")
    uploads = daemon.state_dir / "uploaded-models"
    assert not outside.exists() and not list(tmp_path.glob("escaped*"))
    assert not uploads.exists() or list(uploads.iterdir()) == []  # nothing left of the failures
    # A name that is a glob pattern matched every model's uploads when the earlier ones were pruned.
    assert load("mm", {"file:1/model.py": code}).status == 200
    assert load("??", {"file:1/model.py": code}).status == 200
    assert load("??", {"file:1/model.py": code}).status == 200  # prunes its own first upload only
    assert sorted(p.name[:3] for p in uploads.iterdir()) == ["??-", "mm-"]
    a, b = _simple_inputs()
    body = daemon.post_json("/v2/models/mm/infer", _json_infer(a, b)).json()
    assert body["outputs"][0]["data"] == (a + b).ravel().tolist()


def _step_and_pipe(repo: Path, factor: int, *, step_config: str = "") -> None:
    """A python model `step` (FP32 [2] X -> Y = X * factor) and an ensemble `pipe` over it."""
    tensor = 'data_type: TYPE_FP32 dims: [ 2 ]'
    (repo / "step" / "1").mkdir(parents=True)
    (repo / "step" / "config.pbtxt").write_text(
        f'backend: "python"\ninput [{{ name: "X" {tensor} }}]\noutput [{{ name: "Y" {tensor} }}]\n' + step_config
    )
    (repo / "step" / "1" / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('Y', pb_utils.get_input_tensor_by_name(r, 'X')"
        f".as_numpy() * {factor})]) for r in requests]\n"
    )
    (repo / "pipe" / "1").mkdir(parents=True)
    (repo / "pipe" / "config.pbtxt").write_text(
        f'platform: "ensemble"\ninput [{{ name: "IN" {tensor} }}]\noutput [{{ name: "OUT" {tensor} }}]\n'
        'ensemble_scheduling { step [ { model_name: "step" model_version: -1 '
        'input_map { key: "X" value: "IN" } output_map { key: "Y" value: "OUT" } } ] }\n'
    )


def test_unload_dependents_unloads_the_ensemble_steps(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _step_and_pipe(repo, 2)
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit",
                          "--load-model", "step", "--load-model", "pipe")
    x = {"inputs": [{"name": "IN", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}
    assert daemon.post_json("/v2/models/pipe/infer", x).json()["outputs"][0]["data"] == [2.0, 4.0]
    # Without the flag the step stays; with it, the step goes too (Triton's unload_dependents).
    assert daemon.post_json("/v2/repository/models/pipe/unload", {"parameters": {"unload_dependents": False}}).status == 200
    assert daemon.request("GET", "/v2/models/step/ready").status == 200
    assert daemon.post_json("/v2/repository/models/pipe/load", {}).status == 200
    assert daemon.post_json("/v2/repository/models/pipe/unload", {"parameters": {"unload_dependents": True}}).status == 200
    assert daemon.request("GET", "/v2/models/pipe/ready").status == 400
    assert daemon.request("GET", "/v2/models/step/ready").status == 400


def test_an_ensemble_loads_its_on_demand_steps(start_daemon, tmp_path: Path) -> None:
    """An ensemble request loads the step models that load on demand, as a request to them
    would (before, it failed while they were unloaded: 404 "ensemble 'pipe' step 0 (model
    'step'): Request for unknown model: 'step' is not found"), also after an explicit unload."""
    repo = tmp_path / "repo"
    _step_and_pipe(repo, 3, step_config='parameters { key: "load" value { string_value: "on-demand" } }\n')
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "*")
    x = {"inputs": [{"name": "IN", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}
    assert daemon.request("GET", "/v2/models/step/ready").status == 400  # not loaded at start
    for _ in range(2):
        reply = daemon.post_json("/v2/models/pipe/infer", x)
        assert reply.status == 200, reply.body
        assert reply.json()["outputs"][0]["data"] == [3.0, 6.0]
        assert daemon.request("GET", "/v2/models/step/ready").status == 200
        assert daemon.post_json("/v2/repository/models/step/unload", {}).status == 200
    metrics = daemon.request("GET", "/metrics").body.decode()
    assert "edged_on_demand_loads_total 2.0" in metrics.splitlines()


def test_a_model_warming_up_on_demand_may_ask_an_ensemble_over_on_demand_steps(start_daemon, tmp_path: Path) -> None:
    """An on-demand model whose warmup runs an `execute` that asks (BLS) an ensemble whose step
    loads on demand: the step loads inside the first load, which waits for it. Before, the
    step's load waited for the first load to end, and the request waited without end."""
    repo = tmp_path / "repo"
    on_demand = 'parameters { key: "load" value { string_value: "on-demand" } }\n'
    _step_and_pipe(repo, 3, step_config=on_demand)
    tensor = 'data_type: TYPE_FP32 dims: [ 2 ]'
    (repo / "caller" / "1").mkdir(parents=True)
    (repo / "caller" / "config.pbtxt").write_text(
        f'backend: "python"\ninput [{{ name: "X" {tensor} }}]\noutput [{{ name: "Y" {tensor} }}]\n' + on_demand
        + f'model_warmup [{{ name: "zeros" batch_size: 1 inputs {{ key: "X" value: {{ {tensor} zero_data: true }} }} }}]\n'
    )
    (repo / "caller" / "1" / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        out = []\n"
        "        for r in requests:\n"
        "            x = pb_utils.get_input_tensor_by_name(r, 'X').as_numpy()\n"
        "            response = pb_utils.InferenceRequest(model_name='pipe', requested_output_names=['OUT'],\n"
        "                                                 inputs=[pb_utils.Tensor('IN', x)]).exec()\n"
        "            if response.has_error():\n"
        "                raise RuntimeError(response.error().message())\n"
        "            y = pb_utils.get_output_tensor_by_name(response, 'OUT').as_numpy() + 1\n"
        "            out.append(pb_utils.InferenceResponse([pb_utils.Tensor('Y', y)]))\n"
        "        return out\n"
    )
    daemon = start_daemon("--model-repository", str(repo))
    x = json.dumps({"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [10, 20]}]})
    reply = daemon.request("POST", "/v2/models/caller/infer", x, {"Content-Type": "application/json"}, timeout=30)
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"][0]["data"] == [31.0, 61.0]
    assert daemon.request("GET", "/v2/models/step/ready").status == 200


def test_a_model_whose_warmup_asks_for_itself_fails_its_load(start_daemon, tmp_path: Path) -> None:
    """An on-demand model whose warmup asks (BLS) an ensemble over the model itself: its load
    fails, naming the cycle, rather than loading the model again inside its own load."""
    repo = tmp_path / "repo"
    tensor = 'data_type: TYPE_FP32 dims: [ 2 ]'
    (repo / "selfish" / "1").mkdir(parents=True)
    (repo / "selfish" / "config.pbtxt").write_text(
        f'backend: "python"\ninput [{{ name: "X" {tensor} }}]\noutput [{{ name: "Y" {tensor} }}]\n'
        'parameters { key: "load" value { string_value: "on-demand" } }\n'
        f'model_warmup [{{ name: "zeros" batch_size: 1 inputs {{ key: "X" value: {{ {tensor} zero_data: true }} }} }}]\n'
    )
    (repo / "selfish" / "1" / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        x = pb_utils.get_input_tensor_by_name(requests[0], 'X').as_numpy()\n"
        "        response = pb_utils.InferenceRequest(model_name='back', requested_output_names=['OUT'],\n"
        "                                             inputs=[pb_utils.Tensor('IN', x)]).exec()\n"
        "        if response.has_error():\n"
        "            raise RuntimeError(response.error().message())\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('Y', x)])]\n"
    )
    (repo / "back" / "1").mkdir(parents=True)
    (repo / "back" / "config.pbtxt").write_text(
        f'platform: "ensemble"\ninput [{{ name: "IN" {tensor} }}]\noutput [{{ name: "OUT" {tensor} }}]\n'
        'ensemble_scheduling { step [ { model_name: "selfish" model_version: -1 '
        'input_map { key: "X" value: "IN" } output_map { key: "Y" value: "OUT" } } ] }\n'
    )
    daemon = start_daemon("--model-repository", str(repo))
    x = json.dumps({"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [1, 2]}]})
    reply = daemon.request("POST", "/v2/models/selfish/infer", x, {"Content-Type": "application/json"}, timeout=30)
    assert reply.status >= 400, reply.body
    assert "model 'selfish' is asked for by its own load" in reply.json()["error"]


def test_repeated_server_faults_are_one_log_line_a_minute(start_daemon, tmp_path: Path) -> None:
    """A client retrying a failing model in a loop must not fill the journal: the 5xx answers
    of one status are one warning line a minute, on the lean path as on aiohttp's."""
    repo = tmp_path / "repo"
    (repo / "bad_exec" / "1").mkdir(parents=True)
    (repo / "bad_exec" / "config.pbtxt").write_text(
        'backend: "python"\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }]\n'
    )
    (repo / "bad_exec" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def execute(self, requests):\n        raise ValueError('kaboom')\n"
    )
    daemon = start_daemon("--model-repository", str(repo))
    body = json.dumps({"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [1, 2]}]})
    for _ in range(15):
        _assert_error(daemon.post_json("/v2/models/bad_exec/infer", json.loads(body)), 500, "kaboom")
        # gzip: relayed to aiohttp's route.
        _assert_error(daemon.request("POST", "/v2/models/bad_exec/infer", gzip.compress(body.encode()),
                                     {"Content-Type": "application/json", "Content-Encoding": "gzip"}), 500, "kaboom")
    lines = [line for line in daemon.log().splitlines() if "-> 500" in line]
    assert len(lines) == 2, lines
