"""Stateful models for the sequence batcher's tests and bench, built here (no downloads).

- `simple_sequence`: Triton's docs example, rebuilt with onnx.helper from its graph:
  OUTPUT = READY * (INPUT + START). Stateless: the control inputs are what it shows.
- `simple_dyna_sequence`: OUTPUT = READY * (INPUT + START + END * int32(CORRID)), Triton's
  `oldest` example with a UINT64 CORRID control.
- `accumulator`: a real stateful model through *implicit state*: ACC = STATE * (1 - START) +
  INPUT, returned as OUTPUT and as the next STATE (`state { input_name: "STATE_IN"
  output_name: "STATE_OUT" }`); the server keeps the running sum between requests.
- `py_accumulator`: a Python-backend model keeping its own running sums keyed by the CORRID
  control (TYPE_STRING), with bool START, fp32 END and int32 READY controls.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 13
IR_VERSION = 8


def _int_io(name: str, elem: int = TensorProto.INT32) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, ["batch", 1])


def _save(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
          outputs: list[onnx.ValueInfoProto], path: Path) -> None:
    graph = helper.make_graph(nodes, path.parent.parent.name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def simple_sequence_onnx(path: Path, *, dyna: bool = False) -> None:
    nodes = [helper.make_node("Add", ["INPUT", "START"], ["sum0"])]
    inputs = [_int_io("INPUT"), _int_io("START"), _int_io("READY")]
    total = "sum0"
    if dyna:
        inputs += [_int_io("END"), _int_io("CORRID", TensorProto.UINT64)]
        nodes += [
            helper.make_node("Cast", ["CORRID"], ["corrid32"], to=TensorProto.INT32),
            helper.make_node("Mul", ["END", "corrid32"], ["endcorr"]),
            helper.make_node("Add", ["sum0", "endcorr"], ["sum1"]),
        ]
        total = "sum1"
    nodes.append(helper.make_node("Mul", ["READY", total], ["OUTPUT"]))
    _save(nodes, inputs, [_int_io("OUTPUT")], path)


def simple_sequence_expected(values: list[int], corrid: int = 0, *, dyna: bool = False) -> list[int]:
    """What the model answers for one sequence of `values` (START on the first, END on the last)."""
    out = []
    for index, value in enumerate(values):
        start = int(index == 0)
        end = int(index == len(values) - 1)
        out.append(value + start + (end * int(np.uint64(corrid).astype(np.int32)) if dyna else 0))
    return out


def accumulator_onnx(path: Path) -> None:
    nodes = [
        helper.make_node("Sub", ["one", "START"], ["keep"]),
        helper.make_node("Mul", ["STATE_IN", "keep"], ["kept"]),
        helper.make_node("Add", ["kept", "INPUT"], ["acc"]),
        helper.make_node("Identity", ["acc"], ["OUTPUT"]),
        helper.make_node("Identity", ["acc"], ["STATE_OUT"]),
    ]
    one = helper.make_tensor("one", TensorProto.INT32, [1], [1])
    graph = helper.make_graph(
        nodes, "accumulator",
        [_int_io("INPUT"), _int_io("START"), _int_io("STATE_IN")],
        [_int_io("OUTPUT"), _int_io("STATE_OUT")],
        initializer=[one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


_CONTROL = """  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START {start} }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}{extra}
  ]
"""
_IO = """input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def write_simple_sequence(repo: Path, name: str = "simple_sequence", *, max_batch_size: int = 8,
                          instances: int = 1, strategy: str = "", idle_us: int = 0) -> Path:
    """Triton's `simple_sequence` layout (direct strategy unless `strategy` says otherwise)."""
    folder = repo / name
    simple_sequence_onnx(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
        "sequence_batching {\n"
        + (f"  max_sequence_idle_microseconds: {idle_us}\n" if idle_us else "")
        + (f"  {strategy}\n" if strategy else "")
        + _CONTROL.format(start="int32_false_true: [ 0, 1 ]", extra="")
        + "}\n" + _IO
        + f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
    )
    return folder


def write_simple_dyna_sequence(repo: Path, name: str = "simple_dyna_sequence", *, max_batch_size: int = 8,
                               instances: int = 2, strategy: str = "") -> Path:
    """Triton's `simple_dyna_sequence`: oldest strategy, START/END/READY/CORRID controls."""
    folder = repo / name
    simple_sequence_onnx(folder / "1" / "model.onnx", dyna=True)
    strategy = strategy or "oldest { max_candidate_sequences: 1024 max_queue_delay_microseconds: 10000 }"
    extra = (',\n    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },\n'
             '    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }')
    (folder / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
        "sequence_batching {\n  max_sequence_idle_microseconds: 10000000\n"
        f"  {strategy}\n"
        + _CONTROL.format(start="int32_false_true: [ 0, 1 ]", extra=extra)
        + "}\n" + _IO
        + f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
    )
    return folder


