"""gpt-oss end to end: its harmony format (reasoning on the analysis channel, the answer on the
final one, a call as a message to `functions.NAME`), with the `openai` client, the Responses
API and Ollama's API against a tiny GGUF carrying gpt-oss's real chat template (its markers
control tokens, as in its vocabulary: llama.cpp renders them as text, and `<|return|>` and
`<|call|>` end a reply, `<|end|>` does not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from gguf_builder import _vocab  # noqa: E402

from support import LIGHT_TOOL, check_light, check_responses_stream, gguf_daemon, streamed_chat  # noqa: E402

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "openai-gpt-oss-120b.jinja"
# The template writes today's date into every prompt ("Current date: ..."), so the sampled
# replies of these random weights, which the tests below need to take both branches, changed
# with the day (2026-12-07 lost the answer branch). Pinned to a day they were checked on.
TEMPLATE_TEXT = TEMPLATE.read_text().replace('strftime_now("%Y-%m-%d")', '"2026-12-06"')
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# Tokens of this test's vocabulary only, spelling whole the reasoning's opening and closing and
# a call's header up to where a lazy grammar starts: a bias on
# them makes the tiny model, whatever its random weights prefer, take that path in one step
# (a grammar allows the reasoning's closing anywhere in the reasoning).
OPEN, CLOSE = "<|channel|>analysis<|message|>", "<|end|><|start|>assistant"
CALL = "<|channel|>commentary to"
WHOLE = (OPEN, CLOSE, CALL)
TOKEN = {marker: len(_vocab()[0]) + index for index, marker in enumerate((*MARKERS, *WHOLE))}
# The closing outweighs the opening, which the reasoning may also hold.
CLOSE_REASONING = {str(TOKEN[OPEN]): 60, str(TOKEN[CLOSE]): 100}
QUESTION = [{"role": "user", "content": "Lights in the hall?"}]
ROOM = {"type": "object", "properties": {"room": {"enum": ["hall", "attic"]}}, "required": ["room"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    process = gguf_daemon(tmp_path_factory, {
        "gptoss": {"seed": 3, "n_ctx": 4096, "chat_template": TEMPLATE_TEXT,
                   "control_tokens": MARKERS, "user_tokens": WHOLE},
        "chatml": {"seed": 3, "n_ctx": 1024},
        # The same template on other weights whose greedy reply with tools and a format is a
        # call (seed 7) or an answer (seed 8): the Responses API takes no logit bias to steer it.
        **{name: {"seed": seed, "n_ctx": 4096, "chat_template": TEMPLATE_TEXT,
                  "control_tokens": MARKERS, "user_tokens": WHOLE}
           for name, seed in (("gptoss_calls", 7), ("gptoss_answers", 8))},
    })
    yield process
    process.stop()


def _post(daemon: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{daemon.http_port}{path}", json=body, timeout=120)


def test_the_model_metadata_names_its_syntax_and_tags(daemon: Any) -> None:
    engine = httpx.get(f"http://127.0.0.1:{daemon.http_port}/v2/models/gptoss", timeout=30).json()["engine"]
    assert engine["chat_template_tools"] == "gpt_oss"
    assert engine["chat_template_thinking"] == "<|channel|>analysis<|message|><|end|><|start|>assistant"


def test_a_required_call_comes_back_as_a_tool_call_whole_and_streamed(client: openai.OpenAI) -> None:
    """The grammar lets the model reason on the analysis channel first, then holds it to one
    message to functions.set_light whose text is the tool's arguments."""
    kwargs: dict[str, Any] = {"model": "gptoss", "messages": QUESTION, "tools": [LIGHT_TOOL], "tool_choice": "required",
                              "temperature": 1.0, "max_tokens": 600, "logit_bias": CLOSE_REASONING}
    for seed in range(3):
        choice = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].function.name == "set_light"
        check_light(calls[0].function.arguments)
        thought, content, stream, finish = streamed_chat(client.chat.completions.create(stream=True, seed=seed, **kwargs))
        assert (content, finish) == ("", "tool_calls")
        assert stream == [("set_light", calls[0].function.arguments)]
        assert thought == (getattr(choice.message, "reasoning_content", None) or "")


