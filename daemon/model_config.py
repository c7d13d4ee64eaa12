"""The normalized model configuration every layer works with.

It mirrors Triton's `ModelConfig` (field names in snake_case exactly as in config.pbtxt) so a
config.pbtxt, a native model.toml and the JSON served at `/v2/models/{m}/config` are the same
document. Datatypes are stored in KServe spelling (`FP32`, `BYTES`); the `TYPE_` prefix used by
config.pbtxt is stripped on the way in (see `normalize_datatype`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from daemon.errors import ConfigError

# KServe v2 datatype names. Order matters nowhere; membership does.
DATATYPES: frozenset[str] = frozenset(
    {
        "BOOL",
        "UINT8",
        "UINT16",
        "UINT32",
        "UINT64",
        "INT8",
        "INT16",
        "INT32",
        "INT64",
        "FP16",
        "FP32",
        "FP64",
        "BF16",
        "BYTES",
    }
)


# config.pbtxt has no field for `backend_preference`: it travels as this parameter there.
PREFERENCE_PARAMETER = "backend_preference"
# Nor for residency (`load`, `keep_alive`): in config.pbtxt they are parameters of these names.
RESIDENCY_PARAMETERS = ("load", "keep_alive")
# Sequence slots per instance (max_candidate_sequences, or a direct batcher's max_batch_size):
# the sequence batcher lists a slot each on the event loop when it starts.
MAX_SEQUENCE_SLOTS = 4096

_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|ms|s|m|h)")
_SIZE_UNITS = {
    "": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "t": 1000**4, "tb": 1000**4,
}


def lora_entries(text: str) -> list[tuple[str, str | None]]:
    """The llama.cpp backend's `lora` parameter, `path[:scale],...`: each adapter's path and
    the text of its scale (None: none given), in order; none for an empty text. The path is
    what comes before the last ':' (the backend reads the scale, the memory budget the file)."""
    out: list[tuple[str, str | None]] = []
    for item in text.split(",") if text.strip() else []:
        path, colon, scale = item.strip().rpartition(":")
        out.append((path, scale) if colon else (item.strip(), None))
    return out


def parse_keep_alive(value: str | float | int) -> float | None:
    """Ollama's keep_alive: seconds (a number) or a Go duration ("5m", "1h30m", "300ms", "0").

    Returns seconds; None = forever (any negative value, as in Ollama). ValueError otherwise.
    """
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration or a number of seconds, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if body in ("0", ""):
            if not body:
                raise ValueError("keep_alive must not be empty")
            return 0.0
        try:  # Ollama also takes a bare number of seconds as a string
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION_PART.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(
                    f"keep_alive {value!r} is not a duration (e.g. \"5m\", \"30s\", \"1h\", \"-1\")"
                ) from None
            seconds = sign * sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"keep_alive must be finite, got {value!r}")
    return None if seconds < 0 else seconds


def parse_memory_size(value: str, total: int | None = None) -> int:
    """Bytes from "6GiB", "512MiB", "2000000000" or (with `total`) a fraction "75%"."""
    text = value.strip().lower().replace(" ", "")
    if text.endswith("%"):
        if total is None:
            raise ValueError(f"{value!r}: a fraction needs the total memory")
        percent = float(text[:-1])
        if not 0 < percent <= 100:
            raise ValueError(f"{value!r}: a fraction must be in (0, 100]%")
        return int(total * percent / 100)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", text)
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"{value!r} is not a size (e.g. \"6GiB\", \"512MiB\", \"75%\")")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
    if size <= 0:
        raise ValueError(f"{value!r}: a memory size must be > 0")
    return size


def normalize_datatype(value: str) -> str:
    """`TYPE_FP32` (config.pbtxt) or `FP32` (KServe) -> `FP32`; `TYPE_STRING` -> `BYTES`."""
    name = value.upper()
    if name.startswith("TYPE_"):
        name = name[5:]
    if name == "STRING":
        name = "BYTES"
    if name not in DATATYPES:
        raise ConfigError(f"unknown data_type {value!r}; expected one of {sorted(DATATYPES)}")
    return name


def _field_datatype(value: str) -> str:
    """normalize_datatype for a Struct field: a ValueError (not ConfigError) so msgspec reports
    the field's path, e.g. `$.input[0]`."""
    try:
        return normalize_datatype(value)
    except ConfigError as exc:
        raise ValueError(exc.message) from None


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=False):
    pass