def write_accumulator(repo: Path, name: str = "accumulator", *, max_batch_size: int = 4,
                      instances: int = 2, strategy: str = "", idle_us: int = 0,
                      backend: str = "onnxruntime") -> Path:
    """The implicit-state accumulator (config.pbtxt)."""
    folder = repo / name
    accumulator_onnx(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(
        f'backend: "{backend}"\nmax_batch_size: {max_batch_size}\n'
        "sequence_batching {\n"
        + (f"  max_sequence_idle_microseconds: {idle_us}\n" if idle_us else "")
        + (f"  {strategy}\n" if strategy else "")
        + '  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START '
          "int32_false_true: [ 0, 1 ] } ] } ]\n"
        + '  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 '
          'dims: [ 1 ] initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true '
          'name: "zeros" } } ]\n'
        "}\n" + _IO
        + f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
    )
    return folder


def write_accumulator_toml(repo: Path, name: str = "accumulator_toml") -> Path:
    """The same accumulator configured by a native model.toml (oldest strategy)."""
    folder = repo / name
    accumulator_onnx(folder / "1" / "model.onnx")
    (folder / "model.toml").write_text(
        'backend = "onnxruntime"\nmax_batch_size = 4\n'
        '[[input]]\nname = "INPUT"\ndata_type = "INT32"\ndims = [1]\n'
        '[[output]]\nname = "OUTPUT"\ndata_type = "INT32"\ndims = [1]\n'
        "[[instance_group]]\ncount = 1\nkind = \"KIND_CPU\"\n"
        "[sequence_batching]\nmax_sequence_idle_microseconds = 5000000\n"
        "[sequence_batching.oldest]\nmax_candidate_sequences = 8\nmax_queue_delay_microseconds = 1000\n"
        '[[sequence_batching.control_input]]\nname = "START"\n'
        '[[sequence_batching.control_input.control]]\nkind = "CONTROL_SEQUENCE_START"\n'
        "int32_false_true = [0, 1]\n"
        '[[sequence_batching.state]]\ninput_name = "STATE_IN"\noutput_name = "STATE_OUT"\n'
        'data_type = "TYPE_INT32"\ndims = [1]\n'
    )
    return folder


PY_ACCUMULATOR = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Running sums keyed by the CORRID control; START bool, END fp32, READY int32."""

    def initialize(self, args):
        self.totals = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            x = int(get("INPUT").reshape(-1)[0])
            start = bool(get("START").reshape(-1)[0])
            end = float(get("END").reshape(-1)[0]) == 1.0
            ready = int(get("READY").reshape(-1)[0]) == 1
            corrid = get("CORRID").reshape(-1)[0].decode()
            if not ready:
                raise pb_utils.TritonModelException("a request was not ready")
            total = (0 if start else self.totals[corrid]) + x
            if end:
                self.totals.pop(corrid, None)
            else:
                self.totals[corrid] = total
            out = np.array([[total]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
'''


def _python_model(repo: Path, name: str, source: str, config: str) -> Path:
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text(source)
    (folder / "config.pbtxt").write_text('backend: "python"\n' + config)
    return folder


def write_py_accumulator(repo: Path, name: str = "py_accumulator", *, strategy: str = "") -> Path:
    strategy = strategy or "oldest { max_candidate_sequences: 16 }"
    return _python_model(
        repo, name, PY_ACCUMULATOR,
        "max_batch_size: 4\n"
        "sequence_batching {\n"
        f"  {strategy}\n"
        "  control_input [\n"
        '    { name: "START" control [ { kind: CONTROL_SEQUENCE_START bool_false_true: [ false, true ] } ] },\n'
        '    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },\n'
        '    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },\n'
        '    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }\n'
        "  ]\n}\n" + _IO
        + "instance_group [ { count: 1 kind: KIND_CPU } ]\n",
    )


def rnn_cell_onnx(path: Path, width: int, seed: int = 0) -> np.ndarray:
    """A recurrent cell through implicit state: H = tanh(H_IN @ U + INPUT), returned as OUTPUT
    and as the next H (FP32 [width]). Returns U for `rnn_cell_reference`."""
    rng = np.random.default_rng(seed)
    u = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    vec = ["batch", width]
    nodes = [
        helper.make_node("MatMul", ["H_IN", "U"], ["hu"]),
        helper.make_node("Add", ["hu", "INPUT"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["OUTPUT"]),
        helper.make_node("Identity", ["OUTPUT"], ["H_OUT"]),
    ]
    graph = helper.make_graph(
        nodes, "rnn_cell",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, vec) for n in ("INPUT", "H_IN")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, vec) for n in ("OUTPUT", "H_OUT")],
        initializer=[helper.make_tensor("U", TensorProto.FLOAT, [width, width], u.ravel().tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return u


def rnn_cell_reference(xs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Every step's output for one sequence of inputs `xs` [steps, width], from a zero state."""
    h = np.zeros(u.shape[0], dtype=np.float32)
    out = []
    for x in xs:
        h = np.tanh(h @ u + x)
        out.append(h)
    return np.stack(out)


def rnn_cell_config(name: str, width: int, strategy: str, *, max_batch_size: int = 8,
                    instances: int = 1) -> str:
    return (
        f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: {max_batch_size}\n'
        f'input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ {width} ] }} ]\n'
        f'output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {width} ] }} ]\n'
        f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
        "sequence_batching {\n"
        f"  {strategy}\n"
        f'  state [ {{ input_name: "H_IN" output_name: "H_OUT" data_type: TYPE_FP32 dims: [ {width} ] }} ]\n'
        "}\n"
    )


PY_COUNTER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Like Triton's qa/python_models/sequence_py: counts the requests of each sequence by
    `request.correlation_id()` and `request.flags()` alone (no control inputs)."""

    def initialize(self, args):
        self.sequences = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            sid = request.correlation_id()
            flags = request.flags()
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                if sid in self.sequences:
                    raise pb_utils.TritonModelException("Can't start a new sequence with existing ID")
                self.sequences[sid] = 0
            elif sid not in self.sequences:
                raise pb_utils.TritonModelException("Need START flag for a sequence ID that doesn't exist")
            self.sequences[sid] += 1
            count = self.sequences[sid]
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                del self.sequences[sid]
            out = np.array([[count]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
'''


def write_py_counter(repo: Path, name: str = "py_counter") -> Path:
    return _python_model(
        repo, name, PY_COUNTER,
        "max_batch_size: 4\n" + _IO
        + "sequence_batching {\n  oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 1000 }\n}\n"
        + "instance_group [ { count: 1 kind: KIND_CPU } ]\n",
    )


PY_BLS_SEQUENCE = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Drives a sequence on another model through BLS: INPUT's values in order, with the
    correlation ID in the request's parameters and START/END flags on the first and last."""

    def execute(self, requests):
        responses = []
        for request in requests:
            target = json.loads(request.parameters())
            values = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy().reshape(-1)
            outputs = []
            for index, value in enumerate(values):
                flags = (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if index == 0 else 0) | (
                    pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if index == len(values) - 1 else 0)
                step = pb_utils.InferenceRequest(
                    model_name=target["model"], requested_output_names=["OUTPUT"],
                    inputs=[pb_utils.Tensor("INPUT", np.array([[value]], dtype=np.int32))],
                    correlation_id=target["corrid"], flags=flags,
                ).exec()
                if step.has_error():
                    raise pb_utils.TritonModelException(step.error().message())
                outputs.append(int(pb_utils.get_output_tensor_by_name(step, "OUTPUT").as_numpy().reshape(-1)[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.array(outputs, dtype=np.int32))]))
        return responses
