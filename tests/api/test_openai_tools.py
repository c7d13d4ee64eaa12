"""The generic tool-call format: schema per tool_choice, reply parsing, incremental deltas."""

from __future__ import annotations

import json

import msgspec
import pytest

from daemon.api import openai_tools
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
