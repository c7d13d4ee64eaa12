"""Ensembles across real backends: Python preprocess -> ONNX Runtime -> Python postprocess."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from daemon.backend import REQUEST_FLAG_SEQUENCE_END, REQUEST_FLAG_SEQUENCE_START, InferRequest
from daemon.core import decoupled
from daemon.core.hardware import Hardware
from daemon.core.plugins import PluginRegistry
from daemon.core.registry import ModelRegistry
from daemon.core.stats import MetricsRegistry
from daemon.errors import ConfigError, EdgedError

pytest.importorskip("onnxruntime")

from model_builders import build_simple_onnx
from sequence_models import write_accumulator

from support import REPO_BACKENDS

TENSOR = 'data_type: TYPE_INT32 dims: [ 16 ]'


def python_step(repo: Path, name: str, inputs: list[str], outputs: dict[str, str], *, prelude: str = "") -> None:
    """A Python model computing each output from a numpy expression over its inputs."""
    (repo / name / "1").mkdir(parents=True)
    ins = ", ".join(f'{{ name: "{i}" {TENSOR} }}' for i in inputs)
    outs = ", ".join(f'{{ name: "{o}" {TENSOR} }}' for o in outputs)
    (repo / name / "config.pbtxt").write_text(
        f'backend: "python"\nmax_batch_size: 8\ninput [{ins}]\noutput [{outs}]\n'
    )
    reads = "\n".join(
        f"            {i} = pb_utils.get_input_tensor_by_name(r, '{i}').as_numpy()" for i in inputs
    )
    tensors = ", ".join(f"pb_utils.Tensor('{o}', np.asarray({expr}, dtype=np.int32))" for o, expr in outputs.items())
    (repo / name / "1" / "model.py").write_text(
        "import numpy as np\nimport triton_python_backend_utils as pb_utils\n"
        f"{prelude}\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        out = []\n"
        "        for r in requests:\n"
        f"{reads}\n"
        f"            out.append(pb_utils.InferenceResponse([{tensors}]))\n"
        "        return out\n"
    )


def ensemble(repo: Path, name: str, steps: str, inputs: list[str], outputs: list[str]) -> None:
    (repo / name / "1").mkdir(parents=True)
    ins = ", ".join(f'{{ name: "{i}" {TENSOR} }}' for i in inputs)
    outs = ", ".join(f'{{ name: "{o}" {TENSOR} }}' for o in outputs)
    (repo / name / "config.pbtxt").write_text(
        f'platform: "ensemble"\nmax_batch_size: 8\ninput [{ins}]\noutput [{outs}]\n'
        f"ensemble_scheduling {{ step [ {steps} ] }}\n"
    )


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1{maps} }}'


async def make_registry(tmp_path: Path) -> ModelRegistry:
    plugins = PluginRegistry([REPO_BACKENDS])
    plugins.scan()
    registry = ModelRegistry(plugins, Hardware(openvino=False), MetricsRegistry(), tmp_path / "state")
    return registry


def pipeline_repo(repo: Path) -> None:
    python_step(repo, "pre", ["RAW"], {"A": "RAW * 2", "B": "RAW + 1"})
    (repo / "simple" / "1").mkdir(parents=True)
    build_simple_onnx(repo / "simple" / "1" / "model.onnx")
    (repo / "simple" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 8\n'
        f'input [{{ name: "INPUT0" {TENSOR} }}, {{ name: "INPUT1" {TENSOR} }}]\n'
        f'output [{{ name: "OUTPUT0" {TENSOR} }}, {{ name: "OUTPUT1" {TENSOR} }}]\n'
    )
    python_step(repo, "post", ["IN0"], {"FINAL": "IN0 * 10"})
    ensemble(
        repo, "pipeline",
        ", ".join([
            step("pre", {"RAW": "RAW"}, {"A": "a", "B": "b"}),
            step("simple", {"INPUT0": "a", "INPUT1": "b"}, {"OUTPUT0": "sum", "OUTPUT1": "DIFF"}),
            step("post", {"IN0": "sum"}, {"FINAL": "FINAL"}),
        ]),
        ["RAW"], ["FINAL", "DIFF"],
    )


async def test_pipeline_across_backends(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    pipeline_repo(repo)
    registry = await make_registry(tmp_path)
    try:
        for name in ("pre", "simple", "post", "pipeline"):
            await registry.load(name, repo / name)
        raw = np.arange(32, dtype=np.int32).reshape(2, 16)
        response = await registry.get("pipeline").infer(InferRequest({"RAW": raw}))
        np.testing.assert_array_equal(response.outputs["FINAL"], (3 * raw + 1) * 10)
        np.testing.assert_array_equal(response.outputs["DIFF"], raw - 1)
        assert set(response.outputs) == {"FINAL", "DIFF"}  # intermediates are not leaked
        assert registry.get("pipeline").backend == "ensemble"
        assert registry.get("simple").stats.inference_count == 2  # went through the step's scheduler
    finally:
        await registry.close()


async def test_an_ensemble_counts_its_steps_compute_phases_as_its_own(tmp_path: Path) -> None:
    """As Triton: an ensemble request that succeeds is one execution of its batch size, and its
    compute phases are the sums of its step requests' (an inner ensemble's sums reach the outer
    one). Before, an ensemble counted no execution and no compute time."""
    repo = tmp_path / "repo"
    pipeline_repo(repo)
    ensemble(repo, "outer", step("pipeline", {"RAW": "RAW"}, {"FINAL": "F", "DIFF": "D"}), ["RAW"], ["F", "D"])
    registry = await make_registry(tmp_path)
    phases = ("compute_input", "compute_infer", "compute_output")

    def totals(*names: str) -> list[int]:
        return [sum(getattr(registry.get(n).stats, phase).ns for n in names) for phase in phases]

    try:
        for name in ("pre", "simple", "post", "pipeline", "outer"):
            await registry.load(name, repo / name)
        await registry.get("pipeline").infer(InferRequest({"RAW": np.ones((2, 16), dtype=np.int32)}))
        stats = registry.get("pipeline").stats
        assert (stats.inference_count, stats.execution_count, list(stats.batch_stats)) == (2, 1, [2])
        assert totals("pipeline") == totals("pre", "simple", "post")
        assert totals("pipeline")[1] > 0 and totals("pre")[0] > 0  # the python backend times its input
        assert [getattr(stats.batch_stats[2], phase).ns for phase in phases] == totals("pipeline")
        before = totals("pipeline")
        await registry.get("outer").infer(InferRequest({"RAW": np.ones((1, 16), dtype=np.int32)}))
        outer = registry.get("outer").stats
        assert (outer.inference_count, outer.execution_count, list(outer.batch_stats)) == (1, 1, [1])
        assert totals("outer") == [after - was for after, was in zip(totals("pipeline"), before, strict=True)]
        assert totals("pipeline") == totals("pre", "simple", "post")
        assert (stats.execution_count, sorted(stats.batch_stats)) == (2, [1, 2])
    finally:
        await registry.close()


async def test_independent_steps_run_concurrently(tmp_path: Path) -> None:
    # Each branch waits at a two-party barrier: it only passes if both branches run at once.
    prelude = (
        "import sys, threading, types\n"
        "shared = sys.modules.setdefault('edged_test_rendezvous', types.ModuleType('edged_test_rendezvous'))\n"
        "if not hasattr(shared, 'barrier'):\n"
        "    shared.barrier = threading.Barrier(2)\n"
        "def meet(x):\n"
        "    shared.barrier.wait(timeout=10)\n"
        "    return x\n"
    )
    repo = tmp_path / "repo"
    python_step(repo, "left", ["X"], {"L": "meet(X) + 1"}, prelude=prelude)
    python_step(repo, "right", ["X"], {"R": "meet(X) + 2"}, prelude=prelude)
    ensemble(repo, "fork", ", ".join([
        step("left", {"X": "X"}, {"L": "L"}),
        step("right", {"X": "X"}, {"R": "R"}),
    ]), ["X"], ["L", "R"])
    registry = await make_registry(tmp_path)
    try:
        for name in ("left", "right", "fork"):
            await registry.load(name, repo / name)
        x = np.ones((1, 16), dtype=np.int32)
        response = await registry.get("fork").infer(InferRequest({"X": x}))
        np.testing.assert_array_equal(response.outputs["L"], x + 1)
        np.testing.assert_array_equal(response.outputs["R"], x + 2)
    finally:
        await registry.close()


async def test_failing_step_is_named(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_step(repo, "ok", ["X"], {"Y": "X"})
    python_step(repo, "boom", ["Y"], {"Z": "1 // 0"})
    ensemble(repo, "chain", ", ".join([
        step("ok", {"X": "X"}, {"Y": "y"}),
        step("boom", {"Y": "y"}, {"Z": "Z"}),
    ]), ["X"], ["Z"])
    registry = await make_registry(tmp_path)
    try:
        for name in ("ok", "boom", "chain"):
            await registry.load(name, repo / name)
        with pytest.raises(EdgedError) as info:
            await registry.get("chain").infer(InferRequest({"X": np.ones((1, 16), np.int32)}))
        assert "ensemble 'chain' step 1 (model 'boom')" in info.value.message
        assert "ZeroDivisionError" in info.value.message
    finally:
        await registry.close()


async def test_unsatisfiable_graph_is_refused_at_load(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_step(repo, "ok", ["X"], {"Y": "X"})
    ensemble(repo, "broken", step("ok", {"X": "nowhere"}, {"Y": "Y"}), ["X"], ["Y"])
    registry = await make_registry(tmp_path)
    try:
        with pytest.raises(ConfigError, match=r"step 0 .*'ok'.*nowhere"):
            await registry.load("broken", repo / "broken")
        assert registry.entry("broken").state == "UNAVAILABLE"  # type: ignore[union-attr]
    finally:
        await registry.close()


async def test_an_ensemble_its_steps_lead_back_to_is_refused_at_load(tmp_path: Path) -> None:
    """Loaded, such an ensemble nested one request inside another without end (gigabytes in
    seconds, the event loop blocked): refused whichever of the ensembles loads last."""
    repo = tmp_path / "repo"
    python_step(repo, "ok", ["X"], {"Y": "X"})
    ensemble(repo, "itself", step("itself", {"X": "X"}, {"Y": "Y"}), ["X"], ["Y"])
    ensemble(repo, "a", step("b", {"X": "X"}, {"Y": "Y"}), ["X"], ["Y"])
    ensemble(repo, "b", step("ok", {"X": "X"}, {"Y": "T"}) + ", " + step("a", {"X": "T"}, {"Y": "Y"}), ["X"], ["Y"])
    registry = await make_registry(tmp_path)
    try:
        with pytest.raises(ConfigError, match="ensemble 'itself' contains a cycle: its steps lead back to 'itself'"):
            await registry.load("itself", repo / "itself")
        await registry.load("ok", repo / "ok")
        await registry.load("a", repo / "a")  # b is not loaded yet: nothing leads back so far
        with pytest.raises(ConfigError, match="ensemble 'b' contains a cycle: its steps lead back to 'b'"):
            await registry.load("b", repo / "b")
    finally:
        await registry.close()


async def test_request_parameters_reach_every_step(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    # Each step adds the request's integer parameter "k" to its input.
    prelude = "import json"
    python_step(repo, "add_k", ["X"], {"Y": "X + json.loads(r.parameters())['k']"}, prelude=prelude)
    python_step(repo, "add_k_again", ["X"], {"Y": "X + json.loads(r.parameters())['k']"}, prelude=prelude)
    ensemble(repo, "twice", step("add_k", {"X": "IN"}, {"Y": "MID"}) + ", "
             + step("add_k_again", {"X": "MID"}, {"Y": "OUT"}), ["IN"], ["OUT"])
    registry = await make_registry(tmp_path)
    try:
        for name in ("add_k", "add_k_again", "twice"):
            await registry.load(name, repo / name)
        raw = np.arange(16, dtype=np.int32).reshape(1, 16)
        response = await registry.get("twice").infer(InferRequest({"IN": raw}, parameters={"k": 5}))
        np.testing.assert_array_equal(response.outputs["OUT"], raw + 10)
    finally:
        await registry.close()


def held_first_step(repo: Path, key: str) -> None:
    """An ensemble `chain` (first -> second): `first` tells the test it runs (event `entered`
    of module `key`), then waits for its `go`; `second` adds 1."""
    prelude = (
        "import sys, threading, types\n"
        f"shared = sys.modules.setdefault({key!r}, types.ModuleType({key!r}))\n"
        "if not hasattr(shared, 'go'):\n"
        "    shared.entered, shared.go = threading.Event(), threading.Event()\n"
        "def hold(x):\n"
        "    shared.entered.set()\n"
        "    shared.go.wait(timeout=30)\n"
        "    return x\n"
    )
    python_step(repo, "first", ["X"], {"Y": "hold(X)"}, prelude=prelude)
    python_step(repo, "second", ["X"], {"Y": "X + 1"})
    ensemble(repo, "chain", step("first", {"X": "IN"}, {"Y": "MID"}) + ", "
             + step("second", {"X": "MID"}, {"Y": "OUT"}), ["IN"], ["OUT"])


async def _while_first_step_runs(
    registry: ModelRegistry, key: str, change: Awaitable[None], done: Callable[[], bool]
) -> np.ndarray:
    """Start a `chain` request, run `change` as a task once its first step runs, wait until
    `done()` holds, let the first step finish; the request's OUT (the change is awaited)."""
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    running = asyncio.create_task(registry.get("chain").infer(InferRequest({"IN": x})))
    shared = sys.modules[key]
    assert await asyncio.to_thread(shared.entered.wait, 30)  # type: ignore[attr-defined]
    changing = asyncio.ensure_future(change)
    async with asyncio.timeout(30):
        while not done():  # noqa: ASYNC110 (on observable state)
            await asyncio.sleep(0.01)
    shared.go.set()  # type: ignore[attr-defined]
    response = await running
    await changing
    return response.outputs["OUT"] - x  # type: ignore[no-any-return]


