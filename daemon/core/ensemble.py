"""Ensembles: Triton's `ensemble_scheduling`, a DAG of models served as one model.

Each step maps ensemble tensors to a step model's inputs (`input_map`: step name -> ensemble
name) and its outputs back (`output_map`: step name -> ensemble name). Steps whose inputs are all
available run concurrently, wave by wave; every step goes through the step model's own
scheduler, so batching still happens per model. Errors name the failing step. A request for
some of the outputs runs only the steps that lead to them (Triton prunes the rest too), and a
tensor crossing between a model that batches and one that does not is reshaped as in Triton
(`fit`).

As in Triton, a request takes its step models when it starts and holds them until it ends
(on-demand ones loaded first): a swap meanwhile changes no step of it, and retires the versions
it replaced only after it.

The runner is the ensemble's scheduler: the ensemble's loaded version submits to it like any
tensor model submits to its dynamic batcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import numpy as np

from daemon.backend import InferRequest, InferResponse
from daemon.core.model import LoadedVersion
from daemon.core.stats import ModelStats
from daemon.errors import ConfigError, EdgedError, Unavailable
from daemon.model_config import EnsembleStep, ModelConfig, type_name

# (model name, version or None for the served one) -> that model's loaded version.
Resolver = Callable[[str, "str | None"], LoadedVersion]


class Releasable(Protocol):
    """A hold on a model (daemon.core.residency's Lease) that its holder lets go."""

    def release(self) -> None: ...


# Model name -> a hold on it for one request, loading it first if it is on-demand (None:
# nothing to hold); see ModelRegistry.lease_step.
Leaser = Callable[[str], Awaitable["Releasable | None"]]


class EnsembleRunner:
    def __init__(self, resolve: Resolver, lease: Leaser, name: str, config: ModelConfig, stats: ModelStats) -> None:
        self.resolve = resolve
        self.lease = lease
        self.name = name
        self.config = config
        self.stats = stats
        assert config.ensemble_scheduling is not None
        self.steps = config.ensemble_scheduling.step
        self._outputs = tuple(t.name for t in config.output)
        self._output_dims = {t.name: t.reshape if t.reshape is not None else t.dims for t in config.output}
        self._check_graph()
        self._check_tensors()
        self._check_steps()
        self._check_cycle()
        self._stopped = False
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def _check_tensors(self) -> None:
        """Refuse what Triton refuses before it looks at the step models: a tensor two steps
        produce, an ensemble input no step reads, a tensor a step produces that nothing uses."""
        producer: dict[str, int] = {}
        for index, step in enumerate(self.steps):
            for tensor in step.output_map.values():
                if tensor in producer:
                    raise ConfigError(
                        f"ensemble '{self.name}': tensor '{tensor}' is produced by step "
                        f"{producer[tensor]} and again by step {index}; a tensor has one producer"
                    )
                producer[tensor] = index
        read = {tensor for step in self.steps for tensor in step.input_map.values()}
        for spec in self.config.input:
            if spec.name not in read:
                raise ConfigError(f"ensemble '{self.name}': input '{spec.name}' is read by no step")
        for tensor, index in producer.items():
            if tensor not in read and tensor not in self._outputs:
                raise ConfigError(
                    f"ensemble '{self.name}': tensor '{tensor}' of step {index} is read by no "
                    "step and is no output of the ensemble"
                )

    def _check_steps(self) -> None:
        """Triton's checks against the step models loaded now (a step loaded later, or on
        demand, is checked by its requests): every mapped name is one of the step model's
        inputs or outputs, and every tensor has one data type. Triton's texts."""
        types = {t.name: (t.data_type, self.name) for t in (*self.config.input, *self.config.output)}
        for step in self.steps:
            version = None if step.model_version < 0 else str(step.model_version)
            try:
                config = self.resolve(step.model_name, version).config
            except EdgedError:
                continue
            inputs = {t.name: t.data_type for t in config.input}
            outputs = {t.name: t.data_type for t in config.output}
            pairs = [(inner, outer, inputs, "is mapping to non-existing input") for inner, outer in step.input_map.items()]
            pairs += [(inner, outer, outputs, "is mapped from non-existing output") for inner, outer in step.output_map.items()]
            for inner, outer, tensors, missing in pairs:
                if inner not in tensors:
                    raise ConfigError(
                        f"in ensemble {self.name}, ensemble tensor {outer} {missing} {inner} in model {step.model_name}"
                    )
                seen = types.setdefault(outer, (tensors[inner], step.model_name))
                if seen[0] != tensors[inner]:
                    raise ConfigError(
                        f"in ensemble {self.name}, ensemble tensor {outer}: inconsistent data type: "
                        f"{type_name(seen[0])} is inferred from model {seen[1]} while "
                        f"{type_name(tensors[inner])} is inferred from model {step.model_name}"
                    )

    def _check_graph(self) -> None:
        """Reject configs whose steps can never all run: every input must be produced somewhere."""
        if not self.steps:
            raise ConfigError(f"ensemble '{self.name}': ensemble_scheduling has no steps")
        available = {t.name for t in self.config.input}
        remaining = list(enumerate(self.steps))
        while remaining:
            ready = [(i, s) for i, s in remaining if set(s.input_map.values()) <= available]
            if not ready:
                i, step = remaining[0]
                missing = sorted(set(step.input_map.values()) - available)
                raise ConfigError(
                    f"ensemble '{self.name}': step {i} (model '{step.model_name}') needs "
                    f"{missing}, which no ensemble input or earlier step produces"
                )
            for _, step in ready:
                available |= set(step.output_map.values())
            remaining = [(i, s) for i, s in remaining if (i, s) not in ready]
        missing_outputs = sorted({t.name for t in self.config.output} - available)
        if missing_outputs:
            raise ConfigError(f"ensemble '{self.name}': outputs {missing_outputs} are produced by no step")

    def _check_cycle(self) -> None:
        """Refuse an ensemble that its own steps lead back to: each request would nest another
        without end (one request grew the daemon by gigabytes). Models not loaded yet are
        skipped: whichever of the two loads last sees the way back."""
        seen: set[str] = set()
        pending = [step.model_name for step in self.steps]
        while pending:
            name = pending.pop()
            if name == self.name:
                raise ConfigError(f"ensemble '{self.name}' contains a cycle: its steps lead back to '{self.name}'")
            if name in seen:
                continue
            seen.add(name)
            try:
                config = self.resolve(name, None).config
            except EdgedError:
                continue
            if config.ensemble_scheduling is not None:
                pending.extend(step.model_name for step in config.ensemble_scheduling.step)

    def _named(self, index: int, step: EnsembleStep, exc: EdgedError) -> EdgedError:
        return type(exc)(f"ensemble '{self.name}' step {index} (model '{step.model_name}'): {exc.message}")

    def _steps_for(self, wanted: tuple[str, ...]) -> list[tuple[int, EnsembleStep]]:
        """The steps a request for the outputs `wanted` runs: as Triton does, those that lead to
        them (a step none of whose outputs is wanted, directly or through later steps, is left
        out: a request for one branch's output does not run, nor wait for, the others)."""
        if len(set(wanted)) == len(self._outputs):  # all (the codec checked the names)
            return list(enumerate(self.steps))
        needed = set(wanted)
        chosen: set[int] = set()
        grew = True
        while grew:
            grew = False
            for index, step in enumerate(self.steps):
                if index not in chosen and not needed.isdisjoint(step.output_map.values()):
                    chosen.add(index)
                    needed.update(step.input_map.values())
                    grew = True
        return [(index, step) for index, step in enumerate(self.steps) if index in chosen]

    async def _hold(self, steps: list[tuple[int, EnsembleStep]], held: list[Releasable]) -> dict[int, LoadedVersion]:
        """Lease the models of `steps` into `held`, then resolve each step's version (see the
        module); errors name the first step using the model."""
        first: dict[str, tuple[int, EnsembleStep]] = {}
        for index, step in steps:
            first.setdefault(step.model_name, (index, step))
        for index, step in first.values():
            try:
                lease = await self.lease(step.model_name)
            except EdgedError as exc:
                raise self._named(index, step, exc) from exc
            if lease is not None:
                held.append(lease)
        # One step with no await from the first to the last: no swap between them.
        models: dict[int, LoadedVersion] = {}
        for index, step in steps:
            version = None if step.model_version < 0 else str(step.model_version)
            try:
                models[index] = self.resolve(step.model_name, version)
            except EdgedError as exc:
                raise self._named(index, step, exc) from exc
        return models

    async def _run_step(
        self, index: int, step: EnsembleStep, model: LoadedVersion, tensors: dict[str, np.ndarray],
        sizes: dict[str, int], parent: InferRequest,
    ) -> tuple[dict[str, np.ndarray], int]:
        """The step's outputs as ensemble tensors, and their batch size (0: not batched)."""
        batching = model.config.max_batch_size > 0
        dims = {t.name: t.dims for t in model.config.input}
        inputs = {
            inner: fit(tensors[outer], dims[inner], batching, sizes[outer]) if inner in dims else tensors[outer]
            for inner, outer in step.input_map.items()
        }
        request = InferRequest(
            inputs=inputs,
            id=parent.id,
            requested_outputs=tuple(step.output_map),
            # Request parameters, and the sequence the request belongs to, reach every step,
            # as in Triton (a sequence model can be a step).
            parameters=parent.parameters,
            priority=parent.priority,
            timeout_us=parent.timeout_us,
            correlation_id=parent.correlation_id,
            flags=parent.flags,
        )
        try:
            response = await model.infer(request)
        except EdgedError as exc:
            raise self._named(index, step, exc) from exc
        produced: dict[str, np.ndarray] = {}
        for inner, outer in step.output_map.items():
            if inner not in response.outputs:
                raise ConfigError(
                    f"ensemble '{self.name}' step {index} (model '{step.model_name}') "
                    f"did not produce output '{inner}'"
                )
            produced[outer] = response.outputs[inner]
        return produced, request.batch_size() if batching else 0

    # ------------------------------------------------------------------ the scheduler interface

    async def start(self) -> None:
        return None

    def pending(self) -> int:
        return self._running

    async def stop(self, drain_timeout: float) -> None:
        """Refuse new requests; wait (bounded) for running ones. Steps drain in their models."""
        self._stopped = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_timeout)

    async def submit(self, request: InferRequest) -> InferResponse:
        if self._stopped:
            raise Unavailable(f"ensemble '{self.name}' is being unloaded")
        self._running += 1
        self._idle.clear()
        try:
            return await self._run(request)
        finally:
            self._running -= 1
            if not self._running:
                self._idle.set()

    async def _run(self, request: InferRequest) -> InferResponse:
        started = time.monotonic_ns()
        tensors = dict(request.inputs)
        # Each tensor's batch size, 0 where it is not batched (Triton's reshape, see `fit`).
        batch = request.batch_size() if self.config.max_batch_size > 0 else 0
        sizes = dict.fromkeys(tensors, batch)
        wanted = request.requested_outputs or self._outputs
        remaining = self._steps_for(wanted)
        held: list[Releasable] = []
        models: dict[int, LoadedVersion] = {}
        try:
            models = await self._hold(remaining, held)
            for model in models.values():
                model.enter()
            while remaining:
                ready = [(i, s) for i, s in remaining if set(s.input_map.values()) <= tensors.keys()]
                results = await asyncio.gather(
                    *(self._run_step(i, s, models[i], tensors, sizes, request) for i, s in ready)
                )
                for produced, size in results:
                    tensors.update(produced)
                    sizes.update(dict.fromkeys(produced, size))
                remaining = [(i, s) for i, s in remaining if (i, s) not in ready]
        except EdgedError:
            self.stats.record_failure(time.monotonic_ns() - started)
            raise
        finally:
            for model in models.values():
                model.leave()
            for lease in held:
                lease.release()
        outputs = {
            name: fit(tensors[name], self._output_dims[name], batch != 0, sizes[name])
            for name in wanted if name in tensors
        }
        self.stats.record_success(time.monotonic_ns() - started, request.batch_size())
        return InferResponse(outputs)


def fit(array: np.ndarray, dims: Sequence[int], batching: bool, batch: int) -> np.ndarray:
    """A tensor made for a model that batches (`batch` rows, 0: it does not), given to one
    that does not, or the reverse, reshaped as Triton's ensembles do: a batch of one loses its
    batch dimension where the shape does not match `dims` as it is, and an unbatched tensor
    that matches `dims` gains one. Anything else is left to the model's own shape check."""
    if batching == (batch != 0):
        return array
    if batching:
        return array.reshape(1, *array.shape) if _matches(dims, array.shape) else array
    if batch == 1 and not _matches(dims, array.shape):
        return array.reshape(array.shape[1:])
    return array


def _matches(dims: Sequence[int], shape: tuple[int, ...]) -> bool:
    return len(dims) == len(shape) and all(d in (-1, s) for d, s in zip(dims, shape, strict=True))
