"""Offline updates through the running daemon: signed bundles over the Unix socket and from a
watched inbox, health check with automatic rollback, replay refusal, manual rollback, restart."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

from daemon.updates.bundle import create_bundle
from daemon.updates.keys import keygen
from support import UnixHTTPConnection, python_model, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


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


def _value(daemon, model: str = "m") -> float:
    reply = daemon.post_json(f"/v2/models/{model}/infer", json.loads(_x()))
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


def test_updates_of_an_on_demand_model_load_it_from_the_new_release(start_daemon, tmp_path: Path) -> None:
    """An on-demand model is loaded by the request that needs it, not by the reload: the
    health check loads it as such a request would (before, every update of a release with
    one failed its check: "did not load from the new release"). One loaded from the previous
    release moves to the new one."""
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))

    def on_demand_bundle(name: str, sequence: int, body: str) -> Path:
        src = tmp_path / f"src-{name}"
        python_model(src / "models", "m", body)
        with (src / "models" / "m" / "config.pbtxt").open("a") as config_file:
            config_file.write('parameters { key: "load" value { string_value: "on-demand" } }\n')
        out = tmp_path / f"{name}.edgebundle"
        create_bundle(src, out, key, sequence, name)
        return out

    reply = _post(daemon, on_demand_bundle("1.0.0", 1, "y = x + 1"))
    assert reply.status == 200, reply.body
    assert _value(daemon) == 2.0  # loaded by this request, or still loaded since the check
    reply = _post(daemon, on_demand_bundle("1.1.0", 2, "y = x + 100"))
    assert reply.status == 200, reply.body
    assert _value(daemon) == 101.0


def _release_of(tmp: Path, key: Path, name: str, sequence: int, bodies: dict[str, str], *, slow: str = "",
                fails: str = "") -> Path:
    """A bundle of python models (name -> body); `slow` takes a second to load, then raises
    if it is also `fails`."""
    src = tmp / f"src-{name}"
    for model, body in bodies.items():
        python_model(src / "models", model, body)
    if slow:
        raising = "    raise RuntimeError('bad weights')\n" if fails == slow else ""
        with (src / "models" / slow / "1" / "model.py").open("a") as code:
            code.write(f"\ndef _load(self, args):\n    import time\n    time.sleep(1.0)\n{raising}"
                       "TritonPythonModel.initialize = _load\n")
    out = tmp / f"{name}.edgebundle"
    create_bundle(src, out, key, sequence, name)
    return out


def _during(daemon, post: Callable[[], object]) -> tuple[object, list[tuple[float, float]]]:
    """Run `post` while a client reads models a then b again and again; the (a, b) pairs read."""
    pairs: list[tuple[float, float]] = []
    failed: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                pairs.append((_value(daemon, "a"), _value(daemon, "b")))
        except BaseException as exc:  # a request that failed across the swap fails the test
            failed.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        reply = post()
    finally:
        done.set()
        reader.join()
    if failed:
        raise failed[0]
    return reply, pairs


def test_a_release_that_fails_its_check_is_never_served(start_daemon, tmp_path: Path) -> None:
    """The release's models load beside the ones serving and swap in only once all passed:
    before, model a served the failed release's answers while b still loaded."""
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))
    assert _post(daemon, _release_of(tmp_path, key, "1", 1, {"a": "y = x + 1", "b": "y = x + 1"})).status == 200

    bad = _release_of(tmp_path, key, "2", 2, {"a": "y = x + 100", "b": "y = x + 100"}, slow="b", fails="b")
    reply, pairs = _during(daemon, lambda: _post(daemon, bad))
    assert reply.status == 422, reply.body
    assert "model 'b' did not load from the new release" in reply.json()["error"]
    assert "bad weights" in reply.json()["error"]
    assert len(pairs) >= 5  # read throughout the second b took to fail
    assert set(pairs) == {(2.0, 2.0)}
    assert daemon.request("GET", "/v1/updates").json()["current"].startswith("1-")


