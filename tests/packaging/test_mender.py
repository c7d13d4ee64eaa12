"""The Mender update module `packaging/mender/edged-bundle`, driven exactly as Mender 3.x drives
it (one call per state, `MODULE STATE TREE`, with the file tree the client builds), against a
running daemon; and end to end with Debian's `mender` client and `mender-artifact` where those
are installed (skipped otherwise)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon.updates.bundle import create_bundle
from daemon.updates.keys import keygen
from support import DaemonProcess, python_model, wait_until

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "packaging" / "mender" / "edged-bundle"
MAKE_ARTIFACT = REPO / "packaging" / "mender" / "make-artifact"


@dataclass
class Box:
    """One device: a daemon serving a release store, and the module's settings for it."""

    tmp: Path
    key: Path
    daemon: DaemonProcess
    env: dict[str, str]
    store: Path

    def bundle(self, name: str, sequence: int, body: str, key: Path | None = None) -> Path:
        src = self.tmp / f"src-{name}"
        python_model(src / "models", "m", body)
        out = self.tmp / f"{name}.edgebundle"
        create_bundle(src, out, key or self.key, sequence, name)
        return out

    def value(self) -> float:
        reply = self.daemon.post_json("/v2/models/m/infer", {
            "inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]})
        assert reply.status == 200, reply.body
        return float(reply.json()["outputs"][0]["data"][0])

    def status(self) -> dict[str, object]:
        return dict(self.daemon.request("GET", "/v1/updates").json())

    def snapshot(self) -> tuple[object, ...]:
        """Everything an update may change: state, `current`, the release directories."""
        return ((self.store / "state.json").read_bytes(), os.readlink(self.store / "current"),
                sorted(p.name for p in (self.store / "releases").iterdir()))


@pytest.fixture
def box(start_daemon, tmp_path: Path) -> Box:
    keys = tmp_path / "keys"
    keys.mkdir()
    key = tmp_path / "signing.key"
    keygen(key, keys / "fleet.pub")
    base = tmp_path / "base-repo"
    base.mkdir()
    store = tmp_path / "store"
    config = tmp_path / "edged.toml"
    config.write_text(f'[models]\nrepository = ["{base}"]\n'
                      f'[updates]\nroot = "{store}"\nkeys = "{keys}"\n')
    daemon = start_daemon("--config", str(config))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "EDGED": f"{sys.executable} -m daemon",
        "EDGED_ROOT": str(store),
        "EDGED_KEYS": str(keys),
        "EDGED_SOCKET": str(daemon.socket),
        "EDGED_MENDER_CONF": str(tmp_path / "no-such.conf"),
    }
    return Box(tmp_path, key, daemon, env, store)


def _tree(box: Box, payload: list[Path], name: str) -> Path:
    """The file tree Mender 3.x hands a module for ArtifactInstall and later states."""
    tree = box.tmp / "mender" / name / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "header").mkdir(parents=True)
    (tree / "files").mkdir()
    (tree / "tmp").mkdir()
    (tree / "version").write_text("3")
    (tree / "current_artifact_name").write_text("factory")
    (tree / "current_device_type").write_text("edge-box")
    (tree / "header" / "artifact_name").write_text(name)
    (tree / "header" / "payload_type").write_text("edged-bundle")
    for path in payload:
        shutil.copy(path, tree / "files" / path.name)
    return tree


def _call(box: Box, state: str, tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MODULE), state, str(tree)], cwd=tree, env=box.env,
                          capture_output=True, text=True, timeout=300)


def _install(box: Box, tree: Path) -> subprocess.CompletedProcess[str]:
    """What the client does up to ArtifactInstall (a local `mender install`)."""
    assert _call(box, "Download", tree).returncode == 0
    assert _call(box, "SupportsRollback", tree).stdout == "Yes\n"
    return _call(box, "ArtifactInstall", tree)


def test_queries_and_unknown_states(box: Box) -> None:
    tree = _tree(box, [], "queries")
    assert _call(box, "NeedsArtifactReboot", tree).stdout == "No\n"
    assert _call(box, "SupportsRollback", tree).stdout == "Yes\n"
    for state in ("ProvidePayloadFileSizes", "SomeFutureState", "Cleanup"):
        done = _call(box, state, tree)
        assert (done.returncode, done.stdout) == (0, "")


