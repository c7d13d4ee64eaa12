"""Builds the aiohttp application over a `Service`: routes, middlewares, error mapping.

It serves what the lean front (daemon.api.front) relays to it. The service's lifecycle is the
server's (daemon.server), not the app's: the app is built after the daemon is ready."""

from __future__ import annotations

from aiohttp import web

from daemon.api import (
    admin,
    anthropic,
    kserve,
    llama_completion,
    llama_native,
    logging_routes,
    ollama,
    openai,
    openai_responses,
    rerank,
    shm,
    trace,
)
from daemon.api.access import make_access_middleware
from daemon.api.errors import make_error_middleware
from daemon.api.infer import InferEndpoint
from daemon.api.kserve import INFER
from daemon.api.kserve_codec import Codec
from daemon.api.leases import release_leases
from daemon.api.state import CODEC, SERVICE
from daemon.api.trace import TRACER
from daemon.service import Service


def create_app(service: Service, token: str | None) -> web.Application:
    """`token`: the bearer token of `server.token-file` (daemon.config.read_token), read before
    the daemon reports ready so that a bad file stops it at start."""
    config = service.config
    app = web.Application(
        client_max_size=config.server.max_request_bytes,
        middlewares=[
            make_access_middleware(config.server, token),
            make_error_middleware(),
            release_leases,
        ],
    )
    app[SERVICE] = service
    app[CODEC] = Codec(
        max_request_bytes=config.server.max_request_bytes,
        max_tensor_elements=config.server.max_tensor_elements,
        max_decoded_bytes=config.server.max_decoded_bytes,
    )
    kserve.add_routes(app)
    shm.add_routes(app)
    logging_routes.add_routes(app)
    openai.add_routes(app)
    openai_responses.add_routes(app)
    anthropic.add_routes(app)
    ollama.add_routes(app)
    llama_native.add_routes(app)
    rerank.add_routes(app)
    llama_completion.add_routes(app)
    admin.add_routes(app)
    trace.add_routes(app, config.trace.file)
    # The infer route's work, shared with the lean front (daemon.api.front).
    app[INFER] = InferEndpoint(service, app[CODEC], app[TRACER], app[shm.SHM])
    # No catch-all route: aiohttp answers an unknown path with 404 and a known path with the
    # wrong method with 405 (both through the error middleware, as {"error": ...}).
    return app
