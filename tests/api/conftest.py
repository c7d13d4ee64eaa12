"""Fixtures shared by the API tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def simple_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with Triton's `simple` example as ONNX (`simple`) and as a Python model
    (`simple_python`), written once per test module."""
    pytest.importorskip("onnx")
    from model_builders import write_simple_repository

    path = tmp_path_factory.mktemp("repo")
    write_simple_repository(path)
    return path


@pytest.fixture
def client(daemon: Any) -> Any:
    """The `openai` client on the module's `daemon` fixture (a daemon process serving models
    over TCP); modules testing other clients define their own `client`."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.http_port}/v1", api_key="unused", max_retries=0)
