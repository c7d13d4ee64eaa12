"""apply_update end to end: real bundles into a real store, a real ONNX Runtime health check,
and real crashes (a child process that dies at each step boundary)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from daemon.updates.apply import apply_update, commit_update
from daemon.updates.errors import HealthCheckFailed, StoreBusy, UpdateConflict
from daemon.updates.manifest import Manifest
from daemon.updates.store import ReleaseStore

Tree = dict[str, bytes]
BundleMaker = Callable[..., tuple[Path, Manifest]]
ReadTree = Callable[[Path], Tree]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _add_model(constant: float) -> bytes:
    """y = x + constant, float32 [1, 4]."""
    c = helper.make_tensor("c", TensorProto.FLOAT, [1], [constant])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])], "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[c],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


async def onnx_health_check(release: Path) -> None:
    """Load every model of the release with ONNX Runtime and check one inference against numpy
    (the daemon's check reloads models and sends warm-up requests; this is the same idea)."""
    import onnxruntime as ort

    for path in sorted((release / "models").glob("*/1/model.onnx")):
        expected_add = float((path.parent.parent / "add.txt").read_text())
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, x + expected_add)


@pytest.fixture
def v1() -> Tree:
    return {
        "models/add/1/model.onnx": _add_model(1.0),
        "models/add/add.txt": b"1.0",
        "models/old/1/model.onnx": _add_model(5.0),
        "models/old/add.txt": b"5.0",
        "configs/edged.toml": b'[models]\ncontrol-mode = "poll"\n',
        "plugins/mybackend/manifest.toml": b'name = "mybackend"\n',
    }


@pytest.fixture
def v2_payload() -> Tree:
    """v2 changes `add`, adds `new` and (with remove=["models/old"]) drops `old`."""
    return {
        "models/add/1/model.onnx": _add_model(2.0),
        "models/add/add.txt": b"2.0",
        "models/new/1/model.onnx": _add_model(3.0),
        "models/new/add.txt": b"3.0",
    }


@pytest.fixture
def v2(v1: Tree, v2_payload: Tree) -> Tree:
    """The complete release v2 must produce."""
    tree = {k: v for k, v in v1.items() if not k.startswith(("models/add/", "models/old/"))}
    tree.update(v2_payload)
    return tree


async def test_apply_two_updates(tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path,
                                 read_tree: ReadTree, v1: Tree, v2_payload: Tree,
                                 v2: Tree) -> None:
    store = ReleaseStore(tmp_path / "store")
    b1, _ = make_bundle(v1, sequence=1, version="1.0.0")
    b2, _ = make_bundle(v2_payload, sequence=2, version="1.1.0", remove=["models/old"])
    checked: list[Path] = []
    messages: list[str] = []

    async def check(release: Path) -> None:
        await onnx_health_check(release)
        checked.append(release)

    first = await apply_update(b1, store, trusted_keys, check, messages.append)
    assert (first.release, first.sequence, first.health_checked) == ("1-1.0.0", 1, True)
    assert read_tree(store.current) == v1

    second = await apply_update(b2, store, trusted_keys, check, messages.append)
    assert second.release == "2-1.1.0"
    assert read_tree(store.current) == v2
    assert checked == [store.releases / "1-1.0.0", store.releases / "2-1.1.0"]
    # `current` is a relative link, so the store can be mounted elsewhere.
    assert os.readlink(store.current) == "releases/2-1.1.0"
    # The old release is untouched (a rollback target) and shares unchanged files' inodes.
    assert read_tree(store.releases / "1-1.0.0") == v1
    old_cfg = store.releases / "1-1.0.0" / "configs" / "edged.toml"
    new_cfg = store.releases / "2-1.1.0" / "configs" / "edged.toml"
    assert old_cfg.stat().st_ino == new_cfg.stat().st_ino
    assert not list(store.staging.iterdir())
    status = store.status()
    assert (status.current, status.pending, status.last_sequence) == ("2-1.1.0", None, 2)
    assert status.rollback_to == "1-1.0.0"
    assert [h.action for h in status.history] == ["committed", "committed"]
    assert any("verified bundle 1.1.0 (sequence 2)" in m for m in messages)
    assert messages[-1] == "committed 2-1.1.0"


