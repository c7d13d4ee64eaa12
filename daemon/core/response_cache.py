"""Triton's response cache: a request answered before is answered again without running.

A model whose config has `response_cache { enable: true }`, on a daemon started with a cache
(`--cache-config local,size=N` as Triton's, or `[server] response-cache-size`), looks each
request up here first. One cache per daemon, shared by its models, bounded by the bytes of the
outputs it holds; the least recently used answers go first.

The key is what decides the answer: the loaded model version (a reload starts afresh, and a
version's answers leave with it), every input (name, datatype, shape, bytes), the outputs
asked for and the request's parameters. Only successful responses are kept. Triton 2.51 keys
on the inputs alone, so a request asking for other outputs gets the first request's, and it
keeps error responses as empty successes (tests/compat shows both); here they are other
entries, and errors run again.

Kept answers are read-only copies: a model that reuses its output arrays cannot change them,
and a caller cannot write into them. Hashing and copying large tensors run on a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import struct
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from daemon.backend import OFF_LOOP_BYTES, InferRequest, InferResponse

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric


@dataclass(slots=True)
class _Entry:
    owner: int
    response: InferResponse
    size: int


def _update(digest: hashlib.blake2b, data: bytes | memoryview) -> None:
    """Length-prefixed, so that no two different sequences of fields hash alike."""
    digest.update(struct.pack("<Q", len(data)))
    digest.update(data)


def _key(owner: int, request: InferRequest) -> bytes:
    digest = hashlib.blake2b(digest_size=32)
    digest.update(struct.pack("<Q", owner))
    for name in sorted(request.inputs):
        array = request.inputs[name]
        _update(digest, name.encode())
        _update(digest, f"{array.dtype.str}{array.shape}".encode())
        if array.dtype == np.object_:
            for element in array.flat:
                _update(digest, element if isinstance(element, bytes) else str(element).encode())
        else:
            # The array's own bytes (a copy only if it is not contiguous).
            _update(digest, np.ascontiguousarray(array).data.cast("B"))
    _update(digest, json.dumps([sorted(request.requested_outputs), request.parameters],
                               sort_keys=True, default=repr).encode())
    return digest.digest()


def _hashed_bytes(array: np.ndarray) -> int:
    """About how much hashing `array` reads: a BYTES element's length is not known without
    visiting it, so each counts as 256 bytes (an input of 1 024 strings goes to a thread)."""
    return array.size * 256 if array.dtype == np.object_ else array.nbytes


def _frozen(response: InferResponse) -> tuple[InferResponse, int]:
    """A read-only copy of `response`, and the bytes it holds."""
    outputs: dict[str, np.ndarray] = {}
    size = 0
    for name, array in response.outputs.items():
        copy = np.array(array, copy=True)
        copy.setflags(write=False)
        outputs[name] = copy
        size += copy.nbytes
        if copy.dtype == np.object_:
            size += sum(len(e) if isinstance(e, bytes | str) else 8 for e in copy.flat)
    return InferResponse(outputs, dict(response.parameters)), size


class ResponseCache:
    """The daemon's response cache (see the module docstring). Used on the event loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._owners = itertools.count(1)
        self.used = 0
        self.hits = self.misses = self.evictions = 0
        self.lookup_ns = self.insert_ns = 0

    def owner(self) -> int:
        """A token for one loaded model version: its entries are its own."""
        return next(self._owners)

    async def key(self, owner: int, request: InferRequest) -> bytes:
        if sum(_hashed_bytes(a) for a in request.inputs.values()) >= OFF_LOOP_BYTES:
            return await asyncio.to_thread(_key, owner, request)
        return _key(owner, request)

    def get(self, key: bytes, started_ns: int) -> InferResponse | None:
        """The kept answer (a new response object of the read-only arrays), or None.
        `started_ns`: when this lookup began (its key was being made), for the statistics."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        self.lookup_ns += time.monotonic_ns() - started_ns
        if entry is None:
            return None
        return InferResponse(dict(entry.response.outputs), dict(entry.response.parameters))

    async def put(self, owner: int, key: bytes, response: InferResponse) -> None:
        if key in self._entries:
            return  # the same request answered twice at once: kept already, no copy
        started = time.monotonic_ns()
        if sum(_hashed_bytes(a) for a in response.outputs.values()) >= OFF_LOOP_BYTES:
            frozen, size = await asyncio.to_thread(_frozen, response)
        else:
            frozen, size = _frozen(response)
        if size <= self.capacity and key not in self._entries:
            while self.used + size > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self.used -= evicted.size
                self.evictions += 1
            self._entries[key] = _Entry(owner, frozen, size)
            self.used += size
        self.insert_ns += time.monotonic_ns() - started

    def drop(self, owner: int) -> None:
        """A model version was unloaded: its answers go."""
        for key in [k for k, e in self._entries.items() if e.owner == owner]:
            self.used -= self._entries.pop(key).size

    def families(self) -> Iterator[Metric]:
        """Triton's cache gauges (its names and help texts)."""
        from prometheus_client.metrics_core import Metric

        lookups = self.hits + self.misses
        for name, doc, value in (
            ("nv_cache_util", "Cache utilization [0.0 - 1.0]", self.used / self.capacity),
            ("nv_cache_num_entries", "Number of responses stored in response cache", len(self._entries)),
            ("nv_cache_num_hits", "Number of cache hits in response cache", self.hits),
            ("nv_cache_num_misses", "Number of cache misses in response cache", self.misses),
            ("nv_cache_num_lookups", "Number of cache lookups in response cache", lookups),
            ("nv_cache_num_evictions", "Number of cache evictions in response cache", self.evictions),
            ("nv_cache_lookup_duration", "Total cache lookup duration (hit and miss), in microseconds",
             self.lookup_ns // 1000),
            ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds",
             self.insert_ns // 1000),
        ):
            family = Metric(name, doc, "gauge")
            family.add_sample(name, {}, value)
            yield family
