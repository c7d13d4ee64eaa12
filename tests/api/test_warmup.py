"""Triton's model warmup over a real daemon: the samples each instance runs before the model
is served (zeros, random bytes, a file's data, strings), counted in the statistics as Triton
counts them, and the loads a sample fails with Triton's texts. Side by side with Triton 2.51:
tests/compat/test_oracle.py::test_model_warmup_as_tritons."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support import DaemonProcess, start_daemon_process

# Every request's inputs, as the model saw them (dtype, shape, values), sent back as SEEN.
RECORDER = '''\
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.seen = []

    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = {}
            for tensor in request.inputs():
                array = tensor.as_numpy()
                values = [v.decode() if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
                inputs[tensor.name()] = [str(array.dtype), list(array.shape), values]
            if inputs.get("X", [0, 0, [0]])[2][0] == 13:
                raise ValueError("13 is unlucky")
            self.seen.append({"batch": len(requests), **inputs})
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("SEEN", np.array([json.dumps(self.seen).encode()], dtype=object))]))
        return responses
'''


def _model(repo: Path, name: str, warmup: str, *, max_batch_size: int = 0, files: dict[str, bytes] | None = None) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(RECORDER)
    for file, data in (files or {}).items():
        (repo / name / "warmup").mkdir(exist_ok=True)
        (repo / name / "warmup" / file).write_bytes(data)
    (repo / name / "config.pbtxt").write_text(
        f'backend: "python"\nmax_batch_size: {max_batch_size}\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "S" data_type: TYPE_STRING dims: [ 2 ] }]\n'
        'output [{ name: "SEEN" data_type: TYPE_STRING dims: [ 1 ] }]\n'
        "instance_group [{ kind: KIND_CPU count: 1 }]\n" + warmup
    )


def _sample(name: str, batch_size: int, x: str, s: str, count: int = 0) -> str:
    return (f'{{ name: "{name}" batch_size: {batch_size} count: {count} inputs [ '
            f'{{ key: "X" value: {{ data_type: TYPE_FP32 dims: [ 2 ] {x} }} }}, '
            f'{{ key: "S" value: {{ data_type: TYPE_STRING dims: [ 2 ] {s} }} }} ] }}')


def _seen(daemon: DaemonProcess, model: str, batched: bool) -> list[dict[str, Any]]:
    shape = [1, 2] if batched else [2]
    reply = daemon.post_json(f"/v2/models/{model}/infer", {"inputs": [
        {"name": "X", "shape": shape, "datatype": "FP32", "data": [1, 2]},
        {"name": "S", "shape": shape, "datatype": "BYTES", "data": ["a", "b"]},
    ]})
    assert reply.status == 200, reply.body
    return json.loads(reply.json()["outputs"][0]["data"][0])[:-1]  # the warmups, not this request


def test_each_sample_runs_before_the_model_is_served(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    strings = b"".join(struct.pack("<I", len(t)) + t for t in (b"hi", b"there"))
    _model(repo, "warm", "model_warmup [ " + ", ".join([
        _sample("zeros", 1, "zero_data: true", "zero_data: true", count=2),
        _sample("random", 1, "random_data: true", "random_data: true"),
        _sample("skipped", 0, "zero_data: true", "zero_data: true"),
    ]) + " ]\n")
    _model(repo, "warm_batch", "model_warmup [ " + _sample(
        "files", 3, 'input_data_file: "x.bin"', 'input_data_file: "s.bin"') + " ]\n",
        max_batch_size=4, files={"x.bin": np.array([3, 4, 5], np.float32).tobytes(), "s.bin": strings})
    daemon = start_daemon_process(tmp_path, "--model-repository", str(repo), http=True)
    try:
        zeros = {"batch": 1, "X": ["float32", [2], [0.0, 0.0]], "S": ["object", [2], ["", ""]]}
        seen = _seen(daemon, "warm", batched=False)
        assert seen[:2] == [zeros, zeros]  # count 2
        # Random bytes as the datatype; strings get zeros (empty), as in Triton.
        assert seen[2]["X"][:2] == ["float32", [2]] and seen[2]["S"] == ["object", [2], ["", ""]]
        assert len(seen) == 3  # the batch-size-0 sample is skipped
        # Three requests of one row, executed together; the file's data (longer than needed).
        assert _seen(daemon, "warm_batch", batched=True) == [
            {"batch": 3, "X": ["float32", [1, 2], [3.0, 4.0]], "S": ["object", [1, 2], ["hi", "there"]]}] * 3
        stats = daemon.request("GET", "/v2/models/warm_batch/stats").json()["model_stats"][0]
        assert (stats["inference_count"], stats["execution_count"]) == (4, 2)
        assert [row["batch_size"] for row in stats["batch_stats"]] == [1, 3]
        served = daemon.request("GET", "/v2/models/warm/config").json()["model_warmup"]
        assert served[0] == {"name": "zeros", "batch_size": 1, "count": 2, "inputs": {
            "X": {"data_type": "TYPE_FP32", "dims": [2], "zero_data": True},
            "S": {"data_type": "TYPE_STRING", "dims": [2], "zero_data": True}}}
    finally:
        daemon.stop()


@pytest.mark.parametrize(("x", "files", "message"), [
    ("input_data_file: \"x.bin\"", {"x.bin": b"\0" * 7},
     "warmup setting expects 8 bytes, but the data provided from x.binonly has 7 bytes"),
    ("input_data_file: \"../config.pbtxt\"", {}, "input_data_file '../config.pbtxt' is outside warmup/"),
    ("input_data_file: \"missing.bin\"", {}, "cannot read warmup/missing.bin"),
    ("", {}, "warmup setting expects input 'X' to have input_data_type set"),
    ("random_data: true zero_data: true", {}, "another member of oneof \"input_data_type\""),
])
def test_a_sample_that_cannot_be_made_fails_the_load(tmp_path: Path, x: str, files: dict[str, bytes], message: str) -> None:
    repo = tmp_path / "repo"
    _model(repo, "bad", "model_warmup [ " + _sample("s", 1, x, "zero_data: true") + " ]\n", files=files)
    daemon = start_daemon_process(tmp_path, "--model-repository", str(repo), "--model-control-mode", "explicit",
                                  http=True)
    try:
        reply = daemon.request("POST", "/v2/repository/models/bad/load")
        assert reply.status == 400 and message in reply.json()["error"], reply.body
    finally:
        daemon.stop()


def test_a_failing_sample_fails_the_load_with_tritons_text(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _model(repo, "unlucky", "model_warmup [ " + _sample("thirteen", 1, 'input_data_file: "x.bin"', "zero_data: true")
           + " ]\n", files={"x.bin": np.array([13, 0], np.float32).tobytes()})
    daemon = start_daemon_process(tmp_path, "--model-repository", str(repo), "--model-control-mode", "explicit",
                                  http=True)
    try:
        reply = daemon.request("POST", "/v2/repository/models/unlucky/load")
        assert reply.status == 400
        assert ("failed to run warmup sample 'thirteen': Failed to process the request(s) for model 'unlucky_0_0', "
                "message: ValueError: 13 is unlucky; ") in reply.json()["error"]
        assert daemon.request("GET", "/v2/models/unlucky/ready").status == 400
    finally:
        daemon.stop()


def _custom_sample(batch_size: int, x_type: str = "TYPE_FP32", x_dims: str = "2", key: str = "X") -> str:
    return (f'model_warmup [{{ name: "s" batch_size: {batch_size} inputs [ '
            f'{{ key: "{key}" value: {{ data_type: {x_type} dims: [ {x_dims} ] random_data: true }} }}, '
            '{ key: "S" value: { data_type: TYPE_STRING dims: [ 2 ] zero_data: true } } ] }]\n')


def test_a_sample_is_checked_as_a_request_before_its_data_is_made(tmp_path: Path) -> None:
    """As Triton checks a warmup request before it runs (its texts): the batch size against the
    model's (1 where it does not batch: the config's documented rule, on which Triton 2.51
    crashes), inputs, data types and shapes against the config. Before, edged ran such samples
    (a model fed FP32 where it declared INT32 loaded), and a sample of 2**31 requests or
    2**40 elements filled the memory or answered 500 before anything was checked."""
    repo = tmp_path / "repo"
    for name, warmup, batch in (
        ("too_many", _custom_sample(5), 4),
        ("not_batched", _custom_sample(2), 0),
        ("whole_memory", _custom_sample(2**31 - 1), 8),
        ("shape", _custom_sample(1, x_dims="3"), 0),
        ("huge", _custom_sample(1, x_dims=str(2**40)), 4),
        ("dtype", _custom_sample(1, x_type="TYPE_INT32"), 0),
        ("stranger", _custom_sample(1, key="Y"), 0),
    ):
        _model(repo, name, warmup, max_batch_size=batch)
    (repo / "variable" / "1").mkdir(parents=True)
    (repo / "variable" / "1" / "model.py").write_text(RECORDER)
    (repo / "variable" / "config.pbtxt").write_text(
        'backend: "python"\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ -1, -1 ] }]\n'
        'output [{ name: "SEEN" data_type: TYPE_STRING dims: [ 1 ] }]\n'
        f'model_warmup [{{ name: "s" batch_size: 1 inputs [ {{ key: "X" value: {{ data_type: TYPE_FP32 '
        f'dims: [ {2**40}, {2**40} ] random_data: true }} }} ] }}]\n'
    )
    daemon = start_daemon_process(tmp_path, "--model-repository", str(repo), "--model-control-mode", "explicit",
                                  http=True)
    try:
        for model, words in (
            ("too_many", "failed to run warmup sample 's': batch size 5 for 'too_many_0', max allowed is 4; "),
            ("not_batched", "failed to run warmup sample 's': batch size 2 for 'not_batched_0', max allowed is 1; "),
            ("whole_memory", "batch size 2147483647 for 'whole_memory_0', max allowed is 8; "),
            ("shape", "failed to run warmup sample 's': unexpected shape for input 'X' for model 'shape'. "
                      "Expected [2], got [3]"),
            ("huge", f"unexpected shape for input 'X' for model 'huge'. Expected [-1,2], got [1,{2**40}]"),
            ("dtype", "failed to run warmup sample 's': inference input 'X' data-type is 'INT32', but model 'dtype' "
                      "expects 'FP32'"),
            ("stranger", "failed to run warmup sample 's': unexpected inference input 'Y' for model 'stranger'"),
            ("variable", f"warmup input 'X': {4 * 2**80} bytes of data for shape [{2**40}, {2**40}] cannot be "
                         "allocated"),
        ):
            reply = daemon.request("POST", f"/v2/repository/models/{model}/load")
            assert reply.status == 400 and words in reply.json()["error"], (model, reply.body)
        assert daemon.request("GET", "/v2/health/live").status == 200
    finally:
        daemon.stop()