async def test_replay_and_downgrade_are_refused(tmp_path: Path, make_bundle: BundleMaker,
                                                trusted_keys: Path, read_tree: ReadTree,
                                                v1: Tree, v2_payload: Tree) -> None:
    store = ReleaseStore(tmp_path / "store")
    b1, _ = make_bundle(v1, sequence=1)
    b5, _ = make_bundle(v2_payload, sequence=5, version="1.5.0")
    await apply_update(b1, store, trusted_keys, None)
    await apply_update(b5, store, trusted_keys, None)
    before = read_tree(store.current)
    with pytest.raises(UpdateConflict, match=r"sequence 5, not newer than the last applied "
                                             "sequence 5") as replay:
        await apply_update(b5, store, trusted_keys, None)
    assert replay.value.status == 409
    with pytest.raises(UpdateConflict, match=r"sequence 1, not newer than the last applied "
                                             "sequence 5"):
        await apply_update(b1, store, trusted_keys, None)
    assert read_tree(store.current) == before
    assert os.readlink(store.current) == "releases/5-1.5.0"


async def test_wrong_daemon_version_is_refused(tmp_path: Path, make_bundle: BundleMaker,
                                               trusted_keys: Path, v1: Tree) -> None:
    store = ReleaseStore(tmp_path / "store")
    bundle, _ = make_bundle(v1, sequence=1, targets=[">=99.0"])
    with pytest.raises(UpdateConflict, match=r"targets daemon >=99.0; this daemon is 0.1.0"):
        await apply_update(bundle, store, trusted_keys, None, daemon_version="0.1.0")
    assert store.current_release() is None
    await apply_update(bundle, store, trusted_keys, None, daemon_version="99.1")
    assert store.current_release() == (store.releases / "1-1.0.0").resolve()


async def test_failed_health_check_rolls_back(tmp_path: Path, make_bundle: BundleMaker,
                                              trusted_keys: Path, read_tree: ReadTree,
                                              v1: Tree, v2_payload: Tree, v2: Tree) -> None:
    store = ReleaseStore(tmp_path / "store")
    b1, _ = make_bundle(v1, sequence=1)
    broken = dict(v2_payload, **{"models/add/1/model.onnx": b"this is not an onnx model"})
    b2, _ = make_bundle(broken, sequence=2, version="2.0.0")
    await apply_update(b1, store, trusted_keys, onnx_health_check)
    restored: list[Path] = []

    async def restore(release: Path) -> None:
        await onnx_health_check(release)  # the daemon would reload these models
        restored.append(release)

    messages: list[str] = []
    with pytest.raises(HealthCheckFailed) as failure:
        await apply_update(b2, store, trusted_keys, onnx_health_check, messages.append,
                           restore=restore)
    assert failure.value.status == 422
    assert "health check of release 2-2.0.0 failed" in failure.value.message
    assert "switched back to 1-1.0.0" in failure.value.message
    assert "InvalidProtobuf" in failure.value.message or "protobuf" in failure.value.message.lower()
    assert os.readlink(store.current) == "releases/1-1.0.0"
    assert read_tree(store.current) == v1
    assert restored == [store.releases / "1-1.0.0"]
    status = store.status()
    assert (status.pending, status.last_sequence) == (None, 1)
    assert status.history[-1].action == "failed"
    assert "health check failed; switched back to 1-1.0.0" in messages

    # A failed sequence is not consumed: a fixed bundle with the same number applies.
    b2_fixed, _ = make_bundle(v2_payload, sequence=2, version="2.0.0", remove=["models/old"])
    await apply_update(b2_fixed, store, trusted_keys, onnx_health_check)
    assert read_tree(store.current) == v2


