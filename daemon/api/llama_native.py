"""llama-server's utility routes for generation models: `POST /tokenize`, `/detokenize` and
`/apply-template`, `GET /props`, `/slots` and `/lora-adapters`, `POST /slots/{id}` (save,
restore, erase) and `/lora-adapters` (the scales of later requests), with its request and response
shapes (llama.cpp tools/server); its native `POST /embedding` (also `/embeddings`) for embedding models; and its
`GET /health` (also `/v1/health`), which container health checks and clients poll.

As in llama-server's router mode, the body names the model (`model`, required; for a GET the
query, `?model=NAME`); an unknown one is a 404. Where llama-server ignores what it cannot use (an unknown field, a field of the
wrong type) or fails with a 500 (an id outside the vocabulary), these answer with a 400 naming
the field. llama-server serves them at these paths only, not under /v1/.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from daemon.api import openai_tools
from daemon.api.openai import (
    ChatMessage,
    LoraScale,
    chat_prompt,
    decode_with,
    generation_model,
    lora_scales,
    not_loaded,
    request_body,
    sole_generation_model,
)
from daemon.api.state import daemon_of
from daemon.backend import GenerateParams, SlotAction, SlotState
from daemon.core.model import LoadedVersion
from daemon.errors import InvalidArgument

_json = msgspec.json.Encoder()


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    pass


class TokenizeRequest(_Strict):
    model: str = ""  # "": the one generation model loaded (openai.sole_generation_model)
    # A text, or texts and token ids in order (ids taken as they are; a text after the first
    # item never gets the BOS). None (llama-server: the field missing): no tokens.
    content: str | list[str | int] | None = None
    # llama-server's defaults: no BOS, control tokens' texts are those tokens.
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    model: str = ""  # "": the one generation model loaded (openai.sole_generation_model)
    tokens: list[int] = []


class ApplyTemplateRequest(_Strict):
    """What shapes the chat route's prompt (openai.PromptFields), nothing of sampling."""

    model: str = ""  # "": the one generation model loaded (openai.sole_generation_model)
    messages: list[ChatMessage] = []
    tools: list[openai_tools.Tool] | None = None
    tool_choice: openai_tools.ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    continue_final_message: bool | str | None = None
    add_generation_prompt: bool | None = None


# One prompt: a text, or texts and token ids in order. A list without ids is several prompts.
Prompt = str | list[str | int]


class EmbeddingRequest(_Strict):
    model: str = ""  # "": the one generation model loaded (openai.sole_generation_model)
    # llama-server's two names for the prompts (`input` wins there when both are sent; here
    # that is a 400): a prompt, or a list of them.
    content: str | list[str | int | list[str | int]] | None = None
    input: str | list[str | int | list[str | int]] | None = None
    # -1 none, 0 max-abs scaled to int16's range, 1 taxicab, 2 Euclidean, p > 2 the p-norm.
    embd_normalize: int = 2
    # llama-server parses it, but its native shape is floats whatever is asked.
    encoding_format: str | None = None


class SlotActionRequest(_Strict):
    model: str
    filename: str | None = None  # save and restore: a file in the model's slot_save_path


_TOKENIZE = msgspec.json.Decoder(TokenizeRequest)
_DETOKENIZE = msgspec.json.Decoder(DetokenizeRequest)
_APPLY_TEMPLATE = msgspec.json.Decoder(ApplyTemplateRequest)
_EMBEDDING = msgspec.json.Decoder(EmbeddingRequest)
_SLOT_ACTION = msgspec.json.Decoder(SlotActionRequest)
_LORA_SCALES = msgspec.json.Decoder(list[LoraScale])


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
    return _ok({"content": joined_text(pieces, "tokens")})


def joined_text(pieces: list[bytes], field: str) -> str:
    """The pieces joined as text. Bytes that are not UTF-8 (ids that cut a character) are a
    400: llama-server writes U+FFFD for them, which would change the text unannounced."""
    data = b"".join(pieces)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"{field}: the tokens' bytes are not UTF-8 text (byte {exc.start} of {len(data)}: a character cut "
            "between tokens); POST /tokenize with these ids as content and with_pieces true gives each token's bytes"
        ) from None


