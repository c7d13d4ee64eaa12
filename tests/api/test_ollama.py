"""The official `ollama` Python client against the daemon over TCP, serving tiny GGUF models on
llama.cpp (one loaded at start, others on demand) and an on-demand ONNX model over KServe;
structured output (`format`) and tools."""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
ollama = pytest.importorskip("ollama")
jsonschema = pytest.importorskip("jsonschema")

from gguf_builder import with_fim_tokens, write_tiny_llama  # noqa: E402

LLAMA = 'backend: "llamacpp"\nparameters { key: "n_parallel" value { string_value: "4" } }\n'
ON_DEMAND = 'parameters { key: "load" value { string_value: "on-demand" } }\n'
# Room for the tools' description in the prompt (one sequence of 2048 tokens).
AGENT = ('backend: "llamacpp"\nparameters { key: "n_ctx" value { string_value: "2048" } }\n'
         'parameters { key: "n_parallel" value { string_value: "1" } }\n')


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ollama-repo")
    for name, seed, config in (
        ("tiny", 1, LLAMA + 'parameters { key: "n_ctx" value { string_value: "1024" } }\n'),
        ("embedder", 2, 'backend: "llamacpp"\nparameters { key: "embedding" value { string_value: "true" } }\n'),
        ("lazy", 3, LLAMA + ON_DEMAND),
        ("crowd", 4, LLAMA + ON_DEMAND),
        # Seed 4: greedy, this random model calls the weather tool below (and stops after one
        # call), where most seeds answer in text; see test_tool_call_comes_back_whole.
        ("agent", 4, AGENT),
    ):
        (path / name / "1").mkdir(parents=True)
        write_tiny_llama(path / name / "1" / "model.gguf", seed=seed, pooling=1 if name == "embedder" else None,
                         n_ctx=2048 if name == "agent" else 256)
        (path / name / "config.pbtxt").write_text(config)
    # A code model: the tiny one with fill-in-the-middle tokens named in its tokenizer.
    (path / "coder" / "1").mkdir(parents=True)
    with_fim_tokens(path / "tiny" / "1" / "model.gguf", path / "coder" / "1" / "model.gguf", 300, 301, 302)
    (path / "coder" / "config.pbtxt").write_text(LLAMA)
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
    assert {"tiny", "embedder", "lazy", "crowd", "agent", "mlp"} <= set(ids) and len(ids) == len(set(ids))


def test_list_and_show(client: ollama.Client) -> None:
    models = {m.model: m for m in client.list().models}
    # Text models of the repository, loaded or not; the ONNX model is not an Ollama model.
    assert set(models) == {"tiny:latest", "embedder:latest", "lazy:latest", "crowd:latest", "agent:latest",
                           "coder:latest"}
    tiny = models["tiny:latest"]
    assert tiny.details is not None and tiny.details.format == "gguf" and tiny.details.family == "llama"
    assert tiny.size and tiny.size > 100_000 and tiny.digest
    shown = client.show("tiny")
    assert shown.capabilities == ["completion", "tools"]  # tools work on every chat model
    assert "<|im_start|>" in (shown.template or "")
    assert shown.modelinfo is not None and shown.modelinfo["llama.context_length"] == 256
    assert client.show("embedder:latest").capabilities == ["embedding"]
    assert client.show("coder").capabilities == ["completion", "tools", "insert"]  # it has FIM tokens
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
        (lambda: client.chat(model="tiny", messages=[{"role": "user", "content": "x", "images": [b"\x89PNG"]}]),
         "images"),
        (lambda: client.generate(model="tiny", prompt="x", template="{{ range .Messages }}{{ end }}"), "template"),
        (lambda: client.generate(model="tiny", prompt="x", suffix="y"), "suffix: model 'tiny' has no fill-in-the-middle"),
        (lambda: client.generate(model="coder", prompt="x", suffix="y", system="s"), "suffix: not supported together"),
        (lambda: client.generate(model="tiny", prompt="x", keep_alive="soon"), "keep_alive"),
        (lambda: client.generate(model="embedder", prompt="x"), "embedding"),
        (lambda: client.embed(model="embedder", input="x", dimensions=100_000), "dimensions: the model's"),
        (lambda: client.embed(model="embedder", input="x", dimensions=0), "dimensions must be >= 1"),
    ]
    for call, words in cases:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 400, (words, caught.value.error)
        assert words in caught.value.error, (words, caught.value.error)
    # num_ctx within the loaded context is fine; think: false is what happens anyway.
    ok = client.chat(model="tiny", messages=chat, options={"num_ctx": 256, "num_predict": 2}, think=False)
    assert ok.done and ok.eval_count == 2
    # Thinking asked of a model that does not think: Ollama's 400 and text.
    for call in (lambda: client.chat(model="tiny", messages=chat, think=True),
                 lambda: client.generate(model="tiny", prompt="x", think="high")):
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 400 and caught.value.error == '"tiny" does not support thinking'
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="nope:latest", messages=chat)
    assert caught.value.status_code == 404 and "nope:latest" in caught.value.error


