"""llama-server's native completion routes: `POST /completion` (also `/completions`) and
`POST /infill` (fill-in-the-middle for code editors), with its field names, response object
and event stream (llama.cpp tools/server), on the engine the OpenAI routes use.

The body names the model (`model`, required, as in llama_native). Every field llama-server
takes either has its effect here or is a 400 naming it: an unknown field (llama-server ignores
one) and the fields not implemented (`stream_options`, ...) are
rejected by the decoder; `lora` is taken where it asks for the model's own adapter scales
(openai.lora_request), else a 400. Sampling values are checked as on the OpenAI routes (openai._params),
which reject what llama-server clamps. A list of prompts and `n_cmpl` (also `n`) completions
of each are several generations, run together; the answer is then a list, index
`prompt * n_cmpl + i`.

Streamed, each event is `data: {json}\\n\\n`: one per engine chunk (`content`, its `tokens`,
`stop: false`), then the summary with `stop: true`; no `[DONE]`, as llama-server's native
stream has none. With `return_progress`, events with `prompt_progress` come before the first
token's; with `timings_per_token`, every event has its `timings` so far.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from daemon.api import sampling
from daemon.api.errors import error_body
from daemon.api.llama_native import joined_text, prompts_tokens, settings_json
from daemon.api.openai import (
    LogitBias,
    SharedSampling,
    _all,
    _choices,
    _merged,
    _params,
    _Sampling,
    check_ping_interval,
    decode_with,
    first_chunk,
    generation_model,
    logit_bias_of,
    lora_request,
    pinged,
    request_body,
    start_sse,
)
from daemon.api.timings import Clock, progress_json, timings
from daemon.backend import GenerateChunk, GenerateParams, InfillInput, TokenLogprob
from daemon.core.model import LoadedVersion
from daemon.errors import EdgedError, InvalidArgument

_json = msgspec.json.Encoder()
# llama-server's window for every penalty when repeat_last_n is not given.
_REPEAT_LAST_N = 64


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    pass


class _Completion(SharedSampling):
    """The fields /completion and /infill share: llama-server's names and defaults."""

    # "": the one generation model loaded (openai.sole_generation_model), as llama-server.
    model: str = ""
    # -1: until an end-of-generation token or the end of the context. llama-server also takes
    # the OpenAI names; they must agree when several are sent.
    n_predict: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    # The generated token ids in `tokens` (streamed events carry theirs always, as llama-server's).
    return_tokens: bool = False
    # Each generated token's log probability and the n most likely (before sampling, as
    # llama-server's default post_sampling_probs false); `logprobs` is its other name.
    n_probs: int | None = None
    logprobs: int | None = None
    # llama-server's probabilities after the sampler chain instead (`prob`, `top_probs`; see
    # GenerateParams.post_sampling_probs): what mikupad shows by default.
    post_sampling_probs: bool = False
    # llama.cpp dropped it (a newline is penalised like any token): false, which mikupad
    # sends, is that; true is a 400.
    penalize_nl: bool = False
    # llama-server's two forms: [[token id or text, bias], ...] or {"id or text": bias}; a
    # text biases each of its tokens. Biases in [-100, 100], or false: a ban (see
    # openai.logit_bias_of).
    logit_bias: LogitBias | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # Completions of each prompt (`n` is llama-server's other name); completion i > 0 samples
    # with seed + i when a seed is given, as llama-server's child tasks.
    n_cmpl: int | None = None
    n: int | None = None
    # llama-server's code-completion stops, acting per token in the engine (GenerateParams
    # n_indent, t_max_predict_ms): a new line indented less than n_indent ends the output
    # (the whole answer cuts that line after its indentation); a newline sent more than
    # t_max_predict_ms after the first token ends it (-1 and 0: no limit). stop_type "limit".
    n_indent: int = 0
    t_max_predict_ms: int = -1
    # llama-server takes it and does nothing with it (a TODO there), and llama.vim sends it
    # (1 ms on its context warm-ups, which must still evaluate the whole context): taken, no
    # effect here either, so that a request means the same on both servers.
    t_max_prompt_ms: int | None = None
    # Streamed: each event carries `timings` so far, not only the summary.
    timings_per_token: bool = False
    # Streamed: seconds of silence after which an SSE comment goes out (-1, 0: none).
    sse_ping_interval: int | None = None
    # Streamed: prompt_progress events (total, cache, processed, time_ms) while the prompt is
    # evaluated, before the first token's; whole, nothing (as llama-server).
    return_progress: bool = False
    # The summary has only these fields, each under its path as given; a/b is field b of the
    # object in field a; a path not found is left out (llama-server's json_get_nested_values).
    response_fields: list[str] | None = None


