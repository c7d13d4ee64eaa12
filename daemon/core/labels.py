"""Classification labels: an output's `label_filename`, one label a line, in the model directory.

Read on first use and kept while the file's size and mtime stay the same, so a classification
request costs one stat, not a file read.
"""

from __future__ import annotations

import os
from pathlib import Path

from daemon.errors import ConfigError, EdgedError
from daemon.model_config import ModelConfig


def check_files(model_dir: Path, config: ModelConfig) -> None:
    """Every output's label file is there, as Triton reads them when it loads the model (its
    text); requests read them again (LabelCache), so an edited file is served without a reload.
    Blocks (file checks): call it off the loop."""
    for tensor in config.output:
        if not tensor.label_filename:
            continue
        if not _plain(tensor.label_filename):
            raise ConfigError(f"output {tensor.name!r}: label_filename {tensor.label_filename!r} must name a file in "
                              "the model directory")
        path = model_dir / tensor.label_filename
        try:
            with path.open("rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"failed to open text file for read {path}: {exc.strerror}") from None


class LabelCache:
    def __init__(self) -> None:
        self._files: dict[Path, tuple[int, int, list[str]]] = {}

    def for_outputs(
        self, model_dir: Path | None, config: ModelConfig, outputs: list[str]
    ) -> dict[str, list[str]]:
        """Labels of each named output that declares a `label_filename`."""
        labels: dict[str, list[str]] = {}
        if model_dir is None:
            return labels
        for name in outputs:
            tensor = config.output_by_name(name)
            if tensor is not None and tensor.label_filename:
                labels[name] = self.read(model_dir, tensor.label_filename, name)
        return labels

    def read(self, model_dir: Path, filename: str, output: str) -> list[str]:
        if not _plain(filename):
            raise EdgedError(
                f"output {output!r}: label_filename {filename!r} must name a file in the model directory"
            )
        path = model_dir / filename
        try:
            info = os.stat(path)
            cached = self._files.get(path)
            if cached is not None and cached[:2] == (info.st_mtime_ns, info.st_size):
                return cached[2]
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            # The model's configuration is at fault, not the request: a 500.
            raise EdgedError(
                f"output {output!r}: cannot read label file {filename!r}: {exc}"
            ) from None
        self._files[path] = (info.st_mtime_ns, info.st_size, lines)
        return lines


def _plain(filename: str) -> bool:
    """A label file is a plain name in the model directory, never a path out of it."""
    return "/" not in filename and "\\" not in filename and filename not in (".", "..")
