"""Model repository files: config.pbtxt (protobuf text format, daemon.core.triton_config), and
model.toml, versions, scanning (daemon.core.layout)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
from pathlib import Path

import msgspec
import pytest
from google.protobuf import descriptor_pb2

from daemon.core.layout import (
    fingerprint,
    list_versions,
    parse_model_toml,
    read_model_config,
    scan_repository,
    select_versions,
)
from daemon.core.triton_config import PbtxtParser, _schema_file
from daemon.errors import ConfigError, NotFound
from daemon.model_config import (
    DynamicBatching,
    EnsembleStep,
    InstanceGroup,
    ModelConfig,
    ModelRateLimiter,
    QueuePolicy,
    RateLimiterResource,
    TensorConfig,
    VersionPolicy,
    check_completed,
    config_from_mapping,
    to_triton_json,
)

# Triton's `simple` example model, served by ONNX Runtime.
SIMPLE_PBTXT = """\
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  {
    name: "INPUT0"
    data_type: TYPE_INT32
    dims: [ 16 ]
  },
  {
    name: "INPUT1"
    data_type: TYPE_INT32
    dims: [ 16 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_INT32
    dims: [ 16 ]
  },
  {
    name: "OUTPUT1"
    data_type: TYPE_INT32
    dims: [ 16 ]
  }
]
"""

SIMPLE_TOML = """\
name = "simple"
platform = "onnxruntime_onnx"
max_batch_size = 8

[[input]]
name = "INPUT0"
data_type = "TYPE_INT32"
dims = [16]

[[input]]
name = "INPUT1"
data_type = "INT32"
dims = [16]

[[output]]
name = "OUTPUT0"
data_type = "int32"
dims = [16]

