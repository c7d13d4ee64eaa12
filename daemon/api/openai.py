"""OpenAI-compatible routes (`/v1/models`, completions, chat, embeddings) and Triton's generate
extension, on top of a generation backend's `generate` / `chat_prompt` / `embed`.

Streaming is Server-Sent Events ending in `data: [DONE]`. A client that disconnects cancels its
sequence: aiohttp cancels the handler, and closing the chunk iterator tells the engine.

Every field a request may carry either has its effect or is a 400 naming it (unknown fields
are rejected by the decoders, `forbid_unknown_fields`); ranges are OpenAI's: temperature
[0, 2], top_p [0, 1], presence/frequency penalty [-2, 2], logit_bias values [-100, 100].
llama-server's extensions `top_k`, `min_p`, `typical_p`, `repeat_penalty`, `repeat_last_n`,
`ignore_eos`, `cache_prompt`, `n_cache_reuse` and its other samplers (Mirostat, dynamic
temperature, top-n-sigma, XTC, DRY, `min_keep`) and their order (`samplers`) are taken too,
with llama-server's meaning.
Its per-request `lora` (adapter scales) is checked against the model's adapters
(`lora_request`) and decoded with.

`n` choices are `n` sequences in the engine, run side by side as separate requests would be
(choice i samples with `seed + i` when a seed is given, so that the choices differ and the
response is reproducible); streamed, their chunks interleave, each with its choice's `index`.
A completions request with a list of prompts is a batch: `n` choices for each, in order.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

import msgspec
import numpy as np
from aiohttp import web

from daemon.api import dimensions, openai_tools, reasoning, sampling
from daemon.api import generate as generate_tensor
from daemon.api.body import read_body
from daemon.api.errors import error_body
from daemon.api.leases import hold, use
from daemon.api.state import daemon_of
from daemon.api.timings import Clock, progress_json, timings
from daemon.api.tool_syntax import syntax_named
from daemon.backend import GenerateChunk, GenerateParams, TokenLogprob
from daemon.core.model import LoadedVersion
from daemon.errors import EdgedError, InvalidArgument, NotFound, Unavailable

_json = msgspec.json.Encoder()
T = TypeVar("T")
# OpenAI's upper bound on `n` (choices per request).
MAX_CHOICES = 128


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class StreamOptions(_Strict):
    include_usage: bool = False
    # OpenAI pads stream events with random text against size side channels unless this is
    # false; no event here is padded, so false is what this server does and true a 400.
    include_obfuscation: bool | None = None


class LoraScale(_Strict):
    """An entry of llama-server's per-request `lora`: an adapter's id (GET /lora-adapters)
    and the scale asked for it."""

    id: int
    scale: float


# A request's logit_bias, in llama-server's two forms (logit_bias_of).
LogitBias = dict[str, float | bool] | list[tuple[int | str, float | bool]]


class SharedSampling(_Strict, kw_only=True):
    """The sampling fields the OpenAI routes share with llama-server's own /completion and
    /infill (daemon.api.llama_completion), by the same names: `_params` reads them for both."""

    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions llama.cpp's server also accepts.
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    # The window of recent tokens every penalty counts (-1: the whole context, 0: none).
    # Unset, OpenAI's penalties count the whole context and repeat_penalty the last 64.
    repeat_last_n: int | None = None
    # Never end on an end-of-generation token (benchmark clients send it for fixed lengths).
    ignore_eos: bool | None = None
    # False: evaluate the whole prompt, whatever the slot's cache holds (default true).
    cache_prompt: bool | None = None
    # llama-server's cache reuse (GenerateParams.n_cache_reuse); unset: the model's.
    n_cache_reuse: int | None = None
    # llama-server's other samplers (GenerateParams says what each does).
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    min_keep: int | None = None
    # The samplers' order: names or a string of one-letter codes (sampling.sampler_order).
    samplers: list[str] | str | None = None
    # llama-server's LoRA scales for this request; only the model's own here (lora_request).
    lora: list[LoraScale] | None = None
    # llama-server's slot for this request (GenerateParams.id_slot); -1 or none: any.
    id_slot: int | None = None
    # llama-server's sampling on the GPU backend: false (what the engine does) or a 400.
    backend_sampling: bool | None = None
    # llama-server's context shift (GenerateParams.n_keep): a 400 from a model without it.
    n_keep: int | None = None
    n_discard: int | None = None


class _Sampling(SharedSampling):
    """Fields shared by completions and chat completions (OpenAI names)."""

    # "" (or left out): the one generation model loaded, as a single-model llama-server
    # answers whatever a client names (llama.vim sends "" by default); see generation_model.
    model: str = ""
    # None: until the context is full (OpenAI's and llama-server's default).
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # llama-server's name for the limit, which its OpenAI routes take too: 0 evaluates the
    # prompt into a slot's cache and generates nothing (llama.vim's warm-up requests).
    n_predict: int | None = None
    # llama-server's /completion answer filter. Its OpenAI routes take it and answer whole,
    # and so do these (clients send one body to both kinds of route).
    response_fields: list[str] | None = None
    # Choices per request (1..MAX_CHOICES), each its own sequence in the engine. OpenAI's
    # schema makes these nullable (null: the default), and its client sends null for None.
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # llama-server's stream extensions: `prompt_progress` chunks while the prompt is evaluated
    # (streamed only: a whole answer has nowhere to put them, as there), and `timings` (its
    # counts, times and rates so far) on every chunk, or on a whole answer of one choice.
    return_progress: bool = False
    timings_per_token: bool = False
    # Seconds of silence in a stream after which an SSE comment goes out (llama-server's
    # sse_ping_interval; -1 or 0: none, as when it is left out).
    sse_ping_interval: int | None = None
    # Bias added to a token's logit: OpenAI's {"token id": bias}, or llama-server's forms, which
    # its OpenAI routes take too (see logit_bias_of).
    logit_bias: LogitBias | None = None
    # End-user id for abuse tracking at OpenAI; it changes no output there either.
    user: str | None = None


class CompletionRequest(_Sampling):
    # A string, token ids, or a batch (n choices each): a list of strings or of token-id lists.
    # msgspec allows one list type in a union; completions() checks the elements.
    prompt: str | list[str | int | list[int]] = ""
    echo: bool | None = None
    # Fill-in-the-middle: the text after the completion (models with FIM tokens; else 400).
    suffix: str | None = None
    # Log probabilities of the generated tokens and this many alternatives: 0..20 (OpenAI
    # allows 5; lm-eval-harness's older local-completions asks for 10, vLLM allows 20).
    logprobs: int | None = None
    # llama-server's name for it, where 0 is none.
    n_probs: int | None = None
    # Candidates generated per prompt (n..MAX_CHOICES), of which the n with the highest mean
    # log probability per token are returned (OpenAI's legacy completions). Not with stream.
    best_of: int | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's result answering one call.
    tool_calls: list[openai_tools.ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning as this server returned it (llama-server's field): back
    # to the template, which shows it to the model where it was trained to see it.
    reasoning_content: str | None = None
    # The rest of a reply as the openai client sends it back when the reply is appended to the
    # next request's messages (its documented tool-call loop, with `parse` and `stream`):
    # fields this server never fills, taken empty only (chat_messages), and `parsed`, the
    # client's own decoding of `content`, which holds the same text.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    parsed: Any = None


class JsonSchemaFormat(_Strict):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    # Enforced by grammar either way: the output always matches the schema.
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = []
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    # Alternatives per token (0..20); needs logprobs.
    top_logprobs: int | None = None
    # llama-server's: n > 0 is logprobs with n alternatives per token (0..20); 0 is none.
    n_probs: int | None = None
    # llama-server's: the logprobs entries give probabilities after the samplers (`prob`,
    # `top_probs`: the candidates the token was drawn from) instead of log probabilities.
    post_sampling_probs: bool = False
    tools: list[openai_tools.Tool] | None = None
    tool_choice: openai_tools.ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # False (or null): the completion is not kept for later retrieval, which is all this
    # server does; true is a 400 (clients that opt out of OpenAI's storage send false).
    store: bool | None = None
    # A routing hint for OpenAI's prompt cache: every request here goes to the slot holding the
    # longest common prefix of its prompt, which is what the key asks for.
    prompt_cache_key: str | None = None
    # End-user id for abuse tracking at OpenAI (`user`'s successor); it changes no output.
    safety_identifier: str | None = None
    # llama-server's (and vLLM's) extension: more variables for the model's Jinja chat
    # template, e.g. {"enable_thinking": false} for templates that read it.
    chat_template_kwargs: dict[str, Any] | None = None
    # llama-server's: a thinking model's reasoning in `reasoning_content` ("deepseek"; "auto",
    # the default, means the same here) or left in `content` with its tags ("none").
    reasoning_format: str | None = None
    # OpenAI's; the chat template's `reasoning_effort` (gpt-oss's), as llama-server passes it.
    reasoning_effort: str | None = None
    # llama-server's reasoning budget (tokens; -1: none; `thinking_budget_tokens` its other
    # name) and the message written before the forced closing tag.
    reasoning_budget_tokens: int | None = None
    thinking_budget_tokens: int | None = None
    reasoning_budget_message: str | None = None
    # llama-server's: the reasoning can be ended while the completion runs (POST
    # /v1/chat/completions/control with its id; chat_control).
    reasoning_control: bool = False
    # llama-server's continuation of the last (assistant) message (chat_prompt):
    # true, "content" or "reasoning_content"; with it, add_generation_prompt must be false.
    continue_final_message: bool | str | None = None
    add_generation_prompt: bool | None = None


class EmbeddingRequest(_Strict):
    # A string, strings, token ids (one input) or lists of token ids (one input each): OpenAI's
    # four forms, in one type a msgspec union can hold; `_embedding_inputs` sorts them out.
    input: str | list[str | int | list[int]]
    model: str = ""  # "": the one generation model loaded (sole_generation_model), as llama-server
    # The openai client asks for base64 (float32 little-endian) unless told otherwise.
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    dimensions: int | None = None


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Triton's generate extension: text_input plus sampling fields at the top level."""

    text_input: str
    # None: until the context is full.
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    # Triton's generate extension allows a `parameters` object; none is implemented here,
    # so a non-empty one is a 400 rather than ignored.
    parameters: dict[str, Any] = {}


