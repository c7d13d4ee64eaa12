"""Tools together with a response format (openai_tools.ToolUse.constrain), end to end over a
real socket on tiny GGUF models: the generic JSON reply (a template without a tool syntax),
Hermes / Qwen 2.5 `<tool_call>` and Mistral Nemo `[TOOL_CALLS][` frames, and Qwen 3 (a
thinking template: it may reason first). With tool_choice "auto" every reply is either valid
tool calls or content that validates against the format's schema, and both happen; the
grammar is one union of the two, so a wrong one aborts llama.cpp and the daemon with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from support import LIGHT_TOOL, check_light, check_responses_stream, gguf_daemon, streamed_chat  # noqa: E402

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
THINKING = ("<think>", "</think>", "<tool_call>", "</tool_call>")
MODELS: dict[str, dict[str, Any]] = {
    "generic": {"n_ctx": 2048},  # the builder's ChatML template: no tool syntax
    "qwen": {"n_ctx": 2048, "seed": 3, "chat_template": (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()},
    "mistral": {"n_ctx": 2048, "seed": 3,
                "chat_template": (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()},
    "qwen3": {"n_ctx": 2048, "chat_template": (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(),
              "user_tokens": THINKING},
    # The same template on other weights: greedy, it begins a call (the Responses API takes no
    # logit bias to steer it there).
    "qwen_calls": {"n_ctx": 2048, "seed": 2,
                   "chat_template": (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()},
    "llama31": {"n_ctx": 2048, "chat_template": (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()},
}


def _char(c: str) -> str:
    """The tiny vocabulary's token id of a printable character (gguf_builder)."""
    return str(259 + ord(c) - 0x20)


# Qwen 3's user tokens come after the tiny vocabulary's 379.
THINK_END, TOOL_CALL = "380", "381"
# Per model, the logit biases that steer the tiny model's first choice to the calls or to the
# answer (the grammar decides what either may be); Qwen 3 also closes its reasoning soon.
TO_CALLS = {"generic": {_char("t"): 15}, "qwen": {_char("<"): 15}, "mistral": {_char("["): 15},
            "qwen3": {THINK_END: 30, TOOL_CALL: 15}}
TO_ANSWER = {"generic": {}, "qwen": {}, "mistral": {}, "qwen3": {THINK_END: 30, _char("{"): 15}}
# The answer's schema, with a local reference (the generic reply nests it in its own schema).
ANSWER = {
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/city"}, "warm": {"type": "boolean"}},
    "required": ["city", "warm"], "additionalProperties": False,
    "$defs": {"city": {"enum": ["Paris", "Oslo"]}},
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "strict": True, "schema": ANSWER}}
QUESTION = [{"role": "user", "content": "Lights in the hall?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    process = gguf_daemon(tmp_path_factory, MODELS)
    yield process
    process.stop()


def _request(model: str, seed: int, **more: Any) -> dict[str, Any]:
    bias = (TO_CALLS if seed % 2 else TO_ANSWER).get(model, {})
    return {"model": model, "messages": QUESTION, "tools": [LIGHT_TOOL], "response_format": FORMAT,
            "parallel_tool_calls": False, "temperature": 1.0, "seed": seed, "max_tokens": 300,
            "logit_bias": bias, **more}


def _calls(calls: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    """Calls with their arguments decoded (the generic reply's stream sends the arguments as
    written, its whole reply as re-encoded)."""
    return [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize("model", ["generic", "qwen", "mistral", "qwen3"])
def test_auto_replies_are_calls_or_an_answer_in_the_format(client: openai.OpenAI, model: str) -> None:
    branches = set()
    for seed in range(6):
        kwargs = _request(model, seed)
        choice = client.chat.completions.create(**kwargs).choices[0]
        reasoning, content, calls, finish = streamed_chat(client.chat.completions.create(stream=True, **kwargs))
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
            assert all(check_light(call.function.arguments) for call in choice.message.tool_calls)
            branches.add("calls")
        else:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content or ""), ANSWER)
            branches.add("answer")
        # Streamed (the same seed), the same reply: content deltas or call deltas.
        assert (content or None, finish) == (choice.message.content, choice.finish_reason)
        assert _calls(calls) == _calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []])
        assert reasoning == (getattr(choice.message, "reasoning_content", None) or "")
        if model == "qwen3":
            # The reasoning left in the content (reasoning_format none), a call after it is still a call.
            raw = client.chat.completions.create(extra_body={"reasoning_format": "none"}, **kwargs).choices[0]
            assert (_calls([(c.function.name, c.function.arguments) for c in raw.message.tool_calls or []]),
                    raw.finish_reason) == (_calls(calls), choice.finish_reason), raw
    assert branches == {"calls", "answer"}


