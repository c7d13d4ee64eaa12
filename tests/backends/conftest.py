"""Fixtures shared by the backend tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.backend import Device, InstanceContext
from daemon.model_config import ModelConfig

Loader = Callable[..., Awaitable[Any]]


@pytest.fixture
async def load_llamacpp(backend_class: Callable[[str], type[Any]]) -> AsyncIterator[Loader]:
    """`await load_llamacpp(path, n_parallel="8", ...)`: a loaded llama.cpp backend (the real
    plugin), unloaded at teardown unless the test unloaded it."""
    cls = backend_class("llamacpp")
    loaded: list[Any] = []

    async def make(path: Path, **parameters: str) -> Any:
        backend = cls(InstanceContext("tiny", 1, threads=1))
        await backend.load(ModelConfig(name="tiny", parameters=parameters), path, Device("cpu"))
        loaded.append(backend)
        return backend

    yield make
    for backend in loaded:
        if backend.engine_stats()["slots"]:  # not unloaded yet
            await backend.unload()
