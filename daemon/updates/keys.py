"""Ed25519 signing keys: generation, loading, and checking a signature against trusted keys.

Keys are PEM files: the private key PKCS#8 (mode 0600, kept off the devices), public keys
SubjectPublicKeyInfo. A device trusts every `*.pub` / `*.pem` public key in its keys directory,
so a key can be rotated by shipping the new public key before signing with it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from daemon.updates.errors import UpdateError

TRUSTED_KEY_SUFFIXES = (".pub", ".pem")


def fingerprint(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


def _write_new(path: Path, data: bytes, mode: int) -> None:
    # O_EXCL: never overwrite a key, which would silently orphan every bundle signed with it.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except FileExistsError:
        raise UpdateError(f"{path} already exists; refusing to overwrite a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def keygen(private_path: Path, public_path: Path) -> str:
    """Write a new Ed25519 key pair; returns the public key's fingerprint."""
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new(Path(private_path), private_pem, 0o600)
    _write_new(Path(public_path), public_pem, 0o644)
    return fingerprint(key.public_key())


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise UpdateError(f"cannot load private key {path}: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UpdateError(f"private key {path} is not an Ed25519 key")
    return key


def load_trusted_keys(keys_dir: Path) -> list[tuple[str, Ed25519PublicKey]]:
    """(file name, key) for every public key file in `keys_dir`.

    A file that is there but is not an Ed25519 public key is an error, not skipped: a trust
    store that silently ignores what an operator put in it hides mistakes (e.g. a private key).
    """
    keys_dir = Path(keys_dir)
    try:
        candidates = sorted(p for p in keys_dir.iterdir() if p.suffix in TRUSTED_KEY_SUFFIXES)
    except OSError as exc:
        raise UpdateError(f"cannot read trusted keys directory {keys_dir}: {exc.strerror}") from None
    keys: list[tuple[str, Ed25519PublicKey]] = []
    for path in candidates:
        try:
            key = serialization.load_pem_public_key(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise UpdateError(f"trusted key {path} is not a PEM public key: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise UpdateError(f"trusted key {path} is not an Ed25519 key")
        keys.append((path.name, key))
    if not keys:
        raise UpdateError(f"no trusted keys (*.pub, *.pem) in {keys_dir}")
    return keys


def check_signature(data: bytes, signature: bytes, keys: list[tuple[str, Ed25519PublicKey]],
                    keys_dir: Path) -> str:
    """Name of the trusted key that signed `data`; UpdateError if none did."""
    for name, key in keys:
        try:
            key.verify(signature, data)
        except InvalidSignature:
            continue
        return name
    raise UpdateError(f"manifest.sig does not match any of the {len(keys)} trusted key(s) in "
                      f"{keys_dir}: the bundle was not signed by a trusted key or was modified")
