"""In-process stand-in for Triton's `triton_python_backend_utils` (imported as `pb_utils`).

A Triton Python model does `import triton_python_backend_utils as pb_utils`; the python backend
registers this module under that name before it imports the model, so existing models run
unchanged. Tensors wrap numpy arrays without copying: the request's arrays are handed to the
model as they are, and the model's outputs are returned as they are (no shared-memory hop to a
separate stub process as in Triton; that hop is cheap for small tensors, but an 11 MB input is
copied into it).

Decoupled models send through `request.get_response_sender()`; BLS calls
(`InferenceRequest(...).exec()` / `async_exec()`) reach the daemon's other models through the
hooks the python backend installs for the thread running `execute`.

DLPack works for CPU tensors (numpy's own support). Custom metrics (`MetricFamily`) go to the
daemon's /metrics through the hook the python backend installs likewise, and the model
loading API (`load_model`, `unload_model`, `is_model_ready`) to the repository's control.
Request rescheduling (`request.set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)`) is
read by the python backend once `execute` returns. Not provided: GPU tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import json
import logging
import struct
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger("edged.python_model")

# Request flags, as in Triton (the sequence batcher sets them).
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2

# Triton's `TYPE_*` config names -> numpy. TYPE_STRING is numpy object (Python bytes).
_NUMPY_TYPES: dict[str, type[Any]] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
    # No numpy bfloat16: the bits travel as uint16, as everywhere in the daemon.
    "TYPE_BF16": np.uint16,
}


TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
# `request.set_release_flags`: ALL is what every request does; RESCHEDULE runs it again in a
# later batch (only for a model with `sequence_batching { iterative_sequence: true }`).
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
# Memory types, for `PreferredMemory` (the python backend's own values, not the server API's).
TRITONSERVER_MEMORY_GPU = 0
TRITONSERVER_MEMORY_CPU = 1

# Triton's `TYPE_*` names -> numpy, as Triton's module spells the table (TYPE_BOOL is `bool`).
TRITON_STRING_TO_NUMPY: dict[str, type[Any]] = {
    **{name: numpy_type for name, numpy_type in _NUMPY_TYPES.items() if name != "TYPE_BF16"},
    "TYPE_BOOL": bool,
}
# TRITONSERVER_DataType codes (what `numpy_to_triton_type` returns, as in Triton) -> numpy.
_CODES: dict[int, type[Any]] = {
    1: np.bool_, 2: np.uint8, 3: np.uint16, 4: np.uint32, 5: np.uint64, 6: np.int8, 7: np.int16,
    8: np.int32, 9: np.int64, 10: np.float16, 11: np.float32, 12: np.float64, 13: np.object_,
}
_CODE_OF_DTYPE: dict[np.dtype[Any], int] = {np.dtype(numpy_type): code for code, numpy_type in _CODES.items()}

# The BLS executor of the model instance whose `execute` runs in this context. Set by the python
# backend around each call on the instance thread (a ContextVar so the event loop an `async def
# execute` runs on sees it too); threads a model starts itself have none.
BLS_EXECUTOR: contextvars.ContextVar[Callable[[InferenceRequest, bool], Any] | None] = (
    contextvars.ContextVar("edged_bls_executor", default=None)
)


class TritonModelException(Exception):
    """What Triton raises for a failed call; a model may raise it from execute too."""

    def message(self) -> str:
        return str(self)


class TritonError:
    """An error attached to one response: only that request fails."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


# numpy kinds a Tensor may hold: bool, ints, floats (up to 64 bits), bytes objects, bytes, str.
_TENSOR_KINDS = frozenset("biufOSU")