async def test_a_request_runs_every_step_on_the_versions_it_started_with(tmp_path: Path) -> None:
    """As in Triton, an ensemble request takes its step models when it starts: a step model
    swapped while an earlier step runs answers this request from its old version (and is
    retired only after it). Resolved wave by wave, as before, the request's second step ran on
    the new version (an answer from two releases at once)."""
    key = f"edged_test_swap_{id(tmp_path)}"
    repo = tmp_path / "repo"
    held_first_step(repo, key)
    newer = tmp_path / "newer"
    python_step(newer, "second", ["X"], {"Y": "X + 100"})
    registry = await make_registry(tmp_path)
    try:
        for name in ("first", "second", "chain"):
            await registry.load(name, repo / name)
        old = registry.get("second")
        added = await _while_first_step_runs(
            registry, key, registry.load("second", newer / "second"), lambda: registry.get("second") is not old
        )
        assert added.tolist() == [[1] * 16]
        # The next request takes the new version.
        x = np.zeros((1, 16), dtype=np.int32)
        response = await registry.get("chain").infer(InferRequest({"IN": x}))
        assert response.outputs["OUT"].tolist() == [[100] * 16]  # type: ignore[attr-defined]
    finally:
        sys.modules[key].go.set()  # type: ignore[attr-defined]
        await registry.close()


