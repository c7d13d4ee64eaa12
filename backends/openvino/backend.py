"""OpenVINO backend: OpenVINO IR (`model.xml` + `model.bin`) or ONNX models on CPU, Intel GPU, NPU.

Each instance owns its own `ov.Core`, so device properties (threads, streams, cache dir) set
here never leak into another model or instance. An instance runs one synchronous
`InferRequest` on its own executor thread: the daemon's instance count is the parallelism,
and OpenVINO's thread pool is capped at `InstanceContext.threads` so N instances don't
oversubscribe the cores.

Model parameters (config.pbtxt `parameters` or model.toml `[parameters]`, all strings):

    inference_precision  f32 | bf16 | f16: the precision the device computes in. Default f32
                         on the CPU on every CPU: OpenVINO's own default is bf16 on CPUs with
                         AMX / avx512_bf16, so the same model would give different numbers on
                         different machines. bf16/f16 is an opt-in; a device that cannot
                         compute in it is a load error naming this parameter, never a silent
                         fallback. GPU/NPU keep their plugin's default (f16) unless it is set.
    performance_hint     LATENCY (default) | THROUGHPUT | CUMULATIVE_THROUGHPUT
    num_streams          CPU streams per instance (default 1)
    device               CPU, GPU, GPU.1, NPU, AUTO... (default: CPU, AUTO with several devices)

The precision actually compiled is read back from the compiled model and reported by
`describe()` (model metadata).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np
import openvino as ov

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

# Artifact names this backend reads, in order of preference (same order as manifest.toml).
ARTIFACTS = ("model.xml", "model.onnx")

# OpenVINO element type name (`ov.Type.get_type_name()`) -> KServe datatype.
KSERVE_TYPES: dict[str, str] = {
    "boolean": "BOOL",
    "u8": "UINT8",
    "u16": "UINT16",
    "u32": "UINT32",
    "u64": "UINT64",
    "i8": "INT8",
    "i16": "INT16",
    "i32": "INT32",
    "i64": "INT64",
    "f16": "FP16",
    "f32": "FP32",
    "f64": "FP64",
    "bf16": "BF16",
    "string": "BYTES",
}

# OpenVINO takes at most one stream per CPU core; the bound only keeps an absurd value from
# reaching the plugin.
MAX_STREAMS = 512
PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")

# `inference_precision` values -> the CPU plugin's OPTIMIZATION_CAPABILITIES entry that says the
# CPU can compute in it (f32 always can).
PRECISIONS: dict[str, str] = {"f32": "FP32", "bf16": "BF16", "f16": "FP16"}
DEFAULT_PRECISION = "f32"

# What autocomplete picks when every input and output has a dynamic first dimension and the
# config says nothing about batching (same default as the ONNX Runtime backend).
AUTO_MAX_BATCH_SIZE = 8


class _Port(msgspec.Struct, frozen=True):
    """One model input or output, as this backend addresses it."""

    index: int
    # The name requests and responses use: the config's name for the tensor when it gave one.
    name: str
    # Every tensor name OpenVINO knows the port by (IRs converted from TF often have several).
    aliases: frozenset[str]
    datatype: str
    # -1 for a dynamic dimension; None when even the rank is dynamic.
    dims: tuple[int, ...] | None


class OpenVinoBackend(TensorBackend):
    name: ClassVar[str] = "openvino"
    # queued_execute: `infer` copies its outputs out of the request's reused buffers.
    capabilities: ClassVar[Capabilities] = Capabilities(
        datatypes=frozenset(KSERVE_TYPES.values()), queued_execute=True, ragged_batching="merged"
    )

    def __init__(self, context: InstanceContext) -> None:
        super().__init__(context)
        self.device = ""
        self.model_path: Path | None = None
        self.compiled_model: ov.CompiledModel | None = None
        self._core: ov.Core | None = None
        self._request: ov.InferRequest | None = None
        self._inputs: list[_Port] = []
        # Every alias of every input -> its port, so a request may use any of the names.
        self._input_by_name: dict[str, _Port] = {}
        self._outputs: list[_Port] = []
        self._share_outputs = True
        # What was compiled, for describe(): read back from the compiled model.
        self._effective: dict[str, str] = {}

    # ------------------------------------------------------------------ metadata

    @classmethod
    def probe(cls) -> Probe:
        try:
            devices = tuple(ov.Core().available_devices)
        except Exception as exc:  # a broken driver stack must not take the daemon down
            return Probe(available=False, reason=f"OpenVINO Core failed to start: {exc}")
        if not devices:
            return Probe(available=False, reason="OpenVINO reports no devices")
        return Probe(available=True, devices=devices, runtime_version=ov.get_version())

    @classmethod
    def autocomplete(cls, config: ModelConfig, artifact: Path) -> ModelConfig:
        path = _artifact_file(artifact, config)
        model_name = config.name or path.parent.parent.name  # <model>/<version>/<file>
        model = _read_model(ov.Core(), path, model_name, device="")
        made = config.batch_input_targets()
        # A batch input is the daemon's to feed, not a request's.
        inputs = [p for p in _describe_all(model.inputs, model_name) if not p.aliases & made.keys()]
        outputs = _describe_all(model.outputs, model_name)
        batch = config.max_batch_size
        if batch == 0 and not config.input and all(_batchable(p) for p in inputs + outputs):
            batch = AUTO_MAX_BATCH_SIZE
        return msgspec.structs.replace(
            config,
            max_batch_size=batch,
            input=config.input or [_tensor_config(p, batch > 0) for p in inputs],
            output=config.output or [_tensor_config(p, batch > 0) for p in outputs],
        )

    # ------------------------------------------------------------------ lifecycle

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        model_name = config.name or self.context.model_name
        path = _artifact_file(artifact, config)
        hint = config.parameters.get("performance_hint", "LATENCY").upper()
        if hint not in PERFORMANCE_HINTS:
            raise ConfigError(
                f"model {model_name!r}: parameter performance_hint={hint!r} must be one of "
                f"{list(PERFORMANCE_HINTS)}"
            )
        # One stream per instance by default: an instance runs one synchronous request at a
        # time, so more streams would only split its threads (the daemon's instance count is the
        # parallelism knob).
        streams = config.int_parameter("num_streams", 1, minimum=1, maximum=MAX_STREAMS)
        precision = _precision_parameter(config, model_name)

        core = ov.Core()
        self.device = _choose_device(_openvino_device(device), config, core.available_devices)
        if self.context.state_dir is not None:
            # Compiled blobs are cached per model: a reload (or the next start) imports the blob
            # instead of recompiling, which matters most on GPU/NPU.
            cache = self.context.state_dir / "ov_cache"
            cache.mkdir(parents=True, exist_ok=True)
            core.set_property({"CACHE_DIR": str(cache)})
        if "CPU" in core.available_devices:
            # Set on the CPU plugin rather than in compile_model's config so it also applies when
            # AUTO/HETERO pick the CPU; other plugins reject these keys.
            core.set_property(
                "CPU",
                {
                    "INFERENCE_NUM_THREADS": max(self.context.threads, 0),
                    "NUM_STREAMS": streams,
                    # Never the CPU's choice (bf16 on AMX / avx512_bf16 CPUs): the model's.
                    "INFERENCE_PRECISION_HINT": precision or DEFAULT_PRECISION,
                },
            )
            if precision is not None and self.device == "CPU":
                _check_cpu_precision(core, precision, model_name)

        model = _read_model(core, path, model_name, self.device)
        # Ragged inputs reach the model in one dimension (the batch's elements end to end),
        # batch inputs in one or two (BATCH_ITEM_SHAPE); neither has a batch dimension.
        made = config.batch_input_targets()
        ranks = {name: ("sets allow_ragged_batch", 1) for name in config.ragged_inputs()}
        ranks |= {target: (f"is a batch input ({b.kind})", b.rank) for target, b in made.items()}
        if config.max_batch_size > 0:
            _make_batch_dynamic(model, config.max_batch_size, model_name, path, ranks)
        inputs = _describe_all(model.inputs, model_name, [*(t.name for t in config.input), *made])
        outputs = _describe_all(model.outputs, model_name, [t.name for t in config.output])
        # Fail at load, not at the first request, when the config names tensors the model lacks.
        _check_config_names("input", inputs, config.input, model_name, path)
        _check_config_names("output", outputs, config.output, model_name, path)
        _check_batch_inputs(config, inputs, model_name, path)
        compile_config: dict[str, Any] = {"PERFORMANCE_HINT": hint}
        if precision is not None or self.device == "CPU":
            # Also in the compile config (not only on the CPU plugin): it is then part of the
            # compiled-blob cache key, and a GPU/NPU gets the model's explicit choice.
            compile_config["INFERENCE_PRECISION_HINT"] = precision or DEFAULT_PRECISION
        try:
            compiled = core.compile_model(model, self.device, compile_config)
            request = compiled.create_infer_request()
        except Exception as exc:
            hint_note = (
                f" with parameter inference_precision={precision!r}" if precision is not None else ""
            )
            raise BackendError(
                f"cannot compile model {model_name!r} ({path}) for device "
                f"{self.device!r}{hint_note} (available: {core.available_devices}): {exc}"
            ) from exc
        effective = _compiled_precision(compiled, core)
        if precision is not None and effective not in (precision, ""):
            # The CPU plugin ignores a precision the CPU cannot compute in; never serve
            # numbers the model did not ask for.
            raise ConfigError(
                f"model {model_name!r}: parameter inference_precision={precision!r}, but device "
                f"{self.device!r} compiled the model in {effective}; this device cannot compute "
                f"in {precision} (remove the parameter or use f32)"
            )
        self._core = core
        self.model_path = path
        self.compiled_model = compiled
        self._request = request
        self._inputs = inputs
        self._input_by_name = {alias: port for port in inputs for alias in port.aliases}
        self._outputs = outputs
        self._share_outputs = all(p.datatype != "BYTES" for p in outputs)
        self._effective = {
            "device": self.device,
            "execution_devices": ",".join(_property(compiled, "EXECUTION_DEVICES", [])),
            "inference_precision": effective or "unknown",
            "performance_hint": str(_property(compiled, "PERFORMANCE_HINT", hint)),
        }

    def describe(self) -> dict[str, str]:
        return dict(self._effective)

    def unload_sync(self) -> None:
        # Drop in dependency order: the request holds the compiled model, which holds the core.
        self._request = None
        self.compiled_model = None
        self._core = None
        self._effective = {}

    # ------------------------------------------------------------------ inference

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        request = self._request
        if request is None:
            raise BackendError(f"openvino: model {self.context.model_name!r} is not loaded")
        model_name = self.context.model_name
        feed: dict[int, Any] = {}
        for name, array in inputs.items():
            port = self._input_by_name.get(name)
            if port is None:
                raise InvalidArgument(
                    f"model {model_name!r} has no input {name!r}; "
                    f"inputs are {[p.name for p in self._inputs]}"
                )
            feed[port.index] = _to_runtime(array, port, model_name)
        if len(feed) < len(self._inputs):
            missing = [p.name for p in self._inputs if p.index not in feed]
            raise InvalidArgument(f"model {model_name!r}: missing input(s) {missing}")
        # share_inputs: no copy of the request's arrays into OpenVINO tensors. share_outputs: the
        # returned dict is unused (outputs are read and copied below, because the request reuses
        # its buffers), so don't let it copy either; string outputs can't be shared (OpenVINO
        # warns on every call if asked) and need no decoding to str.
        request.infer(
            feed, share_inputs=True, share_outputs=self._share_outputs, decode_strings=False
        )
        return {port.name: _from_runtime(request.get_output_tensor(port.index)) for port in self._outputs}


# ---------------------------------------------------------------------- module helpers


def _artifact_file(artifact: Path, config: ModelConfig) -> Path:
    """The model file: `artifact` itself, or the preferred artifact inside a version directory."""
    if not artifact.is_dir():
        return artifact
    names = (config.default_model_filename,) if config.default_model_filename else ARTIFACTS
    for name in names:
        if (artifact / name).is_file():
            return artifact / name
    raise BackendError(f"no {' or '.join(names)} in {artifact}")


def _read_model(core: ov.Core, path: Path, model_name: str, device: str) -> ov.Model:
    where = f" for device {device!r}" if device else ""
    if path.suffix == ".xml" and not path.with_suffix(".bin").is_file():
        raise BackendError(
            f"model {model_name!r}: {path.with_suffix('.bin')} (the weights of {path.name}) "
            "is missing"
        )
    try:
        return core.read_model(str(path))
    except Exception as exc:
        raise BackendError(f"cannot read model {model_name!r} from {path}{where}: {exc}") from exc


def _precision_parameter(config: ModelConfig, model_name: str) -> str | None:
    """The model's `inference_precision`, lower-cased; None when the config does not set it."""
    raw = config.parameters.get("inference_precision", "").strip().lower()
    if not raw:
        return None
    if raw not in PRECISIONS:
        raise ConfigError(
            f"model {model_name!r}: parameter inference_precision={raw!r} must be one of "
            f"{list(PRECISIONS)}"
        )
    return raw


