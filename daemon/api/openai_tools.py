"""OpenAI tool calling on any chat model: in the model's own syntax, or a generic JSON reply.

`ToolUse` is one request's tool calling, shared by the chat, Responses and Ollama routes.
Where the model's chat template has a tool syntax edged reads (the backend's `tool_syntax()`;
`tool_syntax` reads it), the tools go to the template, the engine enforces that syntax's
frame (lazily for `auto`), and earlier calls and tool results go back to the template as
they are, as llama-server does. Otherwise the generic format (llama-server's fallback): the
model is told about the tools in a system message and answers with one JSON object:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}   or
    {"response": "plain answer"}

A grammar built from the tools' parameter schemas enforces that object, so the output always
parses: `auto` allows either form, `required` only tool calls, a named tool only calls to it;
`parallel_tool_calls: false` allows one call. Earlier turns go back through the chat template
in the same form: an assistant's `tool_calls` as that JSON, a `tool` message as a user
message holding {"tool_response": {...}}.

Streamed, either reply becomes OpenAI deltas as it is generated (`ToolStream`): content as it
grows; a call's id and name, then its arguments in pieces. The Ollama routes shape calls their
own way (arguments as objects, each call whole: `ToolUse.reply_calls`)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec

from daemon.api.reasoning import overlap
from daemon.api.tool_syntax import GENERIC, GENERIC_ANSWER, Reading, Syntax, syntax_named
from daemon.backend import GenerateParams
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


def tool_schema(tools: list[Tool], choice: ToolChoice | None, parallel: bool, answer: str = "") -> str:
    """The JSON schema (text) of the reply object for these tools and this choice; `answer`
    (a JSON schema, text: the response format) is what "response" holds instead of a string."""
    tools = _chosen(tools, choice)
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
        reply: dict[str, Any] = {"anyOf": [with_calls, {
            "type": "object", "properties": {"response": {"type": "string"}},
            "required": ["response"], "additionalProperties": False,
        }]}
        if answer:
            # The format's schema as a definition of the reply's, a document of its own (its
            # local references mean its own root).
            reply["anyOf"][1]["properties"]["response"] = {"$ref": f"#/$defs/{_ANSWER}"}
            reply["$defs"] = {_ANSWER: own_document(json.loads(answer), "answer")}
        return json.dumps(reply)
    return json.dumps(with_calls)


# The name of the response format's schema among the generic reply's definitions.
_ANSWER = "edged-answer"
def own_document(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """`schema` as a JSON Schema resource of its own (an `$id`), for embedding in a larger
    one: its local `$ref`s then still mean its own root and definitions (ToolCallFrame)."""
    if isinstance(schema.get("$id"), str) and not schema["$id"].startswith("#"):
        return schema
    return {"$id": f"edged:{name}", **schema}


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": _embedded_parameters(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def system_prompt(tools: list[Tool], parallel: bool, answer: str = "") -> str:
    """The generic reply's instructions; `answer`: the response format's schema (JSON text),
    which a direct answer's "response" holds to (the grammar enforces it: the model is told)."""
    described = [
        {k: v for k, v in msgspec.to_builtins(t.function).items() if k != "strict"} for t in tools
    ]
    many = "one or more tool calls" if parallel else "one tool call"
    direct = (
        f'{{"response": ...}} to answer directly, "response" being a JSON value matching this schema: {answer}'
        if answer else '{"response": "..."} to answer directly.'
    )
    return (
        "You can use these tools:\n"
        + json.dumps(described, ensure_ascii=False)
        + f'\n\nAnswer with one JSON object: {{"tool_calls": [{{"name": ..., "arguments": {{...}}}}]}} '
        f"for {many}, or {direct}"
    )