class TensorConfig(_Strict):
    name: str
    data_type: str
    # Without the batch dimension when max_batch_size > 0, like Triton. -1 = variable.
    dims: list[int]
    optional: bool = False
    # Triton `reshape { shape: [...] }`; kept so configs round-trip.
    reshape: list[int] | None = None
    # Outputs only: a file in the model directory, one class label a line, for the
    # classification extension ("score:index:label").
    label_filename: str = ""
    # Inputs only: the layout the model expects, as Triton keeps it (served in the config for
    # clients such as Triton's image_client; neither server converts the data).
    format: Literal["FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW"] = "FORMAT_NONE"
    # Inputs only (Triton's ragged batching): requests whose shapes differ in this input may
    # share a batch; a backend that merges requests concatenates it into one dimension.
    allow_ragged_batch: bool = False

    def __post_init__(self) -> None:
        self.data_type = _field_datatype(self.data_type)
        if any(d < -1 for d in self.dims):
            raise ValueError(f"tensor {self.name!r}: dims must be >= -1, got {self.dims}")


InstanceKind = Literal["KIND_AUTO", "KIND_CPU", "KIND_GPU", "KIND_MODEL"]


class RateLimiterResource(_Strict):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    # Per device (the instance's) unless global: one pool for the whole daemon.
    global_: bool = msgspec.field(default=False, name="global")
    count: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] = 0


class ModelRateLimiter(_Strict):
    """What one execution on an instance of the group holds under `--rate-limit=execution_count`
    (daemon.core.rate_limiter); ignored with the rate limiter off, as in Triton."""

    resources: list[RateLimiterResource] = []
    priority: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] = 0


class InstanceGroup(_Strict):
    # Each instance is a thread (and a runtime session) of this process: 100 000 kept a load
    # creating them for minutes, holding the model's lock. Triton sets no bound.
    count: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    kind: InstanceKind = "KIND_AUTO"
    gpus: list[int] = []
    name: str = ""
    # The daemon's host policy its instances' threads run under (daemon.core.host_policy);
    # "" = Triton's default name for the kind ("cpu", "gpu_<n>", "model").
    host_policy: str = ""
    rate_limiter: ModelRateLimiter | None = None


class QueuePolicy(_Strict):
    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"
    default_timeout_microseconds: Annotated[int, msgspec.Meta(ge=0)] = 0
    allow_timeout_override: bool = False
    # 0 = unbounded, like Triton.
    max_queue_size: Annotated[int, msgspec.Meta(ge=0)] = 0


class DynamicBatching(_Strict):
    preferred_batch_size: list[int] = []
    max_queue_delay_microseconds: Annotated[int, msgspec.Meta(ge=0)] = 0
    preserve_ordering: bool = False
    # The batcher keeps a queue per level and walks them to form each batch: 2**64-1 levels
    # blocked the event loop for 35 s building them, then a MemoryError. Triton bounds it
    # only by uint64.
    priority_levels: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    default_priority_level: Annotated[int, msgspec.Meta(ge=0)] = 0
    default_queue_policy: QueuePolicy | None = None
    priority_queue_policy: dict[int, QueuePolicy] = {}

    def __post_init__(self) -> None:
        # Triton's texts (model_config_utils): with levels, every level named is one of them.
        levels = self.priority_levels
        if levels and not 1 <= self.default_priority_level <= levels:
            raise ValueError(f"default priority level must be in range [1, {levels}]")
        if levels and any(not 1 <= level <= levels for level in self.priority_queue_policy):
            raise ValueError(f"priority queue policy must have priority level in range [1, {levels}]")


