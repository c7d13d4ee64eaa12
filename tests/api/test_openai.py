"""The real `openai` Python client against the daemon serving a tiny GGUF model on llama.cpp,
over TCP and over the Unix socket; plus Triton's generate extension."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
# openai >= 3 ships its HTTP stack as `httpx2`; older releases use `httpx`. Either has `uds=`.
try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover - depends on the installed openai
    httpx = pytest.importorskip("httpx")

from gguf_builder import reference_logprobs, write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llm-repo")
    (path / "tiny" / "1").mkdir(parents=True)
    write_tiny_llama(path / "tiny" / "1" / "model.gguf", seed=1, n_ctx=1024)
    (path / "tiny" / "config.pbtxt").write_text(
        'backend: "llamacpp"\n'
        'parameters { key: "n_parallel" value { string_value: "4" } }\n'
        'parameters { key: "n_ctx" value { string_value: "4096" } }\n'
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


def test_llama_servers_paths_without_v1(daemon: Any, client: openai.OpenAI) -> None:
    """llama-server also answers /models, /chat/completions and /responses: a client whose base
    URL lacks /v1 reaches the same routes (and their OpenAI error shape)."""
    bare = openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.http_port}", api_key="unused", max_retries=0)
    assert {m.id for m in bare.models.list()} == {m.id for m in client.models.list()}
    messages = [{"role": "user", "content": "Hello there"}]
    chat = [c.chat.completions.create(model="tiny", messages=messages, **GREEDY) for c in (bare, client)]
    assert chat[0].choices[0].message.content == chat[1].choices[0].message.content
    answers = [c.responses.create(model="tiny", input="Hello there", temperature=0, max_output_tokens=12)
               for c in (bare, client)]
    assert answers[0].output_text == answers[1].output_text
    with pytest.raises(openai.BadRequestError, match="top_p must be between 0 and 1") as refused:
        bare.chat.completions.create(model="tiny", messages=messages, top_p=2.0)
    assert isinstance(refused.value.body, dict) and refused.value.body["type"] == "invalid_request_error"


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


def test_stream_obfuscation_option(client: openai.OpenAI) -> None:
    # OpenAI's chat stream_options: false (no padding) is what every stream here is; true a 400.
    messages = [{"role": "user", "content": "Hello there"}]
    options = {"include_usage": True, "include_obfuscation": False}
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, stream=True, stream_options=options, **GREEDY
    ))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError, match=r"stream_options\.include_obfuscation: not supported"):
        client.chat.completions.create(
            model="tiny", messages=messages, stream=True, stream_options={"include_obfuscation": True}, **GREEDY
        )


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
    user = [{"role": "user", "content": "x"}]
    for field, value, pattern in [
        ("n", 0, "n must be between 1 and 128, got 0"),
        ("n", 129, "n must be between 1 and 128, got 129"),
        # 4 slots + 64 waiting: more choices would be a 503 a retry can never cure.
        ("n", 69, r"n: 69 choices are more than model 'tiny' takes at once \(68: its slots and max_queue\)"),
        ("temperature", 2.5, "temperature must be between 0 and 2"),
        ("temperature", -0.1, "temperature must be between 0 and 2"),
        ("top_p", 1.5, "top_p must be between 0 and 1"),
        ("presence_penalty", 2.5, "presence_penalty must be between -2 and 2"),
        ("frequency_penalty", -3, "frequency_penalty must be between -2 and 2"),
        ("logit_bias", {"5": 101}, r"logit_bias\[5\] must be between -100 and 100"),
        ("logit_bias", {"5": True}, r"logit_bias\[5\]: true is not a bias"),
        ("logit_bias", [["z", 101]], r"logit_bias\['z'\] must be between -100 and 100"),
        ("logit_bias", {"99999": 1}, "logit_bias: token id 99999 is out of range"),
        ("max_completion_tokens", 0, "max_completion_tokens must be >= 1 \\(or -1: no limit\\), got 0"),
        ("max_tokens", 0, "max_tokens must be >= 1 \\(or -1: no limit\\), got 0"),
        ("max_tokens", -2, "max_tokens must be >= 1 \\(or -1: no limit\\), got -2"),
        ("stream_options", {"include_usage": True}, "stream_options: only allowed when stream is true"),
        ("tools", [], "tools"),
        # llama.cpp keeps 32 bits of a seed (all ones: random): a larger one would be another seed.
        ("seed", 2**32, r"seed must be -1 \(random\) or between 0 and 4294967294, got 4294967296"),
        ("seed", -2, r"seed must be -1 \(random\) or between 0 and 4294967294, got -2"),
        # The engine would drop it, llama-server stops at once on it: neither is what is asked.
        ("stop", "", "stop: an empty string is not a stop string"),
        ("stop", ["x", ""], "stop: an empty string is not a stop string"),
    ]:
        with pytest.raises(openai.BadRequestError, match=pattern):
            client.chat.completions.create(model="tiny", messages=user, extra_body={field: value})
    for messages, pattern in [
        ([{"role": "tool", "content": "x"}], r"messages\[0\]\.tool_call_id: required for role 'tool'"),
        ([{"role": "user", "content": "x", "tool_call_id": "1"}], r"messages\[0\]\.tool_call_id: only on tool messages"),
        ([{"role": "function", "content": "x"}], r"messages\[0\]\.role: 'function' is not one of"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role: 'robot'"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content: required"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], r"messages\[0\]\.content\[0\]"),
        ([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}],
         r"messages\[0\]\.content\[0\]\.cache_control: not supported in a text part"),
    ]:
        with pytest.raises(openai.BadRequestError, match=pattern):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"seed: with n 2, choice i samples with seed \+ i"):
        client.completions.create(model="tiny", prompt="x", n=2, seed=2**32 - 2, max_tokens=1)
    assert client.completions.create(model="tiny", prompt="x", seed=-1, max_tokens=1).choices[0].finish_reason
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model="tiny", prompt="x", suffix="y", max_tokens=1)
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


def test_what_would_overflow_a_stack_is_a_400_and_the_daemon_keeps_serving(daemon: Any, client: openai.OpenAI) -> None:
    """JSON nested past Python's recursion limit (in the body, in a schema, in a tool call's
    arguments) was a 500; groups nested ~20 000 deep in a grammar (raw, or a schema's maxLength
    that the converter writes out as nested groups) overflowed llama.cpp's parser's stack and
    killed the process."""
    deep = "[" * 5000 + "]" * 5000
    schema = '{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000
    # Spliced as text: json.dumps itself would refuse such nesting.
    user = '"messages": [{"role": "user", "content": "x"}]'
    call = json.dumps({"id": "c", "type": "function", "function": {"name": "f", "arguments": "ARGS"}})
    messages = json.dumps([
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": ["CALL"]},
        {"role": "tool", "tool_call_id": "c", "content": "x"},
    ]).replace('"CALL"', call).replace('"ARGS"', json.dumps(deep))
    too_deep = "the request nests too deeply to be read"
    for body, pattern in [
        ('{"model": "tiny", ' + user + ', "response_format": {"type": "json_schema", "json_schema": '
         '{"name": "n", "schema": ' + schema + "}}}", too_deep),
        ('{"model": "tiny", "messages": ' + messages + ', "tools": [{"type": "function", "function": {"name": "f"}}]}',
         too_deep),
        ('{"model": "tiny", ' + user + ', "response_format": {"type": "json_schema", "json_schema": {"name": "n",'
         ' "schema": {"type": "string", "maxLength": 20000}}}}',
         r"json_schema\.maxLength: must be an integer from 0 to 1000, got 20000"),
    ]:
        reply = daemon.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        assert reply.status == 400 and re.search(pattern, reply.json()["error"]["message"]), reply.body[:300]
    # llama-server's raw GBNF (its /completion).
    for grammar, pattern in [
        ("root ::= " + "(" * 20000 + '"a"' + ")" * 20000, "grammar: groups nested 20000 deep, more than the 2048 allowed"),
        # A chain of rules, each beginning with the next: llama.cpp recurses along it.
        ("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(20001)) + 'r20001 ::= "b"\n',
         "grammar: 20003 rules, more than the 20000 a grammar may have"),
        # llama.cpp counted max - min unsigned and allocated until the process ran out of memory.
        ('root ::= "x"{6,4}', "grammar: repetition {6,4} has its minimum above its maximum"),
    ]:
        reply = daemon.post_json("/completion", {"model": "tiny", "prompt": "x", "n_predict": 1, "grammar": grammar})
        assert reply.status == 400 and reply.json()["error"]["message"] == pattern, reply.body[:300]
    # Up to the bounds, it generates: 1 000 repetitions, a raw grammar nested 2 048 deep.
    bounded = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "maxLength": 1000}}}}},
    )
    assert bounded.choices[0].message.content is not None
    nested = "root ::= " + "(" * 2048 + '"a"' + ")" * 2048
    done = daemon.post_ok("/completion", {"model": "tiny", "prompt": "x", "n_predict": 3, "grammar": nested})
    assert done["content"] == "a", done


def test_n_choices_each_a_generation_of_their_own(client: openai.OpenAI) -> None:
    """`n`: that many choices, indexed, each sampled as its own request would be (choice i with
    seed + i), streamed interleaved; usage counts the prompt once and every completion."""
    messages = [{"role": "user", "content": "Tell me a story"}]
    sampled = {"temperature": 1.0, "max_tokens": 10}
    alone = [
        client.chat.completions.create(model="tiny", messages=messages, seed=40 + i, **sampled)
        for i in range(3)
    ]
    together = client.chat.completions.create(model="tiny", messages=messages, n=3, seed=40, **sampled)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.message.content for c in together.choices] == [a.choices[0].message.content for a in alone]
    assert len({a.choices[0].message.content for a in alone}) > 1  # the seeds do differ
    assert together.usage is not None
    assert together.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    stream = client.chat.completions.create(
        model="tiny", messages=messages, n=3, seed=40, stream=True, stream_options={"include_usage": True}, **sampled
    )
    texts, roles, finishes, usage = ["", "", ""], [0, 0, 0], [None, None, None], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] += c.delta.role == "assistant"
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.message.content for c in together.choices]
    assert roles == [1, 1, 1] and finishes == ["length"] * 3
    assert usage is not None and usage.completion_tokens == together.usage.completion_tokens

    greedy = client.completions.create(model="tiny", prompt="Once", n=2, echo=True, **GREEDY)
    solo = client.completions.create(model="tiny", prompt="Once", **GREEDY).choices[0].text
    assert [c.text for c in greedy.choices] == ["Once" + solo] * 2


def test_best_of_returns_the_candidates_with_the_highest_mean_logprob(client: openai.OpenAI) -> None:
    """best_of candidates are the generations n seeded requests would give (seed + i); the
    returned ones are those with the highest mean token log probability, best first."""
    kwargs = {"model": "tiny", "prompt": "Rank these", "max_tokens": 6, "temperature": 1.0}
    candidates = [client.completions.create(seed=40 + i, logprobs=0, **kwargs).choices[0] for i in range(4)]
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates]
    order = sorted(range(4), key=lambda i: -means[i])
    assert len({c.text for c in candidates}) > 1  # the ranking has something to choose from
    best = client.completions.create(seed=40, best_of=4, **kwargs)
    assert [c.text for c in best.choices] == [candidates[order[0]].text]
    assert best.choices[0].index == 0 and best.choices[0].logprobs is None
    assert best.usage is not None and best.usage.completion_tokens == 4 * 6  # every candidate counts
    two = client.completions.create(seed=40, best_of=4, n=2, logprobs=1, **kwargs)
    assert [c.text for c in two.choices] == [candidates[i].text for i in order[:2]]
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.logprobs is not None and len(c.logprobs.top_logprobs or []) == 6 for c in two.choices)
    same = client.completions.create(seed=40, best_of=1, **kwargs)
    assert same.choices[0].text == candidates[0].text  # best_of 1: the plain request
    for extra, pattern in [
        ({"best_of": 2, "n": 3}, r"best_of must be between n \(3\) and 128, got 2"),
        ({"best_of": 129}, "best_of must be between n"),
        ({"best_of": 2, "stream": True}, "best_of: cannot be used with stream"),
    ]:
        with pytest.raises(openai.BadRequestError, match=pattern):
            client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body=extra)


def test_a_list_of_prompts_is_a_batch(client: openai.OpenAI) -> None:
    """Completions with several prompts (lm-eval-harness sends its batches so): n choices for
    each prompt, in order, each what its prompt gets alone; usage counts every prompt once."""
    prompts = ["Once upon", "The quick brown"]
    alone = [client.completions.create(model="tiny", prompt=p, **GREEDY) for p in prompts]
    batch = client.completions.create(model="tiny", prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    texts = ["", ""]
    for chunk in client.completions.create(model="tiny", prompt=prompts, echo=True, stream=True, **GREEDY):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [p + a.choices[0].text for p, a in zip(prompts, alone, strict=True)]
    # Token ids, one list per prompt (lm-eval-harness sends its tokenized batches so).
    ids = [[1, *range(300, 306)], [1, *range(320, 324)]]
    by_ids = client.completions.create(model="tiny", prompt=ids, **GREEDY)
    assert [c.text for c in by_ids.choices] == [
        client.completions.create(model="tiny", prompt=one, **GREEDY).choices[0].text for one in ids
    ]
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 7 + 5
    for bad in (["a", 300], [], [[1, 300], "a"], [[1, 300], []]):
        with pytest.raises(openai.BadRequestError, match="prompt: a string, token ids, or a list of strings"):
            client.completions.create(model="tiny", prompt=bad, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"n: 70 choices \(35 prompts x 2\) are more than model 'tiny'"):
        client.completions.create(model="tiny", prompt=["x"] * 35, n=2, max_tokens=1)


def test_null_means_the_default_as_in_openais_schema(client: openai.OpenAI) -> None:
    """OpenAI's schema makes these nullable, and its client sends null for an explicit None."""
    messages = [{"role": "user", "content": "Hello there"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    nulls = client.chat.completions.create(
        model="tiny", messages=messages, n=None, stream=None, logprobs=None, **GREEDY
    )
    assert len(nulls.choices) == 1 and nulls.choices[0].logprobs is None
    assert nulls.choices[0].message.content == plain.choices[0].message.content
    text = client.completions.create(model="tiny", prompt="Once upon", **GREEDY).choices[0].text
    completion = client.completions.create(
        model="tiny", prompt="Once upon", n=None, stream=None, echo=None, **GREEDY
    )
    assert completion.choices[0].text == text  # not echoed, not streamed
    # store: false asks for what this server does anyway (nothing kept); true cannot be done.
    unstored = client.chat.completions.create(model="tiny", messages=messages, store=False, **GREEDY)
    assert unstored.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="store: chat completions are not stored here"):
        client.chat.completions.create(model="tiny", messages=messages, store=True, **GREEDY)
    # prompt_cache_key (a routing hint the prefix cache fulfils), safety_identifier (no output
    # effect at OpenAI either), and chat_template_kwargs the ChatML template does not read.
    hinted = client.chat.completions.create(
        model="tiny", messages=messages, prompt_cache_key="conversation-7", safety_identifier="user-1",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **GREEDY,
    )
    assert hinted.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs: 'bos_token' is set by the server"):
        client.chat.completions.create(model="tiny", messages=messages, extra_body={
            "chat_template_kwargs": {"bos_token": "x"}}, **GREEDY)


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


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_cancels_and_server_keeps_serving(daemon, client: openai.OpenAI, n: int) -> None:
    """Every choice's sequence is cancelled when the client goes (n > 1: all of them)."""
    import socket

    from support import wait_until

    def engine() -> dict[str, int]:
        return daemon.request("GET", "/v2/models/tiny").json()["engine"]

    before = engine()["tokens_generated"]
    body = json.dumps({"model": "tiny", "prompt": "Go on", "max_tokens": 200, "stream": True, "n": n}).encode()
    for _ in range(6):  # more abandoned streams than slots
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(daemon.socket))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert b"200" in s.recv(64)
        s.close()
    wait_until(lambda: engine()["busy"] == 0 and engine()["queued"] == 0, timeout=60)
    stats = engine()
    # Run to completion, the six streams would have generated 1200 tokens per choice.
    assert stats["tokens_generated"] - before < 600 * n, stats
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


