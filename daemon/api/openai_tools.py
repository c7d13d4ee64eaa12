"""OpenAI tool calling on any chat model, in the generic JSON format (llama-server's fallback).

The model is told about the tools in a system message and answers with one JSON object:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}   or
    {"response": "plain answer"}

A grammar built from the tools' parameter schemas enforces that object, so the output always
parses: `auto` allows either form, `required` only tool calls, a named tool only calls to it;
`parallel_tool_calls: false` allows one call. Earlier turns go back through the model's chat
template in the same form: an assistant's `tool_calls` as that JSON, a `tool` message as a user
message holding {"tool_response": {...}} (templates rarely know a `tool` role). The model's own
native tool syntax (Hermes tags, Llama 3.1 JSON, ...) is not used.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec

from daemon.errors import InvalidArgument


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    # JSON schema of the arguments object; absent = a function without arguments.
    parameters: dict[str, Any] | None = None
    # The grammar enforces the schema either way.
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


def tool_schema(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> str:
    """The JSON schema (text) of the reply object for these tools and this choice."""
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidArgument("tools: function names must be unique")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidArgument(f"tool_choice: no tool named {choice.function.name!r} in tools")
        tools = [t for t in tools if t.function.name == choice.function.name]
    calls: dict[str, Any] = {
        "type": "array",
        "items": {"anyOf": [_call_schema(t) for t in tools]},
        "minItems": 1,
    }
    if not parallel:
        calls["maxItems"] = 1
    with_calls = {
        "type": "object", "properties": {"tool_calls": calls},
        "required": ["tool_calls"], "additionalProperties": False,
    }
    if choice == "auto" or choice is None:
        answer = {
            "type": "object", "properties": {"response": {"type": "string"}},
            "required": ["response"], "additionalProperties": False,
        }
        return json.dumps({"anyOf": [with_calls, answer]})
    return json.dumps(with_calls)


def _call_schema(tool: Tool) -> dict[str, Any]:
    arguments = tool.function.parameters
    if arguments is None:
        arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def system_prompt(tools: list[Tool], parallel: bool) -> str:
    described = [
        {k: v for k, v in msgspec.to_builtins(t.function).items() if k != "strict"} for t in tools
    ]
    many = "one or more tool calls" if parallel else "one tool call"
    return (
        "You can use these tools:\n"
        + json.dumps(described, ensure_ascii=False)
        + f'\n\nAnswer with one JSON object: {{"tool_calls": [{{"name": ..., "arguments": {{...}}}}]}} '
        f'for {many}, or {{"response": "..."}} to answer directly.'
    )


def with_tools(messages: list[dict[str, str]], tools: list[Tool], parallel: bool) -> list[dict[str, str]]:
    """Messages with the tools' description in the (first) system message."""
    text = system_prompt(tools, parallel)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = first["content"] + "\n\n" + text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def assistant_calls_text(calls: list[ToolCall], index: int) -> str:
    """An earlier assistant turn's tool calls, in the form the model is asked to write."""
    out = []
    for i, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            raise InvalidArgument(
                f"messages[{index}].tool_calls[{i}].function.arguments: not valid JSON"
            ) from None
        out.append({"name": call.function.name, "arguments": arguments})
    return json.dumps({"tool_calls": out}, ensure_ascii=False)


def tool_result_text(tool_call_id: str, content: str) -> str:
    return json.dumps({"tool_response": {"tool_call_id": tool_call_id, "content": content}}, ensure_ascii=False)


def parse_reply(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) from the model's JSON reply; unparsable text is content."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []  # cut short (max_tokens) before the object closed
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return value["response"], []
    if not isinstance(value, dict) or not isinstance(value.get("tool_calls"), list):
        return text, []
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": call.get("name"),
                "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False),
            },
        }
        for call in value["tool_calls"]
        if isinstance(call, dict)
    ]
    return None, calls