def test_install_commit_then_rollback_of_the_next(box: Box) -> None:
    tree = _tree(box, [box.bundle("1.0.0", 1, "y = x + 1")], "r1")
    done = _install(box, tree)
    assert done.returncode == 0, done.stderr
    assert box.value() == 2.0  # the daemon serves it already: installed, not committed
    assert (box.status()["pending"], box.status()["pending_installed"]) == ("1-1.0.0", True)
    assert _call(box, "NeedsArtifactReboot", tree).stdout == "No\n"
    done = _call(box, "ArtifactCommit", tree)
    assert done.returncode == 0 and "committed 1-1.0.0" in done.stdout, done.stderr
    assert _call(box, "Cleanup", tree).returncode == 0
    assert (box.status()["current"], box.status()["pending"]) == ("1-1.0.0", None)

    tree = _tree(box, [box.bundle("2.0.0", 2, "y = x + 2")], "r2")
    assert _install(box, tree).returncode == 0
    assert box.value() == 3.0
    # ArtifactCommit failing (or a fleet manager's own check failing) leads Mender here:
    done = _call(box, "ArtifactRollback", tree)
    assert done.returncode == 0 and "current -> 1-1.0.0" in done.stdout, done.stderr
    assert _call(box, "ArtifactFailure", tree).returncode == 0  # idempotent: nothing pending
    assert _call(box, "Cleanup", tree).returncode == 0
    assert box.value() == 2.0
    status = box.status()
    assert (status["current"], status["pending"], status["last_sequence"]) == ("1-1.0.0", None, 1)


def test_failed_health_check_changes_nothing(box: Box) -> None:
    assert _install(box, _tree(box, [box.bundle("1.0.0", 1, "y = x + 1")], "r1")).returncode == 0
    assert _call(box, "ArtifactCommit", _tree(box, [], "r1-commit")).returncode == 0
    before = box.snapshot()

    broken = box.bundle("2.0.0", 2, "raise RuntimeError('corrupt weights')\ny = x")
    tree = _tree(box, [broken], "r2")
    done = _install(box, tree)
    assert done.returncode != 0
    assert "health check" in done.stderr and "corrupt weights" in done.stderr
    assert _call(box, "ArtifactRollback", tree).returncode == 0
    assert _call(box, "ArtifactFailure", tree).returncode == 0
    assert box.value() == 2.0
    after = box.snapshot()
    assert after[1] == before[1] == "releases/1-1.0.0"
    state = json.loads(after[0])
    assert (state["committed"], state["pending"], state["last_sequence"]) == (["1-1.0.0"], None, 1)
    # The failed release's directory stays for inspection until the next commit prunes it.
    assert after[2] == ["1-1.0.0", "2-2.0.0"]
    assert _install(box, _tree(box, [box.bundle("2.0.1", 2, "y = x + 2")], "r2b")).returncode == 0
    assert _call(box, "ArtifactCommit", _tree(box, [], "r2b-commit")).returncode == 0
    assert box.snapshot()[2] == ["1-1.0.0", "2-2.0.1"]


