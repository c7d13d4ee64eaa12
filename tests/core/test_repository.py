"""The repository's control as a model calls it (pb_utils.load_model and friends go through
`ModelControlHook`), on a real registry with python models."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
