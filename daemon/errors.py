"""The daemon's error hierarchy.

Every layer raises these; the transport maps them to HTTP status codes in exactly one
place (`daemon.api.errors`). Messages are user-facing: they name the field, model or plugin.
"""

from __future__ import annotations


class EdgedError(Exception):
    """Base class. `status` is the HTTP status the transport answers with."""

    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(EdgedError):
    """The request is malformed: bad JSON, wrong dtype/shape, unknown field."""

    status = 400


class NotFound(EdgedError):
    """Unknown model, version, backend or route."""

    status = 404


class PayloadTooLarge(EdgedError):
    status = 413


class Unsupported(EdgedError):
    """The operation exists in the protocol but this model/backend cannot do it."""

    status = 501


class Unavailable(EdgedError):
    """Temporarily unable to serve: queue full, model not ready, shutting down."""

    status = 503


class InsufficientMemory(EdgedError):
    """A model cannot be loaded within the daemon's memory budget, even after evicting idle
    models (507 Insufficient Storage: the request may succeed once other models go idle)."""

    status = 507


class QueueTimeout(EdgedError):
    """The request waited in the queue longer than its timeout. Triton's core reports this
    as UNAVAILABLE, which its HTTP frontend answers with 503."""

    status = 503


class Conflict(EdgedError):
    """The operation is not allowed in the current mode (e.g. explicit load while polling)."""

    status = 400


class BackendError(EdgedError):
    """A backend failed while loading or executing; the message names the backend and model."""

    status = 500


class PluginError(EdgedError):
    """A plugin could not be discovered, imported or validated."""

    status = 500


class ConfigError(EdgedError):
    """A daemon or model configuration is invalid; the message names the key and file."""

    status = 400
