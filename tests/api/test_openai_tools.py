"""The generic tool-call format: schema per tool_choice, reply parsing, incremental deltas."""

from __future__ import annotations

import json

import msgspec
import pytest

from daemon.api import openai_tools
from daemon.backend import GenerateParams
from daemon.errors import InvalidArgument

TOOLS = msgspec.convert(
    [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "lights_off"}},
    ],
    list[openai_tools.Tool],
)


def test_schema_follows_tool_choice() -> None:
    auto = json.loads(openai_tools.tool_schema(TOOLS, "auto", parallel=True))
    assert [set(branch["properties"]) for branch in auto["anyOf"]] == [{"tool_calls"}, {"response"}]
    required = json.loads(openai_tools.tool_schema(TOOLS, "required", parallel=False))
    calls = required["properties"]["tool_calls"]
    assert calls["minItems"] == 1 and calls["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in calls["items"]["anyOf"]] == ["get_weather", "lights_off"]
    # A function without parameters takes exactly {}.
    assert calls["items"]["anyOf"][1]["properties"]["arguments"]["additionalProperties"] is False
    named = msgspec.convert({"type": "function", "function": {"name": "lights_off"}}, openai_tools.NamedToolChoice)
    only = json.loads(openai_tools.tool_schema(TOOLS, named, parallel=True))
    assert [c["properties"]["name"]["const"] for c in only["properties"]["tool_calls"]["items"]["anyOf"]] == ["lights_off"]
    with pytest.raises(InvalidArgument, match="tools: function names must be unique"):
        openai_tools.tool_schema([TOOLS[0], TOOLS[0]], "auto", parallel=True)


def test_parse_reply() -> None:
    content, calls = openai_tools.parse_reply('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert openai_tools.parse_reply('{"response": "hi"}') == ("hi", [])
    assert openai_tools.parse_reply('{"tool_calls": [{"na') == ('{"tool_calls": [{"na', [])


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_stream_deltas_rebuild_the_reply(step: int) -> None:
    arguments = [{"city": 'Pa"ris \\ \u00e9 \U0001F600', "n": [1, {"x": 2.5}], "b": True}, {}]
    reply = json.dumps({"tool_calls": [
        {"name": "get_weather", "arguments": arguments[0]}, {"name": "lights_off", "arguments": arguments[1]},
    ]}, indent=1)
    stream = openai_tools.ToolStream()
    deltas = [d for k in range(0, len(reply), step) for d in stream.feed(reply[k : k + step])]
    heads = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "get_weather"), (1, "lights_off")]
    assert len({h["id"] for h in heads}) == 2
    text = {0: "", 1: ""}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            text[call["index"]] += call["function"].get("arguments", "")
    assert [json.loads(text[0]), json.loads(text[1])] == arguments
    assert not any("content" in d for d in deltas)


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stream_deltas_rebuild_the_answer(step: int) -> None:
    answer = 'h\u00e9llo "w"\n\U0001F600 \\ end'
    reply = json.dumps({"response": answer})  # ASCII escapes, a surrogate pair among them
    stream = openai_tools.ToolStream()
    out = "".join(
        d.get("content", "") for k in range(0, len(reply), step) for d in stream.feed(reply[k : k + step])
    )
    assert out == answer and stream.calls_sent == 0


def test_cut_reply_is_what_its_stream_sent() -> None:
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa'
    content, calls = openai_tools.cut_reply(text)
    assert content is None and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Pa'}]
    assert openai_tools.cut_reply('{"response": "hel') == ("hel", [])
    assert openai_tools.cut_reply('{"tool_calls": [{"na') == ('{"tool_calls": [{"na', [])  # nothing said yet


ANSWER = {"type": "object", "properties": {"c": {"$ref": "#/$defs/c"}}, "$defs": {"c": {"enum": ["x", {"$ref": "#/k"}]}}}


