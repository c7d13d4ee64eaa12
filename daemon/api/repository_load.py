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

import msgspec

from daemon.core.uploads import FILE_PREFIX, model_files
from daemon.errors import InvalidArgument


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
        elif key.startswith(FILE_PREFIX):
            files[key] = _base64(key, value)
        else:
            raise InvalidArgument(
                f"unknown load parameter '{key}': expected 'config' or "
                "'file:<version>/<file name>'"
            )
    return config_json, model_files(files, config_json)


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


def _base64(key: str, value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"load parameter '{key}' is not valid base64") from None
