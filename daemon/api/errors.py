"""The one place where errors become HTTP responses: `{"error": "..."}` with the status the
error class names (KServe/Triton convention), in the shape the route's clients read (by path
prefix): OpenAI's `{"error": {"message", "type", ...}}` and Anthropic's
`{"type": "error", "error": {"type", "message"}}` on their routes."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestPayloadError

from daemon.api.body import BodyTooLarge
from daemon.api.kserve_codec import oversized_message
from daemon.errors import EdgedError
from daemon.logs import Throttled

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_encode = msgspec.json.Encoder().encode


# OpenAI clients read `error.message`; Triton/KServe clients read a plain `error` string.
# llama-server's utility routes (daemon.api.llama_native) answer in OpenAI's shape as it does.
_OPENAI_PREFIXES = ("/v1/chat/", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/responses",
                    "/chat/completions", "/models", "/responses",
                    "/tokenize", "/detokenize", "/apply-template", "/props", "/slots", "/lora-adapters", "/completion", "/infill",
                    "/embedding",  # also /embeddings
                    "/rerank", "/v1/rerank")  # also /reranking, /v1/reranking
# Anthropic's Messages API (daemon.api.anthropic), and its error types by status.
_ANTHROPIC_PREFIXES = ("/v1/messages",)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
# Clients that expect a 413 for an oversized body (Triton's get its 400).
_JSON_API_PREFIXES = _OPENAI_PREFIXES + _ANTHROPIC_PREFIXES
_OPENAI_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 503: "server_error"}


def error_body(status: int, message: str, path: str = "") -> dict[str, object]:
    """`{"error": ...}` as the route's clients read it; also the last event of a stream that
    fails after its status went out (the openai client raises on an event carrying `error`;
    the anthropic client on an `error` event, whose data this is)."""
    if path.startswith(_ANTHROPIC_PREFIXES):
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if path.startswith(_OPENAI_PREFIXES):
        error: object = {
            "message": message,
            "type": _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": None,
            "code": None,
        }
    else:
        error = message
    return {"error": error}


def error_response(status: int, message: str, path: str = "") -> web.Response:
    try:
        body = _encode(error_body(status, message, path))
    except UnicodeEncodeError:
        # The message quotes a client's string holding a lone surrogate (Python's json reads
        # them from `\ud800` escapes), which UTF-8 cannot carry: shown as that escape instead.
        message = message.encode("utf-8", "backslashreplace").decode()
        body = _encode(error_body(status, message, path))
    return web.Response(status=status, body=body, content_type="application/json")


# Request body encodings Triton decodes; any other is its 501 "Unsupported compression type".
_KSERVE_ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})


def _unsupported_encoding(request: web.Request) -> bool:
    # aiohttp would also decode br/zstd (when their modules are installed) and pass unknown
    # encodings through undecoded; Triton's clients get a 501 for both.
    encoding = request.headers.get("Content-Encoding")
    return (
        encoding is not None
        and encoding.strip().lower() not in _KSERVE_ENCODINGS
        and request.path.startswith("/v2/")
    )


def _too_large(request: web.Request, exc: web.HTTPRequestEntityTooLarge) -> web.Response:
    """Triton answers an oversized request with a 400 and this wording; OpenAI clients
    expect a 413."""
    limit = request.app._client_max_size  # the one limit aiohttp enforces
    if request.path.startswith(_JSON_API_PREFIXES):
        return error_response(413, f"request body exceeds the limit: {exc.text}", request.path)
    size = request.content_length  # None for a chunked body: its size is not known
    message = (
        oversized_message(size, limit)
        if size is not None and size > limit
        else f"request size exceeds the maximum allowed input size of {limit} bytes"
    )
    return error_response(400, message, request.path)


_TOO_DEEP = "the request nests too deeply to be read (JSON objects and arrays inside each other)"


def make_error_middleware() -> Middleware:
    server_faults = Throttled(log)  # per status: one line a minute at most

    @web.middleware
    async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await answer(request, handler)
        if not response.prepared and request.writer.output_size > 0:
            # The handler failed after its own response had started (a stream that does not
            # end its events with the error itself): a second response would be written into
            # the first. Closing the connection is all that is left.
            raise ConnectionResetError(f"{request.method} {request.path}: failed after the response started")
        return response

    async def answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        """The handler's response, or the error response for what it raised."""
        if _unsupported_encoding(request):
            return error_response(501, "Unsupported compression type", request.path)
        try:
            return await handler(request)
        except BodyTooLarge as exc:
            # Triton's clients get its 400; OpenAI clients expect a 413.
            status = 413 if request.path.startswith(_JSON_API_PREFIXES) else 400
            return error_response(status, exc.message, request.path)
        except EdgedError as exc:
            if exc.status >= 500:
                server_faults.warning(exc.status, "%s %s -> %d: %s", request.method, request.path, exc.status, exc.message)
            return error_response(exc.status, exc.message, request.path)
        except web.HTTPRequestEntityTooLarge as exc:
            return _too_large(request, exc)
        except RequestPayloadError as exc:  # a body that does not decompress, a cut body
            return error_response(400, f"failed to read the request body: {exc}", request.path)
        except web.HTTPNotFound:
            return error_response(404, "Not Found", request.path)
        except web.HTTPMethodNotAllowed:
            return error_response(405, "Method Not Allowed", request.path)  # Triton's text
        except web.HTTPException as exc:
            return error_response(exc.status, exc.reason, request.path)
        except (ConnectionResetError, TimeoutError):
            raise
        except RecursionError:
            # Nothing on a request's path recurses but over what the client sent: JSON nested
            # past Python's recursion limit, in the body or in a string of it that holds JSON
            # (a schema, a tool call's arguments), read by msgspec or json.
            return error_response(400, _TOO_DEEP, request.path)
        except Exception as exc:  # never let a request take the daemon down
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(500, f"internal error: {type(exc).__name__}: {exc}", request.path)

    return error_middleware

