"""Ollama's REST API (`/api/*`, as Ollama documents it) on top of the generation backends.

Streaming is NDJSON: one JSON object per line, the last with `done: true`, `done_reason` and the
counts and nanosecond durations; an error after the stream has started is a line
`{"error": "..."}`, as Ollama writes it. Errors before are `{"error": "..."}` bodies with
Ollama's status codes (the error middleware writes them).

Model names are `name[:tag]`: the repository model `name`, tag `latest` (the served version)
or a version number. Everything Ollama accepts that edged cannot do (images, sampling options
the engine lacks, ...) is a 400 naming the field, never ignored.

A thinking model (its backend names reasoning tags, `thinking_tags()`: templates with `<think>`)
thinks unless `think` is false, as in Ollama: its reasoning comes back apart from the answer, in
`message.thinking` (/api/chat) or `thinking` (/api/generate), and streamed chunks carry either
one or the other (see reasoning.py for where the reasoning starts and ends). `think: false`
renders the template with `enable_thinking: false` and splits nothing. A level ("low",
"medium", "high"; "max" is "high") reaches a Jinja template as `reasoning_effort`, and only a
template whose prompt it changes takes one. A model without thinking takes `think: false` and
unset; true or a level is Ollama's 400.

`format` ("json" or a JSON schema) and `tools` use the same machinery as the OpenAI routes: a
grammar the engine enforces, and for tools the generic JSON reply of `openai_tools` (Ollama
has no tool_choice: the model may call tools or answer, as with OpenAI's "auto"). Tool calls
come back as Ollama shapes them: arguments as an object, each call whole, also when streaming.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import re
import struct
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec
from aiohttp import web

from daemon.api import dimensions, openai_tools, reasoning, sampling
from daemon.api.body import read_body
from daemon.api.leases import hold, use
from daemon.api.llama_native import joined_text
from daemon.api.state import daemon_of
from daemon.api.tool_syntax import Syntax, syntax_named
from daemon.backend import GenerateChunk, GenerateParams, TokenLogprob
from daemon.core import layout
from daemon.core.model import LoadedVersion
from daemon.core.residency import read_gguf_metadata
from daemon.errors import EdgedError, InvalidArgument, NotFound, Unavailable, Unsupported
from daemon.model_config import parse_keep_alive
from daemon.service import Service

# The Ollama release whose API (docs/api.md) these routes follow: tools, `format` schemas,
# /api/embed, `done_reason`. Clients compare it to decide which fields they may send.
OLLAMA_VERSION = "0.6.0"

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
_FOREVER = "2318-01-01T00:00:00Z"  # what Ollama's expires_at reads like for keep_alive < 0
# Generation runs until the context is full when num_predict is unset or negative (Ollama).
_UNLIMITED = 1 << 30

_SUPPORTED_OPTIONS = frozenset({
    "num_ctx", "temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "stop", "num_predict",
    "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "num_keep",
})
# Ollama's default num_keep (api.DefaultOptions): the tokens its context shift keeps.
_NUM_KEEP = 4
# Ollama's runner options: set when it loads a model (another value reloads it). Here the
# model's config sets the load, never a request; the llama.cpp parameter that does it, if any.
_LOAD_TIME = {
    "num_batch": "n_batch", "num_gpu": "n_gpu_layers", "num_thread": "n_threads", "main_gpu": "",
    "use_mmap": "", "use_mlock": "", "numa": "", "low_vram": "", "f16_kv": "", "vocab_only": "",
    "logits_all": "", "embedding_only": "",
}
_THINK_LEVELS = frozenset({"high", "medium", "low", "max"})  # Ollama's
# The reasoning tags of /api/show's "thinking" for a model not loaded yet, read from its
# template text as the llama.cpp plugin reads them once loaded (a loaded model is asked).
_THINKING_TAGS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("<|channel>thought", "<channel|>"))
# Ollama's default window of recent tokens for all three penalties.
_REPEAT_LAST_N = 64


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    pass


class GgufMetadata:
    """GGUF metadata by (path, mtime, size): reading walks the whole vocabulary, so do it once.
    `read` blocks (file reads): call it from an executor thread."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int, int], dict[str, Any]] = {}

    def read(self, path: Path) -> dict[str, Any]:
        st = path.stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) > 256:  # bounded: repositories change, old keys go stale
                self._cache.clear()
            found = self._cache[key] = read_gguf_metadata(path)
        return found


_METADATA = web.AppKey("ollama-gguf-metadata", GgufMetadata)
# Tokens a tokenizer may add to a text beyond one per byte of it (see _counted).
_ADDED_TOKENS = 8


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


KeepAlive = str | float | None


class ToolCallFunction(_Strict):
    name: str
    arguments: dict[str, Any] = {}
    # The call's place in its reply, as Ollama's (and edged's) replies carry it: a client that
    # sends a reply's message back sends it too. It orders nothing that the list does not.
    index: int | None = None


class ToolCall(_Strict):
    function: ToolCallFunction
    # What edged's replies carry; templates with ids (Mistral's) get them back.
    id: str | None = None
    # Clients written for OpenAI's shape send the kind; "function" is the only one there is.
    type: Literal["function"] | None = None


class Message(_Strict):
    role: str
    content: str = ""
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None
    # A `tool` message's call: the tool's name (Ollama) and/or the call's id (newer clients).
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Generation(_Strict):
    model: str
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Ollama's defaults are true (drop what does not fit; shift the context when it fills);
    # edged does neither, so only false (what happens anyway) is taken.
    truncate: bool | None = None
    shift: bool | None = None


class ChatRequest(_Generation):
    messages: list[Message] = []
    # Ollama's tool shape is OpenAI's: {type: function, function: {name, description, parameters}}.
    tools: list[openai_tools.Tool] | None = None


class GenerateRequest(_Generation):
    prompt: str = ""
    suffix: str = ""
    system: str = ""
    template: str = ""
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None


class EmbedRequest(_Strict):
    model: str
    input: str | list[str] = ""
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    dimensions: int | None = None


class EmbeddingsRequest(_Strict):
    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class ModelRequest(_Strict):
    """delete (and the base of show / pull): Ollama takes `model` (older clients send `name`)."""

    model: str = ""
    name: str = ""

    def which(self) -> str:
        if not (self.model or self.name):
            raise InvalidArgument("model is required")
        return self.model or self.name


class ShowRequest(ModelRequest):
    verbose: bool = False


class PullRequest(ModelRequest):
    # Ollama ignores `insecure` (deprecated); nothing is downloaded here for it to matter.
    insecure: bool = False
    stream: bool = True


_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(kind)
    for kind in (ChatRequest, GenerateRequest, EmbedRequest, EmbeddingsRequest, ModelRequest, ShowRequest,
                 PullRequest)
}


async def _decode(request: web.Request, kind: type[Any]) -> Any:
    body = await read_body(request, daemon_of(request).config.server.max_request_bytes)
    try:
        return _DECODERS[kind].decode(body)
    except msgspec.ValidationError as exc:
        error = exc
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed JSON body: {exc}") from None
    # Ollama's server (Go's encoding/json) takes null for any field as "not given": so do we,
    # for the request's own fields and its messages' (not inside a schema, tools or options).
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        # The typed decode stops at the first wrong field; malformed JSON after it shows here.
        raise InvalidArgument(f"malformed JSON body: {exc}") from None
    if isinstance(data, dict) and (stripped := _without_nulls(data)) != data:
        try:
            return msgspec.convert(stripped, kind)
        except msgspec.ValidationError as exc:
            error = exc
    raise InvalidArgument(f"invalid request: {error}") from None