def test_retrieve_model(client: openai.OpenAI, daemon: Any) -> None:
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.owned_by == "edged/llamacpp"
    # llama-server's `meta`, from llama.cpp: the tiny GGUF's shape (64 wide, trained for 1024,
    # the slot's context as /props says it), its vocabulary as /tokenize sees it.
    meta = card.model_extra["meta"]
    props = daemon.get_json("/props?model=tiny")
    assert meta["n_embd"] == 64 and meta["n_ctx_train"] == 1024
    assert meta["n_ctx"] == props["default_generation_settings"]["n_ctx"] and meta["ftype"] == props["model_ftype"]
    assert meta["vocab_type"] == 1 and meta["n_params"] > 0 and meta["size"] > 0  # 1: SentencePiece (llama.cpp's SPM)
    assert daemon.post_json("/tokenize", {"model": "tiny", "content": [meta["n_vocab"] - 1]}).status == 200
    assert daemon.post_json("/detokenize", {"model": "tiny", "tokens": [meta["n_vocab"]]}).status == 400
    assert next(m for m in client.models.list() if m.id == "tiny").model_extra["meta"] == meta
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client.models.retrieve("nope")


def test_default_max_tokens_is_the_rest_of_the_context(client: openai.OpenAI) -> None:
    # 4096 cells over 4 slots: 1024 per sequence, so generation ends there, not at 128.
    result = client.completions.create(model="tiny", prompt="Tell me everything", temperature=0)
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert result.usage.prompt_tokens + result.usage.completion_tokens == 1024 + 1
    # -1 is llama-server's "no limit" (its web UI sends it): the same.
    unlimited = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me everything"}], temperature=0, max_tokens=-1)
    assert unlimited.choices[0].finish_reason == "length" and unlimited.usage is not None
    assert unlimited.usage.prompt_tokens + unlimited.usage.completion_tokens == 1024 + 1