class CompletionRequest(_Completion):
    # A text (BOS added, special tokens' texts parsed), token ids, or texts and ids mixed (a
    # text after the first item gets no BOS); a list without ids is one prompt per element.
    prompt: str | list[str | int | list[str | int]] | None = None


class ExtraChunk(_Strict):
    text: str
    filename: str = "tmp"  # llama-server's name for a chunk without one
    # When llama.vim picked the chunk (vim's reltime(): [seconds, microseconds]); for its own
    # bookkeeping: llama-server reads only text and filename, and so does this route.
    time: list[float] | float | None = None


class InfillRequest(_Completion):
    input_prefix: str | None = None
    input_suffix: str | None = None
    input_extra: list[ExtraChunk] = []
    # Text the completion starts with, after the prefix (llama-server's layout).
    prompt: str = ""


_COMPLETION = msgspec.json.Decoder(CompletionRequest)
_INFILL = msgspec.json.Decoder(InfillRequest)


def _n_predict(req: _Completion) -> int | None:
    """The output limit (None: none), from n_predict or its OpenAI names."""
    given = {name: value for name in ("n_predict", "max_completion_tokens", "max_tokens")
             if (value := getattr(req, name)) is not None}
    if len(set(given.values())) > 1:
        raise InvalidArgument(f"{', '.join(given)} disagree; send one of them")
    name, value = next(iter(given.items()), ("n_predict", -1))
    if value < -1:
        raise InvalidArgument(f"{name} must be -1 (no limit) or >= 0, got {value}")
    return None if value == -1 else value


def _n_cmpl(req: _Completion) -> int:
    """Completions per prompt, from n_cmpl or its other name n."""
    if req.n_cmpl is not None and req.n is not None and req.n_cmpl != req.n:
        raise InvalidArgument("n_cmpl and n disagree; send one of them")
    name, value = ("n", req.n) if req.n is not None else ("n_cmpl", req.n_cmpl)
    if value is not None and value < 1:
        raise InvalidArgument(f"{name} must be >= 1, got {value}")
    return value or 1


async def sampling_params(model: LoadedVersion, req: _Completion) -> GenerateParams:
    """The request's GenerateParams: the sampling fields through the OpenAI routes' checks,
    then what only llama-server's routes take (its logit_bias forms, n_probs, grammar)."""
    shared = {name: getattr(req, name) for name in SharedSampling.__struct_fields__}
    if shared["repeat_last_n"] is None:
        shared["repeat_last_n"] = _REPEAT_LAST_N
    params = _params(_Sampling(model=req.model, **shared), min_tokens=0)
    params.lora = lora_request(model, req.lora)
    params.max_tokens = _n_predict(req)
    probs = sampling.n_probs(req.n_probs, req.logprobs)
    if probs is not None:
        params.logprobs = probs or None  # 0: none, as llama-server
    params.post_sampling_probs = req.post_sampling_probs
    if req.penalize_nl:
        raise InvalidArgument(
            "penalize_nl: llama.cpp no longer has it (a newline is penalised like any other token); "
            "omit it or send false"
        )
    if req.logit_bias:
        params.logit_bias = await logit_bias_of(model, req.logit_bias)
    if req.grammar is not None and req.json_schema is not None:
        # llama-server then uses the grammar and drops the schema without a word.
        raise InvalidArgument("grammar and json_schema: send one of them")
    if req.grammar:
        params.grammar = req.grammar
    if req.json_schema is not None:
        params.json_schema = json.dumps(req.json_schema or {"type": "object"})  # {}: any object
    if req.n_indent < 0:
        raise InvalidArgument(f"n_indent must be >= 0, got {req.n_indent}")
    params.n_indent = req.n_indent
    if req.t_max_predict_ms < -1:
        raise InvalidArgument(f"t_max_predict_ms must be -1 (no limit) or >= 0, got {req.t_max_predict_ms}")
    params.t_max_predict_ms = req.t_max_predict_ms if req.t_max_predict_ms > 0 else None
    # Progress is only sent on a stream: a whole answer has nowhere to put it.
    params.return_progress = req.return_progress and req.stream
    check_ping_interval(req.sse_ping_interval)
    return params