def _without_nulls(data: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in data.items() if v is not None}
    if isinstance(out.get("messages"), list):
        out["messages"] = [
            {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in out["messages"]
        ]
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(payload), content_type="application/json")


def _accepting(request: web.Request) -> Service:
    daemon = daemon_of(request)
    if not daemon.accepting:
        raise Unavailable("server is shutting down")
    return daemon


# ---------------------------------------------------------------------------- names


def _resolve(daemon: Service, raw: str) -> tuple[str, int | None]:
    """`name[:tag]` -> (repository model, version or None for the served one)."""
    name, tag = raw, "latest"
    head, sep, tail = raw.rpartition(":")
    if sep and "/" not in tail:
        name, tag = head, tail or "latest"
    entry = daemon.registry.entry(name)
    if not name or entry is None or (entry.path is None and not entry.versions):
        raise NotFound(f'model "{raw}" not found in the model repository')
    if tag == "latest":
        return name, None
    if tag.isdigit() and not tag.startswith("0"):
        return name, int(tag)
    raise NotFound(f'model "{raw}" not found: tag must be "latest" or a version number')


def _keep_alive(value: KeepAlive) -> float | Literal["default"] | None:
    if value is None:
        return "default"
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise InvalidArgument(f"keep_alive: {exc}") from None


def _generation_model(request: web.Request, name: str, version: int | None, raw: str) -> LoadedVersion:
    model = use(request, daemon_of(request).registry.get(name, version))
    if model.generator is None:
        raise InvalidArgument(f'"{raw}" does not support generate: it runs on backend '
                              f"'{model.backend}', which does not generate text")
    return model


# ---------------------------------------------------------------------------- options


def _options(options: dict[str, Any] | None) -> _Options:
    """The request's `options`, checked (no model needed): names edged implements, types."""
    options = options or {}
    for key in sorted(options):
        if key in _LOAD_TIME:
            where = f" (llama.cpp: parameters {_LOAD_TIME[key]})" if _LOAD_TIME[key] else ""
            raise InvalidArgument(
                f"options.{key} is a load-time setting: edged loads a model as its config says{where}, "
                "never per request"
            )
        if key not in _SUPPORTED_OPTIONS:
            raise InvalidArgument(
                f"options.{key} is not supported by edged (supported: "
                f"{', '.join(sorted(_SUPPORTED_OPTIONS))})"
            )
    try:
        return msgspec.convert(options, _Options)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"options: {exc}") from None


class _Engine(NamedTuple):
    """What a request's context handling reads of the model's engine (its engine_stats)."""

    per_slot: int | None  # its context per sequence, where it reports one
    can_shift: bool  # llama.cpp can move its cached cells (GenerateParams.shift_window)
    adds_bos: bool  # a prompt's text is tokenized with a BOS before it (_cut)


def _engine(model: LoadedVersion) -> _Engine:
    stats = model.require_generator().engine_stats()
    per_slot = stats.get("n_ctx_per_slot")
    return _Engine(per_slot if isinstance(per_slot, int) and per_slot > 0 else None, bool(stats.get("can_shift")),
                   bool(stats.get("adds_bos")))


def _params(opts: _Options, model: LoadedVersion, engine: _Engine) -> tuple[GenerateParams, int | None]:
    """The engine's parameters, and the context a smaller `num_ctx` bounds the sequence to
    (None: the loaded one, which the engine keeps to itself)."""
    # Ollama's documented defaults (its Modelfile PARAMETER table), where the engine's differ.
    params = GenerateParams(
        max_tokens=_UNLIMITED, temperature=0.8, top_k=40, top_p=0.9, min_p=0.0, repeat_penalty=1.1,
        context_shift=False,  # llama-server's shift: Ollama's own is _shift's
    )
    bound = None
    if opts.num_ctx is not None:
        if opts.num_ctx < 1:
            raise InvalidArgument(f"options.num_ctx must be >= 1, got {opts.num_ctx}")
        per_seq = engine.per_slot
        if per_seq is not None and opts.num_ctx > per_seq:
            raise InvalidArgument(
                f"options.num_ctx {opts.num_ctx} exceeds the {per_seq} tokens of context per "
                f"sequence that model '{model.name}' was loaded with (its parameters n_ctx / "
                "n_parallel set it)"
            )
        if per_seq is None or opts.num_ctx < per_seq:
            bound = opts.num_ctx
    if opts.num_predict is not None:
        if opts.num_predict == 0 or opts.num_predict < -2:
            raise InvalidArgument(f"options.num_predict must be > 0, -1 or -2, got {opts.num_predict}")
        if opts.num_predict > 0:
            params.max_tokens = opts.num_predict
    if opts.num_keep is not None and opts.num_keep < -1:
        raise InvalidArgument(f"options.num_keep must be >= -1, got {opts.num_keep}")
    params.penalty_last_n = _REPEAT_LAST_N if opts.repeat_last_n is None else sampling.count(
        opts.repeat_last_n, "options.repeat_last_n", -1, "-1 (the context) or ")
    if opts.top_k is not None:
        # Ollama's top_k of 0 or below keeps every token, as llama.cpp's does.
        sampling.count(opts.top_k, "options.top_k", -(2**31))
    for key in ("presence_penalty", "frequency_penalty"):
        value = getattr(opts, key)
        if value is not None:
            if not -2.0 <= value <= 2.0:
                raise InvalidArgument(f"options.{key} must be between -2 and 2, got {value}")
            setattr(params, key, value)
    if opts.temperature is not None:
        if opts.temperature < 0:
            raise InvalidArgument(f"options.temperature must be >= 0, got {opts.temperature}")
        params.temperature = opts.temperature
        params.greedy = opts.temperature == 0
    if opts.typical_p is not None and not 0.0 <= opts.typical_p <= 1.0:
        raise InvalidArgument(f"options.typical_p must be between 0 and 1, got {opts.typical_p}")
    for key in ("top_p", "top_k", "min_p", "typical_p", "repeat_penalty"):
        value = getattr(opts, key)
        if value is not None:
            setattr(params, key, value)
    params.seed = sampling.seed(opts.seed, "options.seed")  # -1, Ollama's default: random
    if opts.stop is not None:
        params.stop = sampling.stop_strings(opts.stop, "options.stop")
    return params, bound


