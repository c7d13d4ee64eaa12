"""Model registry with real backends: selection fallback, load-then-swap, failed reloads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from daemon.backend import InferRequest
from daemon.core.hardware import CpuInfo, Hardware, HardwareInfo, NvidiaGpu
from daemon.core.plugins import PluginRegistry
from daemon.core.registry import ModelRegistry
from daemon.core.stats import MetricsRegistry
from daemon.errors import BackendError, NotFound, Unavailable

pytest.importorskip("onnxruntime")

from model_builders import build_mlp_onnx, mlp_reference

from support import REPO_BACKENDS, python_model


def registry_for(tmp_path: Path, hardware: HardwareInfo | None = None) -> ModelRegistry:
    plugins = PluginRegistry([REPO_BACKENDS])
    plugins.scan()
    return ModelRegistry(
        plugins, Hardware.fixed(hardware) if hardware else Hardware(openvino=False), MetricsRegistry(),
        tmp_path / "state",
    )


def mlp_model(repo: Path, name: str, *, corrupt_ir: bool = False) -> object:
    version = repo / name / "1"
    version.mkdir(parents=True)
    weights = build_mlp_onnx(version / "model.onnx", width=32, depth=2, seed=3)
    if corrupt_ir:
        (version / "model.xml").write_text("<net this is not OpenVINO IR")
        (version / "model.bin").write_bytes(b"\0" * 16)
    return weights


async def test_fallback_to_next_backend_when_load_fails(tmp_path: Path) -> None:
    pytest.importorskip("openvino")
    repo = tmp_path / "repo"
    weights = mlp_model(repo, "mlp", corrupt_ir=True)
    registry = registry_for(tmp_path)
    try:
        await registry.load("mlp", repo / "mlp")
        model = registry.get("mlp")
        assert model.backend == "onnxruntime"
        skipped = {s["backend"]: s["reason"] for s in model.selection["skipped"]}  # type: ignore[union-attr]
        assert "openvino" in skipped and "load failed" in skipped["openvino"]
        x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
        name_in = model.config.input[0].name
        response = await registry.get("mlp").infer(InferRequest({name_in: x}))
        out = next(iter(response.outputs.values()))
        np.testing.assert_allclose(out, mlp_reference(x, weights), rtol=1e-4, atol=1e-5)  # type: ignore[arg-type]
    finally:
        await registry.close()


async def test_cpu_box_prefers_openvino_for_onnx(tmp_path: Path) -> None:
    pytest.importorskip("openvino")
    repo = tmp_path / "repo"
    mlp_model(repo, "mlp")
    registry = registry_for(tmp_path)
    try:
        await registry.load("mlp", repo / "mlp")
        assert registry.get("mlp").backend == "openvino"
    finally:
        await registry.close()


async def test_datacenter_gpu_without_plan_does_not_pick_tensorrt(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    mlp_model(repo, "mlp")
    fake_h100 = HardwareInfo(
        cpu=CpuInfo(model="test", vendor="test", logical_cores=2, physical_cores=2),
        memory_total=1 << 30,
        nvidia_gpus=[NvidiaGpu(index=0, name="NVIDIA H100 80GB HBM3", memory_total=80 << 30,
                               compute_capability="9.0", datacenter=True)],
    )
    registry = registry_for(tmp_path, fake_h100)
    try:
        await registry.load("mlp", repo / "mlp")
        model = registry.get("mlp")
        assert model.backend in ("openvino", "onnxruntime")
        assert "tensorrt" in {s["backend"] for s in model.selection["skipped"]}  # type: ignore[union-attr]
    finally:
        await registry.close()


async def test_reload_swaps_without_failed_requests(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x + 1")
    registry = registry_for(tmp_path)
    await registry.load("m", repo / "m")
    results: list[float] = []
    errors: list[Exception] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            try:
                r = await registry.get("m").infer(InferRequest({"X": np.ones(1, np.float32)}))
                results.append(float(r.outputs["Y"][0]))
            except Exception as exc:  # any failure is what this test exists to catch
                errors.append(exc)
            await asyncio.sleep(0)

    async def until(condition: Callable[[], bool]) -> None:
        # On observable state, not a sleep that is long enough only on a fast machine.
        async with asyncio.timeout(30):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(client()) for _ in range(4)]
    await until(lambda: len(results) >= 4)
    python_model(repo, "m", "y = x + 100")
    await registry.load("m", repo / "m")
    served = len(results)
    await until(lambda: len(results) >= served + 4)
    stop.set()
    await asyncio.gather(*tasks)
    await registry.close()
    assert not errors
    assert results[0] == 2.0 and results[-1] == 101.0
    assert set(results) == {2.0, 101.0}


async def test_a_request_that_entered_a_version_runs_on_it_after_a_reload(tmp_path: Path) -> None:
    """A route resolves and enters the version before it awaits the body; a reload that swaps
    in another version meanwhile retires the old one only after the request has run on it."""
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x + 1")
    registry = registry_for(tmp_path)
    try:
        await registry.load("m", repo / "m")
        old = registry.get("m")
        old.enter()  # the request's body is still arriving
        python_model(repo, "m", "y = x + 100")
        reload = asyncio.create_task(registry.load("m", repo / "m"))
        async with asyncio.timeout(30):
            while registry.get("m") is old:  # noqa: ASYNC110 (on observable state)
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the retirement has begun and waits
        assert not reload.done()
        try:
            response = await old.infer(InferRequest({"X": np.array([1], np.float32)}))
        finally:
            old.leave()
        assert response.outputs["Y"].tolist() == [2.0]  # the version it resolved, not refused
        await asyncio.wait_for(reload, 30)
        new = await registry.get("m").infer(InferRequest({"X": np.array([1], np.float32)}))
        assert new.outputs["Y"].tolist() == [101.0]
        with pytest.raises(Unavailable, match="unloading"):  # retired now: it takes no more
            await old.infer(InferRequest({"X": np.array([1], np.float32)}))
    finally:
        await registry.close()


def k_model(repo: Path, marker: Path, *, rewrite: str) -> Path:
    """Two instances that each read K from k.txt at initialize. `rewrite` "once": the first
    initialize ever replaces k.txt with 2 (a deploy landing between the two instances' reads);
    "always": every initialize does (files that never stop changing); "never"."""
    folder = repo / "k"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(
        'backend: "python"\ninstance_group [{ kind: KIND_CPU count: 2 }]\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
    )
    (folder / "1" / "k.txt").write_text("1")
    (folder / "1" / "model.py").write_text(f"""\
import os
import pathlib

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        here = pathlib.Path(__file__).parent
        self.k = float((here / "k.txt").read_text())
        marker = pathlib.Path({str(marker)!r})
        if {rewrite!r} == "always" or ({rewrite!r} == "once" and not marker.exists()):
            marker.write_text("")
            (here / "k.new").write_text(str(self.k + 1))
            os.replace(here / "k.new", here / "k.txt")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.full(1, self.k, np.float32))])
                for _ in requests]
