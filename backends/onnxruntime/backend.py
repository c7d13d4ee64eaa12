"""ONNX Runtime backend: `model.onnx` on CPU, or on NVIDIA GPUs through the CUDA/TensorRT EPs.

Each instance owns one `InferenceSession` and calls it only from its own executor thread. The
daemon's instance count is the parallelism, so a session gets `InstanceContext.threads` intra-op
threads and one inter-op thread, sequential execution and full graph optimization: Triton's ORT
backend leaves ORT's defaults (a pool as wide as the machine per session), which is why several
instances there run 2-3x slower than standalone ORT on a CPU. Config `parameters` use the names of
Triton's ORT backend (`intra_op_thread_count`, `inter_op_thread_count`, `enable_mem_pattern`) so
existing configs keep their tuning.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np
import onnxruntime as ort

from daemon.backend import (
    NUMPY_DTYPES,
    BackendError,
    Capabilities,
    ConfigError,
    Device,
    InstanceContext,
    InvalidArgument,
    ModelConfig,
    Probe,
    TensorBackend,
    TensorConfig,
    Unsupported,
)

ARTIFACT = "model.onnx"

log = logging.getLogger(__name__)

# ONNX Runtime's NodeArg.type strings -> KServe datatype. BF16 is left out: numpy has no bfloat16,
# so ORT's Python API can neither take nor return it.
KSERVE_TYPES: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}

# What autocomplete picks when every input and output has a dynamic first dimension and the
# config says nothing about batching. Triton's ORT backend uses 4 when it enables batching on its
# own; 8 matches Triton's `simple` example and the OpenVINO backend, so one model autocompletes
# the same on either backend.
AUTO_MAX_BATCH_SIZE = 8
# The most threads a pool may be given (ggml's limit too): ONNX Runtime asked for 100 000
# crashed the process creating them.
MAX_THREADS = 512

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
TENSORRT_PROVIDER = "TensorrtExecutionProvider"


class _Port(msgspec.Struct, frozen=True):
    """One model input or output, as ONNX Runtime describes it."""

    name: str
    datatype: str
    # -1 for a symbolic or unknown dimension.
    dims: tuple[int, ...]


class OnnxRuntimeBackend(TensorBackend):
    name: ClassVar[str] = "onnxruntime"
    capabilities: ClassVar[Capabilities] = Capabilities(
        datatypes=frozenset(KSERVE_TYPES.values()), queued_execute=True, ragged_batching="merged"
    )

    def __init__(self, context: InstanceContext) -> None:
        super().__init__(context)
        self.session: ort.InferenceSession | None = None
        self.model_path: Path | None = None
        self._inputs: dict[str, _Port] = {}
        # Outputs session.run computes: the config's outputs (a subset skips the rest of the
        # graph), or all of the model's.
        self._output_names: list[str] = []

    # ------------------------------------------------------------------ metadata

    @classmethod
    def probe(cls) -> Probe:
        providers = ort.get_available_providers()
        # A CUDA EP in the build means onnxruntime-gpu is installed; whether a GPU is really
        # present shows at load, which fails over to the next backend when it is not.
        devices = ("CPU", "GPU") if CUDA_PROVIDER in providers else ("CPU",)
        return Probe(
            available=True,
            devices=devices,
            runtime_version=f"{ort.__version__} ({', '.join(providers)})",
        )

    @classmethod
    def autocomplete(cls, config: ModelConfig, artifact: Path) -> ModelConfig:
        path = _artifact_file(artifact, config)
        model_name = config.name or path.parent.parent.name
        options = ort.SessionOptions()
        # Only the graph's signature is needed: skip optimization and keep it to one thread.
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.intra_op_num_threads = 1
        session = _open_session(path, model_name, options, [CPU_PROVIDER])
        made = config.batch_input_targets()
        ports = [_describe(arg) for arg in session.get_inputs()]
        # A batch input is the daemon's to feed, not a request's.
        inputs = [p for p in ports if p.name not in made]
        outputs = [_describe(arg) for arg in session.get_outputs()]
        batch = config.max_batch_size
        if batch == 0 and not config.input and all(_batchable(p) for p in inputs + outputs):
            batch = AUTO_MAX_BATCH_SIZE
        completed = msgspec.structs.replace(
            config,
            max_batch_size=batch,
            input=config.input or [_tensor_config(p, batch > 0) for p in inputs],
            output=config.output or [_tensor_config(p, batch > 0) for p in outputs],
        )
        _check_config(completed, ports, outputs, model_name, path)
        return completed

    # ------------------------------------------------------------------ lifecycle

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        model_name = config.name or self.context.model_name
        device_name = f"GPU.{device.index}" if device.kind == "gpu:nvidia" else ""
        path = _artifact_file(artifact, config)
        options = ort.SessionOptions()
        # 0 lets ONNX Runtime choose, as in Triton.
        options.intra_op_num_threads = config.int_parameter("intra_op_thread_count", self.context.threads, maximum=MAX_THREADS)
        options.inter_op_num_threads = config.int_parameter("inter_op_thread_count", 1, maximum=MAX_THREADS)
        options.enable_mem_pattern = config.bool_parameter("enable_mem_pattern", True)
        options.graph_optimization_level = _graph_level(config)
        accelerators = config.optimization.cpu_accelerators() if config.optimization is not None else []
        if accelerators:
            # Asked for OpenVINO, which Triton's build runs inside ONNX Runtime: here the openvino
            # plugin serves such a model and this one is its fallback, on the CPU provider.
            log.warning("model %s: cpu_execution_accelerator %s: served by ONNX Runtime's CPU "
                        "provider (the plugin standing in for it could not serve it)", model_name, accelerators)
        # Parallel execution only helps graphs with independent branches and needs the inter-op
        # pool; the instance count already parallelizes requests.
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        providers = _providers(device_name, config, model_name)
        session = _open_session(path, model_name, options, providers)
        if (
            device_name.upper().startswith(("GPU", "CUDA"))
            and CUDA_PROVIDER not in session.get_providers()
        ):
            # ORT silently falls back to the CPU when the CUDA EP fails to initialize (no driver,
            # no GPU); a model placed on a GPU must not quietly run on the CPU.
            raise BackendError(
                f"model {model_name!r} ({path}) was asked for device {device!r} but "
                f"the CUDA execution provider did not initialize (session providers: "
                f"{session.get_providers()})"
            )
        inputs = [_describe(arg) for arg in session.get_inputs()]
        outputs = [_describe(arg) for arg in session.get_outputs()]
        _check_config(config, inputs, outputs, model_name, path)
        self.session = session
        self.model_path = path
        self._inputs = {p.name: p for p in inputs}
        known = {p.name for p in outputs}
        wanted = [t.name for t in config.output if t.name in known]
        self._output_names = wanted or [p.name for p in outputs]

    def unload_sync(self) -> None:
        self.session = None

    # ------------------------------------------------------------------ inference

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self.session
        model_name = self.context.model_name
        if session is None:
            raise BackendError(f"onnxruntime: model {model_name!r} is not loaded")
        missing = self._inputs.keys() - inputs.keys()
        if missing:
            raise InvalidArgument(f"model {model_name!r}: missing input(s) {sorted(missing)}")
        # Only the model's own inputs go to session.run, which rejects names it does not know
        # (a config may declare inputs the graph folded away as constants).
        feed = {
            name: _to_runtime(inputs[name], port, model_name) for name, port in self._inputs.items()
        }
        results = session.run(self._output_names, feed)
        return {
            name: _from_runtime(value)
            for name, value in zip(self._output_names, results, strict=True)
        }


# ---------------------------------------------------------------------- module helpers


def _graph_level(config: ModelConfig) -> ort.GraphOptimizationLevel:
    """`optimization { graph { level } }` as Triton's ONNX Runtime backend reads it: -1 basic,
    1 extended, 2 none, anything else (unset) all. Fusions may round differently, so a config
    asking for fewer is honoured, never overridden."""
    level = config.optimization.graph.level if config.optimization and config.optimization.graph else 0
    levels = {
        -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        2: ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }
    return levels.get(level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)


def _artifact_file(artifact: Path, config: ModelConfig) -> Path:
    """The model file: `artifact` itself, or the model file inside a version directory."""
    if not artifact.is_dir():
        return artifact
    path = artifact / (config.default_model_filename or ARTIFACT)
    if not path.is_file():
        raise BackendError(f"no {path.name} in {artifact}")
    return path


def _open_session(
    path: Path, model_name: str, options: ort.SessionOptions, providers: list[Any]
) -> ort.InferenceSession:
    if not path.is_file():
        raise BackendError(f"model {model_name!r}: {path} does not exist")
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as exc:  # ORT raises its own exception types for bad files, ops, EPs
        raise BackendError(
            f"cannot load model {model_name!r} from {path}: {exc}"
        ) from exc


def _providers(device: str, config: ModelConfig, model_name: str) -> list[Any]:
    """Execution providers for a load device: "" / "CPU" / "AUTO", or "GPU", "GPU.1", "CUDA:1"."""
    wanted = device.strip().upper()
    if wanted in ("", "AUTO") or wanted.startswith("CPU"):
        return [CPU_PROVIDER]
    if not wanted.startswith(("GPU", "CUDA")):
        raise BackendError(
            f"model {model_name!r}: unknown device {device!r} (use CPU, GPU or GPU.<n>)"
        )
    available = ort.get_available_providers()
    if CUDA_PROVIDER not in available:
        raise BackendError(
            f"model {model_name!r}: device {device!r} needs the CUDA execution "
            f"provider (onnxruntime-gpu); this build has {available}"
        )
    match = re.fullmatch(r"(?:GPU|CUDA)(?:[.:](\d+))?", wanted)
    if match is None:
        raise BackendError(
            f"model {model_name!r}: cannot read a GPU index from {device!r}"
        )
    options = {"device_id": int(match.group(1) or 0)}
    providers: list[Any] = [(CUDA_PROVIDER, options), CPU_PROVIDER]
    if TENSORRT_PROVIDER in available and config.bool_parameter("enable_tensorrt", False):
        # Opt-in: TensorRT builds an engine at load (minutes for large models) unless cached.
        providers.insert(0, (TENSORRT_PROVIDER, options))
    return providers


def _describe(arg: Any) -> _Port:
    """Name, KServe datatype and dims of an `onnxruntime.NodeArg`."""
    datatype = KSERVE_TYPES.get(arg.type)
    if datatype is None:
        raise Unsupported(
            f"tensor {arg.name!r} has type {arg.type!r}, which has no KServe datatype"
        )
    # Symbolic dims come back as strings, unknown ones as None.
    dims = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in arg.shape or ())
    return _Port(name=arg.name, datatype=datatype, dims=dims)


def _batchable(port: _Port) -> bool:
    return len(port.dims) > 0 and port.dims[0] == -1


def _tensor_config(port: _Port, batched: bool) -> TensorConfig:
    dims = list(port.dims[1:] if batched else port.dims)
    return TensorConfig(name=port.name, data_type=port.datatype, dims=dims)


def _check_config(
    config: ModelConfig, inputs: list[_Port], outputs: list[_Port], model_name: str, path: Path
) -> None:
    """Fail at load, naming the tensor, when the config disagrees with the graph."""
    batched = config.max_batch_size > 0
    # Made by the daemon from the batch, or cut by the source input's shapes: not [batch, dims].
    batch_inputs = config.batch_input_targets()
    scattered = {target for b in config.batch_output for target in b.target_name}
    for kind, ports, wanted in (
        ("input", inputs, config.input),
        ("output", outputs, config.output),
    ):
        by_name = {p.name: p for p in ports}
        for tensor in wanted:
            port = by_name.get(tensor.name)
            if port is None:
                raise ConfigError(
                    f"model {model_name!r}: config {kind} {tensor.name!r} is not an {kind} of "
                    f"{path.name} ({kind}s: {sorted(by_name)})"
                )
            where = f"model {model_name!r}: {kind} {tensor.name!r}"
            if tensor.data_type != port.datatype:
                raise ConfigError(
                    f"{where}: config data_type {tensor.data_type} but {path.name} has {port.datatype}"
                )
            if tensor.allow_ragged_batch:
                _check_flat(where, port, path)
                continue
            if tensor.name in scattered:
                continue
            if batched and not _batchable(port):
                raise ConfigError(
                    f"{where}: max_batch_size is {config.max_batch_size} but the first dimension in "
                    f"{path.name} is not dynamic (shape {list(port.dims)}); set max_batch_size to 0"
                )
            model_dims = port.dims[1:] if batched else port.dims
            if tensor.reshape is None and not _dims_agree(tensor.dims, model_dims):
                shown = "without the batch dimension " if batched else ""
                raise ConfigError(
                    f"{where}: config dims {tensor.dims} do not match {path.name}'s shape "
                    f"{shown}{list(model_dims)}"
                )
    by_name = {p.name: p for p in inputs}
    for target, batch_input in batch_inputs.items():
        where = f"model {model_name!r}: batch input {target!r}"
        port = by_name.get(target)
        if port is None:
            raise ConfigError(f"{where} is not an input of {path.name} (inputs: {sorted(by_name)})")
        if port.datatype != batch_input.data_type:
            raise ConfigError(f"{where}: config data_type {batch_input.data_type} but {path.name} has {port.datatype}")
        if len(port.dims) != batch_input.rank:
            raise ConfigError(
                f"{where} ({batch_input.kind}) is a tensor of {batch_input.rank} dimension(s), but {path.name} takes one of "
                f"shape {list(port.dims)}"
            )
    if config.input:
        # A required graph input the config leaves out could never be fed by any request.
        declared = {t.name for t in config.input} | batch_inputs.keys()
        missing = [p.name for p in inputs if p.name not in declared]
        if missing:
            raise ConfigError(
                f"model {model_name!r}: {path.name} has input(s) {missing} that the config does not declare"
            )


def _check_flat(where: str, port: _Port, path: Path) -> None:
    """A ragged input reaches the graph in one dimension, the batch's elements end to end."""
    if port.dims != (-1,):
        raise ConfigError(
            f"{where} sets allow_ragged_batch, so {path.name} must take it with shape [-1], one dimension of any "
            f"length; it has shape {list(port.dims)}"
        )


