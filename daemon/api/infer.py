"""A Triton infer request's work between its HTTP layer and the data plane.

Shared by the two transports that serve `POST /v2/models/{m}[/versions/{v}]/infer`: the lean
front (daemon.api.front), which serves it for plain requests, and the aiohttp route
(daemon.api.kserve), which serves the rest (compressed or chunked bodies, bearer-token callers).
Each transport reads the body its own way; what happens to it from there is here, once.
"""

from __future__ import annotations

import asyncio

import numpy as np

from daemon.api.kserve_codec import Codec, DecodedInfer, SharedMemoryLookup
from daemon.api.shm import CallerShm, refusal
from daemon.api.trace import Trace, TraceManager
from daemon.backend import OFF_LOOP_BYTES
from daemon.core.model import LoadedVersion
from daemon.core.shm import Lease, SharedMemoryRegistry
from daemon.errors import Unavailable
from daemon.model_config import ModelConfig
from daemon.service import Service


class _OnTheLoop(Exception):
    """A request decoded off the loop names a shared memory region: the registry is the loop's
    (daemon.core.shm), so that request is decoded again on the loop."""


class _NoSharedMemoryHere:
    def acquire(self, name: str, offset: int, byte_size: int) -> Lease:
        raise _OnTheLoop


class InferEndpoint:
    __slots__ = ("codec", "service", "shm", "tracer")

    def __init__(self, service: Service, codec: Codec, tracer: TraceManager, shm: SharedMemoryRegistry) -> None:
        self.service = service
        self.codec = codec
        self.tracer = tracer
        self.shm = shm

    def caller_shm(self, unix: bool) -> CallerShm:
        """Shared memory as a caller may use it (`unix`: it came over the Unix socket)."""
        return CallerShm(self.shm, refusal(self.service.config.server.shared_memory, unix))

    def resolve(self, name: str, version: str | None) -> LoadedVersion:
        """The version that decodes, runs and labels this request, resolved once: a reload that
        swaps in another version while the body is still arriving does not change it."""
        if not self.service.accepting:
            raise Unavailable("server is shutting down")
        return self.service.registry.get(name, version)

    def trace(self, model: LoadedVersion) -> Trace | None:
        """Triton's trace extension: None unless this request is sampled."""
        return self.tracer.start(model.name, str(model.version), "")

    async def run(
        self,
        model: LoadedVersion,
        body: bytes | memoryview,
        header_length: int | None,
        shm: SharedMemoryLookup,
        trace: Trace | None,
    ) -> tuple[bytes, int | None]:
        """Decode, run, encode: the response body and its JSON header's length (None: the
        whole body is JSON)."""
        config = model.config
        codec = self.codec
        if len(body) >= OFF_LOOP_BYTES:
            decoded = await self._decode_off_loop(body, header_length, config, shm)
        else:
            decoded = codec.decode_infer_request(body, header_length, config=config, shm=shm)
        try:  # the request holds its shared memory regions until its outputs are written
            if trace is not None:
                trace.request_id = decoded.request.id
                trace.record("REQUEST_START")
            response = await model.infer(decoded.request)
            if trace is not None:
                trace.record("REQUEST_END")
            labels = None
            if decoded.classification:
                entry = self.service.registry.entry(model.name)
                labels = codec.labels.for_outputs(
                    entry.path if entry else None, config, list(decoded.classification)
                )
            args = (model.name, str(model.version), decoded, response, config, labels)
            # Not with shared memory: a cancelled request releases its regions at once (below),
            # which must not be unmapped under a thread still reading or writing them.
            if decoded.leases or not large_outputs(response.outputs):
                payload, json_length = codec.encode_infer_response(*args)
            else:
                payload, json_length = await asyncio.to_thread(codec.encode_infer_response, *args)
        finally:
            decoded.release()
        if trace is not None:
            trace.record("HTTP_SEND_START")
            self.tracer.finish(trace, model.name)
        return payload, json_length

    async def _decode_off_loop(
        self, body: bytes | memoryview, header_length: int | None, config: ModelConfig, shm: SharedMemoryLookup
    ) -> DecodedInfer:
        try:
            return await asyncio.to_thread(
                self.codec.decode_infer_request, body, header_length, config=config, shm=_NoSharedMemoryHere()
            )
        except _OnTheLoop:
            # It failed at its first region, holding none: decode it where regions are leased.
            return self.codec.decode_infer_request(body, header_length, config=config, shm=shm)


def large_outputs(outputs: dict[str, np.ndarray]) -> bool:
    """Whether the encoder would read OFF_LOOP_BYTES or more."""
    total = 0
    for array in outputs.values():
        total += array.nbytes
    return total >= OFF_LOOP_BYTES
