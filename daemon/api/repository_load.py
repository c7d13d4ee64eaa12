"""`POST /v2/repository/models/{m}/load` and `/unload` bodies, as Triton reads them.

Load parameters (Triton's model repository extension):
- `config`: the model configuration as a JSON string; it replaces the repository's config.
- `file:<path>`: a model file sent in the request, base64-encoded, relative to a model
  directory (`file:1/model.onnx`). Given any, the model is loaded from these files alone, and
  `config` must be given too (as in Triton). They are written under the state directory.
Anything else is a 400 naming the parameter: silently ignoring it would load something other
than what was asked for.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import shutil
import tempfile
from pathlib import Path, PurePosixPath

import msgspec

from daemon.errors import BackendError, InvalidArgument, NotFound
from daemon.service import Service

log = logging.getLogger(__name__)

_FILE_PREFIX = "file:"
_UPLOADS = "uploaded-models"


class LoadRequest(msgspec.Struct, forbid_unknown_fields=True):
    parameters: dict[str, object] = {}


class UnloadRequest(msgspec.Struct, forbid_unknown_fields=True):
    parameters: dict[str, object] = {}


async def load_model(daemon: Service, name: str, body: bytes) -> None:
    """Handle a load request: validate its parameters, write any uploaded files, load."""
    config_json, files = parse_load(body)
    loop = asyncio.get_running_loop()
    model_dir: Path | None = None
    if files:
        model_dir = await loop.run_in_executor(None, write_upload, daemon.state_dir, name, files)
    try:
        await daemon.repository.load(name, config_json, model_dir)
    except BackendError as exc:
        if model_dir is not None:
            await loop.run_in_executor(None, remove_upload, model_dir)
        raise load_failure(name, exc) from None
    except BaseException:
        if model_dir is not None:
            await loop.run_in_executor(None, remove_upload, model_dir)
        raise
    # Earlier uploads of this model are no longer served.
    await loop.run_in_executor(None, _prune_uploads, daemon.state_dir, name, model_dir)


async def unload_model(daemon: Service, name: str, body: bytes) -> None:
    dependents = parse_unload(body)
    steps: list[str] = []
    entry = daemon.registry.entry(name)
    if dependents and entry is not None:
        for model in entry.versions.values():
            ensemble = model.config.ensemble_scheduling
            if ensemble is not None:
                steps += [s.model_name for s in ensemble.step if s.model_name not in steps]
    # As in Triton: a model that is not loaded is already unloaded.
    with contextlib.suppress(NotFound):
        await daemon.repository.unload(name)
    # `unload_dependents`: the ensemble's step models go too.
    for step in steps:
        with contextlib.suppress(NotFound):
            await daemon.repository.unload(step)


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    if not body.strip():
        return kind()
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed request body: {exc}") from None


def parse_load(body: bytes) -> tuple[str | None, dict[str, bytes]]:
    """The config override (JSON text; the repository parses it) and the uploaded files
    (relative path -> contents) of a load request."""
    request = decode_body(body, LoadRequest)
    assert isinstance(request, LoadRequest)
    config_json: str | None = None
    files: dict[str, bytes] = {}
    for key, value in request.parameters.items():
        if not isinstance(value, str):
            raise InvalidArgument(f"load parameter '{key}' must be a string, got {value!r}")
        if key == "config":
            config_json = value
        elif key.startswith(_FILE_PREFIX):
            files[_relative_path(key)] = _base64(key, value)
        else:
            raise InvalidArgument(
                f"unknown load parameter '{key}': expected 'config' or "
                "'file:<version>/<file name>'"
            )
    if files and config_json is None:
        raise InvalidArgument(
            "load parameters 'file:...' need the model configuration in the 'config' "
            "parameter too"
        )
    return config_json, files


def parse_unload(body: bytes) -> bool:
    """The `unload_dependents` flag of an unload request (tritonclient always sends it)."""
    request = decode_body(body, UnloadRequest)
    assert isinstance(request, UnloadRequest)
    dependents = False
    for key, value in request.parameters.items():
        if key != "unload_dependents":
            raise InvalidArgument(
                f"unknown unload parameter '{key}': expected 'unload_dependents'"
            )
        if not isinstance(value, bool):
            raise InvalidArgument(f"Unable to parse 'unload_dependents': expected a boolean, got {value!r}")
        dependents = value
    return dependents


def _relative_path(key: str) -> str:
    raw = key[len(_FILE_PREFIX):]
    path = PurePosixPath(raw)
    if not raw or path.is_absolute() or ".." in path.parts or raw.startswith("/"):
        raise InvalidArgument(
            f"load parameter '{key}': the file path must be relative to the model directory, "
            "like 'file:1/model.onnx'"
        )
    return str(path)


def _base64(key: str, value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"load parameter '{key}' is not valid base64") from None


def write_upload(state_dir: Path, name: str, files: dict[str, bytes]) -> Path:
    """Write uploaded files into a fresh model directory (blocking: run in an executor)."""
    root = state_dir / _UPLOADS
    root.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    for relative, data in files.items():
        target = model_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return model_dir


def remove_upload(model_dir: Path) -> None:
    shutil.rmtree(model_dir, ignore_errors=True)


def _prune_uploads(state_dir: Path, name: str, keep: Path | None) -> None:
    root = state_dir / _UPLOADS
    if not root.is_dir():
        return
    for path in root.glob(f"{name}-*"):
        suffix = path.name[len(name) + 1 :]
        # mkdtemp's suffix has no '-': "a-x1y2z3w4" is model a's, not model "a-x"'s.
        if path != keep and path.is_dir() and "-" not in suffix:
            remove_upload(path)


def load_failure(name: str, exc: BackendError) -> InvalidArgument:
    """Triton answers a model that fails to load with a 400 starting this way."""
    return InvalidArgument(f"load failed for model '{name}': {exc.message}")
