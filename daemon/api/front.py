"""The HTTP/1.1 front: owns every client connection, serves the hot routes itself, and relays
every other request to aiohttp in-process.

Why: under small Triton infer requests the event-loop thread is the bottleneck, and aiohttp's
per-request machinery (URL objects, multidicts, routing, middlewares, Request/Response objects,
a task per request) was the largest share of it after the socket calls themselves
(docs/performance.md). The front parses with httptools (llhttp, C) and serves, for a *plain*
request, with nothing else in between:

- `POST /v2/models/{m}[/versions/{v}]/infer` (daemon.api.infer does the work), and
- `GET /v2/health/live`, `GET /v2/health/ready`.

Plain means: HTTP/1.1, a `Content-Length` body within `server.max-request-bytes` (none for
GET), no `Transfer-Encoding`, `Content-Encoding`, `Expect` or `Upgrade`, no query string, no
percent-encoding in the path, and a caller that needs no bearer token (see daemon.api.access).
Anything else, on any route, is re-serialized as it was parsed (headers verbatim, the body
re-framed) and fed to an aiohttp request handler attached to the same connection through
`_Relay`, an in-process transport: aiohttp answers it exactly as it did before the front
existed (routes, middlewares, access checks, streaming, compression, error texts).

One connection answers its requests in order, one at a time, as aiohttp does; pipelined
requests wait, buffered (the socket stops being read once too much waits). A relayed
response's end is found by parsing it (httptools' response parser), so the next request on the
connection may again be served by the front.

The same front runs in each HTTP worker process (`server.workers`, daemon.api.workers): there
it answers infer requests through the daemon (`Front.answer` runs in the daemon) and, where it
would relay, hands the connection back to the daemon with what it read and did not answer
(`_Connection.unanswered`).

Connection limits live here, for both paths: `server.max-connections` (503 and close),
`server.header-timeout` (a new connection's first request, any request whose headers
arrive in pieces, and each stretch of a body: see `_body_deadline`), `server.keepalive-timeout`
(idle between requests). Each limit logs one line per minute with a count.

An `Upgrade` header is ignored, as Triton (evhtp) ignores it: nothing here switches protocols,
so `curl --http2` (h2c) is answered in HTTP/1.1 and the header is not passed on to aiohttp.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections import OrderedDict, deque
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, cast

import httptools
import msgspec

from daemon.api.buffers import aligned_buffer, direct_read
from daemon.api.encoding import compress, response_encoding
from daemon.api.kserve_codec import parse_header_length
from daemon.api.peers import peer_uid, uid_allowed, unix_socket
from daemon.config import ServerConfig
from daemon.errors import EdgedError, InvalidArgument
from daemon.logs import Throttled

if TYPE_CHECKING:
    from daemon.api.infer import InferEndpoint
    from daemon.api.workers import WorkerPool
    from daemon.service import Service

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode

# Model names and versions as the aiohttp routes match them, minus what a plain request never has.
_INFER_PATH = re.compile(rb"/v2/models/([^/?#%]+)(?:/versions/([0-9]+))?/infer")
# _FAILED: the place of a request that did not parse, answered with the parse error in turn.
_RELAY, _INFER, _LIVE, _READY, _FAILED = range(5)
_HEALTH = {b"/v2/health/live": _LIVE, b"/v2/health/ready": _READY}
# The Open Inference Protocol's bodies (KServe's client reads them; Triton's sends none and
# tritonclient reads only the status); daemon.api.kserve's routes answer with them too.
LIVE_BODY, READY_BODY = b'{"live":true}', b'{"ready":true}'
# Headers that make a request not plain (lower-case, as compared).
_NOT_PLAIN = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
# Pipelined requests waiting behind the active one: stop reading the socket beyond these.
_MAX_WAITING = 16
_MAX_WAITING_BYTES = 4 * 1024 * 1024
# A request's line and headers together, at most (llhttp itself has no limit).
MAX_HEAD_BYTES = 64 * 1024
# A body must arrive at this many bytes per `server.header-timeout` at least (or be complete):
# a real client on a slow link sends far more; one that stalls or trickles a byte a second
# would hold a connection (and its `server.max-connections` slot) for as long as it likes.
_MIN_BODY_BYTES = 1024
# Larger bodies are written as header + body (no concatenation copy).
_JOIN_BELOW = 16 * 1024
# After an error answer to a request whose body was not read (408, 413, a framing error), the
# client may still be sending: closing with its bytes unread makes the kernel reset the
# connection, and over TCP the reset can destroy the answer before the client reads it. So the
# answer is followed by a half-close, and what the client still sends is read and dropped for
# this long at most (Go's net/http waits 0.5 s, nginx's lingering_time is 30 s).
_LINGER_S = 2.0
# aiohttp's own keep-alive timer must never close a connection the front still serves; the
# front closes idle connections itself.
RELAY_KEEPALIVE_S = 10 * 365 * 24 * 3600.0

_BUSY_BODY = b'{"error":"server has reached server.max-connections; try again later"}'
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class _Refuse(asyncio.Protocol):
    """Answers 503 and closes: what a connection over the cap gets."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports (daemon.eventloop) implement
        # asyncio's transport interface without subclassing its classes.
        transport = cast(asyncio.WriteTransport, transport)
        transport.write(_BUSY)
        transport.close()


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode())


