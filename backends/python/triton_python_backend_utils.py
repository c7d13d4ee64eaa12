"""In-process stand-in for Triton's `triton_python_backend_utils` (imported as `pb_utils`).

A Triton Python model does `import triton_python_backend_utils as pb_utils`; the python backend
registers this module under that name before it imports the model, so existing models run
unchanged. Tensors wrap numpy arrays without copying: the request's arrays are handed to the
model as they are, and the model's outputs are returned as they are (no shared-memory hop, which
is where Triton's separate stub process spends its 11-20 ms per request).

Not provided: BLS (`InferenceRequest.exec`), decoupled response senders, DLPack, custom metrics.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
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


class TritonModelException(Exception):
    """What Triton raises for a failed call; a model may raise it from execute too."""


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

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


class Tensor:
    """A named numpy array."""

    def __init__(self, name: str, array: Any) -> None:
        if not isinstance(name, str):
            raise TritonModelException(f"tensor name must be a str, got {type(name).__name__}")
        self._name = name
        self._array = array if isinstance(array, np.ndarray) else np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self.shape()}, dtype={self._array.dtype})"


class InferenceRequest:
    """One request of the batch handed to `execute`."""

    def __init__(
        self,
        inputs: Sequence[Tensor] = (),
        request_id: str = "",
        requested_output_names: Sequence[str] = (),
        parameters: str | dict[str, Any] = "{}",
        model_name: str = "",
        correlation_id: int | str = 0,
        flags: int = 0,
        **_: Any,
    ) -> None:
        self._correlation_id = correlation_id
        self._flags = flags
        self._inputs = list(inputs)
        self._request_id = request_id
        self._requested = list(requested_output_names)
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters)
        self._model_name = model_name

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested

    def request_id(self) -> str:
        return self._request_id

    def parameters(self) -> str:
        """The request's parameters as a JSON object string, as in Triton."""
        return self._parameters

    def model_name(self) -> str:
        return self._model_name

    def correlation_id(self) -> int | str:
        """The sequence ID (sequence batching), 0 otherwise."""
        return self._correlation_id

    def flags(self) -> int:
        """TRITONSERVER_REQUEST_FLAG_SEQUENCE_START | _END for sequence requests."""
        return self._flags

    def is_cancelled(self) -> bool:
        return False

    def exec(self, *_: Any, **__: Any) -> InferenceResponse:
        raise TritonModelException(
            "BLS requests (InferenceRequest.exec) are not supported by edged"
        )

    def async_exec(self, *_: Any, **__: Any) -> InferenceResponse:
        raise TritonModelException(
            "BLS requests (InferenceRequest.async_exec) are not supported by edged"
        )

    def get_response_sender(self) -> Any:
        raise TritonModelException(
            "decoupled models (get_response_sender) are not supported by edged"
        )


class InferenceResponse:
    def __init__(
        self, output_tensors: Iterable[Tensor] = (), error: TritonError | None = None
    ) -> None:
        self._outputs = list(output_tensors)
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class Logger:
    """`pb_utils.Logger.log_info(...)` etc., forwarded to the daemon's log."""

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


def numpy_to_triton_type(dtype: Any) -> str:
    """numpy dtype -> `"TYPE_*"` name (object/bytes/str arrays are TYPE_STRING)."""
    kind = np.dtype(dtype)
    if kind.kind in ("O", "S", "U"):
        return "TYPE_STRING"
    for name, numpy_type in _NUMPY_TYPES.items():
        if name != "TYPE_BF16" and np.dtype(numpy_type) == kind:
            return name
    raise TritonModelException(f"numpy dtype {kind} has no Triton data type")