def test_auto_tools_hold_from_the_call_header_on(client: openai.OpenAI) -> None:
    """tool_choice auto: the model is free until it writes `<|channel|>commentary to`, then the
    lazy grammar holds it to a call."""
    kwargs: dict[str, Any] = {"model": "gptoss", "messages": QUESTION, "tools": [LIGHT_TOOL], "temperature": 1.0,
                              "max_tokens": 300}
    calling = {str(TOKEN[CALL]): 100}
    for seed in range(2):
        choice = client.chat.completions.create(seed=seed, logit_bias=calling, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls or []) == 1, choice
        call = (choice.message.tool_calls or [])[0]
        check_light(call.function.arguments)
        _, content, stream, finish = streamed_chat(
            client.chat.completions.create(stream=True, seed=seed, logit_bias=calling, **kwargs))
        assert (content, stream, finish) == ("", [(call.function.name, call.function.arguments)], "tool_calls")


def test_a_json_answer_comes_on_the_final_channel(client: openai.OpenAI, daemon: Any) -> None:
    """response_format: the grammar lets the model reason first, then writes the final
    channel's header and the JSON; the answer is that JSON, without the header, whole and
    streamed. With reasoning_format none the analysis message stays in the content, as
    llama-server shows it (the final channel's header does not)."""
    room = {"type": "json_schema", "json_schema": {"name": "room", "schema": ROOM, "strict": True}}
    kwargs: dict[str, Any] = {"model": "gptoss", "messages": QUESTION, "temperature": 1.0, "max_tokens": 400,
                              "response_format": room, "logit_bias": CLOSE_REASONING}
    for seed in range(2):
        choice = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        message = choice.message
        assert choice.finish_reason == "stop" and json.loads(message.content or "")["room"] in ("hall", "attic"), choice
        thought, content, calls, finish = streamed_chat(client.chat.completions.create(stream=True, seed=seed, **kwargs))
        assert (thought, content, calls, finish) == (getattr(message, "reasoning_content", None) or "",
                                                     message.content, [], "stop")
        raw = client.chat.completions.create(seed=seed, extra_body={"reasoning_format": "none"}, **kwargs)
        shown = raw.choices[0].message.content or ""
        assert shown == f"{OPEN}{thought}<|end|>{message.content}", shown


def test_the_routes_read_the_channels_alike(client: openai.OpenAI, daemon: Any) -> None:
    """Greedy, the same reply read by chat, Responses and Ollama's chat: the same reasoning and
    answer (Responses' reasoning item and output text, Ollama's thinking and content)."""
    for schema in (None, ROOM):
        extra: dict[str, Any] = {}
        if schema is not None:
            extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "room", "schema": schema}}}
        message = client.chat.completions.create(
            model="gptoss", messages=QUESTION, temperature=0, max_tokens=48, **extra).choices[0].message
        thought, content = getattr(message, "reasoning_content", None) or "", message.content or ""
        body: dict[str, Any] = {"model": "gptoss", "input": QUESTION, "temperature": 0, "max_output_tokens": 48}
        if schema is not None:
            body["text"] = {"format": {"type": "json_schema", "name": "room", "schema": schema}}
        response = _post(daemon, "/v1/responses", body)
        assert response.status_code == 200, response.text
        items = response.json()["output"]
        reasoning = "".join(part["text"] for item in items if item["type"] == "reasoning" for part in item["content"])
        text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
        assert (reasoning, text) == (thought, content)
        ollama = _post(daemon, "/api/chat", {
            "model": "gptoss", "messages": QUESTION, "stream": False, "format": schema,
            "options": {"temperature": 0, "num_predict": 48, "repeat_penalty": 1.0}})
        assert ollama.status_code == 200, ollama.text
        reply = ollama.json()["message"]
        assert (reply.get("thinking", ""), reply["content"]) == (thought, content)
        hidden = _post(daemon, "/api/chat", {
            "model": "gptoss", "messages": QUESTION, "stream": False, "format": schema, "think": False,
            "options": {"temperature": 0, "num_predict": 48, "repeat_penalty": 1.0}}).json()["message"]
        # think false: gpt-oss reasons anyway (its template cannot turn it off); the reasoning
        # is left out, the answer still read off the channels.
        assert "thinking" not in hidden and hidden["content"] == content


