"""The bundle manifest: what a bundle ships, for which daemon versions, and what it replaces."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal

import msgspec

from daemon.updates.errors import UpdateConflict, UpdateError

FORMAT_VERSION: Literal[1] = 1
CATEGORIES = ("models", "configs", "plugins")
Kind = Literal["model", "config", "plugin"]
KIND_OF_CATEGORY: dict[str, Kind] = {"models": "model", "configs": "config", "plugins": "plugin"}

# Semver-ish: dotted numbers and an optional -pre/+build tail. It becomes part of a directory
# name (`<sequence>-<version>`), so no '/' or other surprises can get in.
VERSION_PATTERN = r"^[0-9]+(\.[0-9]+)*([-+][0-9A-Za-z.+-]+)?$"
_SPECIFIER = re.compile(r"^(>=|<=|==|!=|>|<)\s*([0-9]+(?:\.[0-9]+)*)$")


class BundleFile(msgspec.Struct, forbid_unknown_fields=True):
    # Relative POSIX path under models/, configs/ or plugins/.
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    sha256: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    size: Annotated[int, msgspec.Meta(ge=0)]
    kind: Kind


class Replaces(msgspec.Struct, forbid_unknown_fields=True):
    """Top-level entries (a model directory, a config file, a plugin directory) of the live
    release that the new release drops. Every entry the payload ships must be listed: the
    manifest alone says what changes. Listing an entry without shipping it removes it."""

    models: list[str] = []
    configs: list[str] = []
    plugins: list[str] = []

    def of(self, category: str) -> list[str]:
        names: list[str] = getattr(self, category)
        return names


# omit_defaults: `directories` is left out when there are none, so that a daemon from before it
# (which refuses unknown fields) still reads every bundle that needs no empty directory.
class Manifest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    format: Literal[1]
    bundle_version: Annotated[str, msgspec.Meta(pattern=VERSION_PATTERN, max_length=64)]
    # Monotonic per fleet: a store refuses any sequence <= the last one it committed.
    sequence: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    created: Annotated[datetime, msgspec.Meta(tz=True)]
    # Daemon versions this bundle is for, all must hold, e.g. [">=0.1", "<0.3"]. Empty = any.
    targets: list[str]
    files: list[BundleFile]
    replaces: Replaces
    # Empty directories the release holds (an ensemble's version directory has no file). The
    # payload has regular files only; these are made on extraction.
    directories: list[Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]] = []

    def __post_init__(self) -> None:
        for spec in self.targets:
            parse_specifier(spec)
        seen: set[str] = set()
        shipped: dict[str, set[str]] = {c: set() for c in CATEGORIES}
        for entry in self.files:
            category, name = split_path(entry.path)
            if KIND_OF_CATEGORY[category] != entry.kind:
                raise ValueError(f"file {entry.path!r} has kind {entry.kind!r}, expected "
                                 f"{KIND_OF_CATEGORY[category]!r} under {category}/")
            if entry.path in seen:
                raise ValueError(f"file {entry.path!r} is listed twice")
            seen.add(entry.path)
            shipped[category].add(name)
        for directory in self.directories:
            category, name = split_path(directory)
            if directory in seen:
                raise ValueError(f"{directory!r} is listed twice, or as a file and a directory")
            seen.add(directory)
            shipped[category].add(name)
        for category in CATEGORIES:
            listed = self.replaces.of(category)
            for name in listed:
                check_component(name, f"replaces.{category}")
            missing = shipped[category] - set(listed)
            if missing:
                raise ValueError(f"replaces.{category} must list {sorted(missing)}: the payload "
                                 "ships them")

    @property
    def release_name(self) -> str:
        return f"{self.sequence}-{self.bundle_version}"

    @property
    def payload_bytes(self) -> int:
        return sum(f.size for f in self.files)


def check_component(name: str, where: str) -> None:
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"{where}: {name!r} is not a plain file or directory name")


def split_path(path: str) -> tuple[str, str]:
    """(category, top-level entry) of a payload path; ValueError names the path when unsafe."""
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise ValueError(f"unsafe path {path!r}: must be relative, without '.', '..' or '//'")
    if len(parts) < 2 or parts[0] not in CATEGORIES:
        raise ValueError(f"path {path!r} must be under {', '.join(c + '/' for c in CATEGORIES)}")
    return parts[0], parts[1]


_decoder = msgspec.json.Decoder(Manifest)
_encoder = msgspec.json.Encoder()


def decode_manifest(data: bytes) -> Manifest:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise UpdateError(f"manifest.json is invalid: {exc}") from None


def encode_manifest(manifest: Manifest) -> bytes:
    return _encoder.encode(manifest)


def parse_version(text: str) -> tuple[int, ...]:
    """Numeric release part of a version ("0.2.1rc1" -> (0, 2, 1)), trailing zeros dropped so
    that 0.2 == 0.2.0."""
    match = re.match(r"^[0-9]+(?:\.[0-9]+)*", text)
    if not match:
        raise ValueError(f"version {text!r} does not start with a number")
    parts = [int(p) for p in match.group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def parse_specifier(spec: str) -> tuple[str, tuple[int, ...]]:
    match = _SPECIFIER.match(spec.strip())
    if not match:
        raise ValueError(f"target {spec!r} is not OP VERSION with OP one of >= <= == != > <")
    return match.group(1), parse_version(match.group(2))


def check_targets(manifest: Manifest, daemon_version: str) -> None:
    """Raise UpdateConflict unless `daemon_version` satisfies every target specifier."""
    have = parse_version(daemon_version)
    for spec in manifest.targets:
        op, want = parse_specifier(spec)
        ok = {
            ">=": have >= want, "<=": have <= want, "==": have == want,
            "!=": have != want, ">": have > want, "<": have < want,
        }[op]
        if not ok:
            raise UpdateConflict(
                f"bundle {manifest.bundle_version} (sequence {manifest.sequence}) targets daemon "
                f"{', '.join(manifest.targets)}; this daemon is {daemon_version}"
            )
