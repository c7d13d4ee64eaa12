"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from daemon.backend import Backend
from daemon.core.plugins import PluginRegistry
from daemon.errors import PluginError
from support import REPO_BACKENDS as BACKENDS_DIR
from support import DaemonProcess, start_daemon_process


@pytest.fixture
def plugin_registry() -> PluginRegistry:
    """The repository's real backends/ directory, scanned."""
    registry = PluginRegistry([BACKENDS_DIR])
    registry.scan()
    return registry


@pytest.fixture
def backend_class(plugin_registry: PluginRegistry) -> Callable[[str], type[Backend]]:
    """`backend_class("onnxruntime")` imports a real plugin from backends/ the way the daemon
    does, and skips the test when that plugin's runtime is not installed here."""

    def resolve(name: str) -> type[Backend]:
        try:
            return plugin_registry.resolve(name)
        except PluginError as exc:
            if "is not installed" in exc.message or "cannot run here" in exc.message:
                pytest.skip(exc.message)
            raise

    return resolve


# --------------------------------------------------------------------------- a real daemon


@pytest.fixture
def start_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., DaemonProcess]]:
    """Factory: start `python -m daemon serve` with the given flags; stopped at teardown."""
    started: list[DaemonProcess] = []

    def start(*flags: str, **options: Any) -> DaemonProcess:
        daemon = start_daemon_process(tmp_path_factory.mktemp("edged"), *flags, **options)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
