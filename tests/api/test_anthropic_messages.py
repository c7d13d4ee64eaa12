"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) over raw HTTP (the
`anthropic` client is not a test dependency: tests/fixtures/oracle/anthropic_messages.py runs
it) against tiny GGUF models: the same text, tool calls, reasoning and prompt as
`/v1/chat/completions` for the same conversation, streamed events that add up to the whole
reply, and Anthropic's error shape for each rejection."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from gguf_builder import write_tiny_llama

from support import cut_by_unload

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
MODELS = {
    "tiny": None,  # ChatML: tools in the generic JSON reply
    "qwen": "Qwen-Qwen2.5-7B-Instruct.jinja",  # tools in the model's own syntax
    "r1": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",  # the prompt opens the reasoning
}
WEATHER = {
    "name": "get_weather", "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                     "required": ["city"], "additionalProperties": False},
}
LIGHTS = {"name": "lights_off", "description": "Lights off",
          "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    repo = tmp_path_factory.mktemp("anthropic")
    for name, template in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        extra: dict[str, Any] = {"user_tokens": ("<think>", "</think>")} if name == "r1" else {}
        if template is not None:
            extra["chat_template"] = (TEMPLATES / template).read_text()
        write_tiny_llama(repo / name / "1" / "model.gguf", seed=1, n_ctx=2048, **extra)
        (repo / name / "config.pbtxt").write_text(
            'backend: "llamacpp"\nparameters { key: "n_ctx" value { string_value: "4096" } }\n'
        )
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo))
    yield process
    process.stop()


