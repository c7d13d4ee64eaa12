"""OpenAI's Responses API (`POST /v1/responses`), stateless, on the chat machinery.

`input` (a string or message / function_call / function_call_output / reasoning items) and
`instructions` become chat messages and go through the model's chat template as
`/v1/chat/completions` would send them; function tools, `tool_choice`, `parallel_tool_calls`
and `text.format` (json_object, json_schema) use the chat route's grammar-enforced reply
(`openai_tools`). The output is OpenAI's items: a message with one `output_text` part, or one
`function_call` item per call, after a `reasoning` item with the reasoning of a thinking
model (split from the answer as the chat route's `reasoning_content`, `daemon.api.reasoning`;
its text in `content`, as open-weight servers return gpt-oss's). Streamed, it is OpenAI's
typed events (`event:` and `data:`, numbered by `sequence_number`), ending with
`response.completed`, `response.incomplete` (the output limit) or `response.failed`; no
`[DONE]`.

Nothing is stored: `store: true`, `previous_response_id`, `conversation` and `background`
are a 400 naming the field, as is every other field or item type not implemented here
(hosted tools, images, reasoning settings, encrypted reasoning); the client sends the whole
conversation in `input`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from aiohttp import web

from daemon.api import openai_tools, reasoning
from daemon.api.openai import (
    ChatMessage,
    JsonSchemaFormat,
    ResponseFormat,
    chat_messages,
    decode_with,
    effort_prompt,
    feed_chunks,
    first_chunk,
    generation_model,
    in_range,
    request_body,
    schema_of_format,
    start_sse,
    token_text,
)
from daemon.api.tool_syntax import GENERIC, Syntax, syntax_named
from daemon.backend import GenerateChunk, GenerateParams, TokenLogprob
from daemon.core.model import LoadedVersion
from daemon.errors import EdgedError, InvalidArgument, Unavailable

_json = msgspec.json.Encoder()
# The one `include` value with an effect here: log probabilities of the output text.
_LOGPROBS = "message.output_text.logprobs"


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class ContentPart(_Strict):
    # input_text in user/system turns; output_text where a client sends an earlier answer back.
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


Status = Literal["in_progress", "completed", "incomplete"]


class MessageItem(_Strict):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: Status | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: Status | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(_Strict):
    """A thinking model's reasoning as this server returned it (the client sends
    `response.output` back): the reasoning of the assistant turn after it."""

    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    # Only null: OpenAI's opaque reasoning, which this server never issues (_reasoning_of).
    encrypted_content: str | None = None
    id: str | None = None
    status: Status | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem

_ITEMS: dict[str, type[Any]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # The grammar enforces the schema either way.
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    # The chat template's `reasoning_effort` (gpt-oss's; openai.effort_prompt). The others only
    # null (_refuse_stateful): the reasoning comes whole, not summarized.
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # OpenAI's older name of `summary`


class StreamOptions(_Strict):
    # Random padding on delta events, so that their sizes do not reveal the text on the wire.
    include_obfuscation: bool | None = None


class ResponsesRequest(_Strict):
    model: str
    # Items are read one by one (`_item`): their kind is named by `type`, absent on the short
    # message form ({"role": ..., "content": ...}), which msgspec's tagged unions need.
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    # None: until the context is full, as the chat route.
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # Alternatives per output token (0..20), with include ["message.output_text.logprobs"].
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    # Returned with the response (OpenAI keeps it with the stored response; nothing is stored).
    metadata: dict[str, str] | None = None
    # End-user ids for abuse tracking at OpenAI; they change no output there either.
    user: str | None = None
    safety_identifier: str | None = None
    # A routing hint for OpenAI's prompt cache. Here every request goes to the slot holding the
    # longest common prefix of its prompt, which is what the key asks for.
    prompt_cache_key: str | None = None
    # Accepted only as "nothing stored / nothing dropped / no reasoning settings", each with
    # a 400 naming it otherwise (`_refuse_stateful`).
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: ReasoningConfig | None = None


_DECODER = msgspec.json.Decoder(ResponsesRequest)


def _refuse_stateful(req: ResponsesRequest) -> None:
    stateless = "responses are not stored here; send the whole conversation in input"
    if req.store:
        raise InvalidArgument(f"store: {stateless} (omit store or set it to false)")
    if req.previous_response_id is not None:
        raise InvalidArgument(f"previous_response_id: {stateless}")
    if req.conversation is not None:
        raise InvalidArgument(f"conversation: {stateless}")
    if req.background:
        raise InvalidArgument("background: not supported; responses are answered while the request waits")
    if req.truncation == "auto":
        raise InvalidArgument("truncation: only 'disabled' is supported (a prompt over the context is a 400)")
    if req.reasoning is not None:
        for field in ("summary", "generate_summary"):
            if getattr(req.reasoning, field) is not None:
                raise InvalidArgument(f"reasoning.{field}: not supported; a thinking model's reasoning comes whole "
                                      "as a reasoning item's content (omit it or send null)")


def _item(index: int, raw: dict[str, Any]) -> Item:
    kind = raw.get("type", "message")
    target = _ITEMS.get(kind) if isinstance(kind, str) else None
    if target is None:
        raise InvalidArgument(
            f"input[{index}].type: {kind!r} is not supported (message, function_call, function_call_output, reasoning)"
        )
    try:
        item: Item = msgspec.convert(raw, target)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"input[{index}]: {exc}") from None
    return item


def _reasoning_of(index: int, item: ReasoningItem) -> str:
    if item.encrypted_content is not None:
        raise InvalidArgument(f"input[{index}].encrypted_content: not supported; this server never issues encrypted "
                              "reasoning (send the reasoning text in content, as it was returned)")
    if item.summary:
        raise InvalidArgument(f"input[{index}].summary: not supported; this server never issues reasoning summaries "
                              "(send the reasoning text in content, as it was returned)")
    return "".join(part.text for part in item.content or [])


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The conversation as the chat route's messages: function calls join the assistant turn
    before them, their outputs are `tool` messages. A reasoning item is the
    `reasoning_content` of the assistant turn that follows it (a message or a function call,
    which then starts a turn of its own); with none right after it (a reply cut while it
    reasoned), it is an assistant turn of its own that said nothing."""
    out = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        if not req.input:
            raise InvalidArgument("input: required (a string or a list of items)")
        return [*out, ChatMessage(role="user", content=req.input)]
    if not req.input:
        raise InvalidArgument("input: at least one item is required")
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    for index, raw in enumerate(req.input):
        item = _item(index, raw)
        answers = isinstance(item, FunctionCallItem) or (isinstance(item, MessageItem) and item.role == "assistant")
        if thought is not None and not answers:
            out.append(ChatMessage(role="assistant", content="", reasoning_content=thought))
            thought = None
        if isinstance(item, ReasoningItem):
            thought = _reasoning_of(index, item)
        elif isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=_text(item.content), reasoning_content=thought))
            thought = None
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output)))
        else:
            try:
                json.loads(item.arguments)
            except ValueError:
                raise InvalidArgument(f"input[{index}].arguments: not valid JSON") from None
            call = openai_tools.ToolCall(
                id=item.call_id, type="function",
                function=openai_tools.FunctionCall(name=item.name, arguments=item.arguments),
            )
            if out and out[-1].role == "assistant" and thought is None:
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call], reasoning_content=thought))
            thought = None
    if thought is not None:
        out.append(ChatMessage(role="assistant", content="", reasoning_content=thought))
    return out


