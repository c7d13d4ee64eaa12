"""Triton's shared memory extensions over HTTP: system (POSIX) shared memory, and the CUDA
routes answered the way a Triton built without GPU support answers them.

Who may use shared memory is `server.shared-memory` (see docs/operations.md): "socket" (the
default) admits callers on the Unix socket, whose file permissions and `allowed-uids` already
say who they are; "token" adds TCP callers with the bearer token (daemon.api.access checks
it); "all" adds every TCP caller; "off" refuses everyone. A refused caller gets 501
for register/unregister and for any infer request naming a region, like Triton's
`--allow-client-shm=false`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from daemon.api.body import read_body
from daemon.api.peers import unix_socket
from daemon.api.state import daemon_of
from daemon.core.shm import Lease, SharedMemoryRegistry
from daemon.errors import InvalidArgument, NotFound, Unsupported

SHM = web.AppKey("shm", SharedMemoryRegistry)

_json = msgspec.json.Encoder()


class _RegisterRequest(msgspec.Struct, forbid_unknown_fields=True):
    key: str
    byte_size: int
    offset: int = 0


class CallerShm:
    """The registry as one caller may use it: whether the caller may use shared memory is
    checked only when a request names a region (most never do)."""

    __slots__ = ("refusal", "registry")

    def __init__(self, registry: SharedMemoryRegistry, refusal: str | None) -> None:
        self.registry = registry
        self.refusal = refusal

    def acquire(self, name: str, offset: int, byte_size: int) -> Lease:
        if self.refusal is not None:
            raise Unsupported(self.refusal)
        return self.registry.acquire(name, offset, byte_size)


def refusal(mode: str, unix: bool) -> str | None:
    """Why a caller may not use shared memory under `server.shared-memory = mode`, or None
    when it may. `unix`: the caller came over the Unix socket."""
    if mode in ("all", "token"):  # "token": the access middleware already checked TCP callers
        return None
    if mode == "off":
        return "Client shared memory is disabled; set server.shared-memory to \"socket\" or \"all\" to enable it."
    if unix:
        return None
    return ("Client shared memory is disabled for callers over TCP; use the Unix socket or set "
            "server.shared-memory = \"all\".")


def is_unix(request: web.Request) -> bool:
    return unix_socket(request.transport) is not None


def _check_allowed(request: web.Request) -> None:
    why = refusal(daemon_of(request).config.server.shared_memory, is_unix(request))
    if why is not None:
        raise Unsupported(why)


def _json_response(payload: object) -> web.Response:
    return web.Response(body=_json.encode(payload), content_type="application/json")


def _ok() -> web.Response:
    return web.Response(status=200, content_type="application/json")


# ---------------------------------------------------------------------------- system


async def system_status(request: web.Request) -> web.Response:
    return _json_response(request.app[SHM].status(request.match_info.get("name")))


async def system_register(request: web.Request) -> web.Response:
    _check_allowed(request)
    name = request.match_info["name"]
    body = await read_body(request, daemon_of(request).config.server.max_request_bytes)
    try:
        params = msgspec.json.decode(body, type=_RegisterRequest)
    except msgspec.DecodeError as exc:
        raise InvalidArgument(
            f"failed to register shared memory region '{name}': malformed request body: {exc}"
        ) from None
    request.app[SHM].register(name, params.key, params.offset, params.byte_size)
    return _ok()


async def system_unregister(request: web.Request) -> web.Response:
    _check_allowed(request)
    name = request.match_info.get("name")
    registry = request.app[SHM]
    if name is None:
        registry.unregister_all()
    else:
        registry.unregister(name)
    return _ok()


# ---------------------------------------------------------------------------- CUDA


async def cuda_status(request: web.Request) -> web.Response:
    name = request.match_info.get("name")
    if name is not None:
        raise NotFound(f"Unable to find cuda shared memory region: '{name}'")
    return _json_response([])


async def cuda_register(request: web.Request) -> web.Response:
    _check_allowed(request)
    name = request.match_info["name"]
    raise InvalidArgument(f"failed to register CUDA shared memory region: '{name}', GPUs not supported")


async def cuda_unregister(request: web.Request) -> web.Response:
    # Nothing can be registered, so there is nothing to unregister: success, as in Triton.
    _check_allowed(request)
    return _ok()


# ---------------------------------------------------------------------------- wiring


async def _registry_context(app: web.Application) -> AsyncIterator[None]:
    yield
    app[SHM].close()


def add_routes(app: web.Application) -> None:
    app[SHM] = SharedMemoryRegistry()
    app.cleanup_ctx.append(_registry_context)
    r = app.router
    base = "/v2/systemsharedmemory"
    r.add_get(f"{base}/status", system_status)
    r.add_get(base + "/region/{name}/status", system_status)
    r.add_post(base + "/region/{name}/register", system_register)
    r.add_post(base + "/region/{name}/unregister", system_unregister)
    r.add_post(f"{base}/unregister", system_unregister)
    base = "/v2/cudasharedmemory"
    r.add_get(f"{base}/status", cuda_status)
    r.add_get(base + "/region/{name}/status", cuda_status)
    r.add_post(base + "/region/{name}/register", cuda_register)
    r.add_post(base + "/region/{name}/unregister", cuda_unregister)
    r.add_post(f"{base}/unregister", cuda_unregister)
