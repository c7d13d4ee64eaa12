"""Offline updates through the running daemon: signed bundles over the Unix socket and from a
watched inbox, health check with automatic rollback, replay refusal, manual rollback, restart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from daemon.updates.bundle import create_bundle
from daemon.updates.keys import keygen
from support import python_model, wait_until


def _x() -> str:
    return json.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]})


def _bundle(tmp: Path, key: Path, name: str, sequence: int, body: str) -> Path:
    src = tmp / f"src-{name}"
    python_model(src / "models", "m", body)
    out = tmp / f"{name}.edgebundle"
    create_bundle(src, out, key, sequence, name)
    return out


def _setup(tmp_path: Path, inbox: Path | None = None) -> tuple[Path, Path]:
    keys = tmp_path / "keys"
    keys.mkdir()
    private = tmp_path / "signing.key"
    keygen(private, keys / "fleet.pub")
    base = tmp_path / "base-repo"
    base.mkdir()
    config = tmp_path / "edged.toml"
    config.write_text(
        f'[models]\nrepository = ["{base}"]\n'
        f'[updates]\nroot = "{tmp_path / "store"}"\nkeys = "{keys}"\n'
        + (f'inbox = "{inbox}"\ninbox-poll-secs = 0.3\n' if inbox else "")
    )
    return config, private


def _value(daemon) -> float:
    reply = daemon.post_json("/v2/models/m/infer", json.loads(_x()))
    assert reply.status == 200, reply.body
    return float(reply.json()["outputs"][0]["data"][0])


def _post(daemon, bundle: Path):
    return daemon.request("POST", "/v1/updates", bundle.read_bytes(), {"Content-Type": "application/octet-stream"})


def test_update_lifecycle_over_the_socket(start_daemon, tmp_path: Path) -> None:
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))
    # Triton answers ready for an unknown model with 400 "Model version not ready".
    assert daemon.request("GET", "/v2/models/m/ready").status == 400

    reply = _post(daemon, _bundle(tmp_path, key, "1.0.0", 1, "y = x + 1"))
    assert reply.status == 200, reply.body
    assert reply.json()["applied"]["sequence"] == 1 and reply.json()["applied"]["health_checked"]
    assert _value(daemon) == 2.0

    assert _post(daemon, _bundle(tmp_path, key, "1.1.0", 2, "y = x + 100")).status == 200
    assert _value(daemon) == 101.0

    broken = _bundle(tmp_path, key, "1.2.0", 3, "raise RuntimeError('corrupt weights')\ny = x")
    reply = _post(daemon, broken)
    assert reply.status == 422, reply.body
    assert "health check" in reply.json()["error"] and "corrupt weights" in reply.json()["error"]
    assert _value(daemon) == 101.0  # the old release is serving again
    status = daemon.request("GET", "/v1/updates").json()
    assert status["current"].startswith("2-") and status["last_sequence"] == 2

    replay = _post(daemon, _bundle(tmp_path, key, "1.1.0-again", 2, "y = x"))
    assert replay.status == 409 and "sequence 2" in replay.json()["error"]

    tampered = tmp_path / "tampered.edgebundle"
    data = bytearray(_bundle(tmp_path, key, "1.3.0", 4, "y = x + 7").read_bytes())
    index = data.find(b"x + 7")
    data[index + 4] = ord("8")
    tampered.write_bytes(bytes(data))
    bad = _post(daemon, tampered)
    assert bad.status == 400, bad.body
    assert _value(daemon) == 101.0

    other_key = tmp_path / "other.key"
    keygen(other_key, tmp_path / "other.pub")
    foreign = _post(daemon, _bundle(tmp_path, other_key, "9.9.9", 9, "y = x"))
    assert foreign.status == 400 and "not signed by a trusted key" in foreign.json()["error"]

    assert daemon.request("POST", "/v1/updates/rollback").status == 200
    assert _value(daemon) == 2.0

    # A restart serves the committed release.
    assert daemon.stop() == 0
    again = start_daemon("--config", str(config))
    assert _value(again) == 2.0


def test_inbox_applies_bundles_dropped_in(start_daemon, tmp_path: Path) -> None:
    inbox = tmp_path / "usb"
    inbox.mkdir()
    config, key = _setup(tmp_path, inbox)
    daemon = start_daemon("--config", str(config))
    bundle = _bundle(tmp_path, key, "2.0.0", 5, "y = x * 10")
    shutil.copy(bundle, inbox / bundle.name)
    wait_until(lambda: daemon.request("GET", "/v2/models/m/ready").status == 200, timeout=60)
    assert _value(daemon) == 10.0
