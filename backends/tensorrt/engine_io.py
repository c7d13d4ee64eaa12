"""The CPU side of the TensorRT backend: datatypes, engine I/O, config completion and checks.

Nothing here imports tensorrt or touches a GPU, so all of it is unit-tested on any machine.
backend.py turns a real engine into `IoTensor`s and calls these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from daemon.backend import (
    NUMPY_DTYPES,
    BackendError,
    ConfigError,
    Device,
    InvalidArgument,
    ModelConfig,
    TensorConfig,
    Unsupported,
)

from .sidecar import engine_mismatch, read_engine_sidecar

# tensorrt.DataType member name -> KServe datatype. TensorRT's FP8, FP4, INT4 and E8M0 exist
# only inside engines (quantized weights/activations); as engine I/O they have no KServe or
# numpy spelling, so an engine exposing them is refused at load.
TRT_TO_KSERVE: dict[str, str] = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "BF16": "BF16",
    "INT8": "INT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
    "UINT8": "UINT8",
}
KSERVE_TO_TRT: dict[str, str] = {kserve: trt for trt, kserve in TRT_TO_KSERVE.items()}

# Bytes per element of each TensorRT type: the host array must have the same item size.
TRT_ITEMSIZE: dict[str, int] = {
    "FLOAT": 4, "HALF": 2, "BF16": 2, "INT8": 1, "INT32": 4, "INT64": 8, "BOOL": 1, "UINT8": 1,
}

Shape = tuple[int, ...]


def kserve_datatype(trt_name: str, tensor: str) -> str:
    """KServe datatype of a TensorRT DataType name; Unsupported for in-engine-only types."""
    try:
        return TRT_TO_KSERVE[trt_name]
    except KeyError:
        raise Unsupported(
            f"tensorrt: engine tensor {tensor!r} has type {trt_name}, which has no KServe "
            f"datatype (supported at the engine boundary: {sorted(TRT_TO_KSERVE)})"
        ) from None


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    """Host dtype for a KServe datatype (BF16 travels as uint16 bit patterns)."""
    return NUMPY_DTYPES[datatype]


@dataclass(frozen=True, slots=True)
class IoTensor:
    """One engine input or output, as TensorRT describes it."""

    name: str
    is_input: bool
    datatype: str
    # The engine's shape, batch dimension included; -1 = set per request.
    shape: Shape
    # (min, opt, max) of optimization profile 0, for inputs with dynamic dimensions.
    profile: tuple[Shape, Shape, Shape] | None = None


def engine_max_batch(tensors: list[IoTensor]) -> int:
    """Largest batch the engine takes along dim 0, or 0 when it has no batch dimension.

    Dim 0 is a batch dimension when every input and output leaves it dynamic and every input's
    profile bounds it; the smallest profile maximum is what one execution can take.
    """
    inputs = [t for t in tensors if t.is_input]
    if not inputs or any(not t.shape or t.shape[0] != -1 for t in tensors):
        return 0
    if any(t.profile is None for t in inputs):
        return 0
    return min(t.profile[2][0] for t in inputs if t.profile is not None)


def _tensor_config(tensor: IoTensor, batched: bool) -> TensorConfig:
    dims = list(tensor.shape[1:] if batched else tensor.shape)
    return TensorConfig(name=tensor.name, data_type=tensor.datatype, dims=dims)


def complete_config(config: ModelConfig, tensors: list[IoTensor]) -> ModelConfig:
    """Fill inputs, outputs and max_batch_size the config left out, from the engine."""
    engine_batch = engine_max_batch(tensors)
    max_batch = config.max_batch_size
    if max_batch == 0 and not config.input:
        max_batch = engine_batch
    batched = max_batch > 0
    inputs = config.input or [_tensor_config(t, batched) for t in tensors if t.is_input]
    outputs = config.output or [_tensor_config(t, batched) for t in tensors if not t.is_input]
    return msgspec.structs.replace(config, max_batch_size=max_batch, input=inputs, output=outputs)


def _check_tensor(model: str, declared: TensorConfig, tensor: IoTensor, batched: bool) -> None:
    where = f"model {model!r}: {'input' if tensor.is_input else 'output'} {declared.name!r}"
    if declared.data_type != tensor.datatype:
        raise ConfigError(f"{where} is {declared.data_type} in the config but {tensor.datatype} in the engine")
    engine_dims = tensor.shape[1:] if batched else tensor.shape
    if len(declared.dims) != len(engine_dims):
        raise ConfigError(
            f"{where}: config dims {declared.dims} have rank {len(declared.dims)}, the engine's "
            f"{list(engine_dims)} rank {len(engine_dims)}"
            + (" (without the batch dimension)" if batched else "")
        )
    for got, want in zip(declared.dims, engine_dims, strict=True):
        if want != -1 and got != want:
            raise ConfigError(f"{where}: config dims {declared.dims} differ from the engine's {list(engine_dims)}")


def check_config(config: ModelConfig, tensors: list[IoTensor], model: str) -> None:
    """Refuse a config that disagrees with the engine, naming the tensor and both sides."""
    by_name = {t.name: t for t in tensors}
    batched = config.max_batch_size > 0
    if batched:
        engine_batch = engine_max_batch(tensors)
        if engine_batch == 0:
            raise ConfigError(
                f"model {model!r}: max_batch_size {config.max_batch_size} but the engine has no "
                "dynamic batch dimension (build it with an optimization profile on dim 0)"
            )
        if config.max_batch_size > engine_batch:
            raise ConfigError(
                f"model {model!r}: max_batch_size {config.max_batch_size} exceeds the engine's "
                f"optimization profile maximum {engine_batch}"
            )
    for declared, is_input in [(t, True) for t in config.input] + [(t, False) for t in config.output]:
        tensor = by_name.get(declared.name)
        if tensor is None or tensor.is_input != is_input:
            kind = "input" if is_input else "output"
            names = sorted(t.name for t in tensors if t.is_input == is_input)
            raise ConfigError(f"model {model!r}: the engine has no {kind} {declared.name!r} ({kind}s: {names})")
        _check_tensor(model, declared, tensor, batched)
    declared_inputs = {t.name for t in config.input}
    missing = [t.name for t in tensors if t.is_input and t.name not in declared_inputs]
    if config.input and missing:
        raise ConfigError(f"model {model!r}: the engine needs inputs {missing} that the config does not declare")


def shape_problem(tensor: IoTensor, shape: Shape) -> str:
    """Why a request's shape does not fit the engine (fixed dims, profile bounds), or ""."""
    if len(shape) != len(tensor.shape):
        return f"input {tensor.name!r} has shape {list(shape)}, the engine expects rank {len(tensor.shape)} {list(tensor.shape)}"
    for axis, (got, want) in enumerate(zip(shape, tensor.shape, strict=True)):
        if want != -1:
            if got != want:
                return f"input {tensor.name!r} has shape {list(shape)}, the engine expects {list(tensor.shape)}"
            continue
        if tensor.profile is not None:
            low, high = tensor.profile[0][axis], tensor.profile[2][axis]
            if not low <= got <= high:
                return (
                    f"input {tensor.name!r} dim {axis} is {got}, outside the engine's optimization "
                    f"profile range [{low}, {high}]"
                )
    return ""


