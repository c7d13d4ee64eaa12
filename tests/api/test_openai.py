"""The real `openai` Python client against the daemon serving a tiny GGUF model on llama.cpp,
over TCP and over the Unix socket; plus Triton's generate extension."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
# openai >= 3 ships its HTTP stack as `httpx2`; older releases use `httpx`. Either has `uds=`.
try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover - depends on the installed openai
    httpx = pytest.importorskip("httpx")

from gguf_builder import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llm-repo")
    (path / "tiny" / "1").mkdir(parents=True)
    write_tiny_llama(path / "tiny" / "1" / "model.gguf", seed=1)
    (path / "tiny" / "config.pbtxt").write_text(
        'backend: "llamacpp"\n'
        'parameters { key: "n_parallel" value { string_value: "4" } }\n'
        'parameters { key: "n_ctx" value { string_value: "1024" } }\n'
    )
    (path / "embedder" / "1").mkdir(parents=True)
    write_tiny_llama(path / "embedder" / "1" / "model.gguf", seed=2, pooling=1)
    (path / "embedder" / "config.pbtxt").write_text(
        'backend: "llamacpp"\nparameters { key: "embedding" value { string_value: "true" } }\n'
    )
    return path


@pytest.fixture(scope="module")
def daemon(repo: Path, tmp_path_factory: pytest.TempPathFactory):
    # Module-scoped: one llama.cpp load for the whole file.
    from support import start_daemon_process

    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


@pytest.fixture
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.http_port}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def uds_client(daemon) -> openai.OpenAI:
    transport = httpx.HTTPTransport(uds=str(daemon.socket))
    return openai.OpenAI(
        base_url="http://localhost/v1", api_key="unused", max_retries=0,
        http_client=httpx.Client(transport=transport),
    )


GREEDY = {"temperature": 0.0, "max_tokens": 12}


def test_models_listed(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {"tiny", "embedder"} <= ids


def test_chat_completion_and_stream_agree(client: openai.OpenAI, uds_client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    assert choice.message.role == "assistant"
    stream = uds_client.chat.completions.create(
        model="tiny", messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == choice.message.content  # greedy: same text streamed or not
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12


def test_completions_stop_string(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt="The quick brown fox", **{**GREEDY, "max_tokens": 24})
    text = base.choices[0].text
    assert base.choices[0].finish_reason == "length" and len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.completions.create(model="tiny", prompt="The quick brown fox", stop=[stop], **{**GREEDY, "max_tokens": 24})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="The quick brown fox", stop=[stop], stream=True, **{**GREEDY, "max_tokens": 24}
        ) if c.choices
    )
    assert streamed == cut.choices[0].text


def test_concurrent_greedy_requests_match_solo(client: openai.OpenAI) -> None:
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Prompt number {i} says" for i in range(6)]
    solo = [client.completions.create(model="tiny", prompt=p, **GREEDY).choices[0].text for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, **GREEDY).choices[0].text, prompts))
    assert together == solo


def test_embeddings(client: openai.OpenAI) -> None:
    result = client.embeddings.create(model="embedder", input=["one", "two words"])
    assert [d.index for d in result.data] == [0, 1]
    assert len(result.data[0].embedding) == 64
    assert result.data[0].embedding != result.data[1].embedding
    assert result.usage.prompt_tokens > 0


def test_bad_requests_are_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="n: only n=1"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="word " * 3000, max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="embedding"):
        client.completions.create(model="embedder", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="bogus"):
        client.completions.create(model="tiny", prompt="x", extra_body={"bogus": 1})
    # Still serving.
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].text is not None


def test_triton_generate_extension(daemon) -> None:
    body = json.dumps({"text_input": "Hi", "max_tokens": 6, "temperature": 0})
    reply = daemon.request("POST", "/v2/models/tiny/generate", body, {"Content-Type": "application/json"})
    assert reply.status == 200, reply.body
    full = reply.json()
    assert full["model_name"] == "tiny" and full["finish_reason"] == "length"
    stream = daemon.request("POST", "/v2/models/tiny/generate_stream", body, {"Content-Type": "application/json"})
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in stream.body.decode().split("\n") if line.startswith("data: ")]
    texts = [json.loads(e)["text_output"] for e in events if e != "[DONE]"]
    assert "".join(texts) == full["text_output"]


def test_client_disconnect_cancels_and_server_keeps_serving(daemon, client: openai.OpenAI) -> None:
    import socket

    from support import wait_until

    def engine() -> dict[str, int]:
        return daemon.request("GET", "/v2/models/tiny").json()["engine"]

    before = engine()["tokens_generated"]
    body = json.dumps({"model": "tiny", "prompt": "Go on", "max_tokens": 200, "stream": True}).encode()
    for _ in range(6):  # more abandoned streams than slots
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(daemon.socket))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert b"200" in s.recv(64)
        s.close()
    wait_until(lambda: engine()["busy"] == 0 and engine()["queued"] == 0, timeout=60)
    stats = engine()
    # Run to completion, the six streams would have generated 1200 tokens.
    assert stats["tokens_generated"] - before < 600, stats
    result = client.completions.create(model="tiny", prompt="still alive", max_tokens=3, timeout=60)
    assert result.choices[0].finish_reason in ("length", "stop")


def test_generation_requests_show_in_statistics(daemon, client: openai.OpenAI) -> None:
    def stats() -> dict:
        return daemon.request("GET", "/v2/models/tiny/stats").json()["model_stats"][0]

    before = stats()["inference_stats"]["success"]["count"]
    client.completions.create(model="tiny", prompt="count me", max_tokens=2)
    after = stats()
    assert after["inference_stats"]["success"]["count"] == before + 1
    metrics = daemon.request("GET", "/metrics").body.decode()
    assert 'nv_inference_request_success{model="tiny",version="1"}' in metrics