[[output]]
name = "OUTPUT1"
data_type = "INT32"
dims = [16]
"""

BATCHING_PBTXT = """\
backend: "onnxruntime"
max_batch_size: 16
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] reshape: { shape: [ 3, -1 ] } } ]
output [ { name: "y" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [
  { count: 2 kind: KIND_CPU },
  { name: "gpu_group" kind: KIND_GPU gpus: [ 0, 1 ] }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy { max_queue_size: 32 }
  priority_queue_policy {
    key: 1
    value: {
      timeout_action: DELAY
      default_timeout_microseconds: 5000000000
      allow_timeout_override: true
      max_queue_size: 4
    }
  }
}
model_transaction_policy { decoupled: true }
default_model_filename: "net.onnx"
"""

BATCHING_TOML = """\
backend = "onnxruntime"
max_batch_size = 16
default_model_filename = "net.onnx"
instance_group = [{ count = 2, kind = "KIND_CPU" }, { name = "gpu_group", kind = "KIND_GPU", gpus = [0, 1] }]
model_transaction_policy = { decoupled = true }

[[input]]
name = "x"
data_type = "FP32"
dims = [-1, 3]
reshape = [3, -1]

[[output]]
name = "y"
data_type = "BYTES"
dims = [1]

[dynamic_batching]
preferred_batch_size = [4, 8]
max_queue_delay_microseconds = 100
preserve_ordering = true
priority_levels = 2
default_priority_level = 2
default_queue_policy = { max_queue_size = 32 }

[dynamic_batching.priority_queue_policy.1]
timeout_action = "DELAY"
default_timeout_microseconds = 5000000000
allow_timeout_override = true
max_queue_size = 4
"""


@pytest.fixture(scope="module")
def parser() -> PbtxtParser:
    return PbtxtParser()


def model_dir(root: Path, name: str, files: dict[str, str], versions: tuple[int, ...] = ()) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    for filename, text in files.items():
        (directory / filename).write_text(text)
    for version in versions:
        (directory / str(version)).mkdir()
        (directory / str(version) / "model.onnx").write_bytes(b"onnx")
    return directory


# --- config.pbtxt ---------------------------------------------------------------------------


def test_triton_simple_config(tmp_path: Path, parser: PbtxtParser) -> None:
    directory = model_dir(tmp_path, "simple", {"config.pbtxt": SIMPLE_PBTXT}, versions=(1,))
    config, warnings = read_model_config(directory)
    tensors = [TensorConfig(name=n, data_type="INT32", dims=[16]) for n in ("INPUT0", "INPUT1")]
    assert config == ModelConfig(
        name="simple",
        platform="onnxruntime_onnx",
        max_batch_size=8,
        input=tensors,
        output=[TensorConfig(name=n, data_type="INT32", dims=[16]) for n in ("OUTPUT0", "OUTPUT1")],
    )
    assert warnings == []


def test_batching_instance_groups_and_queue_policies(tmp_path: Path, parser: PbtxtParser) -> None:
    directory = model_dir(tmp_path, "batched", {"config.pbtxt": BATCHING_PBTXT})
    config, warnings = read_model_config(directory)
    assert warnings == []
    assert config.name == "batched"
    assert config.input == [TensorConfig(name="x", data_type="FP32", dims=[-1, 3], reshape=[3, -1])]
    assert config.output == [TensorConfig(name="y", data_type="BYTES", dims=[1])]
    assert config.instance_group == [
        InstanceGroup(count=2, kind="KIND_CPU"),
        InstanceGroup(count=1, kind="KIND_GPU", gpus=[0, 1], name="gpu_group"),
    ]
    assert config.dynamic_batching == DynamicBatching(
        preferred_batch_size=[4, 8],
        max_queue_delay_microseconds=100,
        preserve_ordering=True,
        priority_levels=2,
        default_priority_level=2,
        default_queue_policy=QueuePolicy(max_queue_size=32),
        # uint64 values and map keys come back as ints, not the JSON mapping's strings.
        priority_queue_policy={
            1: QueuePolicy(
                timeout_action="DELAY",
                default_timeout_microseconds=5_000_000_000,
                allow_timeout_override=True,
                max_queue_size=4,
            )
        },
    )
    assert config.model_transaction_policy.decoupled is True
    assert config.default_model_filename == "net.onnx"


def test_empty_dynamic_batching_block_enables_batching(parser: PbtxtParser) -> None:
    config, _ = parser.parse("max_batch_size: 4\ndynamic_batching { }\n", source="c")
    assert config.dynamic_batching == DynamicBatching()
    config, _ = parser.parse("max_batch_size: 4\n", source="c")
    assert config.dynamic_batching is None


def test_ensemble_scheduling(parser: PbtxtParser) -> None:
    text = """
    name: "pipeline"
    platform: "ensemble"
    max_batch_size: 1
    input [ { name: "RAW" data_type: TYPE_UINT8 dims: [ -1 ] } ]
    output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 10 ] } ]
    ensemble_scheduling {
      step [
        {
          model_name: "preprocess"
          model_version: -1
          input_map { key: "IN" value: "RAW" }
          output_map { key: "OUT" value: "pixels" }
        },
        {
          model_name: "classifier"
          model_version: 3
          input_map { key: "x" value: "pixels" }
          output_map { key: "y" value: "SCORES" }
        },
        {
          model_name: "logger"
          input_map [ { key: "a" value: "RAW" }, { key: "b" value: "SCORES" } ]
        }
      ]
    }
    """
    config, warnings = parser.parse(text, source="config.pbtxt")
    assert warnings == []
    assert config.ensemble_scheduling is not None
    assert config.ensemble_scheduling.step == [
        EnsembleStep("preprocess", -1, {"IN": "RAW"}, {"OUT": "pixels"}),
        EnsembleStep("classifier", 3, {"x": "pixels"}, {"y": "SCORES"}),
        # An omitted model_version means "latest", like an explicit -1.
        EnsembleStep("logger", -1, {"a": "RAW", "b": "SCORES"}, {}),
    ]


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ("", VersionPolicy()),
        ("version_policy: { latest: { num_versions: 2 } }", VersionPolicy("latest", 2)),
        # proto3 cannot tell it from num_versions 0: no version, as Triton reads it.
        ("version_policy: { latest { } }", VersionPolicy("latest", 0)),
        ("version_policy: { all { } }", VersionPolicy("all")),
        (
            "version_policy: { specific: { versions: [ 1, 3 ] } }",
            VersionPolicy("specific", versions=[1, 3]),
        ),
    ],
)
def test_version_policies(parser: PbtxtParser, block: str, expected: VersionPolicy) -> None:
    config, _ = parser.parse(f'name: "m"\n{block}\n', source="c")
    assert config.version_policy == expected


def test_two_version_policies_conflict(parser: PbtxtParser) -> None:
    text = "version_policy { all { } specific { versions: 1 } }"
    with pytest.raises(ConfigError, match=r"line 1.*specific.*oneof"):
        parser.parse(text, source="c")


def test_parameters_are_flattened(parser: PbtxtParser) -> None:
    text = """
    parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
    parameters [ { key: "empty" value: { } }, { key: "path" value: { string_value: "a b" } } ]
    """
    config, _ = parser.parse(text, source="c")
    assert config.parameters == {"intra_op_thread_count": "2", "empty": "", "path": "a b"}


def test_known_unsupported_fields_parse_with_warnings(parser: PbtxtParser) -> None:
    text = """
    name: "densenet"
    backend: "onnxruntime"
    max_batch_size: 4
    input [ { name: "data_0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 224, 224 ] } ]
    output [
      { name: "fc6_1" data_type: TYPE_FP32 dims: [ 1000 ] label_filename: "labels.txt" }
    ]
    optimization {
      graph { level: 1 }
      execution_accelerators {
        gpu_execution_accelerator : [ {
          name : "tensorrt"
          parameters { key: "precision_mode" value: "FP16" }
          parameters { key: "max_workspace_size_bytes" value: "1073741824" }
        } ]
        cpu_execution_accelerator : [ { name : "openvino" } ]
      }
      cuda { graphs: true graph_spec [ { batch_size: 4 input { key: "data_0" value { dim: [ 3, 224, 224 ] } } } ] }
      input_pinned_memory { enable: false }
    }
    model_warmup [
      {
        name: "zeros"
        batch_size: 4
        inputs { key: "data_0" value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true } }
      }
    ]
    response_cache { enable: true }
    instance_group [ { count: 1 kind: KIND_GPU rate_limiter { resources [ { name: "R1" count: 2 } ] } host_policy: "numa0" } ]
    """
    config, warnings = parser.parse(text, source="densenet/config.pbtxt")
    # format is kept and served (Triton's image_client reads it); no server converts the data.
    assert config.input == [TensorConfig(name="data_0", data_type="FP32", dims=[3, 224, 224], format="FORMAT_NCHW")]
    from daemon.model_config import to_triton_json

    assert to_triton_json(config)["input"][0]["format"] == "FORMAT_NCHW"
    assert config.output[0].dims == [1000]
    assert config.output[0].label_filename == "labels.txt"  # used by classification
    # Honoured (daemon.core.host_policy, daemon.core.rate_limiter), so kept.
    assert config.instance_group == [InstanceGroup(
        count=1, kind="KIND_GPU", host_policy="numa0",
        rate_limiter=ModelRateLimiter([RateLimiterResource("R1", count=2)]),
    )]
    ignored = {w.removeprefix("densenet/config.pbtxt: ").split(" ")[0] for w in warnings}
    # The ONNX Runtime graph level and CPU accelerators are honoured (daemon.core.selection);
    # the rest of the block is Triton's tuning.
    assert config.optimization is not None and config.optimization.graph is not None
    assert config.optimization.graph.level == 1
    assert config.optimization.cpu_accelerators() == ["openvino"]
    assert ignored == {
        "optimization.execution_accelerators.gpu_execution_accelerator",
        "optimization.cuda",
        "optimization.input_pinned_memory",
    }
    assert all(w.endswith("is not supported by edged and is ignored") for w in warnings)
    # Served by the daemon's response cache (daemon.core.response_cache).
    assert config.response_cache is not None and config.response_cache.enable
    # Run on every instance before the model is served (daemon.core.warmup).
    assert config.model_warmup[0].batch_size == 4 and config.model_warmup[0].inputs["data_0"].zero_data


def test_sequence_batching_is_parsed_and_its_unsupported_fields_warned(parser: PbtxtParser) -> None:
    text = """
    max_batch_size: 2
    sequence_batching {
      max_sequence_idle_microseconds: 5000000
      control_input [
        { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] }
      ]
      oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] }
      state [ { input_name: "in" output_name: "out" data_type: TYPE_INT32 dims: [ 1 ]
                use_same_buffer_for_input_output: true
                initial_state: { name: "s" data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } ]
    }
    """
    config, warnings = parser.parse(text, source="c")
    assert config.dynamic_batching is None
    sb = config.sequence_batching
    assert sb is not None and sb.max_sequence_idle_microseconds == 5000000
    assert sb.control_input[0].control[0].fp32_false_true == [0.0, 1.0]
    assert sb.oldest is not None and sb.oldest.preferred_batch_size == [2]
    assert sb.state[0].initial_state[0].zero_data
    assert sorted(warnings) == [
        "c: sequence_batching.state[0].use_same_buffer_for_input_output is not supported by edged "
        "and is ignored",
    ]


@pytest.mark.parametrize(("snippet", "where"), [
    ('input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] is_shape_tensor: true } ]', "input[0].is_shape_tensor"),
    ('output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] is_non_linear_format_io: true } ]',
     "output[0].is_non_linear_format_io"),
    ('output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] is_shape_tensor: true } ]', "output[0].is_shape_tensor"),
])
def test_fields_that_change_what_a_request_means_are_refused(parser: PbtxtParser, snippet: str, where: str) -> None:
    """Dropping these would serve the model with other semantics than its config asks for."""
    with pytest.raises(ConfigError, match=rf"m/config.pbtxt: {re.escape(where)} is set, which edged does not implement"):
        parser.parse("max_batch_size: 4\n" + snippet, source="m/config.pbtxt")
    # Their defaults (what Triton's own /config JSON spells out) are fine.
    config, warnings = parser.parse_json(
        '{"input": [{"name": "x", "data_type": "TYPE_INT32", "dims": [1], "is_shape_tensor": false, '
        '"allow_ragged_batch": false, "is_non_linear_format_io": false, "format": "FORMAT_NONE"}], '
        '"batch_input": [], "batch_output": []}', source="m")
    assert config.input[0].name == "x" and warnings == []


def test_iterative_sequence_is_read_and_served(parser: PbtxtParser) -> None:
    config, warnings = parser.parse("sequence_batching { iterative_sequence: true }", source="m/config.pbtxt")
    assert config.sequence_batching is not None and config.sequence_batching.iterative_sequence
    assert warnings == []
    assert to_triton_json(config)["sequence_batching"]["iterative_sequence"] is True
    plain, _ = parser.parse("sequence_batching { }", source="m/config.pbtxt")
    assert "iterative_sequence" not in to_triton_json(plain)["sequence_batching"]
    assert to_triton_json(plain, model_name="m")["sequence_batching"]["iterative_sequence"] is False


def test_syntax_error_names_file_line_and_column(parser: PbtxtParser) -> None:
    text = (
        'name: "m"\nmax_batch_size: 8\ninput [\n  { name: "x" data_type: TYPE_FP32 dims: [ 1 }\n]\n'
    )
    with pytest.raises(ConfigError) as info:
        parser.parse(text, source="m/config.pbtxt")
    message = info.value.message
    assert message.startswith("m/config.pbtxt: line 4, column ")
    assert info.value.status == 400


def test_unknown_field_is_named(parser: PbtxtParser) -> None:
    with pytest.raises(ConfigError, match=r'line 2, column 1: .*no field named "max_batch"'):
        parser.parse('name: "m"\nmax_batch: 8\n', source="m/config.pbtxt")
    with pytest.raises(ConfigError, match=r'line 1, .*ModelInput.*no field named "shape"'):
        parser.parse('input { name: "x" shape: [ 1 ] }', source="m/config.pbtxt")


def test_bad_enum_value_is_named(parser: PbtxtParser) -> None:
    with pytest.raises(ConfigError, match=r"line 1, .*TYPE_FLOAT"):
        parser.parse('input { name: "x" data_type: TYPE_FLOAT dims: 1 }', source="c")


def test_values_rejected_by_model_config_name_the_field(parser: PbtxtParser) -> None:
    with pytest.raises(ConfigError, match=r"^c: .*\$\.max_batch_size"):
        parser.parse("max_batch_size: -1", source="c")
    # TYPE_INVALID is proto3's default, so the field is simply missing.
    with pytest.raises(ConfigError, match=r"data_type.*\$\.input\[0\]"):
        parser.parse('input { name: "x" dims: 1 }', source="c")
    # 100 000 instances kept a load creating threads for minutes.
    with pytest.raises(ConfigError, match=r"Expected `int` <= 1024 - at `\$\.instance_group\[0\]\.count`"):
        parser.parse("instance_group { count: 100000 }", source="c")
    # A queue per level: 2**64-1 levels blocked the event loop for 35 s, then a MemoryError.
    with pytest.raises(ConfigError, match=r"Expected `int` <= 1024 - at `\$\.dynamic_batching\.priority_levels`"):
        parser.parse("dynamic_batching { priority_levels: 18446744073709551615 }", source="c")
    with pytest.raises(ConfigError, match=r"Expected `int` <= 4096 - at `\$\.sequence_batching\.oldest\.max_candidate_sequences`"):
        parser.parse("sequence_batching { oldest { max_candidate_sequences: 2147483647 } }", source="c")


@pytest.mark.parametrize(("snippet", "message"), [
    # Triton 2.51 refuses each of these (measured): these are its texts.
    ("dynamic_batching { priority_levels: 2 default_priority_level: 3 }", r"default priority level must be in range \[1, 2\]"),
    ("dynamic_batching { priority_levels: 2 }", r"default priority level must be in range \[1, 2\]"),
    ("dynamic_batching { priority_levels: 2 default_priority_level: 1 "
     "priority_queue_policy { key: 5 value { max_queue_size: 1 } } }",
     r"priority queue policy must have priority level in range \[1, 2\]"),
])
def test_priority_levels_are_checked_as_triton_checks_them(parser: PbtxtParser, snippet: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message + r" - at `\$\.dynamic_batching`"):
        parser.parse(snippet, source="c")


@pytest.mark.parametrize(("changes", "message"), [
    ({"dynamic_batching": DynamicBatching(preferred_batch_size=[4, -1])},
     "dynamic batching preferred size must be positive for m"),
    ({"dynamic_batching": DynamicBatching(preferred_batch_size=[0])}, "dynamic batching preferred size must be positive for m"),
    ({"dynamic_batching": DynamicBatching(preferred_batch_size=[16])},
     "dynamic batching preferred size must be <= max batch size for m"),
    ({"max_batch_size": 0, "dynamic_batching": DynamicBatching(preferred_batch_size=[2])},
     "dynamic batching preferred size must be <= max batch size for m"),
    ({"input": [TensorConfig(name="x", data_type="FP32", dims=[3, 0])]},
     "model input 'x' dimension must be integer >= 1, or -1 to indicate a variable-size dimension for m"),
    ({"output": [TensorConfig(name="y", data_type="FP32", dims=[0])]},
     "model output 'y' dimension must be integer >= 1, or -1 to indicate a variable-size dimension for m"),
    ({"output": [TensorConfig(name="y", data_type="FP32", dims=[16], reshape=[5])]},
     "model output 'y' has different size for dims and reshape for m"),
    # Between each two variable dimensions the counts must agree too ([2, 4, -1, 6] ~ [8, -1, 1, 6]).
    ({"input": [TensorConfig(name="x", data_type="FP32", dims=[2, 4, -1, 6], reshape=[4, -1, 12])]},
     "model input 'x' has different size for dims and reshape for m"),
    ({"input": [TensorConfig(name="x", data_type="FP32", dims=[-1, 4], reshape=[4])]},
     "model input 'x' has different size for dims and reshape for m"),
    ({"instance_group": [InstanceGroup(kind="KIND_CPU", gpus=[5])]},
     "instance group m_0 of model m has kind KIND_CPU but specifies one or more GPUs"),
])
def test_completed_configs_are_checked_as_triton_checks_them(changes: dict[str, object], message: str) -> None:
    """On the completed config, at load (daemon.core.loading). Before, edged served such
    models: a dimension of 0 no request could match, preferred sizes no batch could reach."""
    base = ModelConfig(name="m", max_batch_size=8, input=[TensorConfig(name="x", data_type="FP32", dims=[-1, 3])],
                       output=[TensorConfig(name="y", data_type="FP32", dims=[3])],
                       dynamic_batching=DynamicBatching(preferred_batch_size=[4, 8]))
    check_completed(base)
    for fine in ([2, 4, -1, 6], [8, -1, 1, 6]), ([16], [4, 4]), ([1], []):
        check_completed(msgspec.structs.replace(base, input=[TensorConfig(name="x", data_type="FP32", dims=fine[0],
                                                                          reshape=fine[1])]))
    with pytest.raises(ConfigError) as caught:
        check_completed(msgspec.structs.replace(base, **changes))
    assert caught.value.message == message


def test_parsers_are_independent_of_the_global_pool() -> None:
    first, second = PbtxtParser(), PbtxtParser()
    a, _ = first.parse('name: "a"', source="c")
    b, _ = second.parse('name: "b"', source="c")
    assert (a.name, b.name) == ("a", "b")


def _schema_signature(file: descriptor_pb2.FileDescriptorProto) -> dict[str, object]:
    """Every message/enum by qualified name -> its fields (name, number, label, type, type name,
    oneof) or values; insensitive to declaration order."""
    out: dict[str, object] = {}

    def add_enum(prefix: str, enum: descriptor_pb2.EnumDescriptorProto) -> None:
        out[prefix + enum.name] = sorted((v.name, v.number) for v in enum.value)

    def add_message(prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
        name = prefix + message.name
        out[name] = sorted(
            (
                f.name,
                f.number,
                f.label,
                f.type,
                f.type_name,
                message.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else "",
            )
            for f in message.field
        )
        out[name + " map_entry"] = message.options.map_entry
        for nested in message.nested_type:
            add_message(name + ".", nested)
        for enum in message.enum_type:
            add_enum(name + ".", enum)

    for enum in file.enum_type:
        add_enum("", enum)
    for message in file.message_type:
        add_message("", message)
    return out


def test_schema_matches_tritons_generated_descriptor() -> None:
    """Our tables against the descriptor protoc generated from Triton's model_config.proto for
    tritonclient. Read from its source text (not imported, so protobuf's global pool and the
    gencode version check stay out of it)."""
    spec = importlib.util.find_spec("tritonclient")
    if spec is None or spec.origin is None:
        pytest.skip("tritonclient is not installed")
    generated = Path(spec.origin).parent / "grpc" / "model_config_pb2.py"
    serialized = next(
        ast.literal_eval(node.args[0])
        for node in ast.walk(ast.parse(generated.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "AddSerializedFile"
    )
    theirs = descriptor_pb2.FileDescriptorProto.FromString(serialized)
    assert theirs.package == "inference"
    assert _schema_signature(_schema_file()) == _schema_signature(theirs)


# --- model.toml -----------------------------------------------------------------------------


def test_toml_equals_pbtxt(tmp_path: Path, parser: PbtxtParser) -> None:
    from_pbtxt, _ = read_model_config(
        model_dir(tmp_path / "p", "simple", {"config.pbtxt": SIMPLE_PBTXT})
    )
    from_toml, warnings = read_model_config(
        model_dir(tmp_path / "t", "simple", {"model.toml": SIMPLE_TOML})
    )
    assert from_toml == from_pbtxt
    assert warnings == []
    batched_pbtxt, _ = parser.parse(BATCHING_PBTXT, source="c")
    assert parse_model_toml(BATCHING_TOML, source="t") == batched_pbtxt


def test_toml_from_the_readme(tmp_path: Path) -> None:
    text = """
    backend = "onnxruntime"
    max_batch_size = 8
    [[input]]
    name = "INPUT0"
    data_type = "INT32"
    dims = [16]
    [dynamic_batching]
    max_queue_delay_microseconds = 500
    """
    config, _ = read_model_config(model_dir(tmp_path, "m", {"model.toml": text}))
    assert config.name == "m"
    assert config.input == [TensorConfig(name="INPUT0", data_type="INT32", dims=[16])]
    assert config.dynamic_batching == DynamicBatching(max_queue_delay_microseconds=500)


def test_toml_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    text = '[[input]]\nname = "x"\ndata_type = "FP32"\ndims = [1]\nshape = [1]\n'
    directory = model_dir(tmp_path, "m", {"model.toml": text})
    with pytest.raises(ConfigError) as info:
        read_model_config(directory)
    message = info.value.message
    assert str(directory / "model.toml") in message
    assert "`shape`" in message
    assert "$.input[0]" in message


def test_toml_bad_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^t: .*line 2"):
        parse_model_toml('name = "m"\nmax_batch_size = \n', source="t")
    with pytest.raises(ConfigError, match=r"unknown data_type 'FLOAT32'"):
        parse_model_toml('[[input]]\nname = "x"\ndata_type = "FLOAT32"\ndims = [1]', source="t")
    with pytest.raises(ConfigError, match=r"priority_queue_policy key 'high'"):
        parse_model_toml("[dynamic_batching.priority_queue_policy.high]\n", source="t")


# --- model directories ----------------------------------------------------------------------


def test_name_defaults_to_directory_and_mismatch_is_an_error(
    tmp_path: Path, parser: PbtxtParser
) -> None:
    directory = model_dir(tmp_path, "renamed", {"config.pbtxt": SIMPLE_PBTXT})
    with pytest.raises(ConfigError, match=r"config\.pbtxt: model name 'simple'.*'renamed'"):
        read_model_config(directory)
    directory = model_dir(tmp_path, "other", {"model.toml": SIMPLE_TOML})
    with pytest.raises(ConfigError, match=r"model\.toml: model name 'simple'.*'other'"):
        read_model_config(directory)


def test_both_config_files_is_an_error(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, "simple", {"config.pbtxt": SIMPLE_PBTXT, "model.toml": ""})
    with pytest.raises(ConfigError, match=r"both config\.pbtxt and model\.toml"):
        read_model_config(directory)


def test_no_config_file_gives_a_minimal_config(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, "bare", {}, versions=(1,))
    config, warnings = read_model_config(directory)
    assert config == ModelConfig(name="bare")
    assert warnings == []
    with pytest.raises(NotFound):
        read_model_config(tmp_path / "missing")


def test_unreadable_encoding_is_a_config_error(tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.pbtxt").write_bytes(b'name: "\xff"')
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_model_config(directory)


def test_list_versions(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, "m", {"config.pbtxt": "", "3": "a file, not a version"})
    for name in ("1", "2", "10", "0", "007", "v4", ".5"):
        (directory / name).mkdir()
    assert list_versions(directory) == [1, 2, 10]
    assert list_versions(tmp_path / "missing") == []


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (VersionPolicy(), [10]),
        (VersionPolicy("latest", 2), [3, 10]),
        (VersionPolicy("latest", 9), [1, 3, 10]),
        (VersionPolicy("all"), [1, 3, 10]),
        (VersionPolicy("specific", versions=[3, 1, 3]), [1, 3]),
    ],
)
def test_select_versions(policy: VersionPolicy, expected: list[int]) -> None:
    assert select_versions([10, 1, 3], policy) == expected


def test_select_missing_specific_versions_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"model 'm'.*\[2, 7\] not found.*\[1, 3\]"):
        select_versions([1, 3], VersionPolicy("specific", versions=[1, 2, 7]), model="m")
    assert select_versions([], VersionPolicy()) == []
    # Triton 2.51's text for latest with no versions (measured; it refuses the load).
    with pytest.raises(ConfigError, match=r"^at least one version must be available under the version policy of model 'm'$"):
        select_versions([1, 3], VersionPolicy("latest", 0), model="m")


def test_scan_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    model_dir(repo, "with_pbtxt", {"config.pbtxt": ""})
    model_dir(repo, "with_toml", {"model.toml": ""})
    model_dir(repo, "versions_only", {}, versions=(2,))
    model_dir(repo, "empty", {})
    model_dir(repo, "not_a_version", {}).joinpath("latest").mkdir()
    model_dir(repo, ".hidden", {"config.pbtxt": ""})
    (repo / "README.md").write_text("not a model")
    assert scan_repository(repo) == {
        "versions_only": repo / "versions_only",
        "with_pbtxt": repo / "with_pbtxt",
        "with_toml": repo / "with_toml",
    }
    with pytest.raises(ConfigError, match="missing"):
        scan_repository(tmp_path / "missing")


def test_fingerprint_tracks_files_and_version_dirs(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, "m", {"config.pbtxt": SIMPLE_PBTXT}, versions=(1,))
    artifact = directory / "1" / "model.onnx"
    os.utime(artifact, ns=(1_000_000_000, 1_000_000_000))
    before = fingerprint(directory)
    assert fingerprint(directory) == before

    # Same size, new mtime (a model replaced in place).
    os.utime(artifact, ns=(2_000_000_000, 2_000_000_000))
    touched = fingerprint(directory)
    assert touched != before

    # Same mtime, new size.
    artifact.write_bytes(b"onnx2")
    os.utime(artifact, ns=(2_000_000_000, 2_000_000_000))
    resized = fingerprint(directory)
    assert resized not in (before, touched)

    (directory / "2").mkdir()
    with_dir = fingerprint(directory)
    assert with_dir != resized
    (directory / "2").rmdir()
    assert fingerprint(directory) == resized


def test_fingerprint_leaves_out_pythons_bytecode_cache(tmp_path: Path) -> None:
    """Importing a python model's code may write __pycache__ beside it: no change of the model."""
    directory = model_dir(tmp_path, "m", {"config.pbtxt": SIMPLE_PBTXT}, versions=(1,))
    before = fingerprint(directory)
    (directory / "1" / "__pycache__").mkdir()
    (directory / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"bytecode")
    assert fingerprint(directory) == before
    (directory / "1" / "pycache").mkdir()  # any other directory is
    assert fingerprint(directory) != before