async def test_a_step_unloaded_during_a_request_still_answers_it(tmp_path: Path) -> None:
    """Unloading a step model waits for the ensemble requests that took it (within the drain
    timeout), as for a request to the model itself. Before, the request failed at that step:
    "ensemble 'chain' step 1 (model 'second'): Request for unknown model: 'second' ..."."""
    key = f"edged_test_unload_{id(tmp_path)}"
    repo = tmp_path / "repo"
    held_first_step(repo, key)
    registry = await make_registry(tmp_path)
    try:
        for name in ("first", "second", "chain"):
            await registry.load(name, repo / name)
        added = await _while_first_step_runs(
            registry, key, registry.unload("second"), lambda: not registry.is_ready("second")
        )
        assert added.tolist() == [[1] * 16]
        with pytest.raises(EdgedError, match="ensemble 'chain' step 1 \\(model 'second'\\): Request for unknown model"):
            await registry.get("chain").infer(InferRequest({"IN": np.zeros((1, 16), dtype=np.int32)}))
    finally:
        sys.modules[key].go.set()  # type: ignore[attr-defined]
        await registry.close()


async def test_a_request_for_some_outputs_runs_only_the_steps_leading_to_them(tmp_path: Path) -> None:
    """Triton prunes the steps that lead to no requested output (tests/compat checks it against
    Triton 2.51): `mid` feeds only `refuse`, which feeds only R, so a request for K runs `keep`
    alone. Before, every step ran and the request failed in `refuse`."""
    repo = tmp_path / "repo"
    python_step(repo, "keep", ["X"], {"Y": "X + 1"})
    python_step(repo, "mid", ["X"], {"Y": "X * 2"})
    python_step(repo, "refuse", ["X"], {"Y": "refuse(X)"},
                prelude="def refuse(x):\n    raise ValueError('this step must not run')\n")
    ensemble(repo, "fork", ", ".join([
        step("keep", {"X": "X"}, {"Y": "K"}),
        step("mid", {"X": "X"}, {"Y": "M"}),
        step("refuse", {"X": "M"}, {"Y": "R"}),
    ]), ["X"], ["K", "R"])
    registry = await make_registry(tmp_path)
    try:
        for name in ("keep", "mid", "refuse", "fork"):
            await registry.load(name, repo / name)
        x = np.arange(16, dtype=np.int32).reshape(1, 16)
        response = await registry.get("fork").infer(InferRequest({"X": x}, requested_outputs=("K",)))
        assert set(response.outputs) == {"K"}
        np.testing.assert_array_equal(response.outputs["K"], x + 1)
        assert registry.get("mid").stats.inference_count == 0
        with pytest.raises(EdgedError, match="ensemble 'fork' step 2 \\(model 'refuse'\\)"):
            await registry.get("fork").infer(InferRequest({"X": x}))
        assert registry.get("mid").stats.inference_count == 1
    finally:
        await registry.close()