def test_a_release_swaps_in_all_its_models_at_once(start_daemon, tmp_path: Path) -> None:
    """No request sees part of a release: a reads new only once b does (b read after a)."""
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))
    assert _post(daemon, _release_of(tmp_path, key, "1", 1, {"a": "y = x + 1", "b": "y = x + 1"})).status == 200

    good = _release_of(tmp_path, key, "2", 2, {"a": "y = x + 100", "b": "y = x + 100"}, slow="b")
    reply, pairs = _during(daemon, lambda: _post(daemon, good))
    assert reply.status == 200, reply.body
    assert len(pairs) >= 5
    assert (101.0, 2.0) not in pairs
    assert set(pairs) <= {(2.0, 2.0), (2.0, 101.0), (101.0, 101.0)}
    assert pairs[0] == (2.0, 2.0)
    assert (_value(daemon, "a"), _value(daemon, "b")) == (101.0, 101.0)


def test_a_rollback_swaps_the_previous_release_in_at_once(start_daemon, tmp_path: Path) -> None:
    """A rollback loads the previous release's models beside the serving ones too: a reads old
    only once b does (release 1's b takes a second to load)."""
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))
    first = _release_of(tmp_path, key, "1", 1, {"a": "y = x + 1", "b": "y = x + 1"}, slow="b")
    assert _post(daemon, first).status == 200
    assert _post(daemon, _release_of(tmp_path, key, "2", 2, {"a": "y = x + 100", "b": "y = x + 100"})).status == 200

    reply, pairs = _during(daemon, lambda: daemon.request("POST", "/v1/updates/rollback"))
    assert reply.status == 200, reply.body  # type: ignore[attr-defined]
    assert len(pairs) >= 5
    assert (2.0, 101.0) not in pairs
    assert pairs[0] == (101.0, 101.0)  # read while release 1's b loaded (a second)
    assert (_value(daemon, "a"), _value(daemon, "b")) == (2.0, 2.0)


def test_an_ensemble_is_checked_with_the_steps_of_its_release(start_daemon, tmp_path: Path) -> None:
    """Release 2 renames the step's input and maps the ensemble's input to the new name: the
    check runs the new ensemble on the new step (staged, not serving yet), not the old one.
    The ensemble's version directory is empty (a bundle lists it in its manifest)."""
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))

    def release(name: str, sequence: int, step_input: str, body: str) -> Path:
        src = tmp_path / f"src-{name}"
        step = python_model(src / "models", "step", body)
        for file in (step / "config.pbtxt", step / "1" / "model.py"):
            file.write_text(file.read_text().replace('name: "X"', f'name: "{step_input}"')
                            .replace("request, 'X'", f"request, '{step_input}'"))
        (src / "models" / "pipe" / "1").mkdir(parents=True)  # empty, as Triton's ensembles have it
        (src / "models" / "pipe" / "config.pbtxt").write_text(
            'platform: "ensemble"\n'
            'input [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
            'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
            f'ensemble_scheduling {{ step [ {{ model_name: "step" model_version: -1 '
            f'input_map {{ key: "{step_input}" value: "X" }} output_map {{ key: "Y" value: "Y" }} }} ] }}\n'
        )
        out = tmp_path / f"{name}.edgebundle"
        create_bundle(src, out, key, sequence, name)
        return out

    assert _post(daemon, release("1", 1, "X", "y = x + 1")).status == 200
    assert _value(daemon, "pipe") == 2.0
    reply = _post(daemon, release("2", 2, "X2", "y = x + 100"))
    assert reply.status == 200, reply.body
    assert _value(daemon, "pipe") == 101.0
    # A bundle of the step alone: the ensemble, its empty version directory with it, is carried over.
    src = tmp_path / "src-3"
    step = python_model(src / "models", "step", "y = x + 1000")
    for file in (step / "config.pbtxt", step / "1" / "model.py"):
        file.write_text(file.read_text().replace('name: "X"', 'name: "X2"').replace("request, 'X'", "request, 'X2'"))
    create_bundle(src, tmp_path / "3.edgebundle", key, 3, "3")
    reply = _post(daemon, tmp_path / "3.edgebundle")
    assert reply.status == 200, reply.body
    assert _value(daemon, "pipe") == 1001.0


