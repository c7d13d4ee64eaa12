"""Model files sent in a load request (Triton's `file:` load parameters), kept under the state
directory: one fresh directory per load, the previous ones of the model pruned once a new one
serves. Blocking file I/O: call these on a worker thread."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

UPLOADS = "uploaded-models"


def write(state_dir: Path, name: str, files: dict[str, bytes]) -> Path:
    """Write `files` (relative path -> contents, already validated) into a fresh model dir."""
    root = state_dir / UPLOADS
    root.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    for relative, data in files.items():
        target = model_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return model_dir


def remove(model_dir: Path) -> None:
    shutil.rmtree(model_dir, ignore_errors=True)


def prune(state_dir: Path, name: str, keep: Path | None) -> None:
    """Remove the model's earlier uploads, all but `keep`."""
    root = state_dir / UPLOADS
    if not root.is_dir():
        return
    for path in root.glob(f"{name}-*"):
        suffix = path.name[len(name) + 1 :]
        # mkdtemp's suffix has no '-': "a-x1y2z3w4" is model a's, not model "a-x"'s.
        if path != keep and path.is_dir() and "-" not in suffix:
            remove(path)
