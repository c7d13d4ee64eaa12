"""Check a decoded inference request against its model's configuration, like Triton does
before a request reaches a scheduler: input names, datatypes, shapes, batch size, outputs.

Messages name the model, the tensor, what was expected and what came.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np

from daemon.backend import NUMPY_DTYPES, InferRequest, datatype_of
from daemon.errors import InvalidArgument
from daemon.model_config import ModelConfig, TensorConfig


def validate_request(request: InferRequest, config: ModelConfig) -> None:
    """Raise InvalidArgument when `request` does not fit `config`."""
    model = config.name
    batching = config.max_batch_size > 0
    batch_owner = ""
    batch_size = 0
    # Runs once per request on the event loop: the common case is inline, and messages are
    # built only on the error path.
    for name, array in request.inputs.items():
        for tensor in config.input:
            if tensor.name == name:
                break
        else:
            raise InvalidArgument(f"unexpected inference input {name!r} for model {model!r}")
        if tensor.data_type == "BYTES":
            dtype_ok = array.dtype.kind == "O"
        else:
            dtype_ok = array.dtype == NUMPY_DTYPES[tensor.data_type]
        if not dtype_ok:
            _datatype_error(name, array, tensor, model)
        _check_shape(name, array.shape, tensor, config)
        if batching:
            # Merging requests along dim 0 needs every input to agree on it.
            rows = int(array.shape[0])
            if not batch_owner:
                batch_owner, batch_size = name, rows
            elif rows != batch_size:
                raise InvalidArgument(
                    f"inputs {batch_owner!r} and {name!r} for model {model!r} have different "
                    f"batch sizes {batch_size} and {rows}"
                )

    missing = [t.name for t in config.input if not t.optional and t.name not in request.inputs]
    if missing:
        raise InvalidArgument(
            f"request for model {model!r} is missing required input(s) {missing}; "
            f"it has {sorted(request.inputs)}"
        )

    # A config without outputs (not autocompleted, or a generation model) cannot tell which
    # names are valid; the backend answers for those.
    if config.output:
        for name in request.requested_outputs:
            if config.output_by_name(name) is None:
                raise InvalidArgument(f"unexpected inference output {name!r} for model {model!r}")


def _datatype_error(name: str, array: np.ndarray, tensor: TensorConfig, model: str) -> NoReturn:
    """Raise the error for an input whose dtype is not the configured one.

    BF16 and UINT16 share a numpy dtype; the array alone cannot tell them apart."""
    expected = tensor.data_type
    try:
        got = datatype_of(array)
    except InvalidArgument:
        got = f"numpy {array.dtype}"
    if expected == "BYTES" and got == "BYTES":
        got = f"numpy {array.dtype} (BYTES must be an object array of bytes)"
    raise InvalidArgument(
        f"inference input {name!r} data-type is {got!r}, but model {model!r} expects {expected!r}"
    )


def _check_shape(
    name: str, shape: tuple[int, ...], tensor: TensorConfig, config: ModelConfig
) -> None:
    dims = tensor.dims
    mbs = config.max_batch_size
    batched = mbs > 0
    if not (batched and not shape) and _dims_match(shape[1:] if batched else shape, dims):
        if batched and shape[0] > mbs:
            # Triton's wording (clients and its tests match it).
            raise InvalidArgument(
                f"inference request batch-size must be <= {mbs} for {config.name!r} "
                f"(input {name!r} has {shape[0]})"
            )
        if batched and shape[0] < 1:
            raise InvalidArgument(
                f"input {name!r} for model {config.name!r}: batch size {shape[0]} must be "
                f"between 1 and max_batch_size {mbs}"
            )
        return
    expected = [-1, *dims] if batched else list(dims)
    # Triton's wording and its compact dims ("[-1,4]").
    message = (
        f"unexpected shape for input {name!r} for model {config.name!r}. "
        f"Expected {_dims(expected)}, got {_dims(shape)}"
    )
    if batched:
        message += (
            ". NOTE: the model's max_batch_size > 0 means each input shape starts with the "
            "batch dimension"
        )
    raise InvalidArgument(message)


def _dims(shape: list[int] | tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _dims_match(shape: tuple[int, ...], dims: list[int]) -> bool:
    if len(shape) != len(dims):
        return False
    # Dims without -1 (most models) match in one comparison: this runs for every input.
    return list(shape) == dims or all(want in (-1, got) for got, want in zip(shape, dims, strict=True))
