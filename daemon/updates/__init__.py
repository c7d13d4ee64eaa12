"""Offline signed update bundles and the release store they are applied to.

A bundle (`*.edgebundle`) is one tar file: `manifest.json`, its Ed25519 signature
`manifest.sig`, and `payload/<path>` for every file the manifest lists. Applying one verifies it,
stages a complete release next to the live one, switches the `current` symlink atomically, runs
a health check and commits, or switches back.

Import the submodules themselves: this package imports nothing, so a daemon that never applies
an update never loads `cryptography`.
"""
