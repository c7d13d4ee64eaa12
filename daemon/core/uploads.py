"""Uploads kept under the state directory. Model files sent in a load request (Triton's `file:`
load parameters): one fresh directory per load, the previous ones of the model pruned once a
new one serves. Update bundles being received (`POST /v1/updates`): `incoming/*.part`, removed
by their request, or at the next start when the daemon died mid-upload. Blocking file I/O:
call these on a worker thread."""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from daemon.errors import InvalidArgument

log = logging.getLogger(__name__)

UPLOADS = "uploaded-models"
INCOMING_SUFFIX = ".edgebundle.part"
_PATH_ERRNOS = frozenset({errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG})


def incoming_dir(state_dir: Path) -> Path:
    """Where update bundles are written while they arrive."""
    return state_dir / "incoming"


FILE_PREFIX = "file:"


def model_files(parameters: Mapping[str, bytes], config_json: str | None) -> dict[str, bytes]:
    """The files of Triton's `file:<path>` load parameters (name -> contents), by path
    relative to the model directory; checked here for every way a load arrives (the
    repository API, a python model's `pb_utils.load_model`)."""
    files = {_relative_path(key): data for key, data in parameters.items()}
    if files and config_json is None:
        raise InvalidArgument(
            "load parameters 'file:...' need the model configuration in the 'config' parameter too"
        )
    return files


def _relative_path(key: str) -> str:
    raw = key.removeprefix(FILE_PREFIX)
    path = PurePosixPath(raw)
    if (
        not key.startswith(FILE_PREFIX) or not raw or path.is_absolute() or ".." in path.parts
        or raw.startswith("/") or not path.parts or "\0" in raw
    ):
        raise InvalidArgument(
            f"load parameter '{key}': the file path must be relative to the model directory, "
            "like 'file:1/model.onnx'"
        )
    return str(path)


def write(state_dir: Path, name: str, files: dict[str, bytes]) -> Path:
    """Write `files` (relative path -> contents, already validated) into a fresh model dir."""
    root = state_dir / UPLOADS
    root.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    for relative, data in files.items():
        target = model_dir / relative
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        except (OSError, ValueError) as exc:
            remove(model_dir)
            if isinstance(exc, OSError) and exc.errno not in _PATH_ERRNOS:
                raise  # the disk's problem (full, read-only), not the request's
            # Paths that pass the request's checks and still cannot be written: a file and a
            # directory of one name ("1/a" and "1/a/b"), a name too long, a NUL (ValueError).
            problem = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise InvalidArgument(f"load parameter 'file:{relative}' cannot be written: {problem}") from None
    return model_dir


def remove(model_dir: Path) -> None:
    shutil.rmtree(model_dir, ignore_errors=True)


def prune(state_dir: Path, name: str, keep: Path | None) -> None:
    """Remove the model's earlier uploads, all but `keep`."""
    root = state_dir / UPLOADS
    if not root.is_dir():
        return
    # Compared as text, not globbed: a model named "???" matched every other model's uploads.
    for path in root.iterdir():
        if not path.name.startswith(f"{name}-"):
            continue
        suffix = path.name[len(name) + 1 :]
        # mkdtemp's suffix has no '-': "a-x1y2z3w4" is model a's, not model "a-x"'s.
        if path != keep and path.is_dir() and "-" not in suffix:
            remove(path)


def clean_incoming(state_dir: Path) -> None:
    """Partial uploads from a daemon killed mid-upload (each request removes its own file)."""
    incoming = incoming_dir(state_dir)
    if not incoming.is_dir():
        return
    for leftover in incoming.iterdir():
        if leftover.name.endswith((INCOMING_SUFFIX, ".edgebundle")) and leftover.is_file():
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
            log.warning("removed a partial update upload %s", leftover)
