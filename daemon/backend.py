"""The backend contract (API version 1). This file is the whole contract.

A *backend* runs one framework runtime behind this interface; a plugin in `backends/<name>/`
ships one `Backend` subclass named by its manifest's `entrypoint`. The daemon creates one
backend object per model *instance* (Triton's TRITONBACKEND_ModelInstance): an
`instance_group { count: 2 }` gives two objects, each loaded separately and fed by the same
scheduler queue.

Lifecycle, all async with working defaults (MLServer style) so a plugin writes only what it
needs:

    probe()            classmethod: can this backend run here? (runtime importable, device)
    autocomplete(...)  classmethod: fill inputs/outputs the config omitted, from the artifact
    fit(request)       classmethod, optional: checks that need code (e.g. a TensorRT engine built
                       for this GPU); what selection needs besides that is in the manifest
    load(config, artifact, device)
    execute(batch)     a batch of requests in, one InferResponse or EdgedError per request out
    execute_stream(request)  decoupled models only: 0..n responses for one request
    execute_step(batch, sinks)  the sequence batcher's, for decoupled and iterative sequence
                       models: responses to per-request sinks, or RESCHEDULED to run again
    unload()

Blocking runtime calls must go through `run_blocking`, which uses the instance's own thread:
the event loop never blocks, and two instances really run in parallel.

Tensor backends usually subclass `TensorBackend` and write only `load_sync` + `infer`: it
merges a batch along dim 0, runs once, and splits the outputs back per request.
Generation backends subclass `GenerationBackend` and are driven by their own engine loop
(continuous batching), never by the dynamic batcher.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar

import msgspec
import numpy as np

# Re-exported: a plugin imports this module and nothing else of the daemon's.
from daemon.core.hardware import Hardware, HardwareInfo, NvidiaGpu
from daemon.errors import (
    BackendError,
    ConfigError,
    EdgedError,
    InvalidArgument,
    NotFound,
    Unavailable,
    Unsupported,
)
from daemon.model_config import BatchInput, ModelConfig, TensorConfig, lora_entries, to_triton_json

if TYPE_CHECKING:
    from daemon.core.stats import PhaseTally

__all__ = [
    "API_VERSION",
    "DATATYPE_OF_DTYPE",
    "NUMPY_DTYPES",
    "RESCHEDULED",
    "Backend",
    "BackendError",
    "Capabilities",
    "ConfigError",
    "CustomMetrics",
    "Device",
    "EdgedError",
    "ExecuteResult",
    "Fit",
    "FitRequest",
    "GenerateChunk",
    "GenerateParams",
    "GenerationBackend",
    "GenerationProps",
    "Hardware",
    "HardwareInfo",
    "InferRequest",
    "InferResponse",
    "InstanceContext",
    "InvalidArgument",
    "LoraAdapter",
    "MetricFamilyHandle",
    "MetricKind",
    "MetricSeries",
    "ModelConfig",
    "ModelControl",
    "NotFound",
    "NvidiaGpu",
    "Probe",
    "Rescheduled",
    "ResponseQueue",
    "ResponseSink",
    "SlotAction",
    "SlotFile",
    "SlotState",
    "SlotTask",
    "StepResult",
    "TensorBackend",
    "TensorConfig",
    "TokenLogprob",
    "ToolCallFrame",
    "Unavailable",
    "Unsupported",
    "backend_failure",
    "datatype_of",
    "decoupled_infer_error",
    "lora_entries",
    "merge_batch",
    "select_outputs",
    "split_batch",
    "to_triton_json",
]

API_VERSION = 1

T = TypeVar("T")

# KServe datatype <-> numpy. BYTES tensors are numpy object arrays holding `bytes`.
# BF16 has no numpy dtype: it travels as raw uint16 bit patterns.
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(np.uint16),
    "BYTES": np.dtype(np.object_),
}


# Reverse of NUMPY_DTYPES for the fixed-size types; uint16 maps to UINT16, not BF16. Equal
# dtypes hash alike, so one lookup per tensor replaces comparing against each entry (0.7 us
# per tensor, and a small request has several).
DATATYPE_OF_DTYPE: Mapping[np.dtype[Any], str] = MappingProxyType(
    {dt: name for name, dt in NUMPY_DTYPES.items() if name not in ("BF16", "BYTES")}
)


def datatype_of(array: np.ndarray) -> str:
    """KServe datatype of a numpy array (object/str/bytes arrays are BYTES)."""
    kind = array.dtype
    name = DATATYPE_OF_DTYPE.get(kind)
    if name is not None:
        return name
    if kind.kind in ("O", "S", "U"):
        return "BYTES"
    raise InvalidArgument(f"unsupported numpy dtype {kind}")


# --------------------------------------------------------------------------- requests


# Triton's TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END.
REQUEST_FLAG_SEQUENCE_START = 1
REQUEST_FLAG_SEQUENCE_END = 2


@dataclass(slots=True)
class InferRequest:
    """One decoded inference request, as the scheduler and backends see it."""

    inputs: dict[str, np.ndarray]
    id: str = ""
    # Names the client asked for; empty = all outputs of the model.
    requested_outputs: tuple[str, ...] = ()
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    # 0 = the queue policy's default.
    timeout_us: int = 0
    # Set by the sequence batcher (Triton's request correlation ID and flags): the sequence's
    # ID (0 = none) and REQUEST_FLAG_SEQUENCE_START | _END.
    correlation_id: int | str = 0
    flags: int = 0
    # Set by an ensemble on its step requests: the model's statistics add the request's compute
    # phases there (Triton's secondary statistics aggregator). Backends leave it alone.
    tally: PhaseTally | None = None

    def batch_size(self) -> int:
        """Rows along dim 0 (only meaningful when the model has max_batch_size > 0)."""
        first = next(iter(self.inputs.values()), None)
        return 1 if first is None or first.ndim == 0 else int(first.shape[0])


@dataclass(slots=True)
class InferResponse:
    outputs: dict[str, np.ndarray]
    parameters: dict[str, Any] = field(default_factory=dict)


ExecuteResult = InferResponse | EdgedError


class Rescheduled:
    """A request the model released to run again in a later batch (Triton's request
    rescheduling, TRITONSERVER_REQUEST_RELEASE_RESCHEDULE): it has no response yet, and the
    sequence batcher queues it again in its sequence (`sequence_batching.iterative_sequence`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "RESCHEDULED"


RESCHEDULED = Rescheduled()

# What `Backend.execute_step` gives for each request: its one response (or error), RESCHEDULED,
# or None for a request whose responses go (or went) to its ResponseSink.
StepResult = InferResponse | EdgedError | Rescheduled | None


def decoupled_infer_error(model: str, count: int) -> Unsupported:
    """A decoupled model's request on `/infer`, which carries one response, got `count`
    (Triton refuses every decoupled model there with this text; edged serves one)."""
    return Unsupported(
        f"HTTP end point doesn't support models with decoupled transaction policy: model "
        f"{model!r} gave {count} responses to one request; use generate_stream for any number "
        "of responses"
    )


class ResponseQueue:
    """The responses of one request on the event loop, in order, up to the one marked final:
    `put` them (on the loop) and iterate `responses()`; a None item is a final flag without a
    response. Kept cheap (a deque, and a future only while waiting): one is made per request."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[tuple[Any, bool]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Any, final: bool) -> None:
        self._items.append((item, final))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def responses(self) -> AsyncIterator[Any]:
        while True:
            while not self._items:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            item, final = self._items.popleft()
            if item is not None:
                yield item
            if final:
                return


class ResponseSink(Protocol):
    """Where the responses of one streamed request go (a decoupled model's): any number of
    results, the last with `final`. `send` is called on the event loop; `cancelled` (the
    client went away) may be read from any thread."""

    def send(self, result: ExecuteResult | None, final: bool) -> None: ...

    @property
    def cancelled(self) -> bool: ...

# (model name, version or None, request) -> the response; raises EdgedError.
InferHook = Callable[[str, "str | None", InferRequest], Awaitable[InferResponse]]
# The same for any number of responses (a decoupled model's, or a plain model's one), each an
# InferResponse or an EdgedError; closing it early cancels the request.
StreamHook = Callable[[str, "str | None", InferRequest], AsyncGenerator["InferResponse | EdgedError", None]]


class ModelControl(Protocol):
    """Triton's model loading API as a model calls it (python models' `pb_utils.load_model`,
    `unload_model`, `is_model_ready`): the repository's explicit control, with its errors
    (EdgedError: Conflict outside explicit mode, NotFound, ConfigError, BackendError, ...).
    Call it on the daemon's event loop."""

    async def load(self, name: str, config_json: str | None, files: Mapping[str, bytes]) -> None:
        """Load or reload `name`: `config_json` (Triton's JSON config) replaces its config;
        `files` are Triton's `file:<path>` load parameters (name -> contents)."""
        ...

    async def unload(self, name: str, dependents: bool) -> None: ...

    def is_ready(self, name: str, version: str) -> bool:
        """`version` "" is the latest; one that is not a version number is InvalidArgument."""
        ...


# Metrics a model defines itself (Triton's custom metrics), exported at /metrics beside the
# daemon's own. Families are the daemon's, shared by name across models; a family handle's
# series stay exported until it is closed. Every call may run on any thread. Failures raise
# InvalidArgument or Unsupported with the reason.
MetricKind = Literal["counter", "gauge", "histogram"]


class MetricSeries(Protocol):
    """One labelled series of a family."""

    def increment(self, value: float) -> None: ...  # counter (>= 0) or gauge (any sign)
    def set(self, value: float) -> None: ...  # gauge
    def observe(self, value: float) -> None: ...  # histogram
    def value(self) -> float: ...  # counter or gauge


class MetricFamilyHandle(Protocol):
    def metric(self, labels: Mapping[str, str], buckets: Sequence[float] | None) -> MetricSeries:
        """The series of these labels (one per label set; `buckets`: histograms only, and
        ignored when the series exists)."""
        ...

    def close(self) -> None:
        """Release this handle's series; idempotent. A series no open handle holds is gone."""
        ...


class CustomMetrics(Protocol):
    def family(self, name: str, description: str, kind: MetricKind) -> MetricFamilyHandle:
        """Open the family of this name (created on first use; the same kind or refused)."""
        ...


# --------------------------------------------------------------------------- metadata


class Capabilities(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What a backend class can do; the loader checks a model's config against it.

    Where it runs (devices), how it ranks and how many instances it gets by default are
    selection facts and live in the plugin's manifest, which is read without importing code.
    """

    # "tensor": fed by a scheduler through execute(); "generation": its own engine loop.
    kind: Literal["tensor", "generation"] = "tensor"
    # Can one execute() take requests merged along dim 0? (False: the scheduler sends one
    # request per execute call, whatever the config's dynamic_batching says.)
    dynamic_batching: bool = True
    # Can one request produce zero or many responses? A config with
    # model_transaction_policy.decoupled on a backend without it does not load.
    decoupled: bool = False
    # Tensor datatypes the backend accepts; a config naming another one does not load.
    datatypes: frozenset[str] = frozenset(NUMPY_DTYPES)
    # May execute() be called on an instance again before its earlier call returned? Say so
    # when each call's runtime work goes through `run_blocking` (which runs calls in order
    # on the instance's one thread) and a call keeps no state on the instance except
    # `phase_ns`, set right before it returns. The scheduler may then queue the next
    # execution on the thread while one runs (see daemon.core.scheduler).
    queued_execute: bool = False
    # Can execute_step() hand a request back to run again (Triton's request rescheduling)? A
    # config with sequence_batching.iterative_sequence on a backend without it does not load.
    rescheduling: bool = False
    # Triton's ragged batching (an input's `allow_ragged_batch`, `batch_input`, `batch_output`).
    # "none": a config with any of them does not load. "requests": execute() hands the model
    # each request's tensors as sent (Triton's python backend), so requests whose ragged inputs
    # differ in shape may share a batch, and batch_input / batch_output, which describe a
    # merged batch, do not load. "merged": TensorBackend concatenates ragged inputs into one
    # dimension, feeds the batch inputs and scatters the batch outputs (`RaggedPlan`); the
    # backend's load checks that the graph takes them.
    ragged_batching: Literal["none", "requests", "merged"] = "none"


DeviceKind = Literal["auto", "cpu", "gpu:nvidia", "gpu:intel", "npu"]


@dataclass(frozen=True, slots=True)
class Device:
    """Where selection wants an instance to run.

    `auto` leaves the choice to the backend (its config parameters, its runtime's own
    default); the other kinds are the manifest's device kinds, `index` the device's number
    among those of its kind (the NVML index for NVIDIA GPUs).
    """

    kind: DeviceKind = "auto"
    index: int = 0

    def __str__(self) -> str:
        return self.kind if self.kind in ("auto", "cpu") else f"{self.kind}:{self.index}"

    @property
    def gpu(self) -> int | None:
        """The GPU's index for a GPU device, else None."""
        return self.index if self.kind.startswith("gpu") else None


@dataclass(frozen=True, slots=True)
class FitRequest:
    """What a plugin's `fit` hook is asked: may this artifact run here, and where?"""

    config: ModelConfig
    artifact: Path
    # Facts are probed when first read (NVML, OpenVINO): read only what the check needs.
    hardware: Hardware
    # The device selection would use from the manifest alone.
    device: Device
    # The model named this backend (config.backend, backend_preference or platform): a
    # plugin may relax rules it applies in automatic mode.
    requested: bool = False
    # NVIDIA GPUs the model may use (its instance groups allow them), for plugins whose
    # manifest lists gpu:nvidia; empty otherwise.
    gpus: Sequence[NvidiaGpu] = ()


@dataclass(frozen=True, slots=True)
class Fit:
    """A fit hook's answer: `problem` empty = it fits; `reason` says why, for metadata."""

    problem: str = ""
    reason: str = ""
    # None: keep the device selection proposed.
    device: Device | None = None


class Probe(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    available: bool
    reason: str = ""
    # Devices this backend could use here, e.g. ("CPU", "GPU.0").
    devices: tuple[str, ...] = ()
    runtime_version: str = ""


@dataclass(slots=True, frozen=True)
class InstanceContext:
    """What the daemon tells one instance about where and how it runs."""

    model_name: str
    model_version: int
    instance_index: int = 0
    instance_count: int = 1
    # Writable per-model directory for caches (e.g. OpenVINO CACHE_DIR).
    state_dir: Path | None = None
    # CPU threads this instance may use, so N instances don't oversubscribe the cores.
    threads: int = 1
    # Runs a request on another loaded model (model name, version or None for the served one):
    # what Triton's BLS calls go through (`stream`: any number of responses). Set by the model
    # loader; None where no registry runs.
    infer: InferHook | None = None
    stream: StreamHook | None = None
    # The CPUs this instance's thread runs on, which the threads it starts inherit (a
    # runtime's pool, llama.cpp's): its host policy's, else every CPU the daemon may use.
    # Empty: the thread is left where it starts.
    cpus: frozenset[int] = frozenset()
    # Where the model's own metrics go (python models' pb_utils.MetricFamily). None where no
    # daemon runs.
    metrics: CustomMetrics | None = None
    # The repository's model control, for models that load others (pb_utils.load_model).
    control: ModelControl | None = None


# --------------------------------------------------------------------------- backends


class _InstanceThread:
    """The thread of one backend instance: runs submitted calls one at a time, in order.

    Not a one-thread ThreadPoolExecutor, for the wake-up: its queue's put wakes the thread
    while the caller still holds the GIL, so on a busy machine the woken thread preempts the
    event loop only to block on the GIL, and the two bounce the CPU between them. Here the
    caller wakes the thread by writing a byte to a pipe, a syscall during which the GIL is
    free, so the thread takes it at once (a round trip measured 17-22 us against 32-40 us).

    The thread starts on the first call and is a daemon thread: one stuck in a model call
    never holds up the process's exit. `shutdown` lets the queued calls finish, then ends it.
    """

    def __init__(self, name: str, cpus: frozenset[int] = frozenset()) -> None:
        self._name = name
        self._cpus = cpus
        self._jobs: collections.deque[Callable[[], None] | None] = collections.deque()
        self._lock = threading.Lock()
        self._shutdown = False
        self._wake_fd = -1  # the pipe's write end, once the thread runs

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new calls after shutdown")
            if self._wake_fd < 0:
                read_fd, self._wake_fd = os.pipe()
                os.set_blocking(self._wake_fd, False)
                thread = threading.Thread(
                    target=self._run, args=(read_fd, self._wake_fd), name=self._name, daemon=True
                )
                thread.start()
            self._jobs.append(job)
            self._wake()

    def shutdown(self) -> None:
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            if self._wake_fd >= 0:
                self._jobs.append(None)
                self._wake()

    def _wake(self) -> None:
        # Under the lock: the thread closes the pipe under it too, so a shutdown marker the
        # thread takes between the append and this write cannot leave the write to a closed
        # (or reused) descriptor. A full pipe already holds a wake-up for the thread.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_fd, b"\0")

    def _run(self, read_fd: int, write_fd: int) -> None:
        jobs = self._jobs
        if self._cpus:
            # Before any call: what the runtime starts from this thread inherits the mask.
            try:
                os.sched_setaffinity(0, self._cpus)
            except OSError as exc:  # the CPUs were checked at start; a cpuset changed since
                logging.getLogger(__name__).error("%s: cannot run on CPUs %s: %s", self._name, sorted(self._cpus), exc)
        try:
            while True:
                os.read(read_fd, 4096)  # bytes may outnumber or lag the jobs: drain the deque
                while jobs:
                    job = jobs.popleft()
                    if job is None:
                        return
                    try:
                        job()
                    except BaseException:  # a job reports its own outcome; never end the thread
                        logging.getLogger(__name__).exception("%s: a call escaped", self._name)
                    # Drop it before waiting for the next: its arguments may be views of a
                    # client's shared memory region, which stays mapped while any view lives.
                    del job
        finally:
            with self._lock:
                os.close(read_fd)
                os.close(write_fd)
                self._wake_fd = -1


def _settle_threadsafe(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], result: T | None, error: BaseException | None
) -> None:
    """From a worker thread: complete `future` on its loop (nothing to do once the loop is closed)."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for the outcome
        loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[T], result: T | None, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]


class Backend:
    """Base class of every backend. Subclasses set `name` and `capabilities`."""

    api_version: ClassVar[int] = API_VERSION
    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, context: InstanceContext) -> None:
        self.context = context
        # Nanoseconds the last `execute` spent preparing its inputs and collecting its outputs
        # (Triton's compute_input and compute_output; the rest of the call is compute_infer).
        # Set by `execute`; the scheduler sets it to (0, 0) before each call and reads it after.
        self.phase_ns: tuple[int, int] = (0, 0)
        # One thread per instance: runtimes are called from one thread at a time, and the
        # instances of a model run in parallel.
        self._executor = _InstanceThread(
            f"{self.name or 'backend'}-{context.model_name}-{context.instance_index}", context.cpus
        )

    @classmethod
    def probe(cls) -> Probe:
        return Probe(available=True)

    @classmethod
    def autocomplete(cls, config: ModelConfig, artifact: Path) -> ModelConfig:
        """Return `config` with what the artifact tells filled in (inputs, outputs, batch).

        Called on a worker thread before the instances load; may read the artifact."""
        return config

    @classmethod
    def fit(cls, request: FitRequest) -> Fit:
        """Can `request.artifact` run here? Called on a worker thread during selection, after
        the manifest's artifact and device rules passed. Default: it fits as proposed."""
        return Fit()

    def describe(self) -> dict[str, str]:
        """Effective runtime settings of this loaded instance (e.g. the inference precision
        the runtime compiled), shown in model metadata. Default: nothing to report."""
        return {}

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on this instance's thread. Cancelling the caller before the
        call starts means it never runs; once started, it runs to its end.

        The thread hands the outcome straight to an asyncio future (one callback on the loop),
        where `loop.run_in_executor` chains a concurrent future to an asyncio one: a small
        request's latency pays for every layer (see also `_InstanceThread`).

        The call runs in a copy of the caller's context, as `asyncio.to_thread` runs it: what
        the model asks of the daemon from there (BLS) is asked on behalf of its caller (a load
        under way, for one)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        context = contextvars.copy_context()

        def call() -> None:
            if future.cancelled():
                return
            try:
                result = context.run(fn, *args, **kwargs)
            except Exception as exc:  # re-raised in the caller, as run_in_executor does
                _settle_threadsafe(loop, future, None, exc)
            except BaseException as exc:
                # Re-raised on the event loop, a KeyboardInterrupt or SystemExit from the
                # instance's code would end the daemon: the caller gets an error instead.
                error = BackendError(f"backend {self.name!r}: {getattr(fn, '__name__', 'a call')} raised "
                                     f"{type(exc).__name__}: {exc}")
                _settle_threadsafe(loop, future, None, error)
            else:
                _settle_threadsafe(loop, future, result, None)

        self._executor.submit(call)
        return await future

    async def load(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        await self.run_blocking(self.load_sync, config, artifact, device)

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        raise NotImplementedError(f"backend {self.name!r} implements neither load nor load_sync")

    async def execute(self, batch: Sequence[InferRequest]) -> list[ExecuteResult]:
        raise Unsupported(f"backend {self.name!r} does not run tensor inference")

    async def unload(self) -> None:
        await self.run_blocking(self.unload_sync)
        self._executor.shutdown()

    def unload_sync(self) -> None:
        """Release runtime objects. Default: nothing to do."""

    # Decoupled models (`model_transaction_policy { decoupled: true }`): requests the daemon
    # streams (generate_stream) bypass the batcher and pick the instance with the fewest
    # `streams_active`, which a backend that streams keeps up to date (except for a model
    # with `sequence_batching`, whose sequence batcher runs them through `execute_step`).
    streams_active: int = 0

    def execute_stream(self, request: InferRequest) -> AsyncGenerator[ExecuteResult, None]:
        """Decoupled execution of one request: yields 0..n responses, each an InferResponse or
        an EdgedError (an error is one response; the stream may go on after it), and ends after
        the model's final flag. Closing the iterator early means the client went away: the
        backend marks the request cancelled so the model can stop."""
        raise Unsupported(f"backend {self.name!r} does not run decoupled models")

    async def execute_step(
        self, batch: Sequence[InferRequest], sinks: Sequence[ResponseSink | None]
    ) -> list[StepResult]:
        """One execution for the sequence batcher of a decoupled model, or of one with
        `sequence_batching.iterative_sequence` (Triton's iterative sequences): like `execute`,
        but a request with a sink (a decoupled model's) sends its responses there, ending with
        `final` (perhaps after this call returned), and its result is None; and a request the
        model released to run again is RESCHEDULED (only when the config asks for iterative
        sequences; `capabilities.rescheduling`). An EdgedError for a request with a sink is
        its last response."""
        if any(sink is not None for sink in sinks):
            raise Unsupported(f"backend {self.name!r} does not run decoupled models")
        return list(await self.execute(batch))


class TensorBackend(Backend):
    """A backend whose runtime takes named arrays and returns named arrays.

    Subclasses write `load_sync` and `infer`; batching, splitting and per-request output
    selection are done here once for every tensor backend.
    """

    config: ModelConfig
    # How a batch with ragged inputs, batch inputs or batch outputs is merged and split; None
    # when the config has none of them.
    ragged: RaggedPlan | None = None

    async def load(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        self.config = config
        self.ragged = RaggedPlan.of(config)
        await self.run_blocking(self.load_sync, config, artifact, device)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the runtime once on (possibly merged) inputs. Called on the instance thread."""
        raise NotImplementedError

    async def execute(self, batch: Sequence[InferRequest]) -> list[ExecuteResult]:
        ragged = self.ragged
        if ragged is None and (len(batch) == 1 or self.config.max_batch_size == 0):
            return [await self._execute_one(request) for request in batch]
        try:
            if sum(array.nbytes for request in batch for array in request.inputs.values()) < OFF_LOOP_BYTES:
                # Small: merged here. On the instance's thread the same Python would contend with
                # the loop for the GIL, which cost 10 % of the throughput at 32 clients.
                started = time.perf_counter_ns()
                merged, sizes = merge_batch(batch) if ragged is None else ragged.merge(batch)
                merge_ns = time.perf_counter_ns() - started
                outputs = await self.run_blocking(self.infer, merged)
            else:
                # Megabytes to copy: the event loop must not wait for that.
                outputs, sizes, merge_ns = await self.run_blocking(self._merge_and_infer, batch)
            ran_ns = time.perf_counter_ns()
            parts = split_batch(outputs, sizes) if ragged is None else ragged.split(outputs, batch, sizes)
        except EdgedError as exc:
            return [exc for _ in batch]
        except Exception as exc:  # the runtime's own error: fail this batch, not the daemon
            error = backend_failure(self.name, self.context.model_name, exc)
            return [error for _ in batch]
        results: list[ExecuteResult] = [
            InferResponse(select_outputs(part, request.requested_outputs))
            for part, request in zip(parts, batch, strict=True)
        ]
        self.phase_ns = (merge_ns, time.perf_counter_ns() - ran_ns)
        return results

    def _merge_and_infer(self, batch: Sequence[InferRequest]) -> tuple[dict[str, np.ndarray], list[int], int]:
        """On the instance thread: the outputs, each request's rows and the merge's nanoseconds."""
        started = time.perf_counter_ns()
        merged, sizes = merge_batch(batch) if self.ragged is None else self.ragged.merge(batch)
        merge_ns = time.perf_counter_ns() - started
        return self.infer(merged), sizes, merge_ns

    async def _execute_one(self, request: InferRequest) -> ExecuteResult:
        try:
            outputs = await self.run_blocking(self.infer, request.inputs)
        except EdgedError as exc:
            return exc
        except Exception as exc:
            return backend_failure(self.name, self.context.model_name, exc)
        return InferResponse(select_outputs(outputs, request.requested_outputs))


class ToolCallFrame(msgspec.Struct, forbid_unknown_fields=True):
    """Tool calls in the model's own syntax, as the output must write them (a grammar enforces it):
    `open`, then one or more JSON objects each matching `call_schema` (JSON schema text),
    separated by `separator`, then `close`; at most `max_calls` of them (None: no limit).
    Local `$ref`s resolve as JSON Schema says: against the nearest enclosing schema with an
    `$id`, else the root; a tool's parameters embedded in a call's schema carry an `$id`, so
    that their `#/$defs/...` mean their own definitions.

    E.g. Hermes / Qwen: open "<tool_call>\n", separator "\n</tool_call>\n<tool_call>\n",
    close "\n</tool_call>"; Mistral: "[TOOL_CALLS][", ", ", "]"; Nemotron Nano v2: "<TOOLCALL>[",
    ", ", "]</TOOLCALL>"; Llama 3.x: "", "", "".

    `named_calls` instead of `call_schema`: calls that are not JSON objects but a tool's name,
    then `args_marker` and its arguments object, as newer Mistral templates write them
    (`[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`; open and separator "[TOOL_CALLS]"; DeepSeek
    R1's section of calls, each closed by its own end, has open, separator and close around
    them, args_marker "\n```json\n"): tool
    name -> its arguments' JSON schema (text). With `id_marker`, the name is followed by it and
    a call id of 9 letters and digits before `args_marker` (Mistral Small 3.2's `[CALL_ID]`).
    `arguments_syntax` says how a named call writes its arguments: "json", a JSON object;
    "xml", one `<parameter=key>\nvalue\n</parameter>\n` per property (string values as raw
    text, others as JSON), the schema's required properties in any order, then optional ones
    (each at most once), as Qwen 3.5 and Qwen3-Coder write them (open "<tool_call>\n<function=",
    args_marker ">\n"); "gemma", Gemma 4's object syntax (`{key:<|"|>text<|"|>,n:3,o:{...},
    l:[...]}`: unquoted keys, strings between `<|"|>` marks, JSON numbers, booleans and null),
    held to that syntax but not to the tool's schema (as llama-server holds it; open
    "<|tool_call>call:", close "<tool_call|>"); "python", Python keyword arguments up to the
    call's closing parenthesis (`key=value, ...)`, each value JSON by its property's schema,
    required keys in any order, then optional ones), as LFM2 writes its calls (open
    "<|tool_call_start|>[", separator ", ", close "]<|tool_call_end|>", args_marker "(").
    "xml" with `xml_parameter` ('<param name="', '">', "</param>") and `xml_cdata`: MiniCPM5's
    `<param name="key">value</param>` (open '<function name="', args_marker '">', close
    "</function>"), a raw-text value either in `<![CDATA[...]]>` or holding no "<" (so that it
    cannot be taken for CDATA; the template wraps such values in CDATA too).

    `lazy` (tool_choice "auto"): the model may write free text instead, and the grammar holds
    only once the output reaches `open` (llama.cpp's lazy grammar); with an empty `open`, once
    the output's first character other than whitespace is "{". Free text before `open` is
    allowed; after `close` the output ends.
    """

    call_schema: str = ""
    open: str = ""
    separator: str = ""
    close: str = ""
    max_calls: int | None = None
    lazy: bool = False
    named_calls: dict[str, str] = {}
    args_marker: str = ""
    id_marker: str = ""
    arguments_syntax: Literal["json", "xml", "gemma", "python"] = "json"
    # "xml": a parameter is xml_parameter[0] + key + xml_parameter[1] + value + xml_parameter[2].
    xml_parameter: tuple[str, str, str] = ("<parameter=", ">\n", "\n</parameter>\n")
    xml_cdata: bool = False
    # Where a lazy frame's grammar starts: the output ends with this start of `open` ("": the
    # marker that begins `open`, up to its first ">" or "]"). gpt-oss: "<|channel|>commentary
    # to", since its reasoning opens with "<|channel|>" too.
    trigger: str = ""
    # The trigger also ends reasoning the output is in (Qwen 3.5 and Qwen3-Coder: llama-server
    # counts `<tool_call>` among the reasoning's closing tags): written there, it closes the
    # reasoning and starts the call (see GenerateParams.grammar_reasoning).
    ends_reasoning: bool = False


# The types of JSON schema (xml_value_types: a schema that says nothing admits them all).
JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
# JSON schema keywords whose values are JSON values, not schemas (no references in them),
# and those whose values map names (properties, definitions) to schemas: a walk over a
# schema's subschemas reads a key as a keyword only where it is not such a name.
SCHEMA_VALUE_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
SCHEMA_MAP_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def xml_value_types(schema: Any, root: Any, depth: int = 0) -> frozenset[str]:
    """The JSON types a property's schema admits (`root`: the tool's parameters schema, for
    local `$ref`s): how an XML tool call (ToolCallFrame.arguments_syntax "xml") writes the value. Where
    they include "string" the value is raw text (read as JSON first when other types are
    admitted too), else JSON text. Both the grammar and the reader of a frame go by this."""
    if not isinstance(schema, dict) or depth > 16:
        return JSON_TYPES
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target: Any = root
        for part in ref.removeprefix("#").strip("/").split("/") if ref.startswith("#") else [None]:
            target = target.get(part) if isinstance(target, dict) and part is not None else None
        return xml_value_types(target, root, depth + 1)
    kinds = schema.get("type")
    if isinstance(kinds, str):
        return frozenset({kinds})
    if isinstance(kinds, list):
        return frozenset(kind for kind in kinds if isinstance(kind, str))
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        return frozenset(json_type(value) for value in values)
    alternatives = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(alternatives, list):
        return frozenset().union(*(xml_value_types(a, root, depth + 1) for a in alternatives))
    return JSON_TYPES


def json_type(value: Any) -> str:
    """The JSON schema type of a decoded JSON value ("integer" for ints, not "number")."""
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return "object" if isinstance(value, dict) else "array"


# The samplers GenerateParams.samplers may list, by llama.cpp's canonical names (its
# common_sampler_type_to_str); in llama-server's default order but for the last: "infill",
# its fill-in-the-middle sampler, is only ever where a list puts it.
SAMPLERS = (
    "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature", "infill",
)
# llama-server's default order (common_params_sampling.samplers).
DEFAULT_SAMPLERS = SAMPLERS[:-1]


class GenerateParams(msgspec.Struct, forbid_unknown_fields=True):
    """Sampling and stopping for one generation request (OpenAI/Triton generate fields)."""

    # None: until the context of the sequence is full (OpenAI's and llama-server's default).
    # 0: nothing generated; a backend with a prompt cache still evaluates the prompt into it
    # (llama-server's n_predict 0), and the last chunk reports the prompt's token count.
    max_tokens: int | None = None
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    # Locally typical sampling (llama.cpp's typ_p, Ollama's and llama-server's typical_p):
    # keep the tokens whose surprise is closest to the distribution's entropy, up to this
    # probability mass. 1.0: off.
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    # OpenAI's penalties, in [-2, 2]: subtract `presence` once and `frequency` per occurrence
    # from the logit of every token already in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # One window of recent tokens for all three penalties, as llama.cpp's `penalty_last_n`
    # and Ollama's `repeat_last_n`: -1 = the whole context, 0 = no penalties. None: the
    # repeat penalty over the last 64 tokens and OpenAI's two over the whole context.
    penalty_last_n: int | None = None
    # Token id -> value added to its logit (OpenAI's logit_bias, in [-100, 100]; -inf bans
    # the token, llama-server's `false`).
    logit_bias: dict[int, float] = {}
    # A GBNF grammar (root rule "root") the output must match; "" = free text.
    grammar: str = ""
    # A JSON schema (JSON text) the output must match, e.g. '{"type": "object"}' for any JSON
    # object; the backend turns it into a grammar. Not together with `grammar`. Beside a
    # `tool_calls` frame that is not lazy: the output is either that frame (the calls) or a
    # JSON value matching this schema (the answer), as OpenAI's tool_choice "auto" with a
    # response format lets the model call tools or answer in the format.
    json_schema: str = ""
    # Tool calls in the model's own syntax (see ToolCallFrame). Not together with `grammar`;
    # with `json_schema` only when not lazy (see there).
    tool_calls: ToolCallFrame | None = None
    # Where the output may first reason freely (a thinking model whose prompt opened its
    # reasoning): the grammar of `grammar`, `json_schema` or a non-lazy `tool_calls` holds
    # only after the output's first occurrence of this text (e.g. "</think>") and the
    # whitespace after it, and the output does not end before. "": from the first token.
    # With a lazy `tool_calls` frame: the prompt opened the reasoning whose tags
    # `grammar_reasoning` names (this is its closing tag).
    grammar_after: str = ""
    # Reasoning the output may write first (a thinking model that opens its reasoning itself,
    # as Qwen 3 and Gemma 4 do): its (opening, closing) tags. The output either opens with the
    # opening tag, reasons freely up to the closing one and the whitespace after it, and then
    # the grammar of `grammar`, `json_schema` or a non-lazy `tool_calls` holds, or that grammar
    # holds from the first token. ("", ""): no such reasoning. Not with `grammar_after`, but
    # for a lazy `tool_calls` frame: its grammar then sees only the output outside the
    # reasoning (a call marker the model writes while it reasons starts no call), as
    # llama-server's lazy grammars do; with `grammar_after`, the output starts inside it.
    grammar_reasoning: tuple[str, str] = ("", "")
    # llama-server's reasoning budget: the output spends at most this many tokens inside its
    # reasoning (between `reasoning_tags`, the opening tag's own token not counted; a later
    # reasoning block gets the budget again), then writes `reasoning_end` (a message and the
    # closing tag) there, token by token, and goes on. `reasoning_opened`: the prompt opened
    # the reasoning, so the output starts inside it. None: no budget.
    reasoning_budget: int | None = None
    reasoning_end: str = ""
    reasoning_tags: tuple[str, str] = ("", "")
    reasoning_opened: bool = False
    # A name the caller gives this generation (a chat completion's id) so that
    # GenerationBackend.control can reach it while it runs; "" none.
    control_id: str = ""
    # llama-server's `reasoning_control`: GenerationBackend.control may end this generation's
    # reasoning (with `reasoning_budget` set, the largest budget when none was asked for).
    reasoning_control: bool = False
    # Text the output writes right before what `json_schema` holds it to, part of the grammar:
    # gpt-oss's final-channel header, `<|channel|>final<|message|>`. Only with `json_schema`
    # (beside a `tool_calls` frame: before the answer, not before the calls).
    answer_header: str = ""
    seed: int | None = None
    stop: list[str] = []
    # Fill-in-the-middle: the text after the insertion point (the prompt is the text
    # before it); the backend builds the model's FIM prompt. None: plain completion.
    suffix: str | None = None
    # None: no log probabilities; n >= 0: each generated token's log probability under the
    # model (softmax of its logits, before any sampling step) and the n most likely tokens.
    logprobs: int | None = None
    # With `logprobs`: the probabilities after the sampler chain instead (llama-server's
    # post_sampling_probs): the candidates the token was drawn from, their probabilities as
    # the draw saw them, the n most likely with a probability above 0; `TokenLogprob.logprob`
    # is the natural log of that probability. A chain that keeps only the best token (greedy)
    # gives it probability 1.
    post_sampling_probs: bool = False
    # The same for the prompt's tokens (OpenAI's completions with echo and logprobs, how
    # lm-eval-harness scores text): each token's log probability given the tokens before it.
    # The prompt is evaluated whole (a cached prefix keeps no logits); max_tokens 0 is allowed.
    prompt_logprobs: int | None = None
    # llama-server's other samplers, with its meanings and defaults (each off by default).
    # Mirostat 1 or 2 (0: off): the temperature, then Mirostat's own truncation and draw in
    # place of the samplers below and top-k, typical, top-p and min-p; it aims at a surprise
    # of `mirostat_tau` per token, learning at rate `mirostat_eta`.
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # Dynamic temperature: between temperature - range (at least 0) and temperature + range,
    # by the candidates' normalised entropy to this exponent (range 0: off).
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    # Keep only the tokens whose logit is within this many standard deviations of the best
    # one (<= 0: off).
    top_n_sigma: float = -1.0
    # XTC: at each token, with this probability, drop every token more likely than the
    # threshold but the least likely of them (threshold above 0.5: off).
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    # DRY: a token that would extend a repetition of the last `dry_penalty_last_n` tokens
    # (prompt included) beyond `dry_allowed_length` loses multiplier * base ** (length -
    # allowed length) from its logit; the breakers' texts end a repetition (multiplier 0: off).
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: list[str] = msgspec.field(default_factory=lambda: ["\n", ":", '"', "*"])
    # The fewest candidates typical, top-p, min-p and XTC leave (0 and 1 alike: one).
    min_keep: int = 0
    # The samplers after the logit biases, in order (llama-server's `samplers`, by SAMPLERS'
    # names): each runs where it stands, as often as it is listed, and is skipped where its
    # fields turn it off; one not listed does not run, whatever its fields say. "penalties"
    # stands for repeat_penalty, presence_penalty and frequency_penalty together; "infill" is
    # llama.cpp's fill-in-the-middle sampler (it may end the output on its own, so not with a
    # grammar, json_schema, tool_calls or ignore_eos: InvalidArgument). A grammar masks the
    # tokens it does not allow before the first listed sampler other than penalties and DRY
    # (which shift logits: the same either way). A draw from what is left ends the chain, so
    # () draws from the model's own distribution, biased. Temperature 0 (or `greedy`) is where
    # "temperature" stands: it keeps the best token left there; not listed, it changes nothing.
    # With Mirostat the list changes nothing (llama-server ignores it then too): the chain is
    # the one without it. DEFAULT_SAMPLERS: what every route sends without the field.
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    # The most likely token at each step, after the biases, penalties and DRY (temperature
    # <= 0 means the same): unless XTC, typical-p or a dynamic temperature is on, which act
    # at temperature 0 too, as in llama-server. With another `samplers` order: temperature 0
    # where "temperature" stands.
    greedy: bool = False
    # Never sample an end-of-generation token (llama-server's `ignore_eos`): the output runs to
    # max_tokens, a stop string or the end of the context, as benchmarks ask for. Not with
    # a grammar, `json_schema` or `tool_calls` (InvalidArgument): a complete grammar allows
    # only end-of-generation.
    ignore_eos: bool = False
    # Start from the longest prefix of the prompt the slot's KV cache already holds (llama-
    # server's `cache_prompt`, on by default there too). False: the whole prompt is evaluated.
    cache_prompt: bool = True
    # llama-server's `n_cache_reuse` (with cache_prompt): after the cached prefix, a run of at
    # least this many of the slot's cached tokens that the prompt has next is moved to its
    # place in the prompt instead of being decoded again (0: off; None: the backend's default,
    # the llama.cpp backend's `cache_reuse` parameter). Only where the backend can move cells.
    n_cache_reuse: int | None = None
    # The request's llama-server `lora` ((adapter id, scale), by id), which llama-server's
    # generation_settings and /slots echo. () : the model's current scales
    # (GenerationBackend.lora_adapters); else an adapter left out gets scale 0, as
    # llama-server reads the list.
    lora: tuple[tuple[int, float], ...] = ()
    # llama-server's FIM helpers, checked per token as its process_token does (0 and None: off).
    # `n_indent`: once the output has a new line, a line that gets a character other than a
    # space or tab after fewer than this many of them ends the output (finish_reason "length",
    # finish_detail "indent"); the whole answer leaves that line out after its indentation
    # (GenerateChunk.cut), though the chunks sent it. As llama-server's, the check looks at one
    # new line per token and starts a token after the first newline.
    n_indent: int = 0
    # `t_max_predict_ms`: a token whose text has a newline, sampled more than this many ms
    # after the first token, ends the output (finish_reason "length", finish_detail "time").
    t_max_predict_ms: int | None = None
    # Before the first token, a chunk (no text, GenerateChunk.prompt_progress set) when the
    # sequence takes its slot and after each decode of its prompt (llama-server's
    # return_progress).
    return_progress: bool = False
    # llama-server's `id_slot`: the slot to generate in, waiting while it is busy (requests
    # behind it that can use another slot go first); -1: any (the idle slot sharing the
    # longest prefix with the prompt, else the least recently used).
    id_slot: int = -1
    # llama-server's context shift, for a backend that has it on (else InvalidArgument when
    # set): the first `n_keep` tokens stay when a generation fills its context (-1: the
    # prompt), and `n_discard` after them go (0: half of the rest).
    n_keep: int = 0
    n_discard: int = 0
    # False: the model's own (llama-server's) shift does not apply to this sequence (Ollama's
    # routes, which shift as Ollama does: shift_window).
    context_shift: bool = True
    # Ollama's context shift (its routes' `shift`), apart from the model's own: when the
    # sequence holds `shift_window` tokens (its num_ctx; at most the slot's), the first
    # `n_keep` stay (-1: the prompt; at most shift_window - 1) and as many after them go as
    # leave half of the rest of the window free, at least one (Ollama's runner's
    # InputCache.ShiftDiscard). 0: off. Only for a backend whose engine_stats() says
    # `can_shift` 1 (else InvalidArgument).
    shift_window: int = 0


class TokenLogprob(msgspec.Struct):
    """A token's log probability; `top` holds the most likely alternatives at that step."""

    token_id: int
    # The token's bytes (a token can be part of a UTF-8 character).
    piece: bytes
    logprob: float
    top: list[TokenLogprob] = []


class GenerateChunk(msgspec.Struct):
    """A piece of generated text. The last chunk of a sequence has `finish_reason` set."""

    text: str
    token_ids: list[int] = []
    finish_reason: Literal["stop", "length", "cancelled", None] = None
    # The prompt's tokens: on the last chunk, and a backend may set it on every chunk.
    prompt_tokens: int = 0
    completion_tokens: int = 0  # on the last chunk
    # Of `prompt_tokens`, how many were already in the KV cache (not evaluated again); with it.
    cached_tokens: int = 0
    # On the last chunk: of the sequence's tokens whose cells a slot keeps afterwards (the
    # prompt and every generated token but the last), those a context shift dropped or moved
    # (GenerateParams.n_keep): the slot keeps only the cells before them.
    discarded_tokens: int = 0
    # One per token of `token_ids` when GenerateParams.logprobs is set.
    logprobs: list[TokenLogprob] = []
    # On a sequence's first chunk, with GenerateParams.prompt_logprobs: one per token of the
    # prompt as the caller gave it (a BOS the backend's tokenizer put before a text prompt is
    # left out), each scored given every token before it. The first entry's score is not
    # meaningful when nothing preceded it (logprob 0.0, no alternatives): OpenAI reports the
    # first entry as null whatever it is, and so do the routes.
    prompt_logprobs: list[TokenLogprob] = []
    # On the last chunk with finish_reason "stop": the stop string (of GenerateParams.stop)
    # that ended the sequence; "" when an end-of-generation token did (llama-server's
    # stop_type "word" and "eos").
    stop_word: str = ""
    # On the last chunk with finish_reason "length", what ended it besides max_tokens and the
    # context: "indent" (GenerateParams.n_indent) or "time" (t_max_predict_ms); "" otherwise.
    finish_detail: Literal["", "indent", "time"] = ""
    # On the last chunk: how many characters at the end of the output (the chunks' texts
    # joined) a whole answer leaves out: the line n_indent stopped at, after its indentation.
    cut: int = 0
    # A progress chunk (GenerateParams.return_progress; no text, no tokens): the prompt's
    # tokens (total), of them found in the cache, of them in the cache now (cache included),
    # and ms since the sequence took its slot, as llama-server's prompt_progress.
    prompt_progress: tuple[int, int, int, int] | None = None
    # The slot (of GenerationBackend.slots) the sequence runs in, on every chunk once it has
    # one; -1 where the backend has no slots or the chunk came before one was taken.
    slot: int = -1


class InfillInput(msgspec.Struct, frozen=True):
    """llama-server's /infill: the text before and after the insertion point, other files of
    the project as (filename, text), and text the completion starts with (after the prefix)."""

    prefix: str
    suffix: str
    extra: tuple[tuple[str, str], ...] = ()
    prompt: str = ""


class GenerationProps(msgspec.Struct, frozen=True):
    """What a generation backend says about its loaded model (llama-server's GET /props)."""

    n_ctx: int  # tokens one sequence (slot) holds
    total_slots: int  # sequences generated at once
    # The chat template's text the chat routes render with, where it is one (Jinja) text;
    # None when they render otherwise (a built-in template chosen by name, a fallback).
    chat_template: str | None = None
    bos_token: str = ""  # the BOS token's text, "" when the vocabulary has none
    eos_token: str = ""
    ftype: str | None = None  # the weights' type as llama.cpp names it ("Q8_0"), when the file says
    vision: bool = False  # takes images in a chat message
    audio: bool = False
    video: bool = False
    build_info: str = ""  # the runtime that runs the model, with its version
    # llama-server's `meta` of a /v1/models entry, where the runtime says (0: unknown): the
    # vocabulary's type (llama.cpp's enum) and size, the context it was trained with, the
    # embedding width, the parameters and the weights' bytes.
    vocab_type: int = 0
    n_vocab: int = 0
    n_ctx_train: int = 0
    n_embd: int = 0
    n_params: int = 0
    size: int = 0


class LoraAdapter(msgspec.Struct, frozen=True):
    """A LoRA adapter a generation model is loaded with (an entry of llama-server's GET
    /lora-adapters; its id is its index in GenerationBackend.lora_adapters)."""

    path: str  # as the model's configuration names it
    scale: float
    # The adapter GGUF's adapter.lora.task_name and adapter.lora.prompt_prefix ("" if none).
    task_name: str = ""
    prompt_prefix: str = ""


class SlotTask(msgspec.Struct, frozen=True):
    """The request a slot is generating for (see SlotState)."""

    id: int  # the request's number among those this instance has started
    params: GenerateParams
    n_prompt_tokens: int
    n_prompt_tokens_cache: int  # of those, found in the slot's cache
    n_prompt_tokens_processed: int  # of those, decoded so far
    n_decoded: int  # tokens generated so far


class SlotState(msgspec.Struct, frozen=True):
    """One slot of the engine (llama-server's GET /slots): `task` is None while it is idle."""

    id: int
    n_ctx: int
    task: SlotTask | None = None
    speculative: bool = False  # drafts tokens with a second model


SlotAction = Literal["save", "restore", "erase"]


class SlotFile(msgspec.Struct, frozen=True):
    """What a slot action did (llama-server's POST /slots/{id}): the tokens whose cells were
    saved, restored or erased, and the bytes written or read (0 for erase), in `ms`."""

    n_tokens: int
    n_bytes: int = 0
    ms: float = 0.0


class GenerationBackend(Backend):
    """A backend that generates text with its own continuous-batching engine loop."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        kind="generation", dynamic_batching=False, decoupled=True, datatypes=frozenset({"BYTES"})
    )

    def generate(self, prompt: str | list[int], params: GenerateParams) -> AsyncGenerator[GenerateChunk, None]:
        """Stream chunks for one request. Closing the iterator early cancels the sequence.

        Raises Unavailable when the engine's queue is full, InvalidArgument when the prompt
        does not fit the context.
        """
        raise Unsupported(f"backend {self.name!r} does not generate text")

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render OpenAI-style messages with the model's chat template. `template_kwargs`: more
        variables for a Jinja template (llama-server's `chat_template_kwargs`, e.g.
        `enable_thinking`); a template that cannot take them is an InvalidArgument.

        A message is role + content (+ `name`). Where `tool_syntax()` names a syntax, the
        template also takes `tools` (OpenAI function tools: {type, function: {name,
        description, parameters}}), assistant messages with OpenAI `tool_calls` (arguments
        as JSON text; content may be None) and `tool` messages (content, `tool_call_id`).
        They reach the template as llama-server hands them to it (other keys dropped; the
        arguments as an object for templates that read them as one)."""
        raise Unsupported(f"backend {self.name!r} has no chat template")

    async def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """The model's token ids for `text` (llama-server's /tokenize). `add_special`: with the
        tokens the tokenizer puts around a whole prompt (BOS for most models); `parse_special`:
        the text of a control or user-defined token (`<|im_start|>`) is that token, otherwise
        it is tokenized as plain text. Runs off the event loop."""
        raise Unsupported(f"backend {self.name!r} does not tokenize text")

    async def infill_tokens(self, infill: InfillInput) -> list[int]:
        """The prompt llama-server's /infill builds from `infill` with the model's
        fill-in-the-middle tokens (its repository-level layout where the model has those
        tokens), as token ids to generate from. InvalidArgument when the model has no FIM
        tokens. Runs off the event loop."""
        raise Unsupported(f"backend {self.name!r} does not build fill-in-the-middle prompts")

    async def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's bytes as the model writes them, a control token's text included (as
        llama-server's /tokenize pieces and /detokenize show them; their concatenation is the
        detokenized text). A byte-fallback token's piece is one byte, possibly part of a UTF-8
        character. An id outside the vocabulary is an InvalidArgument. Runs off the event loop."""
        raise Unsupported(f"backend {self.name!r} does not detokenize tokens")

    def thinking_tags(self) -> tuple[str, str]:
        """The tags the model writes its reasoning between, such as ("<think>", "</think>")
        (Qwen 3, QwQ, DeepSeek R1 and their distills), so the routes can return it apart from
        the answer (llama-server's `reasoning_content`, Ollama's `thinking`); ("", "") when the
        model does not reason in tags. A chat prompt that ends with the opening tag has
        opened the reasoning for the model (DeepSeek R1's templates do)."""
        return ("", "")

    def tool_syntax(self) -> str:
        """The syntax the model's chat template writes tool calls in, so the routes can ask for
        and parse them: "hermes" (`<tool_call>{"name", "arguments"}</tool_call>`, Qwen and
        Hermes templates), "mistral" (`[TOOL_CALLS][{"name", "arguments", "id"}]`, Mistral
        Nemo), "mistral_args" (`[TOOL_CALLS]name[ARGS]{...}` per call, newer Mistral
        templates), "mistral_call_id" (the same with `[CALL_ID]id` after the name), "llama3"
        (`{"name", "parameters"}`), "qwen3_coder" (`<tool_call>\n<function=name>\n` and
        `<parameter=key>\nvalue\n</parameter>\n` per argument, Qwen 3.5 and Qwen3-Coder),
        "gemma4" (`<|tool_call>call:name{key:<|"|>text<|"|>}<tool_call|>`, Gemma 4), "minicpm5"
        (`<function name="name"><param name="key">value</param></function>`, MiniCPM5); "" when the template has none of these (the routes then
        describe the tools in a system message and ask for a generic JSON reply)."""
        return ""

    async def embed(
        self, texts: Sequence[str | list[int]], *, truncate: bool = False
    ) -> tuple[list[list[float]], int]:
        """Embeddings for each input and the number of prompt tokens used. An input is a text,
        or token ids of the model's vocabulary (OpenAI's token-id input), embedded exactly as
        given: no BOS/EOS added, as llama-server does; an id outside the vocabulary or an empty
        list is an InvalidArgument (so is token input to a backend that embeds text only).
        `truncate`: an input longer than the model embeds at once keeps its first tokens
        (Ollama's `truncate`, its default); otherwise such an input is an InvalidArgument."""
        raise Unsupported(f"backend {self.name!r} does not compute embeddings")

    async def rerank(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
        """A reranker's relevance score of each document for `query` (in the documents' order;
        higher is more relevant) and the number of prompt tokens used, all pairs together.
        llama.cpp: a GGUF whose pooling is rank, loaded with embedding=true; each pair is one
        sequence, built as llama-server's /rerank builds it, and its score is the first output
        of the model's classifier head. A pair longer than the model scores at once, or a
        model that is no reranker, is an InvalidArgument."""
        raise Unsupported(f"backend {self.name!r} does not rerank documents")

    def reranker(self) -> bool:
        """True for a model that `rerank` serves (and `embed` does not)."""
        return False

    def lora_adapters(self) -> list[LoraAdapter]:
        """The LoRA adapters the model is loaded with, in id order, each at the scale a
        request that names none gets (llama-server's GET /lora-adapters); none when the
        model has none."""
        return []

    def set_lora_scales(self, scales: tuple[float, ...]) -> None:
        """The scales, one per adapter in id order, that later requests naming none get
        (llama-server's POST /lora-adapters); running generations keep theirs. Until the
        model reloads, which reads its configuration's again."""
        raise Unsupported(f"backend {self.name!r} has no LoRA adapters")

    def unpooled(self) -> bool:
        """True for an embedding model that names no pooling (llama.cpp's pooling none), so
        that llama-server's native /embedding would answer one vector per token: `embed`
        averages them instead, and that route refuses what it cannot answer as llama-server."""
        return False

    async def props(self) -> GenerationProps:
        """Facts about the loaded model for llama-server's GET /props. Runs off the event loop
        where it must wait for the runtime; an InvalidArgument for a model that does not
        generate (an embedding model)."""
        raise Unsupported(f"backend {self.name!r} does not describe its model")

    def slots(self) -> list[SlotState]:
        """Each slot's state now (llama-server's GET /slots); a snapshot read without waiting
        for the engine, so counts may be a step apart. InvalidArgument as for `props`."""
        raise Unsupported(f"backend {self.name!r} does not report its slots")

    async def slot_action(self, action: SlotAction, slot: int, filename: str = "") -> SlotFile:
        """llama-server's POST /slots/{id}?action=: `save` writes an idle slot's cached tokens
        and their KV cells to `filename` in the model's slot directory, `restore` replaces
        what the slot holds with such a file's, `erase` drops what it holds. Waits while the
        slot is generating. `filename` is a plain file name (no directory). InvalidArgument:
        no such slot, or a file that does not restore here; Unsupported: save or restore on
        a model without a slot directory."""
        raise Unsupported(f"backend {self.name!r} has no slots to save or restore")

    def control(self, control_id: str, action: str) -> str:
        """llama-server's /v1/chat/completions/control, on the running (or waiting) generations
        whose GenerateParams named `control_id`: "reasoning_end" ends their reasoning now, as a
        reasoning budget that runs out does (its message and closing tag are written next;
        nothing happens outside the reasoning). Only for generations whose GenerateParams set
        `reasoning_control` (and a `reasoning_budget`, the largest included: that arms it).
        Returns "" when done, else why not, in llama-server's words ("no active completion
        for this id", ...)."""
        raise Unsupported(f"backend {self.name!r} has no generations to control")

    def engine_stats(self) -> dict[str, int | float | str]:
        """Engine counters and facts for model metadata (slots, busy, queued, chat template...).

        `slots` + `max_queue`, where given, is how many generations the engine takes at once
        (running and waiting): a request for more choices (OpenAI's `n`) is a 400."""
        return {}


# --------------------------------------------------------------------------- helpers


# Work over this many bytes (a batch's inputs to merge, a body to decode, outputs to encode or
# to read back element by element) runs on a thread rather than on the event loop: parsing
# megabytes of JSON or a million BYTES elements takes 0.1-1 s, which every other client would
# wait for; below it, the hop to a thread costs more than the work (a small request's whole
# decode is ~20 us) and Python on two threads contends for the GIL. An object array's size
# counts its pointers (8 bytes per BYTES element).
OFF_LOOP_BYTES = 256 * 1024


def backend_failure(backend: str, model: str, exc: BaseException) -> EdgedError:
    return BackendError(f"backend {backend!r} failed to execute model {model!r}: {exc}")


def merge_batch(batch: Sequence[InferRequest]) -> tuple[dict[str, np.ndarray], list[int]]:
    """Concatenate every input along dim 0; return the arrays and each request's row count."""
    sizes = [request.batch_size() for request in batch]
    names = batch[0].inputs.keys()
    merged = {name: np.concatenate([request.inputs[name] for request in batch]) for name in names}
    return merged, sizes


def split_batch(outputs: dict[str, np.ndarray], sizes: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Inverse of merge_batch: slice each output back into per-request parts (views).

    An output without a row per merged row would hand requests each other's rows, or none:
    a BackendError naming it."""
    if len(sizes) > 1:
        rows = sum(sizes)
        for name, array in outputs.items():
            if array.ndim == 0 or array.shape[0] != rows:
                raise BackendError(
                    f"output {name!r} has shape {list(array.shape)}, but the batch it answers has {rows} rows: "
                    "a batched model must return one row per input row"
                )
    parts = []
    start = 0
    # Python ints, not np.cumsum: slicing with numpy integers is several times slower.
    for size in sizes:
        end = start + size
        parts.append({name: array[start:end] for name, array in outputs.items()})
        start = end
    return parts


@dataclass(frozen=True, slots=True)
class RaggedPlan:
    """Triton's ragged batching for a backend that merges requests (`ragged_batching:
    "merged"`), as its ONNX Runtime backend does it: a ragged input of the batch is every
    request's elements end to end, in one dimension; each `batch_input` target gets a tensor
    describing the batch (counts of a source input's elements, their running sums, item
    shapes); each `batch_output` target is cut, end to end, into one tensor per request shaped
    like that request's source input where the config's dims are -1. Other inputs merge and
    other outputs split along dim 0 as without it."""

    ragged: frozenset[str]
    batch_inputs: tuple[BatchInput, ...]
    # Output name -> (source input, dims with the batch dimension; -1 = the source's).
    scatter: Mapping[str, tuple[str, tuple[int, ...]]]

    @classmethod
    def of(cls, config: ModelConfig) -> RaggedPlan | None:
        ragged = frozenset(config.ragged_inputs())
        if not ragged and not config.batch_input and not config.batch_output:
            return None
        scatter = {}
        for batch_output in config.batch_output:
            output = config.output_by_name(batch_output.target_name[0]) if batch_output.target_name else None
            if output is not None:
                dims = output.reshape if output.reshape is not None else output.dims
                scatter[output.name] = (batch_output.source_input[0], (-1, *dims))
        return cls(ragged, tuple(config.batch_input), scatter)

    def merge(self, batch: Sequence[InferRequest]) -> tuple[dict[str, np.ndarray], list[int]]:
        """The runtime's inputs for `batch` and each request's rows."""
        sizes = [request.batch_size() for request in batch]
        merged = {}
        for name in batch[0].inputs:
            if name in self.ragged:
                merged[name] = np.concatenate([request.inputs[name].reshape(-1) for request in batch])
            else:
                merged[name] = np.concatenate([request.inputs[name] for request in batch])
        for batch_input in self.batch_inputs:
            value = _batch_input_value(batch_input, [request.inputs[batch_input.source_input[0]] for request in batch])
            for target in batch_input.target_name:
                merged[target] = value
        return merged, sizes

    def split(
        self, outputs: dict[str, np.ndarray], batch: Sequence[InferRequest], sizes: Sequence[int]
    ) -> list[dict[str, np.ndarray]]:
        """Each request's outputs (views): scattered ones by their source's shapes, the rest by rows."""
        parts = split_batch({n: a for n, a in outputs.items() if n not in self.scatter}, sizes)
        for name, (source, dims) in self.scatter.items():
            output = outputs.get(name)
            if output is None:
                continue
            flat = output.reshape(-1)
            offset = 0
            for part, request in zip(parts, batch, strict=True):
                shape = request.inputs[source].shape
                wanted = tuple(shape[i] if d == -1 else d for i, d in enumerate(dims))
                count = int(np.prod(wanted))
                if offset + count > flat.size:
                    raise BackendError(
                        f"batch output {name!r} has {flat.size} elements, fewer than the batch's shapes of "
                        f"input {source!r} need"
                    )
                part[name] = flat[offset:offset + count].reshape(wanted)
                offset += count
        return parts


def _batch_input_value(batch_input: BatchInput, sources: list[np.ndarray]) -> np.ndarray:
    """One batch input's tensor, from the source input of each request of the batch (the
    values and shapes of Triton's backend input collector)."""
    dtype = np.int32 if batch_input.data_type == "INT32" else np.float32
    counts = [source.size for source in sources]
    kind = batch_input.kind
    if kind == "BATCH_ELEMENT_COUNT":
        return np.array(counts, dtype=dtype)
    if kind == "BATCH_ACCUMULATED_ELEMENT_COUNT":
        return np.cumsum(counts).astype(dtype)
    if kind == "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO":
        return np.concatenate([[0], np.cumsum(counts)]).astype(dtype)
    if kind == "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE":
        # Only its shape means anything; Triton leaves the data uninitialized, zeros here.
        return np.zeros(max(counts), dtype=dtype)
    # BATCH_ITEM_SHAPE[_FLATTEN]: each row's shape without the batch dimension.
    rank = sources[0].ndim - 1
    shapes = [source.shape[1:] for source in sources for _ in range(source.shape[0])]
    items = np.array(shapes, dtype=dtype).reshape(len(shapes), rank)
    return items if kind == "BATCH_ITEM_SHAPE" else items.reshape(-1)


def select_outputs(outputs: dict[str, np.ndarray], requested: tuple[str, ...]) -> dict[str, np.ndarray]:
    if not requested:
        return outputs
    return {name: outputs[name] for name in requested if name in outputs}


def config_from_triton_json(text: str, *, source: str) -> tuple[ModelConfig, list[str]]:
    """A config in Triton's JSON layout (what a Python model's `auto_complete_config` returns)
    validated exactly like a written config.pbtxt; returns the config and parser warnings."""
    from daemon.core.triton_config import PbtxtParser

    return PbtxtParser().parse_json(text, source=source)