def _shift(model: LoadedVersion, engine: _Engine, req: _Generation, opts: _Options, params: GenerateParams,
           num_ctx: int | None) -> None:
    """Ollama's context shift (`shift`, on unless false): a reply that fills the context goes
    on, its older tokens dropped as Ollama's runner drops them (GenerateParams.shift_window),
    keeping `num_keep` (default 4), for at most 10 x the context unless num_predict says
    otherwise (Ollama's cap on an endless reply). Off for num_predict -2 (fill the context)
    and where llama.cpp cannot shift the model's context: then the reply ends there, with
    `length`, unless the request asked for the shift (a 400)."""
    if req.shift is False or opts.num_predict == -2:
        return
    if not engine.can_shift or engine.per_slot is None:
        if req.shift:
            raise InvalidArgument(f"shift: the context of model '{model.name}' cannot be shifted; send shift false")
        return
    params.shift_window = num_ctx or engine.per_slot
    params.n_keep = _NUM_KEEP if opts.num_keep is None else opts.num_keep
    if opts.num_predict is None or opts.num_predict < 0:
        params.max_tokens = 10 * params.shift_window


async def _fit(model: LoadedVersion, engine: _Engine, req: _Generation, opts: _Options, prompt: str,
               params: GenerateParams, num_ctx: int | None, tokens: list[int] | None = None) -> str | list[int]:
    """The prompt as the model gets it: the text, or its tokens cut to fit the context.

    The context is `num_ctx` (the sequence's context in Ollama, whose runner is loaded with
    it), else the model's context per sequence. A prompt of that many tokens or more is cut
    as Ollama cuts it (`truncate`, on unless false; its llama-server runner's
    completionPromptForRequest, read, not copied): the first `num_keep` tokens stay (default
    4, -1 all; the BOS beside them; at most the context - 1) and the oldest after them go,
    down to the length its first context shift would leave (half of the rest free). As in
    Ollama, only where the context can shift (`shift` not false, a model llama.cpp can
    shift): a reply then goes on past it. Not cut, a prompt that does not fit is a 400
    naming the limit. A `suffix` prompt is never cut (the engine builds it around the FIM
    tokens).

    Without `shift`, prompt and reply together stay within a smaller `num_ctx`: the reply is
    bounded here from the prompt's count. A prompt of few bytes needs no count (_counted).
    `tokens`: the prompt's, where the chat's truncation counted them already."""
    limit = num_ctx or engine.per_slot
    if limit is None:
        return prompt
    if tokens is None and len(prompt.encode()) + _ADDED_TOKENS < limit and (num_ctx is None or params.shift_window):
        return prompt  # it fits, and nothing needs its count
    if params.suffix:
        # Counted as the engine builds it (only max_tokens 0 just tokenizes).
        counted = 0
        count = GenerateParams(max_tokens=0, suffix=params.suffix)
        async with contextlib.aclosing(model.require_generator().generate(prompt, count)) as chunks:
            async for chunk in chunks:
                counted = max(counted, chunk.prompt_tokens)
    else:
        if tokens is None:
            tokens = await model.tokenize(prompt, add_special=True, parse_special=True)
        counted = len(tokens)
    # Counted, the tokens are the prompt: the engine need not tokenize it again.
    fitted: str | list[int] = prompt if tokens is None else tokens
    if counted >= limit:
        if num_ctx:
            where = f"options.num_ctx: the prompt is {counted} tokens, which leaves no room in num_ctx {num_ctx}"
        else:
            where = (f"prompt: the prompt is {counted} tokens, which leaves no room in the {limit} tokens of "
                     f"context per sequence of model '{model.name}'")
        if tokens is None:
            raise InvalidArgument(f"{where} (a prompt with a suffix is never cut)")
        if limit <= 1:
            raise InvalidArgument(f"{where} (cut, no token of it would be left; Ollama's runner does not cut it either)")
        if req.truncate is False:
            raise InvalidArgument(f"{where} (truncate false)")
        if req.shift is False or not engine.can_shift:
            why = "shift false" if req.shift is False else f"the context of model '{model.name}' cannot shift"
            raise InvalidArgument(f"{where}; it is cut only where the context can shift ({why})")
        fitted = _cut(tokens, limit, opts.num_keep, engine.adds_bos)
        log.warning("model '%s': prompt of %d tokens cut to %d for a context of %d (num_keep %s)",
                    model.name, counted, len(fitted), limit, opts.num_keep)
        counted = len(fitted)
    if num_ctx is not None and not params.shift_window:
        params.max_tokens = min(params.max_tokens or _UNLIMITED, num_ctx - counted)
    return fitted