def test_logprobs_per_token_as_the_openai_route_gives_them(client: ollama.Client, daemon) -> None:
    """`logprobs` / `top_logprobs` (the ollama client sends them): one entry per generated
    token with its bytes and alternatives, the same as /v1/completions gives for the same
    prompt; streamed, each object carries its tokens' entries and they add up to the same."""
    greedy = {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}
    reply = client.generate(model="tiny", prompt="Once upon", raw=True, options=greedy, logprobs=True, top_logprobs=2)
    entries = reply.logprobs or []
    assert len(entries) == reply.eval_count == 8
    assert "".join(e.token for e in entries) == reply.response
    for entry in entries:
        top = entry.top_logprobs or []
        assert len(top) == 2 and top[0].token == entry.token and top[0].logprob == entry.logprob <= 0
    raw = {"model": "tiny", "prompt": "Once upon", "raw": True, "options": greedy, "logprobs": True, "stream": False}
    as_sent = daemon.request("POST", "/api/generate", json.dumps(raw).encode()).json()["logprobs"]
    assert [bytes(e["bytes"]).decode() for e in as_sent] == [e.token for e in entries]  # Ollama's bytes
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    openai = daemon.request("POST", "/v1/completions", json.dumps(body).encode()).json()["choices"][0]
    assert openai["text"] == reply.response
    assert [e.logprob for e in entries] == pytest.approx(openai["logprobs"]["token_logprobs"], abs=1e-3)
    streamed = []
    for part in client.generate(model="tiny", prompt="Once upon", raw=True, options=greedy, logprobs=True,
                                stream=True):
        assert len(part.logprobs or []) == (1 if part.response else 0)  # one token, one piece of text
        streamed.extend(part.logprobs or [])
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert all(e.top_logprobs is None for e in streamed)  # top_logprobs 0: none listed
    chat = client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], options=greedy, logprobs=True)
    assert "".join(e.token for e in chat.logprobs or []) == chat.message.content
    plain = client.generate(model="tiny", prompt="Once upon", raw=True, options=greedy)
    assert plain.logprobs is None and plain.response == reply.response
    for extra, words in [({"top_logprobs": 21, "logprobs": True}, "top_logprobs must be between 0 and 20"),
                         ({"top_logprobs": 2}, "top_logprobs: requires logprobs: true")]:
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model="tiny", prompt="x", **extra)
        assert caught.value.status_code == 400 and words in caught.value.error
    weather = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
    with pytest.raises(ollama.ResponseError, match="logprobs: not supported together with tools"):
        client.chat(model="tiny", messages=[{"role": "user", "content": "x"}], tools=[weather], logprobs=True)


def test_suffix_fills_in_the_middle(client: ollama.Client, daemon) -> None:
    """Ollama's suffix on a model with FIM tokens: the same prompt and text as the OpenAI
    completions route's suffix (whose FIM layout tests/backends/test_llamacpp.py checks)."""
    greedy = {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}
    reply = client.generate(model="coder", prompt="def f(", suffix="): pass", options=greedy)
    body = {"model": "coder", "prompt": "def f(", "suffix": "): pass", "max_tokens": 8, "temperature": 0}
    openai = daemon.request("POST", "/v1/completions", json.dumps(body).encode()).json()
    assert reply.response == openai["choices"][0]["text"] and reply.eval_count == 8
    assert reply.prompt_eval_count == openai["usage"]["prompt_tokens"]
    plain = client.generate(model="coder", prompt="def f(", options=greedy)
    assert plain.prompt_eval_count != reply.prompt_eval_count  # the suffix is in the prompt


def test_penalty_options_and_their_window(client: ollama.Client) -> None:
    """presence_penalty, frequency_penalty and repeat_penalty count the last repeat_last_n
    tokens (Ollama's default 64; 0 turns all three off, -1 is the whole context)."""
    def text(**options: object) -> str:
        reply = client.generate(model="tiny", prompt="Once upon a time there was",
                                options={"temperature": 0, "num_predict": 24, "repeat_penalty": 1.0, **options})
        return reply.response

    base = text()
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repeat_penalty": 1.8}):
        assert text(**penalty) != base, penalty
        assert text(**penalty, repeat_last_n=0) == base, penalty
    assert text(presence_penalty=2.0, repeat_last_n=-1) != base
    for options, words in (({"repeat_last_n": -2}, "options.repeat_last_n must be -1 (the context) or between 0 and "
                                                    "2147483647, got -2"),
                           ({"repeat_last_n": 2**32}, "options.repeat_last_n must be -1 (the context) or between 0 "
                                                      "and 2147483647, got 4294967296"),
                           ({"top_k": 2**32 + 1}, "options.top_k must be between -2147483648 and 2147483647"),
                           ({"presence_penalty": 2.5}, "options.presence_penalty must be between -2 and 2")):
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model="tiny", prompt="x", options=options)
        assert caught.value.status_code == 400 and words in caught.value.error


