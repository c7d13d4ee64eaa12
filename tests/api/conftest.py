"""Fixtures shared by the KServe/Triton API tests."""

from __future__ import annotations

from pathlib import Path

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