def _cut(tokens: list[int], limit: int, num_keep: int | None, adds_bos: bool) -> list[int]:
    """Ollama's prompt truncation (_fit): `tokens` (>= `limit` of them) cut to the first
    `keep` and the last ones, as many as leave half of what follows `keep` in `limit` free."""
    keep = _NUM_KEEP if num_keep is None else num_keep
    if keep < 0:
        keep = len(tokens)
    keep = min(keep + int(adds_bos), limit - 1)
    length = limit - max((limit - keep) // 2, 1)
    return tokens[:keep] + tokens[len(tokens) - (length - keep):]


def _format_schema(value: str | dict[str, Any] | None) -> str:
    """The JSON schema (text) `format` asks for; "" for free text. The backend turns it into a
    grammar and refuses (400, naming the keyword) what it cannot enforce."""
    if value is None or value == "":
        return ""
    if value == "json":
        return '{"type": "object"}'  # Ollama's JSON mode: one JSON object
    if isinstance(value, str):
        raise InvalidArgument(f'format: {value!r} is not "json" or a JSON schema object')
    return json.dumps(value)


class _Options(msgspec.Struct):
    num_ctx: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    num_predict: int | None = None
    num_keep: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


def _checked(req: _Generation) -> tuple[_Options, int | None, str]:
    """What chat and generate check before anything is loaded: options, thinking, logprobs,
    format. Returns the options, logprobs' alternatives and the schema."""
    opts = _options(req.options)
    _check_think(req)
    return opts, _logprobs(req), _format_schema(req.format)


def _check_think(req: _Generation) -> None:
    # A string other than a level ("" too) is Ollama's own 400 when it reads the request.
    if isinstance(req.think, str) and req.think not in _THINK_LEVELS:
        raise InvalidArgument(f'invalid think value: {json.dumps(req.think)} (must be "high", "medium", "low", '
                              '"max", true, or false)')


class _Thinking:
    """What `think` does with the loaded model: `tags` to split its reply on (("", "") for
    none: think false or a model without thinking) and the template variables it sets."""

    def __init__(self, model: LoadedVersion, think: bool | str | None, raw: str) -> None:
        tags = model.thinking_tags()
        self.tags: tuple[str, str] = ("", "")
        self.syntax = syntax_named(model.tool_syntax())
        self.variables: dict[str, Any] | None = None
        # The reasoning is left out of the reply (gpt-oss with think false: it always reasons).
        self.hidden = False
        # "max" is "high" in Ollama (the level gpt-oss's template knows).
        self.level = "high" if think == "max" else think if isinstance(think, str) else ""
        if not tags[0]:
            # Unset or false: what happens anyway. A level asks for thinking too.
            if think is True or self.level:
                raise InvalidArgument(f'"{raw}" does not support thinking')
        elif think is False and self.syntax.own_split:
            # gpt-oss reasons whatever it is told (its template has no way to turn it off, as
            # Ollama's docs say): its answer is still read off its channels, without the reasoning.
            self.tags, self.hidden = tags, True
        elif think is False:
            # The template's way to turn thinking off (Qwen 3 closes an empty reasoning, DeepSeek
            # R1 closes the one it opens); the reply, tags and all, is the answer.
            self.variables = {"enable_thinking": False}
        else:
            # Unset is true for a thinking model (Ollama); the template already has
            # enable_thinking true (templates.py), as llama-server gives it. A level reaches it
            # in `prompt`.
            self.tags = tags

    def prompt(self, model: LoadedVersion, messages: list[dict[str, Any]], raw: str,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The chat prompt with the template variables `think` sets. A level must change the
        prompt: a template that does not read `reasoning_effort` (most with <think> tags)
        would ignore it, and edged takes nothing without its effect."""
        if not self.level:
            return model.chat_prompt(messages, template_kwargs=self.variables, tools=tools)
        prompt = reasoning.effort_prompt(
            lambda variables: model.chat_prompt(messages, template_kwargs=variables, tools=tools), None, self.level
        )
        if prompt is None:
            raise InvalidArgument(
                f'think: "{self.level}": the chat template of "{raw}" has no thinking levels (it does not '
                "read reasoning_effort); send think true or false"
            )
        return prompt

    def without_template(self, raw: str) -> None:
        """A prompt not rendered by the model's chat template (/api/generate's raw, template or
        suffix): a level has nothing to reach; true still splits the reply."""
        if self.level:
            raise InvalidArgument(f'think: "{self.level}": a level reaches the model through its chat '
                                  f'template, which raw, template and suffix prompts of "{raw}" do not use')

    def split(self, prompt: str, *, chat: bool) -> _Split | None:
        """How the reply to `prompt` splits (None: it does not)."""
        if not self.tags[0]:
            return None
        return _Split(self.tags, reasoning.opened_by(prompt, self.tags), chat=chat, syntax=self.syntax,
                      hidden=self.hidden)

    def hold_grammar(self, prompt: str, params: GenerateParams) -> None:
        """`format` or tools constrain the reply after the model has thought, as Ollama lets
        it think first: from the closing tag on where the prompt opened the reasoning, after
        the reasoning the model may open itself (Qwen 3) otherwise."""
        if self.tags[0]:
            reasoning.hold_grammar_after(params, self.tags, prompt)
        if params.json_schema:
            params.answer_header = self.syntax.answer_header


class _Split:
    """A thinking reply's reasoning and answer (Ollama's split: reasoning.ThinkingSplit with
    trim, or the syntax's own, gpt-oss's channels); `chat`: the reasoning goes in
    message.thinking, else in thinking (/api/generate); `hidden`: it is left out."""

    def __init__(
        self, tags: tuple[str, str], opened: str | None, *, chat: bool, syntax: Syntax, hidden: bool
    ) -> None:
        self.tags = tags
        self.opened = opened
        self.chat = chat
        self.syntax = syntax
        self.hidden = hidden

    def stream(self) -> reasoning.Split:
        if self.syntax.own_split:
            return self.syntax.thinking_split(self.tags, self.opened)
        return reasoning.ThinkingSplit(self.tags, opened=self.opened, trim=True, ends=self.syntax.ends_reasoning)

    def whole(self, text: str) -> tuple[str, str]:
        return self.stream().feed(text, final=True)

    def put(self, item: dict[str, Any], thought: str) -> dict[str, Any]:
        """`item` carrying `thought` (Ollama leaves the field out when it is empty)."""
        if not thought or self.hidden:
            return item
        if self.chat:
            return {**item, "message": {**item["message"], "thinking": thought}}
        return {**item, "thinking": thought}


def _logprobs(req: _Generation) -> int | None:
    """Alternatives per token for GenerateParams.logprobs (None: no log probabilities)."""
    top = req.top_logprobs
    if top is not None and not 0 <= top <= 20:
        raise InvalidArgument("top_logprobs must be between 0 and 20")  # Ollama's text
    if top and not req.logprobs:
        # Ollama takes it and does nothing; here nothing is taken without its effect.
        raise InvalidArgument("top_logprobs: requires logprobs: true")
    return (top or 0) if req.logprobs else None


def _logprob_entries(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Ollama's `logprobs`: token, logprob, its bytes (a token can hold part of a UTF-8
    character: its text then shows U+FFFD, `bytes` has the truth), alternatives if asked."""

    def entry(e: TokenLogprob) -> dict[str, Any]:
        return {"token": e.piece.decode("utf-8", errors="replace"), "logprob": e.logprob, "bytes": list(e.piece)}

    return [{**entry(e), "top_logprobs": [entry(t) for t in e.top]} if e.top else entry(e) for e in entries]


# ---------------------------------------------------------------------------- streaming


class _Timing:
    def __init__(self, started: int, load_ns: int) -> None:
        self.started = started
        self.load_ns = load_ns
        self.gen_started = time.monotonic_ns()
        self.first = 0

    def final(self, last: GenerateChunk) -> dict[str, Any]:
        end = time.monotonic_ns()
        first = self.first or end
        return {
            "done": True,
            "done_reason": last.finish_reason or "stop",
            "total_duration": end - self.started,
            "load_duration": self.load_ns,
            "prompt_eval_count": last.prompt_tokens,
            "prompt_eval_duration": first - self.gen_started,
            "eval_count": last.completion_tokens,
            "eval_duration": end - first,
        }


class _Text:
    """Generated text as Ollama's pieces: `piece(text)` builds the object for a piece."""

    def __init__(self, piece: Any) -> None:
        self.piece = piece

    def stream(self, text: str) -> list[dict[str, Any]]:
        return [self.piece(text)] if text else []

    def end(self) -> list[dict[str, Any]]:
        return []

    def whole(self, text: str) -> dict[str, Any]:
        return dict(self.piece(text))


class _ToolReply:
    """A chat reply with tools, in the model's own syntax or the generic JSON reply (see
    openai_tools.ToolUse). Its content streams while it grows; tool calls go out whole, in one
    object, once the reply is complete (Ollama sends calls whole, never in pieces). The
    unstreamed reply is what the stream adds up to, also when it was cut short."""

    def __init__(self, piece: Any, use: openai_tools.ToolUse) -> None:
        self.piece = piece  # piece(message) -> the object carrying that message
        self._use = use
        self._reply = use.stream()

    def stream(self, text: str) -> list[dict[str, Any]]:
        return [self.piece(m) for m in self._messages(text)]

    def end(self) -> list[dict[str, Any]]:
        return [self.piece(m) for m in [*self._messages("", final=True), *self._last_messages()]]

    def whole(self, text: str) -> dict[str, Any]:
        reply = _ToolReply(self.piece, self._use)
        messages = [*reply._messages(text, final=True), *reply._last_messages()]
        content = "".join(m["content"] for m in messages)
        with_calls = [m for m in messages if "tool_calls" in m]
        if with_calls:
            return dict(self.piece({**with_calls[0], "content": content}))
        return dict(self.piece({"role": "assistant", "content": content}))

    def _messages(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": d["content"]}
                for d in self._reply.feed(text, final) if "content" in d]

    def _last_messages(self) -> list[dict[str, Any]]:
        content, calls = self._use.reply_calls(self._reply.text)
        if calls:
            return [_tool_message(calls, self._use)]
        if content and not self._reply.sent_content and not self._use.native:
            # Cut short before the reply said anything: the raw text, as the OpenAI route does.
            return [{"role": "assistant", "content": content}]
        return []


