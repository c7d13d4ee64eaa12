"""An HTTP worker process (`edged worker`, started by the daemon: daemon.api.workers).

It serves the connections the daemon hands it with the daemon's own front (daemon.api.front):
plain infer requests are answered through the daemon over the frame stream, `GET
/v2/health/live` here; any other request hands its connection back. It never loads a model,
reads no config file (the daemon passes its server settings) and exits when the daemon tells it
to stop or goes away. SIGTERM and SIGINT are the daemon's to act on (systemd sends them to the
whole unit): a worker finishes its requests when the daemon says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import socket
from typing import TYPE_CHECKING, Any

import msgspec

from daemon import eventloop
from daemon.api import channel
from daemon.api.front import Front
from daemon.api.workers import CONFIG_ENV, FDS_ENV, HANDBACK_ID
from daemon.config import LoggingConfig, ServerConfig
from daemon.errors import EdgedError
from daemon.logs import setup_logging

if TYPE_CHECKING:
    from daemon.api.front import _Connection


LARGE_BODY_BYTES = 256 * 1024


class _Settings(msgspec.Struct, forbid_unknown_fields=True):
    server: ServerConfig
    logging: LoggingConfig


class _Unavailable(Exception):
    pass


class WorkerFront(Front):
    """The front of a worker: infer through the daemon, everything else handed back."""

    remote = True

    def __init__(self, server: ServerConfig, control: socket.socket) -> None:
        super().__init__(server, None)
        self.health = {b"/v2/health/live": self.health[b"/v2/health/live"]}  # readiness is the daemon's
        # A large body costs more to pass on than its HTTP framing costs the daemon: such a
        # request hands its connection back, and the daemon reads the body in place.
        self.infer_bytes = min(server.max_request_bytes, LARGE_BODY_BYTES)
        self.control = control
        self.writer: channel.Writer | None = None
        self.futures: dict[int, asyncio.Future[tuple[int, bytes | memoryview, int | None]]] = {}
        self.ids = itertools.count(1)
        self.handing_back: set[_Connection] = set()
        self.gone = asyncio.get_running_loop().create_future()

    def attached(self) -> bool:
        return True

    async def answer(
        self, model_name: str, version: str | None, body: bytes | memoryview, header_length: str | None,
        unix: bool, url: bytes,
    ) -> tuple[int, bytes | memoryview, int | None]:
        writer = self.writer
        if writer is None:
            return 503, b'{"error":"the daemon is not answering this worker"}', None
        ident = next(self.ids)
        future = self.futures[ident] = asyncio.get_running_loop().create_future()
        writer.send(channel.frame(channel.REQUEST, ident, [model_name, version, header_length, unix, url.decode("latin-1")], body))
        try:
            return await future
        except asyncio.CancelledError:
            if self.futures.pop(ident, None) is not None and self.writer is not None:
                self.writer.send(channel.frame(channel.CANCEL, ident))
            raise

    def dispatch(self, kind: int, ident: int, meta: Any, body: bytes | memoryview) -> None:
        if kind != channel.ANSWER:
            return
        future = self.futures.pop(ident, None)
        if future is not None and not future.done():
            status, json_length = meta
            future.set_result((status, body, json_length))

    def lost(self) -> None:
        """The daemon closed the frame stream: it is gone; nothing here can be answered."""
        self.writer = None
        for future in self.futures.values():
            if not future.done():
                future.set_result((503, b'{"error":"the daemon went away"}', None))
        self.futures.clear()
        if not self.gone.done():
            self.gone.set_result(None)

    def hand_back(self, connection: _Connection) -> None:
        # Called from inside the parser too (a request's head is complete): the rest of the
        # bytes already read must be parsed before they are counted, so the hand-back waits
        # for the loop's next turn.
        connection.hand_back_pending = True
        if connection not in self.handing_back:
            self.handing_back.add(connection)
            asyncio.get_running_loop().call_soon(self._hand_back_now, connection)

    def _hand_back_now(self, connection: _Connection) -> None:
        self.handing_back.discard(connection)
        transport = connection.transport
        if not connection.hand_back_pending or transport is None or self.writer is None:
            return
        if transport.get_write_buffer_size():
            # An answer is still on its way out: the daemon must not write before it.
            self.handing_back.add(connection)
            asyncio.get_running_loop().call_later(0.01, self._hand_back_now, connection)
            return
        prefix = connection.unanswered()
        if prefix is None:
            # The parser calls `hand_back` again at the request's end: keep reading up to it
            # even past the backlog's bound.
            connection.paused_by_front = False
            connection.update_reading()
            return
        sock = transport.get_extra_info("socket")
        ident = next(self.ids)
        try:
            channel.send_control(self.control, channel.HANDBACK_FD + HANDBACK_ID.pack(ident), sock.fileno())
        except BlockingIOError:
            # The daemon has not read its control socket yet: try again shortly.
            self.handing_back.add(connection)
            asyncio.get_running_loop().call_later(0.01, self._hand_back_now, connection)
            return
        except OSError:
            transport.close()  # the daemon is gone
            return
        connection.hand_back_pending = False
        self.writer.send(channel.frame(channel.HANDBACK, ident, list(connection.failure) if connection.failure else None, prefix))
        transport.close()  # the daemon holds its own copy of the socket

    def closed(self, connection: _Connection) -> None:
        super().closed(connection)
        if self.writer is not None:
            self.writer.send(channel.frame(channel.CLOSED, 0))


async def _serve(settings: _Settings, control: socket.socket, frames: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    front = WorkerFront(settings.server, control)
    transport, _ = await loop.connect_accepted_socket(lambda: channel.FrameReader(front.dispatch, front.lost), frames)
    front.writer = channel.Writer(transport)
    stop = loop.create_future()
    opening: set[asyncio.Task[Any]] = set()

    def on_control() -> None:
        while True:
            message = channel.receive_control(control)
            if message is None:
                return
            data, fd = message
            if not data:  # the daemon is gone
                if not stop.done():
                    stop.set_result(False)
                loop.remove_reader(control.fileno())
                return
            if data[:1] == channel.CONNECTION and fd is not None:
                sock = socket.socket(fileno=fd)
                task = loop.create_task(loop.connect_accepted_socket(front.factory, sock))
                opening.add(task)
                task.add_done_callback(opening.discard)
            elif data[:1] == channel.STOP and not stop.done():
                stop.set_result(True)
            elif fd is not None:
                os.close(fd)

    loop.add_reader(control.fileno(), on_control)
    done, _ = await asyncio.wait([stop, front.gone], return_when=asyncio.FIRST_COMPLETED)
    if stop in done and stop.result():
        await front.drain(settings.server.shutdown_timeout)
    front.close_all()
    front.writer = None
    transport.close()
    with contextlib.suppress(ValueError, OSError):
        loop.remove_reader(control.fileno())
    control.close()


def run_worker() -> int:
    if FDS_ENV not in os.environ or CONFIG_ENV not in os.environ:
        raise EdgedError("`edged worker` is started by the daemon (server.workers), not by hand")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    settings = msgspec.json.decode(os.environ.pop(CONFIG_ENV), type=_Settings)
    control_fd, frames_fd = (int(fd) for fd in os.environ.pop(FDS_ENV).split(","))
    setup_logging(settings.logging.level, settings.logging.format)
    control = socket.socket(fileno=control_fd)
    control.setblocking(False)
    frames = socket.socket(fileno=frames_fd)
    eventloop.run(_serve(settings, control, frames), settings.server.event_loop)
    return 0
