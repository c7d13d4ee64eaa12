"""Triton's response cache over a real daemon: answers served again without running, what
makes another entry, the statistics and metrics Triton gives, and the configs it refuses.
Side by side with Triton 2.51: tests/compat/test_oracle.py::test_response_cache_as_tritons."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from support import DaemonProcess, cached_model, metric_samples, start_daemon_process


def _infer(daemon: DaemonProcess, model: str, x: list[float], outputs: list[str] | None = None,
           **params: Any) -> tuple[int, dict[str, Any]]:
    shape = [1, 2] if model.endswith("batching") else [2]
    body: dict[str, Any] = {"inputs": [{"name": "IN", "shape": shape, "datatype": "FP32", "data": x}]}
    if outputs:
        body["outputs"] = [{"name": o} for o in outputs]
    if params:
        body["parameters"] = params
    reply = daemon.post_json(f"/v2/models/{model}/infer", body)
    answer = reply.json()
    if reply.status != 200:
        return reply.status, answer
    return reply.status, {o["name"]: o["data"] for o in answer["outputs"]}


def _stats(daemon: DaemonProcess, model: str) -> dict[str, Any]:
    stats = daemon.request("GET", f"/v2/models/{model}/stats").json()["model_stats"][0]
    inference = stats["inference_stats"]
    return {
        "inference_count": stats["inference_count"], "execution_count": stats["execution_count"],
        **{key: inference[key]["count"] for key in ("success", "fail", "queue", "compute_infer", "cache_hit", "cache_miss")},
    }


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    cached_model(repo, "cached")
    cached_model(repo, "cached_batching", max_batch_size=4, extra="dynamic_batching { }\nresponse_cache { enable: true }\n")
    cached_model(repo, "uncached", extra="")
    return repo


def test_a_repeated_request_is_answered_from_the_cache(repo: Path, tmp_path: Path) -> None:
    daemon = start_daemon_process(tmp_path, "--model-repository", str(repo), "--cache-config", "local,size=1048576",
                                  http=True)
    try:
        first = _infer(daemon, "cached", [1, 2])
        assert first == (200, {"OUT": [2.0, 4.0], "RUNS": [1, 1]})
        assert _infer(daemon, "cached", [1, 2]) == first  # not run again
        assert _infer(daemon, "cached", [1, 3]) == (200, {"OUT": [2.0, 6.0], "RUNS": [2, 2]})
        # Other outputs asked for, or other parameters: another answer (Triton 2.51 gives the
        # first request's outputs and ignores the parameters).
        assert _infer(daemon, "cached", [1, 2], ["OUT"]) == (200, {"OUT": [2.0, 4.0]})
        assert _infer(daemon, "cached", [1, 2], ["RUNS"]) == (200, {"RUNS": [4, 4]})
        assert _infer(daemon, "cached", [1, 2], factor=3) == (200, {"OUT": [3.0, 6.0], "RUNS": [5, 5]})
        # Errors are not kept (Triton 2.51 keeps them as empty successes).
        for _ in range(2):
            assert _infer(daemon, "cached", [-1, 0]) == (500, {"error": "negative input"})
        assert _stats(daemon, "cached") == {
            "inference_count": 5, "execution_count": 7, "success": 6, "fail": 2, "queue": 6, "compute_infer": 5,
            "cache_hit": 1, "cache_miss": 5,
        }
        # Through the dynamic batcher too; a model without the setting runs every time.
        assert _infer(daemon, "cached_batching", [1, 2]) == _infer(daemon, "cached_batching", [1, 2]) == (
            200, {"OUT": [2.0, 4.0], "RUNS": [1, 1]})
        assert _infer(daemon, "uncached", [1, 2])[1]["RUNS"] == [1, 1]
        assert _infer(daemon, "uncached", [1, 2])[1]["RUNS"] == [2, 2]
        assert _stats(daemon, "uncached")["cache_hit"] == 0 == _stats(daemon, "uncached")["cache_miss"]
        text = daemon.request("GET", "/metrics").body.decode()
        samples = metric_samples(text, ("nv_cache_",))
        # Per model only where the config enables the cache, as Triton; the cache's own gauges.
        assert samples["nv_cache_num_hits_per_model"] == {
            (("model", "cached"), ("version", "1")): 1.0, (("model", "cached_batching"), ("version", "1")): 1.0}
        assert samples["nv_cache_num_misses_per_model"][(("model", "cached"), ("version", "1"))] == 5.0
        assert samples["nv_cache_num_entries"] == {(): 6.0}
        assert samples["nv_cache_num_hits"] == {(): 2.0} and samples["nv_cache_num_lookups"] == {(): 10.0}
        assert 0 < samples["nv_cache_util"][()] < 1
    finally:
        daemon.stop()


def test_a_reload_does_not_answer_from_the_old_models_entries(repo: Path, tmp_path: Path) -> None:
    daemon = start_daemon_process(tmp_path, "--model-repository", str(repo), "--cache-config", "local,size=1048576",
                                  "--model-control-mode", "explicit", "--load-model", "cached", http=True)
    try:
        assert _infer(daemon, "cached", [1, 2])[1]["RUNS"] == [1, 1]
        assert _infer(daemon, "cached", [1, 2])[1]["RUNS"] == [1, 1]
        model = repo / "cached" / "1" / "model.py"
        model.write_text(model.read_text().replace("(x * factor)", "(x * factor + 1)"))
        assert daemon.request("POST", "/v2/repository/models/cached/load").status == 200
        assert _infer(daemon, "cached", [1, 2]) == (200, {"OUT": [3.0, 5.0], "RUNS": [1, 1]})
        assert daemon.request("POST", "/v2/repository/models/cached/unload").status == 200
        text = daemon.request("GET", "/metrics").body.decode()
        assert metric_samples(text, ("nv_cache_num_entries",))["nv_cache_num_entries"] == {(): 0.0}
    finally:
        daemon.stop()


def test_without_a_cache_the_setting_changes_nothing(repo: Path, tmp_path: Path) -> None:
    daemon = start_daemon_process(tmp_path, "--model-repository", str(repo), http=True)
    try:
        assert _infer(daemon, "cached", [1, 2])[1]["RUNS"] == [1, 1]
        assert _infer(daemon, "cached", [1, 2])[1]["RUNS"] == [2, 2]
        assert "nv_cache" not in daemon.request("GET", "/metrics").body.decode()
    finally:
        daemon.stop()


@pytest.mark.parametrize(("extra", "what"), [
    ("sequence_batching { }\n", "with sequence batching scheduler"),
    ("model_transaction_policy { decoupled: true }\n", "with 'decoupled' transaction policy"),
])
def test_configs_triton_refuses_with_the_cache(tmp_path: Path, extra: str, what: str) -> None:
    repo = tmp_path / "repo"
    cached_model(repo, "bad", extra=extra + "response_cache { enable: true }\n")
    daemon = start_daemon_process(tmp_path, "--model-repository", str(repo), "--model-control-mode", "explicit",
                                  http=True)
    try:
        reply = daemon.request("POST", "/v2/repository/models/bad/load")
        assert reply.status == 400
        assert (f"Response Cache does not currently support model bad {what}. Please disable the response cache."
                in reply.json()["error"])
    finally:
        daemon.stop()
        shutil.rmtree(repo)