def _tool_message(calls: list[tuple[str, Any]], use: openai_tools.ToolUse) -> dict[str, Any]:
    """Ollama's assistant message with tool calls: arguments are objects; `id` and
    `function.index` as current Ollama releases send them (ids in the form the model's
    template takes back: Mistral's are 9 letters and digits)."""
    return {
        "role": "assistant", "content": "",
        "tool_calls": [
            {"id": use.syntax.call_id(),
             "function": {"index": index, "name": name, "arguments": arguments}}
            for index, (name, arguments) in enumerate(calls)
        ],
    }


async def _respond(
    request: web.Request,
    chunks: AsyncGenerator[GenerateChunk, None],
    *,
    stream: bool,
    timing: _Timing,
    shape: _Text | _ToolReply,
    logprobs: bool = False,
    split: _Split | None = None,
    context: Callable[[str], Awaitable[list[int]]] | None = None,
) -> web.StreamResponse:
    """Stream NDJSON (`shape` turns text into Ollama's objects) or answer one object. With
    `logprobs`, each object carries the entries of the tokens since the previous one. With
    `split`, the reasoning goes apart and `shape` gets the answer only; streamed, an object
    carries reasoning or answer, never both. `context` gives the last object's `context`
    from the whole reply as generated."""
    async with contextlib.aclosing(chunks):
        try:
            first = await chunks.__anext__()  # errors before any output get a real status
        except StopAsyncIteration:
            first = GenerateChunk(text="", finish_reason="stop")
        timing.first = time.monotonic_ns()
        pending = list(first.logprobs)  # a token may add no text yet (part of a character)

        def with_logprobs(item: dict[str, Any]) -> dict[str, Any]:
            if logprobs and pending:
                item = {**item, "logprobs": _logprob_entries(pending)}
                pending.clear()
            return item

        if not stream:
            parts, last = [first.text], first
            async for chunk in chunks:
                parts.append(chunk.text)
                pending.extend(chunk.logprobs)
                last = chunk
            text, thought = "".join(parts), ""
            if split is not None:
                thought, text = split.whole(text)
                whole = split.put(shape.whole(text), thought)
            else:
                whole = shape.whole(text)
            final = with_logprobs({**whole, **timing.final(last)})
            if context is not None:
                final["context"] = await context("".join(parts))
            return _json_response(final)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        last = first
        splitter = split.stream() if split is not None else None

        def items(text: str, final: bool = False) -> list[dict[str, Any]]:
            if splitter is None or split is None:
                return shape.stream(text)
            thought, text = splitter.feed(text, final)
            # The reasoning first: it comes before the answer in the reply.
            out = [split.put(shape.whole(""), thought)] if thought and not split.hidden else []
            return out + shape.stream(text)

        said = [first.text] if context is not None else None  # the reply, for `context`
        try:
            for item in items(first.text):
                await response.write(_json.encode(with_logprobs({**item, "done": False})) + b"\n")
            async for chunk in chunks:
                last = chunk
                pending.extend(chunk.logprobs)
                if said is not None:
                    said.append(chunk.text)
                for item in items(chunk.text):
                    await response.write(_json.encode(with_logprobs({**item, "done": False})) + b"\n")
            # What the split held back in case it became a tag.
            for item in [*items("", final=True), *shape.end()]:
                await response.write(_json.encode(with_logprobs({**item, "done": False})) + b"\n")
            final = with_logprobs({**shape.whole(""), **timing.final(last)})
            if context is not None and said is not None:
                final["context"] = await context("".join(said))
            await response.write(_json.encode(final) + b"\n")
        except EdgedError as exc:
            await response.write(_json.encode({"error": exc.message}) + b"\n")
        await response.write_eof()
        return response


async def _load_or_unload(
    request: web.Request, daemon: Service, raw: str, name: str, version: int | None,
    keep: float | Literal["default"] | None, started: int, empty: dict[str, Any], opts: _Options,
    think: bool | str | None,
) -> web.Response:
    """An empty prompt (or no messages) loads the model; with keep_alive 0 it unloads it.
    Its options are checked as any request's (unknown ones, num_ctx against the model, think
    against its thinking); valid sampling options have nothing to act on in a load, in Ollama
    either."""
    base = {"model": raw, "created_at": _now(), **empty, "done": True}
    if keep == 0:
        if daemon.residency is None or not daemon.registry.entry(name):
            raise Unsupported("unloading is not available")
        await daemon.residency.unload(name)
        return _json_response({**base, "done_reason": "unload"})
    lease = await hold(request, name, keep)
    model = _generation_model(request, name, version, raw)
    _params(opts, model, _engine(model))  # num_ctx vs the model
    _Thinking(model, think, raw)  # Ollama's 400 for thinking asked of a model without it
    return _json_response({**base, "done_reason": "load", "total_duration": time.monotonic_ns() - started,
                           "load_duration": lease.load_ns})


# ---------------------------------------------------------------------------- chat / generate


async def chat(request: web.Request) -> web.StreamResponse:
    started = time.monotonic_ns()
    req: ChatRequest = await _decode(request, ChatRequest)
    daemon = _accepting(request)
    name, version = _resolve(daemon, req.model)
    keep = _keep_alive(req.keep_alive)
    opts, top, schema = _checked(req)
    if not req.messages:
        return await _load_or_unload(request, daemon, req.model, name, version, keep, started,
                                     {"message": {"role": "assistant", "content": ""}}, opts, req.think)
    tools = req.tools or []  # Ollama treats an empty list as no tools
    if tools and top is not None:
        # The model writes the tool reply's JSON, not the answer: its tokens' logprobs would
        # not be the reply's (the OpenAI route refuses this pair too).
        raise InvalidArgument("logprobs: not supported together with tools")
    _check_messages(req.messages, req.model)
    lease = await hold(request, name, keep)
    model = _generation_model(request, name, version, req.model)
    thinking = _Thinking(model, req.think, req.model)
    syntax = model.tool_syntax()
    # The engine's own facts (its context per sequence, whether it can shift), read once.
    engine = _engine(model)
    params, num_ctx = _params(opts, model, engine)
    params.json_schema = schema
    params.logprobs = top
    use = None
    if tools:
        # Ollama has no tool_choice: the model may call tools or answer ("auto").
        use = openai_tools.ToolUse(syntax, tools, "auto", parallel=True, answer=schema)
        # With `format`: tool calls or an answer in the format (ToolUse.constrain).
        use.constrain(params, "format")

    def render(kept: list[Message]) -> str:
        messages = _chat_messages(kept, native_tools=bool(syntax))
        if use is not None:
            messages = use.messages(messages)
        return thinking.prompt(model, messages, req.model, tools=use.template_tools() if use else None)

    limit = num_ctx or engine.per_slot
    tokens: list[int] | None = None  # the prompt's, once counted
    if limit is None or req.truncate is False:
        prompt = render(req.messages)
    else:
        prompt, tokens = await _truncated(model, req.messages, render, limit)
    thinking.hold_grammar(prompt, params)
    _shift(model, engine, req, opts, params, num_ctx)
    fitted = await _fit(model, engine, req, opts, prompt, params, num_ctx, tokens)

    def piece(message: dict[str, Any]) -> dict[str, Any]:
        return {"model": req.model, "created_at": _now(), "message": message}

    shape: _Text | _ToolReply = (
        _ToolReply(piece, use) if use else _Text(lambda text: piece({"role": "assistant", "content": text}))
    )
    timing = _Timing(started, lease.load_ns)
    return await _respond(request, model.generate(fitted, params), stream=req.stream, timing=timing, shape=shape,
                          logprobs=top is not None, split=thinking.split(prompt, chat=True))


