"""The service's start: nothing optional is imported until something needs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO_ROOT

LEAN_START = Path(__file__).resolve().parent / "fixtures" / "lean_start.py"


def heavy_imports_at_ready(tmp_path: Path, repository: Path) -> list[str]:
    result = subprocess.run(
        [sys.executable, str(LEAN_START), str(tmp_path / "s.sock"), str(repository), str(tmp_path / "state")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("HEAVY ")), None)
    assert line is not None, result.stdout + result.stderr
    return eval(line.removeprefix("HEAVY "))


def test_empty_repository_imports_no_runtime_and_no_optional_library(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    repository.mkdir()
    assert heavy_imports_at_ready(tmp_path, repository) == []


def test_a_python_model_with_model_toml_needs_neither_protobuf_nor_runtimes(tmp_path: Path) -> None:
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    )
    (model / "model.toml").write_text(
        'backend = "python"\n[[input]]\nname = "X"\ndata_type = "FP32"\ndims = [1]\n'
        '[[output]]\nname = "Y"\ndata_type = "FP32"\ndims = [1]\n'
    )
    assert heavy_imports_at_ready(tmp_path, tmp_path / "repo") == []


def test_an_onnx_model_imports_only_the_runtime_chosen(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from model_builders import write_simple_repository

    write_simple_repository(tmp_path / "repo", python=False)
    # config.pbtxt needs protobuf; platform onnxruntime_onnx picks ONNX Runtime, nothing else.
    assert heavy_imports_at_ready(tmp_path, tmp_path / "repo") == ["google", "onnxruntime"]