def test_max_completion_tokens_and_zero_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count"}]
    limited = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=3, temperature=0)
    assert limited.usage is not None and limited.usage.completion_tokens == 3
    # Completions with max_tokens 0 and echo: the prompt alone, streamed or not.
    echoed = client.completions.create(model="tiny", prompt="Score this", max_tokens=0, echo=True)
    assert echoed.choices[0].text == "Score this" and echoed.choices[0].finish_reason == "length"
    assert echoed.usage is not None and echoed.usage.completion_tokens == 0 and echoed.usage.prompt_tokens > 0


def test_echo_streams_the_prompt_first(client: openai.OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt="Echo me", echo=True, **GREEDY)
    chunks = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Echo me", echo=True, stream=True, **GREEDY) if c.choices]
    assert chunks[0] == "Echo me"
    assert "".join(chunks) == full.choices[0].text
    assert full.choices[0].text.startswith("Echo me") and len(full.choices[0].text) > len("Echo me")


def test_sampling_parameters_have_their_effect(client: openai.OpenAI) -> None:
    prompt = "Parameters matter"
    base = client.completions.create(model="tiny", prompt=prompt, **GREEDY).choices[0].text
    forced = client.completions.create(model="tiny", prompt=prompt, logit_bias={"300": 100}, **GREEDY)
    # Token 300 is a single printable character of the tiny vocabulary.
    text = forced.choices[0].text
    assert len(set(text)) == 1 and len(text) == 12 and text != base
    # The bias makes token 300 win every step by a wide margin; a frequency penalty grows
    # with each repeat until other tokens win, a presence penalty does not grow.
    long = {"temperature": 0.0, "max_tokens": 120, "logit_bias": {"300": 100}}
    repeated = client.completions.create(model="tiny", prompt=prompt, **long).choices[0].text
    assert len(set(repeated)) == 1 and len(repeated) == 120
    present = client.completions.create(model="tiny", prompt=prompt, presence_penalty=2, **long).choices[0].text
    assert present == repeated
    frequent = client.completions.create(model="tiny", prompt=prompt, frequency_penalty=2, **long).choices[0].text
    assert len(set(frequent)) > 1 and frequent[0] == repeated[0]
    # llama.cpp's repeat_last_n: counted over the last 8 tokens only, the penalty stops at
    # 8 x 2 = 16, below the bias; 0 counts nothing.
    for window in (8, 0):
        capped = client.completions.create(
            model="tiny", prompt=prompt, frequency_penalty=2, extra_body={"repeat_last_n": window}, **long
        ).choices[0].text
        assert capped == repeated, window
    for window in (-2, 2**32):  # 2**32 would reach llama.cpp's 32 bits as 0: no penalties
        with pytest.raises(openai.BadRequestError, match=re.escape(
                f"repeat_last_n must be -1 (the context) or between 0 and 2147483647, got {window}")):
            client.completions.create(model="tiny", prompt=prompt, extra_body={"repeat_last_n": window}, max_tokens=1)


def test_typical_p_keeps_the_most_typical_tokens(client: openai.OpenAI) -> None:
    """llama-server's typical_p: with a mass this small one token is left at each step (the one
    whose surprise is closest to the entropy), so every seed writes the same text; without it,
    hot sampling over the whole vocabulary differs from seed to seed."""
    hot = {"model": "tiny", "prompt": "Typical", "temperature": 2.0, "max_tokens": 12, "top_p": 1.0}
    free = {client.completions.create(**hot, seed=s, extra_body={"top_k": 0, "min_p": 0}).choices[0].text
            for s in range(4)}
    assert len(free) > 1
    typical = {
        client.completions.create(**hot, seed=s, extra_body={"top_k": 0, "min_p": 0, "typical_p": 1e-6}).choices[0].text
        for s in range(4)
    }
    assert len(typical) == 1
    with pytest.raises(openai.BadRequestError, match=r"typical_p must be between 0 and 1, got 1\.5"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"typical_p": 1.5})


# Single-character tokens of the tiny vocabulary (gguf_builder: printable ASCII from id 260).
def char_token(char: str) -> int:
    return 259 + ord(char) - 0x20


HOT = {"model": "tiny", "prompt": "Samplers", "temperature": 1.5, "max_tokens": 12, "top_p": 1.0}
FREE = {"top_k": 0, "min_p": 0}


def seeded_texts(client: openai.OpenAI, extra: dict[str, Any], **fields: Any) -> set[str]:
    request = {**HOT, **fields}
    return {client.completions.create(**request, seed=s, extra_body={**FREE, **extra}).choices[0].text for s in range(4)}


def test_mirostat_top_n_sigma_and_dynamic_temperature(client: openai.OpenAI) -> None:
    """llama-server's samplers with its meaning. Hot sampling over the whole vocabulary differs
    from seed to seed; each of these, set to its narrowest, leaves the best token only, so every
    seed writes the greedy text: Mirostat 2 aiming at a surprise near zero, top-n-sigma with
    almost no spread, a dynamic temperature whose exponent takes it to its low end (0)."""
    greedy = client.completions.create(model="tiny", prompt=HOT["prompt"], max_tokens=12, temperature=0).choices[0].text
    assert len(seeded_texts(client, {})) > 1
    for narrow in (
        {"mirostat": 2, "mirostat_tau": 1e-4},
        {"top_n_sigma": 1e-6},
        {"dynatemp_range": 1.5, "dynatemp_exponent": 1e9},
    ):
        assert seeded_texts(client, narrow) == {greedy}, narrow
    # A dynamic temperature acts at temperature 0 too (llama-server's chain): with exponent 0
    # it is temperature + range, hot again.
    hot_at_zero = seeded_texts(client, {"dynatemp_range": 2.0, "dynatemp_exponent": 0.0}, temperature=0.0)
    assert len(hot_at_zero) > 1 and greedy not in hot_at_zero
    # Mirostat 1 with a seed is reproducible and samples (it is not greedy at its default tau).
    miro = {"mirostat": 1}
    first = client.completions.create(**HOT, seed=7, extra_body=miro).choices[0].text
    assert client.completions.create(**HOT, seed=7, extra_body=miro).choices[0].text == first
    assert len(seeded_texts(client, miro)) > 1


