"""The repository's control as a model calls it (pb_utils.load_model and friends go through
`ModelControlHook`), on a real registry with python models."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from daemon.backend import InferRequest
from daemon.core.hardware import Hardware
from daemon.core.plugins import PluginRegistry
from daemon.core.registry import ModelRegistry
from daemon.core.repository import ModelControlHook, RepositoryManager
from daemon.core.stats import MetricsRegistry
from daemon.errors import Conflict, InvalidArgument, Unavailable
from support import REPO_BACKENDS, python_model


def repository_for(tmp_path: Path, mode: str = "explicit") -> RepositoryManager:
    plugins = PluginRegistry([REPO_BACKENDS])
    plugins.scan()
    registry = ModelRegistry(plugins, Hardware(openvino=False), MetricsRegistry(), tmp_path / "state")
    repo = tmp_path / "repo"
    python_model(repo, "double", "y = x * 2")
    return RepositoryManager(registry, [repo], mode, state_dir=tmp_path / "state")  # type: ignore[arg-type]


async def test_load_unload_and_readiness(tmp_path: Path) -> None:
    repository = repository_for(tmp_path)
    accepting = True
    hook = ModelControlHook(repository, lambda: accepting)
    try:
        assert not hook.is_ready("double", "")
        await hook.load("double", None, {})
        assert hook.is_ready("double", "") and hook.is_ready("double", "1") and not hook.is_ready("double", "2")
        assert not hook.is_ready("double", "0")  # as Triton 2.51: no such version, not an error
        for bad in ("abc", "-1", "1.0", "99999999999999999999", "\u0661"):  # the last: an Arabic-Indic digit one
            with pytest.raises(InvalidArgument, match=re.escape(f"version string '{bad}': version should be an integral value > 0")):
                hook.is_ready("double", bad)
        with pytest.raises(InvalidArgument, match="need the model configuration in the 'config' parameter too"):
            await hook.load("double", None, {"file:1/model.py": b""})
        with pytest.raises(InvalidArgument, match="the file path must be relative to the model directory"):
            await hook.load("double", "{}", {"file:../model.py": b""})
        # Once the daemon shuts down, a model still running loads and unloads nothing.
        accepting = False
        with pytest.raises(Unavailable, match="server is shutting down"):
            await hook.load("double", None, {})
        with pytest.raises(Unavailable, match="server is shutting down"):
            await hook.unload("double", False)
        assert hook.is_ready("double", "")
        accepting = True
        await hook.unload("double", False)
        assert not hook.is_ready("double", "")
    finally:
        await repository.registry.close()


async def test_outside_explicit_mode_the_repository_refuses(tmp_path: Path) -> None:
    hook = ModelControlHook(repository_for(tmp_path, "poll"), lambda: True)
    with pytest.raises(Conflict, match="explicit model load / unload is not allowed if polling is enabled"):
        await hook.load("double", None, {})


def ensemble_of(repo: Path, name: str, step_model: str, *, input_key: str = "X") -> None:
    """An ensemble X -> Y over one step model with Triton's python_model tensors."""
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(
        'platform: "ensemble"\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        f'ensemble_scheduling {{ step [ {{ model_name: "{step_model}" model_version: -1 '
        f'input_map {{ key: "{input_key}" value: "X" }} output_map {{ key: "Y" value: "Y" }} }} ] }}\n'
    )


async def _answer(registry: ModelRegistry, name: str) -> list[float]:
    x = np.array([1.5, -2.0], dtype=np.float32)
    return (await registry.get(name).infer(InferRequest({"X": x}))).outputs["Y"].tolist()  # type: ignore[attr-defined, no-any-return]


def _ensembles_and_a_bad_step(repo: Path) -> None:
    """`outer` over `inner` over `double`; `uses_bad` over `bad`, whose load fails."""
    ensemble_of(repo, "inner", "double")
    ensemble_of(repo, "outer", "inner")
    python_model(repo, "bad", "y = x")
    (repo / "bad" / "1" / "model.py").write_text("raise RuntimeError('this model refuses to load')\n")
    ensemble_of(repo, "uses_bad", "bad")


async def test_an_ensemble_loads_with_its_steps_and_goes_with_them(tmp_path: Path) -> None:
    """Triton's explicit load of an ensemble loads its steps (through nested ensembles) and
    refuses one whose step is in no repository or fails to load, with Triton's texts;
    unloading a step unloads the ensembles over it (tests/compat checks all of it against
    Triton 2.51). Before, the ensemble loaded alone and its requests failed at the step."""
    repository = repository_for(tmp_path)
    repo = tmp_path / "repo"
    _ensembles_and_a_bad_step(repo)
    ensemble_of(repo, "lost", "nope")
    registry = repository.registry
    try:
        await repository.load("outer")
        assert [registry.is_ready(n) for n in ("outer", "inner", "double")] == [True, True, True]
        assert await _answer(registry, "outer") == [3.0, -4.0]
        await repository.unload("double")
        assert [registry.is_ready(n) for n in ("outer", "inner", "double")] == [False, False, False]
        assert registry.entry("outer").reason == "unloaded"  # type: ignore[union-attr]
        with pytest.raises(InvalidArgument, match=re.escape(
            "load failed for model 'lost': ensemble lost contains models that are not available or ambiguous: nope"
        )):
            await repository.load("lost")
        with pytest.raises(InvalidArgument, match=re.escape(
            "load failed for model 'uses_bad': ensemble 'uses_bad' depends on 'bad' which has no loaded "
            "version. Model 'bad' loading failed with error: "
        ) + ".*this model refuses to load"):
            await repository.load("uses_bad")
        # As in Triton, the ensemble was never tried (the index lists it by name alone).
        assert registry.entry("uses_bad") is None and registry.entry("lost") is None
    finally:
        await registry.close()


async def test_an_ensemble_named_at_start_brings_its_steps(tmp_path: Path) -> None:
    repository = repository_for(tmp_path)
    repo = tmp_path / "repo"
    ensemble_of(repo, "inner", "double")
    ensemble_of(repo, "outer", "inner")
    python_model(repo, "other", "y = x")
    repository.startup_models = ["outer"]
    try:
        assert await repository.startup() == []
        assert await _answer(repository.registry, "outer") == [3.0, -4.0]
        assert not repository.registry.is_ready("other")
    finally:
        await repository.registry.close()


async def test_a_rescan_loads_an_ensemble_after_its_steps(tmp_path: Path) -> None:
    """An ensemble is checked against its step models when it loads: a rescan that finds an
    ensemble and its step changed together (the step's input renamed, the ensemble's map with
    it) loads the step first. Loaded together, the ensemble was checked against the old step
    and refused ("ensemble tensor X is mapping to non-existing input X2")."""
    repository = repository_for(tmp_path, "poll")
    repo = tmp_path / "repo"
    ensemble_of(repo, "pipe", "double")
    try:
        assert await repository.startup() == []
        assert await _answer(repository.registry, "pipe") == [3.0, -4.0]
        for file in (repo / "double" / "config.pbtxt", repo / "double" / "1" / "model.py"):
            file.write_text(file.read_text().replace('name: "X"', 'name: "X2"').replace("request, 'X'", "request, 'X2'"))
        ensemble_of(repo, "pipe", "double", input_key="X2")
        await repository.rescan()
        assert repository.registry.entry("pipe").reason == ""  # type: ignore[union-attr]
        assert await _answer(repository.registry, "pipe") == [3.0, -4.0]
    finally:
        await repository.registry.close()


async def test_an_explicit_load_of_ensembles_leading_to_each_other_is_refused(tmp_path: Path) -> None:
    repository = repository_for(tmp_path)
    repo = tmp_path / "repo"
    ensemble_of(repo, "a", "b")
    ensemble_of(repo, "b", "a")
    try:
        with pytest.raises(InvalidArgument, match=re.escape("ensemble 'b' contains a cycle: its steps lead back to 'a'")):
            await repository.load("a")
        assert not repository.registry.is_ready("a") and not repository.registry.is_ready("b")
    finally:
        await repository.registry.close()


async def test_at_start_and_on_rescans_an_ensemble_waits_for_its_steps(tmp_path: Path) -> None:
    """As Triton 2.51 when it starts or polls (tests/compat checks it): an ensemble whose step
    model is in no repository, or failed to load, is not loaded (Triton's texts as its reason);
    a rescan that finds the step loads it; a step leaving the repository unloads the ensembles
    over it, which a later rescan loads again when it is back. Before, such an ensemble was
    served and every request failed at the step."""
    repository = repository_for(tmp_path, "poll")
    repo = tmp_path / "repo"
    (repo / "double").rename(tmp_path / "double")
    _ensembles_and_a_bad_step(repo)
    registry = repository.registry

    def reasons() -> dict[str, str]:
        return {n: registry.entry(n).reason for n in ("inner", "outer", "uses_bad")}  # type: ignore[union-attr]

    try:
        assert sorted(await repository.startup()) == ["bad", "inner", "outer", "uses_bad"]
        assert not any(registry.is_ready(n) for n in ("inner", "outer", "uses_bad"))
        refused = reasons()
        assert refused["inner"] == "ensemble inner contains models that are not available or ambiguous: double"
        assert refused["outer"] == ("ensemble 'outer' depends on 'inner' which has no loaded version. Model 'inner' "
                                    f"loading failed with error: {refused['inner']}")
        assert re.fullmatch("ensemble 'uses_bad' depends on 'bad' which has no loaded version. Model 'bad' loading "
                            "failed with error: .*this model refuses to load", refused["uses_bad"])
        await repository.rescan()  # nothing changed: refused again, for the same reasons
        assert reasons() == refused
        (tmp_path / "double").rename(repo / "double")
        await repository.rescan()
        assert await _answer(registry, "outer") == [3.0, -4.0]
        assert not registry.is_ready("uses_bad")
        (repo / "double").rename(tmp_path / "double")
        await repository.rescan()
        assert not any(registry.is_ready(n) for n in ("double", "inner", "outer"))
        assert reasons()["outer"] == "ensemble 'outer' depends on 'inner' which has no loaded version"
        (tmp_path / "double").rename(repo / "double")
        await repository.rescan()
        assert await _answer(registry, "outer") == [3.0, -4.0]
    finally:
        await registry.close()
