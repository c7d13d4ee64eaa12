"""Two-phase apply for fleet managers: apply --no-commit -> health -> commit, or rollback; and
prune never removing the live, pending, current or active release."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.updates.apply import apply_update, commit_update, rollback_update
from daemon.updates.errors import HealthCheckFailed, UpdateConflict
from daemon.updates.manifest import Manifest
from daemon.updates.store import ReleaseStore

Tree = dict[str, bytes]
BundleMaker = Callable[..., tuple[Path, Manifest]]
ReadTree = Callable[[Path], Tree]


def _tree(n: int) -> Tree:
    return {"models/m/1/model.onnx": f"weights v{n}".encode()}


async def test_no_commit_then_commit(tmp_path: Path, make_bundle: BundleMaker,
                                     trusted_keys: Path, read_tree: ReadTree) -> None:
    store = ReleaseStore(tmp_path / "store")
    b1, _ = make_bundle(_tree(1), sequence=1, version="1")
    b2, _ = make_bundle(_tree(2), sequence=2, version="2")
    await apply_update(b1, store, trusted_keys, None)
    checked: list[str] = []

    async def health(release: Path) -> None:
        checked.append(release.name)

    result = await apply_update(b2, store, trusted_keys, health, commit=False)
    assert (result.release, result.committed, result.health_checked) == ("2-2", False, True)
    assert checked == ["2-2"]
    assert read_tree(store.current) == _tree(2)  # served while pending
    status = store.status()
    assert (status.pending, status.pending_installed, status.last_sequence) == ("2-2", True, 1)
    assert status.rollback_to is None  # nothing committed after 1-1 yet

    done = await commit_update(store)
    assert done.release == "2-2"
    status = store.status()
    assert (status.current, status.pending, status.last_sequence, status.rollback_to) == (
        "2-2", None, 2, "1-1")
    with pytest.raises(UpdateConflict, match="no pending release to commit"):
        await commit_update(store)


async def test_no_commit_then_rollback(tmp_path: Path, make_bundle: BundleMaker,
                                       trusted_keys: Path, read_tree: ReadTree) -> None:
    store = ReleaseStore(tmp_path / "store")
    b1, _ = make_bundle(_tree(1), sequence=1, version="1")
    b2, _ = make_bundle(_tree(2), sequence=2, version="2")
    await apply_update(b1, store, trusted_keys, None)
    await apply_update(b2, store, trusted_keys, None, commit=False)
    restored: list[Path | None] = []

    async def restore(release: Path | None) -> None:
        restored.append(release)

    back = await rollback_update(store, restore)
    assert back is not None and back.name == "1-1"
    assert restored == [back]
    assert read_tree(store.current) == _tree(1)
    status = store.status()
    assert (status.pending, status.last_sequence) == (None, 1)
    assert status.history[-1].action == "rolled-back"
    # Nothing pending any more: --if-pending does nothing, a plain rollback has no earlier release.
    assert (await rollback_update(store, only_pending=True)) == back
    assert read_tree(store.current) == _tree(1)
    with pytest.raises(UpdateConflict, match="no earlier release"):
        await rollback_update(store)
    # The rolled-back sequence was never committed: the same bundle may be installed again.
    await apply_update(b2, store, trusted_keys, None)
    assert read_tree(store.current) == _tree(2)


async def test_first_release_rolled_back_leaves_nothing_current(
    tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path
) -> None:
    store = ReleaseStore(tmp_path / "store")
    b1, _ = make_bundle(_tree(1), sequence=1, version="1")
    await apply_update(b1, store, trusted_keys, None, commit=False)
    assert store.status().current == "1-1"
    assert await rollback_update(store) is None
    assert store.status().current is None and not store.current.is_symlink()


async def test_failed_health_check_in_no_commit_mode_switches_back(
    tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path, read_tree: ReadTree
) -> None:
    store = ReleaseStore(tmp_path / "store")
    b1, _ = make_bundle(_tree(1), sequence=1, version="1")
    b2, _ = make_bundle(_tree(2), sequence=2, version="2")
    await apply_update(b1, store, trusted_keys, None)

    async def sick(release: Path) -> None:
        raise RuntimeError("model m did not load")

    with pytest.raises(HealthCheckFailed, match="model m did not load"):
        await apply_update(b2, store, trusted_keys, sick, commit=False)
    status = store.status()
    assert (status.current, status.pending) == ("1-1", None)


async def test_prune_keeps_pending_current_and_active(
    tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path
) -> None:
    store = ReleaseStore(tmp_path / "store")
    bundles = [make_bundle(_tree(n), sequence=n, version=str(n))[0] for n in range(1, 6)]
    await apply_update(bundles[0], store, trusted_keys, None)
    # A daemon (this process) serves 1-1 and has not reloaded since.
    store.set_active(store.releases / "1-1")
    assert store.active_release() == "1-1"
    await apply_update(bundles[1], store, trusted_keys, None, keep=1)
    await apply_update(bundles[2], store, trusted_keys, None, keep=1)
    assert sorted(p.name for p in store.releases.iterdir()) == ["1-1", "3-3"]
    # A pending release is never pruned, nor the live one, whatever `keep` says.
    await apply_update(bundles[3], store, trusted_keys, None, keep=1, commit=False)
    assert store.prune(keep=1) == []
    assert sorted(p.name for p in store.releases.iterdir()) == ["1-1", "3-3", "4-4"]
    await commit_update(store, keep=1)
    assert sorted(p.name for p in store.releases.iterdir()) == ["1-1", "4-4"]
    # Once that daemon is gone (a dead pid in `active`), its release may go.
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await child.wait()  # reaped: its pid names no process
    (store.root / "active").write_text(f'{{"release": "1-1", "pid": {child.pid}}}')
    assert store.active_release() is None
    assert store.prune(keep=1) == ["1-1"]
    assert sorted(p.name for p in store.releases.iterdir()) == ["4-4"]
    assert os.readlink(store.current) == "releases/4-4"
