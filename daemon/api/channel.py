"""The wire between the daemon and its HTTP worker processes (daemon.api.workers, daemon.api.worker).

Two socket pairs per worker:

- the *frame* stream (SOCK_STREAM), read by `FrameReader`: infer requests one way, their
  answers the other, cancellations, and the bytes that go with a connection handed back;
- the *control* socket (SOCK_SEQPACKET): one message per event, carrying a connection's file
  descriptor (SCM_RIGHTS) where it hands one over. asyncio's stream transports drop ancillary
  data, so descriptors never travel on the frame stream.

A frame is `<I body length><B kind><I id><I meta length>`, then `meta` (msgpack), then `body`.
Bodies of `DIRECT_BYTES` or more are received straight into a buffer of their own, aligned for
numpy where the meta says where the tensor data starts (as the front does for a client's body).
"""

from __future__ import annotations

import array
import asyncio
import socket
import struct
from collections.abc import Callable
from typing import Any, cast

import msgspec

from daemon.api.buffers import DIRECT_BYTES, aligned_buffer

HEAD = struct.Struct("<IBII")
# Frame kinds. Worker -> daemon: REQUEST (meta: model, version, header length, unix, url;
# body: the request body), CANCEL (the client went away), HANDBACK (meta: a framing error to
# answer, or none; body: the connection's bytes read but not answered), CLOSED (a connection
# the daemon handed out has closed). Daemon -> worker: ANSWER (meta: status, JSON header
# length; body: the response body).
REQUEST, CANCEL, HANDBACK, CLOSED, ANSWER = range(1, 6)
# Control messages: a connection handed over (one descriptor attached), or stop.
CONNECTION, HANDBACK_FD, STOP = b"C", b"H", b"S"
_CONTROL_BYTES = 64
# Small frames are cut out of this buffer; it is at least a frame head and a meta.
_SCRATCH_BYTES = 256 * 1024

_pack_meta = msgspec.msgpack.Encoder().encode
unpack_meta = msgspec.msgpack.Decoder().decode


def frame(kind: int, ident: int, meta: Any = None, body: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """One frame as the pieces to write (a large body is not copied into the head)."""
    packed = _pack_meta(meta) if meta is not None else b""
    head = HEAD.pack(len(body), kind, ident, len(packed)) + packed
    if len(body) < DIRECT_BYTES:
        return [head + body]
    return [head, body]


# What a frame's reader is handed: kind, id, meta (None when empty), body (`bytes`, or a
# writable aligned buffer for a large one).
Dispatch = Callable[[int, int, Any, bytes | memoryview], None]


class FrameReader(asyncio.BufferedProtocol):
    """Reads frames with one copy at most: small ones are sliced out of a scratch buffer,
    large bodies are received into their own buffer. `align(kind, meta)` says where a large
    body's tensor data starts (to align it), or None."""

    def __init__(self, dispatch: Dispatch, lost: Callable[[], None],
                 align: Callable[[int, Any], int | None] | None = None) -> None:
        self.dispatch = dispatch
        self.lost = lost
        self.align = align
        self.transport: asyncio.Transport | None = None
        self.scratch = bytearray(_SCRATCH_BYTES)
        self.start = self.end = 0
        # A large body being received: its buffer, bytes filled, and its frame's kind/id/meta.
        self.body: memoryview | None = None
        self.filled = 0
        self.pending: tuple[int, int, Any] = (0, 0, None)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast: uvloop's transports do not subclass asyncio's (daemon.eventloop).
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.lost()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.body is not None:
            return self.body[self.filled :]
        if self.end == len(self.scratch):
            # Move the unread part to the front; a frame head and meta always fit.
            left = self.end - self.start
            self.scratch[:left] = self.scratch[self.start : self.end]
            self.start, self.end = 0, left
        return memoryview(self.scratch)[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.body is not None:
            self.filled += nbytes
            if self.filled == len(self.body):
                body, self.body = self.body, None
                kind, ident, meta = self.pending
                self.dispatch(kind, ident, meta, body)
            return
        self.end += nbytes
        self._cut()

    def _cut(self) -> None:
        scratch = self.scratch
        while self.end - self.start >= HEAD.size:
            length, kind, ident, meta_length = HEAD.unpack_from(scratch, self.start)
            meta_end = self.start + HEAD.size + meta_length
            if meta_length > _SCRATCH_BYTES // 2:
                raise ValueError(f"frame meta of {meta_length} bytes")  # never sent; a broken peer
            if meta_end > self.end:
                break
            meta = unpack_meta(scratch[self.start + HEAD.size : meta_end]) if meta_length else None
            if length >= DIRECT_BYTES:
                offset = self.align(kind, meta) if self.align is not None else None
                body = aligned_buffer(length, offset if offset is not None and 0 <= offset <= length else 0)
                have = min(self.end - meta_end, length)
                body[:have] = scratch[meta_end : meta_end + have]
                self.start = meta_end + have
                if have < length:
                    self.body, self.filled, self.pending = body, have, (kind, ident, meta)
                    break
                self.dispatch(kind, ident, meta, body)
                continue
            if meta_end + length > self.end:
                break
            body_bytes = bytes(scratch[meta_end : meta_end + length])
            self.start = meta_end + length
            self.dispatch(kind, ident, meta, body_bytes)
        if self.start == self.end:
            self.start = self.end = 0


class Writer:
    """Frames written in one system call per loop turn: at load many answers (or requests)
    complete together, and one `sendmsg` for them all costs less than one each."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.parts: list[bytes | memoryview] = []
        self.loop = asyncio.get_running_loop()

    def send(self, parts: list[bytes | memoryview]) -> None:
        if not self.parts:
            self.loop.call_soon(self.flush)
        self.parts += parts

    def flush(self) -> None:
        parts, self.parts = self.parts, []
        if parts and not self.transport.is_closing():
            self.transport.writelines(parts)


def send_control(sock: socket.socket, message: bytes, fd: int | None = None) -> None:
    """One control message, with `fd` attached (the receiver gets its own copy)."""
    if fd is None:
        sock.sendmsg([message])
    else:
        sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def receive_control(sock: socket.socket) -> tuple[bytes, int | None] | None:
    """The next control message and its descriptor: `b""` at end of stream, None when none is
    waiting (a non-blocking socket)."""
    try:
        data, ancillary, _, _ = sock.recvmsg(_CONTROL_BYTES, socket.CMSG_SPACE(array.array("i").itemsize))
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b"", None  # a reset peer is as gone as a closed one
    fd = None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            fd = fds[0] if fds else None
    return data, fd