class Front:
    """The connections' shared state: what they serve with, their limits, their drain.

    The front listens as soon as the service has started; the aiohttp side (the infer
    endpoint and the relay) is attached once it has been imported and built (daemon.server does
    that after the daemon is ready: it is most of the start time). Until then health requests
    are answered and every other request waits for `attach`, in order.
    """

    # A worker process's front (daemon.api.worker) answers infer requests through the daemon
    # and hands every other request's connection back to it.
    remote = False

    def __init__(self, server: ServerConfig, service: Service | None) -> None:
        self.server = server
        self.service = service
        self.health = dict(_HEALTH)
        # The largest infer body served on the lean path here (larger ones are relayed).
        self.infer_bytes = server.max_request_bytes
        # Connections past the first go to the HTTP worker processes, when there are any.
        self.pool: WorkerPool | None = None
        self.endpoint: InferEndpoint | None = None
        # Makes an aiohttp request handler (aiohttp's `web.Server` instance).
        self.relay: Callable[[], asyncio.Protocol] | None = None
        self._on_attach: list[Callable[[], None]] = []
        self.connections: set[_Connection] = set()
        self.unmade = 0  # made by `factory`, not yet connected
        # Sockets (by inode) once returned to a worker, newest last; bounded.
        self.returned: OrderedDict[int, None] = OrderedDict()
        self.stopping = False
        self.allowed_uids = frozenset(server.allowed_uids)
        # Repeated events (refused and silent connections, 5xx answers on the lean path): one
        # line a minute per kind, with the count held back.
        self.throttled = Throttled(log)
        self._status_lines = {status: _status_line(status) for status in (200, 400, 404, 503)}
        self.body_timeout_message = (
            f"request body not received in time: less than {_MIN_BODY_BYTES} bytes of it arrived"
            f" within server.header-timeout ({server.header_timeout:g} s)"
        )

    def attach(self, endpoint: InferEndpoint, relay: Callable[[], asyncio.Protocol]) -> None:
        self.endpoint = endpoint
        self.relay = relay
        waiting, self._on_attach = self._on_attach, []
        for resume in waiting:
            resume()

    def when_attached(self, resume: Callable[[], None]) -> None:
        self._on_attach.append(resume)

    def status_line(self, status: int) -> bytes:
        line = self._status_lines.get(status)
        if line is None:
            line = self._status_lines[status] = _status_line(status)
        return line

    def attached(self) -> bool:
        return self.endpoint is not None

    def factory(self) -> asyncio.BaseProtocol:
        """The protocol factory for loop.create_server / create_unix_server."""
        pool = self.pool
        held = len(self.connections) + (pool.connections if pool is not None else 0)
        if held >= self.server.max_connections:
            self.throttled.warning("over-cap", "connection refused: server.max-connections reached")
            return _Refuse()
        if pool is not None and pool.takes(len(self.connections) + self.unmade):
            return _HandOut(self)
        # Connections accepted together are all made before the first `connection_made`: the
        # decision above counts them too.
        self.unmade += 1
        return _Connection(self, unmade=True)

    def adopt(self, sock: Any, prefix: bytes, failure: tuple[int, str] | None) -> None:
        """Serve a connection a worker handed back: `prefix` is what it read and did not answer
        (requests re-serialized as they were parsed), `failure` a framing error that followed."""
        connection = _Connection(self, prefix, failure)
        # Back to a worker once idle, once: a connection handed back again (a client of other
        # routes than infer) stays here rather than bounce with every request.
        connection.inode = os.fstat(sock.fileno()).st_ino
        connection.adopted = connection.inode not in self.returned
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(lambda: connection, sock))
        task.add_done_callback(lambda done: done.cancelled() or done.exception() is None or sock.close())

    async def answer(
        self, model_name: str, version: str | None, body: bytes | memoryview, header_length: str | None,
        unix: bool, url: bytes,
    ) -> tuple[int, bytes | memoryview, int | None]:
        """One infer request: the status, the response body and its JSON header's length (None:
        all JSON). Errors are answered as Triton writes them, `{"error": "..."}`."""
        if self.endpoint is None:  # a worker's request before the aiohttp side is attached
            attached = asyncio.Event()
            self.when_attached(attached.set)
            await attached.wait()
        endpoint, service = self.endpoint, self.service
        assert endpoint is not None and service is not None
        try:
            lease = await service.hold(model_name)
            try:
                model = endpoint.resolve(model_name, version)
                # A large body is decoded off the loop: a reload meanwhile lets it finish here.
                model.enter()
                try:
                    trace = endpoint.trace(model)
                    if trace is not None:  # the body is in before the route is known
                        trace.record("HTTP_RECV_START")
                        trace.record("HTTP_RECV_END")
                    shm = endpoint.caller_shm(unix)
                    payload, json_length = await endpoint.run(
                        model, body, parse_header_length(header_length), shm, trace
                    )
                finally:
                    model.leave()
            finally:
                lease.release()
        except EdgedError as exc:
            if exc.status >= 500:
                self.throttled.warning(exc.status, "POST %s -> %d: %s", url.decode("latin-1"), exc.status, exc.message)
            return exc.status, _encode({"error": exc.message}), None
        except asyncio.CancelledError:
            raise  # the client went away (or the drain ran out of time)
        except Exception as exc:  # never let a request take the daemon down
            log.exception("unhandled error on POST %s", url.decode("latin-1"))
            return 500, _encode({"error": f"internal error: {type(exc).__name__}: {exc}"}), None
        return 200, payload, json_length

    def hand_back(self, connection: _Connection) -> None:
        raise NotImplementedError  # only a worker's front hands connections back

    def closed(self, connection: _Connection) -> None:
        self.connections.discard(connection)

    async def drain(self, grace_s: float) -> None:
        """Stop: idle connections close now, busy ones after their current response; requests
        the front serves get `grace_s` seconds to finish, then are cancelled. (Relayed requests
        are aiohttp's: its runner drains them.)"""
        self.stopping = True
        # The workers drain beside this process: their requests are answered here meanwhile.
        workers = asyncio.ensure_future(self.pool.stop(grace_s)) if self.pool is not None else None
        for connection in list(self.connections):
            connection.close_if_idle()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace_s)
            for task in late:
                task.cancel()
        if workers is not None:
            await workers

    def close_all(self) -> None:
        for connection in list(self.connections):
            connection.close()


