"""The one place where errors become HTTP responses: `{"error": "..."}` with the status the
error class names (KServe/Triton convention)."""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from daemon.errors import EdgedError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_encode = msgspec.json.Encoder().encode


def error_response(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_encode({"error": message}), content_type="application/json")


def make_error_middleware(allowed_uids: frozenset[int]) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if allowed_uids and not _peer_allowed(request, allowed_uids):
            return error_response(403, "caller's uid is not in server.allowed-uids")
        try:
            return await handler(request)
        except EdgedError as exc:
            if exc.status >= 500:
                log.warning("%s %s -> %d: %s", request.method, request.path, exc.status, exc.message)
            return error_response(exc.status, exc.message)
        except web.HTTPRequestEntityTooLarge as exc:
            return error_response(413, f"request body exceeds the limit: {exc.text}")
        except web.HTTPNotFound:
            return error_response(404, "Not Found")
        except web.HTTPMethodNotAllowed as exc:
            return error_response(405, f"method {exc.method} not allowed for {request.path}")
        except web.HTTPException as exc:
            return error_response(exc.status, exc.reason)
        except (ConnectionResetError, TimeoutError):
            raise
        except Exception as exc:  # never let a request take the daemon down
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    return error_middleware


def _peer_allowed(request: web.Request, allowed: frozenset[int]) -> bool:
    """On the Unix socket, check the caller's uid with SO_PEERCRED; TCP callers have no uid."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        return True
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid in allowed or uid == 0
