"""Requests hold the model they use until their response is done.

`hold(request, name)` loads an on-demand model if needed and takes a lease on it
(daemon.core.residency), so an idle unload or an eviction never cuts a request. `use(request,
model)` enters the version a route resolved (`LoadedVersion.enter`), so a reload that swaps in
another version meanwhile retires this one only after the request, even one whose body is
still arriving. The middleware lets both go once the handler has returned, i.e. after a
streamed response has been written completely.
"""

from __future__ import annotations

from typing import Literal

from aiohttp import web

from daemon.api.errors import Handler
from daemon.api.state import daemon_of
from daemon.core.model import LoadedVersion
from daemon.core.residency import Lease

_LEASES = web.RequestKey("edged.leases", list[Lease])
_VERSIONS = web.RequestKey("edged.versions", list[LoadedVersion])


async def hold(
    request: web.Request, name: str, keep_alive: float | Literal["default"] | None = "default"
) -> Lease:
    lease = await daemon_of(request).hold(name, keep_alive)
    request.setdefault(_LEASES, []).append(lease)
    return lease


def use(request: web.Request, model: LoadedVersion) -> LoadedVersion:
    """`model`, entered until the response is done: call it right after resolving."""
    model.enter()
    request.setdefault(_VERSIONS, []).append(model)
    return model


@web.middleware
async def release_leases(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    finally:
        for model in request.pop(_VERSIONS, ()):
            model.leave()
        for lease in request.pop(_LEASES, ()):
            lease.release()