async def test_first_update_failing_leaves_nothing_current(
    tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path, v1: Tree
) -> None:
    store = ReleaseStore(tmp_path / "store")
    bundle, _ = make_bundle(v1, sequence=1)

    async def fail(release: Path) -> None:
        raise RuntimeError("warm-up request returned 500")

    with pytest.raises(HealthCheckFailed, match=r"warm-up request returned 500.*no release"):
        await apply_update(bundle, store, trusted_keys, fail)
    assert not store.current.is_symlink()
    assert store.status().current is None


async def test_cancelled_health_check_switches_back(
    tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path, read_tree: ReadTree,
    v1: Tree, v2_payload: Tree
) -> None:
    store = ReleaseStore(tmp_path / "store")
    b1, _ = make_bundle(v1, sequence=1)
    b2, _ = make_bundle(v2_payload, sequence=2)
    await apply_update(b1, store, trusted_keys, None)
    started = asyncio.Event()

    async def slow(release: Path) -> None:
        started.set()
        await asyncio.sleep(60)

    task = asyncio.create_task(apply_update(b2, store, trusted_keys, slow))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert read_tree(store.current) == v1
    assert store.status().pending is None


async def test_busy_store(tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path,
                          v1: Tree) -> None:
    store = ReleaseStore(tmp_path / "store")
    bundle, _ = make_bundle(v1, sequence=1)
    with store.locked():
        with pytest.raises(StoreBusy, match=r"busy"):
            await apply_update(bundle, store, trusted_keys, None)
        # Another process (another ReleaseStore on the same root) is refused by the flock.
        with pytest.raises(StoreBusy, match=r"locked by another process"):
            await apply_update(bundle, ReleaseStore(store.root), trusted_keys, None)
    await apply_update(bundle, store, trusted_keys, None)
    assert store.status().current == "1-1.0.0"


async def test_apply_keeps_n_releases(tmp_path: Path, make_bundle: BundleMaker,
                                      trusted_keys: Path, v1: Tree) -> None:
    store = ReleaseStore(tmp_path / "store")
    for seq in range(1, 6):
        files = dict(v1, **{"configs/edged.toml": f"# release {seq}\n".encode()})
        bundle, _ = make_bundle(files, sequence=seq, version=f"1.{seq}")
        result = await apply_update(bundle, store, trusted_keys, None, keep=2)
    assert result.pruned == ["3-1.3"]
    assert sorted(p.name for p in store.releases.iterdir()) == ["4-1.4", "5-1.5"]
    assert store.status().rollback_to == "4-1.4"


# --- crash safety ---------------------------------------------------------------------------

_CRASHING_APPLY = """
import asyncio, os, sys
from pathlib import Path
from daemon.updates.apply import apply_update, commit_update
from daemon.updates.store import ReleaseStore

bundle, root, keys, crash_at = sys.argv[1:5]
commit = sys.argv[5:] != ["no-commit"]

def checkpoint(step: str) -> None:
    if step == crash_at:
        os._exit(1)  # no cleanup, no finally blocks: as close to power loss as a process gets

async def healthy(release: Path) -> None:
    pass

asyncio.run(apply_update(Path(bundle), ReleaseStore(Path(root)), Path(keys), healthy,
                         checkpoint=checkpoint, commit=commit))
print("finished")
"""

STEPS_BEFORE_COMMIT = ["verified", "extracted", "carried-over", "staged", "switched", "checked"]


