"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as
llama-server serves it for Claude-Code-style clients, on the chat machinery.

A request is turned into the chat route's conversation (`daemon.api.openai.ChatRequest`) and
goes through the model's chat template as `/v1/chat/completions` would send it, so the same
conversation gives the same prompt, token for token: `system` is a system message first;
a user turn's `tool_result` blocks are `tool` messages (in block order with its text), an
assistant turn's `tool_use` blocks its `tool_calls` and its `thinking` blocks its
`reasoning_content`. Tools, `tool_choice` and `output_config.format` are the chat route's
grammar-enforced reply in the model's own syntax (`openai_tools`), a thinking model's
reasoning is split from its answer as the chat route's `reasoning_content`
(`daemon.api.reasoning`), and `thinking.budget_tokens` is llama-server's reasoning budget.

The reply is Anthropic's message: content blocks `thinking` (signature ""), `text`, `tool_use`
(`input` an object), `stop_reason` end_turn | max_tokens | stop_sequence | tool_use |
model_context_window_exceeded, and `usage` with Anthropic's split of the prompt:
`input_tokens` evaluated, `cache_read_input_tokens` served from the prompt cache. Streamed, it
is Anthropic's SSE events (`event:` and `data:` lines): message_start, ping, per block
content_block_start / content_block_delta (text_delta, thinking_delta, signature_delta,
input_json_delta) / content_block_stop, message_delta and message_stop; an error after the
200 is an `error` event. One path builds both, so a streamed reply adds up to the whole one.

Every field either has its effect or is a 400 naming it; errors are Anthropic's
`{"type": "error", "error": {"type": ..., "message": ...}}` (daemon.api.errors).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from aiohttp import web

from daemon.api import openai_tools, reasoning, sampling
from daemon.api.errors import error_body
from daemon.api.openai import (
    ChatMessage,
    ChatRequest,
    chat_prompt,
    decode_with,
    feed_chunks,
    first_chunk,
    generation_model,
    in_range,
    request_body,
    start_sse,
)
from daemon.api.tool_syntax import syntax_named
from daemon.backend import GenerateChunk, GenerateParams
from daemon.core.model import LoadedVersion
from daemon.errors import EdgedError, InvalidArgument, Unavailable

_json = msgspec.json.Encoder()


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class CacheControl(_Strict):
    """A prompt-cache breakpoint. Accepted and without effect: every request here already
    reuses the longest prefix of its prompt that a slot (or the host-RAM prefix store) holds."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    # Only null or empty: this server never issues citations.
    citations: list[Any] | None = None


class ThinkingBlock(_Strict):
    """An assistant turn's reasoning as this server returned it: back to the template as the
    turn's `reasoning_content`. The signature is not checked (this server signs nothing)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    # A string or text blocks (joined by newlines); images are a 400 (no vision here).
    content: str | list[dict[str, Any]] = ""
    # Accepted; the result's text is what the model sees (a tool's error says so itself).
    is_error: bool | None = None
    cache_control: CacheControl | None = None


_BLOCKS: dict[str, dict[str, type[Any]]] = {
    "user": {"text": TextBlock, "tool_result": ToolResultBlock},
    "assistant": {"text": TextBlock, "thinking": ThinkingBlock, "tool_use": ToolUseBlock},
}


class Message(_Strict):
    role: str
    # A string, or content blocks read one by one (`_blocks`): what each type allows per role.
    content: str | list[dict[str, Any]]


class Tool(_Strict):
    name: str
    # Required (`_tools`): checked after `type`, so that a server tool is named as such.
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    # Only "custom" (a client tool): Anthropic's server and versioned tools (web_search,
    # bash, text_editor, ...) are a 400.
    type: str | None = None
    cache_control: CacheControl | None = None
    # The grammar enforces the schema either way.
    strict: bool | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    """`enabled` (with `budget_tokens`) and `adaptive`: a thinking model thinks, as it does
    unasked; `disabled`: its template is told not to (`enable_thinking: false`) and any
    reasoning it writes anyway is left out."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    # "omitted": thinking blocks come with their text left out.
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(_Strict):
    # The chat template's `reasoning_effort` (gpt-oss's), as chat's reasoning_effort.
    effort: str | None = None
    format: OutputFormat | None = None


class Metadata(_Strict):
    # An end-user id for abuse tracking at Anthropic; it changes no output there either.
    user_id: str | None = None


class CountTokensRequest(_Strict, kw_only=True):
    """What shapes the prompt: all `/v1/messages/count_tokens` takes."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: Metadata | None = None


