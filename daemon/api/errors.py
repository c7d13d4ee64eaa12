"""The one place where errors become HTTP responses: `{"error": "..."}` with the status the
error class names (KServe/Triton convention)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from daemon.errors import EdgedError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_encode = msgspec.json.Encoder().encode


# OpenAI clients read `error.message`; Triton/KServe clients read a plain `error` string.
_OPENAI_PREFIXES = ("/v1/chat/", "/v1/completions", "/v1/embeddings", "/v1/models")
_OPENAI_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 503: "server_error"}


def error_response(status: int, message: str, path: str = "") -> web.Response:
    if path.startswith(_OPENAI_PREFIXES):
        error: object = {
            "message": message,
            "type": _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": None,
            "code": None,
        }
    else:
        error = message
    return web.Response(status=status, body=_encode({"error": error}), content_type="application/json")


def make_error_middleware() -> Middleware:
    @web.middleware
    async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except EdgedError as exc:
            if exc.status >= 500:
                log.warning("%s %s -> %d: %s", request.method, request.path, exc.status, exc.message)
            return error_response(exc.status, exc.message, request.path)
        except web.HTTPRequestEntityTooLarge as exc:
            return error_response(413, f"request body exceeds the limit: {exc.text}", request.path)
        except web.HTTPNotFound:
            return error_response(404, "Not Found", request.path)
        except web.HTTPMethodNotAllowed as exc:
            return error_response(405, f"method {exc.method} not allowed for {request.path}", request.path)
        except web.HTTPException as exc:
            return error_response(exc.status, exc.reason, request.path)
        except (ConnectionResetError, TimeoutError):
            raise
        except Exception as exc:  # never let a request take the daemon down
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(500, f"internal error: {type(exc).__name__}: {exc}", request.path)

    return error_middleware