def test_explicit_mode_updates_the_loaded_models_and_checks_them(start_daemon, tmp_path: Path) -> None:
    """In explicit mode the models loaded now and the startup set follow the new release and
    are health-checked; the others stay unloaded. Once, the old versions kept serving under the
    new release's path: a model that could not load passed the check and was committed."""
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config), "--model-control-mode", "explicit", "--load-model", "m")
    src = tmp_path / "src-1.0.0"
    python_model(src / "models", "m", "y = x + 1")
    python_model(src / "models", "extra", "y = x + 5")
    create_bundle(src, tmp_path / "1.edgebundle", key, 1, "1.0.0")
    reply = _post(daemon, tmp_path / "1.edgebundle")
    assert reply.status == 200, reply.body
    assert _value(daemon) == 2.0
    assert daemon.request("GET", "/v2/models/extra/ready").status == 400  # not asked for: not loaded
    assert daemon.post_json("/v2/repository/models/extra/load", {}).status == 200

    assert _post(daemon, _bundle(tmp_path, key, "1.1.0", 2, "y = x + 100")).status == 200
    assert _value(daemon) == 101.0
    broken = _post(daemon, _bundle(tmp_path, key, "1.2.0", 3, "raise RuntimeError('corrupt weights')\ny = x"))
    assert broken.status == 422, broken.body
    assert "model 'm' failed its warm-up request" in broken.json()["error"]  # the new code's, not the old
    assert "corrupt weights" in broken.json()["error"]
    assert _value(daemon) == 101.0
    assert daemon.request("GET", "/v1/updates").json()["current"].startswith("2-")
    assert daemon.stop() == 0
    again = start_daemon("--config", str(config), "--model-control-mode", "explicit", "--load-model", "m")
    assert _value(again) == 101.0


def test_inbox_applies_bundles_dropped_in(start_daemon, tmp_path: Path) -> None:
    inbox = tmp_path / "usb"
    inbox.mkdir()
    config, key = _setup(tmp_path, inbox)
    daemon = start_daemon("--config", str(config))
    bundle = _bundle(tmp_path, key, "2.0.0", 5, "y = x * 10")
    shutil.copy(bundle, inbox / bundle.name)
    wait_until(lambda: daemon.request("GET", "/v2/models/m/ready").status == 200, timeout=60)
    assert _value(daemon) == 10.0


# --- the command line and the daemon: one apply path --------------------------------------

def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon", "update", *argv], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          capture_output=True, text=True, timeout=300)


def _store_flags(tmp_path: Path) -> list[str]:
    return ["--root", str(tmp_path / "store")]


def test_offline_cli_apply_then_sighup_switches_and_prune_keeps_reload_working(
    start_daemon, tmp_path: Path
) -> None:
    """Issue 19 item 1: `edged update apply` from the CLI + SIGHUP served the old release, and
    a later prune deleted the directory the daemon still served, breaking the next reload."""
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))
    keys = ["--keys", str(tmp_path / "keys"), "--offline", "--keep", "1"]
    for n, body, expected in ((1, "y = x + 1", 2.0), (2, "y = x + 2", 3.0), (3, "y = x + 3", 4.0)):
        done = _cli("apply", str(_bundle(tmp_path, key, f"{n}.0.0", n, body)),
                    *_store_flags(tmp_path), *keys)
        assert done.returncode == 0, done.stderr
        assert "offline, no health check" in done.stdout
        if n > 1:
            assert _value(daemon) == expected - 1  # not reloaded yet: the old release serves
        daemon.proc.send_signal(signal.SIGHUP)
        wait_until(lambda want=expected: daemon.request("GET", "/v2/models/m/ready").status == 200
                   and _value(daemon) == want, timeout=60)
    status = daemon.request("GET", "/v1/updates").json()
    # keep=1, yet 2-2.0.0 survived the apply of 3: the daemon served it at that moment.
    assert status["current"] == "3-3.0.0" and status["releases"] == ["2-2.0.0", "3-3.0.0"]
    # With keep=1 and no SIGHUP in between, the release the daemon serves is kept until it moves.
    done = _cli("apply", str(_bundle(tmp_path, key, "4.0.0", 4, "y = x + 4")),
                *_store_flags(tmp_path), *keys)
    assert done.returncode == 0, done.stderr
    done = _cli("apply", str(_bundle(tmp_path, key, "5.0.0", 5, "y = x + 5")),
                *_store_flags(tmp_path), *keys)
    assert done.returncode == 0, done.stderr
    assert daemon.request("GET", "/v1/updates").json()["releases"] == ["3-3.0.0", "5-5.0.0"]
    assert _value(daemon) == 4.0
    daemon.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: _value(daemon) == 6.0, timeout=60)
    assert daemon.alive()