@pytest.mark.parametrize("step", [*STEPS_BEFORE_COMMIT, "committed", "never"])
async def test_crash_at_each_step_leaves_a_complete_release(
    step: str, tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path,
    read_tree: ReadTree, v1: Tree, v2_payload: Tree, v2: Tree
) -> None:
    store = ReleaseStore(tmp_path / "store")
    b1, _ = make_bundle(v1, sequence=1)
    b2, _ = make_bundle(v2_payload, sequence=2, remove=["models/old"])
    await apply_update(b1, store, trusted_keys, None)

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASHING_APPLY, str(b2), str(store.root), str(trusted_keys), step,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    if step == "never":
        assert proc.returncode == 0 and b"finished" in out, err.decode()
    else:
        assert proc.returncode == 1, err.decode()  # it really died at that step
        assert b"finished" not in out

    notes = store.recover()  # what the daemon does at start-up

    tree = read_tree(store.current)
    if step in STEPS_BEFORE_COMMIT:
        assert tree == v1
        assert store.status().current == "1-1.0.0"
    else:
        assert tree == v2
        assert store.status().current == "2-1.0.0"
    assert store.status().pending is None
    assert not list(store.staging.iterdir())
    assert not (store.root / "current.tmp").exists()
    if step in ("extracted", "carried-over"):
        assert any("half-staged" in n for n in notes)
    if step in ("switched", "checked"):
        assert any("interrupted before commit" in n for n in notes)

    # After recovery the store works: the interrupted update can simply be applied again.
    if step in STEPS_BEFORE_COMMIT:
        await apply_update(b2, store, trusted_keys, onnx_health_check)
        assert read_tree(store.current) == v2
    else:
        with pytest.raises(UpdateConflict):
            await apply_update(b2, store, trusted_keys, None)


@pytest.mark.parametrize("step", ["switched", "checked", "installed", "never"])
async def test_crash_during_a_two_phase_apply(
    step: str, tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path,
    read_tree: ReadTree, v1: Tree, v2_payload: Tree, v2: Tree
) -> None:
    """kill -9 during `apply --no-commit`: before the release is marked installed, recovery
    goes back; once installed, the pending release survives the crash and a restart, and
    commit or rollback finishes it."""
    store = ReleaseStore(tmp_path / "store")
    b1, _ = make_bundle(v1, sequence=1)
    b2, _ = make_bundle(v2_payload, sequence=2, remove=["models/old"])
    await apply_update(b1, store, trusted_keys, None)

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASHING_APPLY, str(b2), str(store.root), str(trusted_keys), step,
        "no-commit", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == (0 if step == "never" else 1), err.decode()

    store.recover()  # what the daemon does at start-up
    status = store.status()
    if step in ("switched", "checked"):
        assert (status.current, status.pending) == ("1-1.0.0", None)
        assert read_tree(store.current) == v1
        return
    assert (status.current, status.pending, status.pending_installed) == ("2-1.0.0", "2-1.0.0", True)
    assert read_tree(store.current) == v2
    assert store.recover() == []  # a second restart keeps it too
    with pytest.raises(UpdateConflict, match=r"waits for `edged update commit`"):
        await apply_update(b2, store, trusted_keys, None)
    done = await commit_update(store)
    assert done.release == "2-1.0.0"
    status = store.status()
    assert (status.current, status.pending, status.last_sequence) == ("2-1.0.0", None, 2)


async def test_warm_up_ranks_on_a_reranker_and_embeds_on_an_embedder() -> None:
    """The daemon's health check warms a reranker with a rerank (its embed is a 400) and an
    embedding model with an embed."""
    from types import SimpleNamespace

    from daemon.core.releases import ReleaseManager
    from daemon.errors import InvalidArgument

    calls: list[str] = []

    class Generator:
        def __init__(self, ranks: bool) -> None:
            self.ranks = ranks

        def reranker(self) -> bool:
            return self.ranks

        async def rerank(self, query: str, documents: list[str]) -> tuple[list[float], int]:
            calls.append(f"rerank {query} {documents}")
            return [0.5], 3

        async def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
            if self.ranks:
                raise InvalidArgument("is a reranker")
            calls.append(f"embed {texts}")
            return [[1.0]], 1

    config = SimpleNamespace(parameters={"embedding": "true"})
    models = {name: SimpleNamespace(generator=Generator(name == "ranker"), config=config) for name in ("ranker", "embedder")}
    manager = ReleaseManager.__new__(ReleaseManager)
    await manager._warm_up("ranker", models["ranker"])  # type: ignore[arg-type]
    await manager._warm_up("embedder", models["embedder"])  # type: ignore[arg-type]
    assert calls == ["rerank Hello ['Hello']", "embed ['Hello']"]
