"""OpenAI tool calling on any chat model, in the generic JSON format (llama-server's fallback).

The model is told about the tools in a system message and answers with one JSON object:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}   or
    {"response": "plain answer"}

A grammar built from the tools' parameter schemas enforces that object, so the output always
parses: `auto` allows either form, `required` only tool calls, a named tool only calls to it;
`parallel_tool_calls: false` allows one call. Streamed, the reply becomes OpenAI deltas as it
is generated (`ToolStream`): content as it grows; a call's id and name, then its arguments in
pieces. Earlier turns go back through the model's chat
template in the same form: an assistant's `tool_calls` as that JSON, a `tool` message as a user
message holding {"tool_response": {...}} (templates rarely know a `tool` role). The model's own
native tool syntax (Hermes tags, Llama 3.1 JSON, ...) is not used.

The format-neutral pieces (`tool_schema`, `with_tools`, `calls_text`, `tool_result_text`,
`reply_calls`) are shared with the Ollama routes, which shape calls their own way (arguments
as objects, each call whole).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
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
    # The openai client's parse helpers send back their decoding of `arguments` with a call.
    parsed_arguments: Any = None


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall
    # Position in a streamed reply: the openai client's stream helpers keep it in the calls
    # they send back; the call's place in `tool_calls` is its order.
    index: int | None = None


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
        out.append((call.function.name, arguments))
    return calls_text(out)


def calls_text(calls: list[tuple[str, Any]]) -> str:
    """(name, arguments object) pairs as the reply object the model is asked to write."""
    return json.dumps(
        {"tool_calls": [{"name": name, "arguments": arguments} for name, arguments in calls]},
        ensure_ascii=False,
    )


def tool_result_text(content: str, **ident: str) -> str:
    """A tool's result as the model sees it; `ident` names the call (tool_call_id or name)."""
    return json.dumps({"tool_response": {**ident, "content": content}}, ensure_ascii=False)


