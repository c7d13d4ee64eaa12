"""Triton python-backend models that both tritonserver and edged load unchanged.

Written as text into a tmp repository by `write_repository`; every model is plain
`triton_python_backend_utils` code, so both servers run the same Python.
"""

from __future__ import annotations

from pathlib import Path

# Sum and difference of two INT32 inputs (Triton's `simple`), batching.
ADD_SUB = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", (a + b).astype(a.dtype)),
                pb_utils.Tensor("OUTPUT1", (a - b).astype(a.dtype)),
            ]))
        return responses
'''

# Every input copied to the output of the same index (INPUTn -> OUTPUTn).
IDENTITY = '''\
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.pairs = [(i["name"], o["name"]) for i, o in zip(config["input"], config["output"])]

    def execute(self, requests):
        responses = []
        for request in requests:
            outputs = []
            for src, dst in self.pairs:
                tensor = pb_utils.get_input_tensor_by_name(request, src)
                outputs.append(pb_utils.Tensor(dst, tensor.as_numpy()))
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
'''

# A model whose initialize fails: the load-failure cases.
# Asks another model from `initialize`: both python backends refuse it (BLS is for `execute`).
BLS_IN_INITIALIZE = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.InferenceRequest(model_name="identity_fp32", requested_output_names=["OUTPUT0"],
                                  inputs=[pb_utils.Tensor("INPUT0", np.zeros(2, np.float32))]).exec()

    def execute(self, requests):
        return []
'''

BROKEN = '''\
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("this model refuses to load")

    def execute(self, requests):
        return []
'''

# Decoupled: IN[0] responses (OUT = 0, 1, ...), then the final flag alone.
COUNTDOWN = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            for i in range(n):
                sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", np.array([i], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

# Under the sequence batcher: running sums keyed by the CORRID control (UINT64: Triton 2.51
# fails a batched sequence model's TYPE_STRING CORRID with "unexpected number of string
# elements 2"; edged's own tests cover string CORRIDs).
ACCUMULATOR = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.totals = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0]
            if not int(get("READY")):  # an idle slot of the batch (direct strategy)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.zeros((1, 1), np.int32))]))
                continue
            corrid = int(get("CORRID"))
            total = (0 if int(get("START")) else self.totals[corrid]) + int(get("INPUT"))
            if int(get("END")):
                self.totals.pop(corrid, None)
            else:
                self.totals[corrid] = total
            out = np.array([[total]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
'''

# Errors from execute: an error response for negative input, an exception for zero.
FAULTY = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if (x == 0).any():
                raise pb_utils.TritonModelException("zero is not allowed")
            if (x < 0).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input refused")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
'''

_TENSOR = '  {{ name: "{name}" data_type: {dtype} dims: [ {dims} ] }}'


def _config(name: str, max_batch: int, inputs: list[tuple[str, str, str]],
            outputs: list[tuple[str, str, str]]) -> str:
    def block(rows: list[tuple[str, str, str]]) -> str:
        return ",\n".join(_TENSOR.format(name=n, dtype=d, dims=s) for n, d, s in rows)

    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch}\n'
        f"input [\n{block(inputs)}\n]\noutput [\n{block(outputs)}\n]\n"
        'instance_group [ { kind: KIND_CPU count: 1 } ]\n'
    )