def check_input(tensor: IoTensor, array: np.ndarray) -> None:
    """Raise InvalidArgument when `array` cannot be bound to `tensor` as is."""
    want = numpy_dtype(tensor.datatype)
    if array.dtype != want:
        raise InvalidArgument(
            f"input {tensor.name!r} is {array.dtype}, the engine expects {tensor.datatype} ({want})"
        )
    if problem := shape_problem(tensor, tuple(array.shape)):
        raise InvalidArgument(problem)


def device_index(device: Device, config: ModelConfig, instance_index: int) -> int:
    """NVIDIA GPU for one instance: the device selection chose, else the config's KIND_GPU
    gpus (instances spread round-robin, like Triton), else GPU 0."""
    if device.kind == "gpu:nvidia":
        return device.index
    if device.kind != "auto":
        raise Unsupported(f"tensorrt runs on NVIDIA GPUs only; device {device} is not one")
    gpus = [index for group in config.instance_group if group.kind == "KIND_GPU" for index in group.gpus]
    return gpus[instance_index % len(gpus)] if gpus else 0


def compatibility_error(
    model: str, artifact: Path, gpu_name: str, compute_capability: str, tensorrt_version: str
) -> BackendError | None:
    """The refusal to load an engine built for another GPU/TensorRT, decided from the sidecar
    before any deserialization (which would fail with a less helpful message, or not at all
    for a mismatched compute capability of the same architecture)."""
    sidecar = read_engine_sidecar(artifact)
    if sidecar is None:
        return None
    problem = engine_mismatch(sidecar, compute_capability, gpu_name, tensorrt_version)
    if not problem:
        return None
    return BackendError(
        f"tensorrt: model {model!r}: {artifact} cannot run here: {problem}. Rebuild it on this "
        "machine (backends/tensorrt/build_engine.py) or let another artifact's backend serve it"
    )
