"""KServe v2 (Open Inference Protocol) REST routes with Triton's extensions.

Handlers decode, call the data plane, encode; nothing else.
"""

from __future__ import annotations

import logging

import msgspec
from aiohttp import web

from daemon import __version__
from daemon.api.state import codec_of, daemon_of
from daemon.core.model import LoadedVersion
from daemon.errors import InvalidArgument, NotFound, Unavailable
from daemon.service import Service

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()

EXTENSIONS = [
    "classification",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "statistics",
    "binary_tensor_data",
    "parameters",
    "generate",
    "logging",
]


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(payload), content_type="application/json")


def _empty(status: int) -> web.Response:
    return web.Response(status=status)


def _version(request: web.Request) -> str | None:
    return request.match_info.get("version")


def _check_accepting(daemon: Service) -> None:
    if not daemon.accepting:
        raise Unavailable("server is shutting down")


# ---------------------------------------------------------------------------- health/metadata


async def live(request: web.Request) -> web.Response:
    return _empty(200)


async def ready(request: web.Request) -> web.Response:
    return _empty(200 if daemon_of(request).ready() else 400)


async def server_metadata(request: web.Request) -> web.Response:
    return _json_response({"name": "edged", "version": __version__, "extensions": EXTENSIONS})


def model_metadata_payload(daemon: Service, model: LoadedVersion) -> dict[str, object]:
    entry = daemon.registry.entry(model.name)
    return model.metadata(sorted(entry.versions) if entry else [model.version])


async def model_metadata(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    model = daemon.registry.get(request.match_info["model"], _version(request))
    return _json_response(model_metadata_payload(daemon, model))


async def model_ready(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    name = request.match_info["model"]
    if daemon.registry.is_ready(name, _version(request)):
        return _empty(200)
    if daemon.registry.entry(name) is None:
        raise NotFound(f"Request for unknown model: '{name}' is not found")
    return _json_response({"error": "Model version not ready"}, status=400)


async def model_config(request: web.Request) -> web.Response:
    model = daemon_of(request).registry.get(request.match_info["model"], _version(request))
    return _json_response(model.triton_config())


# ---------------------------------------------------------------------------- inference


async def infer(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    _check_accepting(daemon)
    # Resolved once: this version decodes, runs and labels the request, even if a reload
    # swaps in another one while the body is still arriving.
    model = daemon.registry.get(request.match_info["model"], _version(request))
    header = request.headers.get("Inference-Header-Content-Length")
    try:
        header_length = int(header) if header is not None else None
    except ValueError:
        raise InvalidArgument(
            f"Inference-Header-Content-Length must be an integer, got {header!r}"
        ) from None
    body = await request.read()
    config = model.config
    single = config.input[0] if len(config.input) == 1 else None
    codec = codec_of(request)
    decoded = codec.decode_infer_request(
        body, header_length, single_input=single, max_batch_size=config.max_batch_size
    )
    response = await model.infer(decoded.request)
    payload, json_length = codec.encode_infer_response(
        model.name, str(model.version), decoded, response, config
    )
    if json_length is None:
        return web.Response(body=payload, content_type="application/json")
    # Content-Type among the headers rather than `content_type=`: the same bytes on the
    # wire, and aiohttp skips its content_type/charset checks (~1 us per request).
    return web.Response(
        body=payload,
        headers={
            "Inference-Header-Content-Length": str(json_length),
            "Content-Type": "application/octet-stream",
        },
    )


# ---------------------------------------------------------------------------- statistics


async def model_stats(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    name = request.match_info.get("model")
    version = _version(request)
    if name is None:
        models = daemon.registry.loaded()
    elif version is not None:
        models = [daemon.registry.get(name, version)]
    else:
        entry = daemon.registry.entry(name)
        if entry is None:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        models = list(entry.versions.values())
    return _json_response(
        {"model_stats": [m.stats.to_triton_json(m.name, str(m.version)) for m in models]}
    )


async def metrics(request: web.Request) -> web.Response:
    body = daemon_of(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


# ---------------------------------------------------------------------------- repository


class _IndexRequest(msgspec.Struct, forbid_unknown_fields=True):
    ready: bool = False


class _LoadRequest(msgspec.Struct, forbid_unknown_fields=True):
    parameters: dict[str, object] = {}


async def _optional_body(request: web.Request, kind: type[msgspec.Struct]) -> msgspec.Struct:
    body = await request.read()
    if not body.strip():
        return kind()
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed request body: {exc}") from None


async def repository_index(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    body = await _optional_body(request, _IndexRequest)
    assert isinstance(body, _IndexRequest)
    return _json_response(await daemon.repository.index(ready_only=body.ready))


async def repository_load(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    _check_accepting(daemon)
    body = await _optional_body(request, _LoadRequest)
    assert isinstance(body, _LoadRequest)
    config_text = body.parameters.get("config")
    if config_text is not None and not isinstance(config_text, str):
        raise InvalidArgument("parameters.config must be a JSON string holding the model config")
    await daemon.repository.load(request.match_info["model"], config_text)
    return _empty(200)


async def repository_unload(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    await daemon.repository.unload(request.match_info["model"])
    return _empty(200)


def add_routes(app: web.Application) -> None:
    r = app.router
    # aiohttp matches routes in registration order: the hot path goes first.
    r.add_post("/v2/models/{model}/infer", infer)
    r.add_post("/v2/models/{model}/versions/{version}/infer", infer)
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    r.add_get("/v2", server_metadata)
    r.add_get("/metrics", metrics)
    r.add_get("/v2/models/stats", model_stats)
    r.add_post("/v2/repository/index", repository_index)
    r.add_post("/v2/repository/models/{model}/load", repository_load)
    r.add_post("/v2/repository/models/{model}/unload", repository_unload)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_get(prefix, model_metadata)
        r.add_get(prefix + "/ready", model_ready)
        r.add_get(prefix + "/config", model_config)
        r.add_get(prefix + "/stats", model_stats)
