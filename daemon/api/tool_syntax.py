"""Tool calls as models write them: reading a reply (whole or a growing prefix) into content and calls.

Two families of syntax:

- **generic** (`GENERIC`): edged's JSON reply object for chat templates that know no tool
  format (see `openai_tools`): `{"tool_calls": [{"name", "arguments"}]}` or `{"response": "..."}`.
- **native**: the syntax the model's own chat template describes, as llama.cpp's llama-server
  parses it, for the families the llama.cpp backend recognises (`tool_syntax()`):
  Hermes / Qwen `<tool_call>\\n{"name", "arguments"}\\n</tool_call>` (several in a row), Mistral
  Nemo `[TOOL_CALLS][{"name", "arguments", "id"}, ...]`, Nemotron Nano v2
  `<TOOLCALL>[{"name", "arguments"}, ...]</TOOLCALL>`, Apertus
  `<|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>` (the name as the object's key), newer Mistral templates
  `[TOOL_CALLS]name[ARGS]{...}` (several in a row; Mistral Small 3.2 with `[CALL_ID]id` after
  the name), Llama 3.x one `{"name", "parameters"}` object as the whole reply, Qwen 3.5 and
  Qwen3-Coder XML (`<tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n...`,
  read by the tools' parameter types), Gemma 4 (`<|tool_call>call:name{key:<|"|>text<|"|>}<tool_call|>`,
  its own object syntax), gpt-oss (a message to `functions.NAME` on its channels, handed on by
  reasoning.ChannelSplit), LFM2 (`<|tool_call_start|>[name(key="value"), ...]<|tool_call_end|>`,
  Python-style calls), DeepSeek R1 and its Qwen distill (one section of calls, each the tool's
  name and its arguments in a JSON code block between R1's own markers: `_R1_CALLS`), MiniCPM5
  (`<function name="name"><param name="key">value</param></function>`, a string value raw or in
  CDATA). Free text before the calls is the message's content.

The engine's grammar guarantees the calls part is a prefix of a valid frame (`frame`), so a
reader only has to follow it; a reply cut short (max_tokens) is read as far as it goes.
Streaming re-reads the whole text on each piece (a few hundred characters) and sends what is
new; `final=False` holds back what may still turn into the start of a call (a partial
`<tool_call>`, trailing whitespace before it), so that the streamed content adds up to the
unstreamed one.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from daemon.api.reasoning import (
    HARMONY_ARGS,
    HARMONY_CALL,
    HARMONY_END,
    ChannelSplit,
    Split,
    ThinkingSplit,
    overlap,
)
from daemon.backend import JSON_TYPES, ToolCallFrame, json_type, xml_value_types


@dataclass
class Call:
    name: str | None = None
    arguments: str = ""  # raw JSON text of the arguments so far


@dataclass
class Reading:
    """What a prefix of the reply says so far."""

    content: str | None = None  # the answer's text, as far as it is certain
    calls: list[Call] = field(default_factory=list)
    complete: bool = False  # the calls' frame (or generic object) is closed


class Syntax:
    """How one syntax is read and enforced."""

    name: str
    native = True
    # How llama-server's parser for the format reads a thinking model's reasoning
    # (reasoning.ThinkingSplit's `ends`, `trim` and `keep_after`): a marker that also ends
    # it, whether the whitespace that opens it is dropped, whether the whitespace after its
    # closing tag is the answer's.
    ends_reasoning: ClassVar[str] = ""
    trims_reasoning: ClassVar[bool] = False
    keeps_after_reasoning: ClassVar[bool] = False
    # What the output writes before a structured answer (GenerateParams.answer_header).
    answer_header: ClassVar[str] = ""
    # Every route reads a reply through `thinking_split` (gpt-oss's channels), Ollama's too,
    # which otherwise splits reasoning its own way.
    own_split: ClassVar[bool] = False

    def read(self, text: str, final: bool) -> Reading:
        raise NotImplementedError

    def frame(self, calls: list[dict[str, Any]], *, lazy: bool, parallel: bool) -> ToolCallFrame:
        raise NotImplementedError

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def unsplit(self) -> Split | None:
        """How a reply is read when its reasoning is not split off (`reasoning_format: none`):
        None, as it is; gpt-oss's still off its channels."""
        return None

    def thinking_split(self, tags: tuple[str, str], opened: str | None) -> Split:
        """A reply's reasoning and answer as llama-server's parser for the format reads them."""
        return ThinkingSplit(
            tags, opened=opened, trim=self.trims_reasoning, ends=self.ends_reasoning,
            keep_after=self.keeps_after_reasoning,
        )

    def shown_reasoning(self, tags: tuple[str, str]) -> tuple[str, str]:
        """The reasoning's tags (the model's `tags`) as a reply read `unsplit` shows them."""
        return tags

    def reply_text(self, text: str) -> str:
        """The reply as it is read, content and calls: the text, or (Apertus) without the
        whitespace that opens it, which llama-server's automatic parser skips when tools are
        given (its parser lets space follow the generation prompt)."""
        return text

    def for_tools(self, parameters: Mapping[str, Any]) -> Syntax:
        """This syntax for one request's tools (name -> parameters schema): a syntax that
        writes arguments by their types reads them by the same."""
        return self


class _Generic(Syntax):
    name = "generic"
    native = False

    def read(self, text: str, final: bool) -> Reading:
        return _scan_generic(text)