def test_fingerprint_follows_symlinks_without_looping(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "model.onnx").write_bytes(b"a")
    directory = model_dir(tmp_path, "m", {"config.pbtxt": ""})
    (directory / "1").symlink_to(store, target_is_directory=True)
    before = fingerprint(directory)
    # A link back up the tree is not walked again (and not forever).
    (store / "loop").symlink_to(directory, target_is_directory=True)
    assert fingerprint(directory) == before
    (store / "model.onnx").write_bytes(b"bb")
    assert fingerprint(directory) != before


def test_backend_preference_travels_as_a_parameter(tmp_path: Path) -> None:
    from daemon.model_config import to_triton_json

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(
        'parameters { key: "backend_preference" value { string_value: "onnxruntime, openvino" } }\n'
        'parameters { key: "other" value { string_value: "1" } }\n'
    )
    config, _ = read_model_config(tmp_path / "m")
    assert config.backend_preference == ["onnxruntime", "openvino"]
    assert config.parameters == {"other": "1"}
    import json

    again, _ = PbtxtParser().parse_json(json.dumps(to_triton_json(config)), source="round trip")
    assert again == config


def test_a_served_config_loads_back(tmp_path: Path) -> None:
    """What `/config` serves (the completed document, Triton's fields spelled out) is a config
    the repository API takes back, and it means the same model."""
    import json

    from daemon.model_config import to_triton_json

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 4\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
        "sequence_batching {\n  control_input [\n"
        '    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] }\n'
        "  ]\n}\n"
    )
    config, _ = read_model_config(tmp_path / "m")
    served = to_triton_json(config, model_name="m", filename="model.py")
    assert served["sequence_batching"]["control_input"][0]["control"][0]["data_type"] == "TYPE_INVALID"
    again, _ = PbtxtParser().parse_json(json.dumps(served), source="served")
    assert again.sequence_batching == config.sequence_batching
    assert (again.input, again.output, again.max_batch_size) == (config.input, config.output, config.max_batch_size)
    assert [(g.name, g.count, g.kind) for g in again.instance_group] == [("m", 1, "KIND_CPU")]