def post(daemon: Any, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    reply = daemon.post_json(path, body)
    return reply.status, reply.json()


def create(daemon: Any, **body: Any) -> dict[str, Any]:
    status, reply = post(daemon, "/v1/messages", {"max_tokens": 16, **body})
    assert status == 200, reply
    return reply


def events(daemon: Any, **body: Any) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed reply, checked to be Anthropic's framing."""
    reply = daemon.post_json("/v1/messages", {"max_tokens": 16, **body, "stream": True})
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream"), reply.body
    out = []
    for frame in reply.body.decode().split("\n\n"):
        if not frame:
            continue
        kind, data = frame.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == kind[len("event: "):]
        out.append((payload["type"], payload))
    return out


def assembled(stream: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The message the events build, as the anthropic client's accumulator builds it (tool
    input parsed from the whole of its partial_json)."""
    kinds = [kind for kind, _ in stream]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    message = dict(stream[0][1]["message"])
    message["content"], partial = [], {}
    open_block = None
    for kind, event in stream[2:-2]:
        if kind == "content_block_start":
            assert open_block is None and event["index"] == len(message["content"])
            message["content"].append(dict(event["content_block"]))
            open_block = event["index"]
        elif kind == "content_block_delta":
            assert event["index"] == open_block
            block, delta = message["content"][open_block], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                assert delta["type"] == "input_json_delta"
                partial[open_block] = partial.get(open_block, "") + delta["partial_json"]
        else:
            assert kind == "content_block_stop" and event["index"] == open_block
            if open_block in partial:
                message["content"][open_block]["input"] = json.loads(partial[open_block])
            open_block = None
    delta = stream[-2][1]
    message.update(delta["delta"])
    message["usage"] = {**message["usage"], **delta["usage"]}
    return message


def chat(daemon: Any, **body: Any) -> dict[str, Any]:
    status, reply = post(daemon, "/v1/chat/completions", body)
    assert status == 200, reply
    return reply


def count(daemon: Any, **body: Any) -> int:
    status, reply = post(daemon, "/v1/messages/count_tokens", body)
    assert status == 200, reply
    return reply["input_tokens"]


def prompt_tokens(usage: dict[str, int]) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]


def test_text_is_what_chat_completions_gives(daemon: Any) -> None:
    reply = create(daemon, model="tiny", system="Be brief", messages=HELLO, temperature=0, max_tokens=12)
    expected = chat(daemon, model="tiny", temperature=0, max_tokens=12,
                    messages=[{"role": "system", "content": "Be brief"}, *HELLO])
    text = expected["choices"][0]["message"]["content"]
    assert reply["id"].startswith("msg_") and reply["type"] == "message" and reply["role"] == "assistant"
    assert reply["model"] == "tiny" and reply["content"] == [{"type": "text", "text": text}]
    # 12 tokens and no end: cut by max_tokens.
    assert reply["stop_reason"] == "max_tokens" and reply["stop_sequence"] is None
    assert reply["usage"]["output_tokens"] == 12
    assert prompt_tokens(reply["usage"]) == expected["usage"]["prompt_tokens"]
    # System text blocks, and a user turn of text blocks, are the same conversation.
    blocks = create(daemon, model="tiny", system=[{"type": "text", "text": "Be brief", "cache_control": {"type": "ephemeral"}}],
                    messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
                    temperature=0, max_tokens=12, metadata={"user_id": "u1"})
    assert blocks["content"] == reply["content"]


def test_a_stream_adds_up_to_the_whole_reply(daemon: Any) -> None:
    body = {"model": "tiny", "messages": HELLO, "temperature": 0, "max_tokens": 10}
    whole = create(daemon, **body)
    stream = events(daemon, **body)
    message = assembled(stream)
    assert message["content"] == whole["content"] and message["id"].startswith("msg_")
    assert message["stop_reason"] == "max_tokens" and message["stop_sequence"] is None
    start = stream[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    # message_start counts the whole prompt; message_delta splits it as the engine served it.
    assert start["usage"]["input_tokens"] == prompt_tokens(message["usage"]) == prompt_tokens(whole["usage"])
    assert message["usage"]["output_tokens"] == 10
    assert [kind for kind, _ in stream[2:-2]] == ["content_block_start", *["content_block_delta"] * (len(stream) - 6),
                                                  "content_block_stop"]


def test_stop_sequences_and_end_of_turn(daemon: Any) -> None:
    text = create(daemon, model="tiny", messages=HELLO, temperature=0, max_tokens=24)["content"][0]["text"]
    word = text[len(text) // 2:len(text) // 2 + 3]
    assert word.strip() and text.index(word) > 0
    body = {"model": "tiny", "messages": HELLO, "temperature": 0, "max_tokens": 24, "stop_sequences": ["\x00", word]}
    stopped = create(daemon, **body)
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == word
    assert stopped["content"] == [{"type": "text", "text": text[:text.index(word)]}]
    message = assembled(events(daemon, **body))
    assert (message["stop_reason"], message["stop_sequence"], message["content"]) == (
        "stop_sequence", word, stopped["content"])


@pytest.mark.parametrize("model", ["tiny", "qwen"])
def test_tool_choice_any_and_tool_enforce_a_call(daemon: Any, model: str) -> None:
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather",
                                                                          "disable_parallel_tool_use": True}):
        body = {"model": model, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [WEATHER, LIGHTS], "tool_choice": choice, "temperature": 0, "max_tokens": 200}
        reply = create(daemon, **body)
        assert reply["stop_reason"] == "tool_use", json.dumps(reply)
        calls = [block for block in reply["content"] if block["type"] == "tool_use"]
        assert calls and calls[0]["id"].startswith("toolu_") and calls[0]["name"] in ("get_weather", "lights_off")
        if choice["type"] == "tool":
            assert calls[0]["name"] == "get_weather"
        else:
            assert len(calls) == 1
        assert calls[0]["input"] in ({"city": "Paris"}, {"city": "Oslo"}, {})
        message = assembled(events(daemon, **body))
        streamed = [block for block in message["content"] if block["type"] == "tool_use"]
        assert [(c["name"], c["input"]) for c in streamed] == [(c["name"], c["input"]) for c in calls]
        assert message["stop_reason"] == "tool_use"


@pytest.mark.parametrize("model", ["tiny", "qwen"])
def test_a_tool_round_trip_goes_through_the_template(daemon: Any, model: str) -> None:
    question = {"role": "user", "content": "Weather in Paris?"}
    reply = create(daemon, model=model, messages=[question], tools=[WEATHER],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                   temperature=0, max_tokens=200)
    call = next(block for block in reply["content"] if block["type"] == "tool_use")
    conversation = [
        question,
        {"role": "assistant", "content": reply["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "Thanks"}]},
    ]
    answer = create(daemon, model=model, messages=conversation, tools=[WEATHER], temperature=0, max_tokens=8)
    # The chat route's conversation for the same turns: the same prompt and greedy text.
    chat_conversation = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [{"id": call["id"], "type": "function", "function": {
            "name": call["name"], "arguments": json.dumps(call["input"])}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    expected = chat(daemon, model=model, messages=chat_conversation, tools=tools, temperature=0, max_tokens=8)
    assert prompt_tokens(answer["usage"]) == expected["usage"]["prompt_tokens"]
    assert count(daemon, model=model, messages=conversation, tools=[WEATHER]) == expected["usage"]["prompt_tokens"]
    assert "".join(b.get("text", "") for b in answer["content"]) == (expected["choices"][0]["message"]["content"] or "")
    # The result and the call are in the prompt (the template rendered them), not dropped.
    assert count(daemon, model=model, messages=conversation, tools=[WEATHER]) > count(
        daemon, model=model, messages=[question], tools=[WEATHER]) + 5


def test_thinking_blocks_of_a_thinking_model(daemon: Any) -> None:
    # R1's prompt opens the reasoning: cut before it closes, the reply is one thinking block.
    body = {"model": "r1", "messages": HELLO, "temperature": 0, "max_tokens": 12}
    reply = create(daemon, **body)
    expected = chat(daemon, **body)["choices"][0]["message"]
    assert expected["reasoning_content"]
    thinking = [{"type": "thinking", "thinking": expected["reasoning_content"], "signature": ""}]
    text = [{"type": "text", "text": expected["content"]}] if expected["content"] else []
    assert reply["content"] == thinking + text
    stream = events(daemon, **body)
    assert assembled(stream)["content"] == reply["content"]
    deltas = [event["delta"]["type"] for kind, event in stream if kind == "content_block_delta"]
    assert "thinking_delta" in deltas and deltas[len(thinking) and deltas.index("signature_delta") - 1] == "thinking_delta"
    # display "omitted": the blocks without their text.
    omitted = create(daemon, thinking={"type": "adaptive", "display": "omitted"}, **body)
    assert omitted["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}
    # Disabled: the template closes the reasoning in the prompt ("</think>"); no thinking block.
    off = create(daemon, thinking={"type": "disabled"}, **body)
    assert all(block["type"] != "thinking" for block in off["content"])
    assert count(daemon, model="r1", messages=HELLO, thinking={"type": "disabled"}) == count(
        daemon, model="r1", messages=HELLO) + 1
    # An earlier turn's thinking block goes back as that turn's reasoning (R1's template drops it).
    again = [*HELLO, {"role": "assistant", "content": [*reply["content"][:1], {"type": "text", "text": "Hi"}]},
             {"role": "user", "content": "More"}]
    assert count(daemon, model="r1", messages=again) == chat(
        daemon, model="r1", max_tokens=1, messages=[*HELLO, {"role": "assistant", "content": "Hi",
                                                            "reasoning_content": expected["reasoning_content"]},
                                                    {"role": "user", "content": "More"}])["usage"]["prompt_tokens"]


def test_a_thinking_budget_closes_the_reasoning(daemon: Any) -> None:
    body = {"model": "r1", "messages": HELLO, "temperature": 0, "max_tokens": 1040,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    reply = create(daemon, **body)
    expected = chat(daemon, model="r1", messages=HELLO, temperature=0, max_tokens=1040,
                    reasoning_budget_tokens=1024)["choices"][0]["message"]
    assert reply["content"][0] == {"type": "thinking", "thinking": expected["reasoning_content"], "signature": ""}
    assert "".join(b.get("text", "") for b in reply["content"][1:]) == expected["content"]
    # A model without reasoning cannot think as asked: a 400, as Anthropic's for such a model;
    # adaptive (the model decides) and disabled are its own way already.
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert post(daemon, "/v1/messages", body)[1]["error"] == {"type": "invalid_request_error", "message": (
        "thinking: model 'tiny' does not think (its chat template has no reasoning); "
        "leave thinking out, or set it to disabled or adaptive")}
    for kind in ("adaptive", "disabled"):
        plain = create(daemon, **{**body, "max_tokens": 4, "thinking": {"type": kind}})
        assert all(block["type"] != "thinking" for block in plain["content"])


def test_a_call_cut_by_max_tokens_is_not_invented(daemon: Any) -> None:
    """A forced call cut short has arguments that are no object: the whole reply leaves it out
    (stop_reason max_tokens says why), where `input: {}` would be a call the model never made;
    the stream sent its start and the arguments as far as they went."""
    body = {"model": "qwen", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 0, "max_tokens": 40}
    reply = create(daemon, **body)
    assert reply["stop_reason"] == "max_tokens" and reply["content"] == [], reply
    streamed = events(daemon, **body)
    starts = [e for e in streamed if e[0] == "content_block_start"]
    assert [s[1]["content_block"]["type"] for s in starts] == ["tool_use"]
    assert [e[0] for e in streamed][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    # Cut later, inside the arguments: the same.
    reply = create(daemon, **{**body, "max_tokens": 50})
    assert reply["stop_reason"] == "max_tokens" and reply["content"] == [], reply


def test_output_config_format_holds_the_answer_to_a_schema(daemon: Any) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    for model, tools in (("tiny", None), ("qwen", [LIGHTS])):
        body = {"model": model, "messages": HELLO, "max_tokens": 60, "temperature": 0,
                "output_config": {"format": {"type": "json_schema", "schema": schema}}}
        reply = create(daemon, **body, **({"tools": tools} if tools else {}))
        assert reply["stop_reason"] == "end_turn"
        assert set(json.loads(reply["content"][0]["text"])) == {"ok"}


def test_count_tokens_is_the_replys_input(daemon: Any) -> None:
    for body in (
        {"model": "tiny", "messages": HELLO},
        {"model": "tiny", "messages": HELLO, "system": "Be brief", "tools": [WEATHER, LIGHTS]},
        {"model": "qwen", "messages": HELLO, "tools": [WEATHER], "tool_choice": {"type": "none"}},
    ):
        tokens = count(daemon, **body)
        usage = create(daemon, max_tokens=1, **body)["usage"]
        assert tokens == prompt_tokens(usage) and usage["cache_creation_input_tokens"] == 0
    # The same prompt again is served from the cache: Anthropic's split of the same total.
    usage = create(daemon, model="tiny", messages=HELLO, max_tokens=1)["usage"]
    assert usage["cache_read_input_tokens"] > 0 and prompt_tokens(usage) == count(daemon, model="tiny", messages=HELLO)


def test_claude_codes_billing_stamp_keeps_the_prompt_cache(daemon: Any) -> None:
    def system(stamp: str) -> list[dict[str, Any]]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.1; cc_entrypoint=cli; cch={stamp};"},
                {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}]

    first = create(daemon, model="tiny", system=system("a5145"), messages=HELLO, max_tokens=1)
    second = create(daemon, model="tiny", system=system("0b7e2"), messages=HELLO, max_tokens=1)
    # The stamp changes with every request; made constant, the whole prompt comes from the cache.
    assert second["usage"]["input_tokens"] <= 1 and prompt_tokens(second["usage"]) == prompt_tokens(first["usage"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_cut_by_an_unload_is_no_end_turn(tmp_path: Path, start_daemon: Any, stream: bool) -> None:
    """A model unloaded (or swapped) past the drain timeout cancels the generations it still
    runs: the engine ends them with finish_reason "cancelled". The reply is an error (Anthropic
    has no stop_reason for it), not a message whose end_turn says the model finished."""
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 16000, "stream": stream}
    reply = cut_by_unload(tmp_path, start_daemon, "/v1/messages", body)
    if not stream:
        assert reply.status == 503, reply.body
        assert reply.json()["error"]["type"] == "overloaded_error" and "cancelled" in reply.json()["error"]["message"]
        return
    frames = [frame.split("\n") for frame in reply.body.decode().split("\n\n") if frame]
    kind, data = frames[-1]
    assert kind == "event: error" and "cancelled" in json.loads(data[len("data: "):])["error"]["message"], frames[-3:]
    assert all(k != "event: message_delta" for k, _ in frames)


def test_the_api_key_over_tcp(tmp_path: Path, start_daemon: Any) -> None:
    """With server.tcp-auth "all", Anthropic's clients send the token in X-Api-Key. A header
    whose bytes are no UTF-8 is a wrong token (401), never a 500."""
    token = tmp_path / "token"
    token.write_text("anthropic-key-0123456789\n")
    token.chmod(0o600)
    (tmp_path / "edged.toml").write_text(f'[server]\ntoken-file = "{token}"\ntcp-auth = "all"\n')
    (tmp_path / "repo").mkdir()
    daemon = start_daemon("--config", str(tmp_path / "edged.toml"), "--model-repository", str(tmp_path / "repo"), http=True)

    def status(header: bytes) -> tuple[int, bytes]:
        with socket.create_connection(("127.0.0.1", daemon.http_port), timeout=30) as conn:
            conn.sendall(b"POST /v1/messages/count_tokens HTTP/1.1\r\nHost: edged\r\n" + header + b"\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        return int(head.split()[1]), body

    assert status(b"X-Api-Key: anthropic-key-0123456789")[0] == 400  # through: the body is what is wrong
    for header in (b"X-Api-Key: wrong", b"X-Api-Key: \xff\xfe", b"Authorization: Bearer \xff"):
        got, body = status(header)
        assert got == 401 and json.loads(body)["error"]["type"] == "authentication_error", (header, got, body)


def error(daemon: Any, status: int, body: dict[str, Any], path: str = "/v1/messages", kind: str = "invalid_request_error") -> str:
    got, reply = post(daemon, path, body)
    assert got == status, reply
    assert set(reply) == {"type", "error"} and reply["type"] == "error"
    assert set(reply["error"]) == {"type", "message"} and reply["error"]["type"] == kind
    return reply["error"]["message"]


@pytest.mark.parametrize(("body", "says"), [
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "frequency_penalty": 1}, "frequency_penalty"),
    ({"model": "tiny", "messages": HELLO}, "max_tokens"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 0}, "max_tokens: must be >= 1"),
    ({"model": "tiny", "messages": [], "max_tokens": 4}, "messages: at least one"),
    ({"model": "tiny", "messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "messages[0].role"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages[0].content[0].type: 'image' images are not supported"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]}, "messages[0].content[0].type: 'tool_use'"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0]: Object missing required field `text`"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]}]},
     "messages[0].content[0].content[0].citations: not supported"),
    ({"model": "tiny", "max_tokens": 4, "messages": [*HELLO, {"role": "assistant", "content": "Sure"}]},
     "the last message must be a user message"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "temperature": 1.5}, "temperature must be between 0 and 1"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "top_p": -0.1}, "top_p must be between 0 and 1"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "top_k": -1}, "top_k must be between 0 and 2147483647, got -1"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "top_k": 2**32 + 1}, "top_k must be between 0 and 2147483647"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "stop_sequences": [""]}, "stop_sequences: an empty string"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "tool_choice": {"type": "any"}}, "tool_choice: type 'any' needs tools"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool"}},
     "tool_choice.name: required"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}},
     "tool_choice: no tool named 'x'"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type: 'web_search_20250305' is not supported"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "tools": [{"name": "f"}]}, "tools[0].input_schema: required"),
    # A tool's input is an object (Anthropic's rule): another schema's call would have an input
    # that is no object, which the reply could only drop.
    ({"model": "qwen", "messages": HELLO, "max_tokens": 4, "tools": [{"name": "f", "input_schema": {"type": "array"}}]},
     "tools[0].input_schema.type: must be 'object', got 'array'"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "tools": [WEATHER, {"name": "f", "input_schema": {}}]},
     "tools[1].input_schema.type: must be 'object', got None"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "tools": [{**WEATHER, "type": "bash_20250124"}]},
     "tools[0].type: 'bash_20250124' is not supported"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
    ({"model": "r1", "messages": HELLO, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 100}},
     "thinking.budget_tokens: must be >= 1024"),
    ({"model": "r1", "messages": HELLO, "max_tokens": 2**40, "thinking": {"type": "enabled", "budget_tokens": 2**32}},
     "thinking.budget_tokens: must be between 1024 and 2147483647"),
    ({"model": "r1", "messages": HELLO, "max_tokens": 1024, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "max_tokens: must be greater than thinking.budget_tokens"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "thinking": {"type": "disabled", "budget_tokens": 2000}},
     "thinking.budget_tokens: only with type 'enabled'"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "metadata": {"user_id": "u", "tier": 1}}, "tier"),
    ({"model": "tiny", "messages": HELLO, "max_tokens": 4, "output_config": {"effort": "high"}},
     "output_config.effort: the chat template of model 'tiny' has no reasoning levels"),
    ({"model": "tiny", "max_tokens": 4, "messages": [*HELLO, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}, *HELLO]}, "'redacted_thinking' is not supported in assistant"),
])
def test_each_rejection_names_its_field(daemon: Any, body: dict[str, Any], says: str) -> None:
    message = error(daemon, 400, body)
    assert says in message, message


def test_count_tokens_and_the_other_errors(daemon: Any) -> None:
    # count_tokens takes no generation fields; an image or a bad tool_choice is its 400 too.
    assert "max_tokens" in error(daemon, 400, {"model": "tiny", "messages": HELLO, "max_tokens": 4},
                                 "/v1/messages/count_tokens")
    assert "tool_choice" in error(daemon, 400, {"model": "tiny", "messages": HELLO, "tool_choice": {"type": "any"}},
                                  "/v1/messages/count_tokens")
    assert "Request for unknown model" in error(daemon, 404, {"model": "nope", "messages": HELLO, "max_tokens": 4},
                                                kind="not_found_error")
    reply = daemon.request("POST", "/v1/messages", b"{not json", {"Content-Type": "application/json"})
    assert reply.status == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert "malformed JSON" in reply.json()["error"]["message"]
    # Anthropic's wording for a prompt over the context, which clients match (Claude Code compacts).
    long = [{"role": "user", "content": "hello world " * 800}]
    assert error(daemon, 400, {"model": "tiny", "messages": long, "max_tokens": 4}).startswith("prompt is too long: ")
    reply = daemon.request("GET", "/v1/messages")
    assert reply.status == 405 and reply.json()["type"] == "error"