def test_cli_apply_is_health_checked_by_the_running_daemon(start_daemon, tmp_path: Path) -> None:
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))
    flags = [*_store_flags(tmp_path), "--keys", str(tmp_path / "keys"), "--socket", str(daemon.socket)]
    done = _cli("apply", str(_bundle(tmp_path, key, "1.0.0", 1, "y = x + 1")), *flags)
    assert done.returncode == 0, done.stderr
    assert "will serve and health-check" in done.stdout
    assert _value(daemon) == 2.0  # no SIGHUP needed

    broken = _bundle(tmp_path, key, "2.0.0", 2, "raise RuntimeError('corrupt weights')\ny = x")
    done = _cli("apply", str(broken), *flags)
    assert done.returncode == 2
    assert "health check" in done.stderr and "corrupt weights" in done.stderr
    assert _value(daemon) == 2.0
    assert daemon.request("GET", "/v1/updates").json()["current"] == "1-1.0.0"


def test_two_phase_from_the_cli(start_daemon, tmp_path: Path) -> None:
    """apply --no-commit -> (fleet manager's health check) -> commit; then rollback of a second
    pending release; the pending release survives a daemon restart."""
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))
    flags = [*_store_flags(tmp_path), "--socket", str(daemon.socket)]
    keys = ["--keys", str(tmp_path / "keys")]
    assert _cli("apply", str(_bundle(tmp_path, key, "1.0.0", 1, "y = x + 1")), *flags, *keys).returncode == 0

    done = _cli("apply", "--no-commit", str(_bundle(tmp_path, key, "2.0.0", 2, "y = x + 2")),
                *flags, *keys)
    assert done.returncode == 0, done.stderr
    assert "current -> 2-2.0.0 (pending)" in done.stdout
    assert _value(daemon) == 3.0
    status = daemon.request("GET", "/v1/updates").json()
    assert (status["pending"], status["pending_installed"], status["last_sequence"]) == (
        "2-2.0.0", True, 1)

    assert daemon.stop() == 0  # a restart keeps the installed release
    daemon = start_daemon("--config", str(config))
    assert _value(daemon) == 3.0
    flags[-1] = str(daemon.socket)
    done = _cli("commit", *_store_flags(tmp_path))
    assert done.returncode == 0 and "committed 2-2.0.0" in done.stdout, done.stderr
    status = daemon.request("GET", "/v1/updates").json()
    assert (status["pending"], status["last_sequence"], status["rollback_to"]) == (None, 2, "1-1.0.0")

    done = _cli("apply", "--no-commit", str(_bundle(tmp_path, key, "3.0.0", 3, "y = x + 3")),
                *flags, *keys)
    assert done.returncode == 0, done.stderr
    assert _value(daemon) == 4.0
    done = _cli("rollback", *flags)
    assert done.returncode == 0 and "current -> 2-2.0.0" in done.stdout, done.stderr
    assert _value(daemon) == 3.0
    done = _cli("rollback", "--if-pending", *flags)
    assert done.returncode == 0 and "nothing pending" in done.stdout, done.stderr
    assert daemon.request("GET", "/v1/updates").json()["current"] == "2-2.0.0"


