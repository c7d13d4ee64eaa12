"""TensorRT backend: runs a serialized engine (`model.plan`) on one NVIDIA GPU per instance.

Load order, so that a wrong engine is refused cheaply and the next candidate takes over:
1. pick the GPU ("GPU:<n>" hint, else instance_group gpus, else 0) and read its compute
   capability;
2. compare with `model.plan.json` (what the engine was built for) — refuse with both sides
   named before deserializing;
3. deserialize; TensorRT's own refusal (no sidecar, wrong version) is reported with the
   errors its logger printed;
4. describe the engine's I/O tensors (names, types, shapes, optimization profile 0) and check
   them against the config.

Inference binds host arrays to per-instance device buffers, runs `execute_async_v3` on the
instance's own CUDA stream and copies the outputs back. The CUDA calls live in cuda_mem.py,
every decision that needs no GPU in engine_io.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from daemon.backend import (
    BackendError,
    Capabilities,
    ConfigError,
    Device,
    Fit,
    FitRequest,
    InstanceContext,
    InvalidArgument,
    ModelConfig,
    Probe,
    TensorBackend,
    Unsupported,
)

from . import cuda_mem, engine_io
from .engine_io import IoTensor
from .sidecar import SIDECAR_SUFFIX, engine_mismatch, read_engine_sidecar

log = logging.getLogger(__name__)


def _tensorrt_version() -> str:
    """The importable TensorRT's version, or "" when it is absent or does not import."""
    try:
        import tensorrt

        return str(tensorrt.__version__)
    except Exception as exc:  # present but broken (missing libnvinfer): treat as absent
        log.debug("tensorrt does not import: %s", exc)
        return ""


