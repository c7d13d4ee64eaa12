"""OpenAI's Responses API with the real `openai` client against a tiny GGUF model on
llama.cpp: the same text, tool calls and prompt as `/v1/chat/completions` for the same
conversation, the client's own stream accumulator and structured-output parser, and a 400
naming each field or item the route does not implement."""

from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from gguf_builder import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    repo = tmp_path_factory.mktemp("llm-repo")
    (repo / "tiny" / "1").mkdir(parents=True)
    write_tiny_llama(repo / "tiny" / "1" / "model.gguf", seed=1, n_ctx=1024)
    (repo / "tiny" / "config.pbtxt").write_text(
        'backend: "llamacpp"\n'
        'parameters { key: "n_parallel" value { string_value: "4" } }\n'
        'parameters { key: "n_ctx" value { string_value: "4096" } }\n'
    )
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
        "required": ["city", "celsius"],
        "additionalProperties": False,
    },
}
LIGHTS = {"type": "function", "name": "lights_off"}
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in (WEATHER, LIGHTS)
]


def test_text_is_what_chat_completions_gives(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello there"}],
    )
    short = client.responses.create(
        model="tiny", instructions="Be brief", input="Hello there", max_output_tokens=12, temperature=0,
        metadata={"ticket": "7"},
    )
    items = client.responses.create(
        model="tiny", max_output_tokens=12, temperature=0,
        input=[{"role": "developer", "content": "Be brief"},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
    )
    expected = chat.choices[0].message.content
    assert expected and short.output_text == expected and items.output_text == expected
    assert short.id.startswith("resp_") and short.object == "response" and short.model == "tiny"
    # 12 tokens and no end: cut by the output limit, as OpenAI reports it.
    assert short.status == "incomplete" and short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.metadata == {"ticket": "7"} and short.instructions == "Be brief" and short.store is False
    [message] = short.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert short.usage is not None and chat.usage is not None
    assert short.usage.input_tokens == chat.usage.prompt_tokens and short.usage.output_tokens == 12
    assert short.usage.total_tokens == short.usage.input_tokens + 12


def test_stream_events_build_the_same_response(client: openai.OpenAI, daemon) -> None:
    kwargs = {"model": "tiny", "input": "Tell me more", "max_output_tokens": 16, "temperature": 0}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == 16
    # On the wire: OpenAI's `event:` lines naming each event, and no `[DONE]`.
    body = json.dumps({**kwargs, "stream": True, "max_output_tokens": 3}).encode()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(daemon.socket))
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    assert b"text/event-stream" in raw and b"[DONE]" not in raw
    assert b"event: response.created\ndata: {\"type\":\"response.created\"" in raw
    assert raw.count(b"event: response.output_text.delta\n") == 3


def test_structured_output_with_the_clients_parser(client: openai.OpenAI) -> None:
    from typing import Literal

    class Answer(pydantic.BaseModel):
        ok: bool
        mood: Literal["happy", "sad"]  # a free string never ends on a random model

    for seed_text in ("JSON one", "JSON two"):
        parsed = client.responses.parse(model="tiny", input=seed_text, text_format=Answer, temperature=0,
                                        max_output_tokens=200)
        assert parsed.status == "completed" and isinstance(parsed.output_parsed, Answer)
        assert set(json.loads(parsed.output_text)) == {"ok", "mood"}
    # The client's stream helper accumulates the events into the same parsed response.
    with client.responses.stream(model="tiny", input="JSON one", text_format=Answer, temperature=0,
                                 max_output_tokens=200) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == client.responses.parse(
        model="tiny", input="JSON one", text_format=Answer, temperature=0, max_output_tokens=200
    ).output_parsed
    whole = client.responses.create(model="tiny", input="Any JSON", text={"format": {"type": "json_object"}},
                                    temperature=0, max_output_tokens=40)
    assert whole.text is not None and whole.text.format.type == "json_object"
    if whole.status == "completed":
        assert isinstance(json.loads(whole.output_text), dict)
    with pytest.raises(openai.BadRequestError, match=r"properties\.n: keyword 'minimum' is not supported"):
        client.responses.create(model="tiny", input="x", text={"format": {
            "type": "json_schema", "name": "a",
            "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}}})


def test_function_calls_required_named_and_streamed(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        result = client.responses.create(
            model="tiny", input="Weather in Paris?", tools=[WEATHER, LIGHTS], tool_choice="required",
            parallel_tool_calls=False, temperature=temperature, max_output_tokens=400,
        )
        [call] = result.output
        assert call.type == "function_call" and call.status == "completed" and result.status == "completed"
        assert call.call_id.startswith("call_") and call.id == "fc_" + call.call_id.removeprefix("call_")
        assert call.name in ("get_weather", "lights_off")
        arguments = json.loads(call.arguments)
        if call.name == "get_weather":
            assert arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["celsius"], bool)
        else:
            assert arguments == {}
        assert result.output_text == ""
    kwargs = {"model": "tiny", "input": "Weather?", "tools": [WEATHER], "temperature": 0,
              "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 400,
              "parallel_tool_calls": False}
    whole = client.responses.create(**kwargs)
    assert [item.name for item in whole.output] == ["get_weather"]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=CHAT_TOOLS[:1], temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=400,
        parallel_tool_calls=False,
    )
    # The same grammar-enforced reply as the chat route: the same calls, argument for argument.
    assert [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls or []] \
        == [(item.name, json.loads(item.arguments)) for item in whole.output]
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert len(pieces) > 3  # the arguments stream as they are generated, not in one piece
    assert "".join(pieces) == done.arguments == final.output[0].arguments
    assert json.loads(done.arguments) == json.loads(whole.output[0].arguments)


def test_function_results_go_back_as_in_chat(client: openai.OpenAI) -> None:
    arguments = '{"city": "Paris", "celsius": true}'
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees and sunny"},
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    result = client.responses.create(model="tiny", input=items, tools=[WEATHER], max_output_tokens=1)
    chat = client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS[:1], max_tokens=1)
    # The same prompt, token for token, as the chat route builds from the same conversation.
    assert result.usage is not None and chat.usage is not None
    assert result.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match=r"input\[1\]\.arguments: not valid JSON"):
        client.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=1,
                                input=[items[0], {**items[1], "arguments": "{nope"}])