@pytest.mark.parametrize("kind", ["tampered", "foreign key", "not a bundle", "two files"])
def test_bad_payload_inside_a_valid_artifact_is_refused(box: Box, kind: str) -> None:
    assert _install(box, _tree(box, [box.bundle("1.0.0", 1, "y = x + 1")], "r1")).returncode == 0
    assert _call(box, "ArtifactCommit", _tree(box, [], "r1-commit")).returncode == 0
    before = box.snapshot()
    good = box.bundle("2.0.0", 2, "y = x + 7")
    if kind == "tampered":
        data = bytearray(good.read_bytes())
        data[data.find(b"x + 7") + 4] = ord("8")
        good.write_bytes(bytes(data))
        payload = [good]
    elif kind == "foreign key":
        other = box.tmp / "other.key"
        keygen(other, box.tmp / "other.pub")
        payload = [box.bundle("2.0.1", 2, "y = x + 7", key=other)]
    elif kind == "not a bundle":
        payload = [box.tmp / "model.onnx"]
        payload[0].write_bytes(b"weights")
    else:
        payload = [good, box.bundle("2.0.2", 3, "y = x")]
    tree = _tree(box, payload, "bad")
    done = _install(box, tree)
    assert done.returncode != 0
    expected = {"tampered": "does not match", "foreign key": "not signed by a trusted key",
                "not a bundle": "is not an *.edgebundle", "two files": "exactly one file"}[kind]
    assert expected in done.stderr, done.stderr
    assert _call(box, "ArtifactRollback", tree).returncode == 0
    assert _call(box, "ArtifactFailure", tree).returncode == 0
    assert box.snapshot() == before
    assert box.value() == 2.0


# --- end to end with Debian's mender client (standalone mode) and mender-artifact ----------

MENDER_MODULES = Path("/usr/share/mender/modules/v3")  # fixed in mender 3.x, not configurable
ARTIFACT_INFO = Path("/etc/mender/artifact_info")


@dataclass
class Mender:
    box: Box
    conf: Path
    data: Path

    def artifact(self, bundle: Path, name: str, verify: bool = True) -> Path:
        out = self.box.tmp / f"{name}.mender"
        keys = ["--keys", self.box.env["EDGED_KEYS"]] if verify else []
        done = subprocess.run([str(MAKE_ARTIFACT), str(bundle), "--artifact-name", name,
                               "--device-type", "edge-box", "-o", str(out), *keys],
                              env=self.box.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return out

    def argv(self, *args: str) -> list[str]:
        return ["mender", "--config", str(self.conf), "--fallback-config", str(self.conf),
                "--data", str(self.data), "--no-syslog", *args]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), env=self.box.env, capture_output=True, text=True,
                              timeout=300)

    def artifact_name(self) -> str:
        return self.run("show-artifact").stdout.strip()


@pytest.fixture
def mender(box: Box) -> Iterator[Mender]:
    if not (shutil.which("mender") and shutil.which("mender-artifact")):
        pytest.skip("Debian's mender-client and mender-artifact are not installed")
    if os.geteuid() != 0:
        pytest.skip(f"mender 3.x runs modules only from {MENDER_MODULES}: needs root to install one")
    link = MENDER_MODULES / "edged-bundle"
    if link.exists() or link.is_symlink():
        pytest.skip(f"{link} exists already (another install of the module); not touching it")
    made_info = not ARTIFACT_INFO.exists()
    MENDER_MODULES.mkdir(parents=True, exist_ok=True)
    link.symlink_to(MODULE)
    if made_info:
        ARTIFACT_INFO.parent.mkdir(parents=True, exist_ok=True)
        ARTIFACT_INFO.write_text("artifact_name=factory\n")
    data = box.tmp / "mender-data"
    data.mkdir()
    (data / "device_type").write_text("device_type=edge-box\n")
    conf = box.tmp / "mender.conf"
    conf.write_text(json.dumps({"DeviceTypeFile": str(data / "device_type")}))
    try:
        yield Mender(box, conf, data)
    finally:
        link.unlink()
        if made_info:
            ARTIFACT_INFO.unlink()


