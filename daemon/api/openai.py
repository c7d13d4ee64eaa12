"""OpenAI-compatible routes (`/v1/models`, completions, chat, embeddings) and Triton's generate
extension, on top of a generation backend's `generate` / `chat_prompt` / `embed`.

Streaming is Server-Sent Events ending in `data: [DONE]`. A client that disconnects cancels its
sequence: aiohttp cancels the handler, and closing the chunk iterator tells the engine.
"""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

import msgspec
import numpy as np
from aiohttp import web

from daemon.api import generate as generate_tensor
from daemon.api.body import read_body
from daemon.api.state import daemon_of
from daemon.backend import GenerateChunk, GenerateParams
from daemon.core.model import LoadedVersion
from daemon.errors import InvalidArgument, Unavailable

_json = msgspec.json.Encoder()


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions (OpenAI names)."""

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # Accepted for client compatibility; llama.cpp's repeat penalty covers the common need.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions llama.cpp's server also accepts.
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None


class CompletionRequest(_Sampling):
    # A string, a one-element list of strings, or token ids (msgspec allows one list type).
    prompt: str | list[str | int] = ""
    echo: bool = False


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = []


class EmbeddingRequest(_Strict):
    model: str
    input: str | list[str]
    # The openai client asks for base64 (float32 little-endian) unless told otherwise.
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    dimensions: int | None = None


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Triton's generate extension: text_input plus sampling fields at the top level."""

    text_input: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    parameters: dict[str, Any] = {}


# Built once: decoders are immutable and cost a schema walk to make.
_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(kind)
    for kind in (CompletionRequest, ChatRequest, EmbeddingRequest, GenerateRequest)
}


def _decode(body: bytes, kind: type[Any]) -> Any:
    try:
        return _DECODERS[kind].decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed JSON body: {exc}") from None


def _params(req: _Sampling | GenerateRequest) -> GenerateParams:
    params = GenerateParams()
    max_tokens = req.max_tokens
    if isinstance(req, _Sampling):
        if req.n != 1:
            raise InvalidArgument("n: only n=1 is supported")
        max_tokens = req.max_completion_tokens or req.max_tokens
        if req.min_p is not None:
            params.min_p = req.min_p
        if req.repeat_penalty is not None:
            params.repeat_penalty = req.repeat_penalty
    if max_tokens is not None:
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {max_tokens}")
        params.max_tokens = max_tokens
    if req.temperature is not None:
        if req.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {req.temperature}")
        params.temperature = req.temperature
        params.greedy = req.temperature == 0
    if req.top_p is not None:
        params.top_p = req.top_p
    if req.top_k is not None:
        params.top_k = req.top_k
    if req.seed is not None:
        params.seed = req.seed
    if req.stop is not None:
        params.stop = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return params


async def _body(request: web.Request) -> bytes:
    return await read_body(request, daemon_of(request).config.server.max_request_bytes)


def _generation_model(request: web.Request, name: str, version: str | None = None) -> LoadedVersion:
    """Resolve the model once; every later step of the request talks to this version."""
    daemon = daemon_of(request)
    if not daemon.accepting:
        raise Unavailable("server is shutting down")
    model = daemon.registry.get(name, version)
    model.require_generator()
    return model


async def _collect(chunks: AsyncIterator[GenerateChunk]) -> tuple[str, GenerateChunk]:
    parts: list[str] = []
    last = GenerateChunk(text="")
    async for chunk in chunks:
        parts.append(chunk.text)
        last = chunk
    return "".join(parts), last


