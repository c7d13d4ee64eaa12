"""Triton's ragged batching over a real daemon: an input with `allow_ragged_batch` lets requests
of different shapes share a batch; on ONNX Runtime and OpenVINO their elements reach the model
end to end with the `batch_input` tensors Triton's backends make, and a `batch_output` is cut
back by each request's shape. Every answer against numpy, batched == alone; a python model
gets such requests as they were sent; what cannot work is refused at load, naming why."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support import python_model

pytest.importorskip("onnxruntime")

from model_builders import RAGGED_CONFIG, build_ragged_onnx

BACKENDS = ["onnxruntime", pytest.param("openvino", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("openvino"), reason="openvino is not installed"))]


def _body(x: np.ndarray) -> str:
    return json.dumps({"inputs": [{"name": "INPUT", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]})


def _outputs(reply: Any) -> dict[str, np.ndarray]:
    assert reply.status == 200, reply.body
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in reply.json()["outputs"]}


def _ragged_repo(repo: Path, backend: str, delay_us: int) -> None:
    build_ragged_onnx(repo / "ragged" / "1" / "model.onnx")
    (repo / "ragged" / "config.pbtxt").write_text(
        f'backend: "{backend}"\n' + RAGGED_CONFIG
        + "instance_group [{ count: 1 kind: KIND_CPU }]\n"
        + f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_of_different_lengths_share_a_batch(start_daemon, tmp_path: Path, backend: str) -> None:
    repo = tmp_path / "repo"
    # Long enough that the six concurrent requests all arrive before the batch leaves.
    _ragged_repo(repo, backend, 500_000)
    daemon = start_daemon("--model-repository", str(repo))
    # Integer values: every sum is exact in FP32, whatever the order the model adds in.
    rng = np.random.default_rng(3)
    xs = [rng.integers(-50, 50, (1, n)).astype(np.float32) for n in (1, 5, 2, 9, 3, 4)]

    def call(x: np.ndarray) -> dict[str, np.ndarray]:
        return _outputs(daemon.request("POST", "/v2/models/ragged/infer", _body(x),
                                       {"Content-Type": "application/json"}))

    barrier = threading.Barrier(len(xs))

    def at_once(x: np.ndarray) -> dict[str, np.ndarray]:
        barrier.wait()  # all sent together, well inside the batch's delay on a slow machine too
        return call(x)

    with ThreadPoolExecutor(len(xs)) as pool:
        together = list(pool.map(at_once, xs))
    for x, got in zip(xs, together, strict=True):
        assert got["SUM"].tolist() == [[x.sum()]]
        assert got["N"].tolist() == [[x.size]]
        assert got["SHAPE"].tolist() == [[x.shape[1]]]
        # The scattered output takes the request's own shape of INPUT.
        assert got["DOUBLE"].shape == x.shape and np.array_equal(got["DOUBLE"], 2 * x)
    stats = daemon.request("GET", "/v2/models/ragged/stats").json()["model_stats"][0]
    assert [b["batch_size"] for b in stats["batch_stats"]] == [len(xs)]  # one execution, all six
    for x, got in zip(xs, together, strict=True):
        alone = call(x)
        assert all(np.array_equal(alone[name], got[name]) for name in got)
    # A request of two rows has an item shape per row, and its scattered output its shape.
    two_rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = call(two_rows)
    assert got["SHAPE"].tolist() == [[3], [3]]
    assert got["DOUBLE"].shape == (2, 3) and np.array_equal(got["DOUBLE"], 2 * two_rows)
    config = daemon.request("GET", "/v2/models/ragged/config").json()
    assert config["input"][0]["allow_ragged_batch"] is True
    assert config["batch_input"][0] == {"kind": "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", "target_name": ["INDEX"],
                                        "data_type": "TYPE_INT32", "source_input": ["INPUT"]}
    assert config["batch_output"] == [{"target_name": ["DOUBLE"], "kind": "BATCH_SCATTER_WITH_INPUT_SHAPE",
                                       "source_input": ["INPUT"]}]
    # A batch input is the daemon's to make: the model's metadata lists INPUT only.
    assert [t["name"] for t in daemon.request("GET", "/v2/models/ragged").json()["inputs"]] == ["INPUT"]


RECORDING = """
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        shapes = [list(pb_utils.get_input_tensor_by_name(r, "x").shape()) for r in requests]
        with open(os.environ["RAGGED_LOG"], "a") as log:
            log.write(json.dumps(shapes) + "\\n")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", np.array([[s[1]]], dtype=np.int32))])
                for s in shapes]