ControlKind = Literal[
    "CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_READY", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_CORRID"
]


class SequenceControl(_Strict):
    """One `sequence_batching.control_input[].control[]`. The checks Triton makes across
    controls (exactly two false/true values, one kind per tensor, CORRID types) live in
    daemon.core.sequence, where the messages can name the model."""

    # CONTROL_SEQUENCE_START is enum value 0, so protobuf's JSON leaves it out: the default.
    kind: ControlKind = "CONTROL_SEQUENCE_START"
    int32_false_true: list[int] = []
    fp32_false_true: list[float] = []
    bool_false_true: list[bool] = []
    # Only CONTROL_SEQUENCE_CORRID uses it; "" = unset (TYPE_INVALID).
    data_type: str = ""

    def __post_init__(self) -> None:
        if self.data_type:
            self.data_type = _field_datatype(self.data_type)


class SequenceControlInput(_Strict):
    name: str = ""
    control: list[SequenceControl] = []


class SequenceInitialState(_Strict):
    data_type: str = ""
    dims: list[int] = []
    zero_data: bool = False
    # Relative to `<model>/initial_state/`, as in Triton.
    data_file: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        if self.data_type:
            self.data_type = _field_datatype(self.data_type)


class SequenceState(_Strict):
    """Implicit state: the server feeds `input_name` with the sequence's last `output_name`."""

    input_name: str
    output_name: str
    data_type: str
    # Without the batch dimension when max_batch_size > 0; -1 = variable (1 in the initial state).
    dims: list[int] = []
    initial_state: list[SequenceInitialState] = []

    def __post_init__(self) -> None:
        self.data_type = _field_datatype(self.data_type)


class SequenceStrategyDirect(_Strict):
    max_queue_delay_microseconds: Annotated[int, msgspec.Meta(ge=0)] = 0
    minimum_slot_utilization: float = 0.0


class SequenceStrategyOldest(_Strict):
    # 2**31-1 slots would take the loop minutes and more memory than the box has.
    max_candidate_sequences: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQUENCE_SLOTS)] = 0
    preferred_batch_size: list[int] = []
    max_queue_delay_microseconds: Annotated[int, msgspec.Meta(ge=0)] = 0
    preserve_ordering: bool = False


class SequenceBatching(_Strict):
    """Triton's `sequence_batching` (ModelSequenceBatching); see daemon.core.sequence."""

    # 0 = Triton's default, one second.
    max_sequence_idle_microseconds: Annotated[int, msgspec.Meta(ge=0)] = 0
    control_input: list[SequenceControlInput] = []
    # Neither set = direct, as in Triton.
    direct: SequenceStrategyDirect | None = None
    oldest: SequenceStrategyOldest | None = None
    state: list[SequenceState] = []
    # Triton's iterative sequences: a request without a sequence ID gets one of its own, and
    # the model may release a request to run again (request rescheduling).
    iterative_sequence: bool = False

    def __post_init__(self) -> None:
        if self.direct is not None and self.oldest is not None:
            raise ValueError("sequence_batching: set at most one of direct and oldest")


class VersionPolicy(_Strict):
    kind: Literal["latest", "all", "specific"] = "latest"
    # 0 (`latest {}`) serves no version: the load fails, as in Triton.
    num_versions: Annotated[int, msgspec.Meta(ge=0)] = 1
    versions: list[int] = []


class EnsembleStep(_Strict):
    model_name: str
    model_version: int = -1
    # step-model tensor name -> ensemble tensor name (input_map) and the reverse (output_map),
    # exactly as Triton's ensemble_scheduling.step.
    input_map: dict[str, str] = {}
    output_map: dict[str, str] = {}


class EnsembleScheduling(_Strict):
    step: list[EnsembleStep] = []


class TransactionPolicy(_Strict):
    decoupled: bool = False


