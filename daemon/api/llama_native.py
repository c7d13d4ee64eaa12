"""llama-server's utility routes for generation models: `POST /tokenize`, `/detokenize` and
`/apply-template`, with its request and response shapes (llama.cpp tools/server); and its
`GET /health` (also `/v1/health`), which container health checks and clients poll.

As in llama-server's router mode, the body names the model (`model`, required); an unknown
one is a 404. Where llama-server ignores what it cannot use (an unknown field, a field of the
wrong type) or fails with a 500 (an id outside the vocabulary), these answer with a 400 naming
the field. llama-server serves them at these paths only, not under /v1/.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from daemon.api import openai_tools
from daemon.api.openai import ChatMessage, chat_prompt, decode_with, generation_model, request_body
from daemon.api.state import daemon_of
from daemon.core.model import LoadedVersion
from daemon.errors import InvalidArgument

_json = msgspec.json.Encoder()


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    pass


class TokenizeRequest(_Strict):
    model: str
    # A text, or texts and token ids in order (ids taken as they are; a text after the first
    # item never gets the BOS). None (llama-server: the field missing): no tokens.
    content: str | list[str | int] | None = None
    # llama-server's defaults: no BOS, control tokens' texts are those tokens.
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[int] = []


class ApplyTemplateRequest(_Strict):
    """What shapes the chat route's prompt (openai.PromptFields), nothing of sampling."""

    model: str
    messages: list[ChatMessage] = []
    tools: list[openai_tools.Tool] | None = None
    tool_choice: openai_tools.ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None


_TOKENIZE = msgspec.json.Decoder(TokenizeRequest)
_DETOKENIZE = msgspec.json.Decoder(DetokenizeRequest)
_APPLY_TEMPLATE = msgspec.json.Decoder(ApplyTemplateRequest)


def _ok(payload: object) -> web.Response:
    return web.Response(body=_json.encode(payload), content_type="application/json")


async def tokenize(request: web.Request) -> web.Response:
    req = decode_with(_TOKENIZE, await request_body(request))
    model = await generation_model(request, req.model)
    items = [] if req.content is None else [req.content] if isinstance(req.content, str) else req.content
    tokens: list[int] = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            # As llama-server: only a text that comes first gets the special tokens.
            tokens += await model.tokenize(item, add_special=req.add_special and index == 0, parse_special=req.parse_special)
        else:
            tokens.append(item)
    ids = [item for item in items if isinstance(item, int)]
    if not req.with_pieces:
        if ids:
            await _pieces(model, ids, "content")  # llama-server passes any id on; a 400 here
        return _ok({"tokens": tokens})
    pieces = await _pieces(model, tokens, "content")
    return _ok({"tokens": [{"id": t, "piece": _piece_json(p)} for t, p in zip(tokens, pieces, strict=True)]})


async def detokenize(request: web.Request) -> web.Response:
    req = decode_with(_DETOKENIZE, await request_body(request))
    model = await generation_model(request, req.model)
    pieces = await _pieces(model, req.tokens, "tokens")
    # The pieces joined, as llama-server's; bytes that are not UTF-8 become U+FFFD.
    return _ok({"content": b"".join(pieces).decode("utf-8", errors="replace")})


async def apply_template(request: web.Request) -> web.Response:
    req = decode_with(_APPLY_TEMPLATE, await request_body(request))
    model = await generation_model(request, req.model)
    return _ok({"prompt": chat_prompt(model, req).text})


async def _pieces(model: LoadedVersion, tokens: list[int], field: str) -> list[bytes]:
    try:
        return await model.token_pieces(tokens)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{field}: {exc.message}") from None


def _piece_json(piece: bytes) -> str | list[int]:
    """A piece as text, or its bytes when it is not valid UTF-8 (a byte-fallback token's part
    of a character), as llama-server writes it."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


async def health(request: web.Request) -> web.Response:
    """`{"status": "ok"}` once the daemon is ready (what /v2/health/ready says: started,
    accepting, every model in the repository ready), else a 503 in llama-server's shape: its
    "Loading model" while the daemon starts, else what is not ready (llama-server has no other
    state: a model that fails to load ends it)."""
    service = daemon_of(request)
    if service.ready():
        return _ok({"status": "ok"})
    if not service.accepting:
        message = "Shutting down"
    else:
        message = "Loading model" if not service.started else f"Not ready: {service.status()}"
    body = _json.encode({"error": {"message": message, "type": "unavailable_error", "code": 503}})
    return web.Response(status=503, body=body, content_type="application/json")


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/health", health)  # also answers HEAD
    r.add_get("/v1/health", health)
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_post("/apply-template", apply_template)