def test_xtc_drops_the_most_likely_tokens(client: openai.OpenAI) -> None:
    """XTC: after "The" the tiny model's two best tokens, "=" and the byte token of "t", are
    about as likely (log probabilities -0.84 and -0.88); biased alike, both are far above the
    threshold and every other token far below it. XTC at probability 1 drops the more likely of
    the two and writes the other, whatever the seed; without it the more likely one wins at
    temperature 0. At temperature 0 too, as llama-server's chain applies XTC before the
    temperature."""
    pair = ("=", "t")
    tokens = (char_token("="), 3 + ord("t"))  # gguf_builder: byte b is token 3 + b
    request = {"model": "tiny", "prompt": [char_token(c) for c in "The"], "max_tokens": 1,
               "logit_bias": {str(t): 100 for t in tokens}}
    best = client.completions.create(**request, temperature=0.0).choices[0].text
    assert best in pair
    other = pair[1] if best == pair[0] else pair[0]
    xtc = {"xtc_probability": 1.0, "xtc_threshold": 0.1}
    for temperature in (0.0, 1.0):
        written = {client.completions.create(**request, temperature=temperature, seed=s, extra_body={**FREE, **xtc})
                   .choices[0].text for s in range(6)}
        assert written == {other}, temperature
    plain = {client.completions.create(**request, temperature=1.0, seed=s, extra_body=FREE).choices[0].text
             for s in range(6)}
    assert best in plain
    # A threshold above 0.5 turns XTC off (llama.cpp's rule).
    off = client.completions.create(**request, temperature=0.0, extra_body={**xtc, "xtc_threshold": 0.6})
    assert off.choices[0].text == best


def test_dry_penalises_extending_a_repetition(client: openai.OpenAI) -> None:
    """DRY over the prompt's tokens: after "a b c d a b c", writing "d" would extend a repeated
    run of 3 past the allowed 2, so it loses 100 * 1.75 from its logit and the +100 bias no
    longer wins. A sequence breaker inside the run ("b") ends it: no penalty."""
    prompt = [char_token(c) for c in "abcdabc"]
    request = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
               "logit_bias": {str(char_token("d")): 100}}
    assert client.completions.create(**request).choices[0].text == "d"
    dry = {"dry_multiplier": 100.0, "dry_base": 1.75, "dry_allowed_length": 2}
    assert client.completions.create(**request, extra_body=dry).choices[0].text != "d"
    broken = {**dry, "dry_sequence_breakers": ["b"]}
    assert client.completions.create(**request, extra_body=broken).choices[0].text == "d"
    # Only the last 3 tokens looked at: the earlier run is out of sight.
    assert client.completions.create(**request, extra_body={**dry, "dry_penalty_last_n": 3}).choices[0].text == "d"
    # -1 is the whole context, as llama-server reads it.
    assert client.completions.create(**request, extra_body={**dry, "dry_penalty_last_n": -1}).choices[0].text != "d"
    # On chat too (the same fields).
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logit_bias={str(char_token("d")): 100}, extra_body={"dry_multiplier": 100.0, "dry_allowed_length": 1},
    )
    assert chat.choices[0].message.content != "dddd"


@pytest.mark.parametrize(("extra", "message"), [
    ({"mirostat": 3}, "mirostat must be 0 (off), 1 or 2, got 3"),
    ({"mirostat_tau": -1}, "mirostat_tau must be a finite number >= 0, got -1"),
    ({"dynatemp_range": -0.5}, "dynatemp_range must be a finite number >= 0, got -0.5"),
    ({"xtc_probability": 1.5}, "xtc_probability must be between 0 and 1, got 1.5"),
    ({"xtc_threshold": -0.1}, "xtc_threshold must be between 0 and 1, got -0.1"),
    ({"dry_base": 0.5}, "dry_base must be a finite number >= 1, got 0.5"),
    ({"dry_allowed_length": -1}, "dry_allowed_length must be between 0 and 2147483647, got -1"),
    ({"dry_penalty_last_n": -2}, "dry_penalty_last_n must be -1 (the context) or between 0 and 2147483647, got -2"),
    ({"dry_allowed_length": 2**31}, "dry_allowed_length must be between 0 and 2147483647, got 2147483648"),
    # 2**32 + 1 would reach llama.cpp's 32 bits as 1: greedy.
    ({"top_k": 2**32 + 1}, "top_k must be between 0 and 2147483647, got 4294967297"),
    ({"min_keep": -2}, "min_keep must be between 0 and 2147483647, got -2"),
    ({"dry_sequence_breakers": []}, "dry_sequence_breakers must be a non-empty list of strings"),
    ({"dry_sequence_breakers": ["\n", ""]}, "dry_sequence_breakers[1] must be 1 to 40 bytes"),
    ({"dry_sequence_breakers": ["é" * 21]}, "dry_sequence_breakers[0] must be 1 to 40 bytes"),
])
def test_llama_sampler_fields_are_checked(client: openai.OpenAI, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body=extra)


def test_ignore_eos_runs_to_max_tokens(client: openai.OpenAI) -> None:
    """llama-server's ignore_eos (benchmarks send it): an end-of-generation token is never
    sampled. Biased towards EOS (id 2 in the tiny vocabulary) the reply ends at once; with
    ignore_eos it runs to max_tokens."""
    eos_first = {"model": "tiny", "prompt": "Count:", "temperature": 0.0, "max_tokens": 10, "logit_bias": {"2": 100}}
    ended = client.completions.create(**eos_first)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    full = client.completions.create(**eos_first, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=6, logit_bias={"2": 100},
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6


def test_prompt_cache_shows_in_usage_and_engine_stats(daemon, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "A long enough question about caching " * 4}]
    first = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    again = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    # llama-server's cache_prompt false: the whole prompt again, the same answer.
    cold = client.chat.completions.create(
        model="tiny", messages=messages, extra_body={"cache_prompt": False}, **GREEDY
    )
    assert cold.usage is not None and cold.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == first.choices[0].message.content
    turn2 = [
        *messages,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and then?"},
    ]
    second = client.chat.completions.create(model="tiny", messages=turn2, **GREEDY)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens
    engine = daemon.request("GET", "/v2/models/tiny").json()["engine"]
    assert engine["prompt_tokens_cached"] > 0 and engine["kv_cells_used"] > 0
    assert engine["chat_template"] == "gguf (jinja)"


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["happy", "sad"]}},
        "required": ["ok", "mood"],
        "additionalProperties": False,
    }
    for seed in (1, 2, 3):
        result = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Answer in JSON"}], seed=seed,
            temperature=1.0, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        )
        value = json.loads(result.choices[0].message.content or "")
        assert isinstance(value["ok"], bool) and value["mood"] in ("happy", "sad") and set(value) == {"ok", "mood"}
        assert result.choices[0].finish_reason == "stop"
    # json_object: any JSON object ("}" pushed up so the random model closes it quickly).
    close = str(259 + 1 + ord("}") - 0x21)
    obj = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON please"}], temperature=0, max_tokens=40,
        response_format={"type": "json_object"}, logit_bias={close: 50},
    )
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    bad = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}
    with pytest.raises(openai.BadRequestError, match=r"json_schema\.properties\.age: keyword 'minimum' is not supported"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": bad}},
        )