class ModelWarmupInput(_Strict):
    """One input of a warmup sample: its data is zeros, random bytes, or a file's contents
    (`<model>/warmup/<input_data_file>`); exactly one of them (Triton's oneof)."""

    data_type: str
    dims: list[int] = []
    zero_data: bool = False
    random_data: bool = False
    input_data_file: str = ""

    def __post_init__(self) -> None:
        self.data_type = _field_datatype(self.data_type)
        if self.zero_data + self.random_data + bool(self.input_data_file) > 1:
            raise ValueError("set one of zero_data, random_data and input_data_file")


class ModelWarmup(_Strict):
    """Triton's `model_warmup` sample (daemon.core.warmup)."""

    name: str = ""
    batch_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    inputs: dict[str, ModelWarmupInput] = {}
    count: Annotated[int, msgspec.Meta(ge=0)] = 0


BatchInputKind = Literal[
    "BATCH_ELEMENT_COUNT", "BATCH_ACCUMULATED_ELEMENT_COUNT", "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
    "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE", "BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN",
]


class BatchInput(_Strict):
    """Triton's `batch_input`: a model input the backend makes from the batch it runs (each
    request's element count of `source_input`, their running sum, ...), fed as `target_name`.
    Checked by `check_batch_io`; computed in daemon.backend (`RaggedPlan.merge`)."""

    kind: BatchInputKind = "BATCH_ELEMENT_COUNT"
    target_name: list[str] = []
    # "" when unset (Triton's TYPE_INVALID), which check_batch_io refuses with Triton's text.
    data_type: str = ""
    source_input: list[str] = []

    def __post_init__(self) -> None:
        if self.data_type:
            self.data_type = _field_datatype(self.data_type)

    @property
    def rank(self) -> int:
        """Dimensions of the tensor the model gets: [rows, item rank] for BATCH_ITEM_SHAPE, one otherwise."""
        return 2 if self.kind == "BATCH_ITEM_SHAPE" else 1


class BatchOutput(_Strict):
    """Triton's `batch_output`: an output the backend splits by each request's shape of
    `source_input` rather than by its rows."""

    target_name: list[str] = []
    kind: Literal["BATCH_SCATTER_WITH_INPUT_SHAPE"] = "BATCH_SCATTER_WITH_INPUT_SHAPE"
    source_input: list[str] = []


class GraphOptimization(_Strict):
    # Triton's ONNX Runtime backend: -1 basic, 1 extended, 2 none; anything else all.
    level: int = 0


class ExecutionAccelerator(_Strict):
    name: str = ""
    parameters: dict[str, str] = {}


class ExecutionAccelerators(_Strict):
    # CPU accelerators of Triton's ONNX Runtime backend ("openvino"): the plugin whose manifest
    # lists the name serves the model first (daemon.core.selection). The GPU ones are dropped.
    cpu_execution_accelerator: list[ExecutionAccelerator] = []


class Optimization(_Strict):
    """Triton's `optimization`: edged reads `graph.level` (ONNX Runtime's graph optimization
    level, which can change a model's numbers) and the CPU execution accelerators; the rest
    tunes Triton and is dropped with a warning (triton_config)."""

    graph: GraphOptimization | None = None
    execution_accelerators: ExecutionAccelerators | None = None

    def cpu_accelerators(self) -> list[str]:
        accelerators = self.execution_accelerators
        return [a.name for a in accelerators.cpu_execution_accelerator] if accelerators else []


class RepositoryAgent(_Strict):
    """One of Triton's `model_repository_agents`: code run on the model's files before each
    load (edged has the `checksum` agent, daemon.core.checksum)."""

    name: str = ""
    parameters: dict[str, str] = {}


class RepositoryAgents(_Strict):
    agents: list[RepositoryAgent] = []


class ResponseCache(_Strict):
    """Triton's `response_cache`: answers kept by the daemon's cache (daemon.core.response_cache)."""

    enable: bool = False