class _HandOut(asyncio.Protocol):
    """A new connection for an HTTP worker process: its socket goes to the worker, which serves
    it from its first byte (nothing has been read here). Served here when no worker takes it."""

    def __init__(self, front: Front) -> None:
        self.front = front

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # as in _Refuse
        front = self.front
        pool = front.pool
        sock = transport.get_extra_info("socket")
        # Decided again now: a connection of the daemon's own may have closed since `factory`
        # (a client that closes one connection and opens the next finds the daemon serving
        # the new one, whichever of the two events the loop ran first).
        if (
            pool is not None and sock is not None and pool.takes(len(front.connections) + front.unmade)
            and pool.hand_out(sock)
        ):
            transport.close()  # the worker holds its own copy of the socket
            return
        connection = _Connection(self.front)
        transport.set_protocol(connection)
        connection.connection_made(transport)


class _Reject(Exception):
    """Raised from a parser callback: stops parsing (httptools reports it as a parser error)
    and is answered with `status` and `message`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _head_too_large() -> _Reject:
    return _Reject(431, f"request line and headers exceed {MAX_HEAD_BYTES} bytes")


class _Request:
    """One parsed request, from its first byte until its response is written."""

    __slots__ = (
        "accept_encoding", "body", "chunked", "complete", "filled", "head_bytes", "header_length",
        "headers", "http_version", "keep_alive", "kind", "length", "method", "model", "not_plain", "parts",
        "parts_bytes", "relay_wrote", "responded", "url", "version",
    )

    def __init__(self) -> None:
        self.url = b""
        self.head_bytes = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.method = b""
        self.http_version = ""
        self.keep_alive = True
        self.kind = _RELAY
        self.length: int | None = None
        self.header_length: str | None = None
        self.accept_encoding: str | None = None
        self.not_plain = False
        self.chunked = False
        self.model = ""
        self.version: str | None = None
        # The body: `body` (an aligned buffer, filled in place) or `parts` (joined at the end,
        # or, for a relayed request, framed pieces waiting to be forwarded).
        self.body: memoryview | None = None
        self.filled = 0
        self.parts: list[bytes] = []
        self.parts_bytes = 0
        self.complete = False  # the whole request has been received
        self.responded = False  # a relayed request's response has been written completely
        self.relay_wrote = False  # aiohttp has written some of its response (even a 100 Continue)


class _Connection(asyncio.Protocol):
    def __init__(
        self, front: Front, prefix: bytes = b"", failure: tuple[int, str] | None = None, *, unmade: bool = False,
    ) -> None:
        self.front = front
        self.unmade = unmade  # counted in `Front.unmade` until connected
        self.adopted = False  # handed back by a worker (daemon.api.workers), not yet returned
        self.inode = 0
        # What another process read from this connection and did not answer (daemon.api.workers).
        self.prefix: tuple[bytes, tuple[int, str] | None] | None = (prefix, failure) if prefix or failure else None
        # A worker waits for the parser to reach a request's end before handing the connection back.
        self.hand_back_pending = False
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: _Request | None = None  # being parsed
        self.active: _Request | None = None  # being answered
        self.waiting: deque[_Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.unix = False
        self.relay_only = False
        self.relaying: _Request | None = None  # the request being fed to aiohttp
        self.handler: asyncio.Protocol | None = None  # the aiohttp handler, made on first use
        self.relay: _Relay | None = None
        self.tracker: httptools.HttpResponseParser | None = None
        self.loop = asyncio.get_running_loop()
        # The header deadline (a new connection's first request, or headers arriving in
        # pieces) and the idle timer. The idle timer is armed once and re-armed only when it
        # fires early (`idle_since` moved): no timer handle per request.
        self.header_timer: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        # The body deadline (`_body_deadline`): body bytes received on this connection, and
        # their count when the current stretch began.
        self.body_timer: asyncio.TimerHandle | None = None
        self.body_bytes = 0
        self.body_mark = 0
        # While the client reads none of its answers (`_write_deadline`): the timer, and the
        # transport's buffered bytes when it was set.
        self.write_timer: asyncio.TimerHandle | None = None
        self.write_mark = 0
        self.idle_since = 0.0
        self.seen_request = False
        self.paused_by_relay = False
        self.paused_by_front = False
        # The client reads its answers slower than they are written: no further request is read
        # or served until the transport's buffer drains (pipelined infer answers would pile up).
        self.paused_by_writing = False
        self.reading_paused = False
        # A request with Upgrade and a body: llhttp ends it at its head (its body would be the
        # new protocol's); the body is parsed after that, by a fresh parser (`data_received`).
        self.upgrade_body: _Request | None = None
        self.upgrade_resumed = False
        # A framing error's answer (status, message), once one has been seen: nothing after it
        # on this connection is read.
        self.failure: tuple[int, str] | None = None
        # After that answer (`_linger`): reading only to drop what the client still sends.
        self.linger_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # as in _Refuse
        self.transport = transport
        front = self.front
        front.connections.add(self)
        if self.unmade:
            self.unmade = False
            front.unmade -= 1
        server = front.server
        sock = unix_socket(transport)
        self.unix = sock is not None
        if sock is not None:
            # The syscall only when there is an allow-list (the socket's mode is the gate
            # else); a refused caller's requests go to aiohttp, whose middleware answers 403.
            allowed = front.allowed_uids
            self.relay_only = bool(allowed) and not uid_allowed(peer_uid(sock), allowed)
        else:
            self.relay_only = server.tcp_auth == "all"  # every TCP request needs the token
        self.header_timer = self.loop.call_later(server.header_timeout, self._header_deadline)
        if self.prefix is not None:
            prefix, failure = self.prefix
            self.prefix = None
            if prefix:
                self.data_received(prefix)
            if failure is not None:
                self._fail_parse(*failure)

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.closed(self)
        for timer in (self.header_timer, self.idle_timer, self.body_timer, self.write_timer, self.linger_timer):
            if timer is not None:
                timer.cancel()
        self.header_timer = self.idle_timer = self.body_timer = self.write_timer = self.linger_timer = None
        if self.task is not None:
            self.task.cancel()  # the client is gone: nobody reads the answer
        if self.handler is not None:
            self.handler.connection_lost(exc)
        self.transport = None
        # The parser refers back to this connection (a cycle only a full garbage collection
        # frees): drop it and the requests now, or an upload the client abandoned keeps its
        # body (up to server.max-request-bytes) in memory long after the connection is gone.
        self.parser = httptools.HttpRequestParser(_NO_CALLBACKS)
        self.current = self.active = self.relaying = None
        self.waiting.clear()
        self.handler = self.relay = None
        self.tracker = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def close_if_idle(self) -> None:
        if self.active is None and not self.waiting and self.current is None:
            self.close()

    def pause_writing(self) -> None:
        self.paused_by_writing = True
        self.update_reading()
        self._start_write_timer()
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.paused_by_writing = False
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        self.update_reading()
        if self.handler is not None:
            self.handler.resume_writing()
        if self.active is None and self.waiting:
            self._start_next()  # held back by `_finish` while the buffer was full

    def _header_deadline(self) -> None:
        self.header_timer = None
        request = self.current
        if not self.seen_request or (request is not None and not request.method):
            self.front.throttled.warning("silent", "connection closed: no request headers within server.header-timeout")
            self.close()

    def _start_body_timer(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
        self.body_mark = self.body_bytes
        self.body_timer = self.loop.call_later(self.front.server.header_timeout, self._body_deadline)

    def _body_deadline(self) -> None:
        """A body must keep coming: at least `_MIN_BODY_BYTES` per `server.header-timeout`, or
        its end. Not a deadline for the whole body (a large upload on a slow link takes what it
        takes), and no stretch counts while this side holds the reading back. Answered 408."""
        self.body_timer = None
        request = self.current
        if request is None or not request.method or self.transport is None:
            return  # between requests, or in a next request's head (header-timeout's)
        if (
            self.reading_paused or self.body_bytes - self.body_mark >= _MIN_BODY_BYTES
            # A client that asked for 100 Continue waits for it (sent once the request's turn
            # comes, behind those pipelined before it): its body has not been asked for yet.
            or (not request.relay_wrote and any(name.lower() == b"expect" for name, _ in request.headers))
        ):
            self._start_body_timer()
            return
        self.front.throttled.warning("slow-body", "request body stalled: %s", self.front.body_timeout_message)
        self._fail_parse(408, self.front.body_timeout_message)

    def _start_write_timer(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
        if self.transport is None:
            return
        self.write_mark = self.transport.get_write_buffer_size()
        self.write_timer = self.loop.call_later(self.front.server.keepalive_timeout, self._write_deadline)

    def _write_deadline(self) -> None:
        """A client that reads none of its answers for `server.keepalive-timeout` is dropped:
        reading its requests stopped (`pause_writing`), but it would hold its connection, and a
        `server.max-connections` slot, for as long as it likes. One that reads, however slowly,
        keeps it."""
        self.write_timer = None
        if self.transport is None or not self.paused_by_writing:
            return
        if self.transport.get_write_buffer_size() < self.write_mark:
            self._start_write_timer()
            return
        self.front.throttled.warning(
            "unread", "connection dropped: the client read none of its answers within server.keepalive-timeout"
        )
        self.transport.abort()  # close() would wait for the buffer to drain, which it does not

    def _idle_deadline(self) -> None:
        self.idle_timer = None
        if self.active is not None or self.waiting or self.current is not None:
            return  # busy: re-armed when the connection is idle again
        left = self.idle_since + self.front.server.keepalive_timeout - self.loop.time()
        if left > 0:
            self.idle_timer = self.loop.call_later(left, self._idle_deadline)
        else:
            self.close()

    def update_reading(self) -> None:
        if self.transport is None:
            return
        pause = self.linger_timer is None and (
            self.paused_by_relay or self.paused_by_front or self.paused_by_writing or self.failure is not None
        )
        if pause != self.reading_paused:
            self.reading_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()
                if self.body_timer is not None:
                    self._start_body_timer()  # the client was not the one holding the body back

    def data_received(self, data: bytes) -> None:
        if self.linger_timer is not None:
            return  # the last answer is written (`_linger`): the rest is dropped unread
        try:
            self.parser.feed_data(data)
            request = self.current
            if request is not None:
                if not request.method:
                    if self.header_timer is None:
                        # A request's headers are arriving in pieces: they get header-timeout too
                        # (a keep-alive connection must not trickle headers forever).
                        self.header_timer = self.loop.call_later(
                            self.front.server.header_timeout, self._header_deadline
                        )
                elif self.body_timer is None and self.failure is None:
                    # A body arriving in pieces must keep coming (`_body_deadline`); one that
                    # came whole with its head never needed a timer.
                    self._start_body_timer()
        except httptools.HttpParserUpgrade as exc:
            # Nothing here switches protocols (h2c from `curl --http2`, websockets): the request
            # was relayed like any other, without its Upgrade (`_relay_head`), and aiohttp
            # answers it in HTTP/1.1; what follows it is parsed as the next request, by a fresh
            # parser (llhttp stops at an upgrade).
            offset = int(exc.args[0]) if exc.args and isinstance(exc.args[0], int) else len(data)
            self.parser = httptools.HttpRequestParser(self)
            request = self.upgrade_body
            if request is not None and not self.upgrade_resumed:
                # Its body follows: a head framed as it is, fed first, lets llhttp find the
                # body's end (and check a chunked one) for the request being parsed.
                self.upgrade_resumed = True
                if request.chunked:
                    self.parser.feed_data(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
                else:
                    self.parser.feed_data(b"POST / HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (request.length or 0))
            if offset < len(data):
                self.data_received(data[offset:])
        except httptools.HttpParserError as exc:
            reason = exc.__context__
            if isinstance(reason, _Reject):
                self._fail_parse(reason.status, reason.message)
            elif isinstance(reason, MemoryError):  # a callback's, not the client's fault
                self._fail_parse(503, "not enough memory to receive this request")
            else:
                self._fail_parse(400, f"malformed HTTP request: {exc}")

    def _fail_parse(self, status: int, message: str) -> None:
        """After a framing error nothing later on this connection can be trusted: the requests
        received whole before it are still answered, in order (as Triton does; a client that
        pipelined them gets its answers), then the error, then the connection closes."""
        if self.transport is None or self.failure is not None:
            return
        request, self.current = self.current, None
        self.upgrade_body, self.upgrade_resumed = None, False
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        if request is not None and request in self.waiting:
            # Its headers were read, its body broke (or stalled).
            if request is self.active:
                if request.relay_wrote:
                    # aiohttp has begun its answer: another one cannot follow it.
                    self.close()
                    return
                # Nobody has answered it yet (being relayed, aiohttp waits for the rest of the
                # body; or a worker waits for its end to hand the connection back): the error
                # is its answer, and aiohttp writes nothing more here.
                self.active = self.relaying = None
                self.tracker = None
                if self.relay is not None:
                    self.relay.closing = True
            self.waiting.remove(request)
        self.failure = (status, message)
        self.update_reading()
        failed = _Request()
        failed.kind, failed.complete, failed.keep_alive = _FAILED, True, False
        self.waiting.append(failed)
        if self.hand_back_pending:
            self.front.hand_back(self)
        elif self.active is None:
            self._start_next()

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        self.current = _Request()

    def on_url(self, url: bytes) -> None:
        request = self.current
        assert request is not None
        request.url += url
        request.head_bytes += len(url)
        if request.head_bytes > MAX_HEAD_BYTES:
            raise _head_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self.current
        assert request is not None
        request.head_bytes += len(name) + len(value) + 4
        if request.head_bytes > MAX_HEAD_BYTES:
            raise _head_too_large()
        request.headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length":
            request.length = int(value)  # llhttp has validated it
        elif lowered == b"inference-header-content-length":
            request.header_length = value.decode("latin-1")
        elif lowered == b"accept-encoding":
            request.accept_encoding = value.decode("latin-1")
        elif lowered == b"content-encoding":
            if value.strip().lower() not in (b"", b"identity"):
                request.not_plain = True
        elif lowered in _NOT_PLAIN:
            request.not_plain = True
            if lowered == b"transfer-encoding":
                request.chunked = True

    def on_headers_complete(self) -> None:
        if self.upgrade_resumed and self.upgrade_body is not None:
            self.current = self.upgrade_body  # the head framing an upgrade request's body
            return
        request = self.current
        assert request is not None
        parser = self.parser
        request.method = parser.get_method()
        request.http_version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        self.seen_request = True
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        version = parser.get_http_version()
        if version == "0.9":
            # A request line without a version: an HTTP/0.9 client reads a bare body, which
            # none of the routes can answer with (aiohttp would send "HTTP/0.9 200" + headers).
            raise _Reject(400, "HTTP/0.9 requests are not supported: send HTTP/1.0 or HTTP/1.1")
        if version not in ("1.0", "1.1"):
            # "HTTP/2.0" on a request line is not HTTP/2 (that starts with its preface, which
            # does not parse here): aiohttp would answer it in HTTP/1.1 framing labelled 2.0.
            raise _Reject(505, f"HTTP/{version} is not supported: send HTTP/1.0 or HTTP/1.1")
        if not self.relay_only and not request.not_plain and version == "1.1":
            self._classify(request)
        if (request.length or request.chunked) and parser.should_upgrade():
            self.upgrade_body = request
        if request.kind == _RELAY:
            request.parts.append(self._relay_head(request, version))
        elif request.kind == _INFER and request.length:
            offset = binary_offset(request.header_length)
            if direct_read(request.length, offset):
                assert offset is not None
                try:
                    request.body = aligned_buffer(request.length, offset)
                except MemoryError:  # this side's condition, not the client's mistake
                    raise _Reject(503, f"not enough memory to receive a body of {request.length} bytes") from None
        self.waiting.append(request)
        if self.hand_back_pending:
            self.front.hand_back(self)
        elif self.active is None:
            self._start_next()
        else:
            self._check_backlog()

    def _classify(self, request: _Request) -> None:
        if request.method == b"POST":
            match = _INFER_PATH.fullmatch(request.url)
            if match is None or request.length is None or request.length > self.front.infer_bytes:
                return
            request.kind = _INFER
            request.model = match[1].decode()
            request.version = match[2].decode() if match[2] is not None else None
        elif request.method == b"GET" and not request.length:
            request.kind = self.front.health.get(request.url, _RELAY)

    def unanswered(self) -> bytes | None:
        """The requests read and not answered, as bytes another front parses the same way (heads
        re-serialized, bodies as far as they came); None while the parser is inside a request's
        head or a chunked body, where the rest on the socket would not follow on from them."""
        current = self.current
        if current is not None and (not current.method or current.chunked):
            return None
        parts: list[bytes] = []
        for request in self.waiting:  # the request being parsed is in it once its head is
            if request.kind == _FAILED:
                break
            if request.kind == _RELAY:
                parts += request.parts
                continue
            parts.append(self._relay_head(request, request.http_version))
            if request.body is not None:
                parts.append(bytes(request.body[: request.filled]))
            else:
                parts += request.parts
        return b"".join(parts)

    def _relay_head(self, request: _Request, version: str) -> bytes:
        lines = [request.method, b" ", request.url, b" HTTP/", version.encode(), b"\r\n"]
        host = False
        for name, value in request.headers:
            lowered = name.lower()
            if lowered == b"upgrade":
                # Not passed on: aiohttp would take the request for a protocol switch and read
                # its body, and what follows it, as the new protocol's (never answering it).
                continue
            if lowered == b"connection" and b"upgrade" in value.lower():
                tokens = [t for t in value.split(b",") if t.strip().lower() != b"upgrade"]
                if not tokens:
                    continue
                value = b",".join(tokens)
            lines += (name, b": ", value, b"\r\n")
            host = host or lowered == b"host"
        if not host and version == "1.1":
            # aiohttp refuses an HTTP/1.1 request without Host (a 400 and a logged traceback);
            # Triton answers it, and so do the routes served here. No route reads Host.
            lines.append(b"Host: localhost\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def on_body(self, data: bytes) -> None:
        request = self.current
        assert request is not None
        self.body_bytes += len(data)
        if request.kind == _RELAY:
            if request.chunked:
                data = b"%x\r\n%s\r\n" % (len(data), data)
            if request is self.relaying:
                self._feed_relay(data)
                return
        elif request.body is not None:
            end = request.filled + len(data)
            request.body[request.filled : end] = data  # llhttp never passes Content-Length
            request.filled = end
            if request is not self.active:
                self._check_backlog()
            return
        request.parts.append(data)
        request.parts_bytes += len(data)
        if request is not self.active:
            self._check_backlog()

    def on_message_complete(self) -> None:
        request = self.current
        assert request is not None
        if request is self.upgrade_body:
            if not self.upgrade_resumed:
                return  # llhttp's end of an upgrade request at its head: its body follows
            self.upgrade_body, self.upgrade_resumed = None, False
        self.current = None
        request.complete = True
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        if request.kind == _RELAY and request.chunked:
            if request is self.relaying:
                self._feed_relay(b"0\r\n\r\n")
            else:
                request.parts.append(b"0\r\n\r\n")
        if self.hand_back_pending:
            self.front.hand_back(self)
        elif request is self.active:
            if request.kind == _RELAY:
                if request.responded:
                    self._finish()
            else:
                self._serve(request)

    # ------------------------------------------------------------------ answering in order

    def _check_backlog(self) -> None:
        # A body read in place (`_Request.body`) counts as far as it has come.
        waiting_bytes = sum(r.parts_bytes + r.filled for r in self.waiting if r is not self.active)
        self.paused_by_front = len(self.waiting) > _MAX_WAITING or waiting_bytes > _MAX_WAITING_BYTES
        self.update_reading()

    def _start_next(self) -> None:
        if not self.waiting or self.transport is None or self.paused_by_writing:
            return  # (`resume_writing` starts it)
        request = self.active = self.waiting[0]
        if request.kind == _RELAY:
            self._start_relay(request)
        elif request.complete:
            self._serve(request)

    def _finish(self) -> None:
        """The active request's response has been written."""
        request = self.active
        self.active = self.relaying = None
        if self.waiting and self.waiting[0] is request:
            self.waiting.popleft()
        if self.transport is None:
            return
        if request is not None and (not request.keep_alive or self.front.stopping):
            self.close()
            return
        if self.paused_by_front:
            self._check_backlog()
        if self.waiting:
            self._start_next()
        else:
            self.idle_since = self.loop.time()
            if self.idle_timer is None:
                self.idle_timer = self.loop.call_later(self.front.server.keepalive_timeout, self._idle_deadline)
            if self.adopted:
                self.loop.call_soon(self._return_to_worker, _RETURN_TRIES)

    def _return_to_worker(self, tries: int) -> None:
        """A connection a worker handed back goes back to a worker once idle, so that a client
        that asked for metadata first still has its later infer requests served there. Only
        once aiohttp's handler waits for a next request: closing it then is what a client
        closing an idle keep-alive connection does (its handler finishes its response's
        bookkeeping first, a few loop turns after the last byte)."""
        pool = self.front.pool
        transport = self.transport
        if (
            pool is None or transport is None or self.front.stopping or self.failure is not None or self.relay_only
            or self.active is not None or self.waiting or self.current is not None or self.tracker is not None
            or transport.get_write_buffer_size() or not pool.takes(len(self.front.connections) - 1)
        ):
            return
        if self.handler is not None and not _handler_idle(self.handler):
            if tries > 0:
                self.loop.call_soon(self._return_to_worker, tries - 1)
            return
        if pool.hand_out(transport.get_extra_info("socket")):
            returned = self.front.returned
            returned[self.inode] = None
            if len(returned) > _RETURNED_KEPT:
                returned.popitem(last=False)
            transport.close()  # the worker holds its own copy of the socket

    def _resume(self, request: _Request, step: Callable[[_Request], None]) -> Callable[[], None]:
        def resume() -> None:
            if self.transport is not None and self.active is request:
                step(request)

        return resume

    def _serve(self, request: _Request) -> None:
        if request.kind == _INFER:
            if not self.front.attached():
                self.front.when_attached(self._resume(request, self._serve))
                return
            self.task = self.loop.create_task(self._infer(request))
        elif request.kind == _LIVE:
            self._write(200, b"application/json", LIVE_BODY, None, close=not request.keep_alive)
            self._finish()
        elif request.kind == _READY:
            if self.front.service is not None and self.front.service.ready():
                self._write(200, b"application/json", READY_BODY, None, close=not request.keep_alive)
            else:  # Triton's answer, no body
                self._write(400, None, b"", None, close=not request.keep_alive)
            self._finish()
        else:  # _FAILED: the last answer on this connection
            assert self.failure is not None
            self._write_error(*self.failure, close=True)

    async def _infer(self, request: _Request) -> None:
        try:
            if request.body is not None:
                body: bytes | memoryview = request.body.toreadonly()
            else:
                body = b"".join(request.parts) if len(request.parts) != 1 else request.parts[0]
            status, payload, json_length = await self.front.answer(
                request.model, request.version, body, request.header_length, self.unix, request.url
            )
            encoding = response_encoding(request.accept_encoding) if status == 200 else None
            if encoding is not None:
                payload = await compress(payload, encoding)
        except asyncio.CancelledError:
            raise  # the client went away (or the drain ran out of time)
        except Exception as exc:  # never let a request take the daemon down
            log.exception("unhandled error on POST %s", request.url.decode("latin-1"))
            self._write_error(500, f"internal error: {type(exc).__name__}: {exc}", close=not request.keep_alive)
        else:
            content_type = b"application/json" if json_length is None else b"application/octet-stream"
            self._write(status, content_type, payload, json_length, close=not request.keep_alive, encoding=encoding)
        finally:
            self.task = None
        self._finish()

    def _write_error(self, status: int, message: str, *, close: bool) -> None:
        """Triton's error body, `{"error": "..."}` (daemon.api.errors writes the same for aiohttp's
        routes)."""
        self._write(status, b"application/json", _encode({"error": message}), None, close=close)

    def _write(
        self, status: int, content_type: bytes | None, body: bytes | memoryview, json_length: int | None, *, close: bool,
        encoding: str | None = None,
    ) -> None:
        transport = self.transport
        if transport is None:
            return
        head: list[bytes | memoryview] = [self.front.status_line(status)]
        if content_type is not None:
            head += (b"Content-Type: ", content_type, b"\r\n")
        if json_length is not None:
            # The JSON header's length before compression, as Triton sends it.
            head.append(b"Inference-Header-Content-Length: %d\r\n" % json_length)
        if encoding is not None:
            head += (b"Content-Encoding: ", encoding.encode(), b"\r\n")
        if close or self.front.stopping:
            head.append(b"Connection: close\r\n")
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        if len(body) < _JOIN_BELOW:
            head.append(body)
            transport.write(b"".join(head))
        else:
            transport.writelines([b"".join(head), body])
        if close:
            if self.failure is not None and transport.can_write_eof():
                self._linger(transport)
            else:
                transport.close()

    def _linger(self, transport: asyncio.Transport) -> None:
        """The answer to a framing or body error is written, but the client may still be
        sending (`_LINGER_S`): shut this side's writing once the answer is out, read and drop
        what arrives until the client closes or the time is up, then close."""
        transport.write_eof()
        self.linger_timer = self.loop.call_later(_LINGER_S, self.close)
        self.update_reading()

    # ------------------------------------------------------------------ relaying to aiohttp

    def _start_relay(self, request: _Request) -> None:
        if self.front.remote:
            self.front.hand_back(self)
            return
        if self.front.relay is None:
            self.front.when_attached(self._resume(request, self._start_relay))
            return
        self.relaying = request
        if self.handler is None:
            self.handler = self.front.relay()
            self.relay = _Relay(self)
            self.handler.connection_made(self.relay)
        self.tracker = httptools.HttpResponseParser(_Tracker(self, request.method == b"HEAD"))
        parts, request.parts, request.parts_bytes = request.parts, [], 0
        for part in parts:
            self._feed_relay(part)
        if self.paused_by_front:
            self._check_backlog()

    def _feed_relay(self, data: bytes) -> None:
        if self.handler is not None and self.relay is not None and not self.relay.closing:
            self.handler.data_received(data)

    def relay_write(self, data: bytes | bytearray | memoryview) -> None:
        """What aiohttp writes: to the client, and through the tracker that finds its end."""
        if self.transport is None:
            return
        if self.active is not None:
            self.active.relay_wrote = True
        self.transport.write(data)
        if self.tracker is not None:
            try:
                self.tracker.feed_data(bytes(data))
            except httptools.HttpParserError:
                log.exception("relayed response did not parse; closing the connection")
                self.close()

    def relay_response_done(self) -> None:
        self.tracker = None
        request = self.active
        if request is None:
            return
        request.responded = True
        if request.complete:
            # Not from inside aiohttp's write: it has not finished its own bookkeeping yet.
            self.loop.call_soon(self._finish_relayed, request)

    def _finish_relayed(self, request: _Request) -> None:
        if self.active is request:
            self._finish()

    def relay_closed(self) -> None:
        """aiohttp closes the connection (Connection: close, an error, its shutdown)."""
        self.close()

    def relay_pause(self, paused: bool) -> None:
        self.paused_by_relay = paused
        self.update_reading()


