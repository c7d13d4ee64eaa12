"""Ensembles: Triton's `ensemble_scheduling`, a DAG of models served as one model.

Each step maps ensemble tensors to a step model's inputs (`input_map`: step name -> ensemble
name) and its outputs back (`output_map`: step name -> ensemble name). Steps whose inputs are all
available run concurrently, wave by wave; every step goes through the step model's own
scheduler, so batching still happens per model. Errors name the failing step. A request for
some of the outputs runs only the steps that lead to them (Triton prunes the rest too), and a
tensor crossing between a model that batches and one that does not is reshaped as in Triton
(`fit`). With a decoupled step, each of its responses runs the steps after it and may complete
one more answer (`_flow`, Triton's decoupled ensembles); otherwise every step runs once
(`_waves`).

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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import numpy as np

from daemon.backend import (
    REQUEST_FLAG_SEQUENCE_END,
    REQUEST_FLAG_SEQUENCE_START,
    ExecuteResult,
    InferRequest,
    InferResponse,
    decoupled_infer_error,
)
from daemon.core.model import LoadedVersion
from daemon.core.stats import ModelStats, PhaseTally
from daemon.errors import ConfigError, EdgedError, InvalidArgument, Unavailable
from daemon.model_config import EnsembleStep, ModelConfig, TransactionPolicy, type_name

T = TypeVar("T")

# (model name, version or None for the served one) -> that model's loaded version.
Resolver = Callable[[str, "str | None"], LoadedVersion]


class Releasable(Protocol):
    """A hold on a model (daemon.core.residency's Lease) that its holder lets go."""

    def release(self) -> None: ...


# Model name -> a hold on it for one request, loading it first if it is on-demand (None:
# nothing to hold); see ModelRegistry.lease_step.
Leaser = Callable[[str], Awaitable["Releasable | None"]]


# A model's responses to one request (daemon.core.decoupled.responses: a decoupled model's
# stream, any other model's one response or its error).
Streamer = Callable[[LoadedVersion, InferRequest], AsyncGenerator[ExecuteResult, None]]


class EnsembleRunner:
    def __init__(
        self, resolve: Resolver, lease: Leaser, streamer: Streamer, name: str, config: ModelConfig, stats: ModelStats
    ) -> None:
        self.resolve = resolve
        self.lease = lease
        self.streamer = streamer
        self.name = name
        self.config = config
        self.stats = stats
        assert config.ensemble_scheduling is not None
        self.steps = config.ensemble_scheduling.step
        self._outputs = tuple(t.name for t in config.output)
        self._output_dims = {t.name: t.reshape if t.reshape is not None else t.dims for t in config.output}
        # The steps in waves, each wave's inputs all made by the ensemble's inputs or earlier
        # waves (the order a request with every input runs them in).
        self._waves_of_steps = self._check_graph()
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
        demand, is checked by its requests), with Triton's texts: a step model batches at least
        as much as the ensemble; every mapped name is one of its inputs or outputs and every
        input it needs is mapped; each ensemble tensor has one data type and one shape (up to
        -1, and up to the batch dimension between a model that batches and one that does not).
        As Triton, an ensemble with a decoupled step is decoupled (its served config says so)."""
        batching = self.config.max_batch_size > 0
        tensors = {
            t.name: _Tensor(t.data_type, t.reshape if t.reshape is not None else t.dims, batching, self.name)
            for t in (*self.config.input, *self.config.output)
        }
        decoupled: list[bool | None] = []  # per step; None: its model is not loaded now
        for step in self.steps:
            try:
                config = self.resolve(step.model_name, _version(step)).config
            except EdgedError:
                decoupled.append(None)
                continue
            decoupled.append(config.model_transaction_policy.decoupled)
            if config.model_transaction_policy.decoupled:
                self.config.model_transaction_policy = TransactionPolicy(decoupled=True)
            if 0 < config.max_batch_size < self.config.max_batch_size:
                raise ConfigError(
                    f"ensemble {self.name} allows maximum batch size {self.config.max_batch_size}, but it "
                    f"contains model {step.model_name} which only allows maximum batch size to be "
                    f"{config.max_batch_size}"
                )
            step_batching = config.max_batch_size > 0
            inputs = {t.name: t for t in config.input}
            outputs = {t.name: t for t in config.output}
            for inner, outer in step.input_map.items():
                if inner not in inputs:
                    raise ConfigError(
                        f"in ensemble {self.name}, ensemble tensor {outer} is mapping to non-existing "
                        f"input {inner} in model {step.model_name}"
                    )
            for spec in config.input:
                if spec.name not in step.input_map and not spec.optional:
                    raise ConfigError(
                        f"in ensemble {self.name}, input {spec.name} in model {step.model_name} is not "
                        "mapped to any ensemble tensors"
                    )
            for inner, outer in step.output_map.items():
                if inner not in outputs:
                    raise ConfigError(
                        f"in ensemble {self.name}, ensemble tensor {outer} is mapped from non-existing "
                        f"output {inner} in model {step.model_name}"
                    )
            for specs, mapping in ((inputs, step.input_map), (outputs, step.output_map)):
                for inner, outer in mapping.items():
                    spec = specs[inner]
                    here = _Tensor(spec.data_type, spec.dims, step_batching, step.model_name)
                    seen = tensors.setdefault(outer, here)
                    seen.check(here, f"in ensemble {self.name}, ensemble tensor {outer}: ")
        if None not in decoupled:
            self._check_origins([bool(d) for d in decoupled], tensors)

    def _check_origins(self, decoupled: list[bool], tensors: dict[str, _Tensor]) -> None:
        """Triton refuses a step whose inputs come from different decoupled steps (or from one
        and the ensemble's inputs): their responses could not be paired. Each tensor is labelled
        with the decoupled step it comes from (0: the request), wave after wave."""
        labels = dict.fromkeys((t.name for t in self.config.input), 0)
        for wave in self._waves_of_steps:
            for index, step in wave:
                origins = {labels[t] for t in step.input_map.values()}
                if len(origins) > 1:  # named as Triton names it: the model its output came from first
                    first = tensors[next(iter(step.output_map.values()))].model if step.output_map else self.name
                    raise ConfigError(
                        f"in ensemble {self.name}, step of model '{first}' receives inputs originated "
                        "from different decoupled models"
                    )
                label = index + 1 if decoupled[index] else next(iter(origins), 0)
                labels.update(dict.fromkeys(step.output_map.values(), label))

    def _check_graph(self) -> list[list[tuple[int, EnsembleStep]]]:
        """Reject configs whose steps can never all run: every input must be produced somewhere.
        Returns the steps in waves (see `_waves_of_steps`)."""
        if not self.steps:
            raise ConfigError(f"ensemble '{self.name}': ensemble_scheduling has no steps")
        available = {t.name for t in self.config.input}
        remaining = list(enumerate(self.steps))
        waves: list[list[tuple[int, EnsembleStep]]] = []
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
            waves.append(ready)
            remaining = [(i, s) for i, s in remaining if (i, s) not in ready]
        missing_outputs = sorted({t.name for t in self.config.output} - available)
        if missing_outputs:
            raise ConfigError(f"ensemble '{self.name}': outputs {missing_outputs} are produced by no step")
        return waves

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
        if len(set(wanted)) == len(self._outputs):  # all (validate_request checked the names)
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
            try:
                models[index] = self.resolve(step.model_name, _version(step))
            except EdgedError as exc:
                raise self._named(index, step, exc) from exc
        return models

    def _step_request(
        self, step: EnsembleStep, model: LoadedVersion, tensors: dict[str, np.ndarray], sizes: dict[str, int],
        parent: InferRequest,
    ) -> InferRequest:
        batching = model.config.max_batch_size > 0
        dims = {t.name: t.dims for t in model.config.input}
        inputs = {
            inner: fit(tensors[outer], dims[inner], batching, sizes[outer]) if inner in dims else tensors[outer]
            for inner, outer in step.input_map.items()
        }
        return InferRequest(
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
            tally=parent.tally,
        )

    async def _run_step(
        self, index: int, step: EnsembleStep, model: LoadedVersion, tensors: dict[str, np.ndarray],
        sizes: dict[str, int], parent: InferRequest,
    ) -> tuple[dict[str, np.ndarray], int]:
        """The step's outputs as ensemble tensors, and their batch size (0: not batched)."""
        request = self._step_request(step, model, tensors, sizes, parent)
        try:
            response = await model.infer(request)
        except EdgedError as exc:
            raise self._named(index, step, exc) from exc
        self._check_outputs(index, step, response)
        produced = {outer: response.outputs[inner] for inner, outer in step.output_map.items()}
        return produced, _rows(model.config, request)

    def _check_outputs(self, index: int, step: EnsembleStep, response: InferResponse) -> None:
        """A step that is not decoupled answers every output it maps."""
        for inner in step.output_map:
            if inner not in response.outputs:
                raise ConfigError(
                    f"ensemble '{self.name}' step {index} (model '{step.model_name}') "
                    f"did not produce output '{inner}'"
                )

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
        """The request's one response (`/infer`). With a decoupled step the ensemble may answer
        any number of times: one answer is served, as for a decoupled model, any other count
        is Triton's refusal (use the generate extension's stream)."""
        async with self._running_request(request) as (own, wanted, steps, models):
            if not self._decoupled(models):
                return await self._waves(own, wanted, steps, models)
            async with contextlib.aclosing(self._flow(own, wanted, steps, models)) as flow:
                answers = [response async for response in flow]
            if len(answers) != 1:
                raise decoupled_infer_error(self.name, len(answers))
            return answers[0]

    async def stream(self, request: InferRequest) -> AsyncGenerator[InferResponse, None]:
        """Every response of `request`: one, or with decoupled steps one per set of requested
        outputs that their responses complete (Triton's decoupled ensembles)."""
        async with self._running_request(request) as (own, wanted, steps, models):
            if not self._decoupled(models):
                yield await self._waves(own, wanted, steps, models)
            else:
                async with contextlib.aclosing(self._flow(own, wanted, steps, models)) as flow:
                    async for response in flow:
                        yield response

    def _record_success(self, started: int, request: InferRequest, own: InferRequest) -> None:
        """As Triton counts an ensemble's success: one execution of the request's batch size
        (1 where the ensemble does not batch), whose compute phases are the sums of its step
        requests' (`own.tally`), added to the tally of the ensemble's own caller if it is a step."""
        assert own.tally is not None
        phases = own.tally
        rows = _rows(self.config, request) or 1
        self.stats.record_success(
            time.monotonic_ns() - started, rows, queue_ns=0, compute_input_ns=phases.input_ns,
            compute_infer_ns=phases.infer_ns, compute_output_ns=phases.output_ns, tally=request.tally,
        )
        self.stats.record_execution(rows, phases.infer_ns, phases.input_ns, phases.output_ns)

    def _begin(self) -> None:
        if self._stopped:
            raise Unavailable(f"ensemble '{self.name}' is being unloaded")
        self._running += 1
        self._idle.clear()

    def _end(self) -> None:
        self._running -= 1
        if not self._running:
            self._idle.set()

    @contextlib.asynccontextmanager
    async def _running_request(
        self, request: InferRequest
    ) -> AsyncIterator[tuple[InferRequest, tuple[str, ...], list[tuple[int, EnsembleStep]], dict[int, LoadedVersion]]]:
        """One request's run, `submit`'s and `stream`'s alike: `request` with a tally of its own
        (see `_tallied`), the outputs asked for, the steps leading to them, and their models,
        held (leased and entered) until the block ends; then the request counted in the
        ensemble's statistics, as a failure if the block raised an EdgedError, as a success
        (`_record_success`) if it ended without an error."""
        self._begin()
        started = time.monotonic_ns()
        own = _tallied(request)
        held: list[Releasable] = []
        models: dict[int, LoadedVersion] = {}
        try:
            try:
                wanted = own.requested_outputs or self._outputs
                steps = self._steps_for(wanted)
                models = await self._hold(steps, held)
                for model in models.values():
                    model.enter()
                yield own, wanted, steps, models
            finally:
                for model in models.values():
                    model.leave()
                for lease in held:
                    lease.release()
        except EdgedError:
            self.stats.record_failure(time.monotonic_ns() - started)
            raise
        finally:
            self._end()
        self._record_success(started, request, own)

    def _decoupled(self, models: dict[int, LoadedVersion]) -> bool:
        return self.config.model_transaction_policy.decoupled or any(
            model.config.model_transaction_policy.decoupled for model in models.values()
        )

    async def _waves(
        self, request: InferRequest, wanted: tuple[str, ...], steps: list[tuple[int, EnsembleStep]],
        models: dict[int, LoadedVersion],
    ) -> InferResponse:
        """Each step once, all steps whose inputs are there at once (no step is decoupled)."""
        tensors = dict(request.inputs)
        # Each tensor's batch size, 0 where it is not batched (Triton's reshape, see `fit`).
        batch = _rows(self.config, request)
        sizes = dict.fromkeys(tensors, batch)
        remaining = steps
        while remaining:
            ready = [(i, s) for i, s in remaining if set(s.input_map.values()) <= tensors.keys()]
            if not ready:  # an optional input the request left out: Triton's words
                raise InvalidArgument(
                    f"in ensemble '{self.name}', unexpected deadlock, at least one output is not set "
                    "while no more ensemble steps can be made"
                )
            if len(ready) == 1:  # a chain: no task of its own
                (i, s), = ready
                results = [await self._run_step(i, s, models[i], tensors, sizes, request)]
            else:
                results = await self._together(
                    [self._run_step(i, s, models[i], tensors, sizes, request) for i, s in ready]
                )
            for produced, size in results:
                tensors.update(produced)
                sizes.update(dict.fromkeys(produced, size))
            remaining = [(i, s) for i, s in remaining if (i, s) not in ready]
        return InferResponse({
            name: fit(tensors[name], self._output_dims[name], batch != 0, sizes[name])
            for name in wanted if name in tensors
        }, _sequence_of(request))

    @staticmethod
    async def _together(runs: list[Coroutine[Any, Any, T]]) -> list[T]:
        """Each run's result, all run at once; if one fails (or the request is cancelled) the
        others are cancelled and waited for: none runs on once the request lets its models go."""
        tasks = [asyncio.create_task(run) for run in runs]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            await _cancel(tasks)
            raise

    async def _flow(
        self, request: InferRequest, wanted: tuple[str, ...], steps: list[tuple[int, EnsembleStep]],
        models: dict[int, LoadedVersion],
    ) -> AsyncGenerator[InferResponse, None]:
        """Triton's decoupled ensemble: every response of a step adds the next *iteration* of
        its output tensors (0, 1, ...); a step runs once for each iteration that all its inputs
        have (an ensemble input has iteration 0 only), and each iteration that all requested
        outputs have is one response, as soon as it is complete. As in Triton, a tensor's
        iteration is let go once every step that reads it has it and, if it is requested, its
        response went out: a long stream does not hold all its tensors to the end."""
        batch = _rows(self.config, request)
        tensors: dict[str, list[np.ndarray | None]] = {name: [array] for name, array in request.inputs.items()}
        sizes = {name: [batch] for name in request.inputs}
        consumers: dict[str, list[tuple[int, EnsembleStep]]] = {}
        for index, step in steps:
            for tensor in step.input_map.values():
                consumers.setdefault(tensor, []).append((index, step))
        # Users still to come of each (tensor, iteration) there: its readers, and its response.
        users: dict[tuple[str, int], int] = {}
        fired: set[tuple[int, int]] = set()
        sent: set[int] = set()
        # (step index, step, a response | None once the step's run is done | its error, the
        # batch size of its outputs), in the order each step's run produced them.
        events: asyncio.Queue[tuple[int, EnsembleStep, InferResponse | Exception | None, int]] = asyncio.Queue()
        tasks: list[asyncio.Task[None]] = []

        def added(tensor: str, iteration: int) -> None:
            users[tensor, iteration] = len(consumers.get(tensor, ())) + (tensor in wanted)
            used(tensor, iteration, 0)

        def used(tensor: str, iteration: int, count: int = 1) -> None:
            left = users[tensor, iteration] - count
            users[tensor, iteration] = left
            if left == 0:
                tensors[tensor][iteration] = _RELEASED

        async def feed(
            index: int, step: EnsembleStep, step_tensors: dict[str, np.ndarray], step_sizes: dict[str, int]
        ) -> None:
            model = models[index]
            decoupled = model.config.model_transaction_policy.decoupled
            try:
                step_request = self._step_request(step, model, step_tensors, step_sizes, request)
                size = _rows(model.config, step_request)
                async with contextlib.aclosing(self.streamer(model, step_request)) as results:
                    async for result in results:
                        if isinstance(result, EdgedError):  # fails the ensemble, as in Triton
                            raise result
                        if not decoupled:
                            self._check_outputs(index, step, result)
                        await events.put((index, step, result, size))
            except EdgedError as exc:
                await events.put((index, step, self._named(index, step, exc), 0))
            except Exception as exc:  # a fault of ours: ends the request, raised below
                await events.put((index, step, exc, 0))
            else:
                await events.put((index, step, None, 0))

        def fire(updated: list[tuple[str, int]]) -> None:
            for tensor, iteration in updated:
                for index, step in consumers.get(tensor, ()):
                    if (index, iteration) not in fired and all(
                        _at(tensors, t, iteration) is not None for t in step.input_map.values()
                    ):
                        fired.add((index, iteration))
                        names = set(step.input_map.values())
                        # Taken now: the step has them, and the iterations may go (`used`).
                        step_tensors: dict[str, np.ndarray] = {t: tensors[t][iteration] for t in names}  # type: ignore[misc]
                        step_sizes = {t: sizes[t][iteration] for t in names}
                        for t in names:
                            used(t, iteration)
                        tasks.append(asyncio.create_task(feed(index, step, step_tensors, step_sizes)))

        for name in tensors:
            added(name, 0)
        fire([(name, 0) for name in tensors])
        running = len(tasks)
        try:
            while running:
                index, step, item, size = await events.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                # Every output of the step moves to its next iteration together; one a decoupled
                # response does not carry is None there (Triton's empty placeholder).
                updated: list[tuple[str, int]] = []
                for inner, outer in step.output_map.items():
                    tensors.setdefault(outer, []).append(item.outputs.get(inner))
                    sizes.setdefault(outer, []).append(size)
                    updated.append((outer, len(tensors[outer]) - 1))
                    if tensors[outer][-1] is not None:
                        added(outer, len(tensors[outer]) - 1)
                before = len(tasks)
                fire(updated)
                running += len(tasks) - before
                for outer, iteration in updated:
                    if outer in wanted and iteration not in sent and all(
                        _at(tensors, name, iteration) is not None for name in wanted
                    ):
                        sent.add(iteration)
                        response = InferResponse({
                            name: fit(tensors[name][iteration], self._output_dims[name], batch != 0,  # type: ignore[arg-type]
                                      sizes[name][iteration])
                            for name in wanted
                        }, _sequence_of(request))
                        for name in wanted:
                            used(name, iteration)
                        yield response
        finally:
            await _cancel(tasks)


@dataclass(frozen=True, slots=True)
class _Tensor:
    """An ensemble tensor as a model's config has it (Triton's check of an ensemble at load)."""

    data_type: str
    dims: list[int]
    batching: bool
    model: str  # the model it is seen in

    @property
    def full(self) -> list[int]:
        return [-1, *self.dims] if self.batching else list(self.dims)

    def check(self, other: _Tensor, context: str) -> None:
        if self.data_type != other.data_type:
            raise ConfigError(
                f"{context}inconsistent data type: {type_name(self.data_type)} is inferred from model "
                f"{self.model} while {type_name(other.data_type)} is inferred from model {other.model}"
            )
        if not _matches(self.dims, tuple(other.dims)) and not _matches(self.full, tuple(other.full)):
            raise ConfigError(
                f"{context}inconsistent shape: {_dims(self.full)} is inferred from model {self.model} "
                f"while {_dims(other.full)} is inferred from model {other.model}"
            )


def _dims(dims: list[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel the request's step runs still going and wait for them to end."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _rows(config: ModelConfig, request: InferRequest) -> int:
    """The request's batch size for `fit`: 0 where the model does not batch."""
    return request.batch_size() if config.max_batch_size > 0 else 0


def _tallied(request: InferRequest) -> InferRequest:
    """`request` with a tally of its own, which its step requests carry (their compute phases
    add up there; the caller's tally stays on `request`)."""
    return replace(request, tally=PhaseTally())


def _version(step: EnsembleStep) -> str | None:
    """The version a step names (None: the one served)."""
    return None if step.model_version < 0 else str(step.model_version)


# A tensor's iteration once every user has it (`EnsembleRunner._flow`): there (not None, which
# is a placeholder for a missing output), holding nothing.
_RELEASED = np.empty(0)
_RELEASED.flags.writeable = False


def _at(tensors: dict[str, list[np.ndarray | None]], name: str, iteration: int) -> np.ndarray | None:
    """Tensor `name` at `iteration` (None: not there, or a placeholder)."""
    values = tensors.get(name, ())
    return values[iteration] if iteration < len(values) else None


def _sequence_of(request: InferRequest) -> dict[str, Any]:
    """The response parameters Triton gives every ensemble answer: the request's sequence."""
    return {
        "sequence_id": request.correlation_id,
        "sequence_start": bool(request.flags & REQUEST_FLAG_SEQUENCE_START),
        "sequence_end": bool(request.flags & REQUEST_FLAG_SEQUENCE_END),
    }


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
    """Triton's CompareDimsWithWildcard: the same rank, each dimension equal or -1 on a side."""
    return len(dims) == len(shape) and all(-1 in (d, s) or d == s for d, s in zip(dims, shape, strict=True))
