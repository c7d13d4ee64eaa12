"""Triton's model warmup: requests each instance runs before its model is ready.

A config's `model_warmup` samples are run as Triton runs them (core's TritonModelInstance
WarmUp): on every instance, `batch_size` requests of one row each (no batch dimension for a
model that does not batch) executed together, `count` times (at least once); a sample with
batch size 0 is skipped. Inputs are zeros, random bytes (zeros for BYTES, as there) or the
contents of `<model>/warmup/<input_data_file>` (raw little-endian data, or 4-byte-length-
prefixed strings for BYTES). A sample that fails fails the load with Triton's text. The
executions count in the model's statistics, as in Triton.

Errors carry Triton's texts (core/src/backend_model_instance.cc).
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daemon.backend import NUMPY_DTYPES, Backend, EdgedError, InferRequest
from daemon.core.stats import ModelStats, compute_phases
from daemon.core.validate import validate_request
from daemon.errors import ConfigError, InvalidArgument
from daemon.model_config import ModelConfig, ModelWarmupInput

# Triton's kWarmupDataFolder, under the model's directory.
WARMUP_FOLDER = "warmup"


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    count: int
    requests: tuple[InferRequest, ...]


def samples(config: ModelConfig, model_dir: Path) -> list[Sample]:
    """The config's warmup samples as requests (reads data files: call it off the loop).

    Each is checked as Triton checks it before it runs, and before its data is made: its
    batch size against the model's (a model that does not batch takes 1, as the config's
    documentation says; Triton 2.51 crashes on 2), its inputs as a request's (names, data types,
    shapes against the config, Triton's texts). A sample's size is then what the config allows,
    not a shape or batch that the allocation or the requests would fail on (or fill the memory
    with) first."""
    out = []
    batched = config.max_batch_size > 0
    inputs = {t.name for t in config.input}
    for warmup in config.model_warmup:
        if warmup.batch_size == 0:
            continue
        most = max(config.max_batch_size, 1)
        if warmup.batch_size > most:
            # Triton's text, once (it repeats it for every request of the sample).
            raise ConfigError(f"failed to run warmup sample '{warmup.name}': batch size {warmup.batch_size} for "
                              f"'{config.name}_0', max allowed is {most}; ")
        shapes = {}
        for name, spec in warmup.inputs.items():
            if any(d < 0 for d in spec.dims):
                raise ConfigError(
                    "warmup setting expects all variable-size dimensions are specified for input "
                    f"'{name}'"
                )
            shapes[name] = ((1,) if batched and name in inputs else ()) + tuple(spec.dims)
        # The request's shapes and data types, without its data (views of one element).
        outline = {name: _outline(name, spec.data_type, shapes[name]) for name, spec in warmup.inputs.items()}
        try:
            validate_request(InferRequest(inputs=outline), config)
        except InvalidArgument as exc:
            raise ConfigError(f"failed to run warmup sample '{warmup.name}': {exc}") from None
        arrays = {name: _data(name, spec.data_type, shapes[name], spec, model_dir)
                  for name, spec in warmup.inputs.items()}
        requests = tuple(InferRequest(inputs=dict(arrays)) for _ in range(warmup.batch_size))
        out.append(Sample(warmup.name, max(1, warmup.count), requests))
    return out


def _dtype(datatype: str) -> np.dtype[Any]:
    return np.dtype(np.object_) if datatype == "BYTES" else NUMPY_DTYPES[datatype]


def _outline(name: str, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return np.broadcast_to(np.zeros((), _dtype(datatype)), shape)
    except ValueError:  # more elements than numpy can index
        raise _unallocatable(name, datatype, shape) from None


def _data(name: str, datatype: str, shape: tuple[int, ...], spec: ModelWarmupInput, model_dir: Path) -> np.ndarray:
    try:
        return _made(name, datatype, shape, spec, model_dir)
    except (MemoryError, ValueError, OverflowError):
        # A shape the config allows (a variable dimension) that this box cannot hold.
        raise _unallocatable(name, datatype, shape) from None


def _unallocatable(name: str, datatype: str, shape: tuple[int, ...]) -> ConfigError:
    size = math.prod(shape) * _dtype(datatype).itemsize
    return ConfigError(f"warmup input '{name}': {size} bytes of data for shape {list(shape)} cannot be allocated")


def _made(name: str, datatype: str, shape: tuple[int, ...], spec: ModelWarmupInput, model_dir: Path) -> np.ndarray:
    count = math.prod(shape)
    if spec.input_data_file:
        return _from_file(name, datatype, shape, spec.input_data_file, model_dir)
    if datatype == "BYTES" and (spec.zero_data or spec.random_data):
        # Triton: zero bytes for both, i.e. empty strings.
        return np.full(shape, b"", dtype=np.object_)
    dtype = NUMPY_DTYPES[datatype]
    if spec.zero_data:
        return np.zeros(shape, dtype)
    if spec.random_data:
        raw = np.frombuffer(os.urandom(count * dtype.itemsize), np.uint8)
        return (raw != 0).reshape(shape) if dtype == np.bool_ else raw.view(dtype).reshape(shape)
    raise ConfigError(f"warmup setting expects input '{name}' to have input_data_type set")


def _from_file(name: str, datatype: str, shape: tuple[int, ...], file: str, model_dir: Path) -> np.ndarray:
    folder = (model_dir / WARMUP_FOLDER).resolve()
    path = (folder / file).resolve()
    if not path.is_relative_to(folder):
        raise ConfigError(f"warmup input '{name}': input_data_file {file!r} is outside {WARMUP_FOLDER}/")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"warmup input '{name}': cannot read {WARMUP_FOLDER}/{file}: {exc.strerror}") from None
    count = math.prod(shape)
    if datatype == "BYTES":
        elements: list[bytes] = []
        offset = 0
        while len(elements) < count and offset + 4 <= len(data):
            (length,) = struct.unpack_from("<I", data, offset)
            elements.append(data[offset + 4 : offset + 4 + length])
            offset += 4 + length
        if len(elements) < count or offset > len(data):
            raise ConfigError(
                f"warmup input '{name}': {WARMUP_FOLDER}/{file} holds fewer than {count} length-prefixed strings"
            )
        array = np.empty(count, dtype=np.object_)
        array[:] = elements
        return array.reshape(shape)
    dtype = NUMPY_DTYPES[datatype]
    needed = count * dtype.itemsize
    if len(data) < needed:
        # Triton's words (its missing space too).
        raise ConfigError(
            f"warmup setting expects {needed} bytes, but the data provided from {file}only has {len(data)} bytes"
        )
    return np.frombuffer(data[:needed], dtype).reshape(shape).copy()


async def warm_up(instance: Backend, warmups: list[Sample], stats: ModelStats, *, decoupled: bool) -> None:
    """Run every sample on `instance`; EdgedError (Triton's text) at the first that fails."""
    for sample in warmups:
        for _ in range(sample.count):
            errors = await _run(instance, sample.requests, stats, decoupled)
            if errors:
                raise EdgedError(f"failed to run warmup sample '{sample.name}': " + "".join(f"{e}; " for e in errors))


async def _run(instance: Backend, requests: tuple[InferRequest, ...], stats: ModelStats, decoupled: bool) -> list[str]:
    instance.phase_ns = (0, 0)
    started = time.monotonic_ns()
    errors: list[str] = []
    if decoupled:
        # Any number of responses each; their errors count (a decoupled model runs a request
        # at a time here).
        for request in requests:
            async with contextlib.aclosing(instance.execute_stream(request)) as responses:
                errors += [r.message for r in [r async for r in responses] if isinstance(r, EdgedError)]
    else:
        try:
            results = await instance.execute(list(requests))
        except EdgedError as exc:
            results = [exc] * len(requests)
        errors += [r.message for r in results if isinstance(r, EdgedError)]
    elapsed = time.monotonic_ns() - started
    phases = compute_phases(elapsed, instance.phase_ns)
    # Counted as Triton counts them: one execution of the sample's rows, each request a success.
    stats.record_execution(len(requests), phases.infer_ns, phases.input_ns, phases.output_ns)
    if not errors:
        for _ in requests:
            stats.record_success(elapsed, 1, queue_ns=0, compute_input_ns=phases.input_ns,
                                 compute_infer_ns=phases.infer_ns, compute_output_ns=phases.output_ns)
    return errors