class ControlRequest(_Strict):
    """llama-server's /v1/chat/completions/control (chat_control)."""

    model: str
    id: str  # the chat completion's, as its answer or stream gave it
    action: Literal["reasoning_end"]


# Built once: decoders are immutable and cost a schema walk to make.
_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(kind)
    for kind in (CompletionRequest, ChatRequest, EmbeddingRequest, GenerateRequest, ControlRequest)
}


def _decode(body: bytes, kind: type[Any]) -> Any:
    return decode_with(_DECODERS[kind], body)


def decode_with(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """A request body through its decoder; what does not decode is a 400 saying where."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed JSON body: {exc}") from None


def in_range(name: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidArgument(f"{name} must be between {low:g} and {high:g}, got {value}")


def _max_tokens(req: _Sampling | GenerateRequest, minimum: int) -> int | None:
    """The output limit, from max_completion_tokens (OpenAI's current name) or max_tokens."""
    field, value = "max_tokens", req.max_tokens
    if isinstance(req, _Sampling):
        given = {name: v for name, v in (("max_tokens", req.max_tokens), ("n_predict", req.n_predict),
                                         ("max_completion_tokens", req.max_completion_tokens)) if v is not None}
        if len(set(given.values())) > 1:
            raise InvalidArgument(f"{' and '.join(given)} disagree; send one of them")
        if given:
            field, value = list(given.items())[-1]
        if field == "n_predict":
            minimum = 0  # llama-server's: the prompt into the cache, nothing generated
    if value == -1:
        return None  # llama-server's "no limit" (its web UI sends it), as leaving it out
    if value is not None and value < minimum:
        raise InvalidArgument(f"{field} must be >= {minimum} (or -1: no limit), got {value}")
    return value


def _params(req: _Sampling | GenerateRequest, *, min_tokens: int = 1) -> GenerateParams:
    params = GenerateParams(max_tokens=_max_tokens(req, min_tokens))
    if isinstance(req, _Sampling):
        if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
            raise InvalidArgument(f"n must be between 1 and {MAX_CHOICES}, got {req.n}")
        if req.stream_options is not None and not req.stream:
            raise InvalidArgument("stream_options: only allowed when stream is true")
        if req.stream_options is not None and req.stream_options.include_obfuscation:
            raise InvalidArgument("stream_options.include_obfuscation: not supported (omit it or set it to false)")
        params.return_progress = req.return_progress and bool(req.stream)
        check_ping_interval(req.sse_ping_interval)
        if req.min_p is not None:
            in_range("min_p", req.min_p, 0.0, 1.0)
            params.min_p = req.min_p
        if req.typical_p is not None:
            in_range("typical_p", req.typical_p, 0.0, 1.0)
            params.typical_p = req.typical_p
        if req.repeat_penalty is not None:
            if not req.repeat_penalty > 0:
                raise InvalidArgument(f"repeat_penalty must be > 0, got {req.repeat_penalty}")
            params.repeat_penalty = req.repeat_penalty
        params.ignore_eos = bool(req.ignore_eos)
        params.cache_prompt = req.cache_prompt is not False
        if req.n_cache_reuse is not None:
            if req.n_cache_reuse < 0:
                raise InvalidArgument(f"n_cache_reuse must be >= 0, got {req.n_cache_reuse}")
            params.n_cache_reuse = req.n_cache_reuse
        if req.repeat_last_n is not None:
            params.penalty_last_n = sampling.count(req.repeat_last_n, "repeat_last_n", -1, "-1 (the context) or ")
        if req.presence_penalty is not None:
            in_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
            params.presence_penalty = req.presence_penalty
        if req.frequency_penalty is not None:
            in_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
            params.frequency_penalty = req.frequency_penalty
        if req.id_slot is not None:
            params.id_slot = req.id_slot  # the backend checks it against the model's slots
        if req.backend_sampling:
            raise InvalidArgument("backend_sampling: not supported (the engine samples on the CPU); omit it or send false")
        _llama_samplers(req, params)
    if req.temperature is not None:
        in_range("temperature", req.temperature, 0.0, 2.0)
        params.temperature = req.temperature
        params.greedy = req.temperature == 0
    if req.top_p is not None:
        in_range("top_p", req.top_p, 0.0, 1.0)
        params.top_p = req.top_p
    if req.top_k is not None:
        params.top_k = sampling.count(req.top_k, "top_k", 0)
    params.seed = sampling.seed(req.seed, "seed")
    if req.stop is not None:
        params.stop = sampling.stop_strings(req.stop, "stop")
    return params


def lora_request(model: LoadedVersion, entries: list[LoraScale] | None) -> tuple[tuple[int, float], ...]:
    """llama-server's per-request `lora`, checked against the model's adapters: (id, scale)
    by id, which generation_settings echoes and the engine decodes with. None or [] is the
    model's current scales; an adapter the list leaves out gets scale 0 (the engine reads it
    so). An id with no adapter (llama-server ignores it) and an id given twice (llama-server
    keeps the last) are 400s; JSON has no scale that is not a finite number (the decoder
    refuses 1e999)."""
    if not entries:
        return ()
    return lora_scales(model, entries, "lora")


def lora_scales(model: LoadedVersion, entries: list[LoraScale], field: str) -> tuple[tuple[int, float], ...]:
    """`entries` as (id, scale) by id, each id one of the model's adapters, once; errors name
    `field[index]`."""
    adapters = model.require_generator().lora_adapters()
    asked: dict[int, float] = {}
    for index, entry in enumerate(entries):
        if not 0 <= entry.id < len(adapters):
            has = f"ids 0 to {len(adapters) - 1}" if adapters else "none (its parameters lora would load them)"
            raise InvalidArgument(
                f"{field}[{index}]: model '{model.name}' has no LoRA adapter with id {entry.id}; its adapters: {has} "
                f"(GET /lora-adapters?model={model.name})"
            )
        if entry.id in asked:
            raise InvalidArgument(f"{field}[{index}]: adapter id {entry.id} given twice")
        asked[entry.id] = entry.scale
    return tuple(sorted(asked.items()))


def _budget_tokens(req: ChatRequest) -> int | None:
    """The reasoning budget asked for under either of llama-server's names (None: none)."""
    given = {k: v for k, v in (("reasoning_budget_tokens", req.reasoning_budget_tokens),
                               ("thinking_budget_tokens", req.thinking_budget_tokens)) if v is not None}
    if len(set(given.values())) > 1:
        raise InvalidArgument("reasoning_budget_tokens and thinking_budget_tokens disagree; send one of them")
    return next(iter(given.values()), None)


# llama.cpp cuts a longer DRY sequence breaker to its first 40 bytes (with a log line only).
_MAX_BREAKER_BYTES = 40


def _llama_samplers(req: _Sampling, params: GenerateParams) -> None:
    """llama-server's other samplers, checked where a value would be changed or mean nothing
    (llama-server clamps some and replaces a DRY base below 1 with its default: a 400 here)."""
    if req.mirostat is not None:
        if req.mirostat not in (0, 1, 2):
            raise InvalidArgument(f"mirostat must be 0 (off), 1 or 2, got {req.mirostat}")
        params.mirostat = req.mirostat
    for name in ("mirostat_tau", "mirostat_eta", "dynatemp_range", "dry_multiplier"):
        value = getattr(req, name)
        if value is not None:
            _at_least(name, value, 0.0)
            setattr(params, name, value)
    for name in ("dynatemp_exponent", "top_n_sigma"):
        value = getattr(req, name)
        if value is not None:
            if not math.isfinite(value):
                raise InvalidArgument(f"{name} must be a finite number, got {value}")
            setattr(params, name, value)
    for name in ("xtc_probability", "xtc_threshold"):
        value = getattr(req, name)
        if value is not None:
            in_range(name, value, 0.0, 1.0)
            setattr(params, name, value)
    if req.dry_base is not None:
        _at_least("dry_base", req.dry_base, 1.0)
        params.dry_base = req.dry_base
    if req.n_keep is not None:
        params.n_keep = sampling.count(req.n_keep, "n_keep", -1, "-1 (the prompt) or ")
    for name in ("dry_allowed_length", "min_keep", "n_discard"):
        value = getattr(req, name)
        if value is not None:
            setattr(params, name, sampling.count(value, name, 0))
    if req.dry_penalty_last_n is not None:
        params.dry_penalty_last_n = sampling.count(req.dry_penalty_last_n, "dry_penalty_last_n", -1,
                                                   "-1 (the context) or ")
    if req.dry_sequence_breakers is not None:
        if not req.dry_sequence_breakers:
            raise InvalidArgument("dry_sequence_breakers must be a non-empty list of strings")
        for index, breaker in enumerate(req.dry_sequence_breakers):
            size = len(breaker.encode("utf-8", "surrogatepass"))
            if not breaker or "\0" in breaker or size > _MAX_BREAKER_BYTES:
                raise InvalidArgument(
                    f"dry_sequence_breakers[{index}] must be 1 to {_MAX_BREAKER_BYTES} bytes of UTF-8 "
                    f"without NUL, got {breaker!r}"
                )
        params.dry_sequence_breakers = list(req.dry_sequence_breakers)
    params.samplers = sampling.sampler_order(req.samplers)


def _at_least(name: str, value: float, low: float) -> None:
    if not (math.isfinite(value) and value >= low):
        raise InvalidArgument(f"{name} must be a finite number >= {low:g}, got {value}")


async def logit_bias_of(model: LoadedVersion, biases: LogitBias) -> dict[int, float]:
    """Token id -> bias from a request's `logit_bias`, in either of llama-server's forms:
    `{"id or text": bias}` (OpenAI's, with ids only) or `[[id or text, bias], ...]`; a text
    biases each of its tokens, as llama-server tokenizes it, and biases of one token add up.
    A bias of `false` is llama-server's ban (-inf: the token is never sampled); `true` means
    nothing there (it skips the pair), and is a 400 here."""
    pairs: list[tuple[int | str, float | bool]]
    pairs = list(biases.items()) if isinstance(biases, dict) else list(biases)
    out: dict[int, float] = {}
    for key, value in pairs:
        token: int | None = key if isinstance(key, int) else None
        if isinstance(key, str) and key.strip() == key and key.lstrip("-").isdigit():
            token = int(key)
        where = f"logit_bias[{key if token is not None else repr(key)}]"
        if value is True:
            raise InvalidArgument(f"{where}: true is not a bias; a bias is a number in [-100, 100], or false to ban the token")
        if value is False:
            bias = -math.inf
        else:
            bias = float(value)
            in_range(where, bias, -100.0, 100.0)
        if token is not None:
            tokens = [token]  # the engine answers a 400 for an id outside the vocabulary
        else:
            assert isinstance(key, str)
            tokens = await model.tokenize(key, add_special=False, parse_special=False)
        for each in tokens:
            # As llama-server's sampler adds each pair's bias: a token a text holds twice, or
            # that two pairs name, gets both.
            out[each] = out.get(each, 0.0) + bias
    total = next(((t, b) for t, b in out.items() if not -100.0 <= b <= 100.0 and b != -math.inf), None)
    if total is not None:
        raise InvalidArgument(
            f"logit_bias: the biases of token {total[0]} add up to {total[1]:g}; a token's bias must be in [-100, 100]"
        )
    return out


async def request_body(request: web.Request) -> bytes:
    return await read_body(request, daemon_of(request).config.server.max_request_bytes)


def sole_generation_model(request: web.Request) -> str:
    """The name a request without one (`model` "" or left out) means: the one generation model
    loaded, as a llama-server serving one model answers whatever a client names there (llama.vim
    sends "" unless told a name). With none or several loaded, a 400 naming the field."""
    names = sorted({v.name for v in daemon_of(request).registry.loaded() if v.generator is not None})
    if len(names) != 1:
        loaded = f"the generation models loaded are {', '.join(repr(n) for n in names)}" if names else "none is loaded"
        raise InvalidArgument(f"model: required here ({loaded})")
    return names[0]


def not_loaded(request: web.Request, name: str) -> bool:
    """Whether `name` is a model of the repository with no version loaded now (an on-demand
    one, say): what a request that must not load it answers for without asking it."""
    entry = daemon_of(request).registry.entry(name)
    return entry is not None and not entry.versions


async def generation_model(request: web.Request, name: str, version: str | None = None) -> LoadedVersion:
    """Resolve the model once; every later step of the request talks to this version."""
    daemon = daemon_of(request)
    if not daemon.accepting:
        raise Unavailable("server is shutting down")
    if not name:
        name = sole_generation_model(request)
    await hold(request, name)  # loads an on-demand model; held until the response is done
    model = use(request, daemon.registry.get(name, version))
    model.require_generator()
    return model


async def collect(chunks: AsyncIterator[GenerateChunk]) -> tuple[str, GenerateChunk]:
    """The whole text, and the last chunk carrying every chunk's logprobs."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    last = GenerateChunk(text="")
    async for chunk in chunks:
        parts.append(chunk.text)
        logprobs.extend(chunk.logprobs)
        last = chunk
    if logprobs:
        last = msgspec.structs.replace(last, logprobs=logprobs)
    return "".join(parts), last


async def first_chunk(chunks: AsyncIterator[GenerateChunk]) -> GenerateChunk | None:
    """Pull the first chunk before answering, so queue-full and bad prompts get a real status."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def feed_chunks(
    first: GenerateChunk | None,
    chunks: AsyncIterator[GenerateChunk],
    feed: Callable[[GenerateChunk], None],
    flush: Callable[[], Awaitable[None]] | None = None,
) -> GenerateChunk:
    """Feed a generation's chunks in order: `first` (pulled before the status, first_chunk),
    then the rest, awaiting `flush` after each (a stream sends its events). The last chunk (an
    empty one for none)."""
    last = GenerateChunk(text="")
    pending = [first] if first is not None else []
    while True:
        for chunk in pending:
            last = chunk
            feed(chunk)
            if flush is not None:
                await flush()
        try:
            pending = [await anext(chunks)]
        except StopAsyncIteration:
            return last


def _choices(
    model: LoadedVersion, prompts: Sequence[str | list[int]], params: GenerateParams, per_prompt: int,
    field: str = "n",
) -> list[AsyncGenerator[GenerateChunk, None]]:
    """One generation per choice: `per_prompt` (OpenAI's `n`) for each prompt, in OpenAI's
    order (prompt by prompt). With a seed, a prompt's choice i samples with seed + i: its
    choices differ, as OpenAI's independent samples do, and each prompt's are what it would
    get alone."""
    total = per_prompt * len(prompts)
    if params.seed is not None and params.seed + per_prompt - 1 > sampling.MAX_SEED:
        raise InvalidArgument(
            f"seed: with {field} {per_prompt}, choice i samples with seed + i, which must stay <= {sampling.MAX_SEED}"
        )
    if total > 1:
        engine = model.require_generator().engine_stats()
        room = int(engine.get("slots", 0)) + int(engine.get("max_queue", 0))
        if room and total > room:
            # Never a 503: retrying cannot help a request the engine can never hold.
            what = f"{total} choices" + (f" ({len(prompts)} prompts x {per_prompt})" if len(prompts) > 1 else "")
            raise InvalidArgument(
                f"{field}: {what} are more than model '{model.name}' takes at once ({room}: its slots and "
                "max_queue); ask for fewer or raise the model's max_queue"
            )
    out = []
    for prompt in prompts:
        for i in range(per_prompt):
            seeded = params if i == 0 or params.seed is None else msgspec.structs.replace(params, seed=params.seed + i)
            if i > 0 and params.id_slot >= 0:
                # As llama-server's child tasks: a prompt's first choice goes to the slot named
                # (its cache is that conversation's), the others to any slot (llama.vscode asks
                # for 3 completions in slot 0).
                seeded = msgspec.structs.replace(seeded, id_slot=-1)
            out.append(model.generate(prompt, seeded))
    return out


async def _all(steps: list[Any]) -> list[Any]:
    """Await the choices' steps together; the first failure is raised once all have ended, so
    that no choice's generator is still running when the caller closes them."""
    if len(steps) == 1:
        return [await steps[0]]
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def joined(first: GenerateChunk | None, collected: tuple[str, GenerateChunk]) -> tuple[str, GenerateChunk]:
    text, last = collected
    if first is None:
        return text, last
    if last.finish_reason is None:
        return first.text + text, first
    if first.logprobs:
        last = msgspec.structs.replace(last, logprobs=first.logprobs + last.logprobs)
    return first.text + text, last


def check_ping_interval(seconds: int | None) -> None:
    if seconds is not None and not -1 <= seconds <= 2**31 - 1:
        raise InvalidArgument(f"sse_ping_interval must be -1 (no pings) or a number of seconds up to 2^31-1, got {seconds}")


def pinged(
    items: AsyncGenerator[T, None], response: web.StreamResponse, interval: int | None
) -> AsyncGenerator[T, None]:
    """`items` as they come; each time none came for `interval` seconds, an SSE comment line
    (`:`, which event-stream readers skip), so that a client or proxy with an idle timeout
    keeps the stream open while the engine is busy (llama-server's sse_ping_interval).
    None, -1 or 0: `items` itself (no layer on the per-token path)."""
    if not interval or interval < 0:
        return items
    return _pinging(items, response, interval)


async def _pinging(items: AsyncGenerator[T, None], response: web.StreamResponse, interval: int) -> AsyncGenerator[T, None]:
    async def following() -> T:
        return await items.__anext__()

    pending: asyncio.Task[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.create_task(following())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                await response.write(b":\n\n")
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # the stream ended early (a client gone, an error)
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending


async def _merged(
    choices: list[AsyncGenerator[GenerateChunk, None]],
) -> AsyncGenerator[tuple[int, GenerateChunk], None]:
    """(choice index, chunk) as each choice produces them."""
    if len(choices) == 1:
        async for chunk in choices[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, GenerateChunk | Exception | None]] = asyncio.Queue()

    async def pump(index: int, chunks: AsyncGenerator[GenerateChunk, None]) -> None:
        try:
            async for chunk in chunks:
                queue.put_nowait((index, chunk))
        except Exception as exc:  # the error of one choice ends the response
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, None))

    pumps = [asyncio.create_task(pump(i, chunks)) for i, chunks in enumerate(choices)]
    try:
        running = len(pumps)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        # A choice still generating when the response ends (an error, a client gone):
        # cancelling its pump closes its generator, which cancels its sequence.
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, payload: object) -> None:
    await response.write(b"data: " + _json.encode(payload) + b"\n\n")


