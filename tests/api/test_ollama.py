"""The official `ollama` Python client against the daemon over TCP, serving tiny GGUF models on
llama.cpp (one loaded at start, others on demand) and an on-demand ONNX model over KServe."""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
ollama = pytest.importorskip("ollama")

from gguf_builder import write_tiny_llama  # noqa: E402

LLAMA = 'backend: "llamacpp"\nparameters { key: "n_parallel" value { string_value: "4" } }\n'
ON_DEMAND = 'parameters { key: "load" value { string_value: "on-demand" } }\n'


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ollama-repo")
    for name, seed, config in (
        ("tiny", 1, LLAMA + 'parameters { key: "n_ctx" value { string_value: "1024" } }\n'),
        ("embedder", 2, 'backend: "llamacpp"\nparameters { key: "embedding" value { string_value: "true" } }\n'),
        ("lazy", 3, LLAMA + ON_DEMAND),
        ("crowd", 4, LLAMA + ON_DEMAND),
    ):
        (path / name / "1").mkdir(parents=True)
        write_tiny_llama(path / name / "1" / "model.gguf", seed=seed, pooling=1 if name == "embedder" else None)
        (path / name / "config.pbtxt").write_text(config)
    pytest.importorskip("onnxruntime")
    from model_builders import build_mlp_onnx

    (path / "mlp" / "1").mkdir(parents=True)
    build_mlp_onnx(path / "mlp" / "1" / "model.onnx", width=4, depth=1)
    (path / "mlp" / "config.pbtxt").write_text('backend: "onnxruntime"\n' + ON_DEMAND)
    return path


@pytest.fixture(scope="module")
def daemon(repo: Path, tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


@pytest.fixture
def client(daemon) -> ollama.Client:
    return ollama.Client(host=f"http://127.0.0.1:{daemon.http_port}", timeout=120)


GREEDY = {"temperature": 0, "num_predict": 12}


def loaded(client: ollama.Client) -> set[str]:
    return {m.model for m in client.ps().models}


def test_root_version_and_head(daemon) -> None:
    base = f"http://127.0.0.1:{daemon.http_port}"
    with urllib.request.urlopen(base + "/") as reply:
        assert reply.status == 200 and reply.read() == b"Ollama is running"
    with urllib.request.urlopen(urllib.request.Request(base + "/", method="HEAD")) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(base + "/api/version") as reply:
        assert re.fullmatch(r"\d+\.\d+\.\d+", json.load(reply)["version"])


def test_openai_model_list_includes_on_demand_models(daemon) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.http_port}/v1/models") as reply:
        ids = [m["id"] for m in json.load(reply)["data"]]
    assert {"tiny", "embedder", "lazy", "crowd", "mlp"} <= set(ids) and len(ids) == len(set(ids))


def test_list_and_show(client: ollama.Client) -> None:
    models = {m.model: m for m in client.list().models}
    # Text models of the repository, loaded or not; the ONNX model is not an Ollama model.
    assert set(models) == {"tiny:latest", "embedder:latest", "lazy:latest", "crowd:latest"}
    tiny = models["tiny:latest"]
    assert tiny.details is not None and tiny.details.format == "gguf" and tiny.details.family == "llama"
    assert tiny.size and tiny.size > 100_000 and tiny.digest
    shown = client.show("tiny")
    assert shown.capabilities == ["completion"]
    assert "<|im_start|>" in (shown.template or "")
    assert shown.modelinfo is not None and shown.modelinfo["llama.context_length"] == 256
    assert client.show("embedder:latest").capabilities == ["embedding"]
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("nope")
    assert caught.value.status_code == 404


