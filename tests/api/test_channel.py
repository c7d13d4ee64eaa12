"""The daemon <-> HTTP worker wire (daemon.api.channel) over a real socket pair: frames cut the
same whatever pieces the stream delivers them in, large bodies received into a buffer of their own
at the alignment asked for, descriptors passed on the control socket."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import numpy as np
import pytest

from daemon.api.buffers import ALIGN, DIRECT_BYTES
from daemon.api.channel import (
    ANSWER,
    REQUEST,
    FrameReader,
    Writer,
    frame,
    receive_control,
    send_control,
)


def _frames() -> list[tuple[int, int, Any, bytes]]:
    large = bytes(range(256)) * (DIRECT_BYTES // 128)
    return [
        (REQUEST, 1, ["simple", None, "17", True, "/v2/models/simple/infer"], b"x" * 17 + b"\x01" * 64),
        (ANSWER, 2, [200, None], b""),
        (REQUEST, 3, ["m", "2", "40", False, "/u"], large),  # binary data starts at 40: aligned there
        (ANSWER, 4, None, b"tail"),
        (ANSWER, 5, [404, None], large[:DIRECT_BYTES]),  # exactly the direct size, no offset
    ]


def _offset(kind: int, meta: Any) -> int | None:
    return int(meta[2]) if kind == REQUEST else None


async def _receive(pieces: list[bytes]) -> list[tuple[int, int, Any, bytes | memoryview]]:
    received: list[tuple[int, int, Any, bytes | memoryview]] = []
    lost = asyncio.Event()
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    await loop.connect_accepted_socket(
        lambda: FrameReader(lambda *f: received.append(f), lost.set, _offset), ours
    )
    for piece in pieces:
        await loop.sock_sendall(theirs, piece)
        await asyncio.sleep(0)
    theirs.close()
    await asyncio.wait_for(lost.wait(), 10)
    return received


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 30])
def test_frames_are_cut_the_same_whatever_the_pieces(piece: int) -> None:
    sent = _frames()
    stream = b"".join(bytes(part) for f in sent for part in frame(*f))
    pieces = [stream[i : i + piece] for i in range(0, len(stream), piece)]
    received = asyncio.run(_receive(pieces))
    assert [(k, i, m, bytes(b)) for k, i, m, b in received] == sent
    large = received[2][3]
    assert isinstance(large, memoryview) and not large.readonly
    assert np.frombuffer(large, dtype=np.uint8)[40:].ctypes.data % ALIGN == 0
    assert isinstance(received[0][3], bytes)  # small bodies are their own bytes


def test_a_writer_sends_one_turns_frames_together() -> None:
    async def run() -> list[tuple[int, int, Any, bytes | memoryview]]:
        received: list[tuple[int, int, Any, bytes | memoryview]] = []
        lost = asyncio.Event()
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        await loop.connect_accepted_socket(lambda: FrameReader(lambda *f: received.append(f), lost.set), b)
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, a)
        assert isinstance(transport, asyncio.Transport)
        writer = Writer(transport)
        for ident in range(100):
            writer.send(frame(ANSWER, ident, [200, ident], b"%d" % ident))
        assert writer.parts  # held until the loop's turn ends
        await asyncio.sleep(0.05)
        transport.close()
        await asyncio.wait_for(lost.wait(), 10)
        return received

    received = asyncio.run(run())
    assert [(i, m, bytes(b)) for _, i, m, b in received] == [(i, [200, i], b"%d" % i) for i in range(100)]


def test_a_descriptor_travels_on_the_control_socket(tmp_path) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.setblocking(False)
    assert receive_control(theirs) is None  # nothing waiting
    path = tmp_path / "f"
    path.write_bytes(b"passed")
    with path.open("rb") as f:
        send_control(ours, b"C", f.fileno())
    data, fd = receive_control(theirs)  # type: ignore[misc]
    assert data == b"C" and fd is not None
    with os.fdopen(fd, "rb") as passed:
        assert passed.read() == b"passed"
    ours.close()
    assert receive_control(theirs) == (b"", None)  # end of stream
    theirs.close()