async def _send_all(response: web.StreamResponse, payload: dict[str, Any] | list[dict[str, Any]] | None) -> None:
    """Send one event, several, or none (a chunk held back, e.g. a tool call still forming)."""
    for item in [payload] if isinstance(payload, dict) else payload or []:
        await _send(response, item)


def _sampled(entry: TokenLogprob) -> dict[str, Any]:
    """A logprobs entry of post_sampling_probs (GenerateParams.post_sampling_probs)."""
    return {"id": entry.token_id, "token": token_text(entry), "bytes": list(entry.piece), "prob": math.exp(entry.logprob)}


def token_text(entry: TokenLogprob) -> str:
    # A token holding part of a UTF-8 character shows as U+FFFD; `bytes` has the truth.
    return entry.piece.decode("utf-8", errors="replace")


def _usage(lasts: Sequence[GenerateChunk], per_prompt: int = 1) -> dict[str, Any]:
    """Usage of a response from each choice's last chunk (`per_prompt` choices a prompt, in
    order): each prompt once (OpenAI's count for several choices), the completions summed."""
    firsts = lasts[::per_prompt]
    prompt, completion = sum(c.prompt_tokens for c in firsts), sum(c.completion_tokens for c in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # OpenAI's and llama-server's field for prompt tokens served from the cache.
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)},
    }


