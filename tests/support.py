"""Plain helpers for tests (importable as `support` because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
REPO_BACKENDS = REPO_ROOT / "backends"


def python_model(repo: Path, name: str, body: str, *, version: int = 1) -> Path:
    """Write a Triton-style Python model: FP32 X[-1] -> Y[-1], Y computed by `body` from `x`."""
    folder = repo / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
    )
    code = "\n".join("        " + line for line in body.splitlines())
    (folder / str(version) / "model.py").write_text(
        "import numpy as np\n"
        "import triton_python_backend_utils as pb_utils\n\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [self._one(r) for r in requests]\n\n"
        "    def _one(self, request):\n"
        "        x = pb_utils.get_input_tensor_by_name(request, 'X').as_numpy()\n"
        f"{code}\n"
        "        return pb_utils.InferenceResponse([pb_utils.Tensor('Y', np.asarray(y, dtype=np.float32))])\n"
    )
    return folder


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (OSError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