def with_tools(
    messages: list[dict[str, str]], tools: list[Tool], parallel: bool, answer: str = ""
) -> list[dict[str, str]]:
    """Messages with the tools' description in the (first) system message."""
    text = system_prompt(tools, parallel, answer)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = first["content"] + "\n\n" + text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def decoded_calls(calls: list[ToolCall], index: int) -> list[tuple[str, Any]]:
    """An earlier assistant turn's (messages[index]) tool calls as (name, arguments object);
    arguments that are not JSON are an InvalidArgument naming them."""
    out = []
    for i, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            raise InvalidArgument(
                f"messages[{index}].tool_calls[{i}].function.arguments: not valid JSON"
            ) from None
        out.append((call.function.name, arguments))
    return out


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
    return content, [openai_call(GENERIC.call_id(), name, json.dumps(arguments, ensure_ascii=False))
                     for name, arguments in calls]


def openai_call(ident: str, name: str, arguments: str) -> dict[str, Any]:
    """A tool call in OpenAI's shape (`arguments`: JSON text), as replies carry them and as
    chat templates with a tool syntax take them back."""
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}}


def cut_reply(text: str, syntax: Syntax = GENERIC) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a reply cut off before it was complete (max_tokens):
    what streaming it sent, so that both answers agree (OpenAI's too, which returns a call cut
    short with its partial arguments and finish_reason "length"): the answer so far, or the
    calls whose name is complete with their arguments so far; the raw text when the reply
    said nothing yet."""
    text = syntax.reply_text(text)
    return _calls_read(text, syntax.read(text, final=True), syntax)


def _calls_read(text: str, reading: Reading, syntax: Syntax) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of `reading`, `syntax`'s reading of the whole `text`."""
    calls = [openai_call(syntax.call_id(), call.name, call.arguments)
             for call in reading.calls if call.name is not None]
    if calls:
        return reading.content or None, calls
    if syntax.native:
        # A call begun but not named yet: the raw text, as its stream ends (ToolStream).
        return text, []
    return (reading.content, []) if reading.content else (text, [])


# --------------------------------------------------------------------------- one request


