"""Offline signed update bundles and the release store they are applied to.

A bundle (`*.edgebundle`) is one tar file: `manifest.json`, its Ed25519 signature
`manifest.sig`, and `payload/<path>` for every file the manifest lists. Applying one verifies it,
stages a complete release next to the live one, switches the `current` symlink atomically, runs
a health check and commits, or switches back.
"""

from daemon.updates.apply import AppliedUpdate, apply_update
from daemon.updates.bundle import BUNDLE_SUFFIX, create_bundle, verify_bundle
from daemon.updates.errors import HealthCheckFailed, StoreBusy, UpdateConflict, UpdateError
from daemon.updates.inbox import watch_inbox
from daemon.updates.keys import keygen
from daemon.updates.manifest import Manifest
from daemon.updates.store import ReleaseStore, StoreStatus

__all__ = [
    "BUNDLE_SUFFIX",
    "AppliedUpdate",
    "HealthCheckFailed",
    "Manifest",
    "ReleaseStore",
    "StoreBusy",
    "StoreStatus",
    "UpdateConflict",
    "UpdateError",
    "apply_update",
    "create_bundle",
    "keygen",
    "verify_bundle",
    "watch_inbox",
]