async def _first(chunks: AsyncIterator[GenerateChunk]) -> GenerateChunk | None:
    """Pull the first chunk before answering, so queue-full and bad prompts get a real status."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def _sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, payload: object) -> None:
    await response.write(b"data: " + _json.encode(payload) + b"\n\n")


def _usage(chunk: GenerateChunk) -> dict[str, int]:
    return {
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
    }


# ---------------------------------------------------------------------------- /v1/models


async def list_models(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    data = [
        {"id": m.name, "object": "model", "created": 0, "owned_by": f"edged/{m.backend}"}
        for m in daemon.registry.loaded()
    ]
    unique = list({d["id"]: d for d in data}.values())
    return web.Response(body=_json.encode({"object": "list", "data": unique}), content_type="application/json")


# ---------------------------------------------------------------------------- completions


async def _stream_or_collect(
    request: web.Request,
    chunks: AsyncGenerator[GenerateChunk, None],
    *,
    stream: bool,
    include_usage: bool,
    make_chunk: Any,
    make_final: Any,
) -> web.StreamResponse:
    async with contextlib.aclosing(chunks):
        first = await _first(chunks)
        if not stream:
            text, last = await _collect(chunks)
            if first is not None:
                text = first.text + text
                if last.finish_reason is None:
                    last = first
            return web.Response(body=_json.encode(make_final(text, last)), content_type="application/json")
        response = await _sse(request)
        last = GenerateChunk(text="")
        pending = [first] if first is not None else []
        async def all_chunks() -> AsyncIterator[GenerateChunk]:
            for c in pending:
                yield c
            async for c in chunks:
                yield c
        async for chunk in all_chunks():
            last = chunk
            if chunk.text or chunk.finish_reason:
                await _send(response, make_chunk(chunk))
        if include_usage:
            final = make_chunk(GenerateChunk(text=""), usage_only=True)
            final["usage"] = _usage(last)
            await _send(response, final)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def completions(request: web.Request) -> web.StreamResponse:
    req: CompletionRequest = _decode(await _body(request), CompletionRequest)
    model = _generation_model(request, req.model)
    prompt: str | list[int]
    if isinstance(req.prompt, str):
        prompt = req.prompt
    elif all(isinstance(p, int) for p in req.prompt):
        prompt = [int(p) for p in req.prompt]
    elif len(req.prompt) == 1:
        prompt = str(req.prompt[0])
    else:
        raise InvalidArgument("prompt: one string, a one-element list of strings, or token ids")
    params = _params(req)
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def make_chunk(chunk: GenerateChunk, usage_only: bool = False) -> dict[str, Any]:
        choices = [] if usage_only else [
            {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": chunk.finish_reason}
        ]
        return {"id": ident, "object": "text_completion", "created": created, "model": model.name, "choices": choices}

    def make_final(text: str, last: GenerateChunk) -> dict[str, Any]:
        if req.echo and isinstance(prompt, str):
            text = prompt + text
        return {
            "id": ident, "object": "text_completion", "created": created, "model": model.name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}],
            "usage": _usage(last),
        }

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _stream_or_collect(
        request, model.generate(prompt, params), stream=req.stream,
        include_usage=include_usage, make_chunk=make_chunk, make_final=make_final,
    )


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for i, part in enumerate(message.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidArgument(f"messages content[{i}]: only parts of type 'text' are supported")
        texts.append(part["text"])
    return "".join(texts)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req: ChatRequest = _decode(await _body(request), ChatRequest)
    if not req.messages:
        raise InvalidArgument("messages: at least one message is required")
    model = _generation_model(request, req.model)
    messages = [{"role": m.role, "content": _message_text(m)} for m in req.messages]
    prompt = model.chat_prompt(messages)
    params = _params(req)
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    first_delta = [True]

    def make_chunk(chunk: GenerateChunk, usage_only: bool = False) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": chunk.text} if chunk.text else {}
        if first_delta[0] and not usage_only:
            delta["role"] = "assistant"
            first_delta[0] = False
        choices = [] if usage_only else [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": chunk.finish_reason}
        ]
        return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model.name, "choices": choices}

    def make_final(text: str, last: GenerateChunk) -> dict[str, Any]:
        return {
            "id": ident, "object": "chat.completion", "created": created, "model": model.name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": last.finish_reason,
            }],
            "usage": _usage(last),
        }

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _stream_or_collect(
        request, model.generate(prompt, params), stream=req.stream,
        include_usage=include_usage, make_chunk=make_chunk, make_final=make_final,
    )


def _encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def embeddings(request: web.Request) -> web.Response:
    req: EmbeddingRequest = _decode(await _body(request), EmbeddingRequest)
    model = _generation_model(request, req.model)
    texts = [req.input] if isinstance(req.input, str) else req.input
    if not texts:
        raise InvalidArgument("input: at least one string is required")
    vectors, tokens = await model.embed(texts)
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
    req: GenerateRequest = _decode(await _body(request), GenerateRequest)
    model = _generation_model(request, name, request.match_info.get("version"))
    params = _params(req)
    version = str(model.version)

    def make_chunk(chunk: GenerateChunk, usage_only: bool = False) -> dict[str, Any]:
        return {"model_name": name, "model_version": version, "text_output": chunk.text}

    def make_final(text: str, last: GenerateChunk) -> dict[str, Any]:
        return {
            "model_name": name, "model_version": version, "text_output": text,
            "finish_reason": last.finish_reason, "usage": _usage(last),
        }

    return await _stream_or_collect(
        request, model.generate(req.text_input, params),
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
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/embeddings", embeddings)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_post(prefix + "/generate", generate)
        r.add_post(prefix + "/generate_stream", generate_stream)
