"""The `bundle` and `update` subcommands, run through argparse like `edged` runs them."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from daemon.updates.cli import add_commands
from daemon.updates.errors import UpdateConflict, UpdateError


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="edged")
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return int(args.handler(args))


def test_keygen_create_verify_apply_status_rollback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key, pub = tmp_path / "fleet.key", tmp_path / "keys" / "fleet.pub"
    pub.parent.mkdir()
    assert _run("bundle", "keygen", "--private", str(key), "--public", str(pub)) == 0
    assert "ed25519:" in capsys.readouterr().out

    bundles = []
    for seq in (1, 2):
        src = tmp_path / f"src{seq}" / "models" / "m" / "1"
        src.mkdir(parents=True)
        (src / "model.onnx").write_bytes(f"weights {seq}".encode())
        out = tmp_path / f"r{seq}.edgebundle"
        assert _run("bundle", "create", str(tmp_path / f"src{seq}"), "--out", str(out),
                    "--key", str(key), "--sequence", str(seq), "--version", f"1.{seq}.0",
                    "--target", ">=0.1") == 0
        bundles.append(out)
    assert "sequence 2, 1 files" in capsys.readouterr().out

    assert _run("bundle", "verify", str(bundles[0]), "--keys", str(pub.parent)) == 0
    out = capsys.readouterr().out
    assert "OK, bundle 1.1.0, sequence 1" in out and "models: m" in out
    assert _run("bundle", "verify", str(bundles[0]), "--keys", str(pub.parent), "--json") == 0
    assert json.loads(capsys.readouterr().out)["sequence"] == 1

    root = tmp_path / "store"
    for bundle in bundles:
        assert _run("update", "apply", str(bundle), "--root", str(root),
                    "--keys", str(pub.parent), "--socket", str(tmp_path / "no.sock")) == 0
    out = capsys.readouterr().out
    assert "offline, no health check" in out
    assert "current -> 2-1.2.0" in out

    assert _run("update", "status", "--root", str(root), "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["current"], status["rollback_to"], status["last_sequence"]) == (
        "2-1.2.0", "1-1.1.0", 2)

    assert _run("update", "rollback", "--root", str(root), "--offline") == 0
    assert "current -> 1-1.1.0" in capsys.readouterr().out
    assert (root / "current" / "models" / "m" / "1" / "model.onnx").read_bytes() == b"weights 1"
    assert _run("update", "status", "--root", str(root)) == 0
    assert "current:       1-1.1.0" in capsys.readouterr().out

    with pytest.raises(UpdateConflict, match=r"no earlier release"):
        _run("update", "rollback", "--root", str(root), "--offline")
    with pytest.raises(UpdateConflict, match=r"sequence 2, not newer"):
        _run("update", "apply", str(bundles[1]), "--root", str(root), "--keys", str(pub.parent),
             "--offline")


def test_verify_reports_a_bad_bundle(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    _run("bundle", "keygen", "--private", str(tmp_path / "k"), "--public", str(keys / "k.pub"))
    bad = tmp_path / "bad.edgebundle"
    bad.write_bytes(b"\0" * 10)
    with pytest.raises(UpdateError, match=r"not a readable tar"):
        _run("bundle", "verify", str(bad), "--keys", str(keys))


def test_subcommand_is_required() -> None:
    with pytest.raises(SystemExit):
        _run("update")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a directory as someone else")
def test_root_refuses_a_store_owned_by_the_daemon_user(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    os.chown(root, 4242, 4242)
    with pytest.raises(UpdateError, match="belongs to uid 4242"):
        _run("update", "rollback", "--root", str(root))
