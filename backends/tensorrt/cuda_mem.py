"""The few CUDA runtime calls the TensorRT backend needs, through cuda-python's cudart.

Only this module talks to the CUDA runtime: device queries, one stream per instance, device
buffers and host<->device copies. Everything here needs an NVIDIA driver; nothing else in the
plugin does. cuda-python returns `(error, *values)` tuples; `_check` turns a failure into a
BackendError naming the call.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from daemon.backend import BackendError


def cudart() -> types.ModuleType:
    """cuda-python's runtime bindings (module path moved in cuda-python 12.6)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        from cuda import cudart as runtime  # cuda-python < 12.6
    return runtime


def _check(result: Any, call: str) -> Any:
    rt = cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        _, name = rt.cudaGetErrorName(err)
        _, text = rt.cudaGetErrorString(err)
        raise BackendError(f"tensorrt: CUDA {call} failed: {_decode(name)}: {_decode(text)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _decode(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def device_count() -> tuple[int, str]:
    """(number of CUDA devices, "") or (0, why not) — never raises, for the probe."""
    try:
        rt = cudart()
    except ImportError:
        return 0, "cuda-python is not installed (pip install cuda-python)"
    try:
        err, count = rt.cudaGetDeviceCount()
    except Exception as exc:  # a broken CUDA install must make the probe say so, not crash it
        return 0, f"the CUDA runtime does not work here: {type(exc).__name__}: {exc}"
    if err != rt.cudaError_t.cudaSuccess:
        _, text = rt.cudaGetErrorString(err)
        return 0, f"CUDA reports no usable device: {_decode(text)}"
    return int(count), ""


def device_properties(index: int) -> tuple[str, str]:
    """(name, "major.minor" compute capability) of CUDA device `index`."""
    props = _check(cudart().cudaGetDeviceProperties(index), f"cudaGetDeviceProperties({index})")
    name = props.name
    if isinstance(name, bytes | bytearray):
        name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
    return str(name), f"{props.major}.{props.minor}"


def set_device(index: int) -> None:
    """Make `index` the current device of the calling thread (the instance's own thread)."""
    _check(cudart().cudaSetDevice(index), f"cudaSetDevice({index})")


class Stream:
    """One CUDA stream; each backend instance owns one so instances run concurrently."""

    def __init__(self) -> None:
        self._stream = _check(cudart().cudaStreamCreate(), "cudaStreamCreate")

    @property
    def handle(self) -> int:
        return int(self._stream)

    def synchronize(self) -> None:
        _check(cudart().cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def to_device(self, pointer: int, array: np.ndarray) -> None:
        if array.nbytes:
            rt = cudart()
            kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
            _check(rt.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, kind, self._stream),
                   "cudaMemcpyAsync(host to device)")

    def to_host(self, array: np.ndarray, pointer: int) -> None:
        if array.nbytes:
            rt = cudart()
            kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
            _check(rt.cudaMemcpyAsync(array.ctypes.data, pointer, array.nbytes, kind, self._stream),
                   "cudaMemcpyAsync(device to host)")

    def destroy(self) -> None:
        if self._stream is not None:
            _check(cudart().cudaStreamDestroy(self._stream), "cudaStreamDestroy")
            self._stream = None


class DeviceBuffers:
    """Device memory per tensor name, grown (never shrunk) to the largest request seen, so
    steady-state inference allocates nothing."""

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[int, int]] = {}

    def get(self, name: str, nbytes: int) -> int:
        # TensorRT wants a valid address even for an empty tensor.
        nbytes = max(nbytes, 1)
        pointer, size = self._buffers.get(name, (0, 0))
        if size >= nbytes:
            return pointer
        if pointer:
            _check(cudart().cudaFree(pointer), "cudaFree")
            del self._buffers[name]
        pointer = int(_check(cudart().cudaMalloc(nbytes), f"cudaMalloc({nbytes}) for {name!r}"))
        self._buffers[name] = (pointer, nbytes)
        return pointer

    def free(self) -> None:
        for pointer, _ in self._buffers.values():
            _check(cudart().cudaFree(pointer), "cudaFree")
        self._buffers.clear()