@pytest.mark.parametrize(("steps", "inputs", "outputs", "refusal"), [
    pytest.param([("ok", {"X": "X"}, {"Y": "Y"}), ("ok", {"X": "X"}, {"Y": "Y"})], ["X"], ["Y"],
                 "ensemble 'e': tensor 'Y' is produced by step 0 and again by step 1", id="produced-twice"),
    pytest.param([("ok", {"X": "X"}, {"Y": "Y"})], ["X", "Z"], ["Y"],
                 "ensemble 'e': input 'Z' is read by no step", id="unused-input"),
    pytest.param([("ok", {"X": "X"}, {"Y": "Y"}), ("ok", {"X": "X"}, {"Y": "T"})], ["X"], ["Y"],
                 "ensemble 'e': tensor 'T' of step 1 is read by no step and is no output", id="unused-tensor"),
    pytest.param([("ok", {"NOPE": "X"}, {"Y": "Y"})], ["X"], ["Y"],
                 "in ensemble e, ensemble tensor X is mapping to non-existing input NOPE in model ok", id="input-key"),
    pytest.param([("ok", {"X": "X"}, {"NOPE": "Y"})], ["X"], ["Y"],
                 "in ensemble e, ensemble tensor Y is mapped from non-existing output NOPE in model ok", id="output-key"),
])
async def test_an_ensemble_its_steps_do_not_fit_is_refused_at_load(
    tmp_path: Path, steps: list[tuple[str, dict[str, str], dict[str, str]]], inputs: list[str], outputs: list[str],
    refusal: str,
) -> None:
    """What Triton refuses (tests/compat: the texts of the last two are Triton's; the first
    three Triton answers with a 500 "failed to poll from model repository")."""
    repo = tmp_path / "repo"
    python_step(repo, "ok", ["X"], {"Y": "X"})
    ensemble(repo, "e", ", ".join(step(*s) for s in steps), inputs, outputs)
    registry = await make_registry(tmp_path)
    try:
        await registry.load("ok", repo / "ok")
        with pytest.raises(ConfigError, match=re.escape(refusal)):
            await registry.load("e", repo / "e")
    finally:
        await registry.close()