# What a closed connection's parser calls back: nothing (`_Connection.connection_lost`).
_NO_CALLBACKS = object()
# Loop turns an idle connection waits for aiohttp's handler to finish a response's bookkeeping.
_RETURN_TRIES = 20
# Connections remembered as returned to a worker once.
_RETURNED_KEPT = 4096


def _handler_idle(handler: asyncio.Protocol) -> bool:
    """aiohttp's request handler waits for a next request, with none being handled or queued.
    Read from its private state (aiohttp 3.x `RequestHandler`); unknown state reads as busy."""
    return (
        getattr(handler, "_current_request", True) is None
        and not getattr(handler, "_messages", True)
        and getattr(handler, "_waiter", None) is not None
    )


class _Tracker:
    """Finds where a relayed response ends (1xx interim responses do not count)."""

    __slots__ = ("connection", "head", "status")

    def __init__(self, connection: _Connection, head: bool) -> None:
        self.connection = connection
        self.head = head
        self.status = 0

    def on_headers_complete(self) -> None:
        tracker = self.connection.tracker
        assert tracker is not None
        self.status = tracker.get_status_code()
        if self.head and self.status >= 200:  # a response to HEAD has no body, whatever it says
            self.connection.relay_response_done()

    def on_message_complete(self) -> None:
        # An interim response (100 Continue) is not the end: the final one follows, parsed as
        # the next message by the same parser.
        if self.status >= 200 and not self.head:
            self.connection.relay_response_done()