def test_logit_bias_in_llama_servers_forms(client: openai.OpenAI) -> None:
    # llama-server's OpenAI routes take its /completion forms too: a list of [id or text, bias]
    # pairs, and a text where OpenAI has a token id, each of the text's tokens biased (the
    # tiny vocabulary's "z" is "▁" and "z", ids 259 and 349, with its space prefix).
    user = [{"role": "user", "content": "x"}]

    def answers(bias: Any) -> tuple[str, str]:
        chat = client.chat.completions.create(model="tiny", messages=user, temperature=0, max_tokens=4,
                                              extra_body={"logit_bias": bias})
        text = client.completions.create(model="tiny", prompt="x", temperature=0, max_tokens=4,
                                         extra_body={"logit_bias": bias})
        return chat.choices[0].message.content or "", text.choices[0].text

    assert answers({"349": 100}) == answers([[349, 100]]) == ("zzzz", "zzzz")
    both = answers({"259": 100, "349": 100})
    assert both != ("zzzz", "zzzz") and set("".join(both)) == {"z", " "}
    assert answers({"z": 100}) == answers([["z", 100]]) == both
    # false: llama-server's ban. The greedy answer without the ban starts with "z" here.
    assert answers({"349": 30})[0].startswith("z")
    assert "z" not in "".join(answers([[349, 30], ["z", False]]))
    # A token named twice gets both biases, as llama-server's sampler adds each pair.
    assert answers([[349, 12], [349, 12]]) == answers({"349": 24}) != answers({"349": 12})
    with pytest.raises(openai.BadRequestError, match=r"logit_bias: the biases of token 349 add up to 120; "):
        answers([[349, 60], ["z", 60]])


def test_structured_output_is_json_that_a_strict_parser_takes(client: openai.OpenAI) -> None:
    # The newline's (or tab's) byte token pushed up: whitespace may be newlines and an indent
    # where llama-server's grammar allows whitespace (after "{", ",", a key and ":", before
    # "}"), but not after a value, so never before a comma nor after the answer; and a string
    # may not hold a raw control character (RFC 8259).
    newline, tab = str(3 + 0x0A), str(3 + 0x09)
    schema = {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
        "required": ["s", "n"], "additionalProperties": False,
    }
    answers = []
    for bias in ({newline: 100}, {tab: 100}, {newline: 100, tab: 100}):
        result = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "JSON"}], temperature=0, max_tokens=300,
            logit_bias=bias, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
        content = result.choices[0].message.content or ""
        assert result.choices[0].finish_reason == "stop", content
        value = json.loads(content)  # strict: a raw control character in a string is refused
        assert len(value["s"]) <= 4 and all(ord(c) >= 0x20 for c in value["s"]), content
        assert content.endswith("}") and not re.search(r"\s,", content), content
        answers.append(content)
    assert answers[0].startswith("{\n") and re.search(r"\n[ \t]*\}$", answers[0]), answers[0]


def test_embedding_dimensions(client: openai.OpenAI) -> None:
    import math

    full = client.embeddings.create(model="embedder", input="shorten me").data[0].embedding
    short = client.embeddings.create(model="embedder", input="shorten me", dimensions=16).data[0].embedding
    assert len(short) == 16
    assert math.isclose(sum(v * v for v in short), 1.0, rel_tol=1e-6)
    scale = math.sqrt(sum(v * v for v in full[:16]))
    assert all(math.isclose(a, b / scale, rel_tol=1e-5, abs_tol=1e-7) for a, b in zip(short, full[:16], strict=True))
    with pytest.raises(openai.BadRequestError, match="dimensions: the model's embeddings have 64 dimensions, got 65"):
        client.embeddings.create(model="embedder", input="x", dimensions=65)


@pytest.fixture(scope="module")
def embedder_ids(repo: Path) -> Callable[[str], list[int]]:
    """Text to the embedding model's token ids, with its special tokens (BOS), by llama.cpp's
    own tokenizer: the ids a client such as LangChain's OpenAIEmbeddings would send."""
    from llama_cpp import Llama

    vocab = Llama(str(repo / "embedder" / "1" / "model.gguf"), vocab_only=True, verbose=False)
    return lambda text: vocab.tokenize(text.encode(), add_bos=True, special=True)


def test_embedding_token_ids_are_the_texts_tokens(
    client: openai.OpenAI, embedder_ids: Callable[[str], list[int]]
) -> None:
    ids = embedder_ids("hello world")
    text = client.embeddings.create(model="embedder", input="hello world", encoding_format="float")
    tokens = client.embeddings.create(model="embedder", input=ids, encoding_format="float")
    np.testing.assert_allclose(tokens.data[0].embedding, text.data[0].embedding, atol=1e-5)
    assert tokens.usage.prompt_tokens == text.usage.prompt_tokens == len(ids)
    # Embedded as given, as llama-server does: without the BOS nothing puts it back.
    bare = client.embeddings.create(model="embedder", input=ids[1:], encoding_format="float")
    assert bare.usage.prompt_tokens == len(ids) - 1
    assert not np.allclose(bare.data[0].embedding, text.data[0].embedding, atol=1e-3)


def test_embedding_several_token_arrays(client: openai.OpenAI, embedder_ids: Callable[[str], list[int]]) -> None:
    texts = ["one", "two words", "one"]
    by_text = client.embeddings.create(model="embedder", input=texts, encoding_format="float")
    by_ids = client.embeddings.create(model="embedder", input=[embedder_ids(t) for t in texts], encoding_format="float")
    # Strings and token lists side by side, one input each (llama-server takes this too).
    mixed = client.embeddings.create(model="embedder", input=["one", embedder_ids("two words")], encoding_format="float")
    assert [d.index for d in by_ids.data] == [0, 1, 2]
    for result in (by_ids, mixed):
        for got, want in zip(result.data, by_text.data, strict=False):
            np.testing.assert_allclose(got.embedding, want.embedding, atol=1e-5)
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == sum(len(embedder_ids(t)) for t in texts)
    assert mixed.usage.prompt_tokens == len(embedder_ids("one")) + len(embedder_ids("two words"))


def test_embedding_token_ids_base64_and_dimensions(
    client: openai.OpenAI, embedder_ids: Callable[[str], list[int]]
) -> None:
    import base64

    want = client.embeddings.create(model="embedder", input="shorten me", dimensions=16, encoding_format="float")
    raw = client.embeddings.create(
        model="embedder", input=[embedder_ids("shorten me")], dimensions=16, encoding_format="base64"
    ).data[0].embedding
    assert isinstance(raw, str)
    vector = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    np.testing.assert_allclose(vector, want.data[0].embedding, atol=1e-5)
    # The client's default: it asks for base64 and decodes it.
    default = client.embeddings.create(model="embedder", input=embedder_ids("shorten me"), dimensions=16)
    np.testing.assert_allclose(default.data[0].embedding, want.data[0].embedding, atol=1e-5)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "input: at least one string or token id is required"),
        ([[]], "input[0]: an empty list of token ids has nothing to embed"),
        ([[1, 5], []], "input[1]: an empty list of token ids has nothing to embed"),
        (
            ["hello", 5],
            "input[1]: a token id among strings or token-id lists; send token ids as one list "
            "of ints (one input) or as lists of ints (one input each)",
        ),
        ([[1, 5], [3, 4, 5, 99999]], "input[1][3]: token id 99999 is out of range (vocabulary 379)"),
        ([1, 379], "input[0][1]: token id 379 is out of range (vocabulary 379)"),
        ([-1], "input[0][0]: token id -1 is out of range (vocabulary 379)"),
        ([[1, "a"]], "invalid request: Expected `int`, got `str` - at `$.input[0][1]`"),
        ([1.5], "invalid request: Expected `int | str | array`, got `float` - at `$.input[0]`"),
        ([1] * 600, "input[0] is 600 tokens but model 'embedder' embeds at most 512 tokens per input (n_batch)"),
    ],
)
def test_embedding_input_rejected(client: openai.OpenAI, value: Any, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="embedder", input=value, encoding_format="float")
    assert info.value.message == f"Error code: 400 - {message}"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
LIGHTS = {"type": "function", "function": {"name": "lights_off"}}