def test_logprobs_included_on_request(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "input": "Probabilities", "max_output_tokens": 8, "temperature": 0}
    result = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kwargs)
    part = result.output[0].content[0]
    assert part.logprobs is not None and len(part.logprobs) == 8
    assert "".join(entry.token for entry in part.logprobs) == part.text
    for entry in part.logprobs:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert bytes(entry.bytes).decode() == entry.token
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Probabilities"}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None
    assert [e.logprob for e in part.logprobs] == pytest.approx([e.logprob for e in content], abs=1e-3)
    streamed = [
        entry for event in client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2,
                                                   stream=True, **kwargs)
        if event.type == "response.output_text.delta" for entry in event.logprobs
    ]
    assert [e.token for e in streamed] == [e.token for e in part.logprobs]
    assert client.responses.create(**kwargs).output[0].content[0].logprobs == []


def test_obfuscation_pads_delta_events_when_asked(daemon) -> None:
    body = {"model": "tiny", "input": "Pad", "max_output_tokens": 4, "temperature": 0, "stream": True}
    for asked in (True, False):
        text = daemon.post_json("/v1/responses", {**body, "stream_options": {"include_obfuscation": asked}}).body
        deltas = [json.loads(line[6:]) for line in text.decode().splitlines()
                  if line.startswith("data: ") and '"response.output_text.delta"' in line]
        assert len(deltas) == 4 and all(("obfuscation" in d) is asked for d in deltas)


def test_client_disconnect_cancels_the_generation(daemon) -> None:
    from support import wait_until

    def engine() -> dict[str, int]:
        return daemon.request("GET", "/v2/models/tiny").json()["engine"]

    before = engine()["tokens_generated"]
    body = json.dumps({"model": "tiny", "input": "Go on", "max_output_tokens": 300, "stream": True}).encode()
    for _ in range(6):  # more abandoned streams than slots
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(daemon.socket))
            s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert b"200" in s.recv(64)
    wait_until(lambda: engine()["busy"] == 0 and engine()["queued"] == 0, timeout=60)
    # Run to their ends, the six would have generated 1800 tokens.
    assert engine()["tokens_generated"] - before < 900


