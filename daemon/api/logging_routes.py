"""Triton's logging extension: `GET /v2/logging` reads the daemon's log settings, `POST` changes
them at run time (only the fields given; `null` leaves a field as it is, as in Triton).

Settings: log_info, log_warning, log_error (each severity on or off), log_verbose_level (edged
logs DEBUG when it is >= 1), log_format ("default", "ISO8601", or our "json"), log_file
(read-only: "" = stderr, i.e. the journal under systemd).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from aiohttp import web

from daemon.api.body import read_body
from daemon.api.state import daemon_of
from daemon.errors import InvalidArgument, Unsupported
from daemon.logs import LOG_FORMATS, LogSwitches, log_switches

_json = msgspec.json.Encoder()


class _LogSettings(msgspec.Struct, forbid_unknown_fields=True):
    log_file: str | None = None
    log_info: bool | None = None
    log_warning: bool | None = None
    log_error: bool | None = None
    log_verbose_level: Annotated[int, msgspec.Meta(ge=0)] | None = None
    log_format: str | None = None


def _settings(switches: LogSwitches) -> dict[str, object]:
    return {
        "log_file": "",
        "log_info": switches.info,
        "log_warning": switches.warning,
        "log_error": switches.error,
        "log_verbose_level": switches.verbose,
        "log_format": switches.format,
    }


async def get_logging(request: web.Request) -> web.Response:
    return web.Response(body=_json.encode(_settings(log_switches())), content_type="application/json")


async def post_logging(request: web.Request) -> web.Response:
    body = await read_body(request, daemon_of(request).config.server.max_request_bytes)
    try:
        update = msgspec.json.decode(body, type=_LogSettings) if body.strip() else _LogSettings()
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed log setting request: {exc}") from None
    # Check everything before changing anything: a rejected request changes no setting.
    if update.log_file is not None:
        raise Unsupported("log file location can not be updated through network protocol")
    if update.log_format is not None and update.log_format not in LOG_FORMATS:
        raise InvalidArgument(
            f"invalid argument for --log_format, got: {update.log_format}; expected one of "
            f"{', '.join(LOG_FORMATS)}"
        )
    switches = log_switches()
    if update.log_info is not None:
        switches.info = update.log_info
    if update.log_warning is not None:
        switches.warning = update.log_warning
    if update.log_error is not None:
        switches.error = update.log_error
    if update.log_verbose_level is not None:
        switches.verbose = update.log_verbose_level
    if update.log_format is not None:
        switches.format = update.log_format
    switches.apply()
    return web.Response(body=_json.encode(_settings(switches)), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v2/logging", get_logging)
    app.router.add_post("/v2/logging", post_logging)