def test_the_generic_reply_takes_a_format_as_its_response() -> None:
    auto = json.loads(openai_tools.tool_schema(TOOLS, "auto", parallel=True, answer=json.dumps(ANSWER)))
    assert auto["anyOf"][1]["properties"]["response"] == {"$ref": "#/$defs/edged-answer"}
    # A document of its own (an `$id`): its references keep meaning its own root.
    assert auto["$defs"]["edged-answer"] == {"$id": "edged:answer", **ANSWER}
    required = json.loads(openai_tools.tool_schema(TOOLS, "required", parallel=True, answer=json.dumps(ANSWER)))
    assert "$defs" not in required and set(required["properties"]) == {"tool_calls"}


@pytest.mark.parametrize("step", [1, 2, 5])
@pytest.mark.parametrize("value", ['{"a": [1, {"b": "}\\" ]"}], "c" : null }', '"te\\"xt"', "-12.5e3", "true"])
def test_stream_deltas_rebuild_an_answer_in_a_format(step: int, value: str) -> None:
    """The response's JSON text as the model wrote it, streamed as it grows and whole alike."""
    reply = '{"response": ' + value + " }"
    use = openai_tools.ToolUse("", TOOLS, "auto", parallel=True)
    params = GenerateParams(json_schema='{"type": "object"}')
    use.constrain(params)
    stream = use.stream()
    out = "".join(d.get("content", "") for k in range(0, len(reply), step) for d in stream.feed(reply[k : k + step]))
    out += "".join(d.get("content", "") for d in stream.feed("", final=True))
    assert out == value == use.reply(reply, cut=False)[0] == use.reply_calls(reply)[0]
    assert use.reply('{"tool_calls": [{"name": "lights_off", "arguments": {}}]}', cut=False)[1]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_native_answer_is_its_text_even_with_a_call_marker_inside(step: int) -> None:
    use = openai_tools.ToolUse("hermes", TOOLS, "auto", parallel=True)
    params = GenerateParams(json_schema='{"type": "object"}')
    use.constrain(params)
    assert params.tool_calls is not None and not params.tool_calls.lazy and params.json_schema
    answer = '{"note": "<tool_call>\\n{\\"name\\": \\"lights_off\\"}"}'
    stream = use.stream()
    deltas = [d for k in range(0, len(answer), step) for d in stream.feed(answer[k : k + step])]
    deltas += stream.feed("", final=True)
    assert "".join(d.get("content", "") for d in deltas) == answer and stream.calls_sent == 0
    assert use.reply(answer, cut=False) == (answer, [])
    call = '<tool_call>\n{"name": "lights_off", "arguments": {}}\n</tool_call>'
    content, calls = use.reply(call, cut=False)
    assert content is None and [c["function"]["name"] for c in calls] == ["lights_off"]
    # Forced calls have no content: the format is not enforced in that turn.
    forced = openai_tools.ToolUse("hermes", TOOLS, "required", parallel=True)
    params = GenerateParams(json_schema='{"type": "object"}')
    forced.constrain(params)
    assert not params.json_schema and params.tool_calls is not None


def test_the_generic_instructions_name_the_format() -> None:
    """With `auto` and a response format the generic reply's instructions give the format's
    schema for the direct answer (the grammar holds "response" to it); else they ask for text."""
    question = [{"role": "user", "content": "hi"}]
    schema = json.dumps(ANSWER)
    auto = openai_tools.ToolUse("", TOOLS, "auto", parallel=True, answer=schema).messages(question)
    assert auto[0]["role"] == "system" and auto[0]["content"].endswith(
        f'or {{"response": ...}} to answer directly, "response" being a JSON value matching this schema: {schema}'
    )
    for use in (openai_tools.ToolUse("", TOOLS, "required", parallel=True, answer=schema),
                openai_tools.ToolUse("", TOOLS, "auto", parallel=True)):
        assert use.messages(question)[0]["content"].endswith('or {"response": "..."} to answer directly.')