async def test_a_batch_of_one_crosses_between_batching_and_non_batching_models(tmp_path: Path) -> None:
    """Triton's reshape (tests/compat checks it against Triton 2.51): a batching ensemble's
    batch of one loses its batch dimension for a step that does not batch, and the step's
    answer gains it back as the ensemble's output; a larger batch is the step's shape error.
    Before, every such request failed the step's shape check."""
    repo = tmp_path / "repo"
    python_step(repo, "unbatched", ["X"], {"Y": "X * 3"})
    config = repo / "unbatched" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 0"))
    ensemble(repo, "e", step("unbatched", {"X": "X"}, {"Y": "Y"}), ["X"], ["Y"])
    registry = await make_registry(tmp_path)
    try:
        for name in ("unbatched", "e"):
            await registry.load(name, repo / name)
        x = np.arange(16, dtype=np.int32).reshape(1, 16)
        response = await registry.get("e").infer(InferRequest({"X": x}))
        assert response.outputs["Y"].shape == (1, 16)
        np.testing.assert_array_equal(response.outputs["Y"], x * 3)
        with pytest.raises(EdgedError, match=re.escape("unexpected shape for input 'X' for model 'unbatched'. Expected [16], got [2,16]")):
            await registry.get("e").infer(InferRequest({"X": np.zeros((2, 16), dtype=np.int32)}))
    finally:
        await registry.close()


