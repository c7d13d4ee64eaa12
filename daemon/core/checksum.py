"""Triton's checksum repository agent (`model_repository_agents { agents [{ name: "checksum" }] }`):
before every load, each file a parameter names is hashed and compared with the value it gives;
a file that differs fails the load, so the versions already served stay served.

A parameter is `key: "MD5:<path relative to the model's directory>" value: "<hex digest>"`, as
Triton's agent reads it (triton-inference-server/checksum_repository_agent); its error texts
are Triton's. Files are read in pieces on the loader's worker thread, never on the event loop.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from daemon.errors import ConfigError
from daemon.model_config import ModelConfig

AGENT = "checksum"
_PIECE = 1 << 20


def verify(config: ModelConfig, model_dir: Path) -> None:
    """Check every file the config's checksum agent names; ConfigError at the first that fails.
    An agent edged does not have fails the load (it would run code of Triton's on the files)."""
    if config.model_repository_agents is None:
        return
    folder = model_dir.resolve()
    for agent in config.model_repository_agents.agents:
        if agent.name != AGENT:
            raise ConfigError(
                f"model '{config.name}': repository agent '{agent.name}' is not available; edged has Triton's "
                f"'{AGENT}' agent only"
            )
        for key, expected in agent.parameters.items():
            algorithm, colon, relative = key.partition(":")
            if not colon:
                raise ConfigError(f"failed to parse key: {key}")
            if algorithm.lower() != "md5":
                raise ConfigError(f"Unsupported checksum algorithm: {algorithm}")
            path = (folder / relative).resolve()
            if not path.is_relative_to(folder):
                # Triton reads it; a digest of any file on the box is not a model's to print.
                raise ConfigError(f"model '{config.name}': checksum file {relative!r} is outside the model's directory")
            digest = _md5(path, relative)
            if digest != expected:
                raise ConfigError(f"Mismatched MD5 hash for file {relative}, expect: {expected}, got: {digest}")


def _md5(path: Path, relative: str) -> str:
    # MD5 is what Triton's agent (and the configs written for it) use: a check that the files
    # are the ones published, not a signature (signed update bundles are that).
    digest = hashlib.md5(usedforsecurity=False)
    try:
        with path.open("rb") as file:
            while piece := file.read(_PIECE):
                digest.update(piece)
    except OSError as exc:
        raise ConfigError(f"failed to open text file for read {relative}: {exc.strerror}") from None
    return digest.hexdigest()