@dataclass
class _Result(Clock):
    """What a sequence produced, gathered as its chunks come."""

    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    probs: list[TokenLogprob] = field(default_factory=list)

    def add(self, chunk: GenerateChunk) -> None:
        super().add(chunk)
        if chunk.prompt_progress is not None:
            return
        self.text.append(chunk.text)
        self.tokens += chunk.token_ids
        self.probs += chunk.logprobs


def _token_json(entry: TokenLogprob, post_sampling: bool) -> dict[str, Any]:
    value = {"prob": math.exp(entry.logprob)} if post_sampling else {"logprob": entry.logprob}
    return {"id": entry.token_id, "token": _piece_text(entry.piece), "bytes": list(entry.piece), **value}


def _piece_text(piece: bytes) -> str:
    """As llama-server: an incomplete UTF-8 character at the end is cut; `bytes` has it."""
    for back in range(1, min(4, len(piece)) + 1):
        byte = piece[-back]
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 0
        if need and back < need:
            piece = piece[: len(piece) - back]
            break
    return piece.decode("utf-8", errors="replace")


def _probs_json(entries: list[TokenLogprob], post_sampling: bool) -> list[dict[str, Any]]:
    """completion_probabilities, as llama-server writes them: log probabilities before the
    samplers, or (post_sampling_probs) probabilities after them under `prob` and `top_probs`."""
    top = "top_probs" if post_sampling else "top_logprobs"
    return [{**_token_json(e, post_sampling), top: [_token_json(t, post_sampling) for t in e.top]} for e in entries]


def _settings(params: GenerateParams, req: _Completion) -> dict[str, Any]:
    """llama-server's generation_settings, for what this engine has: the values sampled with
    (llama_native.settings_json, as /props and /slots show them) and this request's own."""
    out: dict[str, Any] = settings_json(params) | {
        "dry_sequence_breakers": params.dry_sequence_breakers, "stop": params.stop, "stream": req.stream,
        # A ban (-inf) as the request wrote it: JSON has no infinity (llama-server writes null).
        "logit_bias": [{"bias": False if b == -math.inf else b, "token": t} for t, b in params.logit_bias.items()],
        "timings_per_token": req.timings_per_token,
    }
    if not params.json_schema:
        out["grammar"] = req.grammar or ""  # with a json_schema, llama-server shows its GBNF, which is the engine's
    return out


def _stop_type(last: GenerateChunk) -> str:
    if last.finish_reason == "length":
        return "limit"
    if last.finish_reason == "stop":
        return "word" if last.stop_word else "eos"
    return "none"