@pytest.mark.parametrize(("extra", "pattern"), [
    ({"store": True}, "store: responses are not stored here"),
    ({"previous_response_id": "resp_1"}, "previous_response_id: responses are not stored here"),
    ({"conversation": "conv_1"}, "conversation: responses are not stored here"),
    ({"background": True}, "background: not supported"),
    ({"truncation": "auto"}, "truncation: only 'disabled' is supported"),
    ({"reasoning": {"effort": "low"}}, r"reasoning\.effort: the chat template of model .tiny. has no reasoning levels"),
    ({"include": ["reasoning.encrypted_content"]}, "include: 'reasoning.encrypted_content' is not supported"),
    ({"top_logprobs": 2}, r"top_logprobs: requires include \['message.output_text.logprobs'\]"),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs must be between 0 and 20"),
    ({"tools": [{"type": "web_search"}]}, r"tools\[0\]\.type: 'web_search' is not supported"),
    ({"tool_choice": "auto"}, "tool_choice: only allowed when tools are specified"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "no tool named 'nope'"),
    ({"tools": [WEATHER], "text": {"format": {"type": "json_schema", "name": "n", "schema": {
        "type": "integer", "maximum": 3}}}}, "keyword 'maximum' is not supported"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, r"text\.format\.name: required"),
    ({"text": {"format": {"type": "text", "name": "x"}}}, "text.format: name, schema"),
    ({"max_output_tokens": 0}, "max_output_tokens must be >= 1"),
    ({"temperature": 3}, "temperature must be between 0 and 2"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options: only allowed when stream is true"),
    ({"service_tier": "auto"}, "unknown field `service_tier`"),
    ({"input": ""}, "input: required"),
    ({"input": []}, "input: at least one item is required"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, r"input\[0\]\.type: 'item_reference' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, r"input\[0\]: .*input_image"),
    ({"input": [{"role": "tool", "content": "x"}]}, r"input\[0\]: .*role"),
])
def test_what_is_not_implemented_is_a_400_naming_it(client: openai.OpenAI, extra: dict, pattern: str) -> None:
    body = {"input": "x", "max_output_tokens": 1, **extra}
    with pytest.raises(openai.BadRequestError, match=pattern):
        client.responses.create(model="tiny", extra_body=body)


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")



def test_input_tokens_count_the_prompt_each_route_generates_from(client: openai.OpenAI, daemon) -> None:
    """OpenAI's POST /v1/responses/input_tokens (the client's `responses.input_tokens.count`) and
    llama-server's /v1/chat/completions/input_tokens: the tokens of the prompt the route would
    generate from, as its usage counts them (tools and a format shape that prompt too)."""
    cases = [
        {"instructions": "Be brief", "input": "Hello there"},
        {"input": "Weather in Paris?", "tools": [WEATHER, LIGHTS], "tool_choice": "required"},
        {"input": "Weather?", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}},
    ]
    counts = []
    for case in cases:
        counted = client.responses.input_tokens.count(model="tiny", **case)
        assert counted.object == "response.input_tokens"
        usage = client.responses.create(model="tiny", max_output_tokens=1, temperature=0, **case).usage
        assert usage is not None and counted.input_tokens == usage.input_tokens
        counts.append(counted.input_tokens)
    assert len(set(counts)) == len(counts)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": CHAT_TOOLS,
            "response_format": {"type": "json_object"}}
    usage = client.chat.completions.create(**chat, max_tokens=1, temperature=0).usage
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        reply = daemon.post_json(path, chat)
        assert reply.status == 200, reply.body
        assert json.loads(reply.body) == {"object": "response.input_tokens", "input_tokens": usage.prompt_tokens}
    # What the chat route refuses, its count refuses alike (it answered 200 to each of these).
    for extra, text in [
        ({"top_p": 2.0}, b"top_p must be between 0 and 1"),
        ({"store": True}, b"store: chat completions are not stored here"),
        ({"top_logprobs": 2}, b"top_logprobs: requires logprobs to be true"),
        ({"logprobs": True}, b"logprobs: not supported together with tools"),
    ]:
        for path in ("/v1/chat/completions", "/v1/chat/completions/input_tokens"):
            refused = daemon.post_json(path, {**chat, **extra, "max_tokens": 1})
            assert refused.status == 400 and text in refused.body, (path, extra, refused.body)
    assert daemon.post_json("/v1/responses/input_tokens", {"model": "tiny", "input": "x", "store": True}).status == 400


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_cut_by_an_unload_is_not_completed(tmp_path, start_daemon, stream: bool) -> None:
    """A model unloaded past the drain timeout cancels what it still generates (finish_reason
    "cancelled"): the response is an error, a 503 or the stream's response.failed, never a
    "completed" response that says the model finished."""
    from support import cut_by_unload

    body = {"model": "tiny", "input": "hello", "max_output_tokens": 16000, "stream": stream}
    reply = cut_by_unload(tmp_path, start_daemon, "/v1/responses", body)
    if not stream:
        assert reply.status == 503, reply.body
        assert "cancelled" in reply.json()["error"]["message"]
        return
    assert reply.status == 200
    frames = [frame.split("\n") for frame in reply.body.decode().split("\n\n") if frame]
    kind, data = frames[-1]
    assert kind == "event: response.failed", frames[-3:]
    failed = json.loads(data[len("data: "):])["response"]
    assert failed["status"] == "failed" and "cancelled" in failed["error"]["message"]
    assert all(k != "event: response.completed" for k, _ in frames)