@pytest.mark.parametrize("model", ["generic", "qwen", "qwen3"])
def test_greedy_streams_as_unstreamed(client: openai.OpenAI, model: str) -> None:
    for bias in (TO_CALLS[model], TO_ANSWER[model]):
        kwargs = {**_request(model, 0), "temperature": 0, "logit_bias": bias}
        choice = client.chat.completions.create(**kwargs).choices[0]
        _, content, calls, finish = streamed_chat(client.chat.completions.create(stream=True, **kwargs))
        assert (content or None, finish) == (choice.message.content, choice.finish_reason)
        assert _calls(calls) == _calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []])


@pytest.mark.parametrize("model", ["generic", "qwen", "mistral", "qwen3"])
def test_required_calls_and_none_answers(client: openai.OpenAI, model: str) -> None:
    # A forced call has no content: the format has nothing to apply to (as at OpenAI).
    for seed in range(2):
        kwargs = {**_request(model, seed), "tool_choice": "required", "logit_bias": TO_ANSWER[model]}
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        assert all(check_light(call.function.arguments) for call in choice.message.tool_calls)
    # No calls: the answer in the format, even steered towards a call.
    for seed in range(2):
        kwargs = {**_request(model, seed), "tool_choice": "none", "logit_bias": TO_CALLS[model]}
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice
        jsonschema.validate(json.loads(choice.message.content or ""), ANSWER)


@pytest.mark.parametrize("model", ["generic", "qwen"])
def test_schemas_that_hold_to_nothing_are_taken(client: openai.OpenAI, model: str) -> None:
    # A tool with `"parameters": {}` (was a 400: the converter knew no schema of an `$id` alone)
    # and a property whose schema is `true` (was a 500, an AttributeError) in a tool and in the
    # format: any object as the arguments, any value as the property.
    free = {"type": "object", "properties": {"any": True}, "required": ["any"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {}}},
             {"type": "function", "function": {"name": "put", "parameters": free}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "free", "schema": free}}
    # Two seeds, one of each bias, whose free values end within max_tokens (seed 1's string in
    # "any" runs on past it for the qwen model).
    for seed in (2, 3):
        kwargs = {**_request(model, seed), "tools": tools, "tool_choice": "required", "response_format": fmt}
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert isinstance(arguments, dict) and (call.function.name == "ping" or set(arguments) == {"any"})
        choice = client.chat.completions.create(**{**kwargs, "tool_choice": "none"}).choices[0]
        assert set(json.loads(choice.message.content or "")) == {"any"}, choice


def test_bare_json_calls_cannot_take_a_format(client: openai.OpenAI) -> None:
    # Llama 3.1 writes a call as a bare JSON object: an answer could not be told from it.
    with pytest.raises(openai.BadRequestError, match="response_format: cannot be combined with tools for this model"):
        client.chat.completions.create(**_request("llama31", 0))
    # Its forced calls take the request as before (the format has nothing to apply to).
    choice = client.chat.completions.create(**{**_request("llama31", 0), "tool_choice": "required"}).choices[0]
    assert choice.finish_reason == "tool_calls"


def test_responses_api_calls_or_answers(client: openai.OpenAI) -> None:
    # The Responses API takes no seed nor logit bias: the models' own greedy choices, an
    # answer (the generic reply, Qwen 2.5) or a call (Qwen 2.5's template on other weights).
    text = {"format": {"type": "json_schema", "name": "weather", "strict": True, "schema": ANSWER}}
    seen = set()
    for model in ("generic", "qwen", "qwen_calls"):
        kwargs: dict[str, Any] = {"model": model, "input": "Lights in the hall?", "text": text, "temperature": 0,
                                  "tools": [{"type": "function", **LIGHT_TOOL["function"]}],
                                  "parallel_tool_calls": False, "max_output_tokens": 300}
        whole = client.responses.create(**kwargs)
        assert whole.status == "completed"
        [item] = whole.output
        if item.type == "function_call":
            check_light(item.arguments)
        else:
            jsonschema.validate(json.loads(whole.output_text), ANSWER)
        seen.add(item.type)
        check_responses_stream(client, kwargs, whole)
    assert seen == {"function_call", "message"}


def test_ollama_chat_calls_or_answers(daemon: Any) -> None:
    # Ollama's options have no logit bias: the models' own first choices, the generic reply's
    # an answer and Qwen 3's (not thinking) a call.
    seen = set()
    for model in ("generic", "qwen3"):
        for seed in range(3):
            body = {"model": model, "messages": QUESTION, "tools": [LIGHT_TOOL], "format": ANSWER, "stream": False,
                    "think": False, "options": {"seed": seed, "temperature": 1.0, "num_predict": 300}}
            reply = httpx.post(f"http://127.0.0.1:{daemon.http_port}/api/chat", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            message = reply.json()["message"]
            if message.get("tool_calls"):
                assert message["content"] == ""
                check_light(json.dumps(message["tool_calls"][0]["function"]["arguments"]))
                seen.add("calls")
            else:
                jsonschema.validate(json.loads(message["content"]), ANSWER)
                seen.add("answer")
    assert seen == {"calls", "answer"}