def test_reasoning_effort_reaches_the_template(client: openai.OpenAI, daemon: Any) -> None:
    """OpenAI's reasoning_effort (and the Responses API's reasoning.effort, Ollama's think
    levels) is the template's `reasoning_effort`, as llama-server passes it: the system
    message says "Reasoning: low" or "high". A template that does not read it takes none."""
    def prompt_tokens(**extra: Any) -> int:
        response = client.chat.completions.create(model="gptoss", messages=QUESTION, max_tokens=1, **extra)
        assert response.usage is not None
        return response.usage.prompt_tokens

    low, high = prompt_tokens(reasoning_effort="low"), prompt_tokens(reasoning_effort="high")
    assert low != high and prompt_tokens() == prompt_tokens(reasoning_effort="medium")
    assert high == prompt_tokens(extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    responses = _post(daemon, "/v1/responses", {"model": "gptoss", "input": QUESTION, "max_output_tokens": 1,
                                                "reasoning": {"effort": "high"}})
    assert responses.status_code == 200 and responses.json()["usage"]["input_tokens"] == high, responses.text
    ollama = _post(daemon, "/api/chat", {"model": "gptoss", "messages": QUESTION, "stream": False, "think": "high",
                                         "options": {"num_predict": 1}})
    assert ollama.status_code == 200 and ollama.json()["prompt_eval_count"] == high, ollama.text
    for bad, field in (({"reasoning_effort": "max"}, "reasoning_effort"),
                       ({"model": "chatml", "reasoning_effort": "low"}, "reasoning_effort")):
        body = {"model": "gptoss", "messages": QUESTION, "max_tokens": 1, **bad}
        response = _post(daemon, "/v1/chat/completions", body)
        assert response.status_code == 400 and field in response.json()["error"]["message"], response.text
    response = _post(daemon, "/v1/responses", {"model": "chatml", "input": QUESTION, "reasoning": {"effort": "low"}})
    assert response.status_code == 400 and "reasoning.effort" in response.text, response.text


def test_the_tool_loop_goes_back_through_the_template(client: openai.OpenAI, daemon: Any) -> None:
    """A call with its reasoning goes back as the template writes it (the reasoning as the
    assistant's `thinking`, llama-server's renaming); the template takes one call per message."""
    kwargs: dict[str, Any] = {"model": "gptoss", "tools": [LIGHT_TOOL], "tool_choice": "required",
                              "temperature": 1.0, "seed": 1, "max_tokens": 600, "logit_bias": CLOSE_REASONING}
    reply = client.chat.completions.create(messages=QUESTION, **kwargs).choices[0].message
    assert reply.tool_calls and len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": "done"}
    thought = getattr(reply, "reasoning_content", None) or ""
    with_thought = client.chat.completions.create(
        model="gptoss", messages=[*QUESTION, reply, result], tools=[LIGHT_TOOL], max_tokens=1)
    bare = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    without = client.chat.completions.create(
        model="gptoss", messages=[*QUESTION, bare, result], tools=[LIGHT_TOOL], max_tokens=1)
    assert with_thought.usage is not None and without.usage is not None
    if thought:  # "<|start|>assistant<|channel|>analysis<|message|>" + thought + "<|end|>"
        assert with_thought.usage.prompt_tokens > without.usage.prompt_tokens
    two = {**bare, "tool_calls": [call.model_dump(), {**call.model_dump(), "id": "call_2"}]}
    response = _post(daemon, "/v1/chat/completions", {
        "model": "gptoss", "messages": [*QUESTION, two, result, {**result, "tool_call_id": "call_2"}],
        "tools": [LIGHT_TOOL], "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert "messages[1].tool_calls" in response.json()["error"]["message"]


# Tools with a response format (tool_choice auto): the grammar is the call's frame or the final
# channel's header and a JSON value matching the format, after the reasoning the model may write.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "warm": {"type": "boolean"}},
           "required": ["city", "warm"], "additionalProperties": False}
WEATHER_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
# A mild push towards closing the reasoning and towards a call: the seeds below reason first,
# then some call and some answer.
REASON_THEN_EITHER = {str(TOKEN[CLOSE]): 20, str(TOKEN[CALL]): 8}


def _branch(choice: Any) -> str:
    """"calls" (valid set_light calls) or "answer" (content valid against WEATHER)."""
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
        assert [call.function.name for call in choice.message.tool_calls] == ["set_light"]
        check_light(choice.message.tool_calls[0].function.arguments)
        return "calls"
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), WEATHER)
    return "answer"


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def test_auto_tools_with_a_format_call_or_answer_after_reasoning(client: openai.OpenAI, daemon: Any) -> None:
    """Each reply is a valid call or content valid against the format, both happen, each after
    reasoning that comes back as reasoning_content; streamed the same. With reasoning_format
    none the reasoning stays in the content as without tools, and a call is still a call."""
    kwargs: dict[str, Any] = {"model": "gptoss", "messages": QUESTION, "tools": [LIGHT_TOOL],
                              "response_format": WEATHER_FORMAT, "temperature": 1.0, "max_tokens": 300,
                              "logit_bias": REASON_THEN_EITHER}
    reasoned = set()
    for seed in range(6):
        choice = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        branch = _branch(choice)
        thought = getattr(choice.message, "reasoning_content", None) or ""
        if thought:
            reasoned.add(branch)
        streamed = streamed_chat(client.chat.completions.create(stream=True, seed=seed, **kwargs))
        assert streamed == (thought, choice.message.content or "", _calls(choice.message), choice.finish_reason)
        raw = client.chat.completions.create(seed=seed, extra_body={"reasoning_format": "none"}, **kwargs).choices[0]
        shown = f"{OPEN}{thought}<|end|>" if thought else ""
        assert (raw.message.content or "", _calls(raw.message), raw.finish_reason) \
            == (shown + (choice.message.content or ""), _calls(choice.message), choice.finish_reason), raw
        raw_streamed = streamed_chat(client.chat.completions.create(
            stream=True, seed=seed, extra_body={"reasoning_format": "none"}, **kwargs))
        assert raw_streamed == ("", raw.message.content or "", _calls(raw.message), raw.finish_reason)
    assert reasoned == {"calls", "answer"}
    # A grammar that rejected a token the model was allowed would have aborted the daemon.
    assert httpx.get(f"http://127.0.0.1:{daemon.http_port}/v2/health/ready", timeout=30).status_code == 200