def test_null_is_not_given_as_in_ollamas_server(daemon) -> None:
    """Ollama's server (Go) reads null for any field as absent; raw clients and proxies send it."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi", "images": None, "thinking": None}],
            "stream": None, "format": None, "options": {"num_predict": 2}, "keep_alive": None, "think": None,
            "tools": None}
    reply = daemon.post_json("/api/chat", chat)
    # stream null = Ollama's default: streamed, one JSON object a line.
    lines = [json.loads(line) for line in reply.body.decode().splitlines()]
    assert reply.status == 200 and lines[-1]["done"] and lines[-1]["eval_count"] == 2, reply.body
    generate = {"model": "tiny", "prompt": "hi", "system": None, "template": None, "suffix": None, "raw": None,
                "context": None, "images": None, "stream": False, "options": {"num_predict": 2}}
    reply = daemon.post_json("/api/generate", generate)
    assert reply.status == 200 and reply.json()["eval_count"] == 2, reply.body
    # A wrong type is still a 400 naming the field, with or without nulls beside it.
    reply = daemon.post_json("/api/generate", {**generate, "stream": "no"})
    assert reply.status == 400 and "$.stream" in reply.json()["error"], reply.body
    reply = daemon.post_json("/api/chat", {**chat, "messages": [{"role": "user", "content": 5, "images": None}]})
    assert reply.status == 400 and "$.messages[0].content" in reply.json()["error"], reply.body
    # A wrong type first, then JSON that is not JSON (NaN, a lone surrogate): the typed decode
    # stops at the first; the second is found when the nulls are read, and is a 400 too.
    for path, body in (
        ("/api/generate", '{"model": "tiny", "stream": 1, "raw": NaN}'),
        ("/api/chat", '{"model": 5, "messages": [], "format": "\\ud800"}'),
        ("/api/embed", '{"model": "embedder", "truncate": "0", "input": Infinity}'),
    ):
        reply = daemon.request("POST", path, body, {"Content-Type": "application/json"})
        assert reply.status == 400 and reply.json()["error"].startswith("malformed JSON body: "), (path, reply.body)


def test_generate_context_continues_as_ollamas(client: ollama.Client, daemon) -> None:
    """Ollama's (deprecated) `context`: a non-raw generate's last object has the prompt and the
    reply tokenized (without the BOS); sent back, their text goes before the next turn's
    prompt, so the reply is the one a raw prompt of that text gives."""
    greedy = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 6}
    first = client.generate(model="tiny", prompt="Once upon a time", options=greedy)
    rendered = daemon.post_json("/apply-template", {"model": "tiny", "messages": [
        {"role": "user", "content": "Once upon a time"}]}).json()["prompt"]
    expected = daemon.post_json("/tokenize", {"model": "tiny", "content": rendered + first.response,
                                              "add_special": False, "parse_special": True}).json()["tokens"]
    assert first.context == expected
    # Streamed, the last object carries the same.
    streamed = list(client.generate(model="tiny", prompt="Once upon a time", options=greedy, stream=True))
    assert [part.context for part in streamed[:-1]] == [None] * (len(streamed) - 1)
    assert streamed[-1].context == expected
    second = client.generate(model="tiny", prompt="And then?", context=first.context, options=greedy)
    turn = daemon.post_json("/apply-template", {"model": "tiny", "messages": [
        {"role": "user", "content": "And then?"}]}).json()["prompt"]
    earlier = daemon.post_json("/detokenize", {"model": "tiny", "tokens": first.context}).json()["content"]
    raw = client.generate(model="tiny", prompt=earlier + turn, raw=True, options=greedy)
    assert second.response == raw.response and second.prompt_eval_count == raw.prompt_eval_count
    assert raw.context is None  # Ollama gives none for raw
    for body, error in (({"raw": True}, "raw mode does not support template, system, or context"),
                        ({"suffix": "x"}, "context: not supported together with suffix"),
                        ({"context": [1, 99999]}, "context: token id 99999 is out of range")):
        reply = daemon.post_json("/api/generate", {"model": "tiny", "prompt": "x", "stream": False,
                                                   "context": [1, 2], **body})
        assert reply.status == 400 and reply.json()["error"].startswith(error), reply.body


def test_embed_and_legacy_embeddings(client: ollama.Client) -> None:
    result = client.embed(model="embedder", input=["one", "two words"])
    assert len(result.embeddings) == 2 and len(result.embeddings[0]) == 64
    assert result.embeddings[0] != result.embeddings[1] and result.prompt_eval_count
    single = client.embed(model="embedder", input="one")
    assert single.embeddings[0] == pytest.approx(result.embeddings[0], abs=1e-6)
    legacy = client.embeddings(model="embedder", prompt="one")
    assert legacy.embedding == pytest.approx(result.embeddings[0], abs=1e-6)
    # dimensions: the first N components, normalised again (Matryoshka models).
    short = client.embed(model="embedder", input=["one", "two words"], dimensions=16)
    for full, cut in zip(result.embeddings, short.embeddings, strict=True):
        head = np.asarray(full[:16])
        assert cut == pytest.approx(list(head / np.linalg.norm(head)), abs=1e-6)
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model="tiny", input="x")
    assert caught.value.status_code == 400


def test_embed_truncates_as_ollama_does_unless_told_not_to(client: ollama.Client) -> None:
    """truncate (Ollama's default: true): a text longer than the model embeds at once keeps its
    first tokens, so what follows them changes nothing; truncate=false makes it a 400."""
    words = " ".join(f"w{i}" for i in range(3000))
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model="embedder", input=words, truncate=False)
    assert caught.value.status_code == 400
    limit = int(re.search(r"embeds at most (\d+) tokens", caught.value.error)[1])  # type: ignore[index]
    cut = client.embed(model="embedder", input=words)
    assert cut.prompt_eval_count == limit
    more = client.embed(model="embedder", input=[words + " and then some other words", "w0 w1"], truncate=True)
    assert more.prompt_eval_count == limit + client.embed(model="embedder", input="w0 w1").prompt_eval_count
    assert more.embeddings[0] == pytest.approx(cut.embeddings[0], abs=1e-6)
    assert more.embeddings[1] != pytest.approx(cut.embeddings[0], abs=1e-3)


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

    # Right after it ends (well before the default keep-alive of minutes); a loaded machine may
    # take a while to unload.
    wait_until(lambda: "lazy:latest" not in loaded(client), timeout=60)


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


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
        },
    },
}
MOOD = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["happy", "sad"]}},
    "required": ["ok", "mood"],
    "additionalProperties": False,
}


def test_format_json_and_schema(client: ollama.Client, daemon) -> None:
    # JSON mode: one JSON object (greedy, this model closes it at once).
    greedy = {"temperature": 0, "num_predict": 100}
    reply = client.generate(model="tiny", prompt="JSON please", format="json", options=greedy)
    assert reply.done_reason == "stop" and isinstance(json.loads(reply.response), dict)
    chat = client.chat(model="tiny", messages=[{"role": "user", "content": "JSON please"}], format="json", options=greedy)
    assert chat.done_reason == "stop" and isinstance(json.loads(chat.message.content or ""), dict)
    # A schema: the output validates against it, sampled or streamed.
    for seed in (1, 2, 3):
        answer = client.chat(model="tiny", messages=[{"role": "user", "content": "Answer in JSON"}], format=MOOD,
                             options={"seed": seed, "temperature": 1.0, "num_predict": 60})
        assert answer.done_reason == "stop"
        jsonschema.validate(json.loads(answer.message.content or ""), MOOD)
    parts = list(client.generate(model="tiny", prompt="Answer in JSON", format=MOOD, stream=True,
                                 options={"seed": 4, "temperature": 1.0, "num_predict": 60}))
    assert parts[-1].done and parts[-1].done_reason == "stop"
    jsonschema.validate(json.loads("".join(p.response for p in parts)), MOOD)
    # What the grammar cannot enforce is a 400 naming the keyword, as on the OpenAI route.
    bad = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}
    with pytest.raises(ollama.ResponseError) as caught:
        list(client.generate(model="tiny", prompt="x", format=bad, stream=True))  # refused before streaming
    assert caught.value.status_code == 400
    assert "properties.age: keyword 'minimum' is not supported" in caught.value.error
    # The client refuses other strings itself; over plain HTTP they are a 400 too.
    reply = daemon.post_json("/api/generate", {"model": "tiny", "prompt": "x", "format": "yaml"})
    assert reply.status == 400 and "format: 'yaml' is not \"json\" or a JSON schema" in reply.json()["error"]


def test_tool_call_comes_back_whole(client: ollama.Client, daemon) -> None:
    kwargs = {"model": "agent", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
              "options": {"temperature": 0, "num_predict": 300}}
    full = client.chat(**kwargs)
    assert full.done and full.done_reason == "stop" and full.message.content == ""
    (call,) = full.message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(call.function.arguments, WEATHER["function"]["parameters"])
    # On the wire, arguments are an object (not OpenAI's string), with Ollama's id and index.
    raw = daemon.post_json("/api/chat", {**kwargs, "stream": False}).json()
    (wire,) = raw["message"]["tool_calls"]
    assert wire["function"] == {"index": 0, "name": "get_weather", "arguments": dict(call.function.arguments)}
    assert wire["id"].startswith("call_")
    # Streamed, the call comes whole in one object, never as pieces of text.
    parts = list(client.chat(stream=True, **kwargs))
    with_calls = [p for p in parts if p.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done
    assert [c.function for c in with_calls[0].message.tool_calls or []] == [call.function]
    assert not any(p.message.content for p in parts)
    assert parts[-1].done and parts[-1].done_reason == "stop" and parts[-1].eval_count == full.eval_count
    # Cut short (num_predict) before the call is complete: no call but the raw text, streamed or not.
    short = {**kwargs, "options": {"temperature": 0, "num_predict": 10}}
    cut = client.chat(**short)
    assert cut.done_reason == "length" and not cut.message.tool_calls
    assert (cut.message.content or "").startswith("{")
    assert "".join(p.message.content or "" for p in client.chat(stream=True, **short)) == cut.message.content


def test_tool_result_goes_back_through_the_template(client: ollama.Client, daemon) -> None:
    question = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris", "celsius": True}}}
    result = "21 degrees and sunny"
    answered = [*question, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_name": "get_weather", "content": result}]
    one = {"num_predict": 1}
    base = client.chat(model="agent", messages=question, tools=[WEATHER], options=one)
    after = client.chat(model="agent", messages=answered, tools=[WEATHER], options=one)
    # The call and its result are in the prompt: at least the result's characters in tokens more.
    assert after.prompt_eval_count > base.prompt_eval_count + len(result)
    longer = [*answered[:2], {**answered[2], "content": result + " with a light breeze from the west"}]
    assert client.chat(model="agent", messages=longer, tools=[WEATHER], options=one).prompt_eval_count > \
        after.prompt_eval_count
    # Newer clients also name the call by id (the installed client cannot send it).
    with_id = [*answered[:2], {**answered[2], "tool_call_id": "call_1"}]
    reply = daemon.post_json("/api/chat", {"model": "agent", "messages": with_id, "tools": [WEATHER], "options": one,
                                           "stream": False})
    assert reply.status == 200 and reply.json()["prompt_eval_count"] > after.prompt_eval_count
    # A reply's message sent back as it came (Ollama's index, the call's id, an OpenAI-minded
    # client's type) is the same call; anything else in a call is a 400 naming it, not ignored.
    echoed = {"id": "call_1", "type": "function", "function": {"index": 0, **call["function"]}}
    for sent in (echoed, {**echoed, "id": None, "type": None}):
        body = {"model": "agent", "messages": [*answered[:1], {**answered[1], "tool_calls": [sent]}, answered[2]],
                "tools": [WEATHER], "options": one, "stream": False}
        reply = daemon.post_json("/api/chat", body)
        assert reply.status == 200 and reply.json()["prompt_eval_count"] == after.prompt_eval_count, reply.text
    for where, stray in [("tool_calls[0]", {**call, "kind": "x"}),
                         ("tool_calls[0].function", {"function": {**call["function"], "strict": True}}),
                         ("tool_calls[0]", {**call, "type": "code"})]:
        body = {"model": "agent", "messages": [*answered[:1], {**answered[1], "tool_calls": [stray]}, answered[2]],
                "stream": False}
        reply = daemon.post_json("/api/chat", body)
        assert reply.status == 400 and f"$.messages[1].{where}" in reply.json()["error"], reply.text
    for kwargs, words in [
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [call]}], "tools": [WEATHER]},
         "messages[0].tool_calls: only on assistant messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_name": "get_weather"}]},
         "messages[0].tool_name: only on tool messages"),
    ]:
        with pytest.raises(ollama.ResponseError) as caught:
            client.chat(model="agent", options=one, **kwargs)
        assert caught.value.status_code == 400 and words in caught.value.error, caught.value.error


def test_an_error_after_the_stream_started_is_an_error_line(start_daemon, tmp_path: Path) -> None:
    """As Ollama writes it: after the first lines, a failing engine ends the stream with
    {"error": "..."}, which the client raises."""
    from support import failing_generation_plugin

    failing_generation_plugin(tmp_path / "plugins", tmp_path / "repo")
    daemon = start_daemon("--model-repository", str(tmp_path / "repo"),
                          "--backend-directory", str(tmp_path / "plugins"), http=True)
    client = ollama.Client(host=f"http://127.0.0.1:{daemon.http_port}", timeout=60)
    texts: list[str] = []
    with pytest.raises(ollama.ResponseError, match="the engine failed"):
        for part in client.chat(model="broken", messages=[{"role": "user", "content": "x"}], stream=True):
            texts.append(part.message.content or "")
    assert texts == ["a", "b"]
    texts = []
    with pytest.raises(ollama.ResponseError, match="the engine failed"):
        for piece in client.generate(model="broken", prompt="x", stream=True):
            texts.append(piece.response)
    assert texts == ["a", "b"]



def test_num_ctx_below_the_loaded_context_bounds_the_sequence(client: ollama.Client, daemon) -> None:
    """A smaller num_ctx is the sequence's context, as in Ollama: with `shift: false` prompt
    and reply together stay within it (the reply stops with `length`), and a prompt that does
    not fit is a 400 (Ollama cuts a prompt only where the context shifts). It used to be
    accepted and to change nothing. (Without `shift: false` the context shifts, and a long
    prompt is cut: the next tests.)"""
    chat = [{"role": "user", "content": "Tell me a story"}]
    greedy = {"temperature": 0, "repeat_penalty": 1.0}
    base = client.chat(model="tiny", messages=chat, options={**greedy, "num_predict": 40})
    prompt = base.prompt_eval_count or 0
    assert base.eval_count == 40 and prompt > 5

    def post(path: str, body: dict[str, Any], status: int = 200) -> Any:
        reply = daemon.post_json(path, {"model": "tiny", "stream": False, "shift": False, **body})
        assert reply.status == status, reply.body
        return reply.json()

    bounded = post("/api/chat", {"messages": chat, "options": {**greedy, "num_ctx": prompt + 6}})
    assert bounded["done_reason"] == "length" and bounded["eval_count"] == 6
    assert (base.message.content or "").startswith(bounded["message"]["content"])
    # num_predict within the room left is what stops it.
    assert post("/api/chat", {"messages": chat, "options": {**greedy, "num_ctx": prompt + 6, "num_predict": 3}})[
        "eval_count"] == 3
    raw = client.generate(model="tiny", prompt="Once upon a time", raw=True, options={**greedy, "num_predict": 1})
    assert post("/api/generate", {"prompt": "Once upon a time", "raw": True,
                                  "options": {**greedy, "num_ctx": (raw.prompt_eval_count or 0) + 4}})["eval_count"] == 4
    for path, body in (("/api/chat", {"messages": chat, "options": {"num_ctx": prompt}}),
                       ("/api/generate", {"prompt": "Once upon a time", "raw": True, "options": {"num_ctx": 3}})):
        error = post(path, body, 400)["error"]
        assert error.startswith("options.num_ctx: the prompt is ") and error.endswith(
            "it is cut only where the context can shift (shift false)"), error


def test_the_context_shifts_as_ollamas_by_default(client: ollama.Client, daemon) -> None:
    """Ollama's `shift` (on unless false; the official client cannot turn it off): a reply
    that fills num_ctx goes on, the window's older tokens dropped (keeping num_keep), up to
    num_predict, or 10 x num_ctx when num_predict is unset (Ollama's cap). Before the first
    shift the tokens are the unshifted reply's."""
    chat = [{"role": "user", "content": "Tell me a story"}]
    greedy = {"temperature": 0, "repeat_penalty": 1.0}
    base = client.chat(model="tiny", messages=chat, options={**greedy, "num_predict": 6})
    num_ctx = (base.prompt_eval_count or 0) + 6
    shifted = client.chat(model="tiny", messages=chat, options={**greedy, "num_ctx": num_ctx, "num_predict": 40})
    assert shifted.done_reason == "length" and shifted.eval_count == 40
    assert (shifted.message.content or "").startswith(base.message.content or "")
    endless = client.generate(model="tiny", prompt="Once upon a time", raw=True, options={**greedy, "num_ctx": 24})
    assert endless.done_reason == "length" and endless.eval_count == 240
    # num_keep: Ollama's option, -1 the whole prompt; below that a 400.
    kept = client.chat(model="tiny", messages=chat, options={**greedy, "num_ctx": num_ctx, "num_predict": 12,
                                                              "num_keep": -1})
    assert kept.eval_count == 12
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="tiny", messages=chat, options={"num_keep": -2})
    assert caught.value.status_code == 400 and "options.num_keep" in caught.value.error


def test_truncate_and_shift_take_false_and_true(daemon) -> None:
    """Ollama's `truncate` and `shift` take false and true on both routes. One message that
    does not fit: with truncate false a 400 naming num_ctx; else its tokens are cut (below)."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"num_predict": 2}}
    generate = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    for path, body in (("/api/chat", chat), ("/api/generate", generate)):
        reply = daemon.post_json(path, {**body, "truncate": False, "shift": False})
        assert reply.status == 200 and reply.json()["eval_count"] == 2, reply.body
        assert daemon.post_json(path, {**body, "truncate": True}).json()["eval_count"] == 2
        assert daemon.post_json(path, {**body, "shift": True}).json()["eval_count"] == 2
    reply = daemon.post_json("/api/chat", {**chat, "truncate": False, "options": {"num_ctx": 8}})
    assert reply.status == 400, reply.body
    count = _prompt_tokens(daemon, chat["messages"], "tiny")
    assert reply.json()["error"] == f"options.num_ctx: the prompt is {count} tokens, which leaves no room in " \
                                    "num_ctx 8 (truncate false)"
    reply = daemon.post_json("/api/chat", {**chat, "truncate": True, "options": {"num_ctx": 8, "num_predict": 2}})
    # num_keep 4 and the BOS stay, and one more: one cell of 8 free.
    assert reply.status == 200 and reply.json()["prompt_eval_count"] == 7, reply.body


def _cut_as_ollama(tokens: list[int], num_ctx: int, num_keep: int) -> list[int]:
    """Ollama's prompt truncation, computed apart from edged's (its llama-server runner: keep
    num_keep tokens and the BOS, leave half of the rest of num_ctx free for the first shift)."""
    keep = len(tokens) if num_keep < 0 else num_keep + 1  # + 1: this tokenizer adds a BOS
    keep = min(keep, num_ctx - 1)
    free = max((num_ctx - keep) // 2, 1)
    tail = num_ctx - free - keep
    return tokens[:keep] + (tokens[-tail:] if tail else [])


def test_a_prompt_longer_than_the_context_is_cut_as_ollamas(client: ollama.Client, daemon) -> None:
    """Ollama's `truncate` (on unless false) on a prompt of num_ctx tokens or more (here; else
    the model's context per sequence): the first num_keep tokens and the BOS stay, the oldest
    after them go, down to what leaves half of the rest free; the reply is the one the kept
    tokens alone give (llama-server's route, their ids as the prompt)."""
    text = " ".join(f"word{i}" for i in range(60))
    tokens = daemon.post_json("/tokenize", {"model": "tiny", "content": text, "add_special": True,
                                            "parse_special": True}).json()["tokens"]
    assert len(tokens) > 100
    greedy = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 6}

    def alone(kept: list[int], n: int = 6) -> str:
        body = {"model": "tiny", "prompt": kept, "n_predict": n, "temperature": 0, "cache_prompt": False}
        return daemon.post_json("/completion", body).json()["content"]

    for num_ctx, num_keep in ((64, 4), (64, 0), (40, 20), (48, -1), (64, 63)):
        expected = _cut_as_ollama(tokens, num_ctx, num_keep)
        # The tokens before the context's first shift (with num_keep -1 or 63, after one).
        n = min(6, num_ctx - len(expected) + 1)
        reply = client.generate(model="tiny", prompt=text, raw=True, options={**greedy, "num_ctx": num_ctx,
                                                                              "num_keep": num_keep, "num_predict": n})
        assert reply.prompt_eval_count == len(expected) < num_ctx, (num_ctx, num_keep)
        assert reply.response == alone(expected, n), (num_ctx, num_keep)
    # num_keep left out: Ollama's 4. Without num_ctx, the model's 256 tokens per sequence.
    assert client.generate(model="tiny", prompt=text, raw=True, options={**greedy, "num_ctx": 64}).response == \
        alone(_cut_as_ollama(tokens, 64, 4))
    long = " ".join(f"word{i}" for i in range(150))
    long_tokens = daemon.post_json("/tokenize", {"model": "tiny", "content": long, "add_special": True,
                                                 "parse_special": True}).json()["tokens"]
    assert len(long_tokens) > 256
    reply = client.generate(model="tiny", prompt=long, raw=True, options=greedy)
    assert reply.prompt_eval_count == len(_cut_as_ollama(long_tokens, 256, 4))
    assert reply.response == alone(_cut_as_ollama(long_tokens, 256, 4))
    # num_ctx 1 leaves nothing to keep (Ollama's runner cuts nothing there either); 2 keeps the BOS.
    reply = daemon.post_json("/api/generate", {"model": "tiny", "prompt": text, "raw": True, "stream": False,
                                               "options": {"num_ctx": 1}})
    assert reply.status == 400 and reply.json()["error"].startswith("options.num_ctx: the prompt is"), reply.body
    assert client.generate(model="tiny", prompt=text, raw=True, options={**greedy, "num_ctx": 2,
                                                                          "num_predict": 1}).prompt_eval_count == 1
    # Only where the context shifts, as in Ollama; truncate false keeps it whole: 400s.
    for body, ending in (({"shift": False}, "(shift false)"), ({"truncate": False}, "(truncate false)")):
        reply = daemon.post_json("/api/generate", {"model": "tiny", "prompt": long, "raw": True, "stream": False,
                                                   **body})
        assert reply.status == 400, reply.body
        assert reply.json()["error"] == (f"prompt: the prompt is {len(long_tokens)} tokens, which leaves no room "
                                         f"in the 256 tokens of context per sequence of model 'tiny'"
                                         + ("; it is cut only where the context can shift " if "shift" in body
                                            else " ") + ending)


def _prompt_tokens(daemon, messages: list[dict[str, Any]], model: str = "agent") -> int:
    """The chat prompt's tokens, from the daemon's llama-server routes (the model's template,
    then its tokenizer as a prompt is tokenized)."""
    prompt = daemon.post_json("/apply-template", {"model": model, "messages": messages}).json()["prompt"]
    reply = daemon.post_json("/tokenize", {"model": model, "content": prompt, "add_special": True, "parse_special": True})
    return len(reply.json()["tokens"])


def test_chat_drops_its_oldest_messages_until_the_prompt_fits(daemon) -> None:
    """Ollama's `truncate` (on unless false): the oldest messages go until the prompt fits
    num_ctx (here; else the model's context), the system message and the last message
    staying; false keeps them all, and a prompt that does not fit is a 400."""
    system = {"role": "system", "content": "Be brief."}
    old = [{"role": "user", "content": "Tell me everything about the history of the world. " * 6},
           {"role": "assistant", "content": "It is long."}]
    recent = [{"role": "user", "content": "And in short?"}]
    # Room for the short reply of the first turn and the last question, not for the long first question.
    with_reply = _prompt_tokens(daemon, [system, old[1], *recent])
    assert with_reply + 4 < _prompt_tokens(daemon, [system, *old, *recent])
    body = {"model": "agent", "stream": False, "shift": False,
            "options": {"num_ctx": with_reply + 4, "temperature": 0, "repeat_penalty": 1.0}}
    reply = daemon.post_json("/api/chat", {**body, "messages": [system, *old, *recent]}).json()
    assert reply["prompt_eval_count"] == with_reply, reply
    assert reply["eval_count"] == 4 and reply["done_reason"] == "length"
    alone = daemon.post_json("/api/chat", {**body, "messages": [system, old[1], *recent]}).json()
    assert alone["message"] == reply["message"]
    # A prompt that fills num_ctx leaves no room for a reply: one more message goes.
    exact = {**body, "options": {**body["options"], "num_ctx": with_reply}, "messages": [system, *old, *recent]}
    assert daemon.post_json("/api/chat", exact).json()["prompt_eval_count"] == _prompt_tokens(daemon, [system, *recent])
    reply = daemon.post_json("/api/chat", {**body, "truncate": False, "messages": [system, *old, *recent]})
    assert reply.status == 400 and "options.num_ctx" in reply.json()["error"], reply.body
    # Without num_ctx, the model's context per sequence (256 tokens for "tiny") is the limit.
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Message number {i} says hello. " * 3}
            for i in range(41)]  # the last a user message (an assistant one would be a prefill to /apply-template)
    reply = daemon.post_json("/api/chat", {**body, "model": "tiny", "options": {"num_predict": 1},
                                           "messages": [system, *many]}).json()
    fitting = (n for k in range(len(many)) if (n := _prompt_tokens(daemon, [system, *many[k:]], "tiny")) < 256)
    assert reply["prompt_eval_count"] == next(fitting), reply


