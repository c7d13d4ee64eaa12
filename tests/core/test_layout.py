"""The repository's files read by daemon.core.layout: what a bad one gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.core.layout import check_model_name, read_model_config
from daemon.errors import ConfigError, InvalidArgument


def test_a_model_toml_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    # tomllib recurses once per level: this was a RecursionError, which ended a start.
    (model / "model.toml").write_text("x = " + "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"m/model\.toml: nested too deeply to be read"):
        read_model_config(model)


def test_model_names_are_single_directory_names() -> None:
    for name in ("simple", "a.b", "??", "x" * 240, "é" * 120):
        check_model_name(name)
    for name in ("", ".", "..", "a/b", "/abs", "a\0b"):
        with pytest.raises(InvalidArgument, match="is not a directory name"):
            check_model_name(name)
    with pytest.raises(InvalidArgument, match="longer than 240 bytes"):
        check_model_name("é" * 121)