"""


SCHEDULERS = {
    "dynamic": "dynamic_batching { max_queue_delay_microseconds: 500000 }\n",
    "sequence": "sequence_batching { oldest { max_candidate_sequences: 8 max_queue_delay_microseconds: 500000 } }\n",
}


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("ragged", [True, False])
def test_a_python_model_gets_ragged_requests_as_sent(start_daemon, tmp_path: Path, ragged: bool,
                                                     scheduler: str) -> None:
    """As in Triton: without allow_ragged_batch, only requests of one shape share a batch."""
    repo = tmp_path / "repo"
    folder = repo / "rec"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(RECORDING)
    (folder / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 8\n'
        f'input [ {{ name: "x" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: {str(ragged).lower()} }} ]\n'
        'output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        "instance_group [{ count: 1 kind: KIND_CPU }]\n" + SCHEDULERS[scheduler]
    )
    log = tmp_path / "shapes.log"
    daemon = start_daemon("--model-repository", str(repo), env={"RAGGED_LOG": str(log)})
    lengths = [2, 3, 2, 5]
    barrier = threading.Barrier(len(lengths))

    def call(index: int) -> int:
        n = lengths[index]
        parameters = ({"sequence_id": index + 1, "sequence_start": True, "sequence_end": True}
                      if scheduler == "sequence" else {})
        barrier.wait()
        got = _outputs(daemon.request("POST", "/v2/models/rec/infer", json.dumps({"parameters": parameters, "inputs": [
            {"name": "x", "shape": [1, n], "datatype": "FP32", "data": [0.5] * n}]}),
            {"Content-Type": "application/json"}))
        return int(got["y"][0][0])

    with ThreadPoolExecutor(len(lengths)) as pool:
        assert list(pool.map(call, range(len(lengths)))) == lengths
    batches = [json.loads(line) for line in log.read_text().splitlines()]
    if ragged:
        assert len(batches) == 1 and sorted(s[1] for s in batches[0]) == sorted(lengths)
    else:
        assert sorted(sorted(s[1] for s in b) for b in batches) == [[2, 2], [3], [5]]


def _load_error(daemon: Any, model: str) -> str:
    reply = daemon.request("POST", f"/v2/repository/models/{model}/load", "{}")
    assert reply.status == 400, reply.body
    return str(reply.json()["error"])


@pytest.mark.parametrize(("config", "error"), [
    # Triton's checks and texts (model_config_utils ValidateBatchIO).
    ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_INT32 source_input: ["X", "X"] } ]',
     "batch input kind 'BATCH_ELEMENT_COUNT' expects 1 source input, got 2 for m"),
    ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_INT64 source_input: "X" } ]',
     "batch input data type must be TYPE_INT32 or TYPE_FP32 for m"),
    ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" source_input: "X" } ]',
     "batch input data type must be TYPE_INT32 or TYPE_FP32 for m"),
    ('batch_input [ { kind: BATCH_ITEM_SHAPE target_name: "N" data_type: TYPE_INT32 source_input: "z" } ]',
     "unknown source input name 'z' for m"),
    ('batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "q" source_input: "X" } ]',
     "unknown target output name 'q' for m"),
    ('batch_output [ { target_name: ["Y", "Y"] source_input: "X" } ]',
     "target output name 'Y' can only be specified once for m"),
    ('batch_output [ { target_name: "Y" source_input: [] } ]',
     "batch output kind 'BATCH_SCATTER_WITH_INPUT_SHAPE' expects 1 source input, got 0 for m"),
    # edged's: no batch to describe on the python backend; a client cannot send a batch input.
    ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_INT32 source_input: "X" } ]',
     "model 'm': batch_input is set, but backend 'python' hands the model each request as sent, so there is "
     "no merged batch to describe (Triton's python backend ignores it)"),
    ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "X" data_type: TYPE_INT32 source_input: "X" } ]',
     "model 'm': batch input target 'X' is also an input of the config; a batch input is made by the backend, "
     "never sent by a client"),
])
def test_batch_io_errors(start_daemon, tmp_path: Path, config: str, error: str) -> None:
    repo = tmp_path / "repo"
    folder = python_model(repo, "m", "y = x")
    (folder / "config.pbtxt").write_text((folder / "config.pbtxt").read_text() + config + "\n")
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit")
    assert error in _load_error(daemon, "m")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_graph_mismatches_fail_the_load(start_daemon, tmp_path: Path, backend: str) -> None:
    repo = tmp_path / "repo"
    _ragged_repo(repo, backend, 0)
    (repo / "flat" / "1").mkdir(parents=True)
    (repo / "flat" / "1" / "model.onnx").write_bytes((repo / "ragged" / "1" / "model.onnx").read_bytes())
    # ITEM (a BATCH_ITEM_SHAPE of two dimensions) named as a one-dimensional kind.
    (repo / "flat" / "config.pbtxt").write_text(
        f'backend: "{backend}"\n'
        + RAGGED_CONFIG.replace("kind: BATCH_ITEM_SHAPE ", "kind: BATCH_ITEM_SHAPE_FLATTEN ")
    )
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit")
    assert "'ITEM'" in _load_error(daemon, "flat") and "BATCH_ITEM_SHAPE_FLATTEN" in _load_error(daemon, "flat")
    (repo / "flat" / "config.pbtxt").write_text(
        f'backend: "{backend}"\n'
        + RAGGED_CONFIG.replace("max_batch_size: 8", "max_batch_size: 0").replace("dims: [ 1 ]", "dims: [ -1, 1 ]")
    )
    assert ("model 'flat': input 'INPUT' sets allow_ragged_batch, which needs max_batch_size > 0 on backend "
            f"'{backend}'") in _load_error(daemon, "flat")
    reply = daemon.request("POST", "/v2/repository/models/ragged/load", "{}")
    assert reply.status == 200, reply.body