MODELS: dict[str, tuple[str, str]] = {
    # name: (model.py, config.pbtxt)
    "add_sub": (ADD_SUB, _config(
        "add_sub", 8,
        [("INPUT0", "TYPE_INT32", "4"), ("INPUT1", "TYPE_INT32", "4")],
        [("OUTPUT0", "TYPE_INT32", "4"), ("OUTPUT1", "TYPE_INT32", "4")],
    )),
    "identity_fp32": (IDENTITY, _config(
        "identity_fp32", 0, [("INPUT0", "TYPE_FP32", "-1")], [("OUTPUT0", "TYPE_FP32", "-1")],
    )),
    "identity_int32": (IDENTITY, _config(
        "identity_int32", 0, [("INPUT0", "TYPE_INT32", "-1")], [("OUTPUT0", "TYPE_INT32", "-1")],
    )),
    "identity_bytes": (IDENTITY, _config(
        "identity_bytes", 0, [("INPUT0", "TYPE_STRING", "-1")], [("OUTPUT0", "TYPE_STRING", "-1")],
    )),
    "identity_mixed": (IDENTITY, _config(
        "identity_mixed", 4,
        [("INPUT0", "TYPE_INT32", "2"), ("INPUT1", "TYPE_FP32", "2"), ("INPUT2", "TYPE_STRING", "1")],
        [("OUTPUT0", "TYPE_INT32", "2"), ("OUTPUT1", "TYPE_FP32", "2"), ("OUTPUT2", "TYPE_STRING", "1")],
    )),
    "countdown": (COUNTDOWN, _config("countdown", 0, [("IN", "TYPE_INT32", "1")], [("OUT", "TYPE_INT32", "1")])
                  + "model_transaction_policy { decoupled: true }\n"),
    "py_accumulator": (ACCUMULATOR, _config("py_accumulator", 4, [("INPUT", "TYPE_INT32", "1")],
                                            [("OUTPUT", "TYPE_INT32", "1")]) + (
        "sequence_batching {\n  control_input [\n"
        + "".join(f'    {{ name: "{n}" control [ {{ kind: CONTROL_SEQUENCE_{k} int32_false_true: [ 0, 1 ] }} ] }},\n'
                  for n, k in (("START", "START"), ("END", "END"), ("READY", "READY")))
        + '    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }\n'
        + "  ]\n}\n"
    )),
    "faulty": (FAULTY, _config("faulty", 0, [("INPUT0", "TYPE_FP32", "-1")], [("OUTPUT0", "TYPE_FP32", "-1")])),
    # One slow instance with a queue of one: what a burst gets (see test_oracle).
    "queued": ('''\
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.5)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
''', _config("queued", 1, [("INPUT0", "TYPE_FP32", "1")], [("OUTPUT0", "TYPE_FP32", "1")])
        + "dynamic_batching { default_queue_policy { max_queue_size: 1 } }\n"),
    # A step of the load cases' ensembles (A + B); not loaded at start.
    "pair": ('''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        get = pb_utils.get_input_tensor_by_name
        return [pb_utils.InferenceResponse([pb_utils.Tensor("S", get(r, "A").as_numpy() + get(r, "B").as_numpy())])
                for r in requests]
''', _config("pair", 0, [("A", "TYPE_INT32", "1"), ("B", "TYPE_INT32", "1")], [("S", "TYPE_INT32", "1")])),
    # Loaded and unloaded by the repository cases; not loaded at start.
    "scratch": (IDENTITY, _config(
        "scratch", 0, [("INPUT0", "TYPE_FP32", "-1")], [("OUTPUT0", "TYPE_FP32", "-1")],
    )),
    "broken": (BROKEN, _config(
        "broken", 0, [("INPUT0", "TYPE_FP32", "-1")], [("OUTPUT0", "TYPE_FP32", "-1")],
    )),
    "bls_in_initialize": (BLS_IN_INITIALIZE, _config(
        "bls_in_initialize", 0, [("INPUT0", "TYPE_FP32", "-1")], [("OUTPUT0", "TYPE_FP32", "-1")],
    )),
}

# What both servers load at start (explicit control mode).
STARTUP = ["add_sub", "identity_fp32", "identity_int32", "identity_bytes", "identity_mixed", "countdown", "py_accumulator", "faulty", "queued"]


# Versioned models: version N adds N (so answers show which version ran), under three policies.
ADD_VERSION = '''\
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + self.version)]) for r in requests]
'''
VERSIONED = {
    "versions_latest": "version_policy: { latest: { num_versions: 2 } }\n",
    "versions_all": "version_policy: { all: {} }\n",
    "versions_specific": "version_policy: { specific: { versions: [ 1, 3 ] } }\n",
}
STARTUP += list(VERSIONED)