def test_tool_calls_required_and_named(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for seed in (1, 2):
        result = client.chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER, LIGHTS], tool_choice="required",
            parallel_tool_calls=False, seed=seed, temperature=1.0, max_tokens=400,
        )
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
        assert calls[0].function.name in ("get_weather", "lights_off")
        arguments = json.loads(calls[0].function.arguments)
        if calls[0].function.name == "get_weather":
            assert arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["celsius"], bool)
        else:
            assert arguments == {}
    named = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER, LIGHTS],
        tool_choice={"type": "function", "function": {"name": "lights_off"}}, parallel_tool_calls=False,
        temperature=0, max_tokens=400,
    )
    calls = named.choices[0].message.tool_calls or []
    assert calls and {c.function.name for c in calls} == {"lights_off"}
    assert named.choices[0].finish_reason == "tool_calls"


def test_tool_call_streams_as_deltas(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False, "temperature": 0, "max_tokens": 400,
    }
    full = client.chat.completions.create(**kwargs)
    expected = (full.choices[0].message.tool_calls or [])[0]
    names, arguments, ids, finish, pieces = [], "", set(), None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                if call.id:
                    ids.add(call.id)
                if call.function and call.function.name:
                    names.append(call.function.name)
                if call.function and call.function.arguments:
                    arguments += call.function.arguments
                    pieces += 1
            finish = choice.finish_reason or finish
    assert names == ["get_weather"] and len(ids) == 1 and finish == "tool_calls"
    assert pieces > 3  # the arguments stream as they are generated, not in one piece
    assert json.loads(arguments) == json.loads(expected.function.arguments)


def test_tool_call_cut_by_max_tokens_is_length(client: openai.OpenAI) -> None:
    # OpenAI and llama-server: a call cut short ends with "length" (its arguments partial),
    # streamed or not; "tool_calls" would make clients parse arguments that end mid-object.
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    kwargs = {
        "model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": [strict],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False, "temperature": 0,
    }
    full = client.chat.completions.create(max_tokens=400, **kwargs)
    assert full.choices[0].finish_reason == "tool_calls" and full.usage is not None
    # The longest cut whose arguments are started but not yet valid JSON.
    for limit in range(full.usage.completion_tokens - 1, 0, -1):
        cut = client.chat.completions.create(max_tokens=limit, **kwargs).choices[0]
        arguments = cut.message.tool_calls[0].function.arguments if cut.message.tool_calls else ""
        if arguments:
            try:
                json.loads(arguments)
            except ValueError:
                break
    else:
        pytest.fail("no cut leaves a named call with partial arguments")
    assert cut.finish_reason == "length" and cut.message.content is None
    assert cut.message.tool_calls is not None and cut.message.tool_calls[0].function.name == "get_weather"
    streamed, finish = "", None
    for chunk in client.chat.completions.create(stream=True, max_tokens=limit, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function and call.function.arguments:
                    streamed += call.function.arguments
            finish = choice.finish_reason or finish
    assert finish == "length" and streamed == arguments
    with pytest.raises(openai.LengthFinishReasonError), client.chat.completions.stream(
        max_tokens=limit, **kwargs
    ) as stream:
        stream.until_done()


def test_parsed_replies_go_back_as_messages(client: openai.OpenAI) -> None:
    # The openai client's documented tool loop appends the reply it parsed to the messages;
    # it sends back the reply's null fields, `parsed`, a call's `parsed_arguments` and `index`.
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    question = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs = {"model": "tiny", "tools": [strict], "tool_choice": "required", "parallel_tool_calls": False,
              "temperature": 0, "max_tokens": 400}
    parsed = client.chat.completions.parse(messages=question, **kwargs).choices[0].message
    with client.chat.completions.stream(messages=question, **kwargs) as stream:
        streamed = stream.get_final_completion().choices[0].message
    for reply in (parsed, streamed):
        assert reply.tool_calls
        answered = [*question, reply, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "sunny"}]
        after = client.chat.completions.create(messages=answered, **{**kwargs, "max_tokens": 1})
        assert after.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.refusal: not supported"):
        client.chat.completions.create(
            model="tiny", max_tokens=1,
            messages=[*question, {"role": "assistant", "content": None, "refusal": "I can't"}, *question],
        )


def test_tool_results_go_back_through_the_template(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'}}
    answered = [*question, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    base = client.chat.completions.create(model="tiny", messages=question, tools=[WEATHER], max_tokens=1)
    after = client.chat.completions.create(model="tiny", messages=answered, tools=[WEATHER], max_tokens=1)
    assert base.usage is not None and after.usage is not None
    # The call and its result are in the prompt: at least the result's text in tokens more.
    assert after.usage.prompt_tokens > base.usage.prompt_tokens + len("21 degrees and sunny")
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"):
        bad = {**call, "function": {"name": "get_weather", "arguments": "{nope"}}
        client.chat.completions.create(model="tiny", messages=[question[0], {"role": "assistant", "tool_calls": [bad]},
                                                               {"role": "tool", "tool_call_id": "call_1", "content": "x"}],
                                       tools=[WEATHER], max_tokens=1)
    # A call without its result last: llama-server would continue that message, which it refuses.
    with pytest.raises(openai.BadRequestError, match="cannot continue an assistant message that contains tool calls"):
        client.chat.completions.create(model="tiny", messages=[question[0], {"role": "assistant", "tool_calls": [call]}],
                                       tools=[WEATHER], max_tokens=1)
    for extra, pattern in [
        ({"tool_choice": "auto"}, "tool_choice: only allowed when tools are specified"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool named 'nope'"),
        # With tools, the format is still held to what the grammar can enforce.
        ({"tools": [WEATHER], "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "integer", "maximum": 3}}}}, "keyword 'maximum' is not supported"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "n": {"type": "integer", "maximum": 3}}}}}]}, "keyword 'maximum' is not supported"),
    ]:
        with pytest.raises(openai.BadRequestError, match=pattern):
            client.chat.completions.create(model="tiny", messages=question, max_tokens=1, extra_body=extra)


def test_logprobs(daemon: Any, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Probabilities"}]
    full = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    content = full.choices[0].logprobs.content if full.choices[0].logprobs else None
    assert content is not None and len(content) == 12
    assert "".join(e.token for e in content) == full.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert bytes(entry.bytes or []).decode() == entry.token
    # llama-server's `id` beside OpenAI's fields: the ids of the tokens the answer is.
    ids = [getattr(entry, "id", None) for entry in content]
    assert ids == [getattr(entry.top_logprobs[0], "id", None) for entry in content]
    detokenized = daemon.post_ok("/detokenize", {"model": "tiny", "tokens": ids})
    assert detokenized["content"] == full.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, logprobs=True, top_logprobs=2, stream=True, **GREEDY
    ):
        for choice in chunk.choices:
            streamed.extend(choice.logprobs.content or [] if choice.logprobs else [])
    # The second request decodes from the prompt cache: float rounding may differ a little.
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-3)
    completion = client.completions.create(model="tiny", prompt="Probabilities", logprobs=1, **GREEDY)
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) == 1 for top in lp.top_logprobs or [])
    plain = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None
    for extra, pattern in [
        ({"top_logprobs": 2}, "top_logprobs: requires logprobs to be true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
    ]:
        with pytest.raises(openai.BadRequestError, match=pattern):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="logprobs must be between 0 and 20, got 21"):
        client.completions.create(model="tiny", prompt="x", logprobs=21, max_tokens=1)
    ten = client.completions.create(model="tiny", prompt="x", logprobs=10, max_tokens=1, temperature=0)
    assert ten.choices[0].logprobs is not None and len((ten.choices[0].logprobs.top_logprobs or [])[0]) == 10


def test_n_probs_on_chat_is_logprobs_with_that_many_alternatives(client: openai.OpenAI) -> None:
    """llama-server's `n_probs` on its OpenAI chat route: the same answer as `logprobs` with
    `top_logprobs` n (checked against llama-server's own: n_probs 2 gives OpenAI's
    `logprobs.content` with two alternatives per token, streamed too)."""
    messages = [{"role": "user", "content": "Probabilities"}]
    form = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    alias = client.chat.completions.create(model="tiny", messages=messages, extra_body={"n_probs": 2}, **GREEDY)
    expected, got = (r.choices[0].logprobs.content if r.choices[0].logprobs else None for r in (form, alias))
    assert expected is not None and got is not None
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in got] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in expected
    ]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in expected], abs=1e-3)
    streamed = [
        entry
        for chunk in client.chat.completions.create(
            model="tiny", messages=messages, stream=True, extra_body={"n_probs": 2}, **GREEDY
        )
        for choice in chunk.choices
        for entry in (choice.logprobs.content or [] if choice.logprobs else [])
    ]
    assert [e.token for e in streamed] == [e.token for e in expected]
    none = client.chat.completions.create(model="tiny", messages=messages, extra_body={"n_probs": 0}, **GREEDY)
    assert none.choices[0].logprobs is None
    for extra, pattern in [
        ({"n_probs": 2, "logprobs": True}, "n_probs and logprobs/top_logprobs: send one of the two forms"),
        ({"n_probs": 21}, "n_probs must be between 0 and 20, got 21"),
        ({"n_probs": 1, "tools": [WEATHER]}, "n_probs: not supported together with tools"),
    ]:
        with pytest.raises(openai.BadRequestError, match=pattern):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body=extra)


