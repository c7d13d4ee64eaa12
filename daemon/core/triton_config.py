"""Triton's `config.pbtxt` (and its JSON form): parsed against Triton's own schema.

A `config.pbtxt` is parsed by protobuf's own text-format
parser against Triton's `inference.ModelConfig` schema, so anything Triton accepts we accept (and
anything it rejects, e.g. an unknown field, we reject with the same line/column). The schema is
written below as compact tables and turned into descriptors at run time, which keeps protoc out of
the build. Fields Triton knows but edged does not implement are dropped with a warning the daemon
logs, so a Triton repository loads here unchanged.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec
from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    json_format,
    message_factory,
    text_format,
)
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from daemon.errors import ConfigError
from daemon.model_config import (
    PREFERENCE_PARAMETER,
    RESIDENCY_PARAMETERS,
    ModelConfig,
    config_from_mapping,
)

# ---------------------------------------------------------------------------------------------
# Triton's model_config.proto (package `inference`), as tables: same message, field and enum
# names and field numbers. Nested types use dotted names ("ModelVersionPolicy.Latest"); a field
# type is resolved like protoc does, innermost scope first. Field spec: (name, number, type) with
# type = scalar | "repeated <type>" | "map<key, value>" | message/enum name. Enum values are
# numbered from 0 in order (true of every Triton enum).
# ---------------------------------------------------------------------------------------------

_PACKAGE: Final = "inference"

# fmt: off
_ENUMS: Final[dict[str, tuple[str, ...]]] = {
    "DataType": (
        "TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64",
        "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32",
        "TYPE_FP64", "TYPE_STRING", "TYPE_BF16",
    ),
    "ModelInstanceGroup.Kind": ("KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL"),
    "ModelInstanceGroup.SecondaryDevice.SecondaryDeviceKind": ("KIND_NVDLA",),
    "ModelInput.Format": ("FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW"),
    "BatchInput.Kind": (
        "BATCH_ELEMENT_COUNT", "BATCH_ACCUMULATED_ELEMENT_COUNT",
        "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",
        "BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN",
    ),
    "BatchOutput.Kind": ("BATCH_SCATTER_WITH_INPUT_SHAPE",),
    "ModelOptimizationPolicy.ModelPriority": ("PRIORITY_DEFAULT", "PRIORITY_MAX", "PRIORITY_MIN"),
    "ModelQueuePolicy.TimeoutAction": ("REJECT", "DELAY"),
    "ModelSequenceBatching.Control.Kind": (
        "CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_READY", "CONTROL_SEQUENCE_END",
        "CONTROL_SEQUENCE_CORRID",
    ),
}

_Field = tuple[str, int, str]

_MESSAGES: Final[dict[str, tuple[_Field, ...]]] = {
    "ModelConfig": (
        ("name", 1, "string"), ("platform", 2, "string"), ("backend", 17, "string"),
        ("runtime", 25, "string"), ("version_policy", 3, "ModelVersionPolicy"),
        ("max_batch_size", 4, "int32"), ("input", 5, "repeated ModelInput"),
        ("output", 6, "repeated ModelOutput"), ("batch_input", 20, "repeated BatchInput"),
        ("batch_output", 21, "repeated BatchOutput"),
        ("optimization", 12, "ModelOptimizationPolicy"),
        ("dynamic_batching", 11, "ModelDynamicBatching"),
        ("sequence_batching", 13, "ModelSequenceBatching"),
        ("ensemble_scheduling", 15, "ModelEnsembling"),
        ("instance_group", 7, "repeated ModelInstanceGroup"),
        ("default_model_filename", 8, "string"),
        ("cc_model_filenames", 9, "map<string, string>"),
        ("metric_tags", 10, "map<string, string>"),
        ("parameters", 14, "map<string, ModelParameter>"),
        ("model_warmup", 16, "repeated ModelWarmup"),
        ("model_operations", 18, "ModelOperations"),
        ("model_transaction_policy", 19, "ModelTransactionPolicy"),
        ("model_repository_agents", 23, "ModelRepositoryAgents"),
        ("response_cache", 24, "ModelResponseCache"), ("model_metrics", 26, "ModelMetrics"),
    ),
    "ModelVersionPolicy": (
        ("latest", 1, "Latest"), ("all", 2, "All"), ("specific", 3, "Specific"),
    ),
    "ModelVersionPolicy.Latest": (("num_versions", 1, "uint32"),),
    "ModelVersionPolicy.All": (),
    "ModelVersionPolicy.Specific": (("versions", 1, "repeated int64"),),
    "ModelTensorReshape": (("shape", 1, "repeated int64"),),
    "ModelInput": (
        ("name", 1, "string"), ("data_type", 2, "DataType"), ("format", 3, "Format"),
        ("dims", 4, "repeated int64"), ("reshape", 5, "ModelTensorReshape"),
        ("is_shape_tensor", 6, "bool"), ("allow_ragged_batch", 7, "bool"),
        ("optional", 8, "bool"), ("is_non_linear_format_io", 9, "bool"),
    ),
    "ModelOutput": (
        ("name", 1, "string"), ("data_type", 2, "DataType"), ("dims", 3, "repeated int64"),
        ("reshape", 5, "ModelTensorReshape"), ("label_filename", 4, "string"),
        ("is_shape_tensor", 6, "bool"), ("is_non_linear_format_io", 7, "bool"),
    ),
    "BatchInput": (
        ("kind", 1, "Kind"), ("target_name", 2, "repeated string"),
        ("data_type", 3, "DataType"), ("source_input", 4, "repeated string"),
    ),
    "BatchOutput": (
        ("target_name", 1, "repeated string"), ("kind", 2, "Kind"),
        ("source_input", 3, "repeated string"),
    ),
    "ModelRateLimiter": (
        ("resources", 1, "repeated Resource"), ("priority", 2, "uint32"),
    ),
    "ModelRateLimiter.Resource": (
        ("name", 1, "string"), ("global", 2, "bool"), ("count", 3, "uint32"),
    ),
    "ModelInstanceGroup": (
        ("name", 1, "string"), ("kind", 4, "Kind"), ("count", 2, "int32"),
        ("rate_limiter", 6, "ModelRateLimiter"), ("gpus", 3, "repeated int32"),
        ("secondary_devices", 8, "repeated SecondaryDevice"),
        ("profile", 5, "repeated string"), ("passive", 7, "bool"),
        ("host_policy", 9, "string"),
    ),
    "ModelInstanceGroup.SecondaryDevice": (
        ("kind", 1, "SecondaryDeviceKind"), ("device_id", 2, "int64"),
    ),
    "ModelQueuePolicy": (
        ("timeout_action", 1, "TimeoutAction"), ("default_timeout_microseconds", 2, "uint64"),
        ("allow_timeout_override", 3, "bool"), ("max_queue_size", 4, "uint32"),
    ),
    "ModelDynamicBatching": (
        ("preferred_batch_size", 1, "repeated int32"),
        ("max_queue_delay_microseconds", 2, "uint64"), ("preserve_ordering", 3, "bool"),
        ("priority_levels", 4, "uint64"), ("default_priority_level", 5, "uint64"),
        ("default_queue_policy", 6, "ModelQueuePolicy"),
        ("priority_queue_policy", 7, "map<uint64, ModelQueuePolicy>"),
    ),
    "ModelEnsembling": (
        ("step", 1, "repeated Step"), ("max_inflight_requests", 2, "uint32"),
    ),
    "ModelEnsembling.Step": (
        ("model_name", 1, "string"), ("model_version", 2, "int64"),
        ("input_map", 3, "map<string, string>"), ("output_map", 4, "map<string, string>"),
        ("model_namespace", 5, "string"),
    ),
    "ModelParameter": (("string_value", 1, "string"),),
    "ModelTransactionPolicy": (("decoupled", 1, "bool"),),
    "ModelOperations": (("op_library_filename", 1, "repeated string"),),
    "ModelResponseCache": (("enable", 1, "bool"),),
    "ModelRepositoryAgents": (("agents", 1, "repeated Agent"),),
    "ModelRepositoryAgents.Agent": (
        ("name", 1, "string"), ("parameters", 2, "map<string, string>"),
    ),
    "ModelWarmup": (
        ("name", 1, "string"), ("batch_size", 2, "uint32"),
        ("inputs", 3, "map<string, Input>"), ("count", 4, "uint32"),
    ),
    "ModelWarmup.Input": (
        ("data_type", 1, "DataType"), ("dims", 2, "repeated int64"), ("zero_data", 3, "bool"),
        ("random_data", 4, "bool"), ("input_data_file", 5, "string"),
    ),
    "ModelOptimizationPolicy": (
        ("graph", 1, "Graph"), ("priority", 2, "ModelPriority"), ("cuda", 3, "Cuda"),
        ("execution_accelerators", 4, "ExecutionAccelerators"),
        ("input_pinned_memory", 5, "PinnedMemoryBuffer"),
        ("output_pinned_memory", 6, "PinnedMemoryBuffer"),
        ("gather_kernel_buffer_threshold", 7, "uint32"), ("eager_batching", 8, "bool"),
    ),
    "ModelOptimizationPolicy.Graph": (("level", 1, "int32"),),
    "ModelOptimizationPolicy.PinnedMemoryBuffer": (("enable", 1, "bool"),),
    "ModelOptimizationPolicy.ExecutionAccelerators": (
        ("gpu_execution_accelerator", 1, "repeated Accelerator"),
        ("cpu_execution_accelerator", 2, "repeated Accelerator"),
    ),
    "ModelOptimizationPolicy.ExecutionAccelerators.Accelerator": (
        ("name", 1, "string"), ("parameters", 2, "map<string, string>"),
    ),
    "ModelOptimizationPolicy.Cuda": (
        ("graphs", 1, "bool"), ("busy_wait_events", 2, "bool"),
        ("graph_spec", 3, "repeated GraphSpec"), ("output_copy_stream", 4, "bool"),
    ),
    "ModelOptimizationPolicy.Cuda.GraphSpec": (
        ("batch_size", 1, "int32"), ("input", 2, "map<string, Shape>"),
        ("graph_lower_bound", 3, "LowerBound"),
    ),
    "ModelOptimizationPolicy.Cuda.GraphSpec.Shape": (("dim", 1, "repeated int64"),),
    "ModelOptimizationPolicy.Cuda.GraphSpec.LowerBound": (
        ("batch_size", 1, "int32"), ("input", 2, "map<string, Shape>"),
    ),
    "ModelSequenceBatching": (
        ("max_sequence_idle_microseconds", 1, "uint64"),
        ("control_input", 2, "repeated ControlInput"), ("direct", 3, "StrategyDirect"),
        ("oldest", 4, "StrategyOldest"), ("state", 5, "repeated State"),
        ("iterative_sequence", 6, "bool"),
    ),
    "ModelSequenceBatching.Control": (
        ("kind", 1, "Kind"), ("int32_false_true", 2, "repeated int32"),
        ("fp32_false_true", 3, "repeated float"), ("data_type", 4, "DataType"),
        ("bool_false_true", 5, "repeated bool"),
    ),
    "ModelSequenceBatching.ControlInput": (
        ("name", 1, "string"), ("control", 2, "repeated Control"),
    ),
    "ModelSequenceBatching.InitialState": (
        ("data_type", 1, "DataType"), ("dims", 2, "repeated int64"), ("zero_data", 3, "bool"),
        ("data_file", 4, "string"), ("name", 5, "string"),
    ),
    "ModelSequenceBatching.State": (
        ("input_name", 1, "string"), ("output_name", 2, "string"),
        ("data_type", 3, "DataType"), ("dims", 4, "repeated int64"),
        ("initial_state", 5, "repeated InitialState"),
        ("use_same_buffer_for_input_output", 6, "bool"), ("use_growable_memory", 7, "bool"),
    ),
    "ModelSequenceBatching.StrategyDirect": (
        ("max_queue_delay_microseconds", 1, "uint64"), ("minimum_slot_utilization", 2, "float"),
    ),
    "ModelSequenceBatching.StrategyOldest": (
        ("max_candidate_sequences", 1, "int32"), ("preferred_batch_size", 2, "repeated int32"),
        ("max_queue_delay_microseconds", 3, "uint64"), ("preserve_ordering", 4, "bool"),
    ),
    "ModelMetrics": (("metric_control", 1, "repeated MetricControl"),),
    "ModelMetrics.MetricControl": (
        ("metric_identifier", 1, "MetricIdentifier"),
        ("histogram_options", 2, "HistogramOptions"),
    ),
    "ModelMetrics.MetricControl.MetricIdentifier": (("family", 1, "string"),),
    "ModelMetrics.MetricControl.HistogramOptions": (("buckets", 1, "repeated double"),),
}

# Triton's oneofs: message -> {oneof name: member fields}. Protobuf then rejects a config that
# sets two members (e.g. dynamic_batching and sequence_batching), as Triton does.
_ONEOFS: Final[dict[str, dict[str, tuple[str, ...]]]] = {
    "ModelConfig": {
        "scheduling_choice": ("dynamic_batching", "sequence_batching", "ensemble_scheduling"),
    },
    "ModelVersionPolicy": {"policy_choice": ("latest", "all", "specific")},
    "ModelSequenceBatching": {"strategy_choice": ("direct", "oldest")},
    "ModelSequenceBatching.InitialState": {"state_data": ("zero_data", "data_file")},
    "ModelWarmup.Input": {"input_data_type": ("zero_data", "random_data", "input_data_file")},
    "ModelMetrics.MetricControl": {"metric_options": ("histogram_options",)},
}
# fmt: on

_FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS: Final[dict[str, int]] = {
    "string": _FDP.TYPE_STRING,
    "bool": _FDP.TYPE_BOOL,
    "int32": _FDP.TYPE_INT32,
    "int64": _FDP.TYPE_INT64,
    "uint32": _FDP.TYPE_UINT32,
    "uint64": _FDP.TYPE_UINT64,
    "float": _FDP.TYPE_FLOAT,
    "double": _FDP.TYPE_DOUBLE,
}
# The proto3 JSON mapping writes these as strings (and every map key as a string).
_INT64_TYPES: Final = frozenset(
    {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64}
)
_INT_KEY_TYPES: Final = _INT64_TYPES | {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_UINT32}


def _resolve(scope: str, type_name: str) -> str:
    """Protoc's lookup: `Kind` used inside `A.B` is `A.B.Kind`, else `A.Kind`, else `Kind`."""
    parts = scope.split(".")
    for depth in range(len(parts), -1, -1):
        candidate = ".".join([*parts[:depth], type_name])
        if candidate in _MESSAGES or candidate in _ENUMS:
            return candidate
    raise AssertionError(f"schema table: {scope} uses undefined type {type_name}")


