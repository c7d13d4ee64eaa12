"""Admin routes: backend plugins, hardware, offline updates."""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from daemon.api.state import Daemon, daemon_of

_json = msgspec.json.Encoder()


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(payload), content_type="application/json")


async def backends(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    # Resolving imports plugin code (and its runtime): keep it off the event loop.
    infos = await asyncio.get_running_loop().run_in_executor(None, daemon.plugins.info)
    return _json_response({"backends": infos})


async def hardware(request: web.Request) -> web.Response:
    return _json_response(daemon_of(request).hardware)


def start_background(daemon: Daemon) -> list[asyncio.Task[None]]:
    """Background tasks owned by the admin side (the update inbox watcher)."""
    return []


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v2/backends", backends)
    app.router.add_get("/v2/hardware", hardware)
