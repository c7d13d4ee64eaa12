"""Small models built on the spot: the no-flag demo repository, and fixtures for tests and benches.

Everything is generated with `onnx.helper` (ONNX is an optional dependency, so it is imported
inside the functions) and written in Triton's repository layout with hand-written config.pbtxt
text. The models use opset 13 and IR version 8 so that older ONNX Runtime releases (1.10+) and
OpenVINO's ONNX frontend load them too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from daemon.backend import NUMPY_DTYPES

if TYPE_CHECKING:
    import onnx

OPSET = 13
IR_VERSION = 8

# Every KServe datatype an ONNX model can carry through numpy (BF16 has no numpy dtype).
ZOO_DATATYPES: tuple[str, ...] = tuple(name for name in NUMPY_DTYPES if name != "BF16")

# (weight, bias) per layer, as returned by build_mlp_onnx.
MlpWeights = list[tuple[np.ndarray, np.ndarray]]


def _onnx() -> Any:
    try:
        import onnx
    except ImportError as exc:  # the demo is optional; say what to install
        raise RuntimeError(
            "building the demo models needs the `onnx` package (pip install 'edged[onnxruntime]')"
        ) from exc
    return onnx


def _save(model: onnx.ModelProto, path: Path) -> None:
    onnx = _onnx()
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    helper = _onnx().helper
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="edged.demo",
    )


# --------------------------------------------------------------------------- Triton's `simple`


def build_simple_onnx(path: Path, max_batch: bool = True) -> None:
    """Triton's `simple` example: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (INT32).

    With `max_batch` the first dimension is symbolic ("batch", shape [-1, 16]) so the model
    takes merged batches; without it the shape is fixed at [1, 16], which is what Triton's
    `simple` client examples send.
    """
    onnx = _onnx()
    helper, int32 = onnx.helper, onnx.TensorProto.INT32
    shape: list[Any] = ["batch", 16] if max_batch else [1, 16]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [helper.make_tensor_value_info(n, int32, shape) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, int32, shape) for n in ("OUTPUT0", "OUTPUT1")],
    )
    _save(_model(graph), path)


def _simple_tensors(max_batch_size: int) -> str:
    lines = []
    for kind, names in (("input", ("INPUT0", "INPUT1")), ("output", ("OUTPUT0", "OUTPUT1"))):
        entries = ",\n".join(
            f'  {{\n    name: "{name}"\n    data_type: TYPE_INT32\n    dims: [ 16 ]\n  }}'
            for name in names
        )
        lines.append(f"{kind} [\n{entries}\n]")
    return f"max_batch_size: {max_batch_size}\n" + "\n".join(lines) + "\n"


# The shipped demo's Python model (package data) is the one source of this code.
SIMPLE_PYTHON_MODEL = (
    Path(__file__).resolve().parent.parent / "daemon" / "demo_models" / "simple_python" / "1" / "model.py"
).read_text(encoding="utf-8")


def write_simple_repository(repo: Path, *, python: bool = True) -> None:
    """Write `simple` (ONNX) and, with `python`, `simple_python` into a Triton-layout repository."""
    simple = repo / "simple"
    build_simple_onnx(simple / "1" / "model.onnx")
    (simple / "config.pbtxt").write_text(
        'name: "simple"\nplatform: "onnxruntime_onnx"\n' + _simple_tensors(8), encoding="utf-8"
    )
    if not python:
        return
    simple_python = repo / "simple_python"
    (simple_python / "1").mkdir(parents=True, exist_ok=True)
    (simple_python / "1" / "model.py").write_text(SIMPLE_PYTHON_MODEL, encoding="utf-8")
    (simple_python / "config.pbtxt").write_text(
        'name: "simple_python"\nbackend: "python"\n' + _simple_tensors(8), encoding="utf-8"
    )


# --------------------------------------------------------------------------- MLP


def build_mlp_onnx(path: Path, width: int, depth: int, seed: int = 0) -> MlpWeights:
    """An FP32 MLP `OUTPUT0 = L_depth(...relu(L_1(INPUT0)))`, INPUT0/OUTPUT0 shape [batch, width].

    Weights come from `numpy.random.default_rng(seed)`; they are returned so a caller can compute
    the expected output with `mlp_reference`.
    """
    if width < 1 or depth < 1:
        raise ValueError(f"width and depth must be >= 1, got width={width} depth={depth}")
    onnx = _onnx()
    helper, fp32 = onnx.helper, onnx.TensorProto.FLOAT
    rng = np.random.default_rng(seed)
    weights: MlpWeights = []
    nodes = []
    initializers = []
    current = "INPUT0"
    for layer in range(depth):
        # 1/sqrt(width) keeps activations O(1) at any depth, so relative tolerances stay meaningful.
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        b = (0.1 * rng.standard_normal(width)).astype(np.float32)
        weights.append((w, b))
        initializers += [
            onnx.numpy_helper.from_array(w, f"w{layer}"),
            onnx.numpy_helper.from_array(b, f"b{layer}"),
        ]
        last = layer == depth - 1
        out = "OUTPUT0" if last else f"h{layer}"
        nodes.append(helper.make_node("MatMul", [current, f"w{layer}"], [f"mm{layer}"]))
        nodes.append(
            helper.make_node("Add", [f"mm{layer}", f"b{layer}"], [out if last else f"pre{layer}"])
        )
        if not last:
            nodes.append(helper.make_node("Relu", [f"pre{layer}"], [out]))
        current = out
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("INPUT0", fp32, ["batch", width])],
        [helper.make_tensor_value_info("OUTPUT0", fp32, ["batch", width])],
        initializer=initializers,
    )
    _save(_model(graph), path)
    return weights


def mlp_reference(x: np.ndarray, weights: MlpWeights) -> np.ndarray:
    """What the model from `build_mlp_onnx` computes, in numpy."""
    out = x.astype(np.float32)
    for layer, (w, b) in enumerate(weights):
        out = out @ w + b
        if layer < len(weights) - 1:
            out = np.maximum(out, 0)
    return out


# --------------------------------------------------------------------------- datatype zoo


def build_dtype_zoo_onnx(path: Path) -> dict[str, tuple[str, str]]:
    """One Identity per datatype in ZOO_DATATYPES: `INPUT_<DT>` -> `OUTPUT_<DT>`, shape [batch, n].

    Returns {datatype: (input name, output name)}. Used to round-trip every datatype through the
    codecs and a real runtime.
    """
    onnx = _onnx()
    helper, proto = onnx.helper, onnx.TensorProto
    elem = {
        "BOOL": proto.BOOL,
        "UINT8": proto.UINT8,
        "UINT16": proto.UINT16,
        "UINT32": proto.UINT32,
        "UINT64": proto.UINT64,
        "INT8": proto.INT8,
        "INT16": proto.INT16,
        "INT32": proto.INT32,
        "INT64": proto.INT64,
        "FP16": proto.FLOAT16,
        "FP32": proto.FLOAT,
        "FP64": proto.DOUBLE,
        "BYTES": proto.STRING,
    }
    names = {dt: (f"INPUT_{dt}", f"OUTPUT_{dt}") for dt in ZOO_DATATYPES}
    graph = helper.make_graph(
        [helper.make_node("Identity", [i], [o]) for i, o in names.values()],
        "dtype_zoo",
        [
            helper.make_tensor_value_info(i, elem[dt], ["batch", "n"])
            for dt, (i, _) in names.items()
        ],
        [
            helper.make_tensor_value_info(o, elem[dt], ["batch", "n"])
            for dt, (_, o) in names.items()
        ],
    )
    _save(_model(graph), path)
    return names


# --------------------------------------------------------------------------- ragged batching

RAGGED_CONFIG = """max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
batch_input [
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "INDEX" data_type: TYPE_INT32 source_input: "INPUT" },
  { kind: BATCH_ELEMENT_COUNT target_name: "COUNT" data_type: TYPE_FP32 source_input: "INPUT" },
  { kind: BATCH_ITEM_SHAPE target_name: "ITEM" data_type: TYPE_INT32 source_input: "INPUT" }
]
output [
  { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "DOUBLE" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "N" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "SHAPE" data_type: TYPE_INT32 dims: [ 1 ] }
]
batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "DOUBLE" source_input: "INPUT" } ]
"""


def build_ragged_onnx(path: Path) -> None:
    """A model written for Triton's ragged batching (`RAGGED_CONFIG`): INPUT is every request's
    elements end to end, INDEX where each request starts and ends (accumulated counts with a
    leading 0), COUNT each request's element count, ITEM each row's shape. Per request: SUM of
    its elements (from INPUT's running sum at INDEX), N its count, SHAPE its row's shape, and
    DOUBLE = 2 * INPUT scattered back by each request's INPUT shape."""
    onnx = _onnx()
    helper, tp = onnx.helper, onnx.TensorProto
    const = helper.make_tensor
    nodes = [
        helper.make_node("Constant", [], ["zero"], value=const("zero", tp.FLOAT, [1], [0.0])),
        helper.make_node("Constant", [], ["two"], value=const("two", tp.FLOAT, [], [2.0])),
        helper.make_node("Constant", [], ["axis0"], value=const("axis0", tp.INT64, [], [0])),
        helper.make_node("Constant", [], ["axes1"], value=const("axes1", tp.INT64, [1], [1])),
        helper.make_node("Constant", [], ["first"], value=const("first", tp.INT64, [1], [0])),
        helper.make_node("Constant", [], ["second"], value=const("second", tp.INT64, [1], [1])),
        helper.make_node("Constant", [], ["last"], value=const("last", tp.INT64, [1], [-1])),
        helper.make_node("Constant", [], ["end"], value=const("end", tp.INT64, [1], [2**62])),
        helper.make_node("Concat", ["zero", "INPUT"], ["padded"], axis=0),
        helper.make_node("CumSum", ["padded", "axis0"], ["running"]),
        helper.make_node("Cast", ["INDEX"], ["index64"], to=tp.INT64),
        helper.make_node("Gather", ["running", "index64"], ["at"], axis=0),
        helper.make_node("Slice", ["at", "second", "end"], ["hi"]),
        helper.make_node("Slice", ["at", "first", "last"], ["lo"]),
        helper.make_node("Sub", ["hi", "lo"], ["sums"]),
        helper.make_node("Unsqueeze", ["sums", "axes1"], ["SUM"]),
        helper.make_node("Mul", ["INPUT", "two"], ["DOUBLE"]),
        helper.make_node("Unsqueeze", ["COUNT", "axes1"], ["N"]),
        helper.make_node("Identity", ["ITEM"], ["SHAPE"]),
    ]
    graph = helper.make_graph(
        nodes,
        "ragged",
        [
            helper.make_tensor_value_info("INPUT", tp.FLOAT, ["total"]),
            helper.make_tensor_value_info("INDEX", tp.INT32, ["requests_plus_one"]),
            helper.make_tensor_value_info("COUNT", tp.FLOAT, ["requests"]),
            helper.make_tensor_value_info("ITEM", tp.INT32, ["rows", 1]),
        ],
        [
            helper.make_tensor_value_info("SUM", tp.FLOAT, ["requests", 1]),
            helper.make_tensor_value_info("DOUBLE", tp.FLOAT, ["total"]),
            helper.make_tensor_value_info("N", tp.FLOAT, ["requests", 1]),
            helper.make_tensor_value_info("SHAPE", tp.INT32, ["rows", 1]),
        ],
    )
    _save(_model(graph), path)