# An ensemble of two add_sub steps: OUT = (A + B) + (A - B) = 2A, OUT2 = (A + B) - (A - B) = 2B.
ENSEMBLE = '''\
name: "twice"
platform: "ensemble"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_INT32 dims: [ 4 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 4 ] }, { name: "OUT2" data_type: TYPE_INT32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" model_version: -1
    input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "diff" } },
  { model_name: "add_sub" model_version: -1
    input_map { key: "INPUT0" value: "sum" } input_map { key: "INPUT1" value: "diff" }
    output_map { key: "OUTPUT0" value: "OUT" } output_map { key: "OUTPUT1" value: "OUT2" } }
] }
'''
STARTUP.append("twice")

Tensor = tuple[str, str, str]  # name, data type, dims
Step = tuple[str, dict[str, str], dict[str, str]]  # model, input_map, output_map


def _ensemble(name: str, steps: list[Step], inputs: list[Tensor] | None = None,
              outputs: list[Tensor] | None = None, max_batch: int = 0) -> str:
    """An ensemble config; its tensors FP32 [-1] X -> Y unless given."""
    def block(rows: list[Tensor]) -> str:
        return ", ".join(_TENSOR.format(name=n, dtype=d, dims=dims).strip() for n, d, dims in rows)

    body = ", ".join(
        f'{{ model_name: "{model}" model_version: -1'
        + "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in ins.items())
        + "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outs.items()) + " }"
        for model, ins, outs in steps
    )
    return (f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {max_batch}\n'
            f"input [ {block(inputs or [('X', 'TYPE_FP32', '-1')])} ]\n"
            f"output [ {block(outputs or [('Y', 'TYPE_FP32', '-1')])} ]\n"
            f"ensemble_scheduling {{ step [ {body} ] }}\n")


def _fp32(*names: str) -> list[Tensor]:
    return [(n, "TYPE_FP32", "-1") for n in names]


ENSEMBLES = {
    # Two branches from X: `kept` through identity_fp32, `dropped2` through faulty twice
    # (refuses a zero). A request for `kept` alone runs neither faulty step: both prune them.
    "fork": _ensemble("fork", [
        ("identity_fp32", {"INPUT0": "X"}, {"OUTPUT0": "kept"}),
        ("faulty", {"INPUT0": "X"}, {"OUTPUT0": "dropped"}),
        ("faulty", {"INPUT0": "dropped"}, {"OUTPUT0": "dropped2"}),
    ], outputs=_fp32("kept", "dropped2")),
    # Batching ensembles over models that do not batch and the reverse: Triton reshapes.
    "batched_over_unbatched": _ensemble(
        "batched_over_unbatched", [("identity_fp32", {"INPUT0": "X"}, {"OUTPUT0": "Y"})],
        [("X", "TYPE_FP32", "4")], [("Y", "TYPE_FP32", "4")], max_batch=8),
    "unbatched_over_batched": _ensemble(
        "unbatched_over_batched", [("add_sub", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "SUM"})],
        [("A", "TYPE_INT32", "4"), ("B", "TYPE_INT32", "4")], [("SUM", "TYPE_INT32", "4")]),
    # A sequence model inside an ensemble: the request's sequence reaches the step (Triton
    # passes the correlation ID and the start and end flags on).
    "sequence_pipe": _ensemble(
        "sequence_pipe", [("py_accumulator", {"INPUT": "IN"}, {"OUTPUT": "TOTAL"})],
        [("IN", "TYPE_INT32", "1")], [("TOTAL", "TYPE_INT32", "1")], max_batch=4),
    # A decoupled step: the ensemble answers once per response of it (Triton's decoupled
    # ensembles; Triton counts an ensemble with a decoupled step as decoupled whatever its own
    # config says).
    "count_pipe": _ensemble("count_pipe", [
        ("countdown", {"IN": "N"}, {"OUT": "I"}),
        ("identity_int32", {"INPUT0": "I"}, {"OUTPUT0": "TOTAL"}),
    ], [("N", "TYPE_INT32", "1")], [("TOTAL", "TYPE_INT32", "1")]),
}
STARTUP += list(ENSEMBLES)

