"""Manifest rules: paths, kinds, replaces, versions and daemon targets."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from daemon.updates.errors import UpdateConflict, UpdateError
from daemon.updates.manifest import (
    BundleFile,
    Manifest,
    Replaces,
    check_targets,
    decode_manifest,
    encode_manifest,
    parse_version,
    split_path,
)

SHA = "0" * 64


def _manifest(files: list[BundleFile], replaces: Replaces, targets: list[str] | None = None,
              version: str = "1.0.0") -> Manifest:
    return Manifest(format=1, bundle_version=version, sequence=3,
                    created=datetime(2025, 1, 1, tzinfo=UTC), targets=targets or [],
                    files=files, replaces=replaces)


def test_round_trip() -> None:
    m = _manifest([BundleFile("models/a/1/model.onnx", SHA, 4, "model")], Replaces(models=["a"]))
    assert decode_manifest(encode_manifest(m)) == m
    assert m.release_name == "3-1.0.0"
    assert m.payload_bytes == 4


def test_kind_must_match_directory() -> None:
    with pytest.raises(ValueError, match=r"kind 'plugin', expected 'model'"):
        _manifest([BundleFile("models/a/x", SHA, 1, "plugin")], Replaces(models=["a"]))


def test_shipped_entries_must_be_listed_in_replaces() -> None:
    with pytest.raises(ValueError, match=r"replaces.models must list \['a'\]"):
        _manifest([BundleFile("models/a/x", SHA, 1, "model")], Replaces())
    # Listing without shipping is a removal, and fine.
    m = _manifest([], Replaces(models=["gone"]))
    assert m.replaces.models == ["gone"]


def test_duplicate_and_bad_replaces() -> None:
    f = BundleFile("configs/a.toml", SHA, 1, "config")
    with pytest.raises(ValueError, match=r"listed twice"):
        _manifest([f, f], Replaces(configs=["a.toml"]))
    with pytest.raises(ValueError, match=r"replaces.models"):
        _manifest([], Replaces(models=[".."]))


@pytest.mark.parametrize("path", ["../x", "/models/a", "models/./a", "models/a/../../b",
                                  "models", "other/a"])
def test_split_path_refuses(path: str) -> None:
    with pytest.raises(ValueError):
        split_path(path)


def test_split_path() -> None:
    assert split_path("plugins/onnx/backend.py") == ("plugins", "onnx")


def test_decode_errors_name_the_field() -> None:
    good = msgspec.json.decode(encode_manifest(
        _manifest([BundleFile("models/a/x", SHA, 1, "model")], Replaces(models=["a"]))))
    for key, value, field in [("format", 2, "format"), ("bundle_version", "1/2", "bundle_version"),
                              ("sequence", 0, "sequence"), ("created", "2025-01-01T00:00:00",
                                                            "created")]:
        raw = dict(good, **{key: value})
        with pytest.raises(UpdateError, match=field):
            decode_manifest(msgspec.json.encode(raw))


def test_versions() -> None:
    assert parse_version("0.2") == parse_version("0.2.0") == (0, 2)
    assert parse_version("0.10.0") > parse_version("0.9.9")
    assert parse_version("1.2.3rc1") == (1, 2, 3)


def test_targets() -> None:
    m = _manifest([], Replaces(), targets=[">=0.1", "<0.3"])
    for ok in ("0.1.0", "0.2.9", "0.1"):
        check_targets(m, ok)
    for bad in ("0.0.9", "0.3.0", "1.0"):
        with pytest.raises(UpdateConflict, match=f"targets daemon >=0.1, <0.3; this daemon is {bad}"):
            check_targets(m, bad)
    check_targets(_manifest([], Replaces()), "9.9.9")  # no targets: any daemon
    with pytest.raises(ValueError, match=r"not OP VERSION"):
        _manifest([], Replaces(), targets=["~=1.0"])