async def _truncated(model: LoadedVersion, messages: list[Message], render: Callable[[list[Message]], str],
                     limit: int) -> tuple[str, list[int] | None]:
    """Ollama's chat truncation (`truncate`, on unless false): while the prompt leaves no room
    in `limit` tokens (num_ctx, else the model's context per sequence), the oldest messages
    go, one more each time, every system message and the last message staying, and never a
    tool result without the assistant turn that called it. What is left when only the last
    message remains is the prompt either way: one that does not fit is then cut as a
    generate prompt is (_fit). Returns the prompt, and its tokens where they were counted."""
    last = len(messages) - 1
    for index in range(len(messages)):
        start = _tool_block_start(messages, index)
        kept = [m for m in messages[:start] if m.role == "system"] + messages[start:]
        # The whole chat is rendered on the loop, as every chat's prompt; the shorter ones
        # only when it did not fit, off the loop: a long history renders as many times as
        # messages go.
        prompt = render(kept) if index == 0 else await _in_thread(render, kept)
        if index == last:
            return prompt, None
        tokens = await _counted(model, prompt, limit)
        if tokens is None or len(tokens) < limit:
            return prompt, tokens
    raise AssertionError("no messages")  # chat answers an empty list before this


def _tool_block_start(messages: list[Message], index: int) -> int:
    """Where a history cut before `index` starts: at `index`, unless that is a tool result
    whose calling assistant turn precedes its run of results: then at that turn."""
    if not 0 < index < len(messages) or messages[index].role != "tool":
        return index
    start = index
    while start > 0 and messages[start - 1].role == "tool":
        start -= 1
    if start > 0 and messages[start - 1].role == "assistant" and messages[start - 1].tool_calls:
        return start - 1
    return index


async def _counted(model: LoadedVersion, prompt: str, limit: int) -> list[int] | None:
    """`prompt`'s tokens, counted as the engine counts a prompt; None where its bytes alone
    show it is fewer than `limit` (room for one more): each token holds at least one byte of
    it but the few the tokenizer adds (BOS, EOS, a leading space)."""
    if len(prompt.encode()) + _ADDED_TOKENS < limit:
        return None
    return await model.tokenize(prompt, add_special=True, parse_special=True)


def _check_messages(messages: list[Message], raw: str) -> None:
    for index, message in enumerate(messages):
        if message.images:
            raise InvalidArgument(f'messages[{index}].images: "{raw}" does not support images')
        if message.tool_calls and message.role != "assistant":
            raise InvalidArgument(f"messages[{index}].tool_calls: only on assistant messages")
        if message.thinking and message.role != "assistant":
            raise InvalidArgument(f"messages[{index}].thinking: only on assistant messages")
        for key in ("tool_name", "tool_call_id"):
            if getattr(message, key) is not None and message.role != "tool":
                raise InvalidArgument(f"messages[{index}].{key}: only on tool messages")


def _chat_messages(messages: list[Message], *, native_tools: bool) -> list[dict[str, Any]]:
    """Ollama messages -> the chat template's. `native_tools`: the template has its own tool
    syntax and takes assistants' `tool_calls` and `tool` messages (calls without an id get
    one, and a tool result without one answers the earliest call not yet answered: Ollama's
    clients send neither, Mistral's template requires both); otherwise they are written in
    the generic reply's form (see openai_tools). An assistant's `thinking` goes back as
    `reasoning_content`, the name Jinja templates read (Qwen 3's shows it after the last user
    turn; those that drop past reasoning ignore it)."""
    out: list[dict[str, Any]] = []
    unanswered: list[str] = []
    for message in messages:
        if message.role == "tool":
            if native_tools:
                ident = message.tool_call_id or (unanswered.pop(0) if unanswered else f"{len(out):09d}")
                entry = {"role": "tool", "content": message.content, "tool_call_id": ident}
                if message.tool_name:
                    entry["name"] = message.tool_name
                out.append(entry)
                continue
            ident_fields = {"name": message.tool_name} if message.tool_name else {}
            if message.tool_call_id:
                ident_fields["tool_call_id"] = message.tool_call_id
            out.append({"role": "user", "content": openai_tools.tool_result_text(message.content, **ident_fields)})
            continue
        content = message.content
        if message.tool_calls and native_tools:
            calls: list[dict[str, Any]] = []
            for call in message.tool_calls:
                ident = call.id or f"{len(out):05d}{len(calls):04d}"
                unanswered.append(ident)
                calls.append(openai_tools.openai_call(
                    ident, call.function.name, json.dumps(call.function.arguments, ensure_ascii=False)))
            out.append({"role": "assistant", "content": content or None, "tool_calls": calls,
                        **_reasoning_of(message)})
            continue
        if message.tool_calls:
            text = openai_tools.calls_text([(c.function.name, c.function.arguments) for c in message.tool_calls])
            content = f"{content}\n{text}" if content else text
        out.append({"role": message.role, "content": content, **_reasoning_of(message)})
    return out


def _reasoning_of(message: Message) -> dict[str, str]:
    return {"reasoning_content": message.thinking} if message.thinking else {}


