"""A model repository on disk: Triton's layout, config files, version directories, changes.

Layout (Triton's): `<repo>/<model>/config.pbtxt` (or our native `model.toml`) and
`<repo>/<model>/<version>/<artifact>`. Everything here reads files: call it on a worker thread.
Protobuf (for config.pbtxt) is imported only when a repository has such a file.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from pathlib import Path
from typing import Final

import msgspec

from daemon.errors import ConfigError, InvalidArgument, NotFound
from daemon.model_config import ModelConfig, VersionPolicy, config_from_mapping

PBTXT: Final = "config.pbtxt"
TOML: Final = "model.toml"
CONFIG_FILES: Final = (PBTXT, TOML)


# ---------------------------------------------------------------------------------------------
# model.toml
# ---------------------------------------------------------------------------------------------


def parse_model_toml(text: str, *, source: str) -> ModelConfig:
    """Native config: ModelConfig's own field names; unknown keys are errors (with their path)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except RecursionError:  # tomllib recurses once per nested array or table
        raise ConfigError(f"{source}: nested too deeply to be read") from None
    # TOML table keys are always strings; priority levels are integers.
    batching = data.get("dynamic_batching")
    if isinstance(batching, dict) and isinstance(batching.get("priority_queue_policy"), dict):
        batching["priority_queue_policy"] = {
            _int_key(k, source): v for k, v in batching["priority_queue_policy"].items()
        }
    return config_from_mapping(data, source=source)


def _int_key(key: str, source: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise ConfigError(
            f"{source}: dynamic_batching.priority_queue_policy key {key!r} is not an integer"
        ) from None


# ---------------------------------------------------------------------------------------------
# Repository layout
# ---------------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_model_config(model_dir: Path) -> tuple[ModelConfig, list[str]]:
    """The model's config (config.pbtxt, else model.toml, else a minimal one) and warnings.

    The name defaults to the directory name; an explicit name that differs is an error, as in
    Triton (the directory name is what clients address).
    """
    if not model_dir.is_dir():
        raise NotFound(f"model directory {model_dir} does not exist")
    pbtxt, toml = model_dir / PBTXT, model_dir / TOML
    warnings: list[str] = []
    if pbtxt.is_file() and toml.is_file():
        raise ConfigError(f"{model_dir}: both {PBTXT} and {TOML} exist; keep only one")
    if pbtxt.is_file():
        source = str(pbtxt)
        from daemon.core.triton_config import parse_pbtxt

        config, warnings = parse_pbtxt(_read_text(pbtxt), source=source)
    elif toml.is_file():
        source = str(toml)
        config = parse_model_toml(_read_text(toml), source=source)
    else:
        source = str(model_dir)
        config = ModelConfig()
    if not config.name:
        config = msgspec.structs.replace(config, name=model_dir.name)
    elif config.name != model_dir.name:
        raise ConfigError(
            f"{source}: model name {config.name!r} does not match its directory {model_dir.name!r}"
        )
    return config, warnings


def list_versions(model_dir: Path) -> list[int]:
    """Numeric version subdirectories, ascending. Like Triton, names starting with "0" are
    ignored (so "0" and "007" are not versions)."""
    try:
        entries = list(model_dir.iterdir())
    except OSError:
        return []
    return sorted(
        int(e.name)
        for e in entries
        if e.name.isascii() and e.name.isdigit() and e.name[0] != "0" and e.is_dir()
    )


def select_versions(available: list[int], policy: VersionPolicy, *, model: str = "") -> list[int]:
    """The versions to serve under `policy`, ascending. Missing specific versions are errors."""
    present = sorted(set(available))
    if policy.kind == "all":
        return present
    if policy.kind == "latest":
        if policy.num_versions == 0:
            # Triton's text: it serves no version under `latest { num_versions: 0 }` or `latest {}`.
            raise ConfigError(f"at least one version must be available under the version policy of model {model!r}")
        return present[max(len(present) - policy.num_versions, 0) :]
    wanted = sorted(set(policy.versions))
    missing = [v for v in wanted if v not in present]
    if missing:
        who = f"model {model!r}" if model else "model"
        raise ConfigError(
            f"{who}: version_policy specific version(s) {missing} not found (available: {present})"
        )
    return wanted


def check_model_name(name: str) -> None:
    """A model name must be one directory's name: it names the model's directories under the
    state directory (uploads, a backend's state), so "..", "a/b" or an absolute name would
    write outside it. At most 240 bytes, so that an upload's directory ("<name>-" and 8
    random characters) stays within a file name's 255."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise InvalidArgument(f"model name {name!r} is not a directory name (no '/', NUL, '.' or '..')")
    if len(name.encode("utf-8", "surrogateescape")) > 240:
        raise InvalidArgument(f"model name {name[:40]!r}... is longer than 240 bytes")


def scan_repository(repo: Path) -> dict[str, Path]:
    """Model name -> directory for every non-hidden subdirectory holding a config file or a
    numeric version directory. Sorted by name."""
    try:
        entries = sorted(repo.iterdir())
    except OSError as exc:
        raise ConfigError(f"model repository {repo}: {exc.strerror or exc}") from None
    models: dict[str, Path] = {}
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        if any((entry / name).is_file() for name in CONFIG_FILES) or list_versions(entry):
            models[entry.name] = entry
    return models


def fingerprint(model_dir: Path) -> str:
    """A digest of every path, mtime_ns and size under `model_dir`, for poll-mode change
    detection (cheap: stat only, no reads). Symlinks are followed, since repositories often
    link artifacts from elsewhere; a directory reached twice is walked once. `__pycache__`
    is left out: the bytecode Python writes when it imports a python model's code is no
    change of the model (counted, it made every first load look torn, see registry.load)."""
    digest = hashlib.blake2b(digest_size=16)
    visited: set[tuple[int, int]] = set()
    for root, dirs, files in os.walk(model_dir, followlinks=True):
        try:
            st = os.stat(root)
        except OSError:
            dirs.clear()
            continue
        if (st.st_dev, st.st_ino) in visited:
            dirs.clear()
            continue
        visited.add((st.st_dev, st.st_ino))
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.fsencode(os.path.relpath(root, model_dir))
        # Directory names count too: a new, still-empty version directory is a change.
        digest.update(b"d\0%s\0" % rel)
        for name in sorted(files):
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                # Vanished mid-walk (or a dangling link): its absence is the change.
                continue
            digest.update(
                b"f\0%s/%s\0%d\0%d\0" % (rel, os.fsencode(name), st.st_mtime_ns, st.st_size)
            )
    return digest.hexdigest()