async def _complete(
    request: web.Request, model: LoadedVersion, req: _Completion, prompts: list[list[int]], params: GenerateParams
) -> web.StreamResponse:
    """Generate `n_cmpl` completions of each prompt, together. Whole: llama-server's result
    object, or a list of them (each with its `index`) for several. Streamed: each chunk's
    event and, as a generation ends, its summary, all carrying their `index`."""
    per_prompt = _n_cmpl(req)
    texts = [joined_text(await model.token_pieces(tokens), "prompt") for tokens in prompts]  # the answer echoes them
    generations = _choices(model, prompts, params, per_prompt, "n" if req.n is not None else "n_cmpl")
    started = time.monotonic()
    results = [_Result(started=started) for _ in generations]

    async def summary(index: int, stream: bool) -> dict[str, Any]:
        result = results[index]
        last = result.last
        content = "".join(result.text)
        has_new_line = "\n" in content
        if last.cut:
            # n_indent's stop: the line it stopped at, after its indentation, is not part of the
            # whole answer (streamed, the events sent it, as llama-server's do).
            content = content[: len(content) - last.cut]
        probs = result.probs
        if last.stop_word and probs and not stream:
            # As llama-server: the stop string's tokens (as many as it tokenizes to) are not listed.
            cut = len(await model.tokenize(last.stop_word, add_special=False, parse_special=False))
            probs = probs[: max(len(probs) - cut, 0)]
        limit = params.max_tokens
        out: dict[str, Any] = {
            "index": index,
            "content": "" if stream else content,  # streamed, the events carried it
            "tokens": result.tokens if req.return_tokens and not stream else [],
            "id_slot": last.slot,
            "stop": True,
            "model": model.name,
            "tokens_predicted": last.completion_tokens,
            "tokens_evaluated": last.prompt_tokens,
            "generation_settings": _settings(params, req),
            "prompt": texts[index // per_prompt],
            "has_new_line": has_new_line,
            # Cut off by the end of the context rather than n_predict, n_indent or the time, or
            # shifted (llama-server's truncated, set by its context shift too).
            "truncated": bool(last.discarded_tokens) or (
                last.finish_reason == "length" and not last.finish_detail
                and (limit is None or last.completion_tokens < limit)),
            "stop_type": _stop_type(last),
            "stopping_word": last.stop_word,
            # The slot's cache after it: the prompt and every generated token but the last,
            # less what context shifts dropped or moved.
            "tokens_cached": last.prompt_tokens + max(last.completion_tokens - 1, 0) - last.discarded_tokens,
            "timings": timings(result),
        }
        if params.logprobs and not stream:
            out["completion_probabilities"] = _probs_json(probs, params.post_sampling_probs)
        return out if req.response_fields is None else _picked(out, req.response_fields)

    async def rest(index: int) -> None:
        async for chunk in generations[index]:
            results[index].add(chunk)

    async with contextlib.AsyncExitStack() as stack:
        for chunks in generations:
            await stack.enter_async_context(contextlib.aclosing(chunks))
        # Before the status: a full queue or a prompt too long is a real 4xx/5xx.
        firsts = await _all([first_chunk(chunks) for chunks in generations])
        for result, chunk in zip(results, firsts, strict=True):
            if chunk is not None:
                result.add(chunk)
        if not req.stream:
            await _all([rest(index) for index in range(len(generations))])
            answers = [await summary(index, False) for index in range(len(generations))]
            return web.Response(body=_json.encode(answers[0] if len(answers) == 1 else answers),
                                content_type="application/json")
        response = await start_sse(request)

        async def emit(index: int, chunk: GenerateChunk) -> None:
            progress = chunk.prompt_progress
            if chunk.text or chunk.token_ids or progress is not None:
                event: dict[str, Any] = {
                    "index": index, "content": chunk.text, "tokens": chunk.token_ids, "id_slot": chunk.slot, "stop": False,
                    "tokens_predicted": len(results[index].tokens),
                    "tokens_evaluated": len(prompts[index // per_prompt]),
                }
                if req.timings_per_token:
                    event["timings"] = timings(results[index], progress)
                if progress is not None:
                    event["prompt_progress"] = progress_json(progress)
                elif params.logprobs:
                    event["completion_probabilities"] = _probs_json(chunk.logprobs, params.post_sampling_probs)
                await _event(response, event)
            if chunk.finish_reason is not None:
                await _event(response, await summary(index, True))

        try:
            for index, chunk in enumerate(firsts):
                if chunk is not None:
                    await emit(index, chunk)
            async with contextlib.aclosing(_merged(generations)) as merged, \
                    contextlib.aclosing(pinged(merged, response, req.sse_ping_interval)) as arriving:
                async for index, chunk in arriving:
                    results[index].add(chunk)
                    await emit(index, chunk)
        except EdgedError as exc:
            # The 200 went out: the error is the stream's last event, as llama-server's.
            await _event(response, error_body(exc.status, exc.message, request.path))
        await response.write_eof()
        return response


def _picked(answer: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama-server's json_get_nested_values: each path's value, under the path itself (a/b:
    field b of the object in field a); a path not found is left out."""
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


async def _event(response: web.StreamResponse, payload: object) -> None:
    await response.write(b"data: " + _json.encode(payload) + b"\n\n")


async def completion(request: web.Request) -> web.StreamResponse:
    req = decode_with(_COMPLETION, await request_body(request))
    model = await generation_model(request, req.model)
    params = await sampling_params(model, req)
    if req.prompt is None:
        raise InvalidArgument("prompt: required")
    return await _complete(request, model, req, await prompts_tokens(model, "prompt", req.prompt), params)


async def infill(request: web.Request) -> web.StreamResponse:
    req = decode_with(_INFILL, await request_body(request))
    model = await generation_model(request, req.model)
    for name in ("input_prefix", "input_suffix"):
        if getattr(req, name) is None:
            raise InvalidArgument(f"{name}: required")  # as llama-server
    assert req.input_prefix is not None and req.input_suffix is not None
    params = await sampling_params(model, req)
    extra = tuple((chunk.filename, chunk.text) for chunk in req.input_extra)
    try:
        tokens = await model.infill_tokens(InfillInput(req.input_prefix, req.input_suffix, extra, req.prompt))
    except InvalidArgument as exc:
        raise InvalidArgument(f"infill: {exc.message}") from None
    return await _complete(request, model, req, [tokens], params)


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/completion", completion)
    r.add_post("/completions", completion)
    r.add_post("/infill", infill)