class ModelConfig(_Strict):
    name: str = ""
    # "" or "auto" = chosen by hardware-aware selection (daemon.core.selection).
    backend: str = ""
    platform: str = ""
    max_batch_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    input: list[TensorConfig] = []
    output: list[TensorConfig] = []
    instance_group: list[InstanceGroup] = []
    version_policy: VersionPolicy = msgspec.field(default_factory=VersionPolicy)
    # Triton's `parameters { key: "k" value { string_value: "v" } }`, flattened.
    parameters: dict[str, str] = {}
    dynamic_batching: DynamicBatching | None = None
    sequence_batching: SequenceBatching | None = None
    ensemble_scheduling: EnsembleScheduling | None = None
    model_transaction_policy: TransactionPolicy = msgspec.field(
        default_factory=TransactionPolicy
    )
    default_model_filename: str = ""
    # Triton's `metric_tags`: each becomes a label `_<key>` of the model's /metrics samples.
    metric_tags: dict[str, str] = {}
    batch_input: list[BatchInput] = []
    batch_output: list[BatchOutput] = []
    model_repository_agents: RepositoryAgents | None = None
    optimization: Optimization | None = None
    response_cache: ResponseCache | None = None
    model_warmup: list[ModelWarmup] = []
    # Ours: ordered backend preference for `backend: auto` (e.g. ["openvino", "onnxruntime"]).
    backend_preference: list[str] = []
    # Ours: "on-demand" = loaded by the first request that needs it and unloaded after idling
    # for `keep_alive` (an Ollama duration; "" = the daemon's residency.default-keep-alive).
    load: Literal["startup", "on-demand"] = "startup"
    keep_alive: str = ""

    def __post_init__(self) -> None:
        if self.keep_alive:
            parse_keep_alive(self.keep_alive)  # ValueError -> msgspec names `$.keep_alive`
        # Triton's `scheduling_choice` oneof (config.pbtxt gets this check from protobuf).
        chosen = [
            name
            for name in ("dynamic_batching", "sequence_batching", "ensemble_scheduling")
            if getattr(self, name) is not None
        ]
        if len(chosen) > 1:
            raise ValueError(f"set at most one of {' and '.join(chosen)}")
        # TensorConfig serves inputs and outputs; `format` and `optional` are an input's only
        # and `label_filename` an output's (as in Triton, whose config.pbtxt schema refuses
        # them on the other kind): never taken and then dropped.
        for tensor in self.output:
            if tensor.format != "FORMAT_NONE":
                raise ValueError(f"output {tensor.name!r}: format applies to inputs only")
            if tensor.optional:
                raise ValueError(f"output {tensor.name!r}: optional applies to inputs only")
            if tensor.allow_ragged_batch:
                raise ValueError(f"output {tensor.name!r}: allow_ragged_batch applies to inputs only")
        for tensor in self.input:
            if tensor.label_filename:
                raise ValueError(f"input {tensor.name!r}: label_filename applies to outputs only")
        for key in self.metric_tags:
            # Prometheus label names are [a-zA-Z_][a-zA-Z0-9_]* and those starting "__" are
            # reserved: the label `_<key>` must be neither invalid nor reserved.
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_]*", key):
                raise ValueError(f"metric_tags key {key!r}: use letters, digits and '_', not first")

    def int_parameter(self, key: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
        """`parameters[key]` as an integer in [minimum, maximum]; ConfigError naming model and key.

        A runtime's thread or stream count needs a maximum: ONNX Runtime given 100 000 intra-op
        threads crashed the process (SIGSEGV) creating them."""
        raw = self.parameters.get(key, "").strip()
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            value = minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise ConfigError(f"model {self.name!r}: parameter {key}={raw!r} must be an integer {bounds}")
        return value

    def bool_parameter(self, key: str, default: bool) -> bool:
        raw = self.parameters.get(key, "").strip().lower()
        if not raw:
            return default
        if raw in ("1", "true", "yes", "on"):
            return True
        if raw in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"model {self.name!r}: parameter {key}={raw!r} must be true or false")

    # Plain loops: these run for every infer request, and a generator costs more than the scan.
    def input_by_name(self, name: str) -> TensorConfig | None:
        for tensor in self.input:
            if tensor.name == name:
                return tensor
        return None

    def output_by_name(self, name: str) -> TensorConfig | None:
        for tensor in self.output:
            if tensor.name == name:
                return tensor
        return None

    def caches_responses(self) -> bool:
        """Whether the config turns Triton's response cache on for this model."""
        return self.response_cache is not None and self.response_cache.enable

    def ragged_inputs(self) -> tuple[str, ...]:
        """Inputs with `allow_ragged_batch`, in config order."""
        return tuple(tensor.name for tensor in self.input if tensor.allow_ragged_batch)

    def batch_input_targets(self) -> dict[str, BatchInput]:
        """Each model input a `batch_input` makes (not sent by clients) -> that batch input."""
        return {target: batch_input for batch_input in self.batch_input for target in batch_input.target_name}