def _schema_file() -> descriptor_pb2.FileDescriptorProto:
    """The tables above as the FileDescriptorProto protoc would have produced."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name="edged/triton_model_config.proto", package=_PACKAGE, syntax="proto3"
    )
    protos: dict[str, descriptor_pb2.DescriptorProto] = {}
    # Parents before their nested types.
    for full in sorted(_MESSAGES, key=lambda name: name.count(".")):
        parent, _, short = full.rpartition(".")
        container = protos[parent].nested_type if parent else fdp.message_type
        protos[full] = container.add(name=short)
    for full, values in _ENUMS.items():
        parent, _, short = full.rpartition(".")
        container = protos[parent].enum_type if parent else fdp.enum_type
        enum = container.add(name=short)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)

    def set_type(field: descriptor_pb2.FieldDescriptorProto, scope: str, spec: str) -> None:
        if spec in _SCALARS:
            field.type = _SCALARS[spec]
            return
        full = _resolve(scope, spec)
        field.type = _FDP.TYPE_MESSAGE if full in _MESSAGES else _FDP.TYPE_ENUM
        field.type_name = f".{_PACKAGE}.{full}"

    for full, fields in _MESSAGES.items():
        proto = protos[full]
        oneof_index: dict[str, int] = {}
        for index, (oneof, members) in enumerate(_ONEOFS.get(full, {}).items()):
            proto.oneof_decl.add(name=oneof)
            oneof_index.update(dict.fromkeys(members, index))
        for name, number, spec in fields:
            field = proto.field.add(name=name, number=number, label=_FDP.LABEL_OPTIONAL)
            if name in oneof_index:
                field.oneof_index = oneof_index[name]
            if spec.startswith("repeated "):
                field.label = _FDP.LABEL_REPEATED
                spec = spec.removeprefix("repeated ")
            if spec.startswith("map<"):
                # A map is a repeated nested `<Name>Entry {key = 1; value = 2}` flagged map_entry.
                key_spec, value_spec = (s.strip() for s in spec[4:-1].split(","))
                entry_name = "".join(p.capitalize() for p in name.split("_")) + "Entry"
                entry = proto.nested_type.add(name=entry_name)
                entry.options.map_entry = True
                for part_number, (part, part_spec) in enumerate(
                    (("key", key_spec), ("value", value_spec)), start=1
                ):
                    part_field = entry.field.add(name=part, number=part_number)
                    part_field.label = _FDP.LABEL_OPTIONAL
                    set_type(part_field, full, part_spec)
                field.label = _FDP.LABEL_REPEATED
                field.type = _FDP.TYPE_MESSAGE
                field.type_name = f".{_PACKAGE}.{full}.{entry_name}"
            else:
                set_type(field, full, spec)
    return fdp


# ---------------------------------------------------------------------------------------------
# config.pbtxt
# ---------------------------------------------------------------------------------------------


class PbtxtParser:
    """Parses Triton `config.pbtxt` text into our ModelConfig.

    Owns a private descriptor pool (never protobuf's global default pool, where another library
    could already have registered `inference.ModelConfig`, e.g. tritonclient's grpc stubs).
    Building it takes a few milliseconds: hold one parser per repository scanner.
    """

    def __init__(self) -> None:
        pool = descriptor_pool.DescriptorPool()
        pool.AddSerializedFile(_schema_file().SerializeToString())
        self._descriptor = pool.FindMessageTypeByName(f"{_PACKAGE}.ModelConfig")
        self._message_class = message_factory.GetMessageClass(self._descriptor)

    def parse_message(self, text: str, *, source: str) -> Message:
        """The raw `inference.ModelConfig` message; ConfigError carries line and column."""
        message = self._message_class()
        try:
            text_format.Parse(text, message)
        except text_format.ParseError as exc:
            line, column = exc.GetLine(), exc.GetColumn()
            reason = str(exc)
            if line is not None:
                # ParseError prefixes "line:column : "; say it in words instead.
                reason = reason.split(" : ", 1)[-1]
                raise ConfigError(f"{source}: line {line}, column {column}: {reason}") from None
            raise ConfigError(f"{source}: {reason}") from None
        return message

    def parse(self, text: str, *, source: str) -> tuple[ModelConfig, list[str]]:
        """-> (config, warnings naming each Triton field that was set but is ignored here)."""
        return self._convert(self.parse_message(text, source=source), source)

    def parse_json(self, text: str, *, source: str) -> tuple[ModelConfig, list[str]]:
        """A config in Triton's JSON layout (`load` with `parameters.config`, as tritonclient
        sends it), validated against the same schema as config.pbtxt."""
        message = self._message_class()
        try:
            json_format.Parse(text, message)
        except json_format.ParseError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        return self._convert(message, source)

    def _convert(self, message: Message, source: str) -> tuple[ModelConfig, list[str]]:
        data: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
        _int64_to_int(data, self._descriptor)
        _to_edged_shape(data)
        warnings: list[str] = []
        _drop_unsupported(data, msgspec.inspect.type_info(ModelConfig), "", source, warnings)
        return config_from_mapping(data, source=source), warnings


def _int64_to_int(data: dict[str, Any], descriptor: Descriptor) -> None:
    """Undo the JSON mapping's int64-as-string (and map-keys-as-string) in place."""
    for key, value in data.items():
        field = descriptor.fields_by_name[key]
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
            converted: dict[Any, Any] = {}
            for map_key, map_value in value.items():
                if key_field.type in _INT_KEY_TYPES:
                    map_key = int(map_key)
                if value_field.message_type is not None:
                    _int64_to_int(map_value, value_field.message_type)
                elif value_field.type in _INT64_TYPES:
                    map_value = int(map_value)
                converted[map_key] = map_value
            data[key] = converted
        elif entry is not None:
            for item in value if isinstance(value, list) else [value]:
                _int64_to_int(item, entry)
        elif field.type in _INT64_TYPES:
            data[key] = [int(v) for v in value] if isinstance(value, list) else int(value)