def test_post_sampling_probs_on_chat_are_the_candidates_after_the_samplers(client: openai.OpenAI) -> None:
    """llama-server's `post_sampling_probs` on its chat route: `prob` and `top_probs`, the
    probabilities of the candidates the samplers left (top_k 3 leaves three, summing to 1)."""
    messages = [{"role": "user", "content": "Probabilities"}]
    sampling = {"temperature": 1.0, "top_p": 1.0, "seed": 5, "max_tokens": 6}
    extra = {"top_k": 3, "min_p": 0.0, "post_sampling_probs": True}
    for stream in (False, True):
        if stream:
            entries = [
                entry
                for chunk in client.chat.completions.create(
                    model="tiny", messages=messages, logprobs=True, top_logprobs=5, stream=True,
                    extra_body=extra, **sampling,
                )
                for choice in chunk.choices
                for entry in (
                    [e.model_dump(exclude_unset=True) for e in choice.logprobs.content or []] if choice.logprobs else []
                )
            ]
        else:
            reply = client.chat.completions.create(
                model="tiny", messages=messages, logprobs=True, top_logprobs=5, extra_body=extra, **sampling
            )
            assert reply.choices[0].logprobs is not None
            entries = [e.model_dump(exclude_unset=True) for e in reply.choices[0].logprobs.content or []]
        assert len(entries) == 6, stream
        for entry in entries:
            assert "logprob" not in entry and "top_logprobs" not in entry
            candidates = entry["top_probs"]
            assert len(candidates) == 3
            assert sum(c["prob"] for c in candidates) == pytest.approx(1.0, abs=1e-5)
            assert entry["prob"] == next(c["prob"] for c in candidates if c["id"] == entry["id"])
    greedy = client.chat.completions.create(
        model="tiny", messages=messages, extra_body={"n_probs": 2, "post_sampling_probs": True}, **GREEDY
    )
    assert greedy.choices[0].logprobs is not None
    for entry in (e.model_dump(exclude_unset=True) for e in greedy.choices[0].logprobs.content or []):
        assert entry["prob"] == 1.0 and [c["prob"] for c in entry["top_probs"]] == [1.0]
    with pytest.raises(openai.BadRequestError, match="post_sampling_probs: requires logprobs to be true"):
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1, extra_body={"post_sampling_probs": True}
        )


def test_n_probs_on_completions_is_logprobs(client: openai.OpenAI) -> None:
    form = client.completions.create(model="tiny", prompt="Probabilities", logprobs=2, **GREEDY)
    alias = client.completions.create(model="tiny", prompt="Probabilities", extra_body={"n_probs": 2}, **GREEDY)
    assert form.choices[0].logprobs is not None and alias.choices[0].logprobs is not None
    assert alias.choices[0].logprobs.tokens == form.choices[0].logprobs.tokens
    assert [sorted(t) for t in alias.choices[0].logprobs.top_logprobs or []] == [
        sorted(t) for t in form.choices[0].logprobs.top_logprobs or []
    ]
    none = client.completions.create(model="tiny", prompt="Probabilities", extra_body={"n_probs": 0}, **GREEDY)
    assert none.choices[0].logprobs is None
    for extra, pattern in [
        ({"n_probs": 2, "logprobs": 3}, "n_probs and logprobs disagree; send one of them"),
        ({"n_probs": 21}, "n_probs must be between 0 and 20, got 21"),
        ({"n_probs": 2, "post_sampling_probs": True}, "post_sampling_probs"),  # chat's only
    ]:
        with pytest.raises(openai.BadRequestError, match=pattern):
            client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body=extra)


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, repo: Path) -> None:
    """OpenAI's echo with logprobs, as lm-eval-harness scores text (a batch of token-id
    prompts, max_tokens 1, logprobs 1; it sums token_logprobs[ctxlen:-1] and compares each
    with max(top_logprobs)): every prompt token after the first is scored given those before
    it, as numpy computes it; the first is null, as OpenAI has it; the last entry is the
    generated token, as without echo. Streamed, the echo chunk carries the prompt's part."""
    ids = [1, 300, 301, 320, 330, 270, 280, 290, 311]
    expected = reference_logprobs(repo / "tiny" / "1" / "model.gguf", ids)
    alone = client.completions.create(model="tiny", prompt=ids, logprobs=1, max_tokens=1, temperature=0)
    batch = client.completions.create(
        model="tiny", prompt=[ids, ids[:4]], echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    for choice, prompt in zip(batch.choices, (ids, ids[:4]), strict=True):
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.tokens is not None and len(lp.tokens) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [expected[i - 1][prompt[i]] for i in range(1, len(prompt))]
        assert lp.token_logprobs[1:-1] == pytest.approx(want, abs=0.05)
        for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
            assert value is not None and top is not None and len(top) == 1 and value <= 0
            assert max(top.values()) >= value - 1e-6
        assert choice.text == "".join(lp.tokens)  # the prompt's text, then the generated token
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    made = alone.choices[0].logprobs
    assert made is not None and made.token_logprobs is not None
    first = batch.choices[0].logprobs
    assert first is not None and first.token_logprobs is not None
    assert first.token_logprobs[-1] == pytest.approx(made.token_logprobs[0], abs=1e-3)
    assert batch.choices[0].text.endswith(alone.choices[0].text)
    streamed = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0, stream=True
    ) if c.choices]
    assert "".join(c.text for c in streamed) == batch.choices[0].text
    values = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs or []]
    assert values[0] is None and values[1:] == pytest.approx(first.token_logprobs[1:], abs=1e-3)
    # max_tokens 0 scores the prompt alone; echo without logprobs echoes token ids as text.
    scored = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs is not None
    again = scored.choices[0].logprobs.token_logprobs or []
    assert again[0] is None and again[1:] == pytest.approx(first.token_logprobs[1:-1], abs=1e-3)
    # A text prompt: its own tokens (no BOS, no space before the first word) join into it.
    worded = client.completions.create(
        model="tiny", prompt="Once upon a", echo=True, logprobs=0, max_tokens=3, temperature=0
    )
    assert worded.choices[0].text.startswith("Once upon a") and worded.choices[0].logprobs is not None
    assert "".join(worded.choices[0].logprobs.tokens or []) == worded.choices[0].text
    assert worded.usage is not None  # its prompt_tokens count the BOS; the echo has none
    assert len(worded.choices[0].logprobs.tokens or []) == worded.usage.total_tokens - 1
    plain = client.completions.create(model="tiny", prompt=ids, echo=True, max_tokens=0)
    assert plain.choices[0].text == "".join((first.tokens or [])[: len(ids)])
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="echo: the token ids of prompt 1 do not make whole UTF-8 text"):
        # Byte token 0xE2 alone: the start of a three-byte character.
        client.completions.create(model="tiny", prompt=[ids, [1, 3 + 0xE2]], echo=True, max_tokens=0)