async def test_a_sequence_model_runs_as_a_step(tmp_path: Path) -> None:
    """The ensemble request's sequence (correlation ID, start and end) reaches its steps, as in
    Triton (tests/compat checks it against Triton 2.51). Before, a sequence model in an
    ensemble refused every request: "must specify a non-zero or non-empty correlation ID"."""
    repo = tmp_path / "repo"
    write_accumulator(repo, "acc")
    (repo / "pipe" / "1").mkdir(parents=True)
    (repo / "pipe" / "config.pbtxt").write_text(
        'platform: "ensemble"\nmax_batch_size: 4\n'
        'input [{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }]\n'
        'output [{ name: "TOTAL" data_type: TYPE_INT32 dims: [ 1 ] }]\n'
        "ensemble_scheduling { step [ " + step("acc", {"INPUT": "IN"}, {"OUTPUT": "TOTAL"}) + " ] }\n"
    )
    registry = await make_registry(tmp_path)
    try:
        for name in ("acc", "pipe"):
            await registry.load(name, repo / name)
        totals = []
        for value, flags in ((5, REQUEST_FLAG_SEQUENCE_START), (3, 0), (2, REQUEST_FLAG_SEQUENCE_END)):
            request = InferRequest({"IN": np.array([[value]], dtype=np.int32)}, correlation_id=42, flags=flags)
            totals.append(int((await registry.get("pipe").infer(request)).outputs["TOTAL"][0, 0]))
        assert totals == [5, 8, 10]
        with pytest.raises(EdgedError, match=r"ensemble 'pipe' step 0 \(model 'acc'\): .*must specify a non-zero"):
            await registry.get("pipe").infer(InferRequest({"IN": np.array([[1]], dtype=np.int32)}))
    finally:
        await registry.close()