def _to_edged_shape(data: dict[str, Any]) -> None:
    """Where our ModelConfig is flatter than Triton's message, flatten (in place)."""
    policy = data.get("version_policy")
    if policy:
        # The oneof becomes a `kind` tag. proto3 leaves a num_versions of 0 out, as an absent
        # one: Triton serves no version then (its load fails), so 0 it stays.
        ((kind, body),) = policy.items()
        data["version_policy"] = {"kind": kind, **({"num_versions": 0} if kind == "latest" else {}), **body}
    if "parameters" in data:
        data["parameters"] = {k: v.get("string_value", "") for k, v in data["parameters"].items()}
        preference = data["parameters"].pop(PREFERENCE_PARAMETER, "")
        if preference:
            data["backend_preference"] = [b.strip() for b in preference.split(",") if b.strip()]
        # Residency settings are ours, not the backend's: lift them out of `parameters`.
        for key in RESIDENCY_PARAMETERS:
            if key in data["parameters"]:
                data[key] = data["parameters"].pop(key).strip()
    for tensor in [*data.get("input", []), *data.get("output", [])]:
        if "reshape" in tensor:
            tensor["reshape"] = tensor["reshape"].get("shape", [])
    # An ensemble step's omitted model_version (proto3 cannot tell it from 0, and Triton never
    # serves a version 0) stays absent, so EnsembleStep's default -1, "latest", applies.


