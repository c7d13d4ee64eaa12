"""`GET /v2` lists only extensions that work (issue 13 item 5): every name the running daemon
advertises is exercised with a real request over its Unix socket. A name without a check here
fails the test, so an extension cannot be advertised without one."""

from __future__ import annotations

import json
import struct
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from support import DaemonProcess, python_model, start_daemon_process

SEQUENCE_MODEL = """\
backend: "python"
input [{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }]
output [{ name: "ID" data_type: TYPE_STRING dims: [ 1 ] }]
sequence_batching { }
"""
SEQUENCE_CODE = """\
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            'ID', np.array([str(r.correlation_id()).encode()], dtype=object))]) for r in requests]
"""
PARAMS_CODE = """\
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            'ID', np.array([r.parameters().encode()], dtype=object))]) for r in requests]
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    repo = tmp_path_factory.mktemp("repo")
    python_model(repo, "ident", "y = x")
    for name, code in (("seq", SEQUENCE_CODE), ("params", PARAMS_CODE)):
        (repo / name / "1").mkdir(parents=True)
        config = SEQUENCE_MODEL if name == "seq" else SEQUENCE_MODEL.replace("sequence_batching { }\n", "")
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(code)
    base = tmp_path_factory.mktemp("edged")
    trace = base / "trace.json"
    (base / "edged.toml").write_text(f'[trace]\nfile = "{trace}"\n')
    process = start_daemon_process(
        base, "--config", str(base / "edged.toml"), "--model-repository", str(repo),
        "--model-control-mode", "explicit", "--load-model", "*",
    )
    yield process
    process.stop()


def _ident(daemon: DaemonProcess, **extra: object) -> object:
    body: dict[str, object] = {
        "inputs": [{"name": "X", "shape": [3], "datatype": "FP32", "data": [0.5, 2.0, 1.0]}]
    }
    body.update(extra)
    return daemon.post_json("/v2/models/ident/infer", body)


def check_classification(daemon: DaemonProcess) -> None:
    reply = _ident(daemon, outputs=[{"name": "Y", "parameters": {"classification": 2}}])
    assert reply.status == 200, reply.body
    out = reply.json()["outputs"][0]
    assert out["datatype"] == "BYTES"
    assert out["data"] == ["2.000000:1", "1.000000:2"]


def _seq(daemon: DaemonProcess, parameters: dict[str, object]) -> object:
    return daemon.post_json("/v2/models/seq/infer", {
        "inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}],
        "parameters": parameters,
    })


def check_sequence(daemon: DaemonProcess) -> None:
    reply = _seq(daemon, {"sequence_id": 42, "sequence_start": True, "sequence_end": True})
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"][0]["data"] == ["42"]
    missing = _seq(daemon, {})
    assert missing.status == 400
    assert "must specify a non-zero or non-empty correlation ID" in missing.json()["error"]


def check_sequence_string_id(daemon: DaemonProcess) -> None:
    reply = _seq(daemon, {"sequence_id": "abc", "sequence_start": True, "sequence_end": True})
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"][0]["data"] == ["abc"]


def check_model_repository(daemon: DaemonProcess) -> None:
    index = daemon.request("POST", "/v2/repository/index", "{}").json()
    assert {"ident", "seq", "params"} <= {m["name"] for m in index}
    assert daemon.request("POST", "/v2/repository/models/ident/unload").status == 200
    assert daemon.request("GET", "/v2/models/ident/ready").status != 200
    assert daemon.request("POST", "/v2/repository/models/ident/load").status == 200
    assert daemon.request("GET", "/v2/models/ident/ready").status == 200


def check_unload_dependents(daemon: DaemonProcess) -> None:
    reply = daemon.post_json("/v2/repository/models/params/unload",
                             {"parameters": {"unload_dependents": True}})
    assert reply.status == 200, reply.body
    assert daemon.request("GET", "/v2/models/params/ready").status != 200
    assert daemon.request("POST", "/v2/repository/models/params/load").status == 200


def check_schedule_policy(daemon: DaemonProcess) -> None:
    reply = _ident(daemon, parameters={"priority": 1, "timeout": 10_000_000})
    assert reply.status == 200, reply.body
    bad = _ident(daemon, parameters={"priority": -1})
    assert bad.status == 400
    assert "Unable to parse 'priority'" in bad.json()["error"]


def check_model_configuration(daemon: DaemonProcess) -> None:
    config = daemon.request("GET", "/v2/models/ident/config").json()
    assert config["name"] == "ident"
    assert config["input"][0]["name"] == "X"
    assert config["input"][0]["data_type"] == "TYPE_FP32"


def check_system_shared_memory(daemon: DaemonProcess) -> None:
    values = np.array([1.0, -2.0, 3.5], dtype=np.float32)
    key = f"/edged-ext-{uuid.uuid4().hex[:8]}"
    region = shared_memory.SharedMemory(name=key, create=True, size=values.nbytes)
    try:
        region.buf[: values.nbytes] = values.tobytes()
        reg = daemon.post_json("/v2/systemsharedmemory/region/in/register",
                               {"key": key, "offset": 0, "byte_size": values.nbytes})
        assert reg.status == 200, reg.body
        reply = daemon.post_json("/v2/models/ident/infer", {"inputs": [{
            "name": "X", "shape": [3], "datatype": "FP32",
            "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": values.nbytes},
        }]})
        assert reply.status == 200, reply.body
        assert reply.json()["outputs"][0]["data"] == [1.0, -2.0, 3.5]
        status = daemon.request("GET", "/v2/systemsharedmemory/status").json()
        assert [r["name"] for r in status] == ["in"]
        assert daemon.request("POST", "/v2/systemsharedmemory/region/in/unregister").status == 200
    finally:
        region.close()
        region.unlink()


def check_statistics(daemon: DaemonProcess) -> None:
    assert _ident(daemon).status == 200
    stats = daemon.request("GET", "/v2/models/ident/stats").json()["model_stats"][0]
    assert stats["name"] == "ident"
    assert stats["inference_stats"]["success"]["count"] >= 1


def check_binary_tensor_data(daemon: DaemonProcess) -> None:
    values = np.array([1.0, 2.5], dtype="<f4")
    header = json.dumps({
        "inputs": [{"name": "X", "shape": [2], "datatype": "FP32",
                    "parameters": {"binary_data_size": values.nbytes}}],
        "outputs": [{"name": "Y", "parameters": {"binary_data": True}}],
    }).encode()
    reply = daemon.request("POST", "/v2/models/ident/infer", header + values.tobytes(),
                           {"Inference-Header-Content-Length": str(len(header))})
    assert reply.status == 200, reply.body
    length = int(reply.headers["inference-header-content-length"])
    assert json.loads(reply.body[:length])["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert struct.unpack("<2f", reply.body[length:]) == (1.0, 2.5)


def check_parameters(daemon: DaemonProcess) -> None:
    reply = daemon.post_json("/v2/models/params/infer", {
        "inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}],
        "parameters": {"mode": "fast", "n": 3},
    })
    assert reply.status == 200, reply.body
    assert json.loads(reply.json()["outputs"][0]["data"][0]) == {"mode": "fast", "n": 3}


def check_generate(daemon: DaemonProcess) -> None:
    reply = daemon.post_json("/v2/models/ident/generate", {"X": [1.5, -3]})
    assert reply.status == 200, reply.body
    assert reply.json()["Y"] == [1.5, -3.0]
    # 256 KiB of body and of output or more: decoded and encoded on a worker thread, same answer.
    values = np.random.default_rng(2).standard_normal(70_000).astype(np.float32)
    body = json.dumps({"X": values.tolist()})
    assert len(body) >= 256 * 1024 and values.nbytes >= 256 * 1024
    reply = daemon.request("POST", "/v2/models/ident/generate", body, {"Content-Type": "application/json"})
    assert reply.status == 200, reply.body
    np.testing.assert_array_equal(np.asarray(reply.json()["Y"], dtype=np.float32), values)
    reply = daemon.request("POST", "/v2/models/ident/generate", body.replace("[", "{", 1))
    assert reply.status == 400 and "malformed JSON body" in reply.json()["error"]


def check_logging(daemon: DaemonProcess) -> None:
    before = daemon.request("GET", "/v2/logging").json()
    assert "log_verbose_level" in before
    reply = daemon.post_json("/v2/logging", {"log_verbose_level": 1})
    assert reply.status == 200, reply.body
    assert daemon.request("GET", "/v2/logging").json()["log_verbose_level"] == 1
    assert daemon.post_json("/v2/logging", {"log_verbose_level": before["log_verbose_level"]}).status == 200


def check_trace(daemon: DaemonProcess) -> None:
    settings = daemon.request("GET", "/v2/trace/setting")
    assert settings.status == 200, settings.body
    assert "trace_level" in settings.json()
    reply = daemon.post_json("/v2/models/ident/trace/setting", {"trace_level": ["TIMESTAMPS"]})
    assert reply.status == 200, reply.body
    assert daemon.request("GET", "/v2/models/ident/trace/setting").json()["trace_level"] == [
        "TIMESTAMPS"
    ]
    assert daemon.post_json("/v2/models/ident/trace/setting", {"trace_level": ["OFF"]}).status == 200


CHECKS: dict[str, Callable[[DaemonProcess], None]] = {
    "classification": check_classification,
    "sequence": check_sequence,
    "sequence(string_id)": check_sequence_string_id,
    "model_repository": check_model_repository,
    "model_repository(unload_dependents)": check_unload_dependents,
    "schedule_policy": check_schedule_policy,
    "model_configuration": check_model_configuration,
    "system_shared_memory": check_system_shared_memory,
    "statistics": check_statistics,
    "binary_tensor_data": check_binary_tensor_data,
    "parameters": check_parameters,
    "generate": check_generate,
    "logging": check_logging,
    "trace": check_trace,
}


def test_every_advertised_extension_works(daemon: DaemonProcess) -> None:
    extensions = daemon.request("GET", "/v2").json()["extensions"]
    unchecked = [name for name in extensions if name not in CHECKS]
    assert not unchecked, f"advertised without a test in {Path(__file__).name}: {unchecked}"
    failures: dict[str, str] = {}
    for name in extensions:
        try:
            CHECKS[name](daemon)
        except AssertionError as exc:
            failures[name] = str(exc) or repr(exc)
        assert daemon.alive()
    assert not failures, failures
