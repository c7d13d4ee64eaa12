"""Triton's classification extension through the real `tritonclient` (`class_count`) over TCP:
top-K as BYTES "score:index[:label]", labels from the output's `label_filename`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from support import DaemonProcess  # noqa: E402


def _scores_onnx(path: Path, batch: bool) -> None:
    """SCORES = INPUT (FP32), COUNTS = INPUT as INT32, FLAGS = INPUT > 0 (BOOL)."""
    import onnx
    from onnx import TensorProto, helper

    shape: list[Any] = ["batch", 5] if batch else [5]
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["INPUT"], ["SCORES"]),
            helper.make_node("Cast", ["INPUT"], ["COUNTS"], to=TensorProto.INT32),
            helper.make_node("Cast", ["INPUT"], ["FLAGS"], to=TensorProto.BOOL),
        ],
        "scores",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("SCORES", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("COUNTS", TensorProto.INT32, shape),
         helper.make_tensor_value_info("FLAGS", TensorProto.BOOL, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    path.parent.mkdir(parents=True)
    onnx.save(model, str(path))


LABELS = ["cat", "dog", "bird", "fish"]  # one fewer than classes: index 4 has no label


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    for name, batch in (("scores", True), ("scores_nobatch", False)):
        _scores_onnx(repo / name / "1" / "model.onnx", batch)
        (repo / name / "labels.txt").write_text("\n".join(LABELS) + "\n")
        (repo / name / "config.pbtxt").write_text(
            f'platform: "onnxruntime_onnx"\nmax_batch_size: {8 if batch else 0}\n'
            'input [{ name: "INPUT" data_type: TYPE_FP32 dims: [5] }]\n'
            'output [{ name: "SCORES" data_type: TYPE_FP32 dims: [5] label_filename: "labels.txt" },\n'
            '        { name: "COUNTS" data_type: TYPE_INT32 dims: [5] },\n'
            '        { name: "FLAGS" data_type: TYPE_BOOL dims: [5] }]\n'
        )
    return repo


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, repo: Path) -> Iterator[DaemonProcess]:
    from support import start_daemon_process

    daemon = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield daemon
    daemon.stop()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Any]:
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
    yield client
    client.close()


ROWS = np.array([[0.1, 0.7, 0.05, 0.7, 0.15], [3.0, 1.0, 4.0, 1.0, 5.0]], dtype=np.float32)


def _infer(client: Any, model: str, data: np.ndarray, *outputs: Any) -> Any:
    inp = httpclient.InferInput("INPUT", list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    return client.infer(model, [inp], outputs=list(outputs))


@pytest.mark.parametrize("binary", [True, False])
def test_top_k_with_labels_per_batch_item(client: Any, binary: bool) -> None:
    out = httpclient.InferRequestedOutput("SCORES", binary_data=binary, class_count=3)
    result = _infer(client, "scores", ROWS, out)
    assert result.get_output("SCORES")["datatype"] == "BYTES"
    assert result.get_output("SCORES")["shape"] == [2, 3]
    got = result.as_numpy("SCORES")
    # Ties keep the lower index first; index 4 has no label line, so no label.
    assert [[item.decode() if isinstance(item, bytes) else item for item in row] for row in got] == [
        ["0.700000:1:dog", "0.700000:3:fish", "0.150000:4"],
        ["5.000000:4", "4.000000:2:bird", "3.000000:0:cat"],
    ]


def test_integer_scores_k_above_classes_and_no_batch(client: Any) -> None:
    out = httpclient.InferRequestedOutput("COUNTS", class_count=10)
    result = _infer(client, "scores_nobatch", ROWS[1], out)
    assert result.get_output("COUNTS")["shape"] == [5]  # min(K, classes), no batch dim
    assert [b.decode() for b in result.as_numpy("COUNTS")] == ["5:4", "4:2", "3:0", "1:1", "1:3"]
    plain = _infer(client, "scores_nobatch", ROWS[1], httpclient.InferRequestedOutput("SCORES"))
    np.testing.assert_array_equal(plain.as_numpy("SCORES"), ROWS[1])


def test_label_file_edits_are_picked_up(client: Any, repo: Path) -> None:
    labels = repo / "scores" / "labels.txt"
    try:
        labels.write_text("zero\none\ntwo\nthree\nfour and more\n")
        out = httpclient.InferRequestedOutput("SCORES", class_count=1)
        assert _infer(client, "scores", ROWS[1:], out).as_numpy("SCORES")[0][0] == b"5.000000:4:four and more"
    finally:
        labels.write_text("\n".join(LABELS) + "\n")


def test_bad_classification_requests(client: Any, daemon: DaemonProcess) -> None:
    with pytest.raises(InferenceServerException, match="class result not available for output due to "
                                                        "unsupported type 'BOOL'") as exc:
        _infer(client, "scores", ROWS, httpclient.InferRequestedOutput("FLAGS", class_count=2))
    assert exc.value.status() == "400"
    body = {"inputs": [{"name": "INPUT", "shape": [1, 5], "datatype": "FP32", "data": ROWS[0].tolist()}],
            "outputs": [{"name": "SCORES", "parameters": {"classification": -1}}]}
    reply = daemon.request("POST", "/v2/models/scores/infer", json.dumps(body))
    assert reply.status == 400
    assert "'classification' must be a non-negative integer, got -1" in reply.json()["error"]
    body["outputs"] = [{"name": "SCORES", "parameters": {"classification": 0}}]  # 0 = not asked
    reply = daemon.request("POST", "/v2/models/scores/infer", json.dumps(body))
    assert reply.status == 200 and reply.json()["outputs"][0]["datatype"] == "FP32"


def test_config_keeps_label_filename(client: Any) -> None:
    config = client.get_model_config("scores")
    assert config["output"][0]["label_filename"] == "labels.txt"
    assert "label_filename" not in config["input"][0]


