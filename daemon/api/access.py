"""Who may call what: the Unix socket's peer uid, and a bearer token for TCP callers.

- Unix socket: the socket file's mode is the first gate; `server.allowed-uids` (checked with
  SO_PEERCRED) narrows it further for every route. Root is always allowed.
- TCP: anyone who can reach the port. Admin routes (model load/unload, updates, logging,
  llama-server's slot save/restore/erase and POST /lora-adapters)
  need `Authorization: Bearer <token>` (or `X-Api-Key: <token>`, as Anthropic's clients send it)
  with the token from `server.token-file`; without a token file they are refused over TCP.
  With `server.tcp-auth = "all"` every route but the health checks (`/v2/health/*`, and
  llama-server's `/health`, `/v1/health`) needs the token.
- Shared-memory registration follows `server.shared-memory`: "socket" (default) and "off"
  refuse TCP callers (daemon.api.shm answers 501), "token" admits TCP callers with the
  token, "all" admits every TCP caller, as Triton does.

Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from daemon.api.errors import error_response
from daemon.api.peers import peer_uid, uid_allowed, unix_socket
from daemon.config import ServerConfig

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ADMIN_PATHS = re.compile(
    r"^/v2/repository/models/[^/]+/(load|unload)$"
    r"|^/v1/updates(/.*)?$"
    r"|^/v2/logging$"
    # llama-server's slot actions: they write and read files on the box and drop a slot's cache.
    r"|^/slots/[^/]+$"
    # llama-server's change of a model's LoRA scales: every later request gets them.
    r"|^/lora-adapters$"
)
# llama-server's health check, public there too (no API key), as Triton's /v2/health/* here.
_LLAMA_HEALTH = frozenset({"/health", "/v1/health"})
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_SHM_PATHS = re.compile(r"^/v2/(system|cuda)sharedmemory/")


def is_admin(method: str, path: str) -> bool:
    """Routes that change the daemon (not just ask it something)."""
    return method not in _READ_METHODS and _ADMIN_PATHS.match(path) is not None


def _bearer(request: web.Request) -> str:
    """The caller's token: `Authorization: Bearer <token>`, or `X-Api-Key: <token>` where no
    Authorization header is sent (Anthropic's clients, as llama-server takes it)."""
    header = request.headers.get("Authorization")
    if header is None:
        return request.headers.get("X-Api-Key", "").strip()
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def make_access_middleware(server: ServerConfig, token: str | None) -> Middleware:
    allowed = frozenset(server.allowed_uids)
    everything = server.tcp_auth == "all"
    shm_token = server.shared_memory == "token"
    expected = (token or "").encode()

    @web.middleware
    async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
        unix = unix_socket(request.transport)
        if unix is not None:
            # The syscall only when there is an allow-list: the socket's mode is the gate else.
            if allowed and not uid_allowed(peer_uid(unix), allowed):
                return error_response(403, "caller's uid is not in server.allowed-uids", request.path)
            return await handler(request)
        path = request.path
        needs_token = (
            is_admin(request.method, path)
            or (everything and not (path.startswith("/v2/health/") or path in _LLAMA_HEALTH))
            or (shm_token and request.method not in _READ_METHODS and _SHM_PATHS.match(path) is not None)
        )
        if needs_token:
            if not expected:
                return error_response(
                    403, f"{request.method} {path} is an admin route: over TCP it needs "
                    "server.token-file set (or use the Unix socket)", path,
                )
            # aiohttp keeps a header's bytes that are no UTF-8 as surrogates: back to those bytes
            # (a wrong token), where a plain encode() would raise (a 500).
            if not hmac.compare_digest(_bearer(request).encode("utf-8", "surrogateescape"), expected):
                response = error_response(401, "missing or wrong bearer token", path)
                response.headers["WWW-Authenticate"] = 'Bearer realm="edged"'
                return response
        return await handler(request)

    return access
