"""`edged backends`: each plugin's state, devices and the version of the runtime it found."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import REPO_ROOT


def test_backends_names_each_ready_runtime_and_its_version() -> None:
    onnxruntime = pytest.importorskip("onnxruntime")
    done = subprocess.run(
        [sys.executable, "-m", "daemon", "backends"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line.split(maxsplit=3) for line in done.stdout.splitlines()}
    _, state, _, detail = lines["onnxruntime"]
    assert state == "ready" and detail.startswith("CPU") and onnxruntime.__version__ in detail
    if "llamacpp" in lines and lines["llamacpp"][1] == "ready":
        # llama.cpp's CPU library, as loaded (backends/llamacpp/ggml_backends.py).
        assert "(cpu: " in lines["llamacpp"][3]
