"""Builds the aiohttp application over a `Service`: routes, error mapping, and the service's
start/stop hooked into aiohttp's `cleanup_ctx` (stop runs after aiohttp has stopped accepting
and drained in-flight requests for `shutdown_timeout`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from daemon.api import admin, kserve, openai
from daemon.api.errors import error_response, make_error_middleware
from daemon.api.kserve_codec import Codec
from daemon.api.state import CODEC, SERVICE
from daemon.service import Service


async def _not_found(request: web.Request) -> web.Response:
    return error_response(404, "Not Found")


def create_app(service: Service) -> web.Application:
    config = service.config
    app = web.Application(
        client_max_size=config.server.max_request_bytes,
        middlewares=[make_error_middleware(frozenset(config.server.allowed_uids))],
    )
    app[SERVICE] = service
    app[CODEC] = Codec(max_request_bytes=config.server.max_request_bytes)
    kserve.add_routes(app)
    openai.add_routes(app)
    admin.add_routes(app)
    app.router.add_route("*", "/{tail:.*}", _not_found)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await service.start()
        yield
        await service.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