# ---------------------------------------------------------------------------- /v1/models


async def _model_card(model: LoadedVersion) -> dict[str, Any]:
    card: dict[str, Any] = {"id": model.name, "object": "model", "created": 0, "owned_by": f"edged/{model.backend}"}
    if model.generator is not None:
        try:
            props = await model.generator.props()
        except EdgedError:  # a backend that does not describe its model, an embedding model
            return card
        if props.n_vocab:
            # llama-server's `meta` (clients such as llama.vscode read the context from it).
            card["meta"] = {
                "vocab_type": props.vocab_type, "n_vocab": props.n_vocab, "n_ctx": props.n_ctx,
                "n_ctx_train": props.n_ctx_train, "n_embd": props.n_embd, "n_params": props.n_params,
                "size": props.size, "ftype": props.ftype,
            }
    return card


async def list_models(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    data = [await _model_card(m) for m in daemon.registry.loaded()]
    if daemon.residency is not None:  # not loaded yet, but the first request loads them
        data += [{"id": n, "object": "model", "created": 0, "owned_by": "edged"}
                 for n in daemon.residency.on_demand_models()]
    unique = list({d["id"]: d for d in reversed(data)}.values())
    return web.Response(body=_json.encode({"object": "list", "data": unique}), content_type="application/json")


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the card `GET /v1/models` lists for it; 404 (unknown model) otherwise."""
    daemon = daemon_of(request)
    name = request.match_info["model"]
    try:
        card = await _model_card(daemon.registry.get(name))
    except NotFound:
        if daemon.residency is None or name not in daemon.residency.on_demand_models():
            raise
        card = {"id": name, "object": "model", "created": 0, "owned_by": "edged"}
    return web.Response(body=_json.encode(card), content_type="application/json")


# ---------------------------------------------------------------------------- completions


async def _stream_or_collect(
    request: web.Request,
    choices: list[AsyncGenerator[GenerateChunk, None]],
    *,
    stream: bool,
    include_usage: bool,
    make_chunk: Any,
    make_final: Any,
    per_prompt: int = 1,
    echo: Callable[[int, GenerateChunk | None], GenerateChunk] | None = None,
    progress: Callable[[int], dict[str, Any]] | None = None,
    timed: bool = False,
    ping: int | None = None,
) -> web.StreamResponse:
    """Answer with every choice's chunks: one JSON body (`make_final` of each choice's text and
    last chunk), or an event stream (`make_chunk(index, chunk)`, choices interleaved as they
    come). The first chunk of every choice comes before the status, so that a full queue or a
    bad prompt is a real 4xx/5xx and not an error inside a 200 stream.

    `echo(index, first chunk)`: the choice's echoed prompt as a chunk (its text, and its
    tokens' logprobs in `prompt_logprobs`), made before the status too: it can be refused.
    `progress(index)`: the event a progress chunk (GenerateParams.return_progress) becomes, to
    which its `prompt_progress` is added. `timed`: llama-server's `timings` on each event, or
    on a whole answer of one choice. `ping`: see `pinged`."""
    if timed and not stream and len(choices) > 1:
        raise InvalidArgument(
            "timings_per_token: a whole answer carries one choice's timings; ask for one (n 1, one prompt) or stream it"
        )
    clocks = [Clock(started=time.monotonic()) for _ in choices]
    async with contextlib.AsyncExitStack() as stack:
        for chunks in choices:
            await stack.enter_async_context(contextlib.aclosing(chunks))
        firsts = await _all([first_chunk(chunks) for chunks in choices])
        echoes = [echo(index, first) for index, first in enumerate(firsts)] if echo else []
        # The engine's prompt scores reach the client through the echo chunk alone.
        firsts = [
            msgspec.structs.replace(first, prompt_logprobs=[]) if first is not None and first.prompt_logprobs else first
            for first in firsts
        ]
        if not stream:
            if timed and firsts[0] is not None:
                clocks[0].add(firsts[0])
            collected = await _all([collect(chunks) for chunks in choices])
            results = [joined(first, got) for first, got in zip(firsts, collected, strict=True)]
            for index, echoed in enumerate(echoes):
                text, last = results[index]
                results[index] = echoed.text + text, msgspec.structs.replace(last, prompt_logprobs=echoed.prompt_logprobs)
            final = make_final(results)
            if timed:
                clock = clocks[0]
                clock.last, clock.ended_at = results[0][1], time.monotonic()
                final["timings"] = timings(clock)
            return web.Response(body=_json.encode(final), content_type="application/json")
        response = await start_sse(request)
        lasts = [GenerateChunk(text="") for _ in choices]

        async def deliver(index: int, chunk: GenerateChunk) -> None:
            clock = clocks[index]
            if timed:
                clock.add(chunk)
            if chunk.prompt_progress is not None:
                if progress is not None:
                    event = progress(index)
                    event["prompt_progress"] = progress_json(chunk.prompt_progress)
                    if timed:
                        event["timings"] = timings(clock, chunk.prompt_progress)
                    await _send(response, event)
                return
            lasts[index] = chunk
            if chunk.text or chunk.finish_reason:
                events = make_chunk(index, chunk)
                if timed and events:
                    stamp = timings(clock)
                    for event in [events] if isinstance(events, dict) else events:
                        event["timings"] = stamp
                await _send_all(response, events)

        try:
            for index, first in enumerate(firsts):
                if echoes:
                    # The echoed prompt streams first, as its own chunk (OpenAI and llama-server).
                    await _send_all(response, make_chunk(index, echoes[index]))
                if first is not None:
                    await deliver(index, first)
            async with contextlib.aclosing(_merged(choices)) as merged, \
                    contextlib.aclosing(pinged(merged, response, ping)) as arriving:
                async for index, chunk in arriving:
                    await deliver(index, chunk)
        except EdgedError as exc:
            # The 200 went out with the first event: the error is the stream's last event
            # (a second response on this connection would corrupt it).
            await _send(response, error_body(exc.status, exc.message, request.path))
            await response.write_eof()
            return response
        if include_usage:
            final = make_chunk(0, GenerateChunk(text=""), usage_only=True)
            final["usage"] = _usage(lasts, per_prompt)
            await _send(response, final)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def completions(request: web.Request) -> web.StreamResponse:
    req: CompletionRequest = _decode(await request_body(request), CompletionRequest)
    model = await generation_model(request, req.model)
    prompts: list[str | list[int]]
    if isinstance(req.prompt, str):
        prompts = [req.prompt]
    elif req.prompt and all(isinstance(p, int) for p in req.prompt):
        prompts = [[p for p in req.prompt if isinstance(p, int)]]
    elif req.prompt and all(isinstance(p, str) for p in req.prompt):
        prompts = [str(p) for p in req.prompt]  # a batch: n choices for each, in order
    elif req.prompt and all(isinstance(p, list) and p for p in req.prompt):
        prompts = [p for p in req.prompt if isinstance(p, list)]  # a batch of token ids
    else:
        raise InvalidArgument(
            "prompt: a string, token ids, or a list of strings or of token-id lists (not empty, not mixed)"
        )
    if req.n_probs is not None:
        req.logprobs = sampling.n_probs(req.n_probs, req.logprobs) or None
    # Completions accept max_tokens 0 (OpenAI's legacy API: with echo, the prompt alone).
    params = _params(req, min_tokens=0)
    params.lora = lora_request(model, req.lora)
    if req.logit_bias:
        params.logit_bias = await logit_bias_of(model, req.logit_bias)
    if req.logprobs is not None:
        if not 0 <= req.logprobs <= 20:
            raise InvalidArgument(f"logprobs must be between 0 and 20, got {req.logprobs}")
        params.logprobs = req.logprobs
    if req.echo and (req.logprobs is not None or not isinstance(prompts[0], str)):
        # The prompt's own tokens, scored (OpenAI's echo with logprobs, lm-eval-harness's
        # loglikelihood) and, for a prompt of token ids, the text to echo.
        params.prompt_logprobs = req.logprobs or 0
    if params.prompt_logprobs is not None and params.return_progress:
        # The echo is made from the scored prompt, which comes only after the prompt is read:
        # the progress of reading it would all come after it was read.
        raise InvalidArgument("return_progress: not with echo of logprobs or of a token-id prompt")
    params.suffix = req.suffix
    n = req.n or 1
    # Generations per prompt: best_of candidates, of which the n best are returned.
    per_prompt = req.best_of if req.best_of is not None else n
    if not n <= per_prompt <= MAX_CHOICES:
        raise InvalidArgument(f"best_of must be between n ({n}) and {MAX_CHOICES}, got {req.best_of}")
    ranked = per_prompt > n
    if ranked:
        if req.stream:
            raise InvalidArgument("best_of: cannot be used with stream (the best are known only at the end)")
        if params.logprobs is None:
            params.logprobs = 0  # the ranking reads each generated token's log probability
    choices = _choices(model, prompts, params, per_prompt, "best_of" if ranked else "n")
    offset = [0 for _ in choices]  # per choice: text_offset of its next token
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def echo(index: int, first: GenerateChunk | None) -> GenerateChunk:
        """Choice `index`'s prompt as echoed: its text, and its tokens' logprobs if asked."""
        prompt = prompts[index // per_prompt]
        entries = first.prompt_logprobs if first is not None else []
        if isinstance(prompt, str):
            text = prompt
        else:
            try:
                text = b"".join(entry.piece for entry in entries).decode()
            except UnicodeDecodeError:
                raise InvalidArgument(
                    f"echo: the token ids of prompt {index // per_prompt} do not make whole UTF-8 text"
                ) from None
        return GenerateChunk(text=text, prompt_logprobs=entries if req.logprobs is not None else [])

    def completion_logprobs(index: int, chunk: GenerateChunk) -> dict[str, Any] | None:
        """OpenAI's legacy layout: parallel lists, alternatives as {token: logprob}; an echoed
        prompt's tokens first, the very first of them null (as OpenAI, llama-cpp-python)."""
        if req.logprobs is None:
            return None
        entries = chunk.prompt_logprobs + chunk.logprobs
        tokens, offsets, values, tops = [], [], [], []
        for position, entry in enumerate(entries):
            tokens.append(token_text(entry))
            offsets.append(offset[index])
            offset[index] += len(tokens[-1])
            scored = position > 0 or not chunk.prompt_logprobs
            values.append(entry.logprob if scored else None)
            tops.append({token_text(t): t.logprob for t in entry.top} if scored else None)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def make_chunk(index: int, chunk: GenerateChunk, usage_only: bool = False) -> dict[str, Any]:
        entries = [] if usage_only else [{
            "index": index, "text": chunk.text, "logprobs": completion_logprobs(index, chunk),
            "finish_reason": chunk.finish_reason,
        }]
        return {"id": ident, "object": "text_completion", "created": created, "model": model.name, "choices": entries}

    def make_final(results: list[tuple[str, GenerateChunk]]) -> dict[str, Any]:
        kept = list(range(len(results)))
        if ranked:
            # Per prompt, its n candidates with the highest mean log probability per token,
            # best first (a tie keeps the earlier candidate).
            kept = [
                index
                for start in range(0, len(results), per_prompt)
                for index in sorted(range(start, start + per_prompt), key=lambda i: -_mean_logprob(results[i][1]))[:n]
            ]
        return {
            "id": ident, "object": "text_completion", "created": created, "model": model.name,
            "choices": [
                {
                    "index": index, "text": results[generation][0],
                    "logprobs": completion_logprobs(generation, results[generation][1]),
                    "finish_reason": results[generation][1].finish_reason,
                }
                for index, generation in enumerate(kept)
            ],
            # Every candidate's tokens count, as OpenAI bills them.
            "usage": _usage([last for _, last in results], per_prompt),
        }

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _stream_or_collect(
        request, choices, stream=bool(req.stream), include_usage=include_usage,
        make_chunk=make_chunk, make_final=make_final, per_prompt=per_prompt,
        echo=echo if req.echo else None,
        progress=lambda index: make_chunk(index, GenerateChunk(text="")), timed=req.timings_per_token,
        ping=req.sse_ping_interval,
    )


