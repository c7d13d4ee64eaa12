"""Requests hold the model they use (daemon.core.residency) until their response is done.

`hold(request, name)` loads an on-demand model if needed and takes a lease on it; the middleware
releases every lease of a request once its handler has returned, i.e. after a streamed response
has been written completely, so an idle unload or an eviction never cuts a request.
"""

from __future__ import annotations

from typing import Literal

from aiohttp import web

from daemon.api.errors import Handler
from daemon.api.state import daemon_of
from daemon.core.residency import Lease

_LEASES = web.RequestKey("edged.leases", list[Lease])


async def hold(
    request: web.Request, name: str, keep_alive: float | Literal["default"] | None = "default"
) -> Lease:
    lease = await daemon_of(request).hold(name, keep_alive)
    request.setdefault(_LEASES, []).append(lease)
    return lease


@web.middleware
async def release_leases(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    finally:
        for lease in request.pop(_LEASES, ()):
            lease.release()