async def generate(request: web.Request) -> web.StreamResponse:
    started = time.monotonic_ns()
    req: GenerateRequest = await _decode(request, GenerateRequest)
    daemon = _accepting(request)
    name, version = _resolve(daemon, req.model)
    keep = _keep_alive(req.keep_alive)
    opts, top, schema = _checked(req)
    if not req.prompt:
        return await _load_or_unload(request, daemon, req.model, name, version, keep, started, {"response": ""},
                                     opts, req.think)
    if req.images:
        raise InvalidArgument(f'images: "{req.model}" does not support images')
    if req.suffix and (req.template or req.system):
        # Ollama renders the suffix through the model's template; edged builds llama.cpp's
        # fill-in-the-middle prompt from the model's FIM tokens (a model without them: 400).
        raise InvalidArgument("suffix: not supported together with template or system")
    if req.context and req.suffix:
        # The engine builds a fill-in-the-middle prompt around the text; Ollama renders the
        # context before its template's: two different prompts.
        raise InvalidArgument("context: not supported together with suffix")
    for key in ("width", "height", "steps"):
        if getattr(req, key) is not None:
            raise InvalidArgument(f"{key}: image generation is not supported by edged")
    if req.raw and (req.template or req.system or req.context):
        raise InvalidArgument("raw mode does not support template, system, or context")  # Ollama's words
    lease = await hold(request, name, keep)
    model = _generation_model(request, name, version, req.model)
    thinking = _Thinking(model, req.think, req.model)
    engine = _engine(model)
    params, num_ctx = _params(opts, model, engine)
    params.json_schema = schema
    params.logprobs = top
    if req.suffix:
        params.suffix = req.suffix  # the engine builds the FIM prompt around the raw text
    # Ollama's deprecated `context` (the token ids an earlier response gave): their text
    # (control tokens' too) goes before this turn's prompt, as Ollama writes it.
    earlier = ""
    if req.context:
        try:
            earlier = joined_text(await model.token_pieces(req.context), "context")
        except InvalidArgument as exc:
            raise InvalidArgument(exc.message if exc.message.startswith("context") else f"context: {exc.message}") from None
    if req.suffix or req.raw or req.template:
        # Not the chat template: think true still splits the reply (Ollama's too), and a
        # raw prompt that ends with the opening tag opened the reasoning.
        thinking.without_template(req.model)
        prompt = render_template(req.template, system=req.system, prompt=req.prompt) if req.template else req.prompt
    else:
        messages = [{"role": "system", "content": req.system}] if req.system else []
        messages.append({"role": "user", "content": req.prompt})
        prompt = thinking.prompt(model, messages, req.model)
    prompt = earlier + prompt
    thinking.hold_grammar(prompt, params)
    _shift(model, engine, req, opts, params, num_ctx)
    fitted = await _fit(model, engine, req, opts, prompt, params, num_ctx)

    def piece(text: str) -> dict[str, Any]:
        return {"model": req.model, "created_at": _now(), "response": text}

    async def context(reply: str) -> list[int]:
        """The final object's `context`, as Ollama's (not for raw): the prompt and the reply
        as the model wrote it, tokenized without the BOS (a later request's `context`)."""
        return await model.tokenize(prompt + reply, add_special=False, parse_special=True)

    timing = _Timing(started, lease.load_ns)
    return await _respond(request, model.generate(fitted, params), stream=req.stream, timing=timing,
                          shape=_Text(piece), logprobs=top is not None, split=thinking.split(prompt, chat=False),
                          context=None if req.raw else context)