class _Relay(asyncio.Transport):
    """The transport an aiohttp request handler sees: its writes go to the client (through the
    front's tracker), its flow control and extra info are the client connection's."""

    def __init__(self, connection: _Connection) -> None:
        super().__init__()
        self.connection = connection
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        transport = self.connection.transport
        return transport.get_extra_info(name, default) if transport is not None else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closing:
            self.connection.relay_write(data)

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def is_closing(self) -> bool:
        transport = self.connection.transport
        return self.closing or transport is None or transport.is_closing()

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.connection.relay_closed()

    def abort(self) -> None:
        self.closing = True
        transport = self.connection.transport
        if transport is not None:
            transport.abort()

    def pause_reading(self) -> None:
        self.connection.relay_pause(True)

    def resume_reading(self) -> None:
        self.connection.relay_pause(False)

    def is_reading(self) -> bool:
        return not self.connection.paused_by_relay

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        transport = self.connection.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        transport = self.connection.transport
        if transport is not None:
            transport.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        transport = self.connection.transport
        return transport.get_write_buffer_limits() if transport is not None else (0, 0)


def binary_offset(value: str | None) -> int | None:
    """`Inference-Header-Content-Length` as a number, for placing the body; None when absent or
    invalid (the codec then reports it with Triton's wording). Also daemon.api.workers's, for
    a frame's body."""
    try:
        offset = parse_header_length(value)
    except InvalidArgument:
        return None
    return offset if offset is not None and offset >= 0 else None