def _mean_logprob(last: GenerateChunk) -> float:
    """Mean log probability of a choice's generated tokens (0 for none: nothing to rank)."""
    return sum(e.logprob for e in last.logprobs) / len(last.logprobs) if last.logprobs else 0.0


# Roles a chat template can take; "developer" is OpenAI's newer name for "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(messages: list[ChatMessage], native_tools: bool = False) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them. `native_tools`: the template
    has its own tool syntax and takes assistants' `tool_calls` and `tool` messages as they
    are; otherwise they become the generic reply's text (openai_tools)."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        for field, value in (("refusal", message.refusal), ("annotations", message.annotations),
                             ("audio", message.audio), ("function_call", message.function_call)):
            if value:
                raise InvalidArgument(f"messages[{index}].{field}: not supported (only null or empty)")
        if message.tool_calls is not None and message.role != "assistant":
            raise InvalidArgument(f"messages[{index}].tool_calls: only on assistant messages")
        if message.tool_call_id is not None and message.role != "tool":
            raise InvalidArgument(f"messages[{index}].tool_call_id: only on tool messages")
        if message.reasoning_content is not None and message.role != "assistant":
            raise InvalidArgument(f"messages[{index}].reasoning_content: only on assistant messages")
        if message.role == "tool":
            if message.tool_call_id is None:
                raise InvalidArgument(f"messages[{index}].tool_call_id: required for role 'tool'")
            if native_tools:
                out.append({"role": "tool", "content": _message_text(message, index),
                            "tool_call_id": message.tool_call_id})
                continue
            content = openai_tools.tool_result_text(
                _message_text(message, index), tool_call_id=message.tool_call_id
            )
            out.append({"role": "user", "content": content})
            continue
        role = _ROLES.get(message.role)
        if role is None:
            raise InvalidArgument(
                f"messages[{index}].role: {message.role!r} is not one of system, developer, user, "
                "assistant, tool"
            )
        if message.content is None and role != "assistant":
            raise InvalidArgument(f"messages[{index}].content: required for role {message.role!r}")
        text = _message_text(message, index)
        entry: dict[str, Any] = {"role": role, "content": text}
        if message.tool_calls:
            decoded = openai_tools.decoded_calls(message.tool_calls, index)  # arguments are JSON
            if native_tools:
                entry["content"] = text if message.content is not None else None
                entry["tool_calls"] = [
                    openai_tools.openai_call(c.id, c.function.name, c.function.arguments)
                    for c in message.tool_calls
                ]
            else:
                calls = openai_tools.calls_text(decoded)
                entry["content"] = f"{text}\n{calls}" if text else calls
        if message.name is not None:
            entry["name"] = message.name
        if message.reasoning_content:
            entry["reasoning_content"] = message.reasoning_content
        out.append(entry)
    return out