# Ensembles the load cases load (explicit loads, after every other case): Triton loads an
# ensemble's steps with it and refuses one whose steps do not fit.
_IDENTITY: Step = ("identity_fp32", {"INPUT0": "X"}, {"OUTPUT0": "Y"})
ENSEMBLES_TO_LOAD = {
    "chain": _ensemble("chain", [("chain_step", {"INPUT0": "X"}, {"OUTPUT0": "Y"})]),
    "chain_outer": _ensemble("chain_outer", [("chain", {"X": "X"}, {"Y": "Y"})]),
    "ens_missing_step": _ensemble("ens_missing_step", [("no_such_model", {"INPUT0": "X"}, {"OUTPUT0": "Y"})]),
    "ens_broken_step": _ensemble("ens_broken_step", [("broken", {"INPUT0": "X"}, {"OUTPUT0": "Y"})]),
    "ens_bad_input_key": _ensemble("ens_bad_input_key", [("identity_fp32", {"NOPE": "X"}, {"OUTPUT0": "Y"})]),
    "ens_bad_output_key": _ensemble("ens_bad_output_key", [("identity_fp32", {"INPUT0": "X"}, {"NOPE": "Y"})]),
    "ens_bad_type": _ensemble("ens_bad_type", [_IDENTITY], [("X", "TYPE_INT32", "-1")]),
    "ens_unused_input": _ensemble("ens_unused_input", [_IDENTITY], _fp32("X", "Z")),
    "ens_unused_tensor": _ensemble("ens_unused_tensor", [_IDENTITY, ("faulty", {"INPUT0": "X"}, {"OUTPUT0": "unused"})]),
    # `pair` takes the decoupled countdown's responses and the request's input at once.
    "ens_mixed_origins": _ensemble("ens_mixed_origins", [
        ("countdown", {"IN": "N"}, {"OUT": "I"}),
        ("pair", {"A": "I", "B": "N"}, {"S": "TOTAL"}),
    ], [("N", "TYPE_INT32", "1")], [("TOTAL", "TYPE_INT32", "1")]),
    "ens_bad_shape": _ensemble("ens_bad_shape", [("add_sub", {"INPUT0": "A", "INPUT1": "A"}, {"OUTPUT0": "Y"})],
                               [("A", "TYPE_INT32", "3")], [("Y", "TYPE_INT32", "4")]),
    "ens_unmapped_input": _ensemble("ens_unmapped_input", [("add_sub", {"INPUT0": "A"}, {"OUTPUT0": "Y"})],
                                    [("A", "TYPE_INT32", "4")], [("Y", "TYPE_INT32", "4")]),
    "ens_batch_too_big": _ensemble("ens_batch_too_big", [("add_sub", {"INPUT0": "A", "INPUT1": "A"}, {"OUTPUT0": "Y"})],
                                   [("A", "TYPE_INT32", "4")], [("Y", "TYPE_INT32", "4")], max_batch=16),
    "ens_produced_twice": _ensemble("ens_produced_twice", [_IDENTITY, ("faulty", {"INPUT0": "X"}, {"OUTPUT0": "Y"})]),
}


def write_repository(repo: Path) -> None:
    for name, (code, config) in MODELS.items():
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "1" / "model.py").write_text(code, encoding="utf-8")
        (repo / name / "config.pbtxt").write_text(config, encoding="utf-8")
    (repo / "twice" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "twice" / "config.pbtxt").write_text(ENSEMBLE, encoding="utf-8")
    for name, config in (*ENSEMBLES.items(), *ENSEMBLES_TO_LOAD.items()):
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(config, encoding="utf-8")
    (repo / "chain_step" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "chain_step" / "1" / "model.py").write_text(IDENTITY, encoding="utf-8")
    (repo / "chain_step" / "config.pbtxt").write_text(_config(
        "chain_step", 0, [("INPUT0", "TYPE_FP32", "-1")], [("OUTPUT0", "TYPE_FP32", "-1")]), encoding="utf-8")
    for name, policy in VERSIONED.items():
        for version in (1, 2, 3):
            (repo / name / str(version)).mkdir(parents=True, exist_ok=True)
            (repo / name / str(version) / "model.py").write_text(ADD_VERSION, encoding="utf-8")
        config = _config(name, 0, [("INPUT0", "TYPE_INT32", "1")], [("OUTPUT0", "TYPE_INT32", "1")])
        (repo / name / "config.pbtxt").write_text(config + policy, encoding="utf-8")

