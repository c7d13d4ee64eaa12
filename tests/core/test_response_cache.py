"""The response cache's keys, budget and copies (daemon/core/response_cache.py); served
through a daemon in tests/api/test_response_cache.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from daemon.backend import InferRequest, InferResponse
from daemon.core.response_cache import ResponseCache


def _request(x: object, dtype: object = np.float32, **changes: object) -> InferRequest:
    return InferRequest(inputs={"IN": np.asarray(x, dtype=dtype)}, **changes)  # type: ignore[arg-type]


def _response(nbytes: int) -> InferResponse:
    return InferResponse({"OUT": np.zeros(nbytes, np.uint8)})


async def test_the_key_is_everything_that_decides_the_answer() -> None:
    cache = ResponseCache(1 << 20)
    first = await cache.key(1, _request([1, 2]))
    assert await cache.key(1, _request([1, 2])) == first
    others = [
        await cache.key(2, _request([1, 2])),  # another loaded model version
        await cache.key(1, _request([1, 3])),
        await cache.key(1, _request([1, 2], np.int32)),  # same values, other datatype
        await cache.key(1, _request([[1, 2]])),  # other shape
        await cache.key(1, InferRequest(inputs={"OTHER": np.asarray([1, 2], np.float32)})),
        await cache.key(1, _request([1, 2], requested_outputs=("OUT",))),
        await cache.key(1, _request([1, 2], parameters={"factor": 3})),
        await cache.key(1, _request(np.array([b"a", b"bc"], dtype=object), dtype=object)),
        await cache.key(1, _request(np.array([b"ab", b"c"], dtype=object), dtype=object)),
    ]
    assert len({first, *others}) == len(others) + 1
    # Large inputs are hashed off the loop, to the same key.
    big = np.arange(1 << 17, dtype=np.float32)
    assert await cache.key(1, _request(big)) == await cache.key(1, _request(big.copy()))
    strings = np.array([b"x"] * 2000, dtype=object)  # many strings: off the loop too
    assert await cache.key(1, _request(strings, dtype=object)) == await cache.key(1, _request(strings.copy(), dtype=object))
    assert await cache.key(1, _request(strings, dtype=object)) != await cache.key(1, _request(strings[:-1], dtype=object))


async def test_least_recently_used_answers_go_first_and_oversized_ones_are_not_kept() -> None:
    cache = ResponseCache(300)
    keys = [bytes([i]) for i in range(4)]
    for key in keys[:3]:
        await cache.put(1, key, _response(100))
    assert cache.get(keys[0], time.monotonic_ns()) is not None  # now the most recent
    await cache.put(1, keys[3], _response(100))
    assert cache.get(keys[1], time.monotonic_ns()) is None and cache.evictions == 1
    assert all(cache.get(k, time.monotonic_ns()) is not None for k in (keys[0], keys[2], keys[3]))
    await cache.put(1, b"huge", _response(301))
    assert cache.get(b"huge", time.monotonic_ns()) is None and cache.used == 300
    cache.drop(1)
    assert cache.used == 0 and cache.get(keys[0], time.monotonic_ns()) is None


async def test_kept_answers_are_read_only_copies() -> None:
    cache = ResponseCache(1 << 20)
    out = np.array([1.0, 2.0], np.float32)
    await cache.put(1, b"k", InferResponse({"OUT": out}, {"p": 1}))
    out[0] = 9  # a model reusing its output array
    hit = cache.get(b"k", time.monotonic_ns())
    assert hit is not None and hit.outputs["OUT"].tolist() == [1.0, 2.0] and hit.parameters == {"p": 1}
    with pytest.raises(ValueError, match="read-only"):
        hit.outputs["OUT"][0] = 5
    hit.outputs.pop("OUT")  # each hit is a response object of its own
    again = cache.get(b"k", time.monotonic_ns())
    assert again is not None and "OUT" in again.outputs
