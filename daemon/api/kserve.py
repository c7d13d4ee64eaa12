"""KServe v2 (Open Inference Protocol) REST routes with Triton's extensions.

Handlers decode, call the data plane, encode; nothing else.
"""

from __future__ import annotations

import logging

import msgspec
from aiohttp import HttpVersion11, web

from daemon import __version__
from daemon.api import repository_load as load_api
from daemon.api.body import read_body, read_tensor_body
from daemon.api.encoding import compress, response_encoding
from daemon.api.front import LIVE_BODY, READY_BODY
from daemon.api.infer import InferEndpoint
from daemon.api.kserve_codec import parse_header_length
from daemon.api.leases import hold, use
from daemon.api.shm import is_unix
from daemon.api.state import daemon_of
from daemon.core.model import LoadedVersion
from daemon.core.registry import IndexEntry
from daemon.core.repository import load_failure
from daemon.errors import BackendError, InvalidArgument, Unavailable
from daemon.service import Service

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()

EXTENSIONS = [
    "classification",
    # sequence_id / sequence_start / sequence_end (daemon.core.sequence); string IDs too.
    "sequence",
    "sequence(string_id)",
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
    "trace",
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
    # The Open Inference Protocol's body, which KServe's client reads (Triton sends none).
    return web.Response(body=LIVE_BODY, content_type="application/json")


async def ready(request: web.Request) -> web.Response:
    if daemon_of(request).ready():
        return web.Response(body=READY_BODY, content_type="application/json")
    return _empty(400)  # Triton's answer while not ready


async def server_metadata(request: web.Request) -> web.Response:
    return _json_response({"name": "edged", "version": __version__, "extensions": EXTENSIONS})


def model_metadata_payload(daemon: Service, model: LoadedVersion) -> dict[str, object]:
    entry = daemon.registry.entry(model.name)
    return model.metadata(sorted(entry.versions) if entry else [model.version])


async def model_metadata(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    await hold(request, request.match_info["model"])  # clients read metadata before infer
    model = daemon.registry.get(request.match_info["model"], _version(request))
    return _json_response(model_metadata_payload(daemon, model))


async def model_ready(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    name = request.match_info["model"]
    if daemon.registry.is_ready(name, _version(request)):
        return _empty(200)
    # Triton answers an unknown model the same way as a version that is not ready.
    return _json_response({"error": "Model version not ready"}, status=400)


async def model_config(request: web.Request) -> web.Response:
    await hold(request, request.match_info["model"])  # perf_analyzer reads it before infer
    model = daemon_of(request).registry.get(request.match_info["model"], _version(request))
    return _json_response(model.triton_config())


# ---------------------------------------------------------------------------- inference


INFER = web.AppKey("infer", InferEndpoint)


async def infer(request: web.Request) -> web.Response:
    """The infer route for what the lean front (daemon.api.front) relays: compressed or
    chunked bodies, callers that need a bearer token, HTTP/1.0."""
    endpoint = request.app[INFER]
    # Loads an on-demand model, held until the response is done.
    await hold(request, request.match_info["model"])
    # Entered before the body is read: a reload meanwhile lets this request finish on it.
    model = use(request, endpoint.resolve(request.match_info["model"], _version(request)))
    trace = endpoint.trace(model)
    if trace is not None:
        trace.record("HTTP_RECV_START")
    header_length = parse_header_length(request.headers.get("Inference-Header-Content-Length"))
    body = await read_tensor_body(request, endpoint.service.config.server.max_request_bytes, header_length)
    if trace is not None:
        trace.record("HTTP_RECV_END")
    payload, json_length = await endpoint.run(model, body, header_length, endpoint.caller_shm(is_unix(request)), trace)
    # Content-Type among the headers rather than `content_type=`: the same bytes on the
    # wire, and aiohttp skips its content_type/charset checks (~1 us per request).
    headers = {"Content-Type": "application/json"}
    if json_length is not None:
        # The JSON header's length before compression, as Triton sends it.
        headers = {"Inference-Header-Content-Length": str(json_length), "Content-Type": "application/octet-stream"}
    encoding = response_encoding(request.headers.get("Accept-Encoding"))
    if encoding is not None:
        payload = await compress(payload, encoding)
        headers["Content-Encoding"] = encoding
    return web.Response(body=payload, headers=headers)


# ---------------------------------------------------------------------------- statistics


async def model_stats(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    name = request.match_info.get("model")
    version = _version(request)
    if name is None:
        models = daemon.registry.loaded()
    else:
        entry = daemon.registry.entry(name)
        models = list(entry.versions.values()) if entry is not None else []
        if version is not None:
            models = [m for m in models if m.version == int(version)]  # the route takes digits only
        if not models:
            # Triton's wording and status (its core reports INVALID_ARG), also for a known
            # model or version that is not loaded.
            raise InvalidArgument(f"requested model '{name}' is not available")
    return _json_response(
        {"model_stats": [m.stats.to_triton_json(m.name, str(m.version)) for m in models]}
    )


async def metrics(request: web.Request) -> web.Response:
    body = daemon_of(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


# ---------------------------------------------------------------------------- repository


class _IndexRequest(msgspec.Struct, forbid_unknown_fields=True):
    ready: bool = False


async def _body(request: web.Request) -> bytes:
    return await read_body(request, daemon_of(request).config.server.max_request_bytes)


async def _optional_body(request: web.Request, kind: type[msgspec.Struct]) -> msgspec.Struct:
    return load_api.decode_body(await _body(request), kind)


async def repository_index(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    body = await _optional_body(request, _IndexRequest)
    assert isinstance(body, _IndexRequest)
    # Triton lists a model it never tried to load by its name alone.
    rows = [
        IndexEntry(row.name) if row.state == "UNKNOWN" and not row.version else row
        for row in await daemon.repository.index(ready_only=body.ready)
    ]
    return _json_response(rows)


async def repository_load(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    _check_accepting(daemon)
    name = request.match_info["model"]
    config_json, files = load_api.parse_load(await _body(request))
    try:
        await daemon.repository.load(name, config_json, files)
    except BackendError as exc:
        raise load_failure(name, exc) from None
    return _empty(200)


async def repository_unload(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    dependents = load_api.parse_unload(await _body(request))
    await daemon.repository.unload(request.match_info["model"], dependents=dependents)
    return _empty(200)


async def _expect(request: web.Request) -> None:
    """`Expect` as Triton treats it: 100 Continue for `100-continue` (HTTP/1.1), any other
    expectation ignored and the request answered; aiohttp's default answers those 417 with a
    text body that no Triton client parses (the lean front relays every Expect here)."""
    if request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim response is not the body's start


def add_routes(app: web.Application) -> None:
    r = app.router
    # aiohttp matches routes in registration order: the hot path goes first.
    r.add_post("/v2/models/{model}/infer", infer, expect_handler=_expect)
    # Versions are digits, as in Triton's route patterns: /versions/x/... is a 404.
    r.add_post("/v2/models/{model}/versions/{version:[0-9]+}/infer", infer, expect_handler=_expect)
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    r.add_get("/v2", server_metadata)
    r.add_get("/metrics", metrics)
    r.add_get("/v2/models/stats", model_stats)
    r.add_post("/v2/repository/index", repository_index)
    r.add_post("/v2/repository/models/{model}/load", repository_load)
    r.add_post("/v2/repository/models/{model}/unload", repository_unload)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version:[0-9]+}"):
        r.add_get(prefix, model_metadata)
        r.add_get(prefix + "/ready", model_ready)
        r.add_get(prefix + "/config", model_config)
        r.add_get(prefix + "/stats", model_stats)
