"""Reading a request body: once, bounded, and decompressed off the event loop.

aiohttp's own decompression runs zlib on the event loop, chunk by chunk, while the body
arrives; a small gzip body that inflates to hundreds of megabytes stalls every other request.
The daemon therefore runs its server with `auto_decompress=False` and every handler reads its
body here: the compressed bytes are read up to the request-size limit, then inflated on a worker
thread with the same limit on the inflated size.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from daemon.api.buffers import aligned_buffer, direct_read
from daemon.api.kserve_codec import oversized_message
from daemon.errors import InvalidArgument

# Bodies below this inflate faster than a thread hand-off costs.
_INLINE_BYTES = 64 * 1024


class BodyTooLarge(InvalidArgument):
    """The body (or what it inflates to) exceeds the request-size limit."""


def _too_large(size: int | None, limit: int, after: str = "") -> BodyTooLarge:
    if size is not None:
        return BodyTooLarge(oversized_message(size, limit))
    # A chunked or compressed body: its whole size is never known.
    return BodyTooLarge(f"request size exceeds the maximum allowed input size of {limit} bytes{after}")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, inflated when `Content-Encoding` says gzip or deflate."""
    length = request.content_length
    if length is not None and length > limit:
        raise _too_large(length, limit)
    if length == 0:
        return b""
    if length is not None:
        try:
            raw = await request.content.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise InvalidArgument(
                f"request body ended after {len(exc.partial)} of {length} bytes"
            ) from None
    else:  # chunked transfer encoding: the size is known only at the end
        parts: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise _too_large(None, limit)
            parts.append(chunk)
        raw = b"".join(parts)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in ("gzip", "deflate"):
        raise InvalidArgument(
            f"unsupported Content-Encoding {encoding!r} (use gzip, deflate or identity)"
        )
    if len(raw) <= _INLINE_BYTES:
        return inflate(raw, encoding, limit)
    return await asyncio.to_thread(inflate, raw, encoding, limit)


async def read_tensor_body(request: web.Request, limit: int, binary_offset: int | None) -> bytes | memoryview:
    """Like `read_body`, for a KServe infer body whose binary tensor data starts at `binary_offset`
    (its `Inference-Header-Content-Length`; None for a JSON-only body).

    A large uncompressed binary body with a Content-Length is copied once, chunk by chunk as
    aiohttp hands the chunks over, into one buffer placed so that `binary_offset` is aligned:
    the codec's tensors are then views of it. `readexactly` instead joins the chunks into a new
    `bytes` whose tensor data is misaligned behind the JSON header, so the codec copied the
    tensors a second time (measured: an 11 MB tensor spent ~15 ms of the loop in the two copies).
    The result is read-only, like the `bytes` of the other paths.
    """
    length = request.content_length
    if (
        not direct_read(length, binary_offset)
        or length is None  # (for the type checker: direct_read says it is not)
        or binary_offset is None
        or length > limit
        or request.headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity")
    ):
        return await read_body(request, limit)
    view = aligned_buffer(length, binary_offset)
    filled = 0
    content = request.content
    while filled < length:
        chunk, _ = await content.readchunk()
        if not chunk:  # end of stream: the client sent less than it announced
            raise InvalidArgument(f"request body ended after {filled} of {length} bytes")
        end = filled + len(chunk)
        if end > length:  # aiohttp's parser stops at Content-Length; never trust that blindly
            raise InvalidArgument(f"request body is longer than its Content-Length of {length} bytes")
        view[filled:end] = chunk
        filled = end
    return view.toreadonly()


def inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """Decompress with a cap on the output: never more than `limit` + 1 bytes are produced."""
    # wbits: 32+MAX reads a gzip or a zlib stream, whichever its header says, as Triton's zlib
    # does for either label (clients mix them up: it accepts zlib data sent as gzip and gzip
    # data sent as deflate). Deflate may also be a raw stream, as some HTTP clients send it.
    candidates = (32 + zlib.MAX_WBITS,) if encoding == "gzip" else (32 + zlib.MAX_WBITS, -zlib.MAX_WBITS)
    error: zlib.error | None = None
    for wbits in candidates:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(raw, limit + 1)
        except zlib.error as exc:
            error = exc
            continue
        if len(out) > limit or inflater.unconsumed_tail:
            raise _too_large(None, limit, f" (after {encoding} decoding)")
        if not inflater.eof:
            raise InvalidArgument(f"{encoding} body is truncated")
        return out
    raise InvalidArgument(f"body is not valid {encoding} data: {error}")