def config_from_mapping(data: object, *, source: str) -> ModelConfig:
    """Validate a plain mapping (from TOML, JSON or a converted pbtxt) into a ModelConfig.

    `source` names the file so the error tells the user where to look.
    """
    try:
        return msgspec.convert(data, ModelConfig)
    except (msgspec.ValidationError, ConfigError) as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def to_triton_json(
    config: ModelConfig, *, model_name: str = "", count: int = 1, gpu: int | None = None, filename: str = ""
) -> dict[str, Any]:
    """The config in Triton's JSON layout (what `/v2/models/{m}/config` serves and a Python
    model's `initialize` gets): `data_type` spelled `TYPE_*`, `version_policy` as a oneof,
    parameters as `{"key": {"string_value": "..."}}`, unset messages left out.

    With `model_name`, as Triton 2.51 serves a config once it has completed it (checked side by
    side): an unnamed instance group is `<model>_<index>`, and a config without any has one
    group named after the model, of its `count` instances (none for an ensemble), on GPU `gpu`
    or the CPU; `default_model_filename` is the file loaded (`filename`); a
    dynamic batcher without preferred sizes prefers max_batch_size; empty and unset fields are
    spelled out as Triton spells them. Triton's `optimization` block only as far as a config set
    what edged reads (`graph`, the CPU execution accelerators): its defaults (pinned memory)
    describe what edged does not do."""
    data: dict[str, Any] = msgspec.to_builtins(config)
    if not config.model_transaction_policy.decoupled:
        # Our config cannot tell a written `decoupled: false` from none; Triton omits the unset one.
        del data["model_transaction_policy"]
    for group in data["instance_group"]:
        if group["rate_limiter"] is None:
            del group["rate_limiter"]  # an unset message: Triton leaves it out
    optimization = data.get("optimization")
    if optimization is not None:
        for key in [key for key, value in optimization.items() if value is None]:
            del optimization[key]
        if "execution_accelerators" in optimization:
            optimization["execution_accelerators"]["gpu_execution_accelerator"] = []
    batching = data.get("dynamic_batching")
    if batching is not None and batching["default_queue_policy"] is None:
        del batching["default_queue_policy"]
    if model_name:
        groups = data["instance_group"]
        if not groups and count:
            groups.append({
                "count": count, "kind": "KIND_CPU" if gpu is None else "KIND_GPU", "gpus": [] if gpu is None else [gpu],
                "name": model_name, "host_policy": "",
            })
        for index, group in enumerate(groups):
            if not group["name"]:
                group["name"] = f"{model_name}_{index}"
            group.update(secondary_devices=[], profile=[], passive=False)
        if not data["default_model_filename"]:
            data["default_model_filename"] = filename
        if batching is not None and not batching["preferred_batch_size"] and config.max_batch_size > 0:
            batching["preferred_batch_size"] = [config.max_batch_size]
        for key, empty in (("runtime", ""), ("cc_model_filenames", {})):
            data.setdefault(key, empty)
        ensemble = data.get("ensemble_scheduling")
        if ensemble is not None:
            data.setdefault("model_transaction_policy", {"decoupled": False})  # Triton serves it for ensembles
            for step in ensemble["step"]:
                step.setdefault("model_namespace", "")
    for side in ("input", "output"):
        for tensor in data[side]:
            datatype = tensor["data_type"]
            tensor["data_type"] = "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
            if tensor.get("reshape") is None:
                tensor.pop("reshape", None)
            else:
                tensor["reshape"] = {"shape": tensor["reshape"]}
            # Triton spells out these defaults (the only values edged serves, see triton_config).
            tensor["is_shape_tensor"] = tensor["is_non_linear_format_io"] = False
            if side == "output":
                # Triton's ModelOutput has none of these
                del tensor["optional"], tensor["format"], tensor["allow_ragged_batch"]
            else:
                del tensor["label_filename"]  # nor has its ModelInput this one
    for key in ("batch_input", "batch_output", "metric_tags"):
        if not data[key] and not model_name:
            del data[key]  # unset; Triton's completed config spells them out empty
    for batch_input in data.get("batch_input", []):
        batch_input["data_type"] = type_name(batch_input["data_type"]) if batch_input["data_type"] else "TYPE_INVALID"
    sequence = data.get("sequence_batching")
    if sequence is not None:
        _sequence_to_triton_json(sequence, completed=bool(model_name))
    if not data["model_warmup"] and not model_name:
        del data["model_warmup"]  # unset; Triton's completed config spells it out empty
    for warmup in data.get("model_warmup", []):
        for spec in warmup["inputs"].values():
            spec["data_type"] = type_name(spec["data_type"])
            for key in ("zero_data", "random_data", "input_data_file"):
                if not spec[key]:
                    del spec[key]  # a oneof: only the one set is spelled out
    policy = config.version_policy
    data["version_policy"] = (
        {"latest": {"num_versions": policy.num_versions}} if policy.kind == "latest"
        else {"all": {}} if policy.kind == "all"
        else {"specific": {"versions": policy.versions}}
    )
    parameters = dict(config.parameters)
    # Ours, not Triton's: config.pbtxt spells it as a parameter (see triton_config).
    if data.pop("backend_preference"):
        parameters[PREFERENCE_PARAMETER] = ",".join(config.backend_preference)
    for key in RESIDENCY_PARAMETERS:
        value = data.pop(key)
        if value and value != "startup":
            parameters[key] = value
    data["parameters"] = {key: {"string_value": value} for key, value in parameters.items()}
    return {key: value for key, value in data.items() if value is not None}


