"""Admin routes: backend plugins, hardware, offline updates."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import msgspec
from aiohttp import web

from daemon.api.state import daemon_of
from daemon.errors import InvalidArgument

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
_CHUNK = 1 << 20


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(payload), content_type="application/json")


async def backends(request: web.Request) -> web.Response:
    daemon = daemon_of(request)
    # Resolving imports plugin code (and its runtime): keep it off the event loop.
    infos = await asyncio.get_running_loop().run_in_executor(None, daemon.plugins.info)
    return _json_response({"backends": infos})


async def hardware(request: web.Request) -> web.Response:
    # Probes every fact not probed yet (imports OpenVINO, loads NVML): off the event loop.
    info = await asyncio.get_running_loop().run_in_executor(None, daemon_of(request).hardware.info)
    return _json_response(info)


async def update_status(request: web.Request) -> web.Response:
    return _json_response(daemon_of(request).releases.status())


async def apply_update(request: web.Request) -> web.Response:
    """`curl --unix-socket S --data-binary @bundle.edgebundle http://localhost/v1/updates`.

    The body is streamed to disk (bundles hold models: they may exceed the request size cap).
    """
    daemon = daemon_of(request)
    incoming = daemon.state_dir / "incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    path = incoming / f"{uuid.uuid4().hex}.edgebundle"
    progress: list[str] = []
    try:
        size = 0
        with path.open("wb") as out:
            async for chunk in request.content.iter_chunked(_CHUNK):
                out.write(chunk)
                size += len(chunk)
        if size == 0:
            raise InvalidArgument("request body must be the bundle file (e.g. curl --data-binary @FILE)")
        applied = await daemon.releases.apply(path, progress.append)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return _json_response({"applied": applied, "progress": progress})


async def rollback(request: web.Request) -> web.Response:
    release = await daemon_of(request).releases.rollback()
    return _json_response({"current": release.name})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v2/backends", backends)
    app.router.add_get("/v2/hardware", hardware)
    app.router.add_get("/v1/updates", update_status)
    app.router.add_post("/v1/updates", apply_update)
    app.router.add_post("/v1/updates/rollback", rollback)