def test_format_is_for_inputs_only() -> None:
    """model.toml shares one tensor table for inputs and outputs: an output's format would be
    taken and dropped, so it is refused (config.pbtxt's schema has no such field)."""
    from daemon.model_config import config_from_mapping

    tensor = {"data_type": "TYPE_FP32", "dims": [1], "format": "FORMAT_NCHW"}
    config = config_from_mapping({"input": [{"name": "x", **tensor}]}, source="m")
    assert config.input[0].format == "FORMAT_NCHW"
    with pytest.raises(ConfigError, match="output 'y': format applies to inputs only"):
        config_from_mapping({"output": [{"name": "y", **tensor}]}, source="m")


@pytest.mark.parametrize(
    ("kind", "field", "value", "refused"),
    [("output", "optional", True, "output 'y': optional applies to inputs only"),
     ("input", "label_filename", "labels.txt", "input 'y': label_filename applies to outputs only")],
)
def test_a_field_of_the_other_tensor_kind_is_refused(kind: str, field: str, value: object, refused: str) -> None:
    """`optional` is an input's, `label_filename` an output's: on the other kind they would be
    taken and dropped (neither the served config nor the data plane reads them there)."""
    from daemon.model_config import config_from_mapping

    tensor = {"name": "y", "data_type": "TYPE_FP32", "dims": [1], field: value}
    other = "input" if kind == "output" else "output"
    config = config_from_mapping({other: [tensor]}, source="m")
    assert getattr(getattr(config, other)[0], field) == value
    with pytest.raises(ConfigError, match=refused):
        config_from_mapping({kind: [tensor]}, source="m")