def _make_logger(trt: Any) -> Any:
    """A TensorRT logger that keeps the errors, so a refusal can say what TensorRT said."""

    class CollectingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            if level <= int(trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                log.error("TensorRT: %s", msg)
            elif level == int(trt.ILogger.Severity.WARNING):
                log.warning("TensorRT: %s", msg)

    return CollectingLogger()


def _deserialize(trt: Any, runtime: Any, logger: Any, artifact: Path, where: str) -> Any:
    """ICudaEngine from a plan file; BackendError with TensorRT's own words on failure."""
    sidecar = read_engine_sidecar(artifact)
    if sidecar is not None and sidecar.version_compatible:
        # Version-compatible plans embed a lean runtime that must be allowed to run.
        runtime.engine_host_code_allowed = True
    try:
        data = artifact.read_bytes()
    except OSError as exc:
        raise BackendError(f"tensorrt: {where}: cannot read {artifact}: {exc}") from exc
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:
        said = "; ".join(logger.errors[-3:]) or "no details"
        raise BackendError(
            f"tensorrt: {where}: TensorRT {trt.__version__} could not deserialize {artifact} "
            f"(engines run only on the GPU architecture and TensorRT version that built them; "
            f"TensorRT said: {said})"
        )
    return engine


def describe_engine(trt: Any, engine: Any, where: str) -> list[IoTensor]:
    """The engine's I/O tensors; Unsupported for what plain device buffers cannot feed."""
    tensors: list[IoTensor] = []
    profiles = int(engine.num_optimization_profiles)
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        if is_input and engine.is_shape_inference_io(name):
            raise Unsupported(f"tensorrt: {where}: input {name!r} is a shape tensor (host memory), which is not supported")
        if engine.get_tensor_format(name) != trt.TensorFormat.LINEAR:
            raise Unsupported(
                f"tensorrt: {where}: tensor {name!r} uses a vectorized format "
                f"({engine.get_tensor_format_desc(name)}); rebuild with linear I/O formats"
            )
        datatype = engine_io.kserve_datatype(engine.get_tensor_dtype(name).name, name)
        shape = tuple(int(d) for d in engine.get_tensor_shape(name))
        profile = None
        if is_input and -1 in shape and profiles > 0:
            low, opt, high = engine.get_tensor_profile_shape(name, 0)
            profile = (tuple(int(d) for d in low), tuple(int(d) for d in opt), tuple(int(d) for d in high))
        tensors.append(IoTensor(name, is_input, datatype, shape, profile))
    return tensors


def _load_engine(model: str, artifact: Path, gpu: int) -> tuple[Any, Any, Any, list[IoTensor]]:
    """(runtime, logger, engine, tensors) on GPU `gpu` of the calling thread, refusing an
    engine built for another GPU or TensorRT before deserializing it."""
    import tensorrt as trt

    where = f"model {model!r}"
    cuda_mem.set_device(gpu)
    gpu_name, capability = cuda_mem.device_properties(gpu)
    error = engine_io.compatibility_error(model, artifact, f"GPU {gpu} {gpu_name}", capability, trt.__version__)
    if error is not None:
        raise error
    logger = _make_logger(trt)
    runtime = trt.Runtime(logger)
    engine = _deserialize(trt, runtime, logger, artifact, where)
    return runtime, logger, engine, describe_engine(trt, engine, where)


class TensorRtBackend(TensorBackend):
    name: ClassVar[str] = "tensorrt"
    capabilities: ClassVar[Capabilities] = Capabilities(
        kind="tensor",
        dynamic_batching=True,
        datatypes=frozenset(engine_io.TRT_TO_KSERVE.values()),
    )

    def __init__(self, context: InstanceContext) -> None:
        super().__init__(context)
        self._runtime: Any = None
        self._logger: Any = None
        self._engine: Any = None
        self._context: Any = None
        self._stream: cuda_mem.Stream | None = None
        self._buffers = cuda_mem.DeviceBuffers()
        self._inputs: list[IoTensor] = []
        self._outputs: list[IoTensor] = []
        self.gpu = -1

    @classmethod
    def probe(cls) -> Probe:
        version = _tensorrt_version()
        if not version:
            return Probe(
                available=False,
                reason="the TensorRT Python package is not installed or does not import "
                "(pip install tensorrt, on a machine with an NVIDIA GPU)",
            )
        count, problem = cuda_mem.device_count()
        if problem or count == 0:
            return Probe(available=False, reason=problem or "no CUDA device", runtime_version=version)
        return Probe(available=True, devices=tuple(f"GPU:{i}" for i in range(count)), runtime_version=version)

    @classmethod
    def fit(cls, request: FitRequest) -> Fit:
        """An engine runs only where it was built for (the sidecar says so, before any CUDA
        call); in automatic mode only on datacenter GPUs, where a pre-built engine is the
        expected path; naming the backend (backend_preference) opts in on any NVIDIA GPU."""
        eligible = [gpu for gpu in request.gpus if request.requested or gpu.datacenter]
        if not eligible:
            found = ", ".join(f"GPU {g.index} {g.name}" for g in request.gpus) or "no GPU"
            hint = "; list tensorrt in backend_preference to use it anyway" if request.gpus else ""
            return Fit(problem=f"no NVIDIA datacenter GPU (found: {found}){hint}")
        plan = request.artifact
        try:
            sidecar = read_engine_sidecar(plan)
        except ConfigError as exc:
            return Fit(problem=f"unreadable engine sidecar: {exc.message}")
        if sidecar is None and request.requested:
            # The model insists on TensorRT: the load-time check judges the engine itself.
            gpu = eligible[0]
            return Fit(
                reason=f"no {plan.name}{SIDECAR_SUFFIX}; asked for by the config, on GPU {gpu.index} {gpu.name}",
                device=Device("gpu:nvidia", gpu.index),
            )
        if sidecar is None:
            return Fit(
                problem=f"{plan.name} has no {plan.name}{SIDECAR_SUFFIX} saying which GPU and "
                "TensorRT version built it (build_engine.py writes one)"
            )
        problems = []
        for gpu in eligible:
            problem = engine_mismatch(
                sidecar, gpu.compute_capability, gpu.name, request.hardware.tensorrt_version
            )
            if not problem:
                tier = "datacenter GPU" if gpu.datacenter else "GPU, opted in by backend_preference"
                return Fit(
                    reason=f"engine for {gpu.sm}/TensorRT {sidecar.tensorrt_version} matches "
                    f"GPU {gpu.index} {gpu.name} ({tier})",
                    device=Device("gpu:nvidia", gpu.index),
                )
            problems.append(problem)
        return Fit(problem="; ".join(dict.fromkeys(problems)))

    @classmethod
    def autocomplete(cls, config: ModelConfig, artifact: Path) -> ModelConfig:
        if config.input and config.output:
            return config  # nothing to fill: skip deserializing the engine twice
        gpu = engine_io.device_index(Device(), config, 0)
        _, _, engine, tensors = _load_engine(config.name, artifact, gpu)
        del engine
        return engine_io.complete_config(config, tensors)

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        model = self.context.model_name
        self.gpu = engine_io.device_index(device, config, self.context.instance_index)
        self._runtime, self._logger, self._engine, tensors = _load_engine(model, artifact, self.gpu)
        engine_io.check_config(config, tensors, model)
        self._inputs = [t for t in tensors if t.is_input]
        self._outputs = [t for t in tensors if not t.is_input]
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise BackendError(
                f"tensorrt: model {model!r}: cannot create an execution context on GPU {self.gpu} "
                "(out of GPU memory?)"
            )
        self._stream = cuda_mem.Stream()
        if self._engine.num_optimization_profiles > 1:
            log.info("model %s: engine has %d optimization profiles; using profile 0",
                     model, self._engine.num_optimization_profiles)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self._stream is not None, "infer before load"
        stream, context = self._stream, self._context
        host_inputs: list[np.ndarray] = []  # alive until the stream is synchronized
        for tensor in self._inputs:
            array = inputs.get(tensor.name)
            if array is None:
                raise InvalidArgument(f"missing input {tensor.name!r} for model {self.context.model_name!r}")
            engine_io.check_input(tensor, array)
            array = np.ascontiguousarray(array)
            if not context.set_input_shape(tensor.name, array.shape):
                raise InvalidArgument(f"TensorRT rejected shape {list(array.shape)} for input {tensor.name!r}")
            pointer = self._buffers.get(tensor.name, array.nbytes)
            context.set_tensor_address(tensor.name, pointer)
            stream.to_device(pointer, array)
            host_inputs.append(array)
        results: dict[str, np.ndarray] = {}
        for tensor in self._outputs:
            shape = tuple(int(d) for d in context.get_tensor_shape(tensor.name))
            if any(d < 0 for d in shape):
                raise Unsupported(
                    f"tensorrt: output {tensor.name!r} has a data-dependent shape {list(shape)}, "
                    "which this backend does not support"
                )
            out = np.empty(shape, dtype=engine_io.numpy_dtype(tensor.datatype))
            pointer = self._buffers.get(tensor.name, out.nbytes)
            context.set_tensor_address(tensor.name, pointer)
            results[tensor.name] = out
        if not context.execute_async_v3(stream.handle):
            raise BackendError(f"tensorrt: model {self.context.model_name!r}: execute_async_v3 failed")
        for name, out in results.items():
            stream.to_host(out, self._buffers.get(name, out.nbytes))
        stream.synchronize()
        return results

    def unload_sync(self) -> None:
        # Context before engine before runtime: each one depends on the next.
        self._context = None
        self._engine = None
        self._runtime = None
        self._logger = None
        self._buffers.free()
        if self._stream is not None:
            self._stream.destroy()
            self._stream = None