COUNTDOWN = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)[0])
            for i in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.full((1, 16), i, np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def countdown(repo: Path, *, shape: str = "(1, 16)") -> None:
    """The decoupled python model `countdown`: IN = n -> n responses OUT = 0 .. n-1 (`shape`)."""
    (repo / "countdown" / "1").mkdir(parents=True)
    (repo / "countdown" / "1" / "model.py").write_text(COUNTDOWN.replace("(1, 16)", shape))
    (repo / "countdown" / "config.pbtxt").write_text(
        f'backend: "python"\nmax_batch_size: 0\ninput [{{ name: "IN" {TENSOR} }}]\n'
        f'output [{{ name: "OUT" {TENSOR} }}]\nmodel_transaction_policy {{ decoupled: true }}\n'
    )


async def test_a_decoupled_step_makes_one_answer_per_response(tmp_path: Path) -> None:
    """Triton's decoupled ensembles (tests/compat checks them against Triton 2.51): each
    response of the decoupled step runs the steps after it and is one answer of the ensemble.
    `/infer` serves exactly one answer, as for a decoupled model. Before, the step's responses
    were refused ("HTTP end point doesn't support models with decoupled transaction policy")."""
    repo = tmp_path / "repo"
    countdown(repo)
    python_step(repo, "plus", ["X"], {"Y": "X + 100"})
    ensemble(repo, "pipe", step("countdown", {"IN": "N"}, {"OUT": "I"}) + ", " + step("plus", {"X": "I"}, {"Y": "Y"}),
             ["N"], ["Y"])
    config = repo / "pipe" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 0"))
    registry = await make_registry(tmp_path)
    try:
        for name in ("countdown", "plus", "pipe"):
            await registry.load(name, repo / name)

        def n(value: int) -> InferRequest:
            return InferRequest({"N": np.full(16, value, dtype=np.int32)})

        answers = [r async for r in decoupled.responses(registry.get("pipe"), n(3))]
        # The step's batch of one leaves its batch dimension for the ensemble that does not batch.
        assert [a.outputs["Y"].tolist() for a in answers] == [[100 + i] * 16 for i in range(3)]  # type: ignore[union-attr]
        assert [r async for r in decoupled.responses(registry.get("pipe"), n(0))] == []
        one = await registry.get("pipe").infer(n(1))
        assert one.outputs["Y"].tolist() == [100] * 16  # type: ignore[attr-defined]
        assert one.parameters == {"sequence_id": 0, "sequence_start": False, "sequence_end": False}
        with pytest.raises(EdgedError, match="model 'pipe' gave 3 responses to one request"):
            await registry.get("pipe").infer(n(3))
    finally:
        await registry.close()


async def test_a_decoupled_ensemble_holds_no_answered_iteration(tmp_path: Path) -> None:
    """As Triton, each iteration of a tensor is let go once the steps that read it have it and its
    answer went out: at the last of 24 answers of 1 MiB tensors, the request holds a few of
    them, not all (before: every iteration of both tensors, 48 MiB, until the request ended)."""
    import gc
    import tracemalloc

    repo = tmp_path / "repo"
    wide = 'data_type: TYPE_INT32 dims: [ -1 ]'
    (repo / "countdown" / "1").mkdir(parents=True)
    (repo / "countdown" / "1" / "model.py").write_text(COUNTDOWN.replace("(1, 16)", "(262144,)"))
    (repo / "countdown" / "config.pbtxt").write_text(
        f'backend: "python"\nmax_batch_size: 0\ninput [{{ name: "IN" {wide} }}]\n'
        f'output [{{ name: "OUT" {wide} }}]\nmodel_transaction_policy {{ decoupled: true }}\n'
    )
    python_step(repo, "plus", ["X"], {"Y": "X + 100"})
    for name in ("plus",):
        config = repo / name / "config.pbtxt"
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 0").replace(TENSOR, wide))
    ensemble(repo, "pipe", step("countdown", {"IN": "N"}, {"OUT": "I"}) + ", " + step("plus", {"X": "I"}, {"Y": "Y"}),
             ["N"], ["Y"])
    config = repo / "pipe" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 0").replace(TENSOR, wide))
    registry = await make_registry(tmp_path)
    try:
        for name in ("countdown", "plus", "pipe"):
            await registry.load(name, repo / name)
        request = InferRequest({"N": np.array([24], dtype=np.int32)})
        tracemalloc.start()
        try:
            answers = 0
            async for answer in decoupled.responses(registry.get("pipe"), request):
                answers += 1
                assert answer.outputs["Y"][0] == 100 + answers - 1  # type: ignore[union-attr]
                del answer
                if answers == 24:
                    gc.collect()
                    held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert answers == 24
        assert held < 8 * 2**20, held
    finally:
        await registry.close()


async def test_a_step_failing_mid_stream_ends_the_answers_with_its_error(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    countdown(repo, shape="16")
    # Not batching, one instance: the responses' runs go one after the other, in order.
    python_step(repo, "picky", ["X"], {"Y": "picky(X)"},
                prelude="def picky(x):\n    if (x == 2).any():\n        raise ValueError('two is refused')\n    return x\n")
    config = repo / "picky" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 0"))
    ensemble(repo, "pipe", step("countdown", {"IN": "N"}, {"OUT": "I"}) + ", " + step("picky", {"X": "I"}, {"Y": "Y"}),
             ["N"], ["Y"])
    registry = await make_registry(tmp_path)
    try:
        for name in ("countdown", "picky", "pipe"):
            await registry.load(name, repo / name)
        request = InferRequest({"N": np.full((1, 16), 3, dtype=np.int32)})
        results = [r async for r in decoupled.responses(registry.get("pipe"), request)]
        assert len(results) == 3 and isinstance(results[2], EdgedError)
        assert [r.outputs["Y"].tolist() for r in results[:2]] == [[[0] * 16], [[1] * 16]]  # type: ignore[union-attr]
        assert "ensemble 'pipe' step 1 (model 'picky')" in results[2].message
        assert "two is refused" in results[2].message
        # The request let its step models go.
        assert [registry.get(n)._running for n in ("countdown", "picky")] == [0, 0]
    finally:
        await registry.close()


async def test_a_request_without_an_optional_input_a_step_needs_is_refused(tmp_path: Path) -> None:
    """Triton's words. Before, no step could run and the runner looped without end on the
    event loop (gather of nothing)."""
    repo = tmp_path / "repo"
    python_step(repo, "add", ["X", "Z"], {"Y": "X + Z"})
    ensemble(repo, "e", step("add", {"X": "X", "Z": "Z"}, {"Y": "Y"}), ["X", "Z"], ["Y"])
    config = repo / "e" / "config.pbtxt"
    config.write_text(config.read_text().replace('{ name: "Z" data_type: TYPE_INT32 dims: [ 16 ] }',
                                                 '{ name: "Z" data_type: TYPE_INT32 dims: [ 16 ] optional: true }'))
    registry = await make_registry(tmp_path)
    try:
        for name in ("add", "e"):
            await registry.load(name, repo / name)
        with pytest.raises(EdgedError, match=re.escape("in ensemble 'e', unexpected deadlock, at least one output is not set")):
            await registry.get("e").infer(InferRequest({"X": np.zeros((1, 16), dtype=np.int32)}))
    finally:
        await registry.close()


async def test_a_step_taking_a_decoupled_steps_responses_and_the_request_is_refused(tmp_path: Path) -> None:
    """Triton's check and text (tests/compat: ens_mixed_origins): the responses of the
    decoupled step could not be paired with the request's one tensor."""
    repo = tmp_path / "repo"
    countdown(repo)
    python_step(repo, "pair", ["X", "Z"], {"Y": "X + Z"})
    ensemble(repo, "e", step("countdown", {"IN": "N"}, {"OUT": "I"}) + ", " + step("pair", {"X": "I", "Z": "N"}, {"Y": "Y"}),
             ["N"], ["Y"])
    registry = await make_registry(tmp_path)
    try:
        for name in ("countdown", "pair"):
            await registry.load(name, repo / name)
        with pytest.raises(ConfigError, match=re.escape(
            "in ensemble e, step of model 'e' receives inputs originated from different decoupled models"
        )):
            await registry.load("e", repo / "e")
    finally:
        await registry.close()


@pytest.mark.parametrize(("edit", "refusal"), [
    pytest.param(("dims: [ 16 ] }]\noutput", "dims: [ 15 ] }]\noutput"),
                 "in ensemble e, ensemble tensor X: inconsistent shape: [-1,15] is inferred from model e while "
                 "[-1,16] is inferred from model ok", id="shape"),
    pytest.param(("TYPE_INT32", "TYPE_FP32"),
                 "in ensemble e, ensemble tensor X: inconsistent data type: TYPE_FP32 is inferred from model e "
                 "while TYPE_INT32 is inferred from model ok", id="data-type"),
    pytest.param(("max_batch_size: 8", "max_batch_size: 16"),
                 "ensemble e allows maximum batch size 16, but it contains model ok which only allows maximum "
                 "batch size to be 8", id="max-batch-size"),
    pytest.param(('key: "X" value: "X"', 'key: "W" value: "X"'),
                 "in ensemble e, ensemble tensor X is mapping to non-existing input W in model ok", id="unknown-input"),
])
async def test_an_ensemble_its_step_models_do_not_fit_is_refused_at_load(
    tmp_path: Path, edit: tuple[str, str], refusal: str
) -> None:
    """Triton's checks and texts (tests/compat checks them against Triton 2.51)."""
    repo = tmp_path / "repo"
    python_step(repo, "ok", ["X"], {"Y": "X"})
    python_step(repo, "two", ["X", "Z"], {"Y": "X + Z"})
    ensemble(repo, "e", step("ok", {"X": "X"}, {"Y": "Y"}), ["X"], ["Y"])
    ensemble(repo, "half", step("two", {"X": "X"}, {"Y": "Y"}), ["X"], ["Y"])
    config = repo / "e" / "config.pbtxt"
    assert edit[0] in config.read_text()
    config.write_text(config.read_text().replace(*edit, 1))
    registry = await make_registry(tmp_path)
    try:
        for name in ("ok", "two"):
            await registry.load(name, repo / name)
        with pytest.raises(ConfigError, match=re.escape(refusal)):
            await registry.load("e", repo / "e")
        with pytest.raises(ConfigError, match=re.escape(
            "in ensemble half, input Z in model two is not mapped to any ensemble tensors"
        )):
            await registry.load("half", repo / "half")
    finally:
        await registry.close()