class _GenericAnswer(_Generic):
    """The generic reply when the answer has a response format: `{"response": VALUE}`, VALUE
    any JSON value (the format's); the content is VALUE's JSON text as the model wrote it."""

    def read(self, text: str, final: bool) -> Reading:
        return _scan_generic(text, raw_answer=True)


@dataclass(frozen=True)
class _Framed(Syntax):
    """A native syntax: `open`, call objects separated by `separator`, `close`."""

    name: str
    open: str
    separator: str
    close: str
    arguments_key: str
    # Llama 3.x templates take one call per assistant turn.
    one_call: bool = False
    # Mistral's template requires call ids of 9 letters and digits.
    id_length: int = 0

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        properties: dict[str, Any] = {"name": {"const": name}, self.arguments_key: parameters}
        if self.id_length:
            # The model writes an id (its training format); edged answers with its own.
            properties["id"] = {"type": "string", "pattern": f"^[a-zA-Z0-9]{{{self.id_length}}}$"}
        return {
            "type": "object", "properties": properties,
            "required": list(properties), "additionalProperties": False,
        }

    def frame(self, calls: list[dict[str, Any]], *, lazy: bool, parallel: bool) -> ToolCallFrame:
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return ToolCallFrame(
            call_schema=json.dumps(schema), open=self.open, separator=self.separator, close=self.close,
            max_calls=1 if self.one_call or not parallel else None, lazy=lazy,
        )

    def call_id(self) -> str:
        if self.id_length:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(self.id_length))
        return super().call_id()

    def read(self, text: str, final: bool) -> Reading:
        reading = Reading()
        if self.open:
            at = _content(text, self.open, final, reading)
            if at < 0:
                return reading
            i = at + len(self.open)
        else:
            # No opening marker (Llama 3.x): a reply starting with "{" is a call, anything
            # else is an answer (the lazy grammar triggers on the same leading "{").
            i = _skip(text, 0)
            if i >= len(text):
                reading.content = text if final else ""
                return reading
            if text[i] != "{":
                reading.content = text
                return reading
            reading.content = ""
        while True:
            i = _skip(text, i)
            if i >= len(text) or text[i] != "{":
                return reading
            call = Call()
            reading.calls.append(call)
            i = _scan_call(text, i + 1, call, self.arguments_key)
            if i < 0:
                return reading
            # The grammar lets whitespace follow a JSON value (llama.cpp's `space` rule), also
            # before a separator or close that begins with a newline.
            i = _skip(text, i)
            separator, close = self.separator.lstrip(), self.close.lstrip()
            if separator and text.startswith(separator, i):
                i += len(separator)
                continue
            if text.startswith(close, i):
                reading.complete = True
            return reading


@dataclass(frozen=True)
class _JsonList(_Framed):
    """Calls as one JSON list after a marker, closed by `end` (if any): Nemotron Nano v2's
    `<TOOLCALL>[{"name", "arguments"}, ...]</TOOLCALL>`, Apertus's
    `<|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>`. Read as llama-server's parser for the
    format reads it: whitespace between the marker, the list's brackets and commas, and the end
    marker; several such sections one after another (its grammar repeats them, edged's writes
    one, so only replies of other writers have more)."""

    marker: str = ""
    end: str = ""
    # Apertus: each call is `{"NAME": ARGUMENTS}`, the tool's name its object's only key
    # (llama.cpp's automatic parser finds this layout in the template and reads it so).
    name_is_key: bool = False
    # llama-server drops the newline after the `<think>` Nemotron's prompt opens (its parser
    # for the template), also from a reply without tools.
    trims_reasoning: ClassVar[bool] = True

    def reply_text(self, text: str) -> str:
        return text[_skip(text, 0) :] if self.name_is_key else text

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        if not self.name_is_key:
            return super().call_schema(name, parameters)
        return {"type": "object", "properties": {name: parameters}, "required": [name], "additionalProperties": False}

    def read(self, text: str, final: bool) -> Reading:
        reading = Reading()
        # Apertus: llama-server's automatic parser keeps the whitespace before the marker as
        # content (Nemotron's parser for its template does not).
        i = _content(text, self.marker, final, reading, strip=not self.name_is_key)
        while i >= 0 and text.startswith(self.marker, i):
            reading.complete = False
            i = _skip(text, i + len(self.marker))
            if not text.startswith("[", i):
                return reading
            i += 1
            while True:
                i = _skip(text, i)
                if not text.startswith("{", i):
                    return reading
                call = Call()
                reading.calls.append(call)
                if self.name_is_key:
                    i = _scan_keyed_call(text, i + 1, call)
                else:
                    i = _scan_call(text, i + 1, call, self.arguments_key)
                if i < 0:
                    # llama-server opens the arguments as soon as the name is complete.
                    if call.name is not None and not call.arguments:
                        call.arguments = "{"
                    return reading
                i = _skip(text, i)
                if not text.startswith(",", i):
                    break
                i += 1
            if not text.startswith("]", i):
                return reading
            i = _skip(text, i + 1)
            if not text.startswith(self.end, i):
                return reading
            reading.complete = True
            i = _skip(text, i + len(self.end))
        return reading


def _json_list(name: str, marker: str, end: str, *, name_is_key: bool = False) -> _JsonList:
    return _JsonList(name, f"{marker}[", ", ", f"]{end}", "arguments", marker=marker, end=end, name_is_key=name_is_key)