_TEMPLATE_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def render_template(template: str, *, system: str, prompt: str) -> str:
    """The subset of Ollama's Go templates a /api/generate `template` needs: `.System`,
    `.Prompt`, `.Response` (empty: the model writes it), `if`/`else`/`end` on those, and the
    `{{-`/`-}}` whitespace trims. Anything else is a 400 naming the action."""
    values = {".System": system, ".Prompt": prompt, ".Response": ""}
    out: list[str] = []
    conditions: list[bool] = []
    position, trim_next = 0, False
    for match in _TEMPLATE_ACTION.finditer(template):
        text = template[position:match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        if all(conditions):
            out.append(text)
        action = match.group(2)
        if action in values:
            if all(conditions):
                out.append(values[action])
        elif action.startswith("if ") and action[3:].strip() in values:
            conditions.append(bool(values[action[3:].strip()]))
        elif action == "else" and conditions:
            conditions[-1] = not conditions[-1]
        elif action == "end" and conditions:
            conditions.pop()
        else:
            raise InvalidArgument(
                f"template: {{{{ {action} }}}} is not supported (edged renders .System, .Prompt, "
                ".Response and if/else/end on them)"
            )
        trim_next = bool(match.group(3))
        position = match.end()
    if conditions:
        raise InvalidArgument("template: an {{ if }} has no {{ end }}")
    tail = template[position:]
    out.append(tail.lstrip() if trim_next else tail)
    return "".join(out)


# ---------------------------------------------------------------------------- embeddings


def _refuse_options(options: dict[str, Any] | None) -> None:
    if options:
        raise InvalidArgument(f"options.{sorted(options)[0]} is not supported for embeddings")


async def _embed(
    request: web.Request, raw: str, texts: list[str], keep: KeepAlive, truncate: bool = False
) -> tuple[list[list[float]], int, int]:
    daemon = _accepting(request)
    name, version = _resolve(daemon, raw)
    lease = await hold(request, name, _keep_alive(keep))
    model = use(request, daemon.registry.get(name, version))
    if model.generator is None:
        raise InvalidArgument(f'"{raw}" does not support embeddings')
    if not texts:
        return [], 0, lease.load_ns
    vectors, tokens = await model.embed(texts, truncate=truncate)
    return vectors, tokens, lease.load_ns


async def embed(request: web.Request) -> web.Response:
    started = time.monotonic_ns()
    req: EmbedRequest = await _decode(request, EmbedRequest)
    _refuse_options(req.options)
    dimensions.check(req.dimensions)
    texts = ([req.input] if req.input else []) if isinstance(req.input, str) else req.input
    # `truncate` (Ollama's default: true): a text longer than the model embeds at once keeps
    # its first tokens; false makes it a 400.
    truncate = req.truncate is not False
    vectors, tokens, load_ns = await _embed(request, req.model, texts, req.keep_alive, truncate)
    if req.dimensions is not None and vectors:
        vectors = dimensions.shorten(vectors, req.dimensions)  # as the OpenAI route does
    return _json_response({
        "model": req.model, "embeddings": vectors, "total_duration": time.monotonic_ns() - started,
        "load_duration": load_ns, "prompt_eval_count": tokens,
    })


async def embeddings(request: web.Request) -> web.Response:
    req: EmbeddingsRequest = await _decode(request, EmbeddingsRequest)
    _refuse_options(req.options)
    vectors, _, _ = await _embed(request, req.model, [req.prompt] if req.prompt else [], req.keep_alive)
    return _json_response({"embedding": vectors[0] if vectors else []})


# ---------------------------------------------------------------------------- models


def _model_facts(metadata: GgufMetadata, path: Path) -> dict[str, Any]:
    """Size, digest, mtime and details of a repository model (blocking: file reads)."""
    config, _ = layout.read_model_config(path)
    versions = layout.select_versions(layout.list_versions(path), config.version_policy)
    files = [p for v in versions for p in (path / str(v)).rglob("*") if p.is_file()]
    stats = [p.stat() for p in files]
    ggufs = [p for p in files if p.suffix == ".gguf"]
    meta: dict[str, Any] = {}
    if ggufs:
        with contextlib.suppress(OSError, ValueError, struct.error):
            meta = metadata.read(ggufs[-1])
    arch = str(meta.get("general.architecture", ""))
    embedding = config.bool_parameter("embedding", False) if ggufs else False
    # Tools work on every chat model here (a grammar-enforced JSON reply, see openai_tools),
    # where Ollama's depend on the model's template: clients that read `capabilities` before
    # they send tools (IDE agents) would otherwise never offer them.
    capabilities = ["embedding"] if embedding else ["completion", "tools"]
    if not embedding and _names_fim_tokens(meta):
        capabilities.append("insert")  # Ollama's word for `suffix` (fill in the middle)
    # The template the model will run: the config's (Jinja text or a built-in's name) or its own.
    template = config.parameters.get("chat_template", "") or str(meta.get("tokenizer.chat_template", ""))
    if not embedding and any(all(tag in template for tag in tags) for tags in _THINKING_TAGS):
        capabilities.append("thinking")
    details = {
        "parent_model": "",
        "format": "gguf" if ggufs else (files[0].suffix.lstrip(".") if files else ""),
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": "",
        "quantization_level": _QUANT.get(int(meta.get("general.file_type", -1)), ""),
    }
    return {
        "size": sum(s.st_size for s in stats),
        "digest": layout.fingerprint(path),
        "modified_at": _rfc3339(max((s.st_mtime for s in stats), default=path.stat().st_mtime)),
        "details": details,
        "meta": meta,
        "generation": bool(ggufs) or config.backend == "llamacpp",
        "capabilities": capabilities if ggufs else [],
        "path": path,
        "gguf": ggufs[-1] if ggufs else None,  # the one `meta` was read from
    }


def _names_fim_tokens(meta: dict[str, Any]) -> bool:
    """Whether the tokenizer names prefix, suffix and middle tokens (llama.cpp's keys, current
    or older), which the engine's fill-in-the-middle prompt needs."""
    return any(
        all(f"tokenizer.ggml.{part}_token_id" in meta for part in parts)
        for parts in (("fim_pre", "fim_suf", "fim_mid"), ("prefix", "suffix", "middle"))
    )


_QUANT = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
          11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
          17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


async def _facts(request: web.Request, name: str) -> dict[str, Any]:
    entry = daemon_of(request).registry.entry(name)
    if entry is None or entry.path is None:
        raise NotFound(f'model "{name}" not found in the model repository')
    try:
        facts: dict[str, Any] = await _in_thread(_model_facts, request.app[_METADATA], entry.path)
        return facts
    except (OSError, EdgedError) as exc:
        raise NotFound(f'model "{name}" cannot be read from the repository: {exc}') from None


async def tags(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    models = []
    for name in daemon.registry.names():
        try:
            facts = await _facts(request, name)
        except NotFound:
            continue
        if not facts["generation"]:
            continue  # /api/tags lists what Ollama clients can chat with or embed
        models.append({
            "name": f"{name}:latest", "model": f"{name}:latest", "modified_at": facts["modified_at"],
            "size": facts["size"], "digest": facts["digest"], "details": facts["details"],
        })
    return _json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    req: ShowRequest = await _decode(request, ShowRequest)
    daemon = daemon_of(request)
    raw = req.which()
    name, version = _resolve(daemon, raw)
    facts = await _facts(request, name)
    meta = facts["meta"]
    if req.verbose and facts["gguf"] is not None:
        # Ollama's verbose show lists the arrays too (vocabulary, merges...): megabytes, so
        # read for this request only, never cached.
        try:
            meta = await _in_thread(lambda: read_gguf_metadata(facts["gguf"], keep_arrays=True))
        except (OSError, ValueError, struct.error) as exc:
            raise NotFound(f'model "{raw}": its GGUF metadata cannot be read in full: {exc}') from None
    info = {k: v for k, v in meta.items() if not k.startswith("tokenizer.chat_template")}
    capabilities = facts["capabilities"]
    entry = daemon.registry.entry(name)
    if entry is not None and entry.versions and capabilities:
        # Loaded, the model says whether it thinks (its backend read the template it runs).
        served = entry.versions[max(entry.versions)] if version is None else entry.versions.get(version)
        if served is not None and served.generator is not None:
            capabilities = [c for c in capabilities if c != "thinking"]
            if served.thinking_tags()[0]:
                capabilities.append("thinking")
    config, _ = layout.read_model_config(facts["path"])
    parameters = "\n".join(f"{k} {v}" for k, v in sorted(config.parameters.items()))
    return _json_response({
        "modelfile": f"# served by edged from {facts['path']}\n",
        "parameters": parameters,
        "template": str(meta.get("tokenizer.chat_template", "")),
        "details": facts["details"],
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": facts["modified_at"],
    })


async def ps(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    if daemon.residency is None:
        return _json_response({"models": []})
    models = []
    now = time.time()
    metadata = request.app[_METADATA]
    for resident in daemon.residency.residents():
        if resident.expires_at is not None:
            expires = _rfc3339(resident.expires_at)
        elif resident.on_demand and resident.keep_alive is not None:
            expires = _rfc3339(now + resident.keep_alive)  # in use: counts from its last request
        else:
            expires = _FOREVER
        entry = daemon.registry.entry(resident.name)
        details: dict[str, Any] = {}
        context: int | None = None
        if entry is not None and entry.versions:
            served = entry.versions[max(entry.versions)]
            details = {"format": served.artifact.suffix.lstrip(".")}
            if served.artifact.suffix == ".gguf":
                with contextlib.suppress(OSError, ValueError, struct.error):
                    meta = await _in_thread(metadata.read, served.artifact)
                    details["family"] = str(meta.get("general.architecture", ""))
            if served.generator is not None:
                context = _engine(served).per_slot  # the engine's own, after llama.cpp's rounding
        models.append({
            "name": f"{resident.name}:latest", "model": f"{resident.name}:latest",
            "size": resident.cost, "size_vram": 0, "digest": "", "details": details,
            "expires_at": expires, "context_length": context,
            # Ours: residency state, for operators (Ollama lists loaded models only).
            "edged": {
                "state": resident.state, "in_flight": resident.in_flight,
                "on_demand": resident.on_demand, "size_measured": resident.measured,
                "load_seconds": round(resident.load_seconds, 3),
            },
        })
    return _json_response({"models": models})


async def pull(request: web.Request) -> web.StreamResponse:
    """Offline: a model already in the repository "pulls" at once; nothing is downloaded."""
    req: PullRequest = await _decode(request, PullRequest)
    daemon = daemon_of(request)
    raw = req.which()
    try:
        _resolve(daemon, raw)
    except NotFound:
        raise NotFound(
            f'model "{raw}" is not in the model repository, and edged does not download models: '
            "copy it into the repository (or install an update bundle) instead"
        ) from None
    if not req.stream:
        return _json_response({"status": "success"})
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    await response.write(b'{"status":"success"}\n')
    await response.write_eof()
    return response


async def delete(request: web.Request) -> web.Response:
    req: ModelRequest = await _decode(request, ModelRequest)
    daemon = daemon_of(request)
    name, _ = _resolve(daemon, req.which())
    entry = daemon.registry.entry(name)
    raise Unsupported(
        f"edged does not delete models: the repository is managed on disk (remove "
        f"{entry.path if entry else name} and the next rescan drops it)"
    )


async def _not_offered(request: web.Request) -> web.Response:
    raise Unsupported(f"{request.path} is not supported by edged (models come from its repository)")


async def root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")


async def version(request: web.Request) -> web.Response:
    from daemon import __version__

    return _json_response({"version": OLLAMA_VERSION, "edged": __version__})


def add_routes(app: web.Application) -> None:
    app[_METADATA] = GgufMetadata()
    r = app.router
    r.add_get("/", root)  # also answers HEAD
    r.add_get("/api/version", version)
    r.add_get("/api/tags", tags)
    r.add_get("/api/ps", ps)
    r.add_post("/api/show", show)
    r.add_post("/api/chat", chat)
    r.add_post("/api/generate", generate)
    r.add_post("/api/embed", embed)
    r.add_post("/api/embeddings", embeddings)
    r.add_post("/api/pull", pull)
    r.add_delete("/api/delete", delete)
    for path in ("/api/copy", "/api/create", "/api/push"):
        r.add_post(path, _not_offered)
    r.add_route("*", "/api/blobs/{digest}", _not_offered)