def _tools(req: ResponsesRequest) -> list[FunctionTool]:
    if req.tools is None:
        if req.tool_choice is not None:
            raise InvalidArgument("tool_choice: only allowed when tools are specified")
        if req.parallel_tool_calls is not None:
            raise InvalidArgument("parallel_tool_calls: only allowed when tools are specified")
        return []
    tools = []
    for index, raw in enumerate(req.tools):
        if raw.get("type") != "function":
            raise InvalidArgument(f"tools[{index}].type: {raw.get('type')!r} is not supported (only function tools)")
        try:
            tools.append(msgspec.convert(raw, FunctionTool))
        except msgspec.ValidationError as exc:
            raise InvalidArgument(f"tools[{index}]: {exc}") from None
    if not tools:
        raise InvalidArgument("tools: at least one tool is required (omit the field for none)")
    return tools


def _format(text: TextConfig | None) -> tuple[str, dict[str, Any]]:
    """The JSON schema text the output must match ("" for free text), and the format as echoed."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return "", {"type": "text"}
    if fmt.type != "json_schema":
        if fmt.name is not None or fmt.schema is not None or fmt.strict is not None or fmt.description is not None:
            raise InvalidArgument(f"text.format: name, schema, description and strict only with type 'json_schema', not {fmt.type!r}")
        return schema_of_format(ResponseFormat(type=fmt.type)), {"type": fmt.type}
    if fmt.name is None:
        raise InvalidArgument("text.format.name: required with type 'json_schema'")
    spec = JsonSchemaFormat(name=fmt.name, schema=fmt.schema, description=fmt.description, strict=fmt.strict)
    try:
        schema = schema_of_format(ResponseFormat(type="json_schema", json_schema=spec))
    except InvalidArgument as exc:
        raise InvalidArgument(f"text.format: {exc.message}") from None
    return schema, msgspec.to_builtins(fmt)


def _params(req: ResponsesRequest) -> GenerateParams:
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise InvalidArgument(f"max_output_tokens must be >= 1, got {req.max_output_tokens}")
    if req.stream_options is not None and not req.stream:
        raise InvalidArgument("stream_options: only allowed when stream is true")
    params = GenerateParams(max_tokens=req.max_output_tokens)
    if req.temperature is not None:
        in_range("temperature", req.temperature, 0.0, 2.0)
        params.temperature = req.temperature
        params.greedy = req.temperature == 0
    if req.top_p is not None:
        in_range("top_p", req.top_p, 0.0, 1.0)
        params.top_p = req.top_p
    unknown = [value for value in req.include or [] if value != _LOGPROBS]
    if unknown:
        raise InvalidArgument(f"include: {unknown[0]!r} is not supported (only {_LOGPROBS!r})")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise InvalidArgument(f"top_logprobs must be between 0 and 20, got {req.top_logprobs}")
    if _LOGPROBS in (req.include or []):
        params.logprobs = req.top_logprobs or 0
    elif req.top_logprobs:
        raise InvalidArgument(f"top_logprobs: requires include [{_LOGPROBS!r}]")
    return params


class _Output:
    """The response's output items as they form, and the stream events that say so.

    Fed the reply's pieces (`reasoning`, then `text` or a tool reply's deltas from
    `openai_tools.ToolStream`); the same object builds a whole response, so streamed and
    collected outputs are alike."""

    def __init__(self, logprobs: bool, streamed: bool) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._open = False
        self._logprobs = logprobs
        self._streamed = streamed  # whether the events are wanted

    def reasoning(self, piece: str) -> None:
        """More of the reasoning, in a reasoning item opened with the first piece (one
        `reasoning_text` part; no summary)."""
        if not (self._open and self.items[-1]["type"] == "reasoning"):
            self.close("completed")
            self._add({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "in_progress",
                       "summary": [], "content": [], "encrypted_content": None})
            self._part({"type": "reasoning_text", "text": ""})
        self.items[-1]["content"][0]["text"] += piece
        self._emit("response.reasoning_text.delta", self._where(content_index=0, delta=piece))

    def message(self) -> None:
        """Open a message item unless one is open (also for a reply with no text at all: the
        response then holds an empty message, as OpenAI's)."""
        if self._open and self.items[-1]["type"] == "message":
            return
        self.close("completed")
        self._add({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                   "role": "assistant", "content": []})
        self._part({"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def text(self, piece: str, entries: list[TokenLogprob]) -> None:
        self.message()
        part = self.items[-1]["content"][0]
        part["text"] += piece
        if self._logprobs:
            part["logprobs"].extend(_logprob(e, full=True) for e in entries)
        delta = [_logprob(e, full=False) for e in entries] if self._logprobs else []
        self._emit("response.output_text.delta", self._where(content_index=0, delta=piece, logprobs=delta))

    def call(self, call_id: str, name: str) -> None:
        self.close("completed")
        self._add({"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "status": "in_progress",
                   "arguments": "", "call_id": call_id, "name": name})

    def arguments(self, piece: str) -> None:
        self.items[-1]["arguments"] += piece
        self._emit("response.function_call_arguments.delta", self._where(delta=piece))

    def tool_deltas(self, deltas: list[dict[str, Any]]) -> None:
        """Chat deltas of a tool reply (`ToolStream.feed`) as output items."""
        for delta in deltas:
            if "content" in delta:
                self.text(delta["content"], [])
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    self.call(call["id"], call["function"]["name"])
                elif call["function"]["arguments"]:
                    self.arguments(call["function"]["arguments"])

    def close(self, status: str) -> None:
        """End the open item (`status`: completed, or incomplete when the output was cut)."""
        if not self._open:
            return
        self._open = False
        item = self.items[-1]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            self._emit("response.output_text.done",
                       self._where(content_index=0, text=part["text"], logprobs=part["logprobs"]))
            self._emit("response.content_part.done", self._where(content_index=0, part=dict(part)))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self._emit("response.reasoning_text.done", self._where(content_index=0, text=part["text"]))
            self._emit("response.content_part.done", self._where(content_index=0, part=dict(part)))
        else:
            self._emit("response.function_call_arguments.done",
                       self._where(arguments=item["arguments"], name=item["name"]))
        self._emit("response.output_item.done", {"output_index": len(self.items) - 1, "item": _copy(item)})

    def _add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._open = True
        self._emit("response.output_item.added", {"output_index": len(self.items) - 1, "item": _copy(item)})

    def _part(self, part: dict[str, Any]) -> None:
        self.items[-1]["content"].append(part)
        self._emit("response.content_part.added", self._where(content_index=0, part=dict(part)))

    def _where(self, **fields: Any) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, **fields}

    def _emit(self, kind: str, fields: dict[str, Any]) -> None:
        if self._streamed:
            self.events.append((kind, fields))


class _Thinking:
    """A thinking model's reply as it comes: its reasoning and its answer
    (`reasoning.ThinkingSplit`, as the chat route splits them), and which of its tokens were
    the reasoning's, for `usage` and the answer's logprobs.

    The reasoning's tokens run from the first (when the output or the prompt opens the
    reasoning) to the one that completes the closing tag. A chunk holds whole tokens
    (`token_ids`) and the engine sends one as soon as a token has text (no stop strings here
    to hold text back), so the token completing the tag ends a chunk and the count is exact;
    whitespace after the tag counts as the answer's."""

    def __init__(self, tags: tuple[str, str], opened: str | None, syntax: Syntax = GENERIC) -> None:
        self._split = syntax.thinking_split(tags, opened)
        self._tokens = 0  # of chunks not yet known to be reasoning or answer
        self._logprobs: list[TokenLogprob] = []
        self.tokens = 0

    def feed(self, chunk: GenerateChunk) -> tuple[str, str, list[TokenLogprob]]:
        """The reasoning and the answer `chunk` adds, and the logprobs of the answer's tokens
        whose text is out now (none of the reasoning's: they are not output text)."""
        # The chunk is the reasoning's when the reasoning was still open before it: the one
        # completing the closing tag is too.
        reasoning_open = not self._split.closed
        thought, answer = self._split.feed(chunk.text, chunk.finish_reason is not None)
        self._tokens += len(chunk.token_ids)
        self._logprobs += chunk.logprobs
        if self._split.began is None:
            return thought, answer, []
        if self._split.began and reasoning_open:
            self.tokens, self._tokens, self._logprobs = self.tokens + self._tokens, 0, []
            return thought, answer, []
        logprobs, self._tokens, self._logprobs = self._logprobs, 0, []
        # Text that went nowhere is the whitespace after the closing tag.
        return thought, answer, logprobs if answer or not chunk.text else []


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item for an event (the item itself keeps growing)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [
            dict(part, logprobs=list(part["logprobs"])) if "logprobs" in part else dict(part) for part in out["content"]
        ]
    return out


def _logprob(entry: TokenLogprob, *, full: bool) -> dict[str, Any]:
    """A token's log probability as output_text carries it (`full`: with bytes) or a delta event."""
    out: dict[str, Any] = {"token": token_text(entry), "logprob": entry.logprob}
    if full:
        out["bytes"] = list(entry.piece)
    out["top_logprobs"] = [
        {"token": token_text(t), "logprob": t.logprob, **({"bytes": list(t.piece)} if full else {})}
        for t in entry.top
    ]
    return out


@dataclass
class _Prompt:
    """What a Responses request generates from: the prompt and the params it was built with."""

    text: str
    params: GenerateParams
    text_format: dict[str, Any]
    syntax: str
    use: openai_tools.ToolUse | None


def _prompt(model: LoadedVersion, req: ResponsesRequest) -> _Prompt:
    """The request checked and its prompt rendered (the route's, and /input_tokens' count)."""
    _refuse_stateful(req)
    params = _params(req)
    params.json_schema, text_format = _format(req.text)
    tools = _tools(req)
    parallel = req.parallel_tool_calls is not False
    all_tools = [
        openai_tools.Tool(type="function", function=openai_tools.FunctionDef(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in tools
    ]
    chat_tools = [] if req.tool_choice == "none" else all_tools
    syntax = model.tool_syntax()
    messages = chat_messages(_messages(req), native_tools=bool(syntax))
    use = None
    if chat_tools:
        if params.logprobs is not None:
            raise InvalidArgument(f"include: {_LOGPROBS!r} is not supported together with tools")
        choice: openai_tools.ToolChoice | None = (
            openai_tools.NamedToolChoice(type="function", function=openai_tools.FunctionName(name=req.tool_choice.name))
            if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice
        )
        use = openai_tools.ToolUse(syntax, chat_tools, choice, parallel, params.json_schema)
        # With text.format: tool calls or an answer in the format (ToolUse.constrain).
        use.constrain(params, "text.format")
        messages = use.messages(messages)
    # With tool_choice "none" too (described_tools).
    described = openai_tools.described_tools(syntax, all_tools)
    effort = req.reasoning.effort if req.reasoning is not None else None
    prompt = effort_prompt(model, messages, described, None, effort, "reasoning.effort")
    return _Prompt(prompt, params, text_format, syntax, use)


async def input_tokens(request: web.Request) -> web.Response:
    """OpenAI's POST /v1/responses/input_tokens (and llama-server's): how many tokens the
    request's prompt is, as the model tokenizes what /v1/responses would generate from."""
    req = decode_with(_DECODER, await request_body(request))
    model = await generation_model(request, req.model)
    tokens = await model.tokenize(_prompt(model, req).text, add_special=True, parse_special=True)
    return web.json_response({"object": "response.input_tokens", "input_tokens": len(tokens)})


async def responses(request: web.Request) -> web.StreamResponse:
    req = decode_with(_DECODER, await request_body(request))
    model = await generation_model(request, req.model)
    built = _prompt(model, req)
    prompt, params, text_format, syntax, use = built.text, built.params, built.text_format, built.syntax, built.use
    tags = model.thinking_tags()
    opened = reasoning.opened_by(prompt, tags)
    reasoning.hold_grammar_after(params, tags, prompt)
    if params.json_schema:
        params.answer_header = syntax_named(syntax).answer_header
    thinking = _Thinking(tags, opened, syntax_named(syntax)) if tags[0] else None
    ident, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    output = _Output(logprobs=params.logprobs is not None, streamed=bool(req.stream))
    reply = use.stream() if use else None

    def feed(chunk: GenerateChunk) -> None:
        if chunk.finish_reason == "cancelled":
            # The model was unloaded or swapped past its drain timeout. "completed" would say
            # the model finished the reply: a 503, or response.failed once the stream began.
            raise Unavailable(f"the generation was cancelled: model '{model.name}' was unloaded while it ran")
        text, logprobs = chunk.text, chunk.logprobs
        if thinking is not None:
            thought, text, logprobs = thinking.feed(chunk)
            if thought:
                output.reasoning(thought)
        if reply is None:
            if text or logprobs:  # the last chunk may hold only an end token's logprob
                output.text(text, logprobs)
            return
        output.tool_deltas(reply.feed(text, chunk.finish_reason is not None))
        if (chunk.finish_reason is not None and not reply.calls_sent and not reply.sent_content
                and use is not None and not use.native):
            # Cut off before the reply object said anything: its raw text, as the chat route.
            content, _ = openai_tools.parse_reply(reply.text)
            if content:
                output.text(content, [])

    def body(status: str, last: GenerateChunk | None, error: EdgedError | None = None) -> dict[str, Any]:
        done = status != "in_progress"
        usage = None
        if last is not None and last.finish_reason is not None:
            usage = {
                "input_tokens": last.prompt_tokens,
                "input_tokens_details": {"cached_tokens": last.cached_tokens},
                "output_tokens": last.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": thinking.tokens if thinking else 0},
                "total_tokens": last.prompt_tokens + last.completion_tokens,
            }
        return {
            "id": ident, "object": "response", "created_at": created, "status": status,
            "completed_at": int(time.time()) if done else None,
            "error": None if error is None else {
                "code": "server_error" if error.status >= 500 else "invalid_prompt", "message": error.message,
            },
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "model": model.name,
            "output": [_copy(item) for item in output.items] if done else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None,
            "store": False, "background": False, "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": text_format}, "tool_choice": msgspec.to_builtins(req.tool_choice or "auto"),
            "tools": [msgspec.to_builtins(t) for t in _tools(req)], "top_logprobs": req.top_logprobs or 0,
            "truncation": "disabled", "usage": usage, "user": req.user,
            "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
        }

    def finish(last: GenerateChunk) -> str:
        cut = last.finish_reason == "length"
        # A reply cut (or ended) while it reasoned is its reasoning item alone, as OpenAI's.
        if not output.items:
            output.message()
        output.close("incomplete" if cut else "completed")
        return "incomplete" if cut else "completed"

    chunks = model.generate(prompt, params)
    async with contextlib.aclosing(chunks):
        # Before the status: a full queue or a prompt over the context is a real 4xx/5xx.
        first = await first_chunk(chunks)
        if not req.stream:
            # Chunk by chunk, as streamed: each holds its tokens' count for the reasoning's.
            last = await feed_chunks(first, chunks, feed)
            return web.Response(body=_json.encode(body(finish(last), last)), content_type="application/json")
        obfuscate = bool(req.stream_options and req.stream_options.include_obfuscation)
        sequence = 0
        response = await start_sse(request)

        async def send(kind: str, fields: dict[str, Any]) -> None:
            nonlocal sequence
            payload = {"type": kind, "sequence_number": sequence, **fields}
            if obfuscate and kind.endswith(".delta"):
                payload["obfuscation"] = secrets.token_urlsafe(12)
            sequence += 1
            await response.write(b"event: " + kind.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n")

        async def flush() -> None:
            events, output.events = output.events, []
            for kind, fields in events:
                await send(kind, fields)

        await send("response.created", {"response": body("in_progress", None)})
        await send("response.in_progress", {"response": body("in_progress", None)})
        try:
            last = await feed_chunks(first, chunks, feed, flush)
        except EdgedError as exc:
            # The 200 went out with the first event: the failure is the stream's last event.
            output.close("incomplete")
            await flush()
            await send("response.failed", {"response": body("failed", None, exc)})
            await response.write_eof()
            return response
        status = finish(last)
        await flush()
        await send(f"response.{status}", {"response": body(status, last)})
        await response.write_eof()
        return response


def add_routes(app: web.Application) -> None:
    for prefix in ("/v1", ""):  # llama-server's paths without /v1/ too
        app.router.add_post(prefix + "/responses", responses)
        app.router.add_post(prefix + "/responses/input_tokens", input_tokens)