class _ByName(Syntax):
    """A syntax whose calls are no JSON objects but a tool's name and its arguments (the
    frame's `named_calls`)."""

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        # Not a schema of the call: what `frame` needs of it.
        return {"name": name, "arguments": parameters}


def _named_calls(calls: list[dict[str, Any]]) -> dict[str, str]:
    """ToolCallFrame.named_calls of `_ByName.call_schema`s: tool name -> arguments schema."""
    return {call["name"]: json.dumps(call["arguments"]) for call in calls}


@dataclass(frozen=True)
class _Named(_ByName):
    """Calls written as `marker` + name (+ `id_marker` + id) + `args_marker` + arguments object,
    one after another: newer Mistral templates (`[TOOL_CALLS]get_weather[ARGS]{...}`).

    With `start`, the calls are one section: `start`, then each call closed by `call_end`,
    then `end` (DeepSeek R1's, `_R1_CALLS` ... `_R1_CALLS_END`); read as
    llama-server's parser reads it: whitespace after `start`, between calls, before `end` and
    around the arguments object. The frame writes `between` between two calls and a newline
    before each `call_end`, as the model's template does."""

    name: str
    marker: str = "[TOOL_CALLS]"
    args_marker: str = "[ARGS]"
    id_marker: str = ""
    start: str = ""
    call_end: str = ""
    end: str = ""
    between: str = ""

    def frame(self, calls: list[dict[str, Any]], *, lazy: bool, parallel: bool) -> ToolCallFrame:
        if self.start:
            call_end = f"\n{self.call_end}"
            return ToolCallFrame(
                open=self.start + self.marker, separator=call_end + self.between + self.marker,
                close=call_end + self.end, max_calls=None if parallel else 1, lazy=lazy,
                named_calls=_named_calls(calls), args_marker=self.args_marker,
            )
        return ToolCallFrame(
            open=self.marker, separator=self.marker, max_calls=None if parallel else 1, lazy=lazy,
            named_calls=_named_calls(calls), args_marker=self.args_marker, id_marker=self.id_marker,
        )

    def call_id(self) -> str:
        if self.start:
            return super().call_id()
        # Mistral's templates take back only ids of 9 letters and digits.
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))

    def read(self, text: str, final: bool) -> Reading:
        reading = Reading()
        i = _content(text, self.start or self.marker, final, reading)
        if i < 0:
            return reading
        if self.start:
            i = _skip(text, i + len(self.start))
        while text.startswith(self.marker, i):
            i += len(self.marker)
            # The name ends at the id's marker or the arguments' (the grammar wrote one of them).
            name_end = text.find(self.id_marker or self.args_marker, i)
            args_at = text.find(self.args_marker, i)
            if name_end < 0 or args_at < 0:
                if name_end >= 0:
                    reading.calls.append(Call(name=text[i:name_end]))
                return reading
            call = Call(name=text[i:name_end])
            reading.calls.append(call)
            i = _skip(text, args_at + len(self.args_marker))
            if i >= len(text) or text[i] != "{":
                if self.start:
                    # llama-server opens the arguments as soon as the name is complete.
                    call.arguments = "{"
                return reading
            end = _value_end(text, i)
            call.arguments = text[i:end] if end > 0 else text[i:]
            if end < 0:
                if self.start:
                    # llama-server leaves the whitespace that ends arguments still arriving out.
                    call.arguments = call.arguments.rstrip(" \t\n\r")
                return reading
            i = _skip(text, end)
            if self.call_end:
                if not text.startswith(self.call_end, i):
                    return reading
                i = _skip(text, i + len(self.call_end))
        if self.start:
            reading.complete = text.startswith(self.end, i)
            return reading
        # Nothing closes the frame: it is complete once a call's arguments are, unless
        # another call is still starting.
        reading.complete = not self.marker.startswith(text[i:]) or final
        return reading


@dataclass(frozen=True)
class _Harmony(_Named):
    """gpt-oss: its reply is messages on channels (reasoning.ChannelSplit), one call per reply,
    a message to `functions.NAME` whose text is the arguments object; the split hands the call
    on as `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, the form
    the grammar holds the model to, and the one read here. A lazy grammar starts at
    `<|channel|>commentary to`, as llama-server's does (a preamble on the commentary channel
    has no recipient and stays free text)."""

    name: str = "gpt_oss"
    marker: str = HARMONY_CALL
    args_marker: str = HARMONY_ARGS
    answer_header: ClassVar[str] = "<|channel|>final<|message|>"
    own_split: ClassVar[bool] = True

    def thinking_split(self, tags: tuple[str, str], opened: str | None) -> Split:
        return ChannelSplit()

    def unsplit(self) -> Split | None:
        return ChannelSplit(keep_reasoning=True)

    def shown_reasoning(self, tags: tuple[str, str]) -> tuple[str, str]:
        # ChannelSplit(keep_reasoning) ends an analysis message with `<|end|>` alone.
        return (tags[0], HARMONY_END) if tags[0] else tags

    def frame(self, calls: list[dict[str, Any]], *, lazy: bool, parallel: bool) -> ToolCallFrame:
        # The template takes one call per assistant message (it renders tool_calls[0]).
        return ToolCallFrame(
            open=self.marker, max_calls=1, lazy=lazy, named_calls=_named_calls(calls),
            args_marker=self.args_marker, trigger="<|channel|>commentary to",
        )

    def call_id(self) -> str:
        return Syntax.call_id(self)