def test_an_error_after_the_stream_started_is_its_last_event(start_daemon, tmp_path: Path) -> None:
    """An engine failing mid-stream: the 200 and the first events went out, so the error is
    the last event, in each route's shape (the openai client raises it; Triton's
    generate_stream carries {"error": "..."}), and the connection stays sound (before: a
    second response was written into the stream and the client saw a broken connection)."""
    from support import failing_generation_plugin

    failing_generation_plugin(tmp_path / "plugins", tmp_path / "repo")
    daemon = start_daemon("--model-repository", str(tmp_path / "repo"),
                          "--backend-directory", str(tmp_path / "plugins"), http=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.http_port}/v1", api_key="unused", max_retries=0)
    for n in (1, 2):
        texts: list[str] = []
        with pytest.raises(openai.APIError, match="the engine failed"):
            for chunk in client.chat.completions.create(
                model="broken", messages=[{"role": "user", "content": "x"}], stream=True, n=n
            ):
                texts += [c.delta.content or "" for c in chunk.choices]
        if n == 1:
            assert texts == ["a", "b"]
        else:  # every choice's first chunk comes before the stream starts; then as they come
            assert texts[:2] == ["a", "a"] and set(texts[2:]) <= {"b"}
    reply = daemon.post_json("/v2/models/broken/generate_stream", {"text_input": "x"})
    events = [json.loads(line[5:]) for line in reply.body.split(b"\n") if line.startswith(b"data:")]
    assert reply.status == 200 and [e.get("text_output") for e in events[:2]] == ["a", "b"]
    assert events[-1] == {"error": "the engine failed"}
    # Before the stream: a plain error response with its status.
    with pytest.raises(openai.InternalServerError, match="the engine failed"):
        client.completions.create(model="broken", prompt="x")
    # A plugin written before chat_prompt took template variables: a 400 naming the field.
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs: model 'broken' runs on backend 'failing'"):
        client.chat.completions.create(model="broken", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"chat_template_kwargs": {"a": 1}})
    assert "Traceback" not in daemon.log()



def sse_events(daemon: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    reply = daemon.post_json(path, body)
    assert reply.status == 200, reply.body
    lines = reply.body.decode().split("\n")
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
           "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_llama_servers_progress_and_timings_in_a_stream(daemon: Any, path: str) -> None:
    """llama-server's return_progress and timings_per_token, as its web UI sends them."""
    chat = "chat" in path
    prompt = {"messages": [{"role": "user", "content": "progress"}]} if chat else {"prompt": "progress"}
    body = {"model": "tiny", **prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    plain = sse_events(daemon, path, body)
    assert not any("prompt_progress" in e or "timings" in e for e in plain)
    events = sse_events(daemon, path, {**body, "return_progress": True, "timings_per_token": True})
    progress = [e for e in events if "prompt_progress" in e]
    # The slot taken (what its cache held), then the prompt evaluated: llama-server's pair.
    assert len(progress) == 2 and events[:2] == progress
    total = progress[0]["prompt_progress"]["total"]
    assert progress[-1]["prompt_progress"]["processed"] == total > 0
    for event in progress:
        choice = event["choices"][0]
        assert (choice["delta"] == {"role": "assistant", "content": None}) if chat else choice["text"] == ""
    assert all(set(e["timings"]) == TIMINGS for e in events)
    rest = events[2:]
    last = rest[-1]["timings"]
    assert last["predicted_n"] == 4 and last["prompt_n"] + last["cache_n"] == total

    def text(evs: list[dict[str, Any]]) -> str:
        return "".join((c["delta"].get("content") or "") if chat else c["text"] for e in evs for c in e["choices"])

    assert text(rest) == text(plain)


def test_llama_servers_timings_on_a_whole_answer(daemon: Any) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    answer = daemon.post_json("/v1/chat/completions", {**body, "timings_per_token": True}).json()
    assert set(answer["timings"]) == TIMINGS and answer["timings"]["predicted_n"] == 3
    assert answer["timings"]["prompt_n"] + answer["timings"]["cache_n"] == answer["usage"]["prompt_tokens"]
    assert "timings" not in daemon.post_json("/v1/chat/completions", body).json()
    # Progress has nowhere to go in a whole answer, as in llama-server's.
    assert "prompt_progress" not in daemon.post_json("/v1/chat/completions", {**body, "return_progress": True}).json()
    # One choice's timings only: n 2, or two prompts, or best_of, are refused.
    completion = {"model": "tiny", "max_tokens": 3, "temperature": 0, "timings_per_token": True}
    for path, asked in (("/v1/chat/completions", {**body, "timings_per_token": True, "n": 2}),
                        ("/v1/completions", {**completion, "prompt": ["a", "b"]}),
                        ("/v1/completions", {**completion, "prompt": "a", "best_of": 2})):
        reply = daemon.post_json(path, asked)
        assert reply.status == 400 and "timings_per_token" in reply.json()["error"]["message"], (path, asked)
    one = daemon.post_json("/v1/completions", {**completion, "prompt": ["a"]}).json()
    assert one["timings"]["predicted_n"] == 3


def test_an_echo_streams_with_progress(daemon: Any) -> None:
    """return_progress with echo: a text prompt's echo is the prompt; an echo of scores or of
    token ids is known only after the prompt is read, so the pair is refused."""
    body = {"model": "tiny", "prompt": "echo me", "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "stream": True, "echo": True}
    events = sse_events(daemon, "/v1/completions", {**body, "return_progress": True})
    texts = [e["choices"][0]["text"] for e in events if "prompt_progress" not in e]
    assert texts[0] == "echo me" and any("prompt_progress" in e for e in events)
    assert texts == [e["choices"][0]["text"] for e in sse_events(daemon, "/v1/completions", body)]
    for extra in ({"logprobs": 1}, {"prompt": [1, 2, 3]}):
        reply = daemon.post_json("/v1/completions", {**body, **extra, "return_progress": True})
        assert reply.status == 400, reply.body
        assert reply.json()["error"]["message"] == "return_progress: not with echo of logprobs or of a token-id prompt"


def test_sse_pings_while_a_stream_is_silent() -> None:
    """llama-server's sse_ping_interval: a comment line after each silent interval, the
    items unchanged, and a stream closed early cancels the wait for the next item."""
    from daemon.api.openai import pinged

    class Response:
        def __init__(self) -> None:
            self.writes: list[bytes] = []

        async def write(self, data: bytes) -> None:
            self.writes.append(data)

    async def slow(gaps: list[float], closed: list[bool]) -> AsyncIterator[int]:
        try:
            for index, gap in enumerate(gaps):
                await asyncio.sleep(gap)
                yield index
        finally:
            closed.append(True)

    async def run(gaps: list[float], interval: int | None, take: int | None = None) -> tuple[list[object], list[bool]]:
        response, closed, seen = Response(), [], []
        source = slow(gaps, closed)
        async with contextlib.aclosing(pinged(source, response, interval)) as items:  # type: ignore[arg-type]
            async for item in items:
                seen.extend(response.writes)  # the pings written while waiting for it
                response.writes.clear()
                seen.append(item)
                if take is not None and len(seen) >= take:
                    break
        await source.aclose()
        return seen, closed

    seen, _ = asyncio.run(run([0.0, 2.5, 0.0], 1))  # half a second from each ping
    assert seen == [0, b":\n\n", b":\n\n", 1, 2]
    assert asyncio.run(run([0.0, 1.2], None))[0] == [0, 1]
    assert asyncio.run(run([0.0, 1.2], -1))[0] == [0, 1]
    # Left after the first item while waiting for the second: that wait is cancelled.
    seen, closed = asyncio.run(run([0.0, 30.0], 1, take=1))
    assert seen == [0] and closed == [True]


def test_sse_ping_interval_is_taken_and_checked(daemon: Any) -> None:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}
    for path in ("/v1/completions", "/completion"):
        events = sse_events(daemon, path, {**body, "sse_ping_interval": 1})
        assert events
        reply = daemon.post_json(path, {**body, "sse_ping_interval": -2})
        assert reply.status == 400 and "sse_ping_interval" in reply.json()["error"]["message"]
