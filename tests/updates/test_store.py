"""ReleaseStore: rollback, prune, recovery from interrupted switches, and the atomic link."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.updates.apply import apply_update
from daemon.updates.errors import UpdateConflict, UpdateError
from daemon.updates.manifest import Manifest
from daemon.updates.store import ReleaseStore

Tree = dict[str, bytes]
BundleMaker = Callable[..., tuple[Path, Manifest]]
ReadTree = Callable[[Path], Tree]


def _tree(n: int) -> Tree:
    return {
        "models/m/1/model.onnx": f"weights v{n}".encode(),
        "configs/edged.toml": f"# release {n}\n".encode(),
    }


async def _store_with(n: int, tmp_path: Path, make_bundle: BundleMaker,
                      trusted_keys: Path) -> ReleaseStore:
    store = ReleaseStore(tmp_path / "store")
    for seq in range(1, n + 1):
        bundle, _ = make_bundle(_tree(seq), sequence=seq, version=f"1.{seq}")
        await apply_update(bundle, store, trusted_keys, None, keep=10)
    return store


async def test_rollback(tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path,
                        read_tree: ReadTree) -> None:
    store = await _store_with(3, tmp_path, make_bundle, trusted_keys)
    assert read_tree(store.current) == _tree(3)
    assert store.rollback().name == "2-1.2"
    assert read_tree(store.current) == _tree(2)
    assert store.rollback().name == "1-1.1"
    assert read_tree(store.current) == _tree(1)
    with pytest.raises(UpdateConflict, match=r"no earlier release to roll back to"):
        store.rollback()
    assert read_tree(store.current) == _tree(1)
    assert [h.action for h in store.status().history][-2:] == ["rolled-back", "rolled-back"]
    # A rollback does not reopen the door to the rolled-back sequence...
    again, _ = make_bundle(_tree(3), sequence=3, version="1.3")
    with pytest.raises(UpdateConflict, match=r"last applied sequence 3"):
        await apply_update(again, store, trusted_keys, None)
    # ...a newer bundle is needed.
    newer, _ = make_bundle(_tree(4), sequence=4, version="1.4")
    await apply_update(newer, store, trusted_keys, None)
    assert read_tree(store.current) == _tree(4)


async def test_prune_keeps_n(tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path,
                             read_tree: ReadTree) -> None:
    store = await _store_with(5, tmp_path, make_bundle, trusted_keys)
    assert len(list(store.releases.iterdir())) == 5
    removed = store.prune(keep=2)
    assert sorted(removed) == ["1-1.1", "2-1.2", "3-1.3"]
    assert sorted(p.name for p in store.releases.iterdir()) == ["4-1.4", "5-1.5"]
    assert read_tree(store.current) == _tree(5)
    assert store.rollback().name == "4-1.4"
    with pytest.raises(UpdateConflict):
        store.rollback()  # 3 was pruned
    # keep=0 still keeps the live release.
    store.prune(keep=0)
    assert [p.name for p in store.releases.iterdir()] == ["4-1.4"]
    assert read_tree(store.current) == _tree(4)


async def test_recover_finishes_an_interrupted_rollback(tmp_path: Path, make_bundle: BundleMaker,
                                                        trusted_keys: Path,
                                                        read_tree: ReadTree) -> None:
    store = await _store_with(2, tmp_path, make_bundle, trusted_keys)
    # rollback() records its intent before moving the link; simulate dying in between.
    with store.locked():
        state = store.load_state()
        state.committed.pop()
        store._save(state)
    assert read_tree(store.current) == _tree(2)
    notes = store.recover()
    assert notes == ["current repointed to 1-1.1"]
    assert read_tree(store.current) == _tree(1)


async def test_recover_cleans_a_half_made_switch(tmp_path: Path, make_bundle: BundleMaker,
                                                 trusted_keys: Path, read_tree: ReadTree) -> None:
    store = await _store_with(2, tmp_path, make_bundle, trusted_keys)
    # Died after creating current.tmp, before renaming it over current; and mid-staging.
    os.symlink("releases/1-1.1", store.root / "current.tmp")
    (store.staging / "3-1.3.abcd" / "models").mkdir(parents=True)
    (store.staging / "3-1.3.abcd" / "models" / "partial.onnx").write_bytes(b"half")
    notes = store.recover()
    assert "removed current.tmp" in notes
    assert "removed half-staged 3-1.3.abcd" in notes
    assert read_tree(store.current) == _tree(2)
    assert store.recover() == []  # nothing left to do


def test_switch(tmp_path: Path) -> None:
    store = ReleaseStore(tmp_path / "store")
    with store.locked():
        a = store.releases / "1-a"
        b = store.releases / "2-b"
        a.mkdir()
        b.mkdir()
        store.switch(a)
        assert os.readlink(store.current) == "releases/1-a"
        store.switch(b)
        assert os.readlink(store.current) == "releases/2-b"
        assert not (store.root / "current.tmp").exists()
        with pytest.raises(UpdateError, match=r"is not a release"):
            store.switch(tmp_path)
        store.switch(None)
        assert not store.current.is_symlink()


def test_low_level_steps_need_the_lock(tmp_path: Path) -> None:
    store = ReleaseStore(tmp_path / "store")
    with pytest.raises(RuntimeError, match=r"locked"):
        store.commit()


def test_empty_store_status(tmp_path: Path) -> None:
    status = ReleaseStore(tmp_path / "nothing-here").status()
    assert (status.current, status.last_sequence, status.releases) == (None, 0, [])


def test_corrupt_state_is_reported(tmp_path: Path) -> None:
    store = ReleaseStore(tmp_path / "store")
    store.root.mkdir()
    (store.root / "state.json").write_text('{"last_sequence": "many"}')
    with pytest.raises(UpdateError, match=r"state.json is invalid"):
        store.status()
