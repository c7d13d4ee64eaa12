"""Update errors. They extend the daemon's hierarchy, so the transport maps `.status` as usual."""

from __future__ import annotations

from daemon.errors import EdgedError


class UpdateError(EdgedError):
    """The bundle is unusable: unreadable, unsigned, tampered with, or malformed."""

    status = 400


class UpdateConflict(UpdateError):
    """The bundle is valid but cannot be applied now: an old or replayed sequence, a daemon
    version it does not target, another update in progress, nothing to roll back to."""

    status = 409


class HealthCheckFailed(UpdateError):
    """The new release was switched to, failed its health check, and was switched back."""

    status = 422


class StoreBusy(UpdateConflict):
    """Another update holds the release store's lock; trying again later may work."""


class PendingRelease(UpdateConflict):
    """A two-phase update waits for commit or rollback; another apply must wait for that."""
