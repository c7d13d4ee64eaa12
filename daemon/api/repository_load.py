"""`POST /v2/repository/models/{m}/load` and `/unload` bodies, as Triton reads them.

Load parameters (Triton's model repository extension):
- `config`: the model configuration as a JSON string; it replaces the repository's config.
- `file:<path>`: a model file sent in the request, base64-encoded, relative to a model
  directory (`file:1/model.onnx`). Given any, the model is loaded from these files alone, and
  `config` must be given too (as in Triton). They are written under the state directory.
Anything else is a 400 naming the parameter: silently ignoring it would load something other
than what was asked for. This module only decodes; the repository manager writes the files and
loads (daemon.core.repository).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import PurePosixPath

import msgspec

from daemon.errors import BackendError, InvalidArgument

_FILE_PREFIX = "file:"


class LoadRequest(msgspec.Struct, forbid_unknown_fields=True):
    parameters: dict[str, object] = {}


class UnloadRequest(msgspec.Struct, forbid_unknown_fields=True):
    parameters: dict[str, object] = {}


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
    if not raw or path.is_absolute() or ".." in path.parts or raw.startswith("/") or not path.parts or "\0" in raw:
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


def load_failure(name: str, exc: BackendError) -> InvalidArgument:
    """Triton answers a model that fails to load with a 400 starting this way."""
    return InvalidArgument(f"load failed for model '{name}': {exc.message}")
