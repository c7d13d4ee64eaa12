"""Triton's checksum repository agent: files hashed before each load, Triton's texts on failure;
over a real daemon, a model whose file changed does not load and the version served stays."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from daemon.core.checksum import verify
from daemon.errors import ConfigError
from daemon.model_config import ModelConfig, RepositoryAgent, RepositoryAgents
from support import python_model


def _config(parameters: dict[str, str], name: str = "checksum") -> ModelConfig:
    return ModelConfig(name="m", model_repository_agents=RepositoryAgents([RepositoryAgent(name, parameters)]))


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_every_named_file_is_checked(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    weights = tmp_path / "1" / "weights.bin"
    # Larger than one read, so a digest of the first piece only would differ.
    weights.write_bytes(bytes(range(256)) * 9000)
    (tmp_path / "labels.txt").write_text("a\nb\n")
    good = {"MD5:1/weights.bin": _md5(weights), "md5:labels.txt": _md5(tmp_path / "labels.txt")}
    verify(_config(good), tmp_path)
    verify(ModelConfig(name="m"), tmp_path)  # no agents: nothing to read
    wrong = "0" * 32
    cases = [
        ({"MD5:1/weights.bin": wrong},
         f"Mismatched MD5 hash for file 1/weights.bin, expect: {wrong}, got: {_md5(weights)}"),
        # Triton compares the text as written: an upper-case digest does not match.
        ({"MD5:labels.txt": _md5(tmp_path / "labels.txt").upper()}, "Mismatched MD5 hash for file labels.txt"),
        ({"MD5:1/missing.bin": wrong}, "failed to open text file for read 1/missing.bin: No such file or directory"),
        ({"weights.bin": wrong}, "failed to parse key: weights.bin"),
        ({"SHA256:labels.txt": wrong}, "Unsupported checksum algorithm: SHA256"),
        ({"MD5:../outside": wrong}, "model 'm': checksum file '../outside' is outside the model's directory"),
    ]
    for parameters, error in cases:
        with pytest.raises(ConfigError, match=error.replace("(", r"\(")):
            verify(_config({**good, **parameters}), tmp_path)
    with pytest.raises(ConfigError, match="repository agent 'relocation' is not available; edged has Triton's "
                                          "'checksum' agent only"):
        verify(_config({}, name="relocation"), tmp_path)


def test_a_changed_file_fails_the_load_and_the_served_version_stays(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    folder = python_model(repo, "m", "y = x * 2")
    model_file = folder / "1" / "model.py"
    config = (folder / "config.pbtxt").read_text()
    (folder / "config.pbtxt").write_text(
        config + 'model_repository_agents { agents [ { name: "checksum" parameters { key: "MD5:1/model.py" '
        f'value: "{_md5(model_file)}" }} }} ] }}\n'
    )
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "m")
    body = json.dumps({"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [1, 2]}]})
    reply = daemon.request("POST", "/v2/models/m/infer", body, {"Content-Type": "application/json"})
    assert reply.status == 200 and reply.json()["outputs"][0]["data"] == [2, 4]
    served = daemon.request("GET", "/v2/models/m/config").json()
    assert served["model_repository_agents"] == {"agents": [{"name": "checksum", "parameters": {
        "MD5:1/model.py": _md5(model_file)}}]}
    expected = _md5(model_file)
    model_file.write_text(model_file.read_text().replace("x * 2", "x * 3"))
    reply = daemon.request("POST", "/v2/repository/models/m/load", "{}")
    assert reply.status == 400
    assert (f"Mismatched MD5 hash for file 1/model.py, expect: {expected}, got: {_md5(model_file)}"
            in reply.json()["error"])
    reply = daemon.request("POST", "/v2/models/m/infer", body, {"Content-Type": "application/json"})
    assert reply.status == 200 and reply.json()["outputs"][0]["data"] == [2, 4]
