"""Structured logging: `key=value` text for terminals and journald, or one JSON object a line."""

from __future__ import annotations

import logging
import sys
import time

import msgspec

_encode = msgspec.json.Encoder().encode


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return _encode(entry).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} level={record.levelname.lower()} logger={record.name} msg={record.getMessage()!r}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class Iso8601Formatter(TextFormatter):
    """The text format with a full ISO 8601 UTC timestamp (microseconds, `Z`), as Triton's
    `--log-format ISO8601` asks for."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        seconds = int(record.created)
        micros = int((record.created - seconds) * 1_000_000)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{micros:06d}Z"
        return stamp + line[line.index(" "):]


# Triton's log format names, plus our JSON lines.
LOG_FORMATS = {"default": TextFormatter, "ISO8601": Iso8601Formatter, "json": JsonFormatter}


class Throttled:
    """At most one line per `interval` seconds for each kind of repeated event (e.g. an HTTP
    status answered by the server's fault); the next line says how many were held back, so a
    client retrying in a loop cannot fill the journal."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self.logger = logger
        self.interval = interval
        self._seen: dict[object, tuple[float, int]] = {}

    def warning(self, kind: object, message: str, *args: object) -> None:
        now = time.monotonic()
        last, held = self._seen.get(kind, (-self.interval, 0))
        if now - last < self.interval:
            self._seen[kind] = (last, held + 1)
            return
        if held:
            message += f" ({held} more like it held back in the last {self.interval:.0f} s)"
        self._seen[kind] = (now, 0)
        self.logger.warning(message, *args)


class LogSwitches(logging.Filter):
    """Triton's run-time log settings on the daemon's handlers: each severity on or off, a
    verbose level (edged has one verbose level, DEBUG: any level >= 1 enables it) and a format."""

    def __init__(self, level: str = "info", fmt: str = "default") -> None:
        super().__init__()
        rank = ("debug", "info", "warning", "error").index(level.lower())
        self.verbose = 1 if rank == 0 else 0
        self.info = rank <= 1
        self.warning = rank <= 2
        self.error = True
        self.format = "default" if fmt == "text" else fmt

    def filter(self, record: logging.LogRecord) -> bool:
        level = record.levelno
        if level >= logging.ERROR:
            return self.error
        if level >= logging.WARNING:
            return self.warning
        if level >= logging.INFO:
            return self.info
        return self.verbose > 0

    def root_level(self) -> int:
        """The lowest severity any switch lets through (records below it are never built)."""
        for enabled, level in ((self.verbose > 0, logging.DEBUG), (self.info, logging.INFO),
                               (self.warning, logging.WARNING)):
            if enabled:
                return level
        return logging.ERROR

    def apply(self) -> None:
        """Make the root logger and every handler carrying these switches follow them."""
        root = logging.getLogger()
        for handler in root.handlers:
            if self in handler.filters:
                handler.setFormatter(LOG_FORMATS[self.format]())
        root.setLevel(self.root_level())


def log_switches() -> LogSwitches:
    """The switches on the root logger's handlers (installed by `setup_logging`; attached to
    whatever handlers there are when the daemon runs embedded, e.g. in tests)."""
    root = logging.getLogger()
    for handler in root.handlers:
        for item in handler.filters:
            if isinstance(item, LogSwitches):
                return item
    switches = LogSwitches(logging.getLevelName(root.getEffectiveLevel()).lower()
                           if root.getEffectiveLevel() in (10, 20, 30, 40) else "info")
    for handler in root.handlers:
        handler.addFilter(switches)
    return switches


class ClientFaults(logging.Filter):
    """aiohttp logs what a client did wrong as a server error with a traceback: a request its
    parser refuses (it has answered 400 already) or a client gone while a response was being
    written. On a daemon any client can reach, that lets a client fill the log; such records
    become one DEBUG line. aiohttp is not imported here (it loads after the daemon is ready):
    its HTTP errors are told by module and status code."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        client_fault = isinstance(exc, ConnectionResetError) or (
            type(exc).__module__.startswith("aiohttp") and 400 <= getattr(exc, "code", 0) < 500
        )
        if client_fault:
            reason = " ".join(str(exc).split())
            record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {reason}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    switches = LogSwitches(level, fmt)
    handler.addFilter(switches)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    switches.apply()
    # aiohttp's access log per request is noise on an edge box; errors still come through.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(item, ClientFaults) for item in server.filters):
        server.addFilter(ClientFaults())