_REASONING_FORMATS = ("none", "auto", "deepseek")


def splits_reasoning(value: str | None) -> bool:
    """Whether a reply's reasoning goes apart (`reasoning_format`; a model without thinking
    tags has none to split either way)."""
    if value is not None and value not in _REASONING_FORMATS:
        raise InvalidArgument(
            f"reasoning_format: {value!r} is not one of {', '.join(_REASONING_FORMATS)} "
            "('deepseek-legacy' is not supported)"
        )
    return value != "none"


def _tools_in_use(req: PromptFields) -> list[openai_tools.Tool]:
    """The tools the model may call in this request ([] without tools or with tool_choice none)."""
    if req.tools is None:
        if req.tool_choice is not None:
            raise InvalidArgument("tool_choice: only allowed when tools are specified")
        if req.parallel_tool_calls is not None:
            raise InvalidArgument("parallel_tool_calls: only allowed when tools are specified")
        return []
    if not req.tools:
        raise InvalidArgument("tools: at least one tool is required (omit the field for none)")
    return [] if req.tool_choice == "none" else req.tools


def schema_of_format(fmt: ResponseFormat | None) -> str:
    """The JSON schema (text) response_format asks for; "" for free text."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise InvalidArgument("response_format.json_schema: only with type 'json_schema'")
        return ""
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise InvalidArgument("response_format.json_schema: only with type 'json_schema'")
        return '{"type": "object"}'
    if fmt.json_schema is None:
        raise InvalidArgument("response_format.json_schema: required with type 'json_schema'")
    # No schema: any JSON value's object form, as OpenAI's json_object.
    return json.dumps(fmt.json_schema.schema if fmt.json_schema.schema is not None else {"type": "object"})


# The levels a chat template's `reasoning_effort` takes (gpt-oss's, and OpenAI's names for them).
EFFORTS = ("low", "medium", "high")


def effort_prompt(
    model: LoadedVersion, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None, effort: str | None, field: str,
) -> str:
    """The chat prompt, with `effort` (when given) as the template's `reasoning_effort`, as
    llama-server passes it; a 400 naming `field` for another level or a template that does not
    read it (reasoning.effort_prompt)."""
    if effort is None:
        return model.chat_prompt(messages, template_kwargs=kwargs, tools=tools)
    if effort not in EFFORTS:
        raise InvalidArgument(f"{field}: {effort!r} is not one of {', '.join(EFFORTS)}")
    prompt = reasoning.effort_prompt(
        lambda variables: model.chat_prompt(messages, template_kwargs=variables, tools=tools), kwargs, effort
    )
    if prompt is None:
        raise InvalidArgument(f"{field}: the chat template of model '{model.name}' has no reasoning levels "
                              "(it does not read reasoning_effort)")
    return prompt


def _message_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for i, part in enumerate(message.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidArgument(f"messages[{index}].content[{i}]: only parts of type 'text' are supported")
        if stray := sorted(set(part) - {"type", "text"}):
            raise InvalidArgument(f"messages[{index}].content[{i}].{stray[0]}: not supported in a text part")
        texts.append(part["text"])
    return "".join(texts)


class PromptFields(Protocol):
    """The fields of a chat request that shape its prompt: ChatRequest's, and those of
    llama-server's /apply-template (daemon.api.llama_native), which shows that prompt."""

    messages: list[ChatMessage]
    tools: list[openai_tools.Tool] | None
    tool_choice: openai_tools.ToolChoice | None
    parallel_tool_calls: bool | None
    chat_template_kwargs: dict[str, Any] | None
    reasoning_effort: str | None
    continue_final_message: bool | str | None
    add_generation_prompt: bool | None


@dataclass
class ChatPrompt:
    text: str
    syntax: str  # the model's tool syntax ("" for none)
    use: openai_tools.ToolUse | None  # the tools the model may call, if any
    # When the prompt continues the last assistant message (`continuation`): that message as
    # the model would have written it so far (its reasoning between the template's tags, then
    # its content), which the prompt ends with and the reply begins with; and the same between
    # the bare tags, for the reasoning to be read apart (the whitespace the template writes
    # around a reasoning is the tags', as llama-server reads it).
    prefill: str = ""
    prefill_tagged: str = ""
    # The prompt ends inside the reasoning (a continued message's reasoning goes on).
    inside: bool = False


def continuation(req: PromptFields) -> str | None:
    """How the prompt continues the last message, as llama-server decides it: "content" or
    "reasoning_content" (the message's reasoning is left open), or None for a new assistant
    turn. A trailing assistant message is continued unless told (llama-server's default
    --prefill-assistant); `continue_final_message` asks for it, with add_generation_prompt
    false."""
    given, generation = req.continue_final_message, req.add_generation_prompt
    last = req.messages[-1] if req.messages else None
    if given not in (None, False, True, "content", "reasoning_content"):
        raise InvalidArgument(f"continue_final_message: true, \"content\" or \"reasoning_content\", got {given!r}")
    if given not in (None, False):
        if generation is not False:
            # llama-server's rule (its add_generation_prompt defaults to true).
            raise InvalidArgument("continue_final_message: cannot be used with add_generation_prompt true "
                                  "(send add_generation_prompt false)")
        if last is None or last.role != "assistant":
            raise InvalidArgument("continue_final_message: the last message must be the assistant's, to continue")
    elif last is not None and last.role == "assistant":
        if len(req.messages) >= 2 and req.messages[-2].role == "assistant":
            raise InvalidArgument("messages: cannot have 2 or more assistant messages at the end of the list")
        given = True
    elif generation is False:
        raise InvalidArgument("add_generation_prompt: false is only taken with a last assistant message to continue")
    else:
        return None
    assert last is not None
    if last.tool_calls:
        raise InvalidArgument("messages: cannot continue an assistant message that contains tool calls")
    if given is True:  # llama-server's "auto": the reasoning when the message has nothing else
        given = "reasoning_content" if last.reasoning_content and not _message_text(last, len(req.messages) - 1) else "content"
    assert isinstance(given, str)
    return given