def test_two_phase_over_http(start_daemon, tmp_path: Path) -> None:
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))
    assert _post(daemon, _bundle(tmp_path, key, "1.0.0", 1, "y = x + 1")).status == 200
    body = _bundle(tmp_path, key, "2.0.0", 2, "y = x + 2").read_bytes()

    bad = daemon.request("POST", "/v1/updates?commit=maybe", body)
    assert bad.status == 400 and "'commit' must be true or false" in bad.json()["error"]
    bad = daemon.request("POST", "/v1/updates?force=1", body)
    assert bad.status == 400 and "unknown query parameter(s) for /v1/updates: force" in bad.json()["error"]

    reply = daemon.request("POST", "/v1/updates?commit=false", body)
    assert reply.status == 200, reply.body
    assert reply.json()["applied"]["committed"] is False
    assert _value(daemon) == 3.0
    again = daemon.request("POST", "/v1/updates", _bundle(tmp_path, key, "3.0.0", 3, "y = x").read_bytes())
    assert again.status == 409 and "waits for `edged update commit`" in again.json()["error"]
    reply = daemon.request("POST", "/v1/updates/commit")
    assert reply.status == 200 and reply.json()["committed"]["release"] == "2-2.0.0"
    assert daemon.request("POST", "/v1/updates/commit").status == 409

    assert daemon.request("POST", "/v1/updates?commit=false",
                          _bundle(tmp_path, key, "3.0.0", 3, "y = x + 3").read_bytes()).status == 200
    assert _value(daemon) == 4.0
    reply = daemon.request("POST", "/v1/updates/rollback?only_pending=true")
    assert reply.status == 200 and reply.json() == {"current": "2-2.0.0"}
    assert _value(daemon) == 3.0


def test_bundle_size_caps_and_partial_uploads(start_daemon, tmp_path: Path) -> None:
    """Issue 19 items 3 and 13: a size cap before and after Content-Encoding; partial uploads
    under incoming/ are removed on failure and at start."""
    config, key = _setup(tmp_path)
    config.write_text(config.read_text().replace("[updates]\n", "[updates]\nmax-bundle-bytes = 65536\n"))
    state = tmp_path / "state"
    (state / "incoming").mkdir(parents=True)
    stale = state / "incoming" / "0123.edgebundle.part"
    stale.write_bytes(b"half a bundle from a daemon killed mid-upload")
    daemon = start_daemon("--config", str(config), "--state-dir", str(state))
    assert not stale.exists()

    too_big = daemon.request("POST", "/v1/updates", b"\0" * 70000)
    assert too_big.status == 413
    assert "bundle of 70000 bytes exceeds updates.max-bundle-bytes (65536 bytes)" in too_big.json()["error"]

    bomb = gzip.compress(b"\0" * (4 << 20))  # ~4 KiB on the wire, 4 MiB inflated
    assert len(bomb) < 65536
    reply = daemon.request("POST", "/v1/updates", bomb, {"Content-Encoding": "gzip"})
    assert reply.status == 413, reply.body
    assert reply.json()["error"] == ("bundle exceeds updates.max-bundle-bytes (65536 bytes, "
                                     "counted after gzip decoding)")

    corrupt = daemon.request("POST", "/v1/updates", b"\x1f\x8b\x08\x00garbage" * 10,
                             {"Content-Encoding": "gzip"})
    assert corrupt.status == 400, corrupt.body
    assert corrupt.json()["error"].startswith("body is not valid gzip data")
    truncated = daemon.request("POST", "/v1/updates", gzip.compress(b"x" * 5000)[:-20],
                               {"Content-Encoding": "gzip"})
    assert truncated.status == 400 and truncated.json()["error"] == "gzip body is truncated"
    brotli = daemon.request("POST", "/v1/updates", b"x", {"Content-Encoding": "br"})
    assert brotli.status == 400 and "unsupported Content-Encoding 'br'" in brotli.json()["error"]

    # A valid gzip-encoded bundle under the cap still applies.
    small = _bundle(tmp_path, key, "1.0.0", 1, "y = x + 1").read_bytes()
    reply = daemon.request("POST", "/v1/updates", gzip.compress(small), {"Content-Encoding": "gzip"})
    assert reply.status == 200, reply.body
    assert _value(daemon) == 2.0
    # "deflate" arrives zlib-wrapped or raw, depending on the client: both are taken.
    for n, wbits in ((2, zlib.MAX_WBITS), (3, -zlib.MAX_WBITS)):
        packer = zlib.compressobj(wbits=wbits)
        plain = _bundle(tmp_path, key, f"{n}.0.0", n, f"y = x + {n}").read_bytes()
        reply = daemon.request("POST", "/v1/updates", packer.compress(plain) + packer.flush(),
                               {"Content-Encoding": "deflate"})
        assert reply.status == 200, reply.body
        assert _value(daemon) == 1.0 + n
    assert list((state / "incoming").iterdir()) == []
    assert daemon.alive()