_PY_START = "<|tool_call_start|>"
_PY_END = "<|tool_call_end|>"


@dataclass(frozen=True)
class _Pythonic(_ByName):
    """LFM2 / LFM2.5: `<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>`, keyword
    arguments whose values are Python or JSON literals (strings in either quotes, True/False/
    None or true/false/null, numbers, lists, dicts), read into JSON as llama-server's parser
    for the format converts them (`_py_rewrite`): `{"key":value,...}`, each value as written
    but for its strings in JSON's quotes and Python's names as JSON's. Streamed, a key once its
    "=" is out and a value as far as it is certain."""

    name: str

    def frame(self, calls: list[dict[str, Any]], *, lazy: bool, parallel: bool) -> ToolCallFrame:
        return ToolCallFrame(
            open=f"{_PY_START}[", separator=", ", close=f"]{_PY_END}", max_calls=None if parallel else 1, lazy=lazy,
            named_calls=_named_calls(calls), args_marker="(", arguments_syntax="python",
        )

    def read(self, text: str, final: bool) -> Reading:
        reading = Reading()
        i = _content(text, _PY_START, final, reading)
        if i < 0:
            return reading
        i = _skip(text, i + len(_PY_START))
        if not text.startswith("[", i):
            return reading
        i += 1
        while True:
            i = _skip(text, i)
            open_at = text.find("(", i)
            if open_at < 0 or not text[i:open_at].strip():
                return reading
            call = Call(name=text[i:open_at].strip(), arguments="{")
            reading.calls.append(call)
            i = _py_arguments(text, open_at + 1, call, final)
            if i < 0:
                return reading
            i = _skip(text, i)
            if text.startswith(",", i):
                i += 1
                continue
            if text.startswith("]", i) and text.startswith(_PY_END, _skip(text, i + 1)):
                reading.complete = True
            return reading


def _py_arguments(text: str, i: int, call: Call, final: bool) -> int:
    """Read keyword arguments from text[i] (after the call's "(") into `call.arguments`; the
    index after the closing ")", or -1 while the call is incomplete (what is certain so far is
    in `call.arguments`)."""
    first = True
    while True:
        i = _skip(text, i)
        if i >= len(text):
            return -1
        if text[i] == ")":
            call.arguments += "}"
            return i + 1
        if not first:
            if text[i] != ",":
                return -1
            i = _skip(text, i + 1)
        equals = text.find("=", i)
        if equals < 0 or not text[i:equals].strip().isidentifier():
            return -1
        key = text[i:equals].strip()
        # The key is out once its "=" is, as llama-server streams it.
        call.arguments += ("" if first else ",") + json.dumps(key, ensure_ascii=False) + ":"
        first = False
        i = _skip(text, equals + 1)
        end = _py_value_end(text, i)
        if end < 0:
            call.arguments += _py_partial(text[i:])
            return -1
        value = _py_json(text[i:end])
        if value is None:
            return -1
        call.arguments += value
        i = end


def _py_value_end(text: str, i: int) -> int:
    """Index after the Python or JSON literal starting at text[i]; -1 while it is incomplete."""
    depth, j = 0, i
    while j < len(text):
        char = text[j]
        if char in "\"'":
            j = _string_end(text, j)
            if j < 0:
                return -1
            if depth == 0:
                return j
            continue
        if char in "[{(":
            depth += 1
        elif char in "]})":
            if depth == 0:
                return j  # the call's ")" ends a bare value
            depth -= 1
            if depth == 0:
                return j + 1
        elif char == "," and depth == 0:
            return j
        j += 1
    return -1


def _py_json(literal: str) -> str | None:
    """A complete Python or JSON literal as JSON text, as llama-server converts it: written as
    it is, each Python string in JSON's quotes and True/False/None as JSON's names; None when
    the result is no JSON (a tuple, a set, a name)."""
    text = _py_rewrite(literal.strip(), final=True)
    try:
        json.loads(text)
    except ValueError:
        return None
    return text


def _py_partial(raw: str) -> str:
    """What is certain of a value still arriving (`_py_rewrite` of its start): a string's JSON
    text without the closing quote, other values as far as their complete parts go."""
    return _py_rewrite(raw, final=False).rstrip()


def _py_rewrite(raw: str, *, final: bool) -> str:
    """`raw` (a Python or JSON literal, or its start) rewritten into JSON text in place: strings
    in JSON's quotes (single-quoted ones converted, double-quoted ones as written where JSON reads
    them), True/False/None as true/false/null, everything else as written. Not `final`: it ends
    before a name still arriving and a string's closing quote, so what it returns only grows as
    `raw` does."""
    out: list[str] = []
    j = 0
    while j < len(raw):
        char = raw[j]
        if char in "\"'":
            end = _string_end(raw, j)
            if end < 0:
                out.append(_py_open_string(raw[j:]))
                break
            literal = raw[j:end]
            try:
                value = json.loads(literal) if char == '"' else None
                text = literal if char == '"' and isinstance(value, str) else None
            except ValueError:
                text = None
            if text is None:
                try:
                    text = json.dumps(ast.literal_eval(literal), ensure_ascii=False)
                except (ValueError, SyntaxError, MemoryError, RecursionError):
                    text = literal
            out.append(text)
            j = end
            continue
        word = re.match(r"[A-Za-z_]\w*", raw[j:])
        if word:
            if j + len(word.group()) == len(raw) and not final:
                break  # the name may go on
            out.append(_PY_NAMES.get(word.group(), word.group()))
            j += len(word.group())
            continue
        out.append(char)
        j += 1
    return "".join(out)