_DECODE_MESSAGES = msgspec.json.Decoder(MessagesRequest)
_DECODE_COUNT = msgspec.json.Decoder(CountTokensRequest)
# Anthropic's least budget for thinking.
_MIN_BUDGET = 1024
# Claude Code's first system block carries a stamp that changes with every request
# ("x-anthropic-billing-header: ...; cch=a5145;"): made constant, as llama-server does, so that
# the prompt cache reaches past it.
_BILLING = re.compile(r"^(x-anthropic-billing-header:[^\n]*?\bcch=)[0-9a-fA-F]{5};")
# The engine's 400 for a prompt over the context (backends/llamacpp/engine.py), which Anthropic
# words "prompt is too long: N tokens > M maximum": clients match that (Claude Code compacts
# the conversation on it).
_TOO_LONG = re.compile(r"prompt is (\d+) tokens but model '[^']*' has a context of (\d+) tokens")


def _block(index: int, at: int, role: str, raw: dict[str, Any]) -> Any:
    kind = raw.get("type")
    allowed = _BLOCKS.get(role, {})
    target = allowed.get(kind) if isinstance(kind, str) else None
    if target is None:
        why = ("images are not supported (the model has no vision here)" if kind in ("image", "document")
               else f"is not supported in {role} messages ({', '.join(allowed)})")
        raise InvalidArgument(f"messages[{index}].content[{at}].type: {kind!r} {why}")
    try:
        block = msgspec.convert(raw, target)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"messages[{index}].content[{at}]: {exc}") from None
    if isinstance(block, TextBlock) and block.citations:
        raise InvalidArgument(f"messages[{index}].content[{at}].citations: not supported (only null or empty)")
    return block


def _result_text(index: int, at: int, block: ToolResultBlock) -> str:
    if isinstance(block.content, str):
        return block.content
    texts = []
    for i, part in enumerate(block.content):
        if part.get("type") != "text":
            raise InvalidArgument(f"messages[{index}].content[{at}].content[{i}].type: {part.get('type')!r} is "
                                  "not supported (only text blocks; the model has no vision here)")
        try:
            text = msgspec.convert(part, TextBlock)
        except msgspec.ValidationError as exc:
            raise InvalidArgument(f"messages[{index}].content[{at}].content[{i}]: {exc}") from None
        if text.citations:
            raise InvalidArgument(f"messages[{index}].content[{at}].content[{i}].citations: not supported (only null or empty)")
        texts.append(text.text)
    return "\n".join(texts)


def _system(system: str | list[TextBlock] | None) -> str:
    """The system prompt: its text blocks joined by newlines (llama-server joins them with
    nothing between)."""
    if isinstance(system, list) and any(block.citations for block in system):
        raise InvalidArgument("system: citations are not supported (only null or empty)")
    texts = [system] if isinstance(system, str) else [block.text for block in system or []]
    return "\n".join(_BILLING.sub(r"\1fffff;", text) for text in texts)


