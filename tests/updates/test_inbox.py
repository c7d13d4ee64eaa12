"""The inbox watcher, with real bundles applied to a real store."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.updates.apply import apply_update
from daemon.updates.inbox import watch_inbox
from daemon.updates.manifest import Manifest
from daemon.updates.store import ReleaseStore

BundleMaker = Callable[..., tuple[Path, Manifest]]


async def _until(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    # Polls on purpose: the condition is the store on disk, which has no event to wait on.
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_inbox_applies_good_bundles_once_and_survives_bad_ones(
    tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path,
    caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="daemon.updates.inbox")
    store = ReleaseStore(tmp_path / "store")
    inbox = tmp_path / "usb"  # not mounted yet
    calls: Counter[str] = Counter()

    async def apply(path: Path) -> None:
        calls[path.name] += 1
        await apply_update(path, store, trusted_keys, None)

    watcher = asyncio.create_task(watch_inbox(inbox, apply, interval=0.02))
    try:
        await asyncio.sleep(0.1)  # a missing inbox is waited for
        assert not watcher.done()
        inbox.mkdir()
        (inbox / "garbage.edgebundle").write_bytes(b"not a tar at all")
        good, _ = make_bundle({"models/m/1/model.onnx": b"w1"}, sequence=1)
        shutil.copy(good, inbox / "fleet-1.edgebundle")
        (inbox / "notes.txt").write_text("ignored: wrong suffix")
        await _until(lambda: store.status().current == "1-1.0.0")
        await _until(lambda: calls["garbage.edgebundle"] == 1)
        await asyncio.sleep(0.2)  # several more polls
        assert calls == Counter({"garbage.edgebundle": 1, "fleet-1.edgebundle": 1})
        assert "garbage.edgebundle rejected" in caplog.text
        assert not watcher.done()

        # A second stick with the next release: picked up too.
        good2, _ = make_bundle({"models/m/1/model.onnx": b"w2"}, sequence=2)
        shutil.copy(good2, inbox / "fleet-2.edgebundle")
        await _until(lambda: store.status().current == "2-1.0.0")
        assert calls["fleet-2.edgebundle"] == 1
        assert not watcher.done()
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher


async def test_inbox_waits_for_a_copy_to_finish(tmp_path: Path, make_bundle: BundleMaker,
                                                trusted_keys: Path) -> None:
    store = ReleaseStore(tmp_path / "store")
    inbox = tmp_path / "usb"
    inbox.mkdir()
    calls: list[str] = []

    async def apply(path: Path) -> None:
        calls.append(path.name)
        await apply_update(path, store, trusted_keys, None)

    good, _ = make_bundle({"models/m/1/model.onnx": b"w" * 100_000}, sequence=1)
    data = good.read_bytes()
    target = inbox / "slow.edgebundle"
    watcher = asyncio.create_task(watch_inbox(inbox, apply, interval=0.2))
    try:
        # Write it in pieces, far quicker than the poll interval: the file is never seen
        # unchanged across two polls until it is complete, so it is never tried half-written
        # (a half-written bundle would fail and show up as a second call).
        with target.open("wb") as f:
            for i in range(0, len(data), len(data) // 8):
                f.write(data[i:i + len(data) // 8])
                f.flush()
                await asyncio.sleep(0.01)
        await _until(lambda: store.status().current == "1-1.0.0")
        assert calls == ["slow.edgebundle"]  # the half-written file was never tried
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher


async def test_inbox_waits_while_a_two_phase_release_is_pending(
    tmp_path: Path, make_bundle: BundleMaker, trusted_keys: Path
) -> None:
    """A bundle dropped while a fleet manager's release waits for commit is retried once that
    is finished, not written off as rejected."""
    from daemon.updates.apply import commit_update

    store = ReleaseStore(tmp_path / "store")
    inbox = tmp_path / "usb"
    inbox.mkdir()
    b1, _ = make_bundle({"models/m/1/model.onnx": b"w1"}, sequence=1)
    await apply_update(b1, store, trusted_keys, None, commit=False)
    calls: list[str] = []

    async def apply(path: Path) -> None:
        calls.append(path.name)
        await apply_update(path, store, trusted_keys, None)

    b2, _ = make_bundle({"models/m/1/model.onnx": b"w2"}, sequence=2)
    shutil.copy(b2, inbox / "fleet-2.edgebundle")
    watcher = asyncio.create_task(watch_inbox(inbox, apply, interval=0.02))
    try:
        await _until(lambda: len(calls) >= 2)  # tried, deferred, tried again
        assert store.status().pending == "1-1.0.0"
        await commit_update(store)
        await _until(lambda: store.status().current == "2-1.0.0")
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher
