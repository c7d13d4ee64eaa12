"""Triton's trace extension driven by the real `tritonclient.http` client over TCP, and the
trace file it leaves (timestamps of real requests)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
httpclient = pytest.importorskip("tritonclient.http")
from model_builders import write_simple_repository  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

DEFAULTS = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0",
            "trace_mode": "triton"}


def _infer(client) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    result = client.infer("simple", inputs, request_id="traced")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)


def test_trace_settings_and_file(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_simple_repository(repo, python=False)
    trace_file = tmp_path / "trace.json"
    config = tmp_path / "edged.toml"
    config.write_text(f'[trace]\nfile = "{trace_file}"\n')
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo), http=True)
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
    try:
        assert client.get_trace_settings() == {**DEFAULTS, "trace_file": str(trace_file)}
        # A model's settings override the global ones key by key.
        got = client.update_trace_settings(
            model_name="simple",
            settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "2",
                      "log_frequency": "2"},
        )
        assert got["trace_level"] == ["TIMESTAMPS"] and got["trace_count"] == "2"
        assert client.get_trace_settings()["trace_level"] == ["OFF"]
        for _ in range(3):
            _infer(client)
        # Two traces were allowed; the count is spent, and they were written together.
        assert client.get_trace_settings(model_name="simple")["trace_count"] == "0"
        written = Path(f"{trace_file}.0")
        for _ in range(100):  # the write runs in an executor thread
            if written.exists():
                break
            time.sleep(0.05)
        # Renamed into place whole: the file is never seen half-written, nothing is left beside it.
        traces = json.loads(written.read_text())
        assert sorted(p.name for p in tmp_path.iterdir()) == ["edged.toml", "repo", "trace.json.0"]
        assert [t["id"] for t in traces] == [1, 2]
        assert {t["model_name"] for t in traces} == {"simple"} and traces[0]["request_id"] == "traced"
        names = [s["name"] for s in traces[0]["timestamps"]]
        assert names == ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "REQUEST_END", "HTTP_SEND_START"]
        stamps = [s["ns"] for s in traces[0]["timestamps"]]
        assert stamps == sorted(stamps)
        # null clears a model's override; the global value shows through again.
        cleared = client.update_trace_settings(model_name="simple", settings={"trace_count": None})
        assert cleared["trace_count"] == "-1"
        # Triton's refusals.
        with pytest.raises(InferenceServerException, match="trace file location can not be updated"):
            client.update_trace_settings(settings={"trace_file": "/tmp/elsewhere"})
        with pytest.raises(InferenceServerException, match="Unable to parse 'trace_rate', got: fast"):
            client.update_trace_settings(settings={"trace_rate": "fast"})
        # A lone surrogate (Python's json reads `\ud800`) quoted back in the error: the error
        # response itself failed to encode and aiohttp answered its bare 500 page.
        reply = daemon.request("POST", "/v2/trace/setting", '{"trace_rate": "\\ud800"}')
        assert reply.status == 400, reply.body
        assert reply.json() == {"error": "Unable to parse 'trace_rate', got: \\ud800"}
        with pytest.raises(InferenceServerException, match="TENSORS is not supported"):
            client.update_trace_settings(settings={"trace_level": ["TENSORS"]})
        with pytest.raises(InferenceServerException, match="unknown trace setting 'bogus'"):
            client.update_trace_settings(settings={"bogus": "1"})
        with pytest.raises(InferenceServerException, match="Request for unknown model : nope"):
            client.get_trace_settings(model_name="nope")
        assert "trace" in client.get_server_metadata()["extensions"]
    finally:
        client.close()


def test_timestamps_need_a_trace_file(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_simple_repository(repo, python=False)
    daemon = start_daemon("--model-repository", str(repo), http=True)
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
    try:
        assert client.get_trace_settings()["trace_file"] == ""
        with pytest.raises(InferenceServerException, match="trace file name is not given"):
            client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
        assert client.get_trace_settings()["trace_level"] == ["OFF"]
    finally:
        client.close()