def test_mender_client_install_commit_rollback_and_refusals(mender: Mender) -> None:
    box = mender.box
    done = mender.run("install", str(mender.artifact(box.bundle("1.0.0", 1, "y = x + 1"), "edged-1")))
    assert done.returncode == 0, done.stderr
    assert box.value() == 2.0
    assert box.status()["pending"] == "1-1.0.0"
    done = mender.run("commit")
    assert done.returncode == 0, done.stderr
    assert (box.status()["current"], box.status()["pending"]) == ("1-1.0.0", None)
    assert mender.artifact_name() == "edged-1"

    # A failed health check: the install fails, Mender rolls back, nothing changed.
    broken = box.bundle("2.0.0", 2, "raise RuntimeError('corrupt weights')\ny = x")
    done = mender.run("install", str(mender.artifact(broken, "edged-2")))
    assert done.returncode != 0
    assert mender.artifact_name() == "edged-1"
    assert (box.status()["current"], box.status()["pending"]) == ("1-1.0.0", None)
    assert box.value() == 2.0

    # Installed, then rolled back by the fleet manager instead of committed.
    done = mender.run("install", str(mender.artifact(box.bundle("3.0.0", 3, "y = x + 3"), "edged-3")))
    assert done.returncode == 0, done.stderr
    assert box.value() == 4.0
    done = mender.run("rollback")
    assert done.returncode == 0, done.stderr
    assert box.value() == 2.0
    assert mender.artifact_name() == "edged-1"
    assert (box.status()["current"], box.status()["pending"]) == ("1-1.0.0", None)

    # A tampered bundle inside a valid (well-formed, checksummed) artifact: refused, unchanged.
    tampered = box.bundle("4.0.0", 4, "y = x + 7")
    data = bytearray(tampered.read_bytes())
    data[data.find(b"x + 7") + 4] = ord("8")
    tampered.write_bytes(bytes(data))
    before = box.snapshot()
    done = mender.run("install", str(mender.artifact(tampered, "edged-4", verify=False)))
    assert done.returncode != 0
    assert box.snapshot() == before
    assert mender.artifact_name() == "edged-1"
    assert box.value() == 2.0


def _pids_running(*needles: bytes) -> list[int]:
    """Processes whose command line holds every needle (name this test's store among them,
    so processes of other tests or runs on the machine never count)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if all(needle in cmdline for needle in needles):
                pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("victims", ["client", "client and module"])
def test_mender_client_killed_during_install(mender: Mender, victims: str) -> None:
    """kill -9 mid-install. Mender runs the module in its own process group: killing only the
    client orphans a module that finishes the install; killing both leaves a half-done switch.
    Either way the daemon keeps serving, and the next deployment goes through."""
    box = mender.box
    assert mender.run("install", str(mender.artifact(box.bundle("1.0.0", 1, "y = x + 1"), "edged-1"))).returncode == 0
    assert mender.run("commit").returncode == 0
    # The warm-up request of this release takes seconds: time to kill the client mid-install.
    slow = mender.artifact(box.bundle("2.0.0", 2, "import time\ntime.sleep(3)\ny = x + 2"), "edged-2")
    proc = subprocess.Popen(mender.argv("install", str(slow)), env=box.env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: json.loads((box.store / "state.json").read_bytes())["pending"] is not None,
                   timeout=120, interval=0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        if victims == "client and module":
            for pid in _pids_running(b"edged-bundle\0ArtifactInstall"):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        proc.wait()
    wait_until(lambda: not _pids_running(b"daemon\0update\0apply", str(box.store).encode()), timeout=120)
    state = json.loads((box.store / "state.json").read_bytes())
    assert state["pending"] == "2-2.0.0"
    if victims == "client and module":
        assert state["pending_installed"] is False
    # Killing only the client usually orphans a module that finishes the install; but the
    # orphan writes to pipes whose reader is gone, and one that dies of it leaves the same
    # half-done switch as killing both (seen ~1 run in 6 here). Both must end well.
    installed = state["pending_installed"]
    assert box.value() in (2.0, 3.0)  # serving all along, the old or the new release

    mender.run("rollback")  # standalone Mender may not remember the install: rc 2 is fine
    done = mender.run("install", str(mender.artifact(box.bundle("3.0.0", 3, "y = x + 3"), "edged-3")))
    assert done.returncode == 0, done.stderr
    assert mender.run("commit").returncode == 0
    assert box.value() == 4.0
    assert mender.artifact_name() == "edged-3"
    status = box.status()
    assert (status["current"], status["pending"], status["last_sequence"]) == ("3-3.0.0", None, 3)
    # The orphaned, finished install was undone by the next ArtifactInstall; the half-done
    # switch was undone by recovery.
    undone = "rolled-back" if installed else "interrupted"
    assert {"action": undone, "release": "2-2.0.0"}.items() <= next(
        h for h in status["history"] if h["release"] == "2-2.0.0").items()