def test_chat_truncation_never_keeps_a_tool_result_without_its_call(daemon) -> None:
    """A history cut before a tool result starts at the assistant turn that called the tool;
    if that does not fit either, the cut goes past the results, though the result and the
    last message alone would fit."""
    system = {"role": "system", "content": "Be brief."}
    call = {"role": "assistant", "content": "Let me look that up in great detail. " * 8,
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}
    result = {"role": "tool", "content": "Sunny", "tool_name": "weather"}
    last = {"role": "user", "content": "Thanks"}

    def chat(messages: list[dict[str, Any]], **fields: Any) -> Any:
        reply = daemon.post_json("/api/chat", {"model": "agent", "stream": False, "messages": messages, **fields})
        assert reply.status == 200, reply.body
        return reply.json()

    # What the result and the last message take (as this route writes a tool result).
    room = chat([system, result, last], truncate=False, options={"num_predict": 1})["prompt_eval_count"] + 2
    history = [system, {"role": "user", "content": "Weather?"}, call, result, last]
    assert chat(history, truncate=False, options={"num_predict": 1})["prompt_eval_count"] > room
    reply = chat(history, options={"num_ctx": room, "num_predict": 1})
    assert reply["prompt_eval_count"] == _prompt_tokens(daemon, [system, last])