def test_a_warmup_input_takes_one_kind_of_data_in_any_config_format() -> None:
    """config.pbtxt gets this from protobuf's oneof; model.toml and JSON from the model."""
    from daemon.model_config import config_from_mapping

    sample = {"name": "s", "batch_size": 1, "inputs": {"X": {"data_type": "TYPE_FP32", "dims": [2], "zero_data": True}}}
    config = config_from_mapping({"name": "m", "model_warmup": [sample]}, source="m")
    assert config.model_warmup[0].inputs["X"].data_type == "FP32"
    sample["inputs"]["X"]["random_data"] = True  # type: ignore[index]
    with pytest.raises(ConfigError, match="set one of zero_data, random_data and input_data_file"):
        config_from_mapping({"name": "m", "model_warmup": [sample]}, source="m")


def test_ragged_batching_fields_parse_and_serve_as_triton_spells_them(parser: PbtxtParser) -> None:
    config, warnings = parser.parse(
        'max_batch_size: 4\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'batch_input [ { kind: BATCH_ITEM_SHAPE_FLATTEN target_name: "s" data_type: TYPE_INT32 source_input: "x" },\n'
        '              { target_name: "n" data_type: TYPE_FP32 source_input: "x" } ]\n'
        'batch_output [ { target_name: "y" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "x" } ]\n',
        source="m/config.pbtxt")
    assert warnings == []
    assert config.input[0].allow_ragged_batch
    assert [(b.kind, b.target_name, b.data_type, b.source_input) for b in config.batch_input] == [
        ("BATCH_ITEM_SHAPE_FLATTEN", ["s"], "INT32", ["x"]), ("BATCH_ELEMENT_COUNT", ["n"], "FP32", ["x"])]
    served = to_triton_json(config, model_name="m")
    assert served["input"][0]["allow_ragged_batch"] is True and "allow_ragged_batch" not in served["output"][0]
    assert served["batch_input"][1] == {"kind": "BATCH_ELEMENT_COUNT", "target_name": ["n"], "data_type": "TYPE_FP32",
                                        "source_input": ["x"]}
    assert served["batch_output"] == [{"target_name": ["y"], "kind": "BATCH_SCATTER_WITH_INPUT_SHAPE",
                                       "source_input": ["x"]}]
    # What Triton's own /config JSON says reads back the same.
    again, _ = parser.parse_json(json.dumps(served), source="m")
    assert again.batch_input == config.batch_input and again.batch_output == config.batch_output
    # An output has no such field: config.pbtxt's schema says so, and a TOML or JSON config too.
    with pytest.raises(ConfigError, match='has no field named "allow_ragged_batch"'):
        parser.parse('output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] allow_ragged_batch: true } ]', source="m")
    with pytest.raises(ConfigError, match="output 'y': allow_ragged_batch applies to inputs only"):
        config_from_mapping({"output": [{"name": "y", "data_type": "FP32", "dims": [1], "allow_ragged_batch": True}]},
                            source="m/model.toml")


def test_the_onnx_runtime_graph_level_is_read_and_the_rest_of_optimization_dropped(parser: PbtxtParser) -> None:
    config, warnings = parser.parse(
        "optimization { graph { level: -1 } priority: PRIORITY_MAX input_pinned_memory { enable: false } }\n",
        source="m/config.pbtxt")
    assert config.optimization is not None and config.optimization.graph is not None
    assert config.optimization.graph.level == -1
    assert sorted(warnings) == [
        "m/config.pbtxt: optimization.input_pinned_memory is not supported by edged and is ignored",
        "m/config.pbtxt: optimization.priority is not supported by edged and is ignored",
    ]
    assert to_triton_json(config)["optimization"] == {"graph": {"level": -1}}


def test_metric_tags_are_kept_and_their_keys_checked(parser: PbtxtParser) -> None:
    config, warnings = parser.parse('metric_tags { key: "team" value: "vision" }\n', source="m/config.pbtxt")
    assert config.metric_tags == {"team": "vision"} and warnings == []
    assert to_triton_json(config)["metric_tags"] == {"team": "vision"}
    assert "metric_tags" not in to_triton_json(ModelConfig())
    assert to_triton_json(ModelConfig(), model_name="m")["metric_tags"] == {}
    # The label is `_<key>`: a key Prometheus cannot carry there is refused at load.
    for key in ("a-b", "_x", "", "tier 2"):
        with pytest.raises(ConfigError, match=r"metric_tags key .*: use letters, digits and '_', not first"):
            parser.parse(f'metric_tags {{ key: "{key}" value: "v" }}\n', source="m/config.pbtxt")