_PY_NAMES = {"True": "true", "False": "false", "None": "null"}


def _py_open_string(raw: str) -> str:
    """A string still arriving as JSON text without its closing quote, up to a complete escape."""
    body, j, cut = raw[1:], 0, 0
    while j < len(body):
        if body[j] == "\\":
            # An escape counts once whole: \uXXXX, \xXX, \UXXXXXXXX, or two characters.
            size = {"u": 6, "x": 4, "U": 10}.get(body[j + 1], 2) if j + 1 < len(body) else 2
            if j + size > len(body):
                break
            j += size
        else:
            j += 1
        cut = j
    if raw[0] == '"':
        try:  # JSON's so far: as written, as the whole string will be
            json.loads(raw[: 1 + cut] + '"')
            return raw[: 1 + cut]
        except ValueError:
            pass
    try:
        value = ast.literal_eval(raw[0] + body[:cut] + raw[0])
    except (ValueError, SyntaxError):
        return ""
    return json.dumps(value, ensure_ascii=False)[:-1]


_CDATA_OPEN = "<![CDATA["
_CDATA_CLOSE = "]]>"


@dataclass(frozen=True)
class _Xml(_ByName):
    """XML calls, one tag per parameter. Qwen 3.5 and Qwen3-Coder (the defaults): each call is
    `<tool_call>\n<function=name>\n`, one `<parameter=key>\nvalue\n</parameter>\n` per
    argument, then `</function>\n</tool_call>`; a value is raw text where its schema admits
    strings (as JSON first, where it admits another type too and parses as one), else JSON text
    (`xml_value_types`). The arguments are read into compact JSON, as llama-server writes them:
    `{"key":value,...}`, raw text as a JSON string, JSON text as written. `_MiniCpm5` is the
    same with other tags."""

    name: str
    # The text that begins a call (the content ends there), then the tags that open it, each
    # after optional whitespace; the last is followed by the name and `name_end`.
    marker: str = "<tool_call>"
    opens: tuple[str, ...] = ("<tool_call>", "<function=")
    name_end: str = ">"
    # What the grammar writes after the name (the name's tag and the whitespace after it).
    args_marker: str = ">\n"
    # A parameter: parameter[0] key parameter[1], an optional `value_lead`, the value, parameter[2].
    parameter: tuple[str, str, str] = ("<parameter=", ">", "\n</parameter>\n")
    value_lead: str = "\n"
    # The tags that close a call, each after optional whitespace.
    ends: tuple[str, ...] = ("</function>", "</tool_call>")
    # Whitespace allowed after the name's tag and after each value, and the whitespace before
    # the first call kept in the content (as llama-server reads MiniCPM5's calls).
    spaced: bool = False
    # A value where strings are allowed: read as JSON first where another type is allowed too
    # (Qwen), or always as the string (MiniCPM5, which may also write it in `<![CDATA[...]]>`).
    strings_as_json: bool = True
    cdata: bool = False
    # A JSON value ends where its JSON text does (a string in it may hold the close), not at
    # the first close.
    scan_json: bool = False
    # Where a lazy grammar starts (ToolCallFrame.trigger; "" for its default).
    trigger: str = ""
    # llama-server ends the reasoning at a call too, and drops the newline after the <think>
    # the prompt opens (its parser for these templates).
    ends_reasoning: ClassVar[str] = "<tool_call>"
    trims_reasoning: ClassVar[bool] = True
    # tool -> parameter -> the JSON types of its value (xml_value_types).
    types: Mapping[str, Mapping[str, frozenset[str]]] = field(default_factory=dict)

    def for_tools(self, parameters: Mapping[str, Any]) -> Syntax:
        types = {}
        for tool, schema in parameters.items():
            properties = schema.get("properties") if isinstance(schema, dict) else None
            types[tool] = {
                key: xml_value_types(value, schema)
                for key, value in (properties.items() if isinstance(properties, dict) else ())
            }
        return replace(self, types=types)

    def frame(self, calls: list[dict[str, Any]], *, lazy: bool, parallel: bool) -> ToolCallFrame:
        # As the template writes calls: one tag a line (Qwen), the next call on a new line.
        start, end = "\n".join(self.opens), "\n".join(self.ends)
        key_open, key_end, close = self.parameter
        return ToolCallFrame(
            open=start, separator=f"{end}\n{start}", close=end,
            max_calls=None if parallel else 1, lazy=lazy, args_marker=self.args_marker, arguments_syntax="xml",
            named_calls=_named_calls(calls), xml_parameter=(key_open, key_end + self.value_lead, close),
            xml_cdata=self.cdata, trigger=self.trigger, ends_reasoning=bool(self.ends_reasoning),
        )

    def read(self, text: str, final: bool) -> Reading:
        reading = Reading()
        i = _content(text, self.marker, final, reading, strip=not self.spaced)
        key_open, key_end, _ = self.parameter
        while i >= 0 and text.startswith(self.marker, i):
            reading.complete = False
            for tag in self.opens[:-1]:
                if not text.startswith(tag, i):
                    return reading
                i = _skip(text, i + len(tag))
            head = self.opens[-1]
            end = text.find(self.name_end, i + len(head))
            if not text.startswith(head, i) or end < 0:
                return reading
            name = text[i + len(head) : end]
            call = Call(name=name, arguments="{")
            reading.calls.append(call)
            types = self.types.get(name, {})
            i = _skip(text, end + len(self.name_end))
            while text.startswith(key_open, i):
                end = text.find(key_end, i + len(key_open))
                if end < 0:
                    return reading
                key = text[i + len(key_open) : end]
                comma = "," if call.arguments != "{" else ""
                call.arguments += f"{comma}{json.dumps(key, ensure_ascii=False)}:"
                start = end + len(key_end)
                if self.value_lead and text.startswith(self.value_lead, start):
                    start += len(self.value_lead)
                value, i = self._value(text, start, types.get(key, JSON_TYPES), final)
                call.arguments += value
                if i < 0:
                    return reading
                if self.spaced:
                    i = _skip(text, i)
            for number, tag in enumerate(self.ends):
                i = _skip(text, i) if number else i
                if not text.startswith(tag, i):
                    return reading
                call.arguments += "" if number else "}"
                i += len(tag)
            reading.complete = True
            i = _skip(text, i)
        return reading

    def _value(self, text: str, start: int, kinds: frozenset[str], final: bool) -> tuple[str, int]:
        """The JSON of the value at text[start] and the index after its close; while it is
        incomplete, what is certain of it and -1."""
        close = self.parameter[2]
        string = "string" in kinds and (kinds == {"string"} or not self.strings_as_json)
        if self.cdata and string and _CDATA_OPEN.startswith(text[start : start + len(_CDATA_OPEN)]):
            if not text.startswith(_CDATA_OPEN, start):
                return "", -1  # CDATA or not: nothing of the value yet
            inner = start + len(_CDATA_OPEN)
            end = text.find(_CDATA_CLOSE, inner)
            raw = text[inner:] if end < 0 else text[inner:end]
            if end < 0:
                return _open_string(raw[: len(raw) - overlap(raw, _CDATA_CLOSE)]), -1
            after = end + len(_CDATA_CLOSE)
            if text.startswith(close, after):
                return json.dumps(raw, ensure_ascii=False), after + len(close)
            # The close still arriving; anything else after "]]>" llama-server does not read.
            return json.dumps(raw, ensure_ascii=False)[:-1], -1
        end = text.find(close, start)
        if self.scan_json and not string and text[start : start + 1] in ('"', "{", "["):
            # JSON text may hold the close in a string: the value ends where its JSON does.
            end = _value_end(text, start)
            if end < 0 or not text.startswith(close, end):
                # Still arriving, or something else after it (llama-server reads no call there).
                return _xml_partial(text[start:] if end < 0 else text[start:end], kinds, final, close, string=string), -1
        if end < 0:
            return _xml_partial(text[start:], kinds, final, close, string=string), -1
        return _xml_value(text[start:end], kinds, string=string), end + len(close)


