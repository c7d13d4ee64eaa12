"""Dynamic batching seen from a client: concurrent requests over the Unix socket are merged
(batch stats show it), every answer equals numpy; queue full -> 503, queue timeout -> 503 (as Triton)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from support import python_model

pytest.importorskip("onnxruntime")

from model_builders import build_mlp_onnx, mlp_reference


def _infer_body(name: str, x: np.ndarray) -> str:
    return json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]})


def test_concurrent_requests_are_batched_and_exact(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "mlp" / "1").mkdir(parents=True)
    weights = build_mlp_onnx(repo / "mlp" / "1" / "model.onnx", width=64, depth=3, seed=7)
    (repo / "mlp" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 16\n'
        "instance_group [{ count: 1 kind: KIND_CPU }]\n"
        # Long enough that all eight concurrent requests arrive even on a loaded machine.
        "dynamic_batching { max_queue_delay_microseconds: 500000 }\n"
    )
    daemon = start_daemon("--model-repository", str(repo))
    meta = daemon.request("GET", "/v2/models/mlp").json()
    input_name = meta["inputs"][0]["name"]
    # Triton names an unnamed instance group <model>_<index> (model_analyzer reads it).
    assert [g["name"] for g in daemon.request("GET", "/v2/models/mlp/config").json()["instance_group"]] == ["mlp_0"]
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((rows, 64)).astype(np.float32) for rows in (1, 2, 3, 1, 2, 1, 3, 1)]

    def call(x: np.ndarray) -> np.ndarray:
        reply = daemon.request("POST", "/v2/models/mlp/infer", _infer_body(input_name, x),
                               {"Content-Type": "application/json"})
        assert reply.status == 200, reply.body
        out = reply.json()["outputs"][0]
        return np.array(out["data"], dtype=np.float32).reshape(out["shape"])

    with ThreadPoolExecutor(len(xs)) as pool:
        results = list(pool.map(call, xs))
    for x, got in zip(xs, results, strict=True):
        np.testing.assert_allclose(got, mlp_reference(x, weights), rtol=1e-4, atol=1e-5)
    # Batched == unbatched: the same inputs one at a time give the same numbers (GEMM kernels
    # may round differently by batch size, so to float32 precision rather than bit-for-bit).
    for x, got in zip(xs[:3], results[:3], strict=True):
        np.testing.assert_allclose(call(x), got, rtol=1e-6, atol=1e-6)
    stats = daemon.request("GET", "/v2/models/mlp/stats").json()["model_stats"][0]
    sizes = [b["batch_size"] for b in stats["batch_stats"]]
    assert max(sizes) > 3, sizes  # requests (of up to 3 rows) were merged
    assert stats["inference_count"] == sum(len(x) for x in xs) + sum(len(x) for x in xs[:3])
    assert stats["execution_count"] < len(xs) + 3


def test_queue_full_and_timeout_are_503(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    folder = python_model(repo, "slow", "import time\ntime.sleep(0.6)\ny = x")
    (folder / "config.pbtxt").write_text(
        (folder / "config.pbtxt").read_text()
        + "instance_group [{ count: 1 kind: KIND_CPU }]\n"
        "dynamic_batching { default_queue_policy { max_queue_size: 1 } }\n"
    )
    folder = python_model(repo, "timed", "import time\ntime.sleep(0.6)\ny = x")
    (folder / "config.pbtxt").write_text(
        (folder / "config.pbtxt").read_text()
        + "instance_group [{ count: 1 kind: KIND_CPU }]\n"
        "dynamic_batching { default_queue_policy { timeout_action: REJECT "
        "default_timeout_microseconds: 100000 } }\n"
    )
    daemon = start_daemon("--model-repository", str(repo))
    body = json.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]})

    def call(model: str) -> tuple[int, str]:
        reply = daemon.request("POST", f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"})
        return reply.status, reply.body.decode()

    with ThreadPoolExecutor(4) as pool:
        full = list(pool.map(call, ["slow"] * 4))
    rejected = [text for status, text in full if status == 503]
    assert rejected and all("queue" in t and "full" in t for t in rejected), full
    assert any(status == 200 for status, _ in full)

    with ThreadPoolExecutor(3) as pool:
        timed = list(pool.map(call, ["timed"] * 3))
    assert any(status == 503 and "timed out" in text for status, text in timed), timed
    assert any(status == 200 for status, _ in timed)
    assert daemon.request("GET", "/v2/models/slow/ready").status == 200