class ToolUse:
    """One request's tool calling, in the model's own syntax where its template has one
    (`tool_syntax.syntax_named`), else in the generic JSON reply: what the template is given,
    what the engine enforces, and how the reply is read."""

    def __init__(
        self, syntax_name: str, tools: list[Tool], choice: ToolChoice | None, parallel: bool, answer: str = ""
    ) -> None:
        self.syntax = syntax_named(syntax_name).for_tools({t.function.name: _parameters(t) for t in tools})
        self.tools = tools
        self.choice = choice
        self.parallel = parallel
        # The response format's schema (JSON text, "" none) a direct answer holds to with
        # `auto` (constrain): the generic reply's instructions say so.
        self.answer = answer if choice is None or choice == "auto" else ""
        # Whether the reply may be an answer in a response format instead of calls (constrain).
        self.answers = False

    @property
    def native(self) -> bool:
        return self.syntax.native

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for a template that describes them itself (None for the generic reply)."""
        return described_tools(self.syntax.name, self.tools)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the template gets it: the generic reply's description of the
        tools goes into the system message; a native template describes them itself."""
        return messages if self.native else with_tools(messages, self.tools, self.parallel, self.answer)

    def constrain(
        self, params: GenerateParams, format_field: str = "response_format", unsplit: tuple[str, str] = ("", "")
    ) -> None:
        """What the engine enforces: the generic reply's schema, or the native frame (lazy for
        `auto`: the model may answer in text instead).

        A response format already in `params.json_schema` (the request's `format_field`):
        with `auto` the model calls tools or answers with a JSON value matching it (OpenAI's
        semantics): the generic reply's "response" holds that value, or the output is the
        native frame or that value (one grammar, not lazy: its first token starts either).
        With `required` or a named tool the turn is a call and has no content, so the format
        has nothing to apply to (as at OpenAI); it applies to a later turn's answer.

        `unsplit`: the model's reasoning tags where the reply is read with its reasoning left in
        (`reasoning_format: none`), which the calls or the answer then follow."""
        answer, params.json_schema = params.json_schema, ""
        auto = self.choice is None or self.choice == "auto"
        self.answers = bool(answer) and auto
        if not self.native:
            params.json_schema = tool_schema(self.tools, self.choice, self.parallel, answer if auto else "")
            if self.answers:
                self.syntax = GENERIC_ANSWER
            return
        tools = _chosen(self.tools, self.choice)
        calls = [self.syntax.call_schema(t.function.name, _embedded_parameters(t)) for t in tools]
        frame = self.syntax.frame(calls, lazy=auto and not self.answers, parallel=self.parallel)
        if self.answers:
            if not frame.open:
                # Llama 3.x: a call is a bare JSON object, as the answer may be; neither the
                # grammar's first token nor the reader could tell which one the model began.
                raise InvalidArgument(
                    f"{format_field}: cannot be combined with tools for this model: its tool calls "
                    "are bare JSON objects, which an answer in the format could not be told from"
                )
            params.json_schema = answer
            self.syntax = _CallsOrAnswer(self.syntax, frame.open, self.syntax.shown_reasoning(unsplit))
        params.tool_calls = frame

    def stream(self) -> ToolStream:
        return ToolStream(self.syntax)

    def reply(self, text: str, cut: bool) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool_calls) of a whole reply; `cut`: it ended at max_tokens."""
        if cut:
            return cut_reply(text, self.syntax)
        if not self.native:
            if self.answers and (content := self.syntax.read(text, final=True).content) is not None:
                return content, []
            return parse_reply(text)
        text = self.syntax.reply_text(text)
        reading = self.syntax.read(text, final=True)
        if not reading.complete:
            # No call, or a frame the grammar did not hold (a token ran past the trigger):
            # the text as it is.
            return text, []
        return _calls_read(text, reading, self.syntax)

    def reply_calls(self, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
        """(content, [(name, arguments object)]) of a whole reply (Ollama's shape); calls
        whose arguments are not complete JSON are left out (the reply was cut short)."""
        if not self.native:
            if self.answers and (content := self.syntax.read(text, final=True).content) is not None:
                return content or None, []
            return reply_calls(text)
        reading = self.syntax.read(self.syntax.reply_text(text), final=True)
        calls = []
        for call in reading.calls:
            try:  # a call cut short (max_tokens) has no complete arguments: left out
                calls.append((str(call.name), json.loads(call.arguments)))
            except ValueError:
                continue
        return reading.content or None, calls


class _CallsOrAnswer(Syntax):
    """A native syntax whose reply is either its calls (`open`, the frame the grammar holds it
    to) or an answer in the response format (a JSON value, ToolUse.constrain): read as that
    syntax reads it when it opens with `open`, else all of it is the answer (whatever the
    answer's strings hold: a call marker quoted in it starts no call).

    `reasoning`: the opening and closing tags of reasoning the reply shows first (unsplit,
    `reasoning_format: none`): the calls or the answer begin after a closing tag, as the
    grammar lets the model reason before either; ("", "") when the reasoning is split off."""

    def __init__(self, calls: Syntax, open: str, reasoning: tuple[str, str] = ("", "")) -> None:
        self.calls, self.open, self.name = calls, open, calls.name
        self.reasoning = reasoning

    def read(self, text: str, final: bool) -> Reading:
        start = text.lstrip()
        opening = self.reasoning[0]
        if opening and start.startswith(opening):
            return self._after_reasoning(text, len(text) - len(start) + len(opening), final)
        if start.startswith(self.open):
            return self.calls.read(text, final)
        if not final and self.open.startswith(start):
            return Reading(content="")  # it may still turn into the calls' opening
        return Reading(content=text, complete=True)

    def _after_reasoning(self, text: str, at: int, final: bool) -> Reading:
        """`read` of a reply that shows its reasoning first (from text[at] on, after its opening
        tag): calls where a closing tag is followed by `open`; the reasoning may hold a closing
        tag of its own (gpt-oss's `<|end|>`, shown without the `<|start|>assistant` that really
        closes it), so each is tried."""
        closing = self.reasoning[1]
        end = text.find(closing, at)
        while end >= 0:
            rest = text[end + len(closing):].lstrip()
            if rest.startswith(self.open):
                return self.calls.read(text, final)
            if not final and self.open.startswith(rest):
                return Reading(content=text[:end])  # it may still turn into the calls' opening
            end = text.find(closing, end + 1)
        # The reasoning so far, or the answer after it; what may begin a closing tag held back.
        held = 0 if final else overlap(text, closing)
        return Reading(content=text[: len(text) - held], complete=True)

    def reply_text(self, text: str) -> str:
        return self.calls.reply_text(text)

    def call_id(self) -> str:
        return self.calls.call_id()


def described_tools(syntax_name: str, tools: list[Tool]) -> list[dict[str, Any]] | None:
    """The tools for the template when it has its own tool syntax, else None. Also with
    tool_choice "none": the template still describes them (OpenAI and llama-server do; the
    prompt is that of "auto", so a tool loop's last turn keeps its prompt prefix), and
    nothing is enforced: the reply is text."""
    if not tools or not syntax_named(syntax_name).native:
        return None
    return [msgspec.to_builtins(t) for t in tools]


# OpenAI's rule for function names, plus "." and ":" (namespaced names, e.g. MCP tools behind
# Ollama, which checks nothing). A name is written into the grammar and the model's prompt;
# quotes, spaces, newlines or markup in it would break either.
_NAME = re.compile(r"[a-zA-Z0-9_.:-]{1,64}")


def check_names(tools: list[Tool]) -> list[str]:
    """The tools' names, each as OpenAI allows and all different (else InvalidArgument)."""
    names = [t.function.name for t in tools]
    for index, name in enumerate(names):
        if not _NAME.fullmatch(name):
            raise InvalidArgument(
                f"tools[{index}].function.name: {name!r} must be 1 to 64 letters, digits, "
                "underscores, dashes, dots or colons"
            )
    if len(set(names)) != len(names):
        raise InvalidArgument("tools: function names must be unique")
    return names


def _chosen(tools: list[Tool], choice: ToolChoice | None) -> list[Tool]:
    check_names(tools)
    if not isinstance(choice, NamedToolChoice):
        return tools
    chosen = [t for t in tools if t.function.name == choice.function.name]
    if not chosen:
        raise InvalidArgument(f"tool_choice: no tool named {choice.function.name!r} in tools")
    return chosen


def _parameters(tool: Tool) -> dict[str, Any]:
    if tool.function.parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return tool.function.parameters


def _embedded_parameters(tool: Tool) -> dict[str, Any]:
    """The parameters as a call's schema holds them: a document of their own."""
    return own_document(_parameters(tool), f"tool/{tool.function.name}")


# --------------------------------------------------------------------------- streaming


class ToolStream:
    """Turns the growing reply into OpenAI stream deltas as it is generated.

    Each call re-reads the whole text (`Syntax.read`) and sends what is new: content as it
    grows, a call's id and name once its name is complete, its arguments as they grow.
    `final`: the reply is complete; content held back (what might have begun a call) goes out.
    """

    def __init__(self, syntax: Syntax = GENERIC) -> None:
        self._syntax = syntax
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

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """Deltas (OpenAI `delta` objects) for the text added since the last call."""
        self._text += text
        # What is read (Syntax.reply_text: a prefix of the reply reads as a prefix of it).
        view = self._syntax.reply_text(self._text)
        reading = self._syntax.read(view, final)
        deltas: list[dict[str, Any]] = []
        if reading.content is not None and len(reading.content) > self._content:
            deltas.append({"content": reading.content[self._content :]})
            self._content = len(reading.content)
        for index, call in enumerate(reading.calls):
            if call.name is None:
                break
            if index == len(self._calls):
                ident = self._syntax.call_id()
                self._calls.append((ident, 0))
                deltas.append({"tool_calls": [{
                    "index": index, "id": ident, "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }]})
            ident, sent = self._calls[index]
            if len(call.arguments) > sent:
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments[sent:]}}]})
                self._calls[index] = (ident, len(call.arguments))
        if final and self._syntax.native and not self._calls and len(view) > self._content:
            # The reply ended inside a call marker or an unnamed call (cut short, or a frame the
            # grammar did not hold): the rest of the text goes out as content, as unstreamed.
            deltas.append({"content": view[self._content :]})
            self._content = len(view)
        return deltas