def test_auto_tools_with_a_format_greedy_streams_as_unstreamed(client: openai.OpenAI) -> None:
    branches = set()
    for bias in ({str(TOKEN[CALL]): 14}, {str(TOKEN[CLOSE]): 20}):
        kwargs: dict[str, Any] = {"model": "gptoss", "messages": QUESTION, "tools": [LIGHT_TOOL], "temperature": 0,
                                  "response_format": WEATHER_FORMAT, "max_tokens": 300, "logit_bias": bias}
        choice = client.chat.completions.create(**kwargs).choices[0]
        branches.add(_branch(choice))
        streamed = streamed_chat(client.chat.completions.create(stream=True, **kwargs))
        assert streamed == (getattr(choice.message, "reasoning_content", None) or "", choice.message.content or "",
                            _calls(choice.message), choice.finish_reason)
    assert branches == {"calls", "answer"}


def test_responses_api_tools_with_a_format(client: openai.OpenAI) -> None:
    """text.format with tools: the greedy reply of one model is a call, of the other an answer in
    the format (without the final channel's header); streamed the same."""
    text = {"format": {"type": "json_schema", "name": "weather", "strict": True, "schema": WEATHER}}
    seen = []
    for model in ("gptoss_calls", "gptoss_answers"):
        kwargs: dict[str, Any] = {"model": model, "input": "Lights in the hall?", "text": text, "temperature": 0,
                                  "tools": [{"type": "function", **LIGHT_TOOL["function"]}],
                                  "parallel_tool_calls": False, "max_output_tokens": 300}
        whole = client.responses.create(**kwargs)
        assert whole.status == "completed", whole
        items = [item for item in whole.output if item.type != "reasoning"]
        assert len(items) == 1, whole.output
        if items[0].type == "function_call":
            check_light(items[0].arguments)
        else:
            jsonschema.validate(json.loads(whole.output_text), WEATHER)
        seen.append(items[0].type)
        check_responses_stream(client, kwargs, whole)
    assert seen == ["function_call", "message"]