""")
    return folder


async def test_a_model_whose_files_change_while_it_loads_is_loaded_again(tmp_path: Path) -> None:
    """Each instance reads the files itself: a file replaced between two instances' reads
    would leave one version answering with two copies. The load is done again instead."""
    marker = tmp_path / "rewritten"
    folder = k_model(tmp_path / "repo", marker, rewrite="once")
    registry = registry_for(tmp_path)
    try:
        await registry.load("k", folder)
        assert marker.exists()  # the file did change during the first load
        assert [instance.model.k for instance in registry.get("k").instances] == [2.0, 2.0]  # type: ignore[attr-defined]
    finally:
        await registry.close()


async def test_files_that_keep_changing_fail_the_load_and_keep_the_old_version(tmp_path: Path) -> None:
    folder = k_model(tmp_path / "repo", tmp_path / "rewritten", rewrite="never")
    registry = registry_for(tmp_path)
    try:
        await registry.load("k", folder)
        k_model(tmp_path / "repo", tmp_path / "rewritten", rewrite="always")
        with pytest.raises(Unavailable, match="files changed during each of 3 loads"):
            await registry.load("k", folder)
        entry = registry.entry("k")
        assert entry is not None and entry.state == "READY" and entry.fingerprint == ""
        response = await registry.get("k").infer(InferRequest({"X": np.zeros(1, np.float32)}))
        assert response.outputs["Y"].tolist() == [1.0]  # the old version still serves
    finally:
        await registry.close()


async def test_failed_reload_keeps_serving_old_version(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x * 2")
    registry = registry_for(tmp_path)
    try:
        await registry.load("m", repo / "m")
        (repo / "m" / "1" / "model.py").write_text("raise RuntimeError('bad weights')\n")
        with pytest.raises(BackendError, match="bad weights"):
            await registry.load("m", repo / "m")
        entry = registry.entry("m")
        assert entry is not None and entry.state == "READY" and "bad weights" in entry.reason
        r = await registry.get("m").infer(InferRequest({"X": np.array([3], np.float32)}))
        assert r.outputs["Y"].tolist() == [6.0]
    finally:
        await registry.close()


async def test_staged_models_serve_only_once_published_and_all_together(tmp_path: Path) -> None:
    python_model(tmp_path / "old", "a", "y = x + 1")
    python_model(tmp_path / "old", "b", "y = x + 1")
    python_model(tmp_path / "new", "a", "y = x + 100")
    python_model(tmp_path / "new", "b", "y = x + 100")
    python_model(tmp_path / "new", "c", "y = x + 100")
    registry = registry_for(tmp_path)

    async def value(name: str) -> float:
        response = await registry.get(name).infer(InferRequest({"X": np.zeros(1, np.float32)}))
        return float(response.outputs["Y"][0])

    try:
        for name in ("a", "b"):
            await registry.load(name, tmp_path / "old" / name)
        staged = [await registry.stage(name, tmp_path / "new" / name, registry.generation(name)) for name in ("a", "b", "c")]
        assert [await value("a"), await value("b")] == [1.0, 1.0]  # staged: not serving
        assert registry.entry("c") is None
        old = registry.get("a")
        await registry.publish(staged)
        assert [await value(name) for name in ("a", "b", "c")] == [100.0, 100.0, 100.0]
        entry = registry.entry("a")
        assert entry is not None and entry.loaded_from == entry.path == tmp_path / "new" / "a"
        with pytest.raises(Unavailable):  # the replaced version was retired
            await old.infer(InferRequest({"X": np.zeros(1, np.float32)}))

        (tmp_path / "new" / "a" / "1" / "model.py").write_text("raise RuntimeError('bad weights')\n")
        with pytest.raises(BackendError, match="bad weights"):
            await registry.stage("a", tmp_path / "new" / "a", registry.generation("a"))
        assert entry.reason == ""  # a refused release records nothing
        with pytest.raises(BackendError, match="bad weights"):
            await registry.stage("a", tmp_path / "new" / "a", registry.generation("a"), record_failure=True)
        assert entry.state == "READY" and "bad weights" in entry.reason and await value("a") == 100.0

        # Unloaded after the switch chose it (an on-demand model idling out): it stays so.
        chosen = registry.generation("b")
        await registry.unload("b")
        restaged = await registry.stage("b", tmp_path / "old" / "b", chosen)
        await registry.publish([restaged])
        assert not registry.is_ready("b")
        with pytest.raises(Unavailable):  # the staged copy was dropped
            await restaged.versions[1].infer(InferRequest({"X": np.zeros(1, np.float32)}))
        # Loaded after it was chosen (a request loading an on-demand model): that load stands.
        chosen = registry.generation("b")
        restaged = await registry.stage("b", tmp_path / "old" / "b", chosen)
        await registry.load("b", tmp_path / "new" / "b")
        await registry.publish([restaged])
        assert await value("b") == 100.0

        kept = await registry.stage("b", tmp_path / "old" / "b", registry.generation("b"))
        await registry.discard([kept])
        assert await value("b") == 100.0
        with pytest.raises(Unavailable):
            await kept.versions[1].infer(InferRequest({"X": np.zeros(1, np.float32)}))
    finally:
        await registry.close()


async def test_a_publish_waits_for_a_load_under_way_and_a_cancelled_one_drops_its_copies(tmp_path: Path) -> None:
    python_model(tmp_path / "old", "a", "y = x + 1")
    python_model(tmp_path / "new", "a", "y = x + 100")
    registry = registry_for(tmp_path)
    x = InferRequest({"X": np.zeros(1, np.float32)})
    try:
        await registry.load("a", tmp_path / "old" / "a")
        entry = registry.entry("a")
        assert entry is not None
        staged = await registry.stage("a", tmp_path / "new" / "a", registry.generation("a"))
        async with entry.lock:  # a load of "a" under way
            publishing = asyncio.create_task(registry.publish([staged]))
            await asyncio.sleep(0.05)
            assert not publishing.done()
            publishing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await publishing
        assert (await registry.get("a").infer(x)).outputs["Y"].tolist() == [1.0]
        with pytest.raises(Unavailable):  # the staged copy was dropped, not left loaded
            await staged.versions[1].infer(x)

        staged = await registry.stage("a", tmp_path / "new" / "a", registry.generation("a"))
        async with entry.lock:
            publishing = asyncio.create_task(registry.publish([staged]))
            await asyncio.sleep(0.05)
            assert (await registry.get("a").infer(x)).outputs["Y"].tolist() == [1.0]
        await publishing  # swapped once the lock was let go
        assert (await registry.get("a").infer(x)).outputs["Y"].tolist() == [100.0]
    finally:
        await registry.close()


async def test_versions_and_unload(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x + 1", version=1)
    python_model(repo, "m", "y = x + 2", version=2)
    registry = registry_for(tmp_path)
    try:
        await registry.load("m", repo / "m")
        assert registry.get("m").version == 2  # latest policy, 1 version
        with pytest.raises(NotFound, match="version 1"):
            registry.get("m", "1")
        await registry.unload("m")
        # Triton's answers for a model unloaded on request: unknown (404) without a version,
        # "not at ready state" (503) for a version it had loaded, unknown for any other.
        with pytest.raises(NotFound, match="'m' is not found"):
            registry.get("m")
        with pytest.raises(Unavailable, match="'m' version 2 is not at ready state"):
            registry.get("m", "2")
        with pytest.raises(NotFound, match="'m' version 1 is not found"):
            registry.get("m", "1")  # the policy never tried it
        # Triton's index: a row for the version it had loaded.
        assert [(r.version, r.state, r.reason) for r in registry.index()] == [("2", "UNAVAILABLE", "unloaded")]
    finally:
        await registry.close()


async def test_a_model_that_failed_to_load_answers_as_triton(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "m" / "3").mkdir(parents=True)
    (repo / "m" / "config.pbtxt").write_text(
        'backend: "python"\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }]\n'
    )
    (repo / "m" / "3" / "model.py").write_text("raise RuntimeError('bad weights')\n")
    registry = registry_for(tmp_path)
    try:
        with pytest.raises(BackendError, match="bad weights"):
            await registry.load("m", repo / "m")
        with pytest.raises(NotFound, match="'m' has no available versions"):
            registry.get("m")
        with pytest.raises(Unavailable, match="'m' version 3 is not at ready state"):
            registry.get("m", 3)
        with pytest.raises(NotFound, match="'m' version 4 is not found"):
            registry.get("m", 4)
        assert [(r.version, r.state) for r in registry.index()] == [("3", "UNAVAILABLE")]
        # Unloading it changes nothing, as in Triton 2.51 (checked side by side): the failure
        # stays its state and reason, and the server stays not ready (strict readiness).
        await registry.unload("m")
        rows = registry.index()
        assert [(r.version, r.state) for r in rows] == [("3", "UNAVAILABLE")] and "bad weights" in rows[0].reason
        with pytest.raises(NotFound, match="'m' has no available versions"):
            registry.get("m")
        assert not registry.all_ready()
    finally:
        await registry.close()