@dataclass(frozen=True)
class _MiniCpm5(_Xml):
    """MiniCPM5: `<function name="name">`, one `<param name="key">value</param>` per argument,
    then `</function>`, whitespace allowed between the tags. A value is a string where its
    schema admits strings (whatever it looks like), raw or in `<![CDATA[...]]>` (its text up to
    the first "]]>", which "</param>" must follow), else JSON text, as llama-server reads them.
    Free text before the first call is the content, its whitespace too; a call does not end the
    reasoning."""

    marker: str = "<function"
    opens: tuple[str, ...] = ('<function name="',)
    name_end: str = '">'
    args_marker: str = '">'
    parameter: tuple[str, str, str] = ('<param name="', '">', "</param>")
    value_lead: str = ""
    ends: tuple[str, ...] = ("</function>",)
    spaced: bool = True
    strings_as_json: bool = False
    cdata: bool = True
    scan_json: bool = True
    # llama-server's lazy grammar starts at the word "<function".
    trigger: str = "<function"
    ends_reasoning: ClassVar[str] = ""


_GEMMA_CALL = "<|tool_call>call:"
_GEMMA_END = "<tool_call|>"
_GEMMA_QUOTE = '<|"|>'


@dataclass(frozen=True)
class _Gemma(_ByName):
    """Gemma 4: `<|tool_call>call:name{...}<tool_call|>` per call, one after another, the
    arguments in Gemma's object syntax (`{key:<|"|>text<|"|>,n:3,o:{a:true},l:[1]}`), read
    into compact JSON as llama-server converts them: keys quoted, strings escaped, numbers,
    booleans and null as written."""

    name: str
    # llama-server's parser for Gemma 4's thought channel drops the whitespace that opens the
    # reasoning and keeps that after the channel closes (the answer's).
    trims_reasoning: ClassVar[bool] = True
    keeps_after_reasoning: ClassVar[bool] = True

    def frame(self, calls: list[dict[str, Any]], *, lazy: bool, parallel: bool) -> ToolCallFrame:
        return ToolCallFrame(
            open=_GEMMA_CALL, separator=_GEMMA_END + _GEMMA_CALL, close=_GEMMA_END,
            max_calls=None if parallel else 1, lazy=lazy, arguments_syntax="gemma",
            named_calls=_named_calls(calls),
        )

    def read(self, text: str, final: bool) -> Reading:
        reading = Reading()
        i = _content(text, _GEMMA_CALL, final, reading)
        while i >= 0 and text.startswith(_GEMMA_CALL, i):
            reading.complete = False
            i += len(_GEMMA_CALL)
            brace = text.find("{", i)
            if brace < 0:
                return reading
            call = Call(name=text[i:brace])
            reading.calls.append(call)
            call.arguments, end = _gemma_value(text, brace)
            if end < 0:
                return reading
            i = _skip(text, end)
            if not text.startswith(_GEMMA_END, i):
                return reading
            reading.complete = True
            i = _skip(text, i + len(_GEMMA_END))
        return reading


