"""The error middleware on a real socket: errors become one response, never two."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from daemon.api.errors import make_error_middleware
from daemon.errors import BackendError


@contextlib.asynccontextmanager
async def _serving(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[int]:
    """An app with only the error middleware and `handler` at `/`, on a TCP port (yielded)."""
    app = web.Application(middlewares=[make_error_middleware()])
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def _get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)  # to the end: the server closes
    writer.close()
    return data


async def test_a_failure_after_the_response_started_closes_the_connection() -> None:
    """A handler that raises after its response went out (a stream): the connection is closed
    with what was sent; the error response is not written into the stream after it."""

    async def streams(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first part")
        raise BackendError("failed late")

    async with _serving(streams) as port:
        data = await _get(port)
    assert data.startswith(b"HTTP/1.1 200 OK") and data.count(b"HTTP/1.1") == 1
    assert b"first part" in data and b"failed late" not in data


async def test_a_failure_before_the_response_is_its_error_response() -> None:
    async def fails(request: web.Request) -> web.StreamResponse:
        raise BackendError("failed early")

    async with _serving(fails) as port:
        data = await _get_keep_alive(port)
    assert data.startswith(b"HTTP/1.1 500") and data.endswith(b'{"error":"failed early"}')


async def _get_keep_alive(port: int) -> bytes:
    """One request on a connection the server keeps open: read the response by its length."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    writer.close()
    return head + body