def reply_calls(text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    """(content, [(name, arguments object)]) from the model's JSON reply; unparsable text is content."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []  # cut short (max_tokens) before the object closed
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return value["response"], []
    if not isinstance(value, dict) or not isinstance(value.get("tool_calls"), list):
        return text, []
    calls = [
        (str(call.get("name")), call.get("arguments", {}))
        for call in value["tool_calls"]
        if isinstance(call, dict)
    ]
    return None, calls


def parse_reply(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) from the model's JSON reply; unparsable text is content."""
    content, calls = reply_calls(text)
    return content, [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
        for name, arguments in calls
    ]


def cut_reply(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a reply cut off before its object closed (max_tokens):
    what streaming it sent, so that both answers agree (OpenAI's too, which returns a call cut
    short with its partial arguments and finish_reason "length"): the answer so far, or the
    calls whose name is complete with their arguments so far; the raw text when the object
    said nothing yet."""
    partial = _scan(text)
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in partial.calls
        if call.name is not None
    ]
    if calls:
        return None, calls
    return (partial.content, []) if partial.content else (text, [])


# --------------------------------------------------------------------------- streaming


@dataclass
class _Call:
    name: str | None = None
    arguments: str = ""  # raw JSON text of the arguments so far


@dataclass
class _Partial:
    """What a prefix of the reply object says so far."""

    content: str | None = None  # the "response" string, decoded as far as it is complete
    calls: list[_Call] = field(default_factory=list)


class ToolStream:
    """Turns the growing JSON reply into OpenAI stream deltas as it is generated.

    The grammar guarantees the text is a prefix of one valid reply object, so each call
    re-reads the whole text (a few hundred characters) and sends what is new: content as
    it grows, a call's id and name once its name is complete, its arguments as they grow.
    """

    def __init__(self) -> None:
        self._text = ""
        self._content = 0
        self._calls: list[tuple[str, int]] = []  # (id, argument characters sent) per call

    @property
    def calls_sent(self) -> int:
        return len(self._calls)

    @property
    def sent_content(self) -> bool:
        return self._content > 0

    @property
    def text(self) -> str:
        return self._text

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas (OpenAI `delta` objects) for the text added since the last call."""
        self._text += text
        partial = _scan(self._text)
        deltas: list[dict[str, Any]] = []
        if partial.content is not None and len(partial.content) > self._content:
            deltas.append({"content": partial.content[self._content :]})
            self._content = len(partial.content)
        for index, call in enumerate(partial.calls):
            if call.name is None:
                break
            if index == len(self._calls):
                ident = f"call_{uuid.uuid4().hex[:24]}"
                self._calls.append((ident, 0))
                deltas.append({"tool_calls": [{
                    "index": index, "id": ident, "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }]})
            ident, sent = self._calls[index]
            if len(call.arguments) > sent:
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments[sent:]}}]})
                self._calls[index] = (ident, len(call.arguments))
        return deltas


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def _string_end(text: str, i: int) -> int:
    """Index after the closing quote of the string starting at text[i] == '"'; -1 if incomplete."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return -1


def _partial_string(text: str, i: int) -> str:
    """The decoded part of an incomplete string starting at text[i] == '"'.

    Stops before an escape still arriving, and before the first half of a surrogate pair
    whose second half has not arrived (decoded alone it would differ from the pair).
    """
    raw = text[i + 1 :]
    j = cut = 0
    while j < len(raw):
        if raw[j] == "\\":
            if j + 1 >= len(raw):
                break
            if raw[j + 1] == "u":
                if j + 6 > len(raw):
                    break
                pair = 0xD800 <= int(raw[j + 2 : j + 6], 16) <= 0xDBFF
                if pair and j + 12 > len(raw):
                    break
                j += 12 if pair else 6
            else:
                j += 2
        else:
            j += 1
        cut = j
    try:
        return str(json.loads('"' + raw[:cut] + '"'))
    except ValueError:
        return ""


def _value_end(text: str, i: int) -> int:
    """Index after the JSON value starting at text[i]; -1 while it is incomplete."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            char = text[j]
            if char == '"':
                j = _string_end(text, j)
                if j < 0:
                    return -1
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return -1
    j = i
    while j < len(text) and text[j] not in ",}] \t\n\r":
        j += 1
    return j if j < len(text) else -1


def _key(text: str, i: int) -> tuple[str | None, int]:
    """A complete object key and the index after its colon; (None, i) until both are there."""
    i = _skip(text, i)
    if i >= len(text) or text[i] != '"':
        return None, i
    end = _string_end(text, i)
    if end < 0:
        return None, i
    colon = _skip(text, end)
    if colon >= len(text) or text[colon] != ":":
        return None, i
    return str(json.loads(text[i:end])), _skip(text, colon + 1)


def _scan(text: str) -> _Partial:
    partial = _Partial()
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "{":
        return partial
    key, i = _key(text, i + 1)
    if key == "response":
        if i < len(text) and text[i] == '"':
            end = _string_end(text, i)
            partial.content = str(json.loads(text[i:end])) if end > 0 else _partial_string(text, i)
        return partial
    if key != "tool_calls" or i >= len(text) or text[i] != "[":
        return partial
    i += 1
    while True:
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
        if i >= len(text) or text[i] != "{":
            return partial
        call = _Call()
        partial.calls.append(call)
        i += 1
        while True:
            key, i = _key(text, i)
            if key is None or i >= len(text):
                return partial
            end = _value_end(text, i)
            if key == "name":
                if end < 0:
                    return partial
                call.name = str(json.loads(text[i:end]))
            elif key == "arguments":
                call.arguments = text[i:end] if end > 0 else text[i:]
                if end < 0:
                    return partial
            elif end < 0:
                return partial
            i = _skip(text, end)
            if i < len(text) and text[i] == ",":
                i += 1
                continue
            if i < len(text) and text[i] == "}":
                i += 1
                break
            return partial