def _dims_agree(config_dims: list[int], model_dims: tuple[int, ...]) -> bool:
    if len(config_dims) != len(model_dims):
        return False
    return all(c == m or c == -1 or m == -1 for c, m in zip(config_dims, model_dims, strict=True))


def _to_runtime(array: np.ndarray, port: _Port, model_name: str) -> np.ndarray:
    if port.datatype == "BYTES":
        if array.dtype.kind not in ("O", "S", "U"):
            raise InvalidArgument(
                f"model {model_name!r}: input {port.name!r} expects BYTES, got {array.dtype}"
            )
        # ONNX strings are UTF-8 text and ORT takes them as Python str objects.
        try:
            values = [
                v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)
            ]
        except UnicodeDecodeError as exc:
            raise InvalidArgument(
                f"model {model_name!r}: input {port.name!r} holds bytes that are not UTF-8, which "
                f"ONNX string tensors cannot carry: {exc}"
            ) from None
        out = np.empty(len(values), dtype=np.object_)
        out[:] = values
        return out.reshape(array.shape)
    expected = NUMPY_DTYPES[port.datatype]
    if array.dtype != expected:
        raise InvalidArgument(
            f"model {model_name!r}: input {port.name!r} expects {port.datatype}, got {array.dtype}"
        )
    return array


def _from_runtime(value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind in ("O", "U"):
        # The daemon's BYTES tensors hold bytes; ORT returns str.
        out = np.empty(array.size, dtype=np.object_)
        out[:] = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in array.reshape(-1)]
        return out.reshape(array.shape)
    return array