class Tensor:
    """A named numpy array."""

    def __init__(self, name: str, array: Any) -> None:
        if not isinstance(name, str):
            raise TritonModelException(f"tensor name must be a str, got {type(name).__name__}")
        if array is None:
            raise TypeError(f"tensor {name!r}: the data must be a numpy array, got None")
        array = array if isinstance(array, np.ndarray) else np.asarray(array)
        # As Triton's: a dtype no Triton datatype has is refused here, where the model made it
        # (str arrays are edged's extension: sent as UTF-8 BYTES).
        if array.dtype.kind not in _TENSOR_KINDS or (array.dtype.kind == "f" and array.dtype.itemsize > 8):
            raise TritonModelException(f"NumPy dtype is not supported: {array.dtype} (tensor {name!r})")
        self._name = name
        # Triton's tensors are C-ordered (it copies them into shared memory); a view with other
        # strides is copied once here, an ordinary array is not.
        self._array = array if array.flags.c_contiguous else array.copy(order="C")

    @classmethod
    def _trusted(cls, name: str, array: np.ndarray) -> Tensor:
        """A tensor over an array the daemon decoded (a request's input, a BLS answer's
        output): already of a Triton datatype and C-ordered, so not checked again per request."""
        tensor = cls.__new__(cls)
        tensor._name = name
        tensor._array = array
        return tensor

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the array (no copy), e.g. for `torch.utils.dlpack.from_dlpack`.
        BYTES tensors have no DLPack form, as in Triton."""
        try:
            return self._array.__dlpack__()
        except (BufferError, TypeError) as exc:
            raise TritonModelException(f"tensor {self._name!r} cannot be shared through DLPack: {exc}") from exc

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor over a CPU DLPack capsule, or any object with `__dlpack__` (no copy)."""
        source = capsule if hasattr(capsule, "__dlpack__") else _Capsule(capsule)
        try:
            array = np.from_dlpack(source)
        except (BufferError, TypeError, ValueError, RuntimeError) as exc:
            raise TritonModelException(f"tensor {name!r}: not a CPU DLPack tensor: {exc}") from exc
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self.shape()}, dtype={self._array.dtype})"