def test_seed_takes_ollamas_values_and_refuses_what_it_cannot_keep(client: ollama.Client) -> None:
    """-1 is Ollama's "random"; a seed the engine's 32 bits cannot hold would silently become
    another seed: a 400."""
    sampled = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0, "num_predict": 16}
    same = {client.generate(model="tiny", prompt="Once", raw=True, options={**sampled, "seed": 7}).response
            for _ in range(2)}
    assert len(same) == 1
    assert client.generate(model="tiny", prompt="Once", raw=True, options={**sampled, "seed": -1}).done
    # typical_p: with a mass this small one token is left at each step, whatever the seed.
    typical = {client.generate(model="tiny", prompt="Once", raw=True,
                               options={**sampled, "min_p": 0.0, "typical_p": 1e-6, "seed": s}).response
               for s in range(4)}
    free = {client.generate(model="tiny", prompt="Once", raw=True,
                            options={**sampled, "min_p": 0.0, "seed": s}).response for s in range(4)}
    assert len(typical) == 1 and len(free) > 1
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="tiny", prompt="Once", options={"typical_p": 2})
    assert caught.value.status_code == 400 and "options.typical_p must be between 0 and 1" in caught.value.error
    for stop in ("", ["x", ""]):  # the engine would drop it, Ollama's runner stops at once on it
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model="tiny", prompt="Once", options={**sampled, "stop": stop})
        assert caught.value.status_code == 400, caught.value.error
        assert caught.value.error == "options.stop: an empty string is not a stop string"
    for seed in (2**32, 2**32 + 7, -2):
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model="tiny", prompt="Once", options={**sampled, "seed": seed})
        assert caught.value.status_code == 400 and "options.seed" in caught.value.error, caught.value.error


