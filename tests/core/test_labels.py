"""Classification label files (daemon.core.labels): checked at load as Triton reads them, read
again by requests so that an edited file is served without a reload."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.core.labels import LabelCache, check_files
from daemon.errors import ConfigError
from daemon.model_config import ModelConfig, TensorConfig


def _config(filename: str) -> ModelConfig:
    return ModelConfig(name="m", output=[TensorConfig(name="y", data_type="FP32", dims=[3], label_filename=filename)])


def test_a_missing_label_file_fails_the_load_with_tritons_text(tmp_path: Path) -> None:
    # Triton 2.51 refuses such a load (measured); edged served it, and every classification
    # request then failed.
    with pytest.raises(ConfigError) as caught:
        check_files(tmp_path, _config("nope.txt"))
    assert caught.value.message == f"failed to open text file for read {tmp_path / 'nope.txt'}: No such file or directory"
    with pytest.raises(ConfigError, match=r"label_filename '\.\./labels\.txt' must name a file in the model directory"):
        check_files(tmp_path, _config("../labels.txt"))
    (tmp_path / "labels.txt").write_text("a\nb\nc\n")
    check_files(tmp_path, _config("labels.txt"))
    cache = LabelCache()
    assert cache.for_outputs(tmp_path, _config("labels.txt"), ["y"]) == {"y": ["a", "b", "c"]}
    (tmp_path / "labels.txt").write_text("x\ny\nz\nw\n")  # edited: read again
    assert cache.for_outputs(tmp_path, _config("labels.txt"), ["y"]) == {"y": ["x", "y", "z", "w"]}