class _Capsule:
    """A bare DLPack capsule (`torch.utils.dlpack.to_dlpack(...)`) as numpy reads one."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: numpy reads host memory only, and says so if it is not


class InferenceTrace:
    """What `request.trace()` returns. Triton's carries an OpenTelemetry context, which edged,
    tracing in Triton's own mode only, never has: `get_context()` is None, as Triton's is
    without one. BLS requests carry it inertly."""

    def get_context(self) -> str | None:
        return None


class InferenceRequest:
    """One request of the batch handed to `execute`, or a BLS request a model builds."""

    def __init__(
        self,
        inputs: Sequence[Tensor] = (),
        request_id: str = "",
        requested_output_names: Sequence[str] = (),
        parameters: str | dict[str, Any] = "{}",
        model_name: str | bytes = "",
        model_version: int = -1,
        correlation_id: int | str = 0,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: InferenceTrace | None = None,
    ) -> None:
        # preferred_memory is a preference: the outputs are in host memory here (is_cpu()).
        self._inputs = list(inputs)
        self._request_id = request_id
        self._requested = list(requested_output_names)
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters)
        # A BYTES input element is `bytes`: models pass one as a model name (Triton's bls_simple).
        self._model_name = model_name.decode() if isinstance(model_name, bytes) else model_name
        self._model_version = int(model_version)
        self._correlation_id = correlation_id
        self._flags = flags
        self._timeout = int(timeout)
        # Set by the python backend on requests it hands to `execute`.
        self._sender: InferenceResponseSender | None = None
        self._is_cancelled: Callable[[], bool] | None = None
        # Read by the python backend once `execute` returned.
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> set[str]:
        return set(self._requested)  # a set in Triton too (its C++ std::set)

    def request_id(self) -> str:
        return self._request_id

    def parameters(self) -> str:
        """The request's parameters as a JSON object string, as in Triton."""
        return self._parameters

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def correlation_id(self) -> int | str:
        """The sequence ID (sequence batching), 0 otherwise."""
        return self._correlation_id

    def flags(self) -> int:
        """TRITONSERVER_REQUEST_FLAG_SEQUENCE_START | _END for sequence requests."""
        return self._flags

    def set_flags(self, flags: int) -> None:
        """A BLS request's sequence flags."""
        self._flags = flags

    def set_release_flags(self, flags: int) -> None:
        """TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: run this request again in a later batch
        (a non-decoupled model returns None for it); ALL: release it (the default)."""
        if flags not in (TRITONSERVER_REQUEST_RELEASE_ALL, TRITONSERVER_REQUEST_RELEASE_RESCHEDULE):
            # Triton passes any number on; its server acts on the RESCHEDULE bit alone.
            raise TritonModelException(
                f"set_release_flags: unknown flags {flags!r}; expected TRITONSERVER_REQUEST_RELEASE_ALL "
                "or TRITONSERVER_REQUEST_RELEASE_RESCHEDULE"
            )
        self._release_flags = flags

    def timeout(self) -> int:
        return self._timeout

    def trace(self) -> InferenceTrace:
        return InferenceTrace()

    def is_cancelled(self) -> bool:
        """True once the client that sent this request went away (or the daemon dropped it)."""
        return self._is_cancelled is not None and self._is_cancelled()

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException("this request has no response sender (it is a BLS request)")
        return self._sender

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on another loaded model (BLS) and wait: its response, or with
        `decoupled=True` an iterator over its responses (any number, blocking per item).

        Failures come back as a response with an error, as in Triton."""
        result = self._submit(decoupled, "exec")
        return result if decoupled else _bls_response(result.result())

    def async_exec(self, decoupled: bool = False) -> Awaitable[Any]:
        """`exec` for `async def execute`: await it (several may run at once)."""
        import asyncio

        result = self._submit(decoupled, "async_exec")

        async def wait() -> Any:
            return result if decoupled else _bls_response(await asyncio.wrap_future(result))

        return wait()

    def _submit(self, decoupled: bool, verb: str) -> Any:
        if not self._model_name:
            raise TritonModelException(f"InferenceRequest.{verb}: model_name is empty")
        executor = BLS_EXECUTOR.get()
        if executor is None:
            # Triton's text first (its python backend refuses BLS outside `execute`, in
            # `initialize` too), then where edged draws the line.
            raise TritonModelException(
                f"BLS is only supported during the 'execute' function: InferenceRequest.{verb} must "
                "be called from the thread running the model's execute (edged gives threads a model "
                "starts itself no BLS access)"
            )
        return executor(self, decoupled)


class ResponseIterator:
    """What `exec(decoupled=True)` returns: the called model's responses, one per `next()`
    (each waits for it). `cancel()` tells the called model to stop (it sees is_cancelled());
    iteration then ends."""

    def __init__(self, next_item: Callable[[], InferenceResponse | None], cancel: Callable[[], None]) -> None:
        self._next_item = next_item
        self._cancel = cancel
        self._done = False

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            raise StopIteration
        item = self._next_item()
        if item is None:
            self._done = True
            raise StopIteration
        return item

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._cancel()

    def __del__(self) -> None:
        # An iterator dropped half-way must not leave the called model streaming forever.
        if not self._done:
            # Interpreter shutdown or loop closed: nothing is left to stop.
            with contextlib.suppress(Exception):
                self.cancel()


def _bls_response(result: Any) -> InferenceResponse:
    if isinstance(result, InferenceResponse):
        return result
    raise TritonModelException(f"BLS call returned {type(result).__name__}")


class InferenceResponseSender:
    """`request.get_response_sender()`: any number of responses, then one with the final flag."""

    def __init__(
        self,
        push: Callable[[InferenceResponse | None, int], None],
        is_cancelled: Callable[[], bool],
    ) -> None:
        self._push = push
        self._is_cancelled = is_cancelled
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException(f"send: unknown flags {flags}")
        if response is None and flags != TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            raise TritonModelException(
                "send: a response is required unless flags is TRITONSERVER_RESPONSE_COMPLETE_FINAL"
            )
        if response is not None and not callable(getattr(response, "output_tensors", None)):
            raise TritonModelException(
                f"send: expected an InferenceResponse, got {type(response).__name__}"
            )
        with self._lock:
            if self._closed:
                raise TritonModelException(
                    "Unable to send response. Response sender has been closed."
                )
            if flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self._closed = True
            self._push(response, flags)

    def is_cancelled(self) -> bool:
        return self._is_cancelled()


class InferenceResponse:
    def __init__(
        self,
        output_tensors: Iterable[Tensor] = (),
        error: TritonError | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        self._outputs = list(output_tensors)
        self._error = error
        # Newer Triton: a dict of str keys to bool/int/str values (no floats), checked here.
        if parameters is not None and not isinstance(parameters, dict):
            raise TritonModelException(
                f"InferenceResponse parameters must be a dict, got {type(parameters)}"
            )
        self._parameters: dict[str, Any] = dict(parameters or {})
        for key, value in self._parameters.items():
            if not isinstance(key, str):
                raise TritonModelException(
                    f"Expect parameters keys to have type str, found type {type(key)}"
                )
            if not isinstance(value, bool | int | str):
                raise TritonModelException(
                    f"Expect parameters values to have type bool/int/str, found type {type(value)}"
                )

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class _LogLevel(enum.IntEnum):
    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    VERBOSE = logging.DEBUG


class Logger:
    """`pb_utils.Logger.log_info(...)` etc., forwarded to the daemon's log."""

    LogLevel = _LogLevel
    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    VERBOSE = logging.DEBUG

    @staticmethod
    def log(message: str, level: int = logging.INFO) -> None:
        log.log(level, "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        log.debug("%s", message)


class MetricsScope:
    """The custom metrics of one model instance: the daemon's hook (the backend contract's
    `CustomMetrics`), the instance's name for error texts, and the family handles the instance
    opened, which the backend closes when it unloads the instance."""

    def __init__(self, hook: Any, instance: str) -> None:
        self.hook = hook
        self.instance = instance
        # Weak: a model that makes a family per request and drops it piles nothing up here.
        self.opened: weakref.WeakSet[Any] = weakref.WeakSet()

    def close(self) -> None:
        opened, self.opened = list(self.opened), weakref.WeakSet()
        for handle in opened:
            handle.close()


# The metrics scope of the model instance whose code runs in this context: set by the python
# backend around the model's import and `initialize`, each `execute`, and `finalize`.
METRICS: contextvars.ContextVar[MetricsScope | None] = contextvars.ContextVar("edged_metrics", default=None)


class _MetricKind(enum.Enum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    def __int__(self) -> int:
        return int(self.value)

    def __index__(self) -> int:
        return int(self.value)


# As Triton's module shows it (`MetricKind.GAUGE`), without a `pb_utils.MetricKind` name.
_MetricKind.__name__ = _MetricKind.__qualname__ = "MetricKind"
_KIND_NAMES = {_MetricKind.COUNTER: "counter", _MetricKind.GAUGE: "gauge", _MetricKind.HISTOGRAM: "histogram"}


def _request_failed(scope_instance: str, exc: BaseException) -> str:
    return f"Failed to process the request for model '{scope_instance}', message: {exc}"


class MetricFamily:
    """Triton's custom metric family: `MetricFamily(name, description, kind)`, then
    `family.Metric(labels={...})` (histograms: `buckets=[...]`). Exported at the daemon's
    /metrics while this object lives (and its instance is loaded); errors are
    TritonModelException with Triton's texts."""

    COUNTER = _MetricKind.COUNTER
    GAUGE = _MetricKind.GAUGE
    HISTOGRAM = _MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: _MetricKind) -> None:
        if not isinstance(name, str) or not isinstance(description, str) or not isinstance(kind, _MetricKind):
            raise TypeError(
                "MetricFamily(name: str, description: str, kind: MetricFamily.COUNTER, GAUGE or HISTOGRAM)"
            )
        scope = METRICS.get()
        if scope is None or scope.hook is None:
            raise TritonModelException(
                "MetricFamily must be created by the model's own code in initialize, execute or "
                "finalize (edged gives threads a model starts itself no metrics)"
            )
        try:
            handle = scope.hook.family(name, description, _KIND_NAMES[kind])
        except Exception as exc:
            raise TritonModelException(f"Error when creating MetricFamily: {_request_failed(scope.instance, exc)}") from None
        scope.opened.add(handle)
        self._kind = kind
        self._handle = handle
        self._instance = scope.instance
        # Deleting the family releases its series, as in Triton (where its Metric objects stop
        # working then too); the backend closes what is left when the instance unloads.
        weakref.finalize(self, handle.close)

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> _Metric:
        if labels is not None and not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        if buckets is not None:
            if not isinstance(buckets, list):
                raise TritonModelException("Failed to create metric. Buckets must be a list.")
            if self._kind is not _MetricKind.HISTOGRAM:
                raise TritonModelException("Failed to create metric. Unexpected buckets found.")
            buckets = [_number(b, "Metric") for b in buckets]
        elif self._kind is _MetricKind.HISTOGRAM:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        try:
            series = self._handle.metric(labels or {}, buckets)
        except Exception as exc:
            raise TritonModelException(f"Error when creating Metric: {_request_failed(self._instance, exc)}") from None
        return _Metric(self, series)


class _Metric:
    """One labelled series of a `MetricFamily` (made by `family.Metric(...)`; Triton's module
    has no `Metric` name either)."""

    def __init__(self, family: MetricFamily, series: Any) -> None:
        # Weak, as in Triton: a Metric does not keep its family alive, and fails once it is gone.
        self._family = weakref.ref(family)
        self._series = series
        self._instance = family._instance

    def increment(self, value: float) -> None:
        self._call("increment", "increment", _number(value, "increment"))

    def set(self, value: float) -> None:
        self._call("set", "set", _number(value, "set"))

    def observe(self, value: float) -> None:
        self._call("observe", "observe", _number(value, "observe"))

    def value(self) -> float:
        return float(self._call("value", "get", None))

    def _call(self, method: str, verb: str, value: float | None) -> Any:
        what = f"Failed to {verb} metric value"
        if self._family() is None:
            raise TritonModelException(
                f"{what}: Invalid metric operation as the corresponding 'MetricFamily' has been deleted. "
                "The 'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have been deleted."
            )
        call = getattr(self._series, method)
        try:
            return call() if value is None else call(value)
        except Exception as exc:
            raise TritonModelException(f"{what}: {_request_failed(self._instance, exc)}") from None


_Metric.__name__ = _Metric.__qualname__ = "Metric"


def _number(value: Any, method: str) -> float:
    """A float as Triton's bindings take one: a Python or numpy number, never text."""
    if isinstance(value, str | bytes | bytearray):
        raise TypeError(f"{method}(): expected a number, got {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{method}(): expected a number, got {type(value).__name__}") from None


# The model loading API's bridge of the model instance whose `initialize` or `execute` runs in
# this context (the python backend's; its load/unload/is_ready run the repository's control
# on the daemon's loop). None in `finalize`, `auto_complete_config` and threads a model starts,
# as Triton supports it in neither of the first two.
MODEL_CONTROL: contextvars.ContextVar[Any | None] = contextvars.ContextVar("edged_model_control", default=None)


def _model_control(verb: str, call: Callable[[Any], Any]) -> Any:
    control = MODEL_CONTROL.get()
    if control is None:
        raise TritonModelException(
            f"{verb}: the model loading API works in a model's initialize and execute (not in "
            "finalize, auto_complete_config or a thread the model starts)"
        )
    try:
        return call(control)
    except Exception as exc:
        raise TritonModelException(f"{verb}: {_request_failed(control.instance, exc)}") from None


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) another model of the repository, as Triton's model loading API:
    `config` (JSON) replaces its config; `files` ({"file:1/model.onnx": bytes}, with `config`)
    are the model's files. Explicit model control mode only."""
    if not isinstance(model_name, str) or not isinstance(config, str) or not isinstance(files, dict | None):
        raise TypeError("load_model(model_name: str, config: str = '', files: dict[str, bytes] | None = None)")
    for key, data in (files or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"load_model(): a file's name must be a str, got {type(key).__name__}")
        if not isinstance(data, bytes):
            raise TypeError(f"Object of type '{type(data).__name__}' is not an instance of 'bytes'")
    _model_control("Failed to load model", lambda control: control.load(model_name, config or None, dict(files or {})))


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload a model (with `unload_dependents`, an ensemble's step models too); waits until
    its running requests finished. A model that is not loaded is already unloaded."""
    if not isinstance(model_name, str) or not isinstance(unload_dependents, bool):
        raise TypeError("unload_model(model_name: str, unload_dependents: bool = False)")
    _model_control("Failed to unload model", lambda control: control.unload(model_name, unload_dependents))


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether the model (that version; "" the latest) is loaded and serving."""
    if not isinstance(model_name, str) or not isinstance(model_version, str):
        raise TypeError("is_model_ready(model_name: str, model_version: str = '')")
    return bool(_model_control(
        "Failed to check model readiness", lambda control: control.is_ready(model_name, model_version)
    ))


# The directory of the model file whose code runs in this context (Triton's get_model_dir: its
# version directory), set by the python backend around auto_complete_config, initialize,
# execute and finalize. Triton's stub serves one model, so any thread of it may ask; here
# models share the process, and a thread a model starts has no context to say which.
MODEL_DIR: contextvars.ContextVar[str] = contextvars.ContextVar("edged_model_dir", default="")


def get_model_dir() -> str:
    """The directory of the running model's file, `<repository>/<model>/<version>`."""
    directory = MODEL_DIR.get()
    if not directory:
        raise TritonModelException(
            "get_model_dir: works in a model's auto_complete_config, initialize, execute and finalize "
            "(not in a thread the model starts, whose model edged cannot tell)"
        )
    return directory


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", []) if t.get("name") == name), None)


def triton_string_to_numpy(type_string: str) -> type[Any]:
    """`"TYPE_FP32"` -> `numpy.float32` (also accepts KServe names such as `"FP32"`)."""
    name = type_string.upper()
    if not name.startswith("TYPE_"):
        name = "TYPE_STRING" if name == "BYTES" else f"TYPE_{name}"
    try:
        return _NUMPY_TYPES[name]
    except KeyError:
        raise TritonModelException(f"unknown Triton data type {type_string!r}") from None


def numpy_to_triton_type(dtype: Any) -> int | None:
    """numpy dtype -> its TRITONSERVER_DataType code, as Triton's returns it (`np.float32` ->
    11; object and bytes arrays 13); None for a dtype Triton has no code for."""
    try:
        kind = np.dtype(dtype)
    except TypeError:
        return None
    return 13 if kind.kind == "S" else _CODE_OF_DTYPE.get(kind)


def triton_to_numpy_type(data_type: int) -> type[Any] | None:
    """A TRITONSERVER_DataType code -> numpy (`11` -> `np.float32`); None for any other."""
    return _CODES.get(data_type)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | tuple[()] | None:
    """A BYTES tensor in Triton's wire layout: each element, in C order, as its 4-byte
    little-endian length and its bytes; an element that is not bytes is written as its text.
    `()` for an empty tensor and None for one that is not BYTES, as Triton's returns."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype.kind == "S":
        items = input_tensor.reshape(-1).tolist()  # numpy drops trailing zeros of S elements
    elif input_tensor.dtype == np.object_:
        items = [v if type(v) is bytes else str(v).encode("utf-8") for v in input_tensor.reshape(-1).tolist()]
    else:
        return None
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """The inverse of `serialize_byte_tensor`: a flat object array of bytes."""
    view = memoryview(encoded_tensor).cast("B")
    items: list[bytes] = []
    offset = 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise TritonModelException(f"serialized BYTES tensor ends inside a length prefix at byte {offset}")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > len(view):
            raise TritonModelException(f"serialized BYTES element at byte {offset - 4} runs past the end")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    return array


class PreferredMemory:
    """Where a BLS request's outputs should live: host memory is the only kind here."""

    def __init__(self, preferred_memory_type: int = TRITONSERVER_MEMORY_CPU, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class ModelConfig:
    """What `auto_complete_config(auto_complete_model_config)` receives: the model's config in
    Triton's JSON layout, which the model may complete. The daemon validates the result exactly
    like a written config."""

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        config = json.loads(model_config) if isinstance(model_config, str) else model_config
        self._model_config: dict[str, Any] = config
        config.setdefault("input", [])
        config.setdefault("output", [])
        config.setdefault("max_batch_size", 0)

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = self._model_config["max_batch_size"]
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config "
                f"function for model '{self._name()}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name()}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(
                    f"model transaction property in auto-complete-config function for model "
                    f"'{self._name()}' contains property other than 'decoupled'."
                )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != wanted:
                raise ValueError(
                    f"trying to change decoupled property in auto-complete-config for model "
                    f"'{self._name()}', which is already set to '{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output)

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        name = tensor.get("name")
        model = self._name()
        allowed = ("name", "data_type", "dims", "optional") if kind == "input" else (
            "name", "data_type", "dims"
        )
        for key in tensor:
            if key not in allowed:
                listed = ", ".join(repr(a) for a in allowed[:-1]) + f" and {allowed[-1]!r}"
                raise ValueError(
                    f"{kind} '{name}' in auto-complete-config function for model '{model}' "
                    f"contains property other than {listed}."
                )
        if name is None:
            raise ValueError(
                f"{kind} in auto-complete-config function for model '{model}' is missing 'name' property."
            )
        for key in ("data_type", "dims"):
            if key not in tensor:
                raise ValueError(
                    f"{kind} '{name}' in auto-complete-config function for model '{model}' is "
                    f"missing '{key}' property."
                )
        for current in self._model_config[kind]:
            if current.get("name") != name:
                continue
            if current.get("data_type", "TYPE_INVALID") not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(
                    f"unable to load model '{model}', configuration expects datatype "
                    f"{current['data_type']} for {kind} '{name}', model provides {tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{model}', tensor '{name}': the model expects dims {tensor['dims']} "
                    f"but the model configuration specifies dims {current['dims']}"
                )
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))