# Triton fields that change what a request means (TensorRT's shape tensors and non-linear
# formats): set (protobuf leaves defaults out), they are refused, never dropped. Other
# unsupported fields are tuning hints (optimization, rate_limiter, ...): dropped with a warning.
_REFUSED = frozenset({
    "input.is_shape_tensor", "input.is_non_linear_format_io",
    "output.is_shape_tensor", "output.is_non_linear_format_io",
})


def _drop_unsupported(
    data: Any, info: msgspec.inspect.Type, path: str, source: str, warnings: list[str]
) -> None:
    """Remove keys our ModelConfig has no field for, walking it alongside its msgspec type;
    a ConfigError for the ones in _REFUSED.

    Driven by ModelConfig itself, so a Triton field edged starts supporting stops being dropped.
    """
    if isinstance(info, msgspec.inspect.UnionType):
        for member in info.types:
            _drop_unsupported(data, member, path, source, warnings)
    elif isinstance(info, msgspec.inspect.StructType) and isinstance(data, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        for key in list(data):
            where = f"{path}.{key}" if path else key
            if key in fields:
                _drop_unsupported(data[key], fields[key], where, source, warnings)
            elif re.sub(r"\[[^]]*\]", "", where) in _REFUSED:
                raise ConfigError(
                    f"{source}: {where} is set, which edged does not implement (it changes how "
                    "requests are read or batched); remove it to serve this model here"
                )
            else:
                del data[key]
                warnings.append(f"{source}: {where} is not supported by edged and is ignored")
    elif isinstance(info, msgspec.inspect.ListType) and isinstance(data, list):
        for index, item in enumerate(data):
            _drop_unsupported(item, info.item_type, f"{path}[{index}]", source, warnings)
    elif isinstance(info, msgspec.inspect.DictType) and isinstance(data, dict):
        for key, item in data.items():
            _drop_unsupported(item, info.value_type, f"{path}[{key}]", source, warnings)


def parse_pbtxt(
    text: str, *, source: str, parser: PbtxtParser | None = None
) -> tuple[ModelConfig, list[str]]:
    return (parser or PbtxtParser()).parse(text, source=source)