def test_a_gzip_body_is_inflated_a_piece_at_a_time() -> None:
    """The update body's sink holds at most INFLATE_PIECE inflated bytes at once: one 1 MiB
    chunk of a gzip bomb was inflated whole (the daemon's memory grew by ~1.2 GB)."""
    import io

    from daemon.api.admin import INFLATE_PIECE, _Sink

    class Recording(io.BytesIO):
        largest = 0

        def write(self, data) -> int:  # type: ignore[no-untyped-def, override]
            self.largest = max(self.largest, len(data))
            return len(data)

    for encoding, compress in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        out = Recording()
        sink = _Sink(out, encoding, 64 << 20)
        sink.write(compress(b"\0" * (24 << 20)))
        assert sink.size == 24 << 20 and out.largest == INFLATE_PIECE


def test_client_hanging_up_does_not_cancel_the_update(start_daemon, tmp_path: Path) -> None:
    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))
    # The warm-up request of this release takes seconds: the client leaves during the check.
    body = _bundle(tmp_path, key, "1.0.0", 1, "import time\ntime.sleep(2)\ny = x + 1").read_bytes()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(daemon.socket))
        s.sendall(b"POST /v1/updates HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: daemon.request("GET", "/v1/updates").json()["pending"] is not None,
                   timeout=60, interval=0.02)
    wait_until(lambda: daemon.request("GET", "/v1/updates").json()["current"] == "1-1.0.0"
               and daemon.request("GET", "/v1/updates").json()["pending"] is None, timeout=60)
    assert _value(daemon) == 2.0
    assert list((daemon.state_dir / "incoming").iterdir()) == []


def test_a_generation_model_is_checked_staged_and_swapped(start_daemon, tmp_path: Path) -> None:
    """A llama.cpp model in a release: the check generates with the new copy before it serves;
    a generation running across the swap finishes on the copy it began on; a release whose
    GGUF does not load is refused and the old one generates on."""
    from gguf_builder import write_tiny_llama

    config, key = _setup(tmp_path)
    daemon = start_daemon("--config", str(config))

    def release(name: str, sequence: int, seed: int, *, broken: bool = False) -> Path:
        model = tmp_path / f"src-{name}" / "models" / "tiny"
        (model / "1").mkdir(parents=True)
        write_tiny_llama(model / "1" / "model.gguf", seed=seed, n_ctx=4096)
        if broken:
            gguf = model / "1" / "model.gguf"
            gguf.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
        (model / "config.pbtxt").write_text('backend: "llamacpp"\n')
        out = tmp_path / f"{name}.edgebundle"
        create_bundle(model.parents[1], out, key, sequence, name)
        return out

    def complete(max_tokens: int = 8) -> str:
        reply = daemon.post_json("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
        assert reply.status == 200, reply.body
        return str(reply.json()["choices"][0]["text"])

    assert _post(daemon, release("1", 1, seed=1)).status == 200
    first, long_first = complete(), complete(2000)
    # Streamed: its first piece is read before the update is posted, the rest after it landed.
    conn = UnixHTTPConnection(daemon.socket)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": "hello", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True,
    }), {"Content-Type": "application/json"})
    stream = conn.getresponse()
    lines = [stream.readline()]
    while not lines[-1].startswith(b"data: {"):
        lines.append(stream.readline())
    # Read on while the update runs: the swap's retire of release 1 waits for this generation.
    reader = threading.Thread(target=lambda: lines.extend(stream.read().splitlines()))
    reader.start()
    reply = _post(daemon, release("2", 2, seed=2))
    reader.join()
    conn.close()
    assert reply.status == 200, reply.body
    events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    # Begun before the swap: it finished on release 1's weights.
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == long_first
    second = complete()
    assert second != first

    reply = _post(daemon, release("3", 3, seed=3, broken=True))
    assert reply.status == 422, reply.body
    assert "model 'tiny' did not load from the new release" in reply.json()["error"]
    assert complete() == second