def test_chat_stream_and_final_counts(client: ollama.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = client.chat(model="tiny", messages=messages, options=GREEDY)
    assert full.done and full.done_reason == "length" and full.message.role == "assistant"
    assert full.eval_count == 12 and full.prompt_eval_count and full.prompt_eval_count > 5
    assert full.total_duration and full.eval_duration and full.prompt_eval_duration
    assert full.total_duration >= full.eval_duration + full.prompt_eval_duration
    parts = list(client.chat(model="tiny:latest", messages=messages, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == 12
    assert "".join(p.message.content or "" for p in parts) == full.message.content  # greedy
    assert parts[-1].message.content == ""


def test_generate_system_raw_template_and_stop(client: ollama.Client) -> None:
    base = client.generate(model="tiny", prompt="The quick brown fox", options={**GREEDY, "num_predict": 24})
    assert base.done_reason == "length" and len(base.response) > 4
    # With a system prompt the chat template changes the prompt: more tokens evaluated.
    with_system = client.generate(model="tiny", prompt="The quick brown fox", system="You are terse.", options=GREEDY)
    assert with_system.prompt_eval_count > base.prompt_eval_count
    # raw: the prompt as is; a template of just `{{ .Prompt }}` gives the same prompt.
    raw = client.generate(model="tiny", prompt="The quick brown fox", raw=True, options=GREEDY)
    templated = client.generate(model="tiny", prompt="The quick brown fox", template="{{ .Prompt }}", options=GREEDY)
    assert raw.response == templated.response and raw.prompt_eval_count == templated.prompt_eval_count
    assert raw.prompt_eval_count < base.prompt_eval_count
    text = base.response
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.generate(model="tiny", prompt="The quick brown fox", options={**GREEDY, "num_predict": 24, "stop": [stop]})
    assert cut.done_reason == "stop" and cut.response == text[: text.index(stop)]
    streamed = "".join(
        c.response for c in client.generate(
            model="tiny", prompt="The quick brown fox", stream=True, options={**GREEDY, "num_predict": 24, "stop": [stop]}
        )
    )
    assert streamed == cut.response


def test_unsupported_fields_are_400_naming_them(client: ollama.Client) -> None:
    chat = [{"role": "user", "content": "hi"}]
    cases = [
        (lambda: client.chat(model="tiny", messages=chat, options={"mirostat": 2}), "options.mirostat"),
        (lambda: client.chat(model="tiny", messages=chat, options={"num_ctx": 8192}), "num_ctx 8192"),
        (lambda: client.chat(model="tiny", messages=chat, format="json"), "format"),
        (lambda: client.chat(model="tiny", messages=chat, tools=[{"type": "function", "function": {"name": "f"}}]),
         "does not support tools"),
        (lambda: client.chat(model="tiny", messages=[{"role": "user", "content": "x", "images": [b"\x89PNG"]}]),
         "images"),
        (lambda: client.generate(model="tiny", prompt="x", template="{{ range .Messages }}{{ end }}"), "template"),
        (lambda: client.generate(model="tiny", prompt="x", suffix="y"), "suffix"),
        (lambda: client.generate(model="tiny", prompt="x", keep_alive="soon"), "keep_alive"),
        (lambda: client.generate(model="embedder", prompt="x"), "embedding"),
        (lambda: client.embed(model="embedder", input="x", dimensions=8), "dimensions"),
    ]
    for call, words in cases:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 400, (words, caught.value.error)
        assert words in caught.value.error, (words, caught.value.error)
    # num_ctx within the loaded context is fine; think is ignored as Ollama does without thinking.
    ok = client.chat(model="tiny", messages=chat, options={"num_ctx": 256, "num_predict": 2}, think=False)
    assert ok.done and ok.eval_count == 2
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="nope:latest", messages=chat)
    assert caught.value.status_code == 404 and "nope:latest" in caught.value.error


def test_embed_and_legacy_embeddings(client: ollama.Client) -> None:
    result = client.embed(model="embedder", input=["one", "two words"])
    assert len(result.embeddings) == 2 and len(result.embeddings[0]) == 64
    assert result.embeddings[0] != result.embeddings[1] and result.prompt_eval_count
    single = client.embed(model="embedder", input="one")
    assert single.embeddings[0] == pytest.approx(result.embeddings[0], abs=1e-6)
    legacy = client.embeddings(model="embedder", prompt="one")
    assert legacy.embedding == pytest.approx(result.embeddings[0], abs=1e-6)
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model="tiny", input="x")
    assert caught.value.status_code == 400


def test_pull_and_delete_on_an_offline_box(client: ollama.Client) -> None:
    assert client.pull("tiny").status == "success"
    assert [p.status for p in client.pull("tiny:latest", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as caught:
        client.pull("llama3:8b")
    assert caught.value.status_code == 404 and "does not download" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        client.delete("tiny")
    assert caught.value.status_code == 501 and "does not delete" in caught.value.error


def test_on_demand_load_ps_and_keep_alive_unload(client: ollama.Client, daemon) -> None:
    assert "lazy:latest" not in loaded(client)
    first = client.generate(model="lazy", prompt="")  # Ollama's "load this model"
    assert first.done and first.done_reason == "load" and first.load_duration and first.load_duration > 0
    (entry,) = [m for m in client.ps().models if m.model == "lazy:latest"]
    assert entry.size and entry.size > 100_000 and entry.expires_at is not None
    assert entry.context_length == 256
    answer = client.chat(model="lazy", messages=[{"role": "user", "content": "hi"}], options=GREEDY)
    assert answer.eval_count == 12 and answer.load_duration == 0  # already loaded
    gone = client.generate(model="lazy", prompt="", keep_alive=0)
    assert gone.done_reason == "unload"
    assert "lazy:latest" not in loaded(client)
    # The next request loads it again, and says how long it waited for that.
    again = client.chat(model="lazy", messages=[{"role": "user", "content": "hi"}], options=GREEDY, keep_alive="10m")
    assert again.load_duration and again.load_duration > 0 and again.eval_count == 12
    # A model loaded at start is not unloaded by keep_alive 0.
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="tiny", prompt="", keep_alive=0)
    assert caught.value.status_code == 400 and "load: startup" in caught.value.error
    assert "model lazy: loading on demand" in daemon.log()


def test_unload_waits_for_a_streaming_request(client: ollama.Client) -> None:
    stream = client.chat(model="lazy", messages=[{"role": "user", "content": "go"}], stream=True,
                         options={"temperature": 0, "num_predict": 40})
    parts = [next(stream)]
    # keep_alive 0 while the stream runs: the model unloads after it, never under it.
    assert client.generate(model="lazy", prompt="", keep_alive=0).done_reason == "unload"
    parts.extend(stream)
    assert parts[-1].done and parts[-1].eval_count == 40
    from support import wait_until

    wait_until(lambda: "lazy:latest" not in loaded(client), timeout=10)  # right after it ends


def test_concurrent_first_requests_load_once(client: ollama.Client, daemon) -> None:
    barrier = threading.Barrier(4)

    def ask(i: int) -> int | None:
        barrier.wait()
        reply = client.chat(model="crowd", messages=[{"role": "user", "content": f"hi {i}"}], options=GREEDY)
        return reply.eval_count

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == [12] * 4
    assert daemon.log().count("model crowd: loading on demand") == 1
    assert "crowd:latest" in loaded(client)


def test_on_demand_tensor_model_over_kserve(client: ollama.Client, daemon) -> None:
    assert "mlp:latest" not in loaded(client)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    reply = daemon.post_json("/v2/models/mlp/infer", body)
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"][0]["shape"] == [1, 4]
    (entry,) = [m for m in client.ps().models if m.model == "mlp:latest"]
    assert entry.details is not None and entry.details.format == "onnx"


def test_load_that_cannot_fit_the_budget_is_507(tmp_path: Path, start_daemon) -> None:
    repo = tmp_path / "repo"
    (repo / "lazy" / "1").mkdir(parents=True)
    write_tiny_llama(repo / "lazy" / "1" / "model.gguf", seed=3)
    (repo / "lazy" / "config.pbtxt").write_text(LLAMA + ON_DEMAND)
    from model_builders import build_mlp_onnx

    (repo / "pinned" / "1").mkdir(parents=True)
    build_mlp_onnx(repo / "pinned" / "1" / "model.onnx", width=4, depth=1)
    (repo / "pinned" / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    config = tmp_path / "edged.toml"
    # Both are estimated at the 1 MiB floor; the model loaded at start holds the whole budget.
    config.write_text('[residency]\nmemory-budget = "1MiB"\nmeasure = false\n')
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo), http=True)
    client = ollama.Client(host=f"http://127.0.0.1:{daemon.http_port}", timeout=60)
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="lazy", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 507
    assert "memory budget (residency.memory-budget = 1MiB" in caught.value.error
    assert "pinned 1 MiB" in caught.value.error
    assert loaded(client) == {"pinned:latest"} and daemon.alive()