# Deeper nesting than this in a Gemma value is read no further (the reply stays text): the
# reader recurses, and a model's output must not exhaust Python's stack.
_GEMMA_DEPTH = 64


def _gemma_value(text: str, i: int, depth: int = 0) -> tuple[str, int]:
    """The JSON of the Gemma value at text[i] (after whitespace) and the index after it; while
    it is incomplete, the JSON of what is certain so far and -1 (an end that may begin a
    string's closing mark is held back)."""
    if depth > _GEMMA_DEPTH:
        return "", -1
    i = _skip(text, i)
    rest = text[i:]
    if rest.startswith(_GEMMA_QUOTE):
        start = i + len(_GEMMA_QUOTE)
        end = text.find(_GEMMA_QUOTE, start)
        if end < 0:
            raw = text[start:]
            return json.dumps(raw[: len(raw) - overlap(raw, _GEMMA_QUOTE)], ensure_ascii=False)[:-1], -1
        return json.dumps(text[start:end], ensure_ascii=False), end + len(_GEMMA_QUOTE)
    if not rest or _GEMMA_QUOTE.startswith(rest):
        return "", -1
    if rest[0] in "{[":
        return _gemma_container(text, i, depth)
    end = i
    while end < len(text) and text[end] not in ",}] \t\n\r":
        end += 1
    return text[i:end], end if end < len(text) else -1


def _gemma_container(text: str, i: int, depth: int) -> tuple[str, int]:
    """_gemma_value of the object or list at text[i]; a member goes out as its key comes
    (llama-server's streaming), a comma with the member after it."""
    keyed = text[i] == "{"
    close = "}" if keyed else "]"
    out, i, members = text[i], i + 1, 0
    while True:
        i = _skip(text, i)
        if i >= len(text):
            return out, -1
        if text[i] == close:
            return out + close, i + 1
        if members:
            if text[i] != ",":
                return out, -1
            i = _skip(text, i + 1)
        head = "," if members else ""
        if keyed:
            colon = i
            while colon < len(text) and text[colon] not in ":}":
                colon += 1
            if colon >= len(text):
                # A key still arriving goes out as far as it is (llama-server's reading too).
                return out + head + json.dumps(text[i:], ensure_ascii=False)[:-1], -1
            if text[colon] != ":":
                return out, -1
            head += json.dumps(text[i:colon], ensure_ascii=False) + ":"
            i = colon + 1
        value, end = _gemma_value(text, i, depth + 1)
        if end < 0:
            return out + head + value, -1
        out, i, members = out + head + value, end, members + 1


def _xml_value(raw: str, kinds: frozenset[str], *, string: bool) -> str:
    """A complete parameter value as JSON text (see _Xml; `string`: read as a string)."""
    if not string:
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw  # not JSON: its text (a reply the grammar did not hold)
        if not isinstance(value, str) and _admits(kinds, value):
            return raw.strip()
    return json.dumps(raw, ensure_ascii=False)


def _xml_partial(raw: str, kinds: frozenset[str], final: bool, close: str, *, string: bool) -> str:
    """What is certain of a value still arriving (or cut short, `final`): raw text as a JSON
    string without its closing quote, JSON text as written; nothing for a value that may be
    either until the reply ends. An end that may begin the `close` is not the value's
    (llama-server leaves it out of a cut reply too)."""
    raw = raw[: len(raw) - overlap(raw, close)]
    if string or (final and "string" in kinds):
        return _open_string(raw)
    if "string" in kinds:
        return ""
    return raw.rstrip()


def _open_string(raw: str) -> str:
    """A string value still arriving as JSON text without its closing quote; nothing before its
    first character (llama-server's reading writes the opening quote with it)."""
    return json.dumps(raw, ensure_ascii=False)[:-1] if raw else ""


def _admits(kinds: frozenset[str], value: Any) -> bool:
    kind = json_type(value)
    return kind in kinds or (kind == "integer" and "number" in kinds)


# DeepSeek R1 and its Qwen distill (written with the fullwidth bar on purpose): the calls'
# section, and in it per call the marker, the tool's name, "\n```json\n", the arguments
# object, "\n" and the call's end; a newline between two calls.
_R1_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_R1_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
_R1_CALL = "<\uff5ctool\u2581call\u2581begin\uff5c>function<\uff5ctool\u2581sep\uff5c>"
_R1_CALL_END = "```<\uff5ctool\u2581call\u2581end\uff5c>"