def _check_cpu_precision(core: ov.Core, precision: str, model_name: str) -> None:
    """Fail before compiling when the CPU cannot compute in the precision the model asks for."""
    capabilities = [str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
    if PRECISIONS[precision] not in capabilities:
        raise ConfigError(
            f"model {model_name!r}: parameter inference_precision={precision!r}: this CPU cannot "
            f"compute in {precision} (OpenVINO CPU capabilities: {capabilities}); remove the "
            "parameter or use f32"
        )


def _compiled_precision(compiled: ov.CompiledModel, core: ov.Core) -> str:
    """The precision the model was compiled in ("f32", "bf16", "f16"); "" when unknown.

    AUTO's compiled model does not expose the property: then it is the precision each device
    that AUTO runs the model on is configured with, when they all agree.
    """
    value = _property(compiled, "INFERENCE_PRECISION_HINT", None)
    if value is None:
        devices = [str(d).split("(")[0].strip() for d in _property(compiled, "EXECUTION_DEVICES", [])]
        values = set()
        for device in filter(None, devices):
            try:
                values.add(_type_name(core.get_property(device, "INFERENCE_PRECISION_HINT")))
            except Exception:  # a device plugin without the property: unknown
                return ""
        return values.pop() if len(values) == 1 else ""
    return _type_name(value)


def _type_name(value: Any) -> str:
    return (value.get_type_name() if isinstance(value, ov.Type) else str(value)).lower()


def _property(compiled: ov.CompiledModel, key: str, default: Any) -> Any:
    # AUTO and some device plugins do not expose every property of their compiled models.
    try:
        return compiled.get_property(key)
    except Exception:
        return default


def _openvino_device(device: Device) -> str:
    """OpenVINO's name for the device selection chose ("" = let the config or AUTO decide)."""
    names = {"auto": "", "cpu": "CPU", "gpu:intel": f"GPU.{device.index}", "npu": "NPU"}
    if device.kind not in names:
        raise ConfigError(f"openvino cannot run on {device}")
    return names[device.kind]


def _choose_device(requested: str, config: ModelConfig, available: list[str]) -> str:
    """The load argument wins, then the `device` config parameter, then AUTO/CPU."""
    device = (requested or config.parameters.get("device", "")).strip().upper()
    if device:
        return device
    # AUTO only earns its keep when it has something to choose between.
    return "AUTO" if len(available) > 1 else "CPU"


def _make_batch_dynamic(
    model: ov.Model, max_batch_size: int, model_name: str, path: Path, ranks: Mapping[str, tuple[str, int]]
) -> None:
    """Give every input a first dimension of 1..max_batch_size so merged batches fit, and
    those in `ranks` (name -> why, rank) dimensions of any length and no batch dimension.

    A bounded dimension (not just -1) lets GPU/NPU plugins plan memory for the largest batch.
    """
    shapes: dict[int, ov.PartialShape] = {}
    for i, port in enumerate(model.inputs):
        shape = port.get_partial_shape()
        flat = next((ranks[name] for name in port.get_names() if name in ranks), None)
        if flat is not None:
            why, rank = flat
            if shape.rank.is_static and len(shape) != rank:
                raise ConfigError(
                    f"model {model_name!r}: input {port.get_any_name()!r} {why}, so {path.name} must take "
                    f"it with {rank} dimension(s) of any length; it has shape {shape}"
                )
            shapes[i] = ov.PartialShape([-1] * rank)
            continue
        if shape.rank.is_dynamic or len(shape) == 0:
            raise BackendError(
                f"model {model_name!r} ({path.name}): input {port.get_names() or i} "
                "has no batch dimension; set max_batch_size to 0"
            )
        dims = [ov.Dimension(1, max_batch_size), *list(shape)[1:]]
        shapes[i] = ov.PartialShape(dims)
    try:
        model.reshape(shapes)
    except Exception as exc:
        raise BackendError(
            f"model {model_name!r} ({path.name}) cannot take a dynamic batch dimension "
            f"(max_batch_size={max_batch_size}); set max_batch_size to 0: {exc}"
        ) from exc


def _check_batch_inputs(config: ModelConfig, inputs: list[_Port], model_name: str, path: Path) -> None:
    """Each batch input target is an input of the model, of the config's data type."""
    by_alias = {alias: port for port in inputs for alias in port.aliases}
    for batch_input in config.batch_input:
        for target in batch_input.target_name:
            port = by_alias.get(target)
            where = f"model {model_name!r}: batch input {target!r}"
            if port is None:
                raise ConfigError(f"{where} is not an input of {path.name} (inputs: {[p.name for p in inputs]})")
            if port.datatype != batch_input.data_type:
                raise ConfigError(
                    f"{where}: config data_type {batch_input.data_type} but {path.name} has {port.datatype}"
                )


def _describe_all(ports: list[Any], model_name: str, preferred: Collection[str] = ()) -> list[_Port]:
    return [_describe(port, i, model_name, preferred) for i, port in enumerate(ports)]


def _describe(port: Any, index: int, model_name: str, preferred: Collection[str]) -> _Port:
    """Name, KServe datatype and dims of a model input/output port (`ov.Output`)."""
    aliases = frozenset(port.get_names())
    name = next((n for n in preferred if n in aliases), "")
    if not name:
        # Tensor names are what ONNX models and IRs are addressed by; a node built without
        # tensor names still has a friendly name.
        name = port.get_any_name() if aliases else port.get_node().get_friendly_name()
    type_name = port.get_element_type().get_type_name()
    datatype = KSERVE_TYPES.get(type_name)
    if datatype is None:
        raise Unsupported(
            f"model {model_name!r}: tensor {name!r} has element type {type_name!r}, "
            "which has no KServe datatype"
        )
    shape = port.get_partial_shape()
    dims = None
    if shape.rank.is_static:
        dims = tuple(d.get_length() if d.is_static else -1 for d in shape)
    return _Port(index=index, name=name, aliases=aliases | {name}, datatype=datatype, dims=dims)


def _check_config_names(
    kind: str, ports: list[_Port], wanted: list[TensorConfig], model_name: str, path: Path
) -> None:
    known = {alias for port in ports for alias in port.aliases}
    for tensor in wanted:
        if tensor.name not in known:
            raise ConfigError(
                f"model {model_name!r}: config {kind} {tensor.name!r} is not an {kind} of "
                f"{path.name} ({kind}s: {[p.name for p in ports]})"
            )


def _batchable(port: _Port) -> bool:
    return port.dims is not None and len(port.dims) > 0 and port.dims[0] == -1


def _tensor_config(port: _Port, batched: bool) -> TensorConfig:
    dims = list(port.dims) if port.dims is not None else [-1]
    if batched and port.dims:
        dims = dims[1:]
    return TensorConfig(name=port.name, data_type=port.datatype, dims=dims)


def _to_runtime(array: np.ndarray, port: _Port, model_name: str) -> Any:
    """The value handed to `InferRequest.infer` for one input."""
    if port.datatype == "BYTES":
        if array.dtype.kind not in ("O", "S", "U"):
            raise InvalidArgument(f"model {model_name!r}: input {port.name!r} expects BYTES, got {array.dtype}")
        # OpenVINO builds string tensors from numpy bytes/str arrays, not object arrays.
        values = [v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)]
        tensor = ov.Tensor(ov.Type.string, ov.Shape(list(array.shape)))
        tensor.bytes_data = values
        return tensor
    if port.datatype == "BF16":
        # BF16 travels as uint16 bit patterns (daemon.backend.NUMPY_DTYPES); OpenVINO takes the
        # same bits when told the element type.
        if array.dtype != np.uint16:
            raise InvalidArgument(f"model {model_name!r}: input {port.name!r} expects BF16 as uint16 bits")
        return ov.Tensor(np.ascontiguousarray(array), ov.Shape(list(array.shape)), ov.Type.bf16)
    expected = NUMPY_DTYPES[port.datatype]
    if array.dtype != expected:
        raise InvalidArgument(
            f"model {model_name!r}: input {port.name!r} expects {port.datatype}, got {array.dtype}"
        )
    return np.ascontiguousarray(array)


def _from_runtime(tensor: ov.Tensor) -> np.ndarray:
    """A numpy copy of an output tensor (the request reuses its output buffers)."""
    type_name = tensor.get_element_type().get_type_name()
    shape = tuple(tensor.shape)
    if type_name == "string":
        # bytes_data is a fresh numpy `S` array (so trailing NUL bytes are lost, as in numpy);
        # the daemon's BYTES convention is an object array of `bytes`.
        return np.asarray(tensor.bytes_data).astype(np.object_).reshape(shape)
    if type_name == "bf16":
        # OpenVINO labels bf16 data as float16; the bits are what the daemon wants.
        return np.array(tensor.data.view(np.uint16), copy=True)
    return np.array(tensor.data, copy=True)
