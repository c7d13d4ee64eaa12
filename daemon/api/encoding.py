"""Compressed infer responses: gzip or deflate when the request's `Accept-Encoding` asks for
one, as Triton's are. Used by the lean front, which must not import aiohttp (the daemon is
ready before it loads), and by aiohttp's infer route.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib

# Bodies below this compress faster than a thread hand-off costs.
_INLINE_BYTES = 64 * 1024


def response_encoding(accept: str | None) -> str | None:
    """"gzip" or "deflate" where `Accept-Encoding` accepts one (the higher q-value; the first
    listed on a tie), else None: the body goes out as it is. tritonclient's
    `response_compression_algorithm` sends exactly one of them; HTTP libraries send lists."""
    if not accept:
        return None
    chosen, weight = None, 0.0
    for entry in accept.split(","):
        name, _, params = entry.partition(";")
        name = name.strip().lower()
        if name not in ("gzip", "deflate"):
            continue
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0  # malformed: not acceptable
        if q > weight:
            chosen, weight = name, q
    return chosen


async def compress(payload: bytes | memoryview, encoding: str) -> bytes:
    """`payload` gzip- or zlib-wrapped ("deflate", what HTTP clients and tritonclient inflate)."""
    if len(payload) <= _INLINE_BYTES:
        return _compressed(payload, encoding)
    return await asyncio.to_thread(_compressed, payload, encoding)


def _compressed(payload: bytes | memoryview, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.compress(payload, mtime=0)
    return zlib.compress(payload)