def _messages(req: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as the chat route's messages. Consecutive turns of one role are one
    turn, as Anthropic combines them. Text blocks of a turn are joined by newlines (as
    llama-server joins content parts); a user turn's tool results are `tool` messages, in
    their place among its text; an assistant turn's thinking, text and tool calls are one
    assistant message."""
    out: list[ChatMessage] = []
    system = _system(req.system)
    if system:
        out.append(ChatMessage(role="system", content=system))
    if not req.messages:
        raise InvalidArgument("messages: at least one message is required")
    turns: list[tuple[str, list[tuple[int, int, Any]]]] = []
    for index, message in enumerate(req.messages):
        if message.role not in ("user", "assistant"):
            raise InvalidArgument(f"messages[{index}].role: {message.role!r} is not one of user, assistant "
                                  "(the system prompt goes in the top-level system field)")
        raw = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        blocks = [(index, at, _block(index, at, message.role, b)) for at, b in enumerate(raw)]
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message.role, blocks))
    if turns[-1][0] == "assistant":
        raise InvalidArgument(
            "messages: the last message must be a user message (prefilling the assistant's reply is not supported)"
        )
    for role, blocks in turns:
        if role == "assistant":
            out.append(_assistant(blocks))
            continue
        texts: list[str] = []
        for index, at, block in blocks:
            if isinstance(block, ToolResultBlock):
                if texts:
                    out.append(ChatMessage(role="user", content="\n".join(texts)))
                    texts = []
                out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                       content=_result_text(index, at, block)))
            else:
                texts.append(block.text)
        if texts or not blocks:
            out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _assistant(blocks: list[tuple[int, int, Any]]) -> ChatMessage:
    texts, thoughts, calls = [], [], []
    for _, _, block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        else:
            calls.append(openai_tools.ToolCall(
                id=block.id, type="function",
                function=openai_tools.FunctionCall(name=block.name, arguments=json.dumps(block.input, ensure_ascii=False)),
            ))
    return ChatMessage(
        role="assistant", content="\n".join(texts) if texts or not calls else None,
        tool_calls=calls or None, reasoning_content="\n".join(thoughts) if thoughts else None,
    )


def _tools(req: CountTokensRequest) -> tuple[list[openai_tools.Tool] | None, openai_tools.ToolChoice | None, bool | None]:
    """The chat route's tools, tool_choice and parallel_tool_calls."""
    tools = []
    for index, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise InvalidArgument(f"tools[{index}].type: {tool.type!r} is not supported (only custom tools, "
                                  "with name, description and input_schema)")
        if tool.input_schema is None:
            raise InvalidArgument(f"tools[{index}].input_schema: required")
        if (kind := tool.input_schema.get("type")) != "object":
            # Anthropic's rule, and the reply's: a call's `input` is an object, so a call the
            # schema lets be anything else could only be dropped from the reply.
            raise InvalidArgument(f"tools[{index}].input_schema.type: must be 'object', got {kind!r}")
        tools.append(openai_tools.Tool(type="function", function=openai_tools.FunctionDef(
            name=tool.name, description=tool.description, parameters=tool.input_schema)))
    try:
        openai_tools.check_names(tools)
    except InvalidArgument as exc:
        raise InvalidArgument(exc.message.replace(".function.name", ".name")) from None
    choice = req.tool_choice
    if choice is not None:
        if choice.name is not None and choice.type != "tool":
            raise InvalidArgument(f"tool_choice.name: only with type 'tool', not {choice.type!r}")
        if choice.type == "none" and choice.disable_parallel_tool_use is not None:
            raise InvalidArgument("tool_choice.disable_parallel_tool_use: not with type 'none'")
    if not tools:
        # No tools (or an empty list, which Anthropic takes): "auto" and "none" change nothing.
        if choice is not None and choice.type in ("any", "tool"):
            raise InvalidArgument(f"tool_choice: type {choice.type!r} needs tools")
        return None, None, None
    parallel = None if choice is None or choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    if choice is None or choice.type == "auto":
        return tools, None if choice is None else "auto", parallel
    if choice.type == "none":
        return tools, "none", None
    if choice.type == "any":
        return tools, "required", parallel
    if choice.name is None:
        raise InvalidArgument("tool_choice.name: required with type 'tool'")
    named = openai_tools.NamedToolChoice(type="function", function=openai_tools.FunctionName(name=choice.name))
    return tools, named, parallel


@dataclass
class _Prompt:
    text: str
    syntax: str
    use: openai_tools.ToolUse | None
    schema: str  # output_config.format's schema (JSON text), "" for none
    hidden: bool  # thinking disabled: reasoning the model writes anyway is left out
    omitted: bool  # thinking.display "omitted": thinking blocks without their text
    budget: int | None


def _prompt(model: LoadedVersion, req: CountTokensRequest, max_tokens: int | None = None) -> _Prompt:
    """The request checked and its prompt rendered (the route's, and count_tokens')."""
    thinking = req.thinking
    budget = None
    tags = model.thinking_tags()
    if thinking is not None:
        if thinking.type == "enabled" and not tags[0]:
            # Anthropic's answer for a model without extended thinking too: accepted, the
            # request would get no thinking while asking for it.
            raise InvalidArgument(
                f"thinking: model '{model.name}' does not think (its chat template has no reasoning); "
                "leave thinking out, or set it to disabled or adaptive"
            )
        if thinking.type == "enabled":
            if thinking.budget_tokens is None:
                raise InvalidArgument("thinking.budget_tokens: required with type 'enabled'")
            if thinking.budget_tokens < _MIN_BUDGET:
                raise InvalidArgument(f"thinking.budget_tokens: must be >= {_MIN_BUDGET}, got {thinking.budget_tokens}")
            if thinking.budget_tokens > reasoning.MAX_BUDGET:
                # Checked here, so that the 400 names this field rather than the chat route's.
                raise InvalidArgument(f"thinking.budget_tokens: must be between {_MIN_BUDGET} and {reasoning.MAX_BUDGET}, "
                                      f"got {thinking.budget_tokens}")
            if max_tokens is not None and not max_tokens > thinking.budget_tokens:
                raise InvalidArgument(f"max_tokens: must be greater than thinking.budget_tokens "
                                      f"({thinking.budget_tokens}), got {max_tokens}")
            budget = thinking.budget_tokens
        elif thinking.budget_tokens is not None:
            raise InvalidArgument(f"thinking.budget_tokens: only with type 'enabled', not {thinking.type!r}")
        if thinking.type == "disabled" and thinking.display is not None:
            raise InvalidArgument("thinking.display: not with type 'disabled'")
    disabled = thinking is not None and thinking.type == "disabled"
    schema = ""
    effort = None
    if req.output_config is not None:
        if req.output_config.format is not None:
            schema = json.dumps(req.output_config.format.schema)
        effort = req.output_config.effort
    tools, choice, parallel = _tools(req)
    chat = ChatRequest(
        model=req.model, messages=_messages(req), tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
        # The template's way to turn thinking off (Qwen 3 closes an empty reasoning).
        chat_template_kwargs={"enable_thinking": False} if disabled and tags[0] else None,
        reasoning_effort=effort,
    )
    try:
        rendered = chat_prompt(model, chat, schema)
    except InvalidArgument as exc:
        # The chat route's name for the field, as this request calls it.
        message = exc.message
        if message.startswith("reasoning_effort:"):
            message = "output_config.effort:" + message.removeprefix("reasoning_effort:")
        raise InvalidArgument(message) from None
    return _Prompt(rendered.text, rendered.syntax, rendered.use, schema, disabled, bool(
        thinking is not None and thinking.display == "omitted"), budget)


def _params(req: MessagesRequest) -> GenerateParams:
    if req.max_tokens < 1:
        raise InvalidArgument(f"max_tokens: must be >= 1, got {req.max_tokens}")
    params = GenerateParams(max_tokens=req.max_tokens)
    if req.temperature is not None:
        in_range("temperature", req.temperature, 0.0, 1.0)  # Anthropic's range
        params.temperature = req.temperature
        params.greedy = req.temperature == 0
    if req.top_p is not None:
        in_range("top_p", req.top_p, 0.0, 1.0)
        params.top_p = req.top_p
    if req.top_k is not None:
        params.top_k = sampling.count(req.top_k, "top_k", 0)
    if req.stop_sequences:
        params.stop = sampling.stop_strings(req.stop_sequences, "stop_sequences")
    return params


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's POST /v1/messages/count_tokens (and llama-server's): the tokens of the prompt
    /v1/messages would generate from, the request checked as there; equal to that reply's
    `input_tokens` + `cache_read_input_tokens`."""
    req = decode_with(_DECODE_COUNT, await request_body(request))
    model = await generation_model(request, req.model)
    tokens = await model.tokenize(_prompt(model, req).text, add_special=True, parse_special=True)
    return web.json_response({"input_tokens": len(tokens)})


def _tool_id(ident: str) -> str:
    """A call's id as Anthropic spells them (`toolu_…`); ids a syntax makes its own way
    (Mistral's 9 characters) stay as its template takes them back."""
    return "toolu_" + ident.removeprefix("call_") if ident.startswith("call_") else ident


class _Blocks:
    """The reply's content blocks as they form, and the stream events that say so. Fed the
    reply's pieces (`thinking`, then `text` or a tool reply's deltas from
    `openai_tools.ToolStream`); the same object builds a whole reply."""

    def __init__(self, *, streamed: bool, omitted: bool) -> None:
        self.content: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._streamed = streamed
        self._omitted = omitted
        self._open = False
        self._arguments = ""

    def thinking(self, piece: str) -> None:
        if not self._opened("thinking"):
            self._add({"type": "thinking", "thinking": "", "signature": ""})
        if piece and not self._omitted:
            self.content[-1]["thinking"] += piece
            self._delta({"type": "thinking_delta", "thinking": piece})

    def text(self, piece: str) -> None:
        if not piece:
            return
        if not self._opened("text"):
            self._add({"type": "text", "text": ""})
        self.content[-1]["text"] += piece
        self._delta({"type": "text_delta", "text": piece})

    def tool_deltas(self, deltas: list[dict[str, Any]]) -> None:
        """Chat deltas of a tool reply (`ToolStream.feed`) as blocks."""
        for delta in deltas:
            if "content" in delta:
                self.text(delta["content"])
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    self._add({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"],
                               "input": {}})
                    self._arguments = ""
                elif piece := call["function"]["arguments"]:
                    self._arguments += piece
                    self._delta({"type": "input_json_delta", "partial_json": piece})

    @property
    def calls(self) -> int:
        return sum(block["type"] == "tool_use" for block in self.content)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        index, block = len(self.content) - 1, self.content[-1]
        if block["type"] == "thinking":
            self._delta({"type": "signature_delta", "signature": ""})
        elif block["type"] == "tool_use":
            try:
                # A call's arguments, "{}" too, come before the next block; none: cut before them.
                value = json.loads(self._arguments) if self._arguments else None
            except ValueError:
                value = None
            if isinstance(value, dict):
                block["input"] = value
            else:
                # Arguments cut short (max_tokens, a stop sequence) are no object: the whole
                # reply leaves the call out rather than invent its input (`stop_reason` says
                # why it ended); the stream sent them as far as they went.
                self.content.pop()
        self._emit("content_block_stop", {"index": index})

    def _opened(self, kind: str) -> bool:
        return self._open and self.content[-1]["type"] == kind

    def _add(self, block: dict[str, Any]) -> None:
        self.close()
        self.content.append(block)
        self._open = True
        self._emit("content_block_start", {"index": len(self.content) - 1, "content_block": dict(block)})

    def _delta(self, delta: dict[str, Any]) -> None:
        self._emit("content_block_delta", {"index": len(self.content) - 1, "delta": delta})

    def _emit(self, kind: str, fields: dict[str, Any]) -> None:
        if self._streamed:
            self.events.append((kind, {"type": kind, **fields}))


async def messages(request: web.Request) -> web.StreamResponse:
    req = decode_with(_DECODE_MESSAGES, await request_body(request))
    model = await generation_model(request, req.model)
    params = _params(req)
    built = _prompt(model, req, req.max_tokens)
    prompt, syntax, use = built.text, built.syntax, built.use
    params.json_schema = built.schema
    tags = model.thinking_tags()
    if use is not None:
        # With output_config.format: tool calls or an answer in the format (ToolUse.constrain).
        use.constrain(params, "output_config.format")
    opened = reasoning.opened_by(prompt, tags)
    reasoning.hold_grammar_after(params, tags, prompt)
    if built.budget is not None:
        reasoning.budget(params, built.budget, None, tags, opened is not None)
    reading = syntax_named(syntax)
    if params.json_schema:
        params.answer_header = reading.answer_header
    split = reading.thinking_split(tags, opened) if tags[0] else None
    ident = f"msg_{uuid.uuid4().hex}"
    blocks = _Blocks(streamed=bool(req.stream), omitted=built.omitted)
    reply = use.stream() if use else None

    def feed(chunk: GenerateChunk) -> None:
        if chunk.finish_reason == "cancelled":
            # The model was unloaded or swapped past its drain timeout. Anthropic has no
            # stop_reason for that, and end_turn would say the model finished: a 503 (the
            # stream's error event), which a client retries.
            raise Unavailable(f"the generation was cancelled: model '{model.name}' was unloaded while it ran")
        final = chunk.finish_reason is not None
        text = chunk.text
        if split is not None:
            thought, text = split.feed(text, final)
            if thought and not built.hidden:
                blocks.thinking(thought)
        if reply is None:
            blocks.text(text)
            return
        blocks.tool_deltas(reply.feed(text, final))
        if final and not reply.calls_sent and not reply.sent_content and use is not None and not use.native:
            # Cut off before the reply object said anything: its raw text, as the chat route.
            content, _ = openai_tools.parse_reply(reply.text)
            blocks.text(content or "")

    def stop(last: GenerateChunk) -> tuple[str, str | None]:
        if last.finish_reason == "length":
            # Before max_tokens: the context was full.
            full = last.completion_tokens < req.max_tokens
            return ("model_context_window_exceeded" if full else "max_tokens"), None
        if blocks.calls:
            return "tool_use", None
        if last.stop_word:
            return "stop_sequence", last.stop_word
        return "end_turn", None

    def usage(last: GenerateChunk) -> dict[str, int]:
        return {
            "input_tokens": last.prompt_tokens - last.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": last.cached_tokens,
            "output_tokens": last.completion_tokens,
        }

    chunks = model.generate(prompt, params)
    async with contextlib.aclosing(chunks):
        # Before the status: a full queue or a prompt over the context is a real 4xx/5xx.
        try:
            first = await first_chunk(chunks)
        except InvalidArgument as exc:
            if (found := _TOO_LONG.match(exc.message)) is None:
                raise
            raise InvalidArgument(f"prompt is too long: {found[1]} tokens > {found[2]} maximum ({exc.message})") from None
        if not req.stream:
            last = await feed_chunks(first, chunks, feed)
            blocks.close()
            reason, sequence = stop(last)
            body = {
                "id": ident, "type": "message", "role": "assistant", "model": model.name,
                "content": blocks.content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(last),
            }
            return web.Response(body=_json.encode(body), content_type="application/json")
        # The prompt's tokens, for message_start (the engine tells how many were cached at the end).
        total = len(await model.tokenize(prompt, add_special=True, parse_special=True))
        response = await start_sse(request)

        async def send(kind: str, payload: dict[str, Any]) -> None:
            await response.write(b"event: " + kind.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n")

        async def flush() -> None:
            events, blocks.events = blocks.events, []
            for kind, payload in events:
                await send(kind, payload)

        await send("message_start", {"type": "message_start", "message": {
            "id": ident, "type": "message", "role": "assistant", "model": model.name, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": total, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                      "output_tokens": 0},
        }})
        await send("ping", {"type": "ping"})
        try:
            last = await feed_chunks(first, chunks, feed, flush)
        except EdgedError as exc:
            # The 200 went out with message_start: the failure is the stream's last event.
            await send("error", error_body(exc.status, exc.message, request.path))
            await response.write_eof()
            return response
        blocks.close()
        await flush()
        reason, sequence = stop(last)
        await send("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": usage(last)})
        await send("message_stop", {"type": "message_stop"})
        await response.write_eof()
        return response


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
