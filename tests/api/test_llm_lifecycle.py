"""Generation models across a reload, and their engine counters in /metrics."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from gguf_builder import write_tiny_llama

from support import UnixHTTPConnection, wait_until


def _model(repo: Path, n_ctx: int = 2048) -> None:
    (repo / "tiny" / "1").mkdir(parents=True, exist_ok=True)
    write_tiny_llama(repo / "tiny" / "1" / "model.gguf", seed=1, n_ctx=n_ctx)
    (repo / "tiny" / "config.pbtxt").write_text(
        'backend: "llamacpp"\nparameters { key: "n_parallel" value { string_value: "2" } }\n'
    )


def test_a_reload_lets_running_generations_finish(start_daemon, tmp_path: Path) -> None:
    """A completions stream and a Responses stream, both running when the model reloads."""
    repo = tmp_path / "repo"
    _model(repo)
    daemon = start_daemon("--model-repository", str(repo))
    bodies = {
        "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 400, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}},
        "/v1/responses": {"model": "tiny", "input": "hello", "max_output_tokens": 400, "temperature": 0,
                          "stream": True},
    }
    events: dict[str, list[dict[str, object]]] = {path: [] for path in bodies}
    started = {path: threading.Event() for path in bodies}

    def stream(path: str) -> None:
        conn = UnixHTTPConnection(daemon.socket, timeout=120)
        conn.request("POST", path, json.dumps(bodies[path]), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200
        for raw in reply:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events[path].append(json.loads(line[6:]))
                started[path].set()
        conn.close()

    workers = [threading.Thread(target=stream, args=(path,)) for path in bodies]
    for worker in workers:
        worker.start()
    assert all(event.wait(60) for event in started.values())
    # A new version of the model appears mid-generation: SIGHUP loads it, swaps, retires the old.
    (repo / "tiny" / "config.pbtxt").write_text(
        'backend: "llamacpp"\nparameters { key: "n_parallel" value { string_value: "3" } }\n'
    )
    daemon.proc.send_signal(signal.SIGHUP)
    for worker in workers:
        worker.join(120)
    chunks = events["/v1/completions"]
    finals = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]  # type: ignore[index]
    assert finals, chunks[-3:]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 400  # type: ignore[index]
    last = events["/v1/responses"][-1]
    assert last["type"] == "response.incomplete", last["type"]
    assert last["response"]["usage"]["output_tokens"] == 400  # type: ignore[index]
    # ...and the new version serves afterwards.
    wait_until(lambda: json.loads(daemon.request("GET", "/v2/models/tiny").body)["engine"]["slots"] == 3)


def test_engine_counters_are_prometheus_metrics(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _model(repo)
    daemon = start_daemon("--model-repository", str(repo))
    prompt = {"model": "tiny", "prompt": "the same prompt twice", "max_tokens": 4, "temperature": 0}
    for _ in range(2):
        assert daemon.post_json("/v1/completions", prompt).status == 200
    text = daemon.request("GET", "/metrics").body.decode()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("edged_llm_") and 'model="tiny"' in line
    }
    assert values["edged_llm_slots"] == 2
    assert values["edged_llm_slots_busy"] == 0
    assert values["edged_llm_tokens_generated"] >= 8
    # The second identical prompt came from the slot's prefix cache.
    assert values["edged_llm_prompt_tokens_cached"] > 0
    assert values["edged_llm_kv_cells_total"] >= values["edged_llm_kv_cells_used"] > 0
    assert "# TYPE edged_llm_prompt_tokens_evaluated counter" in text
    # Time in decode steps: tokens/s while generating is tokens_generated / decode_seconds.
    assert "# TYPE edged_llm_decode_seconds counter" in text
    assert 0 < values["edged_llm_decode_seconds"] < 60
    longer = {**prompt, "prompt": "another prompt", "max_tokens": 32}
    assert daemon.post_json("/v1/completions", longer).status == 200
    again = daemon.request("GET", "/metrics").body.decode()
    seconds = next(float(line.rsplit(" ", 1)[1]) for line in again.splitlines()
                   if line.startswith('edged_llm_decode_seconds{model="tiny"'))
    assert seconds > values["edged_llm_decode_seconds"]


def test_llama_server_metric_families(start_daemon, tmp_path: Path) -> None:
    """llama-server's llamacpp:* families from the same engine, one model version a label set."""
    repo = tmp_path / "repo"
    _model(repo)
    daemon = start_daemon("--model-repository", str(repo))
    prompt = {"model": "tiny", "prompt": "the same prompt twice", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    usage = [daemon.post_json("/v1/completions", prompt).json()["usage"] for _ in range(2)]
    text = daemon.request("GET", "/metrics").body.decode()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if (line.startswith("llamacpp:") or line.startswith("edged_llm_")) and '{model="tiny",version="1"}' in line
    }
    for name, kind in (("prompt_tokens_total", "counter"), ("tokens_predicted_seconds_total", "counter"),
                       ("requests_processing", "gauge"), ("n_busy_slots_per_decode", "gauge")):
        assert f"# TYPE llamacpp:{name} {kind}\n" in text
    assert values["llamacpp:prompt_tokens_total"] == values["edged_llm_prompt_tokens_evaluated"]
    assert values["llamacpp:prompt_tokens_cached_total"] == values["edged_llm_prompt_tokens_cached"] > 0
    assert values["llamacpp:tokens_predicted_total"] == 8
    # Each request: its prompt in one decode, then one per token but the last (not decoded).
    assert values["llamacpp:n_decode_total"] == 8
    assert values["llamacpp:n_busy_slots_per_decode"] == 1.0  # one request at a time
    # The longest sequence: the prompt and the three generated tokens that were decoded.
    assert values["llamacpp:n_tokens_max"] == usage[0]["prompt_tokens"] + 3
    assert 0 < values["llamacpp:prompt_seconds_total"] < 60
    assert 0 < values["llamacpp:tokens_predicted_seconds_total"] < 60
    assert values["llamacpp:requests_processing"] == 0 and values["llamacpp:requests_deferred"] == 0