async def apply_template(request: web.Request) -> web.Response:
    req = decode_with(_APPLY_TEMPLATE, await request_body(request))
    model = await generation_model(request, req.model)
    return _ok({"prompt": chat_prompt(model, req).text})


async def mixed_tokens(model: LoadedVersion, prompt: Prompt) -> list[int]:
    """llama-server's tokens for one prompt: a text with the BOS and special tokens' texts
    parsed; texts and ids in order, the BOS before a first text only, ids as they are."""
    if isinstance(prompt, str):
        return await model.tokenize(prompt, add_special=True, parse_special=True)
    tokens: list[int] = []
    for index, item in enumerate(prompt):
        if isinstance(item, int):
            tokens.append(item)
        else:
            tokens += await model.tokenize(item, add_special=index == 0, parse_special=True)
    return tokens


def _prompt_list(field: str, value: str | list[str | int | list[str | int]]) -> list[Prompt]:
    """llama-server's reading: a text, or a list holding an id, is one prompt; any other list
    is one prompt per element."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidArgument(f"{field}: must not be empty")
    if any(isinstance(item, int) for item in value):
        prompt: list[str | int] = []
        for index, item in enumerate(value):
            if isinstance(item, list):
                raise InvalidArgument(f"{field}[{index}]: a list among token ids; send one prompt of texts and ids, or a list of prompts")
            prompt.append(item)
        return [prompt]
    return [item for item in value if not isinstance(item, int)]


async def prompts_tokens(
    model: LoadedVersion, field: str, value: str | list[str | int | list[str | int]]
) -> list[list[int]]:
    """The tokens of each prompt `value` holds (llama-server's one prompt or list of them)."""
    out = []
    for index, prompt in enumerate(_prompt_list(field, value)):
        tokens = await mixed_tokens(model, prompt)
        if not tokens:
            raise InvalidArgument(f"{field}[{index}]: no tokens (the model adds none to an empty text)")
        out.append(tokens)
    return out


def _normalized(vector: list[float], norm: int) -> list[float]:
    """llama-server's `embd_normalize` of the engine's vector, which is already divided by its
    Euclidean norm: every norm here scales with the vector, so dividing this one by its own
    norm gives what dividing the raw vector does. The p-norm is taken of the vector scaled by
    its largest element, so that no power under- or overflows."""
    if norm == 2:
        return vector
    v = np.asarray(vector, dtype=np.float64)
    largest = float(np.max(np.abs(v)))
    if largest == 0.0:
        return vector  # llama-server's zero norm leaves zeros
    if norm == 0:
        return (v * (32760.0 / largest)).tolist()
    p_norm = largest * float(np.sum((np.abs(v) / largest) ** norm)) ** (1.0 / norm)
    return (v / p_norm).tolist()


async def embedding(request: web.Request) -> web.Response:
    """llama-server's native embeddings: `[{"index": i, "embedding": [vector]}, ...]`, one
    pooled vector per prompt, in the order of the prompts."""
    req = decode_with(_EMBEDDING, await request_body(request))
    if req.input is not None and req.content is not None:
        raise InvalidArgument("input, content: give one of them (llama-server reads input and ignores content)")
    field, value = ("input", req.input) if req.input is not None else ("content", req.content)
    if value is None:
        raise InvalidArgument("content: required (or input): the text, token ids, or a list of prompts to embed")
    if req.encoding_format not in (None, "float"):
        raise InvalidArgument(
            f"encoding_format: only float here, got {req.encoding_format!r} "
            "(llama-server's /embedding answers floats whatever is asked; /v1/embeddings takes base64)"
        )
    if req.embd_normalize < 0:
        raise InvalidArgument(
            f"embd_normalize: 0, 1, 2 or a p-norm above 2, got {req.embd_normalize} "
            "(the engine returns vectors already normalised, so unnormalised ones, -1, are not offered)"
        )
    model = await generation_model(request, req.model)
    if model.require_generator().unpooled():
        raise InvalidArgument(
            f"model '{model.name}' names no pooling: llama-server's /embedding answers one vector per "
            "token for it, which edged does not offer; set its parameters pooling (mean, cls or last)"
        )
    inputs: list[str | list[int]] = [*await prompts_tokens(model, field, value)]
    try:
        vectors, _ = await model.embed(inputs)
    except InvalidArgument as exc:
        # The engine names its inputs `input` (/v1/embeddings'); this request's field may be
        # `content`: an id outside the vocabulary is named where the client put it.
        if field != "input" and exc.message.startswith("input["):
            raise InvalidArgument(field + exc.message.removeprefix("input")) from None
        raise
    return _ok([{"index": i, "embedding": [_normalized(v, req.embd_normalize)]} for i, v in enumerate(vectors)])


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


# llama-server's seed for "random" (LLAMA_DEFAULT_SEED), which the engine samples with when
# a request sets none; a request asks for it with -1.
_RANDOM_SEED = 0xFFFFFFFF


def _query(request: web.Request, *optional: str) -> tuple[str, dict[str, str]]:
    """The model a GET names (`?model=NAME`; left out, the one generation model loaded, as a
    llama-server serving one model answers) and the other query fields the route takes; any
    other field, or one given twice, is a 400 naming it (llama-server ignores them). The
    router's `autoload`: `true` or `1` (and left out) loads an on-demand model to answer,
    anything else answers only for a model loaded now ("model is not loaded", as the router)."""
    for key in request.query:
        if key not in ("model", "autoload") and key not in optional:
            raise InvalidArgument(
                f"{key}: not a query field of {request.path} (it takes model, autoload{''.join(', ' + o for o in optional)})"
            )
        if len(request.query.getall(key)) > 1:
            raise InvalidArgument(f"{key}: given more than once")
    model = request.query.get("model", "") or sole_generation_model(request)
    if request.query.get("autoload", "true") not in ("true", "1") and not_loaded(request, model):
        raise InvalidArgument("model is not loaded")
    return model, {key: request.query[key] for key in optional if key in request.query}


def settings_json(params: GenerateParams) -> dict[str, object]:
    """Sampling settings under llama-server's names (its task params' `to_json(true)`), as the
    engine applies them; what edged has no such setting for, or no single value for, is left
    out (see docs/llama-server.md). /completion's generation_settings adds its request's own."""
    unlimited = params.max_tokens is None  # until the sequence's context is full: llama-server's -1
    out: dict[str, object] = {
        "seed": _RANDOM_SEED if params.seed is None else params.seed,
        "temperature": 0.0 if params.greedy else params.temperature,
        "dynatemp_range": params.dynatemp_range,
        "dynatemp_exponent": params.dynatemp_exponent,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "top_n_sigma": params.top_n_sigma,
        "xtc_probability": params.xtc_probability,
        "xtc_threshold": params.xtc_threshold,
        "typical_p": params.typical_p,
    }
    if params.penalty_last_n is not None:
        # None has no one value: the repeat penalty looks back 64 tokens, OpenAI's two the
        # whole context (llama-server: all three the same 64).
        out["repeat_last_n"] = params.penalty_last_n
    out |= {
        "repeat_penalty": params.repeat_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "dry_multiplier": params.dry_multiplier,
        "dry_base": params.dry_base,
        "dry_allowed_length": params.dry_allowed_length,
        "dry_penalty_last_n": params.dry_penalty_last_n,
        "mirostat": params.mirostat,
        "mirostat_tau": params.mirostat_tau,
        "mirostat_eta": params.mirostat_eta,
        "max_tokens": -1 if unlimited else params.max_tokens,
        "n_predict": -1 if unlimited else params.max_tokens,
        "n_keep": params.n_keep,
        "n_discard": params.n_discard,
        "ignore_eos": params.ignore_eos,
        "n_probs": params.logprobs or 0,
        "post_sampling_probs": params.post_sampling_probs,
        "min_keep": params.min_keep,
        "samplers": list(params.samplers),
        # The request's own `lora`, as llama-server echoes it ([] when it sent none, and in
        # /props); GET /lora-adapters lists the adapters the model is loaded with.
        "lora": [{"id": id_, "scale": scale} for id_, scale in params.lora],
    }
    return out


async def props(request: web.Request) -> web.Response:
    """llama-server's GET /props for one model: what its router answers for `?model=`. The
    sampling defaults are what a request that sets none of them gets (GenerateParams')."""
    name, _ = _query(request)
    model = await generation_model(request, name)
    info = await model.require_generator().props()
    payload: dict[str, object] = {
        "default_generation_settings": {"params": settings_json(GenerateParams()), "n_ctx": info.n_ctx},
        "total_slots": info.total_slots,
        "model_alias": model.name,
    }
    if info.ftype is not None:
        payload["model_ftype"] = info.ftype
    payload |= {
        "modalities": {"vision": info.vision, "video": info.video, "audio": info.audio},
        "endpoint_slots": True,  # GET /slots is served
        "endpoint_props": False,  # POST /props is not
        "ui": False,  # no web UI
    }
    if info.chat_template is not None:
        payload["chat_template"] = info.chat_template
    payload |= {
        "bos_token": info.bos_token,
        "eos_token": info.eos_token,
        "build_info": info.build_info,
        # Answering loaded the model (an on-demand one too), as llama-server's router does.
        "is_sleeping": False,
        "cors_proxy_enabled": False,
    }
    return _ok(payload)


async def slots(request: web.Request) -> web.Response:
    """llama-server's GET /slots for one model: each slot, and with `fail_on_no_slot` a 503
    when none is idle (its "no slot available")."""
    name, fields = _query(request, "fail_on_no_slot")
    flag = fields.get("fail_on_no_slot", "")
    if flag not in ("", "1", "true"):
        # llama-server takes any text but "" as on, "0" and "false" too: a 400, not a guess.
        raise InvalidArgument(f"fail_on_no_slot: 1 or true (or leave it out), got {flag!r}")
    model = await generation_model(request, name)
    generator = model.require_generator()
    states = generator.slots()
    if flag and all(state.task is not None for state in states):
        body = _json.encode({"error": {"message": "no slot available", "type": "unavailable_error", "code": 503}})
        return web.Response(status=503, body=body, content_type="application/json")
    return _ok([_slot_json(state) for state in states])


def _slot_json(state: SlotState) -> dict[str, object]:
    slot: dict[str, object] = {
        "id": state.id, "n_ctx": state.n_ctx, "speculative": state.speculative, "is_processing": state.task is not None,
    }
    task = state.task
    if task is None:
        # llama-server shows an idle slot's last request here; the engine keeps none.
        return slot
    limit = task.params.max_tokens
    return slot | {
        "id_task": task.id,
        "n_prompt_tokens": task.n_prompt_tokens,
        "n_prompt_tokens_processed": task.n_prompt_tokens_processed,
        "n_prompt_tokens_cache": task.n_prompt_tokens_cache,
        "params": settings_json(task.params),
        "next_token": [{
            "has_next_token": True,  # a slot is freed when its request ends
            "n_remain": -1 if limit is None else limit - task.n_decoded,
            "n_decoded": task.n_decoded,
        }],
    }


async def slot_action(request: web.Request) -> web.Response:
    """llama-server's POST /slots/{id_slot}?action=save|restore|erase: an idle slot's cached
    tokens and KV cells to a file in the model's `slot_save_path`, back from one, or dropped
    (each waits while the slot generates). The files are llama-server's own format: one
    saved by either restores in the other on the same GGUF."""
    for key in request.query:
        if key != "action":
            raise InvalidArgument(f"{key}: not a query field of POST /slots/{{id_slot}} (it takes action)")
        if len(request.query.getall(key)) > 1:
            raise InvalidArgument(f"{key}: given more than once")
    given = request.query.get("action", "")
    action = _SLOT_ACTIONS.get(given)
    if action is None:
        raise InvalidArgument(f"action: save, restore or erase (the query ?action=), got {given!r}")
    text = request.match_info["id_slot"]
    if not (text.isascii() and text.isdigit()):
        raise InvalidArgument(f"id_slot: a slot number in the path, got {text!r}")
    req = decode_with(_SLOT_ACTION, await request_body(request))
    if action == "erase":
        if req.filename is not None:
            raise InvalidArgument("filename: erase takes no file (it drops what the slot holds)")
    elif req.filename is None:
        raise InvalidArgument(f"filename: required to {action} a slot")
    elif not valid_filename(req.filename):
        raise InvalidArgument(
            f"filename: {req.filename!r} is not a file name llama-server takes (no directory, no '..', "
            "no control characters nor any of :*?\"<>|, no leading space nor trailing space or dot, "
            "at most 255 bytes)"
        )
    model = await generation_model(request, req.model)
    slot = int(text)
    done = await model.slot_action(action, slot, req.filename or "")
    if action == "erase":
        return _ok({"id_slot": slot, "n_erased": done.n_tokens})
    if action == "save":
        return _ok({"id_slot": slot, "filename": req.filename, "n_saved": done.n_tokens,
                    "n_written": done.n_bytes, "timings": {"save_ms": done.ms}})
    return _ok({"id_slot": slot, "filename": req.filename, "n_restored": done.n_tokens,
                "n_read": done.n_bytes, "timings": {"restore_ms": done.ms}})


_SLOT_ACTIONS: dict[str, SlotAction] = {"save": "save", "restore": "restore", "erase": "erase"}
# What llama-server's fs_validate_filename refuses in a name, besides the separators.
_FORBIDDEN_CHARS = frozenset(':*?"<>|/\\\uff0e\u2215\u2216\ufffd\ufeff')


def valid_filename(name: str) -> bool:
    """A plain file name, as llama-server's fs_validate_filename (subdirectories not allowed)."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        return False
    if not 0 < size <= 255 or name == "." or ".." in name or name[0] == " " or name[-1] in " .":
        return False
    return not any(
        ch in _FORBIDDEN_CHARS or ord(ch) <= 0x1F or 0x7F <= ord(ch) <= 0x9F for ch in name
    )


async def lora_adapters(request: web.Request) -> web.Response:
    """llama-server's GET /lora-adapters for one model (`?model=NAME`, as its router): the
    adapters the model's parameters `lora` loaded, `[{id, path, scale, task_name,
    prompt_prefix}]` ([] for none), each at the scale a request that names none gets now."""
    name, _ = _query(request)
    model = await generation_model(request, name)
    return _ok([
        {"id": id_, "path": adapter.path, "scale": adapter.scale, "task_name": adapter.task_name,
         "prompt_prefix": adapter.prompt_prefix}
        for id_, adapter in enumerate(model.require_generator().lora_adapters())
    ])


async def set_lora_adapters(request: web.Request) -> web.Response:
    """llama-server's POST /lora-adapters (`?model=NAME`): `[{id, scale}, ...]` become the
    scales of the requests that name none from now on, an adapter left out scale 0 (as
    llama-server reads the list); running generations keep theirs. They hold until the model
    reloads (its configuration's again), as llama-server's until it restarts. An unknown or
    repeated id is a 400 (llama-server ignores the one, keeps the last of the other)."""
    name, _ = _query(request)
    model = await generation_model(request, name)
    asked = dict(lora_scales(model, decode_with(_LORA_SCALES, await request_body(request)), "body"))
    count = len(model.require_generator().lora_adapters())
    if count:  # a model without adapters has nothing to set ([] is all it takes, as llama-server)
        model.require_generator().set_lora_scales(tuple(asked.get(i, 0.0) for i in range(count)))
    return _ok({"success": True})


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


async def change_props(request: web.Request) -> web.Response:
    """llama-server's answer to a change of its global settings when it was started without
    `--props` (its default; `/props` says `endpoint_props` false here too). Even with the flag
    its handler changes nothing; a client that checks `endpoint_props` never asks."""
    del request
    body = _json.encode({"error": {"message": "This server does not support changing global properties",
                                   "type": "not_supported_error", "code": 501}})
    return web.Response(status=501, body=body, content_type="application/json")


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/health", health)  # also answers HEAD
    r.add_get("/v1/health", health)
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_post("/apply-template", apply_template)
    r.add_post("/embedding", embedding)
    r.add_post("/embeddings", embedding)
    r.add_get("/props", props)
    r.add_post("/props", change_props)
    r.add_get("/slots", slots)
    r.add_post("/slots/{id_slot}", slot_action)
    r.add_get("/lora-adapters", lora_adapters)
    r.add_post("/lora-adapters", set_lora_adapters)
