"""Connection limits in front of aiohttp: how many at once, and how long a silent one may stay.

aiohttp's server has no connection cap and no deadline for a request's headers, so slow or
idle clients can hold every file descriptor. The guard wraps aiohttp's protocol factory:

- over `max_connections`, a new connection gets `503` and is closed at once;
- a connection whose first request's headers have not arrived within `header_timeout` is
  closed (the middleware marks a connection as soon as aiohttp has parsed a request on it);
- idle keep-alive connections are closed by aiohttp itself (`keepalive_timeout`).

Each limit logs one warning per interval with a count, never one line per connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_BUSY_BODY = b'{"error":"server has reached server.max-connections; try again later"}'
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class _Refuse(asyncio.Protocol):
    """Answers 503 and closes: what a connection over the cap gets."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_BUSY)
        transport.close()


class RateLimitedLog:
    """At most one log line per `interval` seconds for a repeated event, with the count."""

    def __init__(self, what: str, interval: float = 60.0) -> None:
        self.what = what
        self.interval = interval
        self._count = 0
        self._last = -interval

    def __call__(self) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.interval:
            log.warning("%s (%d time(s) in the last %.0f s)", self.what, self._count, self.interval)
            self._count = 0
            self._last = now


class ConnectionGuard:
    def __init__(self, max_connections: int, header_timeout: float) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        # Connections that have not delivered a request's headers yet; each stays here at most
        # `header_timeout` seconds (aiohttp's handlers cannot be weakly referenced).
        self._waiting: set[web.RequestHandler] = set()
        self._over_cap = RateLimitedLog("connection refused: server.max-connections reached")
        self._silent = RateLimitedLog("connection closed: no request headers within server.header-timeout")

    def factory(self, server: web.Server) -> Callable[[], asyncio.BaseProtocol]:
        """A protocol factory for loop.create_server / create_unix_server."""
        loop = asyncio.get_running_loop()

        def make() -> asyncio.BaseProtocol:
            if len(server.connections) >= self.max_connections:
                self._over_cap()
                return _Refuse()
            handler = server()
            self._waiting.add(handler)
            loop.call_later(self.header_timeout, self._check, handler)
            return handler

        return make

    def _check(self, handler: web.RequestHandler) -> None:
        if handler not in self._waiting:
            return
        self._waiting.discard(handler)
        if handler.transport is None:
            return
        self._silent()
        handler.force_close()
        handler.transport.close()

    def middleware(self) -> Middleware:
        @web.middleware
        async def mark(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.protocol is not None:
                self._waiting.discard(request.protocol)
            return await handler(request)

        return mark
