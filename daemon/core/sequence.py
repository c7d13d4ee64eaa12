"""Triton's sequence batcher: stateful models fed by streams of related requests.

A request names its sequence with the request parameters `sequence_id` (uint64 or string),
`sequence_start` and `sequence_end`. A sequence is bound to one *slot* of one model instance
from its START to its END (or until it has been idle for `max_sequence_idle_microseconds`);
when every slot is taken, new sequences wait in a backlog until one frees. Each instance runs
its own batches, one at a time, so the requests of a sequence execute in order.

Strategies, as in Triton:

- **direct** (the default): an instance has `max_batch_size` slots and a sequence keeps its
  row in the batch for its whole life. A batch covers slots 0..highest-ready; a slot with no
  request ready gets a padding row (a copy of another request's inputs with READY false), so a
  model that keeps per-row state sees each sequence in the same row every time.
- **oldest**: an instance has `max_candidate_sequences` slots; a batch takes the oldest ready
  request of up to `max_batch_size` sequences (one per sequence), no padding, sent at a preferred
  size, when full, or when its oldest request has waited `max_queue_delay_microseconds`.

The scheduler tells the model about sequences through *control inputs* it adds to every request
(START, END, READY, CORRID with the values the config names) and keeps *implicit state*: each
`state { input_name output_name }` input is fed the sequence's previous `output_name` (or the
initial state at START), and the output is taken out of the response. Both are ordinary tensors
to a backend: the loader hands backends `runtime_config(config)`, where they are declared as
inputs and outputs, so every tensor backend works unchanged.

With `iterative_sequence` (Triton's iterative sequences), a request without a sequence ID gets
one of its own (a counter per model, from 1) with START, and is its own sequence: the model may
release it to run again in a later batch (request rescheduling: the backend's RESCHEDULED, the
request queued again with neither START nor END), and the sequence ends when the model releases
it for good, whatever its flags said.

A decoupled model's streamed requests (`submit_stream`) run here too, through the backend's
`execute_step`: their responses go to a sink per request as the model sends them.

Errors carry Triton's texts and codes (core/src/sequence_batch_scheduler, model_config_utils).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import enum
import heapq
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np

from daemon.backend import (
    NUMPY_DTYPES,
    REQUEST_FLAG_SEQUENCE_END,
    REQUEST_FLAG_SEQUENCE_START,
    Backend,
    ExecuteResult,
    InferRequest,
    InferResponse,
    Rescheduled,
    ResponseQueue,
    StepResult,
    decoupled_infer_error,
)
from daemon.core.rate_limiter import InstanceLimits, Ticket
from daemon.core.stats import ComputePhases, FailureReason, ModelStats, compute_phases
from daemon.errors import BackendError, ConfigError, EdgedError, InvalidArgument, Unavailable
from daemon.model_config import (
    MAX_SEQUENCE_SLOTS,
    ModelConfig,
    SequenceBatching,
    TensorConfig,
    check_preferred_sizes,
)

log = logging.getLogger(__name__)

# Triton's SEQUENCE_IDLE_DEFAULT_MICROSECONDS.
DEFAULT_IDLE_US = 1_000_000
# Request parameters the sequence batcher consumes (Triton's HTTP layer turns them into the
# request's correlation ID and flags; a backend never sees them as parameters).
SEQUENCE_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end"})
_CORRID_TYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")
_INT_RANGES = {
    "UINT64": (0, 2**64 - 1),
    "INT64": (-(2**63), 2**63 - 1),
    "UINT32": (0, 2**32 - 1),
    "INT32": (-(2**31), 2**31 - 1),
}

SequenceId = int | str


# ---------------------------------------------------------------------------- the config


@dataclass(frozen=True, slots=True)
class BoolControl:
    """START, END or READY: one tensor, and the arrays it holds when false and when true."""

    name: str
    datatype: str
    false: np.ndarray
    true: np.ndarray

    def value(self, flag: bool) -> np.ndarray:
        return self.true if flag else self.false


@dataclass(frozen=True, slots=True)
class StateSpec:
    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    # With the batch dimension when the model batches.
    initial: np.ndarray


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """`sequence_batching` checked and turned into the tensors the scheduler adds."""

    model: str
    batched: bool
    start: BoolControl | None
    end: BoolControl | None
    ready: BoolControl | None
    corrid_name: str
    corrid_datatype: str
    states: tuple[StateSpec, ...]
    idle_ns: int
    strategy: Literal["direct", "oldest"]

    @classmethod
    def from_config(cls, config: ModelConfig) -> SequenceSpec:
        sb = config.sequence_batching
        if sb is None:
            raise ConfigError(f"model '{config.name}' has no sequence_batching")
        model = config.name
        batched = config.max_batch_size > 0
        _check_control_names(sb, model)
        start = _bool_control(sb, model, "CONTROL_SEQUENCE_START", batched)
        end = _bool_control(sb, model, "CONTROL_SEQUENCE_END", batched)
        ready = _bool_control(sb, model, "CONTROL_SEQUENCE_READY", batched)
        corrid_name, corrid_type = _corrid_control(sb, model)
        if sb.oldest is not None:
            check_preferred_sizes(sb.oldest.preferred_batch_size, config, "sequence batching preferred batch size")
        if sb.direct is not None and not 0.0 <= sb.direct.minimum_slot_utilization <= 1.0:
            raise ConfigError(
                f"sequence batching minimum slot utilization must be in range (0.0, 1.0] for {model}"
            )
        states = tuple(_state_spec(state, batched) for state in sb.state)
        names = [s.input_name for s in states] + [s.output_name for s in states]
        controls = [c.name for c in (start, end, ready) if c is not None] + [corrid_name]
        clash = sorted({n for n in names if n and names.count(n) > 1} | set(names) & set(controls))
        if clash:
            raise ConfigError(f"sequence batching of {model}: tensor name(s) {clash} used twice")
        idle_us = sb.max_sequence_idle_microseconds or DEFAULT_IDLE_US
        return cls(
            model=model,
            batched=batched,
            start=start,
            end=end,
            ready=ready,
            corrid_name=corrid_name,
            corrid_datatype=corrid_type,
            states=states,
            idle_ns=idle_us * 1000,
            strategy="oldest" if sb.oldest is not None else "direct",
        )

    def input_tensors(self) -> list[TensorConfig]:
        """Control and state inputs, as a backend sees them (dims without the batch dim)."""
        tensors = [
            TensorConfig(name=c.name, data_type=c.datatype, dims=[1])
            for c in (self.start, self.end, self.ready)
            if c is not None
        ]
        if self.corrid_name:
            tensors.append(TensorConfig(name=self.corrid_name, data_type=self.corrid_datatype, dims=[1]))
        tensors += [TensorConfig(name=s.input_name, data_type=s.datatype, dims=list(s.dims)) for s in self.states]
        return tensors

    def output_tensors(self) -> list[TensorConfig]:
        return [TensorConfig(name=s.output_name, data_type=s.datatype, dims=list(s.dims)) for s in self.states]

    def corrid_array(self, corrid: SequenceId) -> np.ndarray:
        """The CORRID control tensor for `corrid` (0 / "" for a padding row)."""
        shape = (1, 1) if self.batched else (1,)
        if self.corrid_datatype == "BYTES":
            array = np.empty(shape, dtype=np.object_)
            array.flat[0] = str(corrid).encode() if corrid != 0 else b""
            return array
        if isinstance(corrid, str):
            raise InvalidArgument(
                f"model '{self.model}' takes the correlation ID as {self.corrid_datatype} "
                f"(CONTROL_SEQUENCE_CORRID '{self.corrid_name}'); sequence_id {corrid!r} is a string"
            )
        low, high = _INT_RANGES[self.corrid_datatype]
        if not low <= corrid <= high:
            raise InvalidArgument(
                f"sequence_id {corrid} does not fit the {self.corrid_datatype} correlation ID "
                f"control '{self.corrid_name}' of model '{self.model}'"
            )
        return np.full(shape, corrid, dtype=NUMPY_DTYPES[self.corrid_datatype])


def _check_control_names(sb: SequenceBatching, model: str) -> None:
    seen: set[str] = set()
    for control_input in sb.control_input:
        if not control_input.name:
            raise ConfigError(f"sequence batching control tensor must have a name for {model}")
        if control_input.name in seen:
            raise ConfigError(
                f"sequence batching control tensor '{control_input.name}' is specified for "
                f"multiple control kinds for {model}"
            )
        seen.add(control_input.name)


def _find_control(sb: SequenceBatching, model: str, kind: str) -> tuple[str, Any] | None:
    found: tuple[str, Any] | None = None
    for control_input in sb.control_input:
        for control in control_input.control:
            if control.kind != kind:
                continue
            if found is not None:
                raise ConfigError(f"sequence batching specifies multiple {kind} tensors for {model}")
            found = (control_input.name, control)
    return found


def _bool_control(sb: SequenceBatching, model: str, kind: str, batched: bool) -> BoolControl | None:
    found = _find_control(sb, model, kind)
    if found is None:
        return None
    name, control = found
    lists = [
        ("int32_false_true", "INT32", control.int32_false_true),
        ("fp32_false_true", "FP32", control.fp32_false_true),
        ("bool_false_true", "BOOL", control.bool_false_true),
    ]
    given = [entry for entry in lists if entry[2]]
    if not given:
        raise ConfigError(
            "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or "
            f"'bool_false_true' for {kind} for {model}"
        )
    if len(given) > 1:
        raise ConfigError(
            "sequence batching specifies more than one from 'int32_false_true', "
            f"'fp32_false_true' and 'bool_false_true' for {kind} for {model}"
        )
    field_name, datatype, values = given[0]
    if len(values) != 2:
        raise ConfigError(
            f"sequence batching control '{field_name}' must have exactly 2 entries for {kind} for {model}"
        )
    shape = (1, 1) if batched else (1,)
    dtype = NUMPY_DTYPES[datatype]
    false, true = (np.full(shape, v, dtype=dtype) for v in values)
    # Shared by every request: nobody may write into them.
    false.flags.writeable = true.flags.writeable = False
    return BoolControl(name, datatype, false, true)


def _corrid_control(sb: SequenceBatching, model: str) -> tuple[str, str]:
    kind = "CONTROL_SEQUENCE_CORRID"
    found = _find_control(sb, model, kind)
    if found is None:
        return "", ""
    name, control = found
    if control.int32_false_true or control.fp32_false_true or control.bool_false_true:
        raise ConfigError(
            "sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or "
            f"'bool_false_true' for {kind} for {model}"
        )
    if control.data_type not in _CORRID_TYPES:
        raise ConfigError(
            f"unexpected data type for control {kind} for {model}. Allowed data types are "
            "TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"
        )
    return name, control.data_type


def _state_spec(state: Any, batched: bool) -> StateSpec:
    if len(state.initial_state) > 1:
        raise ConfigError(
            f"initial_state field for state input '{state.input_name}' must contain exactly one or "
            f"zero element. Found '{len(state.initial_state)}' elements."
        )
    dims = tuple(state.dims)
    if state.data_type == "BYTES":
        # A BYTES state has no fixed size to zero-fill; not supported rather than guessed at.
        raise ConfigError(
            f"state '{state.input_name}': TYPE_STRING implicit state is not supported by edged"
        )
    shape = tuple(1 if d == -1 else d for d in dims)
    if state.initial_state:
        initial = state.initial_state[0]
        if initial.data_type != state.data_type:
            raise ConfigError(
                f"The data type used for 'initial_state' field of state '{state.input_name}' does "
                "not match the state data type."
            )
        if not initial.name:
            raise ConfigError(
                f"Field 'name' must be set when using initial_state for state input '{state.input_name}'."
            )
        if len(initial.dims) != len(dims):
            raise ConfigError(
                "Number of dimensions in 'initial_state' doesn't match the size of 'state' "
                f"dimensions for state input '{state.input_name}'. {len(initial.dims)} != {len(dims)}"
            )
        for got, want in zip(initial.dims, dims, strict=True):
            if got == -1:
                raise ConfigError(
                    f"'initial_state' field for state input name '{state.input_name}' contains "
                    "variable dimensions."
                )
            if want != -1 and got != want:
                raise ConfigError(
                    f"'initial_state' dim for input name '{state.input_name}' doesn't match 'state' "
                    f"dim description. {got} != {want}"
                )
        if initial.data_file:
            raise ConfigError(
                f"state '{state.input_name}': initial_state data_file is not supported by edged; "
                "use zero_data"
            )
        if not initial.zero_data:
            raise ConfigError(
                f"initial_state setting expects state'{state.input_name}' to have state_data set"
            )
        shape = tuple(initial.dims)
    array = np.zeros(((1,) if batched else ()) + shape, dtype=NUMPY_DTYPES[state.data_type])
    array.flags.writeable = False
    return StateSpec(state.input_name, state.output_name, state.data_type, dims, array)


def _names(spec: SequenceSpec) -> set[str]:
    return {t.name for t in spec.input_tensors()} | {t.name for t in spec.output_tensors()}


def runtime_config(config: ModelConfig) -> ModelConfig:
    """The config a backend instance loads: control and state tensors declared as ordinary
    inputs/outputs (Triton's config lists them only under `sequence_batching`). Raises
    ConfigError with Triton's message when `sequence_batching` is invalid."""
    if config.sequence_batching is None:
        return config
    spec = SequenceSpec.from_config(config)
    inputs = {t.name for t in config.input}
    outputs = {t.name for t in config.output}
    return msgspec.structs.replace(
        config,
        input=[*config.input, *(t for t in spec.input_tensors() if t.name not in inputs)],
        output=[*config.output, *(t for t in spec.output_tensors() if t.name not in outputs)],
    )


def for_autocomplete(config: ModelConfig) -> ModelConfig:
    """What a backend's autocomplete gets: the runtime view when the config declares inputs
    (so a backend's "graph input not declared" check passes), else the config as it is (the
    backend fills every graph input, and `client_config` takes the sequence ones out again)."""
    if config.sequence_batching is not None and config.input:
        return runtime_config(config)
    return msgspec.structs.replace(config)  # a copy: autocomplete may change it in place


def client_config(config: ModelConfig) -> ModelConfig:
    """The config clients see: no control or state tensors among inputs and outputs."""
    if config.sequence_batching is None:
        return config
    sb = config.sequence_batching
    hidden = _names(SequenceSpec.from_config(config))
    # Triton's normalization, so `/config` shows the values in effect.
    oldest = sb.oldest
    if oldest is not None and not oldest.preferred_batch_size and config.max_batch_size > 0:
        oldest = msgspec.structs.replace(oldest, preferred_batch_size=[config.max_batch_size])
    sb = msgspec.structs.replace(
        sb,
        max_sequence_idle_microseconds=sb.max_sequence_idle_microseconds or DEFAULT_IDLE_US,
        oldest=oldest,
    )
    return msgspec.structs.replace(
        config,
        input=[t for t in config.input if t.name not in hidden],
        output=[t for t in config.output if t.name not in hidden],
        sequence_batching=sb,
    )


# ---------------------------------------------------------------------------- requests


def sequence_parameters(
    request: InferRequest, model: str, new_id: Callable[[], int] | None = None
) -> tuple[SequenceId, bool, bool]:
    """(correlation ID, start, end) from the request parameters; Triton's errors. With
    `new_id` (iterative sequences), a request without an ID starts a sequence of its own.

    A transport that already turned them into `request.correlation_id` / `flags` (as Triton's
    HTTP layer does) is taken at its word."""
    if request.correlation_id not in (0, "") or request.flags:
        if request.correlation_id in (0, "") and new_id is not None:
            return new_id(), True, False
        if request.correlation_id in (0, ""):
            raise InvalidArgument(
                f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID"
            )
        return (
            request.correlation_id,
            bool(request.flags & REQUEST_FLAG_SEQUENCE_START),
            bool(request.flags & REQUEST_FLAG_SEQUENCE_END),
        )
    params = request.parameters
    corrid = params.get("sequence_id", 0)
    if isinstance(corrid, bool) or not isinstance(corrid, int | str) or (
        isinstance(corrid, int) and not 0 <= corrid < 2**64
    ):
        raise InvalidArgument(
            f"Unable to parse 'sequence_id': expected an unsigned 64-bit integer or a string, got {corrid!r}"
        )
    flags = []
    for key in ("sequence_start", "sequence_end"):
        value = params.get(key, False)
        if not isinstance(value, bool):
            raise InvalidArgument(f"Unable to parse '{key}': expected a boolean, got {value!r}")
        flags.append(value)
    if corrid in (0, "") and new_id is not None:
        return new_id(), True, False
    if corrid in (0, ""):
        raise InvalidArgument(
            f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID"
        )
    return corrid, flags[0], flags[1]


def _input_key(request: InferRequest, ragged: frozenset[str]) -> Hashable:
    """Requests that can share a batch have equal keys (names, dtypes, non-batch dims but
    those of `ragged` inputs)."""
    return tuple(
        (name, array.dtype.str, array.shape[1:] if name not in ragged else None)
        for name, array in sorted(request.inputs.items())
    )


# ---------------------------------------------------------------------------- the scheduler


class _Run(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(eq=False, slots=True)
class _Item:
    """One accepted request on its way through the batcher."""

    request: InferRequest
    future: asyncio.Future[InferResponse]
    sequence: _Sequence
    start: bool
    end: bool
    arrival_ns: int
    key: Hashable
    queue_ns: int = 0
    running: bool = False
    # A streamed request's responses (None: its one response goes to `future`).
    sink: _Sink | None = None
    # Answered or failed: it is nobody's to cancel any more.
    finished: bool = False

    def gone(self) -> bool:
        """Whoever waits for this request went away (or it was answered)."""
        return self.sink.cancelled if self.sink is not None else self.future.done()


class _Sink(ResponseQueue):
    """The responses of one streamed request (`ResponseSink`), on the loop, from the backend to
    the consumer of `submit_stream`. Implicit state outputs are taken out of them as they pass
    (`keep`), as the batcher does with a single response."""

    __slots__ = ("cancelled", "closed", "keep", "on_close")

    def __init__(self) -> None:
        super().__init__()
        self.keep: Callable[[InferResponse], ExecuteResult] | None = None
        # Called once the last response is in.
        self.on_close: Callable[[], None] | None = None
        # The consumer went away: the model sees is_cancelled(), and nothing runs again.
        self.cancelled = False
        self.closed = False

    def send(self, result: ExecuteResult | None, final: bool) -> None:
        if self.closed:
            return  # after the last response (a model sending past an error that ended it)
        self.closed = final
        if isinstance(result, InferResponse) and self.keep is not None:
            result = self.keep(result)
        self.put(result, final)
        if final and self.on_close is not None:
            self.on_close()


@dataclass(eq=False, slots=True)
class _Sequence:
    corrid: SequenceId
    last_ns: int
    queue: deque[_Item] = field(default_factory=deque)
    lane: _Lane | None = None
    slot: int = -1
    # The implicit state to feed next; None = the initial state.
    state: dict[str, np.ndarray] | None = None
    # Released (ended, idle or cancelled): it takes no more requests.
    done: bool = False
    # Backlog only: the earliest request timeout, 0 = none.
    expires_ns: int = 0


@dataclass(eq=False, slots=True)
class _Lane:
    """One model instance, its slots and its worker."""

    index: int
    instance: Backend
    slots: list[_Sequence | None]
    wake: asyncio.Future[None] | None = None
    task: asyncio.Task[None] | None = None

    def kick(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)


class SequenceBatcher:
    """The `Scheduler` for models with `sequence_batching` (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        instances: Sequence[Backend],
        stats: ModelStats,
        *,
        limits: InstanceLimits | None = None,
    ) -> None:
        if not instances:
            raise ConfigError(f"model '{config.name or stats.name}' has no backend instances")
        sb = config.sequence_batching
        if sb is None:
            raise ConfigError(f"model '{config.name or stats.name}' has no sequence_batching")
        self.config = config
        self.model = config.name or stats.name
        self.stats = stats
        self.limits = limits
        self.spec = SequenceSpec.from_config(config)
        self.merges = config.max_batch_size > 0 and all(
            type(i).capabilities.dynamic_batching for i in instances
        )
        self.max_rows = config.max_batch_size if self.merges else 1
        # Inputs whose shapes may differ within a batch (Triton's allow_ragged_batch).
        self._ragged = frozenset(config.ragged_inputs())
        slot_count = max(1, config.max_batch_size)
        self.preferred: frozenset[int] = frozenset()
        if sb.oldest is not None:
            slot_count = sb.oldest.max_candidate_sequences or slot_count
            # Triton: no preferred sizes = max_batch_size.
            self.preferred = frozenset(sb.oldest.preferred_batch_size or [self.max_rows])
            self.delay_ns = sb.oldest.max_queue_delay_microseconds * 1000
            self.utilization = 0.0
        else:
            direct = sb.direct
            self.delay_ns = direct.max_queue_delay_microseconds * 1000 if direct else 0
            self.utilization = direct.minimum_slot_utilization if direct else 0.0
        if slot_count > MAX_SEQUENCE_SLOTS:
            # A slot each is listed here, on the event loop (the config bounds
            # max_candidate_sequences itself; max_batch_size also sizes other batchers).
            raise ConfigError(
                f"model '{config.name}': sequence_batching gives each instance {slot_count} sequence slots "
                f"(max_batch_size); at most {MAX_SEQUENCE_SLOTS}"
            )
        self.lanes = [_Lane(i, instance, [None] * slot_count) for i, instance in enumerate(instances)]
        # Free slots as (slot, lane): slot 0 of every instance first, so sequences spread over
        # the instances before batches grow.
        self._free = [(slot, lane) for slot in range(slot_count) for lane in range(len(self.lanes))]
        heapq.heapify(self._free)
        self._sequences: dict[SequenceId, _Sequence] = {}
        self._backlog: deque[_Sequence] = deque()
        self._run = _Run.NEW
        self._pending = 0
        self._running: set[_Item] = set()
        self._drained = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None
        self._reaper_wake: asyncio.Future[None] | None = None
        self._state_outputs = tuple(s.output_name for s in self.spec.states)
        self.iterative = sb.iterative_sequence
        self.decoupled = config.model_transaction_policy.decoupled
        # Through the backend's execute_step: requests may stream or be rescheduled.
        self.stepped = self.iterative or self.decoupled
        # Triton's IterativeSequencer: IDs for requests that bring none, from 1 per model.
        self._last_id = 0
        # Streams of released requests whose model has not sent its final flag yet (it may
        # send from its own thread): a stop waits for them, then ends them.
        self._open: set[_Sink] = set()

    # ------------------------------------------------------------------ Scheduler

    async def start(self) -> None:
        if self._run is not _Run.NEW:
            return
        self._run = _Run.RUNNING
        for lane in self.lanes:
            lane.task = asyncio.create_task(self._lane_loop(lane), name=f"sequence-{self.model}-{lane.index}")
        self._reaper = asyncio.create_task(self._reap_loop(), name=f"sequence-reaper-{self.model}")

    def pending(self) -> int:
        return self._pending

    async def submit(self, request: InferRequest) -> InferResponse:
        if self.decoupled and self.iterative:
            # Its responses may come from several executions: all of them, then the one
            # `/infer` can carry.
            results = []
            async with contextlib.aclosing(self.submit_stream(request)) as stream:
                async for result in stream:
                    results.append(result)
            if len(results) != 1:
                raise decoupled_infer_error(self.model, len(results))
            if isinstance(results[0], EdgedError):
                raise results[0]
            return results[0]
        item = self._accept(request, None)
        try:
            return await item.future
        except asyncio.CancelledError:
            # (Cancelling this task cancelled the future too.)
            if not item.running and (item.future.cancelled() or not item.future.done()):
                # The caller went away: like Triton, a cancelled request ends its sequence.
                self._cancel_sequence(item)
            raise

    async def submit_stream(self, request: InferRequest) -> AsyncGenerator[ExecuteResult, None]:
        """A decoupled model's request: each response as the model sends it, up to its final
        flag. Raises before the first for a request refused here. Closing early (the client
        went away) cancels it: the model sees is_cancelled(), and it never runs again."""
        sink = _Sink()
        item = self._accept(request, sink)
        sink.keep = lambda response: self._keep_state(item, response)
        finished = False
        try:
            async for result in sink.responses():
                yield result
            finished = True
        finally:
            if not finished:
                sink.cancelled = True
                if not item.running and not item.finished:
                    self._cancel_sequence(item)

    def _new_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def _accept(self, request: InferRequest, sink: _Sink | None) -> _Item:
        """Check `request` and queue it in its sequence (Triton's errors)."""
        try:
            corrid, start, end = sequence_parameters(
                request, self.model, self._new_id if self.iterative else None
            )
            if self.config.max_batch_size > 0 and request.batch_size() != 1:
                raise InvalidArgument(
                    f"inference request to model '{self.model}' must specify batch-size 1 due to "
                    "requirements of sequence batcher"
                )
            if self.spec.corrid_name:
                self.spec.corrid_array(corrid)  # a correlation ID the control cannot hold: 400 now
        except InvalidArgument:
            self.stats.record_failure(0, "OTHER")
            raise
        if self._run is _Run.STOPPED or (self._run is _Run.STOPPING and start):
            self.stats.record_failure(0, "REJECTED")
            raise Unavailable(
                f"model '{self.model}' is unloading: its sequence batcher has stopped accepting "
                "new inference requests"
            )
        now = time.monotonic_ns()
        sequence = self._sequences.get(corrid)
        if sequence is None and not start:
            self.stats.record_failure(0, "OTHER")
            raise InvalidArgument(
                f"inference request for sequence {corrid} to model '{self.model}' must specify "
                "the START flag on the first request of the sequence"
            )
        if sequence is not None and start:
            # Triton: the unfinished sequence is cut short and this START continues in its slot
            # (the state is reset when the START runs).
            log.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not end "
                "before this sequence start. Previous sequence will be terminated early.",
                corrid, self.model,
            )
        if sequence is None:
            sequence = _Sequence(corrid, now)
            self._sequences[corrid] = sequence
            self._assign(sequence)
        if end:
            # Like Triton: a later START with this ID is a new sequence (its own slot).
            del self._sequences[corrid]
        params = request.parameters
        if SEQUENCE_PARAMETERS & params.keys():
            params = {k: v for k, v in params.items() if k not in SEQUENCE_PARAMETERS}
        item = _Item(
            request=InferRequest(
                inputs=request.inputs,
                id=request.id,
                requested_outputs=request.requested_outputs,
                parameters=params,
                priority=request.priority,
                timeout_us=request.timeout_us,
                tally=request.tally,
            ),
            future=asyncio.get_running_loop().create_future(),
            sequence=sequence,
            start=start,
            end=end,
            arrival_ns=now,
            key=_input_key(request, self._ragged) if self.merges else None,
            sink=sink,
        )
        sequence.queue.append(item)
        sequence.last_ns = now
        self._pending += 1
        self.stats.pending = self._pending
        if sequence.lane is not None:
            sequence.lane.kick()
        elif request.timeout_us:
            # Triton applies request timeouts to sequences waiting in the backlog.
            deadline = now + request.timeout_us * 1000
            sequence.expires_ns = min(sequence.expires_ns or deadline, deadline)
            self._wake_reaper()
        return item

    async def stop(self, drain_timeout: float) -> None:
        if self._run is _Run.STOPPED:
            return
        was_started = self._run is not _Run.NEW
        self._run = _Run.STOPPING
        self._check_drained()
        if was_started:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), max(0.0, drain_timeout))
        self._run = _Run.STOPPED
        tasks = [lane.task for lane in self.lanes if lane.task is not None]
        if self._reaper is not None:
            tasks.append(self._reaper)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        leftovers = list(self._running)
        for sequence in {*self._sequences.values(), *self._backlog, *self._slotted()}:
            leftovers.extend(sequence.queue)
            sequence.queue.clear()
        self._sequences.clear()
        self._backlog.clear()
        self._pending = 0
        self.stats.pending = 0
        for sink in list(self._open):
            sink.cancelled = True  # the model, still sending, sees is_cancelled()
            sink.send(Unavailable(f"model '{self.model}' was unloaded before the request finished"), True)
        if leftovers:
            log.warning("model %s: %d request(s) failed: not finished within the drain timeout",
                        self.model, len(leftovers))
        for item in leftovers:
            self._fail(
                item, Unavailable(f"model '{self.model}' was unloaded before the request finished"), "REJECTED"
            )

    # ------------------------------------------------------------------ slots

    def _slotted(self) -> list[_Sequence]:
        return [s for lane in self.lanes for s in lane.slots if s is not None]

    def _assign(self, sequence: _Sequence) -> None:
        if self._free:
            slot, lane_index = heapq.heappop(self._free)
            self._place(sequence, self.lanes[lane_index], slot)
        else:
            self._backlog.append(sequence)

    def _place(self, sequence: _Sequence, lane: _Lane, slot: int) -> None:
        sequence.lane, sequence.slot, sequence.expires_ns = lane, slot, 0
        lane.slots[slot] = sequence
        lane.kick()

    def _release(self, sequence: _Sequence) -> None:
        """`sequence` gives up its slot (or backlog place); the next backlog sequence gets it."""
        sequence.done = True
        if self._sequences.get(sequence.corrid) is sequence:
            del self._sequences[sequence.corrid]
        lane = sequence.lane
        if lane is None:
            with contextlib.suppress(ValueError):
                self._backlog.remove(sequence)
            return
        lane.slots[sequence.slot] = None
        slot = sequence.slot
        sequence.lane, sequence.slot = None, -1
        while self._backlog:
            waiting = self._backlog.popleft()
            if waiting.queue:
                self._place(waiting, lane, slot)
                return
        heapq.heappush(self._free, (slot, lane.index))

    def _cancel_sequence(self, item: _Item) -> None:
        sequence = item.sequence
        with contextlib.suppress(ValueError):
            sequence.queue.remove(item)
            self._pending -= 1
        self._fail(item, None, "CANCELED")
        others = list(sequence.queue)
        sequence.queue.clear()
        self._pending -= len(others)
        self.stats.pending = self._pending
        for other in others:
            self._fail(
                other,
                Unavailable(f"sequence {sequence.corrid} for model '{self.model}' was cancelled"),
                "CANCELED",
            )
        if not sequence.done:
            self._release(sequence)
        self._check_drained()

    # ------------------------------------------------------------------ lanes

    async def _lane_loop(self, lane: _Lane) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = time.monotonic_ns()
            rows, wake_at = self._plan(lane, now)
            if rows is not None:
                try:
                    await self._execute(lane, rows, now)
                except Exception as exc:  # a bug here must fail these requests, not hang them
                    log.exception("model %s: sequence batch failed", self.model)
                    for item in rows:
                        if item is not None:
                            self._fail(item, BackendError(f"model '{self.model}': {exc!r}"), "OTHER")
                    self._check_drained()
                if self.iterative:
                    # A request rescheduled by a backend that answered without suspending would
                    # otherwise run again and again before anything else on the loop.
                    await asyncio.sleep(0)
                continue
            lane.wake = loop.create_future()
            timer = None
            if wake_at is not None:
                timer = loop.call_later(max(0, wake_at - now) / 1e9, lane.kick)
            try:
                await lane.wake
            finally:
                lane.wake = None
                if timer is not None:
                    timer.cancel()

    def _plan(self, lane: _Lane, now_ns: int) -> tuple[list[_Item | None] | None, int | None]:
        """The next batch of `lane`: rows (None = padding), or (None, wake time / None)."""
        ready = [s for s in lane.slots if s is not None and s.queue]
        if not ready:
            return None, None
        oldest = min(s.queue[0].arrival_ns for s in ready)
        flush = self._run is not _Run.RUNNING or now_ns >= oldest + self.delay_ns
        if self.spec.strategy == "oldest":
            heads = sorted((s.queue[0] for s in ready), key=lambda item: item.arrival_ns)
            head = heads[0]
            batch = [i for i in heads if i.key == head.key][: self.max_rows]
            if len(batch) < self.max_rows and len(batch) not in self.preferred and not flush:
                sizes = [p for p in self.preferred if p <= len(batch)]
                if not sizes:
                    return None, oldest + self.delay_ns
                batch = batch[: max(sizes)]
            rows: list[_Item | None] = list(batch)
        else:
            if (
                self.delay_ns
                and self.utilization
                and len(ready) / max(1, self.max_rows) < self.utilization
                and not flush
            ):
                return None, oldest + self.delay_ns
            if not self.merges:
                rows = [min((s.queue[0] for s in ready), key=lambda item: item.arrival_ns)]
            else:
                # The oldest request heads the batch, so a request whose shapes differ from
                # its neighbours' waits at most until it is the oldest.
                head = min((s.queue[0] for s in ready), key=lambda item: item.arrival_ns)
                rows = []
                for s in lane.slots:
                    fits = s is not None and s.queue and s.queue[0].key == head.key
                    rows.append(s.queue[0] if fits and s is not None else None)
                while rows and rows[-1] is None:
                    rows.pop()
        for item in rows:
            if item is not None:
                self._take(item, now_ns)
        return rows, None

    def _take(self, item: _Item, now_ns: int) -> None:
        sequence = item.sequence
        sequence.queue.popleft()
        self._pending -= 1
        self.stats.pending = self._pending
        item.running = True
        item.queue_ns = now_ns - item.arrival_ns
        self._running.add(item)
        if item.start or sequence.state is None:
            sequence.state = {s.input_name: s.initial for s in self.spec.states}
        if item.end and not self.iterative:
            # Triton frees the slot as the END request is batched: the next sequence may start
            # in it with the very next batch. (An iterative sequence ends when the model
            # releases its request, which may run again: Triton 2.51 leaves such a request
            # unanswered.)
            self._release(sequence)

    async def _execute(self, lane: _Lane, rows: list[_Item | None], now_ns: int) -> None:
        spec = self.spec
        requests: list[InferRequest] = []
        representative = next(item for item in rows if item is not None)
        for item in rows:
            if item is None:
                requests.append(self._padding(representative))
                continue
            sequence = item.sequence
            inputs = dict(item.request.inputs)
            for control, flag in ((spec.start, item.start), (spec.end, item.end), (spec.ready, True)):
                if control is not None:
                    inputs[control.name] = control.value(flag)
            if spec.corrid_name:
                # Checked in submit: it fits.
                inputs[spec.corrid_name] = spec.corrid_array(sequence.corrid)
            assert sequence.state is not None
            inputs.update(sequence.state)
            requested = item.request.requested_outputs
            if requested and self._state_outputs:
                requested = (*requested, *(n for n in self._state_outputs if n not in requested))
            requests.append(
                InferRequest(
                    inputs=inputs,
                    id=item.request.id,
                    requested_outputs=requested,
                    parameters=item.request.parameters,
                    priority=item.request.priority,
                    timeout_us=item.request.timeout_us,
                    correlation_id=sequence.corrid,
                    flags=(REQUEST_FLAG_SEQUENCE_START if item.start else 0)
                    | (REQUEST_FLAG_SEQUENCE_END if item.end else 0),
                )
            )
        limits = self.limits
        ticket: Ticket | None = None
        if limits is not None:
            ticket, waited = await limits.hold(lane.instance)
            for item in rows:
                if item is not None:
                    item.queue_ns += waited
        lane.instance.phase_ns = (0, 0)
        started = time.monotonic_ns()
        sinks = [item.sink if item is not None else None for item in rows] if self.stepped else None
        try:
            results = await self._run_backend(lane.instance, requests, sinks)
        finally:
            if limits is not None:
                limits.release(ticket)
        phases = compute_phases(time.monotonic_ns() - started, lane.instance.phase_ns)
        # Performed, whatever its outcome.
        self.stats.record_execution(len(rows), phases.infer_ns, phases.input_ns, phases.output_ns)
        finished = time.monotonic_ns()
        for item, result in zip(rows, results, strict=True):
            if item is None:
                continue
            self._running.discard(item)
            item.running = False
            item.sequence.last_ns = finished
            if isinstance(result, Rescheduled):
                self._requeue(item)
                continue
            if item.sink is not None:
                # Its responses went to the sink (a response or error here is its last).
                self._streamed(item, result, phases)
            else:
                outcome = result
                if isinstance(outcome, InferResponse):
                    outcome = self._keep_state(item, outcome)
                if isinstance(outcome, InferResponse):
                    self._succeed(item, outcome, phases)
                else:
                    self._fail(item, outcome, "BACKEND")
            if self.iterative:
                self._end(item.sequence)
        self._check_drained()

    def _requeue(self, item: _Item) -> None:
        """The model rescheduled `item`: it runs again in its sequence, neither START nor END
        (Triton's IterativeSequencer); unless nobody waits for it any more."""
        sequence = item.sequence
        if item.gone() or sequence.done or sequence.lane is None or self._run is _Run.STOPPED:
            self._fail(item, Unavailable(f"sequence {sequence.corrid} for model '{self.model}' was cancelled"),
                       "CANCELED")
            self._end(sequence)
            return
        item.start = item.end = False
        # First in its sequence: it runs until the model releases it, before what a client
        # queued under its ID.
        sequence.queue.appendleft(item)
        self._pending += 1
        self.stats.pending = self._pending
        sequence.lane.kick()

    def _end(self, sequence: _Sequence) -> None:
        """An iterative sequence's request was released for good: the sequence ends (Triton
        sends it an END), so requests a client queued behind it under its ID find none;
        unless the next one starts a sequence under that ID, which goes on in the slot (as a
        START on a busy ID does)."""
        if sequence.queue and sequence.queue[0].start and not sequence.done:
            return
        if not sequence.done:
            self._release(sequence)
        behind = list(sequence.queue)
        sequence.queue.clear()
        self._pending -= len(behind)
        self.stats.pending = self._pending
        for item in behind:
            self._fail(item, InvalidArgument(
                f"inference request for sequence {sequence.corrid} to model '{self.model}' must specify "
                "the START flag on the first request of the sequence"
            ), "OTHER")

    def _padding(self, representative: _Item) -> InferRequest:
        """Triton's null request: another request's inputs, READY false, CORRID 0, and a copy
        of that request's state, so the padded slot's own sequence state is never touched."""
        spec = self.spec
        inputs = dict(representative.request.inputs)
        for control in (spec.start, spec.end, spec.ready):
            if control is not None:
                inputs[control.name] = control.false
        if spec.corrid_name:
            inputs[spec.corrid_name] = spec.corrid_array(0)
        state = representative.sequence.state or {}
        inputs.update(state)
        return InferRequest(inputs=inputs, requested_outputs=representative.request.requested_outputs)

    def _keep_state(self, item: _Item, response: InferResponse) -> ExecuteResult:
        """Take the state outputs out of `response` into the sequence."""
        if not self._state_outputs:
            return response
        outputs = dict(response.outputs)
        state: dict[str, np.ndarray] = {}
        for spec in self.spec.states:
            value = outputs.pop(spec.output_name, None)
            if value is None:
                return BackendError(
                    f"model '{self.model}' did not produce state output '{spec.output_name}'"
                )
            # A copy: the output may be a view into the whole batch's array.
            state[spec.input_name] = np.array(value, dtype=spec.initial.dtype, copy=True)
        item.sequence.state = state
        return InferResponse(outputs, response.parameters)

    async def _run_backend(
        self, instance: Backend, requests: list[InferRequest], sinks: list[_Sink | None] | None
    ) -> list[StepResult]:
        try:
            if sinks is None:
                results: list[Any] = list(await instance.execute(requests))
            else:
                results = list(await instance.execute_step(requests, sinks))
            if len(results) != len(requests):
                raise BackendError(
                    f"backend {instance.name!r} returned {len(results)} results for "
                    f"{len(requests)} requests of model '{self.model}'"
                )
        except EdgedError as exc:
            return [exc] * len(requests)
        except Exception as exc:  # a broken backend fails this batch, never the scheduler
            log.warning("model %s: backend %s raised while executing %d request(s): %r",
                        self.model, instance.name, len(requests), exc)
            error = BackendError(
                f"backend {instance.name!r} failed to execute model '{self.model}': "
                f"{type(exc).__name__}: {exc}"
            )
            return [error] * len(requests)
        return [
            r if isinstance(r, InferResponse | EdgedError)
            or (r is None and sinks is not None and sinks[i] is not None)
            or (isinstance(r, Rescheduled) and self.iterative)
            else BackendError(
                f"backend {instance.name!r} returned {type(r).__name__} instead of a response "
                f"for model '{self.model}'"
            )
            for i, r in enumerate(results)
        ]

    # ------------------------------------------------------------------ idle and timeouts

    def _wake_reaper(self) -> None:
        if self._reaper_wake is not None and not self._reaper_wake.done():
            self._reaper_wake.set_result(None)

    async def _reap_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            wake_at = self._reap(time.monotonic_ns())
            self._reaper_wake = loop.create_future()
            timer = loop.call_later(max(0, wake_at - time.monotonic_ns()) / 1e9, self._wake_reaper)
            try:
                await self._reaper_wake
            finally:
                timer.cancel()
                self._reaper_wake = None

    def _reap(self, now_ns: int) -> int:
        """Release idle sequences and expire backlog timeouts; returns when to look again."""
        idle = self.spec.idle_ns
        wake_at = now_ns + idle
        for sequence in self._slotted():
            # A sequence with requests queued or running is waiting on us, not idle.
            if sequence.queue or any(i.sequence is sequence for i in self._running):
                continue
            deadline = sequence.last_ns + idle
            if deadline <= now_ns:
                log.info("model %s: sequence %s idle for %d us; releasing its slot",
                         self.model, sequence.corrid, idle // 1000)
                self._release(sequence)
            else:
                wake_at = min(wake_at, deadline)
        for sequence in list(self._backlog):
            if not sequence.expires_ns:
                continue
            if sequence.expires_ns > now_ns:
                wake_at = min(wake_at, sequence.expires_ns)
                continue
            expired = list(sequence.queue)
            sequence.queue.clear()
            self._pending -= len(expired)
            self.stats.pending = self._pending
            self._release(sequence)
            for item in expired:
                self._fail(
                    item, Unavailable("timeout of the corresponding sequence has been expired"), "REJECTED"
                )
        self._check_drained()
        return wake_at

    # ------------------------------------------------------------------ delivery

    def _streamed(self, item: _Item, last: StepResult, phases: ComputePhases) -> None:
        """A streamed request the model released: its responses went to its sink, and `last`
        (a response or an error the backend gave) ends them."""
        assert item.sink is not None
        if isinstance(last, EdgedError):
            self._fail(item, last, "BACKEND")
            return
        if isinstance(last, InferResponse):
            item.sink.send(last, True)
        elif not item.sink.closed:
            sink = item.sink
            self._open.add(sink)
            sink.on_close = lambda: self._closed(sink)
        self._record_success(item, phases)

    def _succeed(self, item: _Item, response: InferResponse, phases: ComputePhases) -> None:
        if item.future.done():
            item.finished = True
            self.stats.record_failure(time.monotonic_ns() - item.arrival_ns, "CANCELED")
            return
        self._record_success(item, phases)
        item.future.set_result(response)

    def _record_success(self, item: _Item, phases: ComputePhases) -> None:
        item.finished = True
        self.stats.record_success(
            time.monotonic_ns() - item.arrival_ns,
            1,
            queue_ns=item.queue_ns,
            compute_input_ns=phases.input_ns,
            compute_infer_ns=phases.infer_ns,
            compute_output_ns=phases.output_ns,
            tally=item.request.tally,
        )

    def _fail(self, item: _Item, error: EdgedError | None, reason: FailureReason) -> None:
        self._running.discard(item)
        item.finished = True
        self.stats.record_failure(time.monotonic_ns() - item.arrival_ns, reason)
        if error is None:
            return
        if item.sink is not None:
            item.sink.send(_fresh(error), True)
        elif not item.future.done():
            item.future.set_exception(_fresh(error))

    def _closed(self, sink: _Sink) -> None:
        self._open.discard(sink)
        self._check_drained()

    def _check_drained(self) -> None:
        if self._run is not _Run.RUNNING and self._pending == 0 and not self._running and not self._open:
            self._drained.set()


def _fresh(error: EdgedError) -> EdgedError:
    """A copy per request: one exception object raised in many tasks would share tracebacks."""
    try:
        return copy.copy(error)
    except Exception:
        return error