def _reasoning_wrap(model: LoadedVersion, tags: tuple[str, str], kwargs: dict[str, Any] | None) -> tuple[str, str]:
    """What the template writes around an assistant message's reasoning (Qwen 3's "<think>\\n"
    and "\\n</think>\\n\\n"), seen by rendering one; its bare tags where it drops the reasoning
    of past messages (DeepSeek R1's), as llama-server's template analysis falls back to."""
    probe = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "\x01C", "reasoning_content": "\x01R"}]
    try:
        text = model.chat_prompt(probe, template_kwargs=kwargs) if kwargs else model.chat_prompt(probe)
    except EdgedError:
        return tags
    at, answer = text.find("\x01R"), text.find("\x01C")
    start = text.rfind(tags[0], 0, at) if at >= 0 else -1
    if start < 0 or answer < at:
        return tags
    return text[start:at], text[at + 2 : answer]


def chat_prompt(model: LoadedVersion, req: PromptFields, answer: str = "") -> ChatPrompt:
    """The prompt the chat route generates from: the messages, with the tools described (by
    the template or in the generic reply's system message), rendered by the model's template.
    `answer`: the response format's schema (JSON text), which the generic reply's instructions
    name beside the tools."""
    if not req.messages:
        raise InvalidArgument("messages: at least one message is required")
    mode = continuation(req)
    if mode is not None:
        return _continued(model, req, mode, answer)
    syntax = model.tool_syntax()
    messages = chat_messages(req.messages, native_tools=bool(syntax))
    tools = _tools_in_use(req)
    use = None
    if tools:
        use = openai_tools.ToolUse(syntax, tools, req.tool_choice, req.parallel_tool_calls is not False, answer)
        messages = use.messages(messages)
    # With tool_choice "none" too (described_tools).
    described = openai_tools.described_tools(syntax, req.tools or [])
    text = effort_prompt(model, messages, described, req.chat_template_kwargs, req.reasoning_effort, "reasoning_effort")
    return ChatPrompt(text, syntax, use)


def _continued(model: LoadedVersion, req: PromptFields, mode: str, answer: str) -> ChatPrompt:
    """llama-server's continuation: the prompt of the messages before the last with its
    assistant header (cut before an opening reasoning tag the header ends with, as R1's),
    then the last message as the model writes it: its reasoning between the template's own
    tags (always, for a model that reasons), then its content, unless the reasoning is what
    goes on."""
    if len(req.messages) < 2:
        raise InvalidArgument("messages: continuing an assistant message needs a message before it")
    if _tools_in_use(req) or answer:
        # The tool-call and response-format grammars hold a reply from its start.
        field = "response_format" if answer else "tools"
        raise InvalidArgument(f"{field}: not supported when continuing an assistant message")
    last = req.messages[-1]
    content = _message_text(last, len(req.messages) - 1)
    head = msgspec.structs.replace(req, messages=req.messages[:-1], continue_final_message=None,  # type: ignore[type-var]
                                   add_generation_prompt=None)
    rendered = chat_prompt(model, head)
    prompt, tags = rendered.text, model.thinking_tags()
    if not tags[0]:
        return ChatPrompt(prompt + content, rendered.syntax, None, prefill=content, prefill_tagged=content)
    if reasoning.opened_by(prompt, tags) is not None:
        prompt = prompt[: prompt.rstrip().rindex(tags[0])]
    start, end = _reasoning_wrap(model, tags, req.chat_template_kwargs)
    thought = last.reasoning_content or ""
    prefill = start + thought + (end + content if mode == "content" else "")
    tagged = tags[0] + thought + (tags[1] + content if mode == "content" else "")
    return ChatPrompt(prompt + prefill, rendered.syntax, None, prefill=prefill, prefill_tagged=tagged,
                      inside=mode == "reasoning_content")


def _check_store(req: ChatRequest) -> None:
    if req.store:
        raise InvalidArgument("store: chat completions are not stored here (omit store or set it to false)")


class _CheckedChat(NamedTuple):
    """A chat request checked and turned into the engine's parameters and prompt (the chat
    route and its token count check it alike: a count is 200 only where the route takes it)."""

    params: GenerateParams
    rendered: ChatPrompt
    tags: tuple[str, str]
    split: bool
    opened: str | None


async def _chat_request(model: LoadedVersion, req: ChatRequest) -> _CheckedChat:
    params = _params(req)
    params.lora = lora_request(model, req.lora)
    if req.logit_bias:
        params.logit_bias = await logit_bias_of(model, req.logit_bias)
    params.json_schema = schema_of_format(req.response_format)
    probs_field = "logprobs"
    if req.n_probs is not None:
        if req.logprobs is not None or req.top_logprobs is not None:
            # llama-server then keeps logprobs' count and drops n_probs without a word.
            raise InvalidArgument("n_probs and logprobs/top_logprobs: send one of the two forms")
        count = sampling.n_probs(req.n_probs, None)
        # Read as the OpenAI form from here on (the answers carry it so, as llama-server's do).
        req.logprobs, req.top_logprobs, probs_field = bool(count), count or None, "n_probs"
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise InvalidArgument("top_logprobs: requires logprobs to be true")
        if not 0 <= req.top_logprobs <= 20:
            raise InvalidArgument(f"top_logprobs must be between 0 and 20, got {req.top_logprobs}")
    if req.logprobs:
        params.logprobs = req.top_logprobs or 0
        params.post_sampling_probs = req.post_sampling_probs
    elif req.post_sampling_probs:
        # llama-server then gives no probabilities at all, without a word.
        raise InvalidArgument("post_sampling_probs: requires logprobs to be true (or n_probs above 0)")
    rendered = chat_prompt(model, req, params.json_schema)
    prompt, syntax, use = rendered.text, rendered.syntax, rendered.use
    tags = model.thinking_tags()
    split = splits_reasoning(req.reasoning_format) and bool(tags[0])
    if use is not None:
        if req.logprobs:
            raise InvalidArgument(f"{probs_field}: not supported together with tools")
        # With response_format: tool calls or an answer in the format (ToolUse.constrain),
        # after the reasoning where the reply shows it.
        use.constrain(params, "response_format", ("", "") if split else tags)
    # A continued message's reasoning tags are in the reply's prefill (ChatPrompt.prefill).
    opened = None if rendered.prefill else reasoning.opened_by(prompt, tags)
    reasoning.hold_grammar_after(params, tags, prompt)
    inside = opened is not None or rendered.inside
    budget = _budget_tokens(req)
    params.reasoning_control = req.reasoning_control and bool(tags[0])
    if params.reasoning_control and budget in (None, -1):
        # Armed as llama-server arms it: a budget sampler that only a control will spend,
        # writing reasoning_budget_message when it does.
        budget = reasoning.MAX_BUDGET
    reasoning.budget(params, budget, req.reasoning_budget_message, tags, inside)
    if params.json_schema:
        params.answer_header = syntax_named(syntax).answer_header
    return _CheckedChat(params, rendered, tags, split, opened)


async def chat_control(request: web.Request) -> web.Response:
    """llama-server's POST /v1/chat/completions/control: `reasoning_end` ends the reasoning of a
    running chat completion that asked for `reasoning_control` (GenerationBackend.control).
    `{"success": true}`, or `{"success": false, "message"}` when there is no such completion
    running (it may have ended just before) or it did not ask for control."""
    req = _decode(await request_body(request), ControlRequest)
    if not_loaded(request, req.model):
        # None of its completions runs, and a control must not load a model to say so.
        why = "no active completion for this id"
    else:
        model = await generation_model(request, req.model)
        why = model.require_generator().control(req.id, req.action)
    return web.Response(body=_json.encode({"success": True} if not why else {"success": False, "message": why}),
                        content_type="application/json")