def test_load_time_options_and_options_on_a_load_request(client: ollama.Client) -> None:
    """Runner options (num_thread, num_gpu, num_batch, ...) are set when Ollama loads a model;
    here the model's config sets them: a 400 that says where. An empty prompt (Ollama's "load
    the model") checks its options as any request does instead of ignoring them."""
    for option, parameter in (("num_thread", "n_threads"), ("num_gpu", "n_gpu_layers"), ("num_batch", "n_batch")):
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model="tiny", prompt="x", options={option: 4})
        assert caught.value.status_code == 400, caught.value.error
        assert f"options.{option} is a load-time setting" in caught.value.error and parameter in caught.value.error
    for call in (lambda: client.generate(model="tiny", prompt="", options={"mirostat": 1}),
                 lambda: client.chat(model="tiny", messages=[], options={"num_ctx": 100_000}),
                 lambda: client.chat(model="tiny", messages=[], options={"tfs_z": 0.5})):
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 400 and "options." in caught.value.error, caught.value.error
    assert client.generate(model="tiny", prompt="", options={"temperature": 0.2}).done_reason == "load"


def test_show_verbose_lists_the_metadata_arrays(client: ollama.Client, daemon) -> None:
    """`verbose` (ollama show --verbose) adds the GGUF's arrays (the vocabulary...) to
    model_info, as Ollama's does; fields show does not take are a 400."""
    plain = client.show("tiny").modelinfo or {}
    assert "tokenizer.ggml.tokens" not in plain
    verbose = daemon.post_json("/api/show", {"model": "tiny", "verbose": True})
    assert verbose.status == 200, verbose.body
    info = verbose.json()["model_info"]
    assert len(info["tokenizer.ggml.tokens"]) == info["llama.vocab_size"] > 100
    assert {k: info[k] for k in plain} == plain  # the rest as without verbose
    for field in ("stream", "insecure"):
        reply = daemon.post_json("/api/show", {"model": "tiny", field: False})
        assert reply.status == 400 and field in reply.json()["error"], reply.body