def type_name(datatype: str) -> str:
    """Triton's name of a data type (`TYPE_FP32`, `TYPE_STRING` for BYTES)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def _sequence_to_triton_json(data: dict[str, Any], *, completed: bool) -> None:
    """`sequence_batching` in Triton's layout (in place): TYPE_ names, unset strategies left
    out; unset control data types left out, or `completed` as Triton serves them (TYPE_INVALID,
    and iterative_sequence false spelled out)."""
    for key in ("direct", "oldest"):
        if data.get(key) is None:
            data.pop(key, None)
    if not completed and not data.get("iterative_sequence"):
        data.pop("iterative_sequence", None)
    for control_input in data["control_input"]:
        for control in control_input["control"]:
            if control["data_type"]:
                control["data_type"] = type_name(control["data_type"])
            elif completed:
                control["data_type"] = "TYPE_INVALID"
            else:
                del control["data_type"]
    for state in data["state"]:
        state["data_type"] = type_name(state["data_type"])
        for initial in state["initial_state"]:
            if initial["data_type"]:
                initial["data_type"] = type_name(initial["data_type"])
            if not initial["data_file"]:
                del initial["data_file"]


def _trunks(dims: list[int]) -> list[int]:
    """The element counts of the runs of fixed dimensions between the variable ones ([2, 4, -1,
    6]: [8, 6]), which a reshape must keep (Triton's ValidateIOShape)."""
    counts = [1]
    for dim in dims:
        if dim == -1:
            counts.append(1)
        else:
            counts[-1] *= dim
    return counts


def check_completed(config: ModelConfig) -> None:
    """Triton's checks of a completed config (model_config_utils' ValidateModelConfig and
    ValidateIOShape, its texts): a dimension is -1 or at least 1; a reshape holds as many
    elements as the dims, between each two variable ones too; a KIND_CPU group lists no
    GPUs; each preferred batch size is one the model can take. Triton refuses the preferred
    sizes at its repository poll (a 500 with the reason in its log only); here the load's 400
    says it."""
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for tensor in tensors:
            where = f"model {kind} '{tensor.name}'"
            if any(d == 0 or d < -1 for d in tensor.dims):
                raise ConfigError(f"{where} dimension must be integer >= 1, or -1 to indicate a variable-size "
                                  f"dimension for {config.name}")
            if tensor.reshape is not None and _trunks(tensor.dims) != _trunks(tensor.reshape):
                raise ConfigError(f"{where} has different size for dims and reshape for {config.name}")
    for index, group in enumerate(config.instance_group):
        if group.kind == "KIND_CPU" and group.gpus:
            name = group.name or f"{config.name}_{index}"
            raise ConfigError(f"instance group {name} of model {config.name} has kind KIND_CPU but specifies one "
                              "or more GPUs")
    if config.dynamic_batching is not None:
        check_preferred_sizes(config.dynamic_batching.preferred_batch_size, config,
                              "dynamic batching preferred size")


def check_preferred_sizes(sizes: list[int], config: ModelConfig, what: str) -> None:
    """Each preferred batch size (the dynamic batcher's, a sequence batcher's oldest
    strategy's) is one the model can take, in Triton's words; `what` names the field as
    Triton's text does."""
    for size in sizes:
        if size <= 0:
            raise ConfigError(f"{what} must be positive for {config.name}")
        if size > config.max_batch_size:
            raise ConfigError(f"{what} must be <= max batch size for {config.name}")


def check_batch_io(config: ModelConfig) -> None:
    """Triton's checks of `batch_input` and `batch_output` (model_config_utils'
    ValidateBatchIO, with its texts), then edged's: a batch input must not shadow an input a
    request carries. What a backend can do with them is check_capabilities' business."""
    inputs = {tensor.name for tensor in config.input}
    outputs = {tensor.name for tensor in config.output}

    def fail(text: str) -> ConfigError:
        return ConfigError(f"{text} for {config.name}")

    for batch_input in config.batch_input:
        if len(batch_input.source_input) != 1:
            raise fail(f"batch input kind '{batch_input.kind}' expects 1 source input, got "
                       f"{len(batch_input.source_input)}")
        if batch_input.data_type not in ("INT32", "FP32"):
            raise fail("batch input data type must be TYPE_INT32 or TYPE_FP32")
        for source in batch_input.source_input:
            if source not in inputs:
                raise fail(f"unknown source input name '{source}'")
    for batch_output in config.batch_output:
        if len(batch_output.source_input) != 1:
            raise fail(f"batch output kind '{batch_output.kind}' expects 1 source input, got "
                       f"{len(batch_output.source_input)}")
        for source in batch_output.source_input:
            if source not in inputs:
                raise fail(f"unknown source input name '{source}'")
        targets: set[str] = set()
        for target in batch_output.target_name:
            if target not in outputs:
                raise fail(f"unknown target output name '{target}'")
            if target in targets:
                raise fail(f"target output name '{target}' can only be specified once")
            targets.add(target)
    shadowed = [target for target in config.batch_input_targets() if target in inputs]
    if shadowed:
        raise ConfigError(
            f"model '{config.name}': batch input target {shadowed[0]!r} is also an input of the config; a batch "
            "input is made by the backend, never sent by a client"
        )
