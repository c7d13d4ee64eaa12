"""One loaded version of one model: the object a request is resolved to, once, and run by.

The transport looks a model up once (`ModelRegistry.get`) and from then on talks only to the
`LoadedVersion` it got: it decodes against `model.config`, runs `model.infer` / `generate` /
`embed`, and labels the response with `model.name` / `model.version`. A reload that swaps in
another version meanwhile cannot mix two configs into one request: this object keeps its config,
instances and scheduler until the last request on it has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.backend import (
    Backend,
    Device,
    GenerateChunk,
    GenerateParams,
    GenerationBackend,
    InferRequest,
    InferResponse,
    InfillInput,
    SlotAction,
    SlotFile,
)
from daemon.core.plugins import takes_keyword
from daemon.core.rate_limiter import InstanceLimits
from daemon.core.response_cache import ResponseCache
from daemon.core.scheduler import Scheduler
from daemon.core.stats import FailureReason, ModelStats
from daemon.core.validate import validate_request
from daemon.errors import EdgedError, InvalidArgument
from daemon.model_config import ModelConfig, to_triton_json

log = logging.getLogger(__name__)


@dataclass
class LoadedVersion:
    """One version of one model, ready to serve."""

    name: str
    version: int
    config: ModelConfig
    backend: str
    artifact: Path
    instances: list[Backend]
    stats: ModelStats
    # Tensor models and ensembles: the scheduler every request goes through. None for
    # generation backends, whose own engine loop schedules.
    scheduler: Scheduler | None
    selection: dict[str, object] = field(default_factory=dict)
    # Where its instances run (None for an ensemble, which has none).
    device: Device | None = None
    # The rate limiter's tickets for its instances (None: not limited).
    limits: InstanceLimits | None = None
    # The daemon's response cache, when the config enables it and the daemon has one; this
    # version's entries are those of `cache_owner`.
    cache: ResponseCache | None = None
    cache_owner: int = 0
    # Requests using this version (entered, not yet left): retire() waits for them, on an
    # event it makes only then (every small request enters and leaves: two integer steps).
    _running: int = field(default=0, init=False, repr=False)
    _idle: asyncio.Event | None = field(default=None, init=False, repr=False)

    def enter(self) -> None:
        """A request uses this version from now until `leave`: a reload that swaps in another
        version retires this one only after (or after the drain timeout). A route enters the
        version it resolved before anything it awaits (a body still arriving, a decode off the
        loop), so that the request still runs on it."""
        self._running += 1

    def leave(self) -> None:
        self._running -= 1
        if not self._running and self._idle is not None:
            self._idle.set()

    # ------------------------------------------------------------------ what it is

    @property
    def generator(self) -> GenerationBackend | None:
        first = self.instances[0] if self.instances else None
        return first if isinstance(first, GenerationBackend) else None

    def require_generator(self) -> GenerationBackend:
        """The generation backend, or InvalidArgument naming the backend that is not one."""
        if self.generator is None:
            raise InvalidArgument(
                f"model '{self.name}' runs on backend '{self.backend}', which does not generate text"
            )
        return self.generator

    def metadata(self, versions: Sequence[int]) -> dict[str, object]:
        """KServe model metadata, plus which backend runs it, why, and its effective settings."""
        config = self.config

        def shape(dims: list[int]) -> list[int]:
            return [-1, *dims] if config.max_batch_size > 0 else list(dims)

        payload: dict[str, object] = {
            "name": self.name,
            "versions": [str(v) for v in versions],
            "platform": config.platform or self.backend,
            "backend": self.backend,
            "inputs": [{"name": t.name, "datatype": t.data_type, "shape": shape(t.dims)} for t in config.input],
            "outputs": [{"name": t.name, "datatype": t.data_type, "shape": shape(t.dims)} for t in config.output],
            # Ours: which backend was chosen and why the others were skipped.
            "selection": self.selection,
        }
        effective = self.instances[0].describe() if self.instances else {}
        if effective:
            payload["effective"] = effective
        if self.generator is not None:
            payload["engine"] = self.generator.engine_stats()
        return payload

    def triton_config(self) -> dict[str, Any]:
        """The config in Triton's JSON layout (`GET .../config`), backend filled in as Triton does."""
        if self.backend == "ensemble":  # no instances, so no group; no file of its own
            return to_triton_json(self.config, model_name=self.name, count=0)
        data = to_triton_json(
            self.config, model_name=self.name, count=len(self.instances), filename=self.artifact.name,
            gpu=self.device.gpu if self.device is not None else None,
        )
        if not data.get("backend"):
            data["backend"] = self.backend
        return data

    # ------------------------------------------------------------------ running requests

    async def infer(self, request: InferRequest) -> InferResponse:
        # A request that fails validation never reaches the model: Triton counts it nowhere
        # (neither /stats "fail" nor nv_inference_request_failure; tests/compat checks).
        validate_request(request, self.config)
        if self.scheduler is None:
            raise InvalidArgument(
                f"model '{self.name}' is a generation model; use /v2/models/{self.name}/generate "
                "or /v1/completions"
            )
        if self.cache is None:
            return await self.scheduler.submit(request)
        return await self._through_cache(self.cache, self.scheduler, request)

    async def _through_cache(self, cache: ResponseCache, scheduler: Scheduler, request: InferRequest) -> InferResponse:
        started = time.monotonic_ns()
        key = await cache.key(self.cache_owner, request)
        response = cache.get(key, started)
        looked = time.monotonic_ns()
        if response is not None:
            self.stats.record_cache_hit(looked - started)
            return response
        response = await scheduler.submit(request)
        inserting = time.monotonic_ns()
        await cache.put(self.cache_owner, key, response)
        self.stats.record_cache_miss(looked - started + time.monotonic_ns() - inserting)
        return response

    async def generate(
        self, prompt: str | list[int], params: GenerateParams
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Stream chunks, recording Triton-style statistics. Closing the iterator early (the
        client went away) cancels the sequence in the engine."""
        generator = self.require_generator()
        started = time.monotonic_ns()
        outcome: FailureReason | None = "CANCELED"
        self.enter()
        try:
            async with contextlib.aclosing(generator.generate(prompt, params)) as chunks:
                async for chunk in chunks:
                    yield chunk
            outcome = None
        except EdgedError:
            outcome = "OTHER"
            raise
        finally:
            self.leave()
            elapsed = time.monotonic_ns() - started
            if outcome is None:
                self.stats.record_success(elapsed)
            else:
                self.stats.record_failure(elapsed, outcome)

    async def embed(
        self, texts: Sequence[str | list[int]], *, truncate: bool = False
    ) -> tuple[list[list[float]], int]:
        generator = self.require_generator()
        started = time.monotonic_ns()
        self.enter()
        try:
            # A plugin written before `truncate` cannot truncate: its own limit answers.
            if truncate and takes_keyword(generator.embed, "truncate"):
                result = await generator.embed(texts, truncate=True)
            else:
                result = await generator.embed(texts)
        except EdgedError:
            self.stats.record_failure(time.monotonic_ns() - started)
            raise
        finally:
            self.leave()
        self.stats.record_success(time.monotonic_ns() - started, len(texts))
        return result

    async def rerank(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
        """Each document's relevance score for `query` (see GenerationBackend.rerank)."""
        generator = self.require_generator()
        started = time.monotonic_ns()
        self.enter()
        try:
            result = await generator.rerank(query, documents)
        except EdgedError:
            self.stats.record_failure(time.monotonic_ns() - started)
            raise
        finally:
            self.leave()
        self.stats.record_success(time.monotonic_ns() - started, len(documents))
        return result

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        generator = self.require_generator()
        extra: dict[str, Any] = {}
        if template_kwargs:
            if not takes_keyword(generator.chat_prompt, "template_kwargs"):
                raise InvalidArgument(
                    f"chat_template_kwargs: model '{self.name}' runs on backend '{self.backend}', "
                    "which takes no chat template variables"
                )
            extra["template_kwargs"] = template_kwargs
        if tools is not None:
            # Only asked of a backend whose tool_syntax() named one, which takes them.
            extra["tools"] = tools
        return generator.chat_prompt(messages, **extra)

    async def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """The model's token ids for `text` (see GenerationBackend.tokenize)."""
        generator = self.require_generator()
        self.enter()  # a drain before unloading waits for it
        try:
            return await generator.tokenize(text, add_special=add_special, parse_special=parse_special)
        finally:
            self.leave()

    async def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's bytes (see GenerationBackend.token_pieces)."""
        generator = self.require_generator()
        self.enter()
        try:
            return await generator.token_pieces(tokens)
        finally:
            self.leave()

    async def slot_action(self, action: SlotAction, slot: int, filename: str = "") -> SlotFile:
        """Save, restore or erase one slot's cache (see GenerationBackend.slot_action)."""
        generator = self.require_generator()
        self.enter()  # a drain before unloading waits for it: it may be writing a file
        try:
            return await generator.slot_action(action, slot, filename)
        finally:
            self.leave()

    async def infill_tokens(self, infill: InfillInput) -> list[int]:
        """llama-server's /infill prompt (see GenerationBackend.infill_tokens)."""
        generator = self.require_generator()
        self.enter()
        try:
            return await generator.infill_tokens(infill)
        finally:
            self.leave()

    def thinking_tags(self) -> tuple[str, str]:
        """The tags the model reasons between (("", "") for none; see GenerationBackend.thinking_tags)."""
        opening, closing = self.require_generator().thinking_tags()
        # Both or neither: a plugin naming one tag has none the routes can split on.
        return (opening, closing) if opening and closing else ("", "")

    def tool_syntax(self) -> str:
        """The model's own tool-call syntax ("" for none; see GenerationBackend.tool_syntax)."""
        generator = self.require_generator()
        syntax = generator.tool_syntax()
        # A plugin's override that names a syntax but cannot take `tools` has none we can use.
        return syntax if syntax and takes_keyword(generator.chat_prompt, "tools") else ""

    # ------------------------------------------------------------------ retiring

    async def retire(self, drain_timeout: float) -> None:
        """Drain, then unload every instance (after a swap or an unload).

        First the requests that entered this version finish (new ones already go to the
        version swapped in): a tensor request whose body was still arriving at the swap is
        still taken by this version's scheduler, and generations run to their end. Then the
        scheduler drains. All within `drain_timeout`, after which the scheduler fails what is
        left and the engine's stop cancels it."""
        deadline = time.monotonic() + drain_timeout
        if self._running:
            log.info("model %s version %d: waiting for %d request(s) using it before unloading",
                     self.name, self.version, self._running)
            idle = self._idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(idle.wait(), drain_timeout)
        if self.scheduler is not None:
            await self.scheduler.stop(max(0.0, deadline - time.monotonic()))
        if self.cache is not None:
            self.cache.drop(self.cache_owner)
        for instance in self.instances:
            try:
                await instance.unload()
            except Exception:  # a plugin failing to unload must not stop the others
                log.exception("model %s: backend %s failed to unload", self.name, self.backend)
        if self.limits is not None:
            self.limits.limiter.unregister(self.limits.tickets.values())
        self.stats.close()
