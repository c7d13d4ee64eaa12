"""The release switch in process: a real registry, repository and plugin registry (the python
backend), release directories written by hand (bundles: tests/api/test_updates.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from daemon.backend import InferRequest
from daemon.core.hardware import Hardware
from daemon.core.plugins import PluginRegistry
from daemon.core.registry import ModelRegistry
from daemon.core.releases import ReleaseManager
from daemon.core.repository import RepositoryManager
from daemon.core.stats import MetricsRegistry
from daemon.updates.errors import HealthCheckFailed
from daemon.updates.store import ReleaseStore
from support import REPO_BACKENDS, python_model


def _ensemble(models: Path, name: str, step: str) -> None:
    (models / name / "1").mkdir(parents=True)
    (models / name / "config.pbtxt").write_text(
        'platform: "ensemble"\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        f'ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1 '
        'input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } } ] }\n'
    )


async def _manager(tmp_path: Path) -> tuple[ReleaseManager, RepositoryManager]:
    base = tmp_path / "base"
    python_model(base, "m", "y = x + 1")
    plugins = PluginRegistry([REPO_BACKENDS])
    plugins.scan()
    registry = ModelRegistry(plugins, Hardware(openvino=False), MetricsRegistry(), tmp_path / "state")
    repository = RepositoryManager(registry, [base], "poll")
    manager = ReleaseManager(ReleaseStore(tmp_path / "store"), tmp_path / "keys", registry, repository,
                             plugins, asyncio.Lock())
    assert await repository.startup() == []
    return manager, repository


async def _value(manager: ReleaseManager, name: str) -> float:
    response = await manager.registry.get(name).infer(InferRequest({"X": np.zeros(1, np.float32)}))
    return float(response.outputs["Y"][0])


async def test_a_refused_release_leaves_the_search_paths_as_they_were(tmp_path: Path) -> None:
    """Until the caller switches back, the poller and explicit loads must not find the
    refused release's models (they would load and serve them)."""
    manager, repository = await _manager(tmp_path)
    try:
        before = list(repository.repositories), list(manager.plugins.directories)
        release = tmp_path / "store" / "releases" / "1-1"
        python_model(release / "models", "m", "raise RuntimeError('bad weights')\ny = x")
        (release / "plugins").mkdir()
        with pytest.raises(HealthCheckFailed, match="bad weights"):
            await manager.health_check(release)
        assert (repository.repositories, manager.plugins.directories) == before
        assert await _value(manager, "m") == 1.0
        await repository.rescan()  # the poller's next look changes nothing
        assert await _value(manager, "m") == 1.0
    finally:
        await manager.registry.close()


async def test_ensembles_that_lead_back_to_each_other_are_refused(tmp_path: Path) -> None:
    """Staged one after the other in view of each other: the second sees the cycle at its
    load. (Staged out of each other's view, each checks only the serving models and the
    warm-up nests requests without end: this test then hangs, checked by hand.)"""
    manager, _ = await _manager(tmp_path)
    try:
        release = tmp_path / "store" / "releases" / "1-1"
        _ensemble(release / "models", "x", "y")
        _ensemble(release / "models", "y", "x")
        with pytest.raises(HealthCheckFailed, match="contains a cycle"):
            await manager.health_check(release)
        assert manager.registry.entry("x") is None and manager.registry.entry("y") is None
    finally:
        await manager.registry.close()


async def test_a_release_with_an_ensemble_over_its_own_step_passes(tmp_path: Path) -> None:
    # The control for the test above: the same construction without a cycle is served.
    manager, _ = await _manager(tmp_path)
    try:
        release = tmp_path / "store" / "releases" / "1-1"
        python_model(release / "models", "step", "y = x + 7")
        _ensemble(release / "models", "pipe", "step")
        await manager.health_check(release)
        assert await _value(manager, "pipe") == 7.0
    finally:
        await manager.registry.close()