GENERIC: Syntax = _Generic()
GENERIC_ANSWER: Syntax = _GenericAnswer()
_NATIVE: dict[str, Syntax] = {
    "hermes": _Framed("hermes", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", "arguments"),
    "mistral": _Framed("mistral", "[TOOL_CALLS][", ", ", "]", "arguments", id_length=9),
    "mistral_args": _Named("mistral_args"),
    "mistral_call_id": _Named("mistral_call_id", id_marker="[CALL_ID]"),
    "llama3": _Framed("llama3", "", "", "", "parameters", one_call=True),
    "nemotron_v2": _json_list("nemotron_v2", "<TOOLCALL>", "</TOOLCALL>"),
    "apertus": _json_list("apertus", "<|tools_prefix|>", "<|tools_suffix|>", name_is_key=True),
    "qwen3_coder": _Xml("qwen3_coder"),
    "minicpm5": _MiniCpm5("minicpm5"),
    "gemma4": _Gemma("gemma4"),
    "gpt_oss": _Harmony(),
    "lfm2": _Pythonic("lfm2"),
    "deepseek_r1": _Named(
        "deepseek_r1", marker=_R1_CALL, args_marker="\n```json\n", start=_R1_CALLS, call_end=_R1_CALL_END,
        end=_R1_CALLS_END, between="\n",
    ),
}


def syntax_named(name: str) -> Syntax:
    """The syntax a backend's `tool_syntax()` names; generic for "" or a name edged cannot read."""
    return _NATIVE.get(name, GENERIC)


def _content(text: str, marker: str, final: bool, reading: Reading, *, strip: bool = True) -> int:
    """Set the content before the first `marker` (the calls' start) and return where the
    marker is; -1 without one (the content then holds back what may begin it, unless `final`).
    `strip`: without the whitespace that leads up to the marker."""
    at = text.find(marker)
    if at < 0:
        reading.content = text if final else _held_back(text, marker)
    else:
        reading.content = text[:at].rstrip() if strip else text[:at]
    return at


def _held_back(text: str, marker: str) -> str:
    """`text` without an end that may be the start of `marker`, nor whitespace before it."""
    return text[: len(text) - overlap(text, marker)].rstrip()


# --------------------------------------------------------------------------- partial JSON


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def _string_end(text: str, i: int) -> int:
    """Index after the closing quote of the string starting at text[i] (its quote: `"`, or `'`
    for a Python string); -1 if incomplete."""
    quote, j = text[i], i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == quote:
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


def _scan_call(text: str, i: int, call: Call, arguments_key: str) -> int:
    """Read a call object's members from text[i] (just after its "{") into `call`: its name
    once complete, its arguments' raw text as far as it goes. Index after the object's "}";
    -1 while it is incomplete."""
    while True:
        key, i = _key(text, i)
        if key is None or i >= len(text):
            return -1
        end = _value_end(text, i)
        if key == "name":
            if end < 0:
                return -1
            call.name = str(json.loads(text[i:end]))
        elif key == arguments_key:
            call.arguments = text[i:end] if end > 0 else text[i:]
            if end < 0:
                return -1
        elif end < 0:
            return -1
        i = _skip(text, end)
        if i < len(text) and text[i] == ",":
            i += 1
            continue
        if i < len(text) and text[i] == "}":
            return i + 1
        return -1


def _scan_keyed_call(text: str, i: int, call: Call) -> int:
    """Read a call object whose only key is the tool's name (Apertus: `{"NAME": {...}}`) from
    text[i] (just after its "{") into `call`: the name once its string is closed (llama-server
    names the call before the colon comes), the arguments' raw text as far as it goes. Index
    after the object's "}"; -1 while it is incomplete."""
    i = _skip(text, i)
    if not text.startswith('"', i):
        return -1
    end = _string_end(text, i)
    if end < 0:
        return -1
    call.name = str(json.loads(text[i:end]))
    i = _skip(text, end)
    if not text.startswith(":", i):
        return -1
    i = _skip(text, i + 1)
    if i >= len(text):
        return -1
    end = _value_end(text, i)
    if end < 0:
        call.arguments = _partial_arguments(text[i:])
        return -1
    call.arguments = text[i:end]
    i = _skip(text, end)
    return i + 1 if text.startswith("}", i) else -1


def _partial_arguments(raw: str) -> str:
    """Arguments still being written, as llama-server sends them: without the whitespace they
    end with, nor an escape still arriving (both may yet grow, so each reading is a prefix of
    the next)."""
    raw = raw.rstrip(" \t\n\r")
    escape = re.search(r"\\(u[0-9a-fA-F]{0,3})?$", raw)
    if escape:
        # An odd number of backslashes before the end: the last one opens an escape.
        slashes = len(raw[: escape.start() + 1]) - len(raw[: escape.start() + 1].rstrip("\\"))
        if slashes % 2:
            raw = raw[: escape.start()]
    return raw


def _scan_generic(text: str, raw_answer: bool = False) -> Reading:
    reading = Reading()
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "{":
        return reading
    key, i = _key(text, i + 1)
    if key == "response" and raw_answer:
        # The value's text so far: while it is incomplete, all of it is the value's (a
        # scalar's characters, or what lies inside its brackets or quotes).
        end = _value_end(text, i) if i < len(text) else -1
        reading.content = text[i:end] if end > 0 else text[i:]
        return reading
    if key == "response":
        if i < len(text) and text[i] == '"':
            end = _string_end(text, i)
            reading.content = str(json.loads(text[i:end])) if end > 0 else _partial_string(text, i)
        return reading
    if key != "tool_calls" or i >= len(text) or text[i] != "[":
        return reading
    i += 1
    while True:
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
        if i >= len(text) or text[i] != "{":
            return reading
        call = Call()
        reading.calls.append(call)
        i = _scan_call(text, i + 1, call, "arguments")
        if i < 0:
            return reading