def test_think_levels_are_ollamas(daemon) -> None:
    """A think string other than Ollama's levels ("" too) is Ollama's 400 for the value; a level
    is a thinking request, which no model here can honour."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"num_predict": 1}}
    for value in ("", "bogus"):
        reply = daemon.post_json("/api/chat", {**body, "think": value})
        assert reply.status == 400 and reply.json()["error"].startswith("invalid think value"), reply.body
    for value in ("low", "max", True):
        reply = daemon.post_json("/api/chat", {**body, "think": value})
        assert reply.status == 400 and reply.json()["error"] == '"tiny" does not support thinking', reply.body
    assert daemon.post_json("/api/chat", {**body, "think": False}).status == 200


def test_a_control_does_not_load_an_on_demand_model(daemon, client: ollama.Client) -> None:
    """llama-server's /v1/chat/completions/control on a model not loaded: nothing of it runs,
    so there is nothing to control, and the model stays unloaded."""
    from support import wait_until

    client.generate(model="crowd", prompt="", keep_alive=0)
    wait_until(lambda: "crowd:latest" not in loaded(client), timeout=60)
    reply = daemon.post_json("/v1/chat/completions/control", {"model": "crowd", "id": "chatcmpl-x", "action": "reasoning_end"})
    assert reply.status == 200 and reply.json() == {"success": False, "message": "no active completion for this id"}
    # llama-server's router query `autoload=false`: answered only for a model loaded now.
    assert daemon.get_json("/props?model=crowd&autoload=false", 400)["error"]["message"] == "model is not loaded"
    assert "crowd:latest" not in loaded(client)
    reply = daemon.post_json("/v1/chat/completions/control", {"model": "nope", "id": "x", "action": "reasoning_end"})
    assert reply.status == 404