async def chat_input_tokens(request: web.Request) -> web.Response:
    """llama-server's POST /v1/chat/completions/input_tokens: how many tokens the request's
    prompt is, as the model tokenizes what /v1/chat/completions would generate from (the
    request checked as there)."""
    req: ChatRequest = _decode(await request_body(request), ChatRequest)
    _check_store(req)
    model = await generation_model(request, req.model)
    prompt = (await _chat_request(model, req)).rendered.text
    tokens = await model.tokenize(prompt, add_special=True, parse_special=True)
    return web.json_response({"object": "response.input_tokens", "input_tokens": len(tokens)})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req: ChatRequest = _decode(await request_body(request), ChatRequest)
    _check_store(req)
    model = await generation_model(request, req.model)
    params, rendered, tags, split, opened = await _chat_request(model, req)
    prompt, syntax, use = rendered.text, rendered.syntax, rendered.use
    # Unsplit, the reply starts with the tag the prompt opened, as llama-server's "none" shows it;
    # a continued message, with all of that message so far, as llama-server's.
    if rendered.prefill:
        reopened = rendered.prefill_tagged if split else rendered.prefill
    else:
        reopened = tags[0] + opened if opened is not None and not split else ""
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    params.control_id = ident  # what /v1/chat/completions/control names it by
    choices = _choices(model, [prompt], params, req.n or 1)
    # Per choice: whether its role went out yet; with tools, its reply turned into deltas;
    # with reasoning, the split of its reply and logprobs of tokens whose text is held back.
    first_delta = [True for _ in choices]
    stream_tools = [use.stream() for _ in choices] if use else []
    reading = syntax_named(syntax)

    def splitter() -> reasoning.Split | None:
        return reading.thinking_split(tags, opened) if split else reading.unsplit()

    splits = [splitter() for _ in choices]
    unsent: list[list[TokenLogprob]] = [[] for _ in choices]
    fresh = [True for _ in choices]  # no chunk of the choice came yet

    def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        if req.post_sampling_probs:
            # llama-server's form: probabilities after the samplers.
            return {"content": [
                {**_sampled(e), "top_probs": [_sampled(t) for t in e.top]} for e in entries
            ]}
        # `id`: llama-server's addition to OpenAI's entries (the token's id in the vocabulary).
        return {"content": [
            {
                "id": e.token_id, "token": token_text(e), "logprob": e.logprob, "bytes": list(e.piece),
                "top_logprobs": [
                    {"id": t.token_id, "token": token_text(t), "logprob": t.logprob, "bytes": list(t.piece)}
                    for t in e.top
                ],
            }
            for e in entries
        ]}

    def chunk_payload(
        index: int, delta: dict[str, Any], finish: str | None, entries: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        if first_delta[index]:
            delta = {"role": "assistant", **delta}
            first_delta[index] = False
        return {
            "id": ident, "object": "chat.completion.chunk", "created": created, "model": model.name,
            "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(entries or []), "finish_reason": finish}],
        }

    def make_chunk(
        index: int, chunk: GenerateChunk, usage_only: bool = False
    ) -> dict[str, Any] | list[dict[str, Any]] | None:
        if usage_only:
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model.name, "choices": []}
        final = chunk.finish_reason is not None
        text, thought = chunk.text, ""
        if fresh[index]:
            text, fresh[index] = reopened + text, False
        if (splitting := splits[index]) is not None:
            thought, text = splitting.feed(text, final)
        entries = unsent[index] = unsent[index] + chunk.logprobs
        events = [chunk_payload(index, {"reasoning_content": thought}, None)] if thought else []
        if use is None:
            if text or final:
                events.append(chunk_payload(index, {"content": text} if text else {}, chunk.finish_reason))
        else:
            events += _tool_events(index, text, final, chunk.finish_reason)
        if events and entries:
            # The tokens' logprobs go with the first event their text reached.
            events[0]["choices"][0]["logprobs"] = chat_logprobs(entries)
            unsent[index] = []
        return events

    def _tool_events(index: int, text: str, final: bool, finish: str | None) -> list[dict[str, Any]]:
        assert use is not None
        reply = stream_tools[index]
        events = [chunk_payload(index, delta, None) for delta in reply.feed(text, final)]
        if not final:
            return events
        if reply.calls_sent:
            # Cut off mid-call, the calls are incomplete: "length", as OpenAI and llama-server
            # say (the openai client's stream helpers then raise LengthFinishReasonError
            # instead of parsing arguments that end mid-object).
            cut = finish == "length"
            events.append(chunk_payload(index, {}, "length" if cut else "tool_calls"))
        elif not events and not reply.sent_content and not use.native:
            # Cut off before the reply object said anything: the raw text, as unstreamed.
            content, _ = openai_tools.parse_reply(reply.text)
            events.append(chunk_payload(index, {"content": content} if content else {}, finish))
        else:
            events.append(chunk_payload(index, {}, finish))
        return events

    def final_choice(index: int, text: str, last: GenerateChunk) -> dict[str, Any]:
        text = reopened + text
        thought = ""
        if (splitting := splitter()) is not None:
            thought, text = splitting.feed(text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thought:
            message["reasoning_content"] = thought
        finish: str | None = last.finish_reason
        if use is not None:
            cut = finish == "length"
            # Cut off, the reply is what its stream would have sent, with finish_reason "length".
            content, calls = use.reply(text, cut)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                finish = "length" if cut else "tool_calls"
        return {"index": index, "message": message, "logprobs": chat_logprobs(last.logprobs), "finish_reason": finish}

    def make_final(results: list[tuple[str, GenerateChunk]]) -> dict[str, Any]:
        return {
            "id": ident, "object": "chat.completion", "created": created, "model": model.name,
            "choices": [final_choice(index, text, last) for index, (text, last) in enumerate(results)],
            "usage": _usage([last for _, last in results], per_prompt=len(results)),
        }

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def progress(index: int) -> dict[str, Any]:
        # As llama-server's: the role and no content yet, on every progress chunk.
        first_delta[index] = False
        return chunk_payload(index, {"role": "assistant", "content": None}, None)

    return await _stream_or_collect(
        request, choices, stream=bool(req.stream), include_usage=include_usage,
        make_chunk=make_chunk, make_final=make_final, per_prompt=len(choices),
        progress=progress, timed=req.timings_per_token, ping=req.sse_ping_interval,
    )


def _encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _embedding_inputs(value: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """The inputs to embed: a list of ints is one input of token ids; otherwise each element
    is one (a string, or a list of token ids, as llama-server also takes them side by side).
    Strings and bare ints in one list are a 400: llama-server joins them into one prompt,
    which is not an OpenAI input, and guessing a split would change what the client meant."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidArgument("input: at least one string or token id is required")
    ids = [item for item in value if isinstance(item, int)]
    if len(ids) == len(value):
        return [ids]
    if ids:
        index = next(i for i, item in enumerate(value) if isinstance(item, int))
        raise InvalidArgument(
            f"input[{index}]: a token id among strings or token-id lists; send token ids as one "
            "list of ints (one input) or as lists of ints (one input each)"
        )
    return [item for item in value if not isinstance(item, int)]


async def embeddings(request: web.Request) -> web.Response:
    req: EmbeddingRequest = _decode(await request_body(request), EmbeddingRequest)
    model = await generation_model(request, req.model)
    inputs = _embedding_inputs(req.input)
    dimensions.check(req.dimensions)
    vectors, tokens = await model.embed(inputs)
    if req.dimensions is not None:
        vectors = dimensions.shorten(vectors, req.dimensions)
    payload = {
        "object": "list",
        "model": model.name,
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return web.Response(body=_json.encode(payload), content_type="application/json")


# ---------------------------------------------------------------------------- Triton generate


async def _generate(request: web.Request, stream: bool) -> web.StreamResponse:
    if (tensor := generate_tensor.tensor_model(request)) is not None:  # any tensor model
        return await generate_tensor.handle(request, tensor, stream)
    name = request.match_info["model"]
    req: GenerateRequest = _decode(await request_body(request), GenerateRequest)
    if req.parameters:
        raise InvalidArgument(
            f"parameters: {sorted(req.parameters)} not supported; sampling fields go at the top level"
        )
    model = await generation_model(request, name, request.match_info.get("version"))
    params = _params(req)
    version = str(model.version)

    def make_chunk(index: int, chunk: GenerateChunk, usage_only: bool = False) -> dict[str, Any]:
        return {"model_name": name, "model_version": version, "text_output": chunk.text}

    def make_final(results: list[tuple[str, GenerateChunk]]) -> dict[str, Any]:
        [(text, last)] = results
        return {
            "model_name": name, "model_version": version, "text_output": text,
            "finish_reason": last.finish_reason, "usage": _usage([last]),
        }

    return await _stream_or_collect(
        request, [model.generate(req.text_input, params)],
        stream=stream or req.stream,
        include_usage=False, make_chunk=make_chunk, make_final=make_final,
    )


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, stream=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await _generate(request, stream=True)


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/models", list_models)
    r.add_get("/v1/models/{model}", retrieve_model)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/embeddings", embeddings)
    # llama-server's paths without /v1/ (a client whose base URL lacks it): the same routes.
    # Not /completions: that is llama-server's native route (daemon.api.llama_completion).
    r.add_get("/models", list_models)
    r.add_post("/chat/completions", chat_completions)
    for prefix in ("/v1", ""):
        r.add_post(prefix + "/chat/completions/input_tokens", chat_input_tokens)
        r.add_post(prefix + "/chat/completions/control", chat_control)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_post(prefix + "/generate", generate)
        r.add_post(prefix + "/generate_stream", generate_stream)
