"""Triton's trace extension: `/v2/trace/setting` and `/v2/models/{m}/trace/setting`.

Settings travel as JSON strings, as in Triton: `trace_level` (a list: "OFF" or
"TIMESTAMPS"), `trace_rate` (trace one request in N), `trace_count` (traces left, -1 = no
limit), `log_frequency` (write the file every N traces, 0 = at shutdown), `trace_file` and
`trace_mode` (read-only here as in Triton: the file comes from the config's `[trace] file`).
A model's settings override the global ones key by key; `null` clears an override.

A traced request records monotonic timestamps (ns) of what the HTTP handler observes:
HTTP_RECV_START/END, REQUEST_START, REQUEST_END (the inference result is back) and
HTTP_SEND_START (the response is encoded). Traces are written as a JSON array like Triton's
(one object per trace: id, model_name, model_version, request_id, timestamps), to
`<file>.<n>` every `log_frequency` traces, or to `<file>` at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from daemon.api.body import read_body
from daemon.api.state import daemon_of
from daemon.errors import InvalidArgument, Unsupported

log = logging.getLogger(__name__)

_LEVELS = ("OFF", "TIMESTAMPS")
_INT_KEYS = ("trace_rate", "trace_count", "log_frequency")
_DEFAULTS: dict[str, Any] = {
    "trace_level": ["OFF"], "trace_rate": 1000, "trace_count": -1, "log_frequency": 0,
}


@dataclass
class Trace:
    id: int
    model_name: str
    model_version: str
    request_id: str
    timestamps: list[dict[str, Any]] = field(default_factory=list)

    def record(self, name: str) -> None:
        self.timestamps.append({"name": name, "ns": time.monotonic_ns()})

    def to_json(self) -> dict[str, Any]:
        version = int(self.model_version) if self.model_version.isdigit() else self.model_version
        return {"id": self.id, "model_name": self.model_name, "model_version": version,
                "request_id": self.request_id, "timestamps": self.timestamps}


@dataclass
class _Scope:
    """The settings one scope (global or a model) sets, and its sampling state."""

    settings: dict[str, Any] = field(default_factory=dict)
    seen: int = 0


class TraceManager:
    def __init__(self, trace_file: str) -> None:
        self.file = trace_file
        self._global = _Scope(dict(_DEFAULTS))
        self._models: dict[str, _Scope] = {}
        self._next_id = 1
        self._pending: list[dict[str, Any]] = []
        self._files_written = 0

    # ------------------------------------------------------------------ settings

    def settings(self, model: str | None = None) -> dict[str, Any]:
        merged = dict(self._global.settings)
        if model is not None and model in self._models:
            merged.update(self._models[model].settings)
        return {
            "trace_level": list(merged["trace_level"]),
            "trace_rate": str(merged["trace_rate"]),
            "trace_count": str(merged["trace_count"]),
            "log_frequency": str(merged["log_frequency"]),
            "trace_file": self.file,
            "trace_mode": "triton",
        }

    def update(self, model: str | None, body: dict[str, Any]) -> None:
        """Validate every key first, then apply: a bad request changes nothing."""
        changes: dict[str, Any] = {}
        for key, value in body.items():
            if key == "trace_file":
                raise Unsupported("trace file location can not be updated through network protocol")
            if key == "trace_mode":
                if value not in (None, "triton"):
                    raise InvalidArgument(f"trace_mode {value!r} is not supported; only 'triton' is")
                continue
            if key == "trace_level":
                changes[key] = None if value is None else _levels(value)
            elif key in _INT_KEYS:
                changes[key] = None if value is None else _integer(key, value)
            else:
                raise InvalidArgument(f"unknown trace setting '{key}'")
        level = changes.get("trace_level")
        if level and "TIMESTAMPS" in level and not self.file:
            raise InvalidArgument(
                "Attempting to set invalid trace setting :trace file name is not given"
            )
        scope = self._global if model is None else self._models.setdefault(model, _Scope())
        for key, value in changes.items():
            if value is None:  # null: back to the default (global) or the global (model)
                if model is None:
                    scope.settings[key] = _DEFAULTS[key]
                else:
                    scope.settings.pop(key, None)
            else:
                scope.settings[key] = value
            if key in ("trace_rate", "trace_count"):
                scope.seen = 0

    # ------------------------------------------------------------------ tracing

    def start(self, model: str, version: str, request_id: str) -> Trace | None:
        """A new trace when this request is sampled, else None (the cheap common case)."""
        scope = self._models.get(model)
        merged = self._global.settings if scope is None else {**self._global.settings, **scope.settings}
        if "TIMESTAMPS" not in merged["trace_level"] or not self.file:
            return None
        counting = scope if scope is not None and "trace_count" in scope.settings else self._global
        if counting.settings["trace_count"] == 0:
            return None
        sampler = scope if scope is not None and "trace_rate" in scope.settings else self._global
        sampler.seen += 1
        if (sampler.seen - 1) % int(merged["trace_rate"] or 1):
            return None
        if counting.settings["trace_count"] > 0:
            counting.settings["trace_count"] -= 1
        trace = Trace(self._next_id, model, version, request_id)
        self._next_id += 1
        return trace

    def finish(self, trace: Trace, model: str) -> None:
        self._pending.append(trace.to_json())
        frequency = int(self.settings(model)["log_frequency"])
        if frequency > 0 and len(self._pending) >= frequency:
            batch, self._pending = self._pending, []
            path = Path(f"{self.file}.{self._files_written}")
            self._files_written += 1
            # Blocking file I/O off the event loop; a failed write is logged, not raised.
            asyncio.get_running_loop().run_in_executor(None, _write, path, batch)

    def flush(self) -> None:
        if self._pending and self.file:
            _write(Path(self.file), self._pending)
            self._pending = []


def _write(path: Path, traces: list[dict[str, Any]]) -> None:
    # Written beside the target and renamed over it, so a reader (a log shipper, a test polling
    # for the file) sees either no file or the whole JSON document, never a half-written one.
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(json.dumps(traces), encoding="utf-8")
        os.replace(partial, path)
    except OSError as exc:
        log.error("cannot write traces to %s: %s", path, exc)
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def _levels(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"trace_level must be a list of strings, got {value!r}")
    for level in value:
        if level == "TENSORS":
            raise InvalidArgument("trace level TENSORS is not supported; use TIMESTAMPS")
        if level not in _LEVELS:
            raise InvalidArgument(f"unknown trace level {level!r}; expected OFF or TIMESTAMPS")
    levels = [v for v in value if v != "OFF"]
    return levels or ["OFF"]


def _integer(key: str, value: Any) -> int:
    # Triton's settings are JSON strings; a negative rate would wrap around there.
    try:
        number = int(value) if isinstance(value, str) else None
    except ValueError:
        number = None
    if number is None:
        raise InvalidArgument(f"Unable to parse '{key}', got: {value}")
    if number < (-1 if key == "trace_count" else 0):
        raise InvalidArgument(f"'{key}' must be {'>= -1' if key == 'trace_count' else '>= 0'}, got: {value}")
    return number


# ---------------------------------------------------------------------------- HTTP

TRACER = web.AppKey("tracer", TraceManager)


def _model(request: web.Request) -> str | None:
    name = request.match_info.get("model")
    if name is not None and daemon_of(request).registry.entry(name) is None:
        raise InvalidArgument(f"Request for unknown model : {name}")
    return name


async def get_settings(request: web.Request) -> web.Response:
    return web.json_response(request.app[TRACER].settings(_model(request)))


async def update_settings(request: web.Request) -> web.Response:
    model = _model(request)
    raw = await read_body(request, daemon_of(request).config.server.max_request_bytes)
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError):
        raise InvalidArgument("malformed trace settings: the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise InvalidArgument("malformed trace settings: the body must be a JSON object")
    tracer = request.app[TRACER]
    tracer.update(model, body)
    return web.json_response(tracer.settings(model))


def add_routes(app: web.Application, trace_file: str) -> None:
    app[TRACER] = TraceManager(trace_file)

    async def flush_at_exit(app: web.Application) -> AsyncIterator[None]:
        yield
        app[TRACER].flush()

    app.cleanup_ctx.append(flush_at_exit)
    for path in ("/v2/trace/setting", "/v2/models/{model}/trace/setting"):
        app.router.add_get(path, get_settings)
        app.router.add_post(path, update_settings)