'''


def write_py_bls_sequence(repo: Path, name: str = "py_bls_sequence") -> Path:
    return _python_model(
        repo, name, PY_BLS_SEQUENCE,
        "max_batch_size: 0\n"
        'input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ -1 ] } ]\n',
    )


PY_ITERATIVE = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Runs each request INPUT times: every run logs what the model saw (correlation ID, flags,
    batch size, control inputs) and, while runs remain, reschedules the request; a decoupled
    model sends a response from every run, the last with the final flag. OUTPUT is the runs
    left, LOG the log so far. With parameter mode "not_none" it returns a response for a
    request it reschedules (an error in Triton)."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.batched = config.get("max_batch_size", 0) > 0
        self.mode = config.get("parameters", {}).get("mode", {}).get("string_value", "")
        self.logs = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            runs = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy().reshape(-1)[0])
            seen = {"corrid": request.correlation_id(), "flags": request.flags(), "batch": len(requests)}
            for name in ("START", "END", "READY", "CORRID"):
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    seen[name] = tensor.as_numpy().reshape(-1).tolist()
            log = self.logs.setdefault(request.correlation_id(), [])
            log.append(seen)
            left = runs - len(log)
            shape = (1, 1) if self.batched else (1,)
            response = pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", np.array([left], np.int32).reshape(shape)),
                pb_utils.Tensor("LOG", np.array([json.dumps(log).encode()], object).reshape(shape)),
            ])
            if left <= 0:
                del self.logs[request.correlation_id()]
            else:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            if self.decoupled:
                request.get_response_sender().send(
                    response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if left <= 0 else 0
                )
            else:
                responses.append(response if left <= 0 or self.mode == "not_none" else None)
        return None if self.decoupled else responses
'''

_ITERATIVE_CONTROLS = """  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
"""


def write_py_iterative(repo: Path, name: str, *, max_batch_size: int = 0, decoupled: bool = False,
                       scheduling: str = "iterative", mode: str = "") -> Path:
    """PY_ITERATIVE with `scheduling` "iterative" (sequence_batching { iterative_sequence:
    true }), "sequence" (a plain sequence batcher), "dynamic" or "" (none)."""
    sequencing = {
        "iterative": "sequence_batching {\n  iterative_sequence: true\n" + _ITERATIVE_CONTROLS + "}\n",
        "sequence": "sequence_batching {\n" + _ITERATIVE_CONTROLS + "}\n",
        "dynamic": "dynamic_batching { }\n",
        "": "",
    }[scheduling]
    return _python_model(
        repo, name, PY_ITERATIVE,
        f"max_batch_size: {max_batch_size}\n"
        'input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "LOG" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        f"model_transaction_policy {{ decoupled: {str(decoupled).lower()} }}\n"
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        f'parameters {{ key: "mode" value: {{ string_value: "{mode}" }} }}\n' + sequencing,
    )
