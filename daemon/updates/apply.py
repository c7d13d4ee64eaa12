"""Applying a bundle: verify, stage, switch, health-check, then commit or switch back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from daemon import __version__
from daemon.updates.bundle import verify_bundle
from daemon.updates.errors import HealthCheckFailed
from daemon.updates.manifest import check_targets
from daemon.updates.store import Checkpoint, ReleaseStore

log = logging.getLogger(__name__)

HealthCheck = Callable[[Path], Awaitable[None]]
# Bring the server in line with a release again (None: no release) after a switch back.
Restore = Callable[[Path | None], Awaitable[object]]


class AppliedUpdate(msgspec.Struct, forbid_unknown_fields=True):
    bundle_version: str
    sequence: int
    release: str
    pruned: list[str]
    health_checked: bool
    # False for a two-phase apply: the release is pending until commit or rollback.
    committed: bool = True


def _noop(_: str) -> None:
    pass


async def apply_update(
    path: Path,
    store: ReleaseStore,
    trusted_keys: Path,
    health_check: HealthCheck | None,
    progress: Callable[[str], None] = _noop,
    *,
    restore: Restore | None = None,
    daemon_version: str = __version__,
    keep: int = 3,
    checkpoint: Checkpoint | None = None,
    commit: bool = True,
) -> AppliedUpdate:
    """Apply the bundle at `path` to `store`. The one apply path: the daemon's HTTP route and
    inbox and the `edged update apply` command all come here; they differ only in the health
    check they pass (in-process reload, or asking the running daemon over its socket).

    `health_check(release_dir)` runs after `current` points at the new release (the daemon
    reloads its models from it and sends each a warm-up request); any exception fails the update:
    `current` is switched back to the previous release, `restore(previous_dir)` is awaited (the
    daemon reloads the old models) and HealthCheckFailed is raised. `checkpoint(step)` is called
    at each step boundary (a fault-injection hook for tests). Disk work runs in a thread: the
    event loop, and with it the systemd watchdog, keeps running during a multi-GB extraction.

    With `commit=False` (two-phase, for fleet managers) a healthy release is left *installed*:
    `current` points at it, it survives restarts, and `commit_update` or `rollback_update`
    finishes it.
    """
    path = Path(path)
    step = checkpoint or _noop
    progress(f"verifying {path.name}")
    manifest = await asyncio.to_thread(verify_bundle, path, trusted_keys)
    check_targets(manifest, daemon_version)
    step("verified")
    label = f"{manifest.bundle_version} (sequence {manifest.sequence})"
    progress(f"verified bundle {label}")
    with store.locked():
        await asyncio.to_thread(store._recover)
        store.require_no_pending()
        store.check_sequence(manifest)
        progress(f"staging {label}")
        release = await asyncio.to_thread(store.stage, path, manifest, checkpoint)
        step("staged")
        progress(f"switching to {release.name}")
        await asyncio.to_thread(store.begin, release)
        step("switched")
        if health_check is not None:
            progress(f"health check of {release.name}")
            try:
                await health_check(release)
            except BaseException as exc:  # cancellation too: never leave an unchecked switch
                detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                previous = await asyncio.to_thread(store.abort, f"health check failed: {detail}")
                back = previous.name if previous else "no release"
                progress(f"health check failed; switched back to {back}")
                if not isinstance(exc, Exception):
                    raise
                restored = ""
                if restore is not None:
                    try:
                        await restore(previous)
                    except Exception as restore_exc:
                        log.exception("restoring %s after a failed update", previous)
                        restored = f"; reloading {back} also failed: {restore_exc}"
                raise HealthCheckFailed(
                    f"bundle {label}: health check of release {release.name} failed ({detail}); "
                    f"switched back to {back}{restored}"
                ) from exc
            step("checked")
        if commit:
            name = await asyncio.to_thread(store.commit)
            step("committed")
            pruned = await asyncio.to_thread(store._prune, keep)
        else:
            name = await asyncio.to_thread(store.mark_installed)
            step("installed")
            pruned = []
    if commit:
        progress(f"committed {name}" + (f", pruned {', '.join(pruned)}" if pruned else ""))
    else:
        progress(f"installed {name}, not committed: `edged update commit` or `edged update rollback`")
    return AppliedUpdate(
        bundle_version=manifest.bundle_version,
        sequence=manifest.sequence,
        release=name,
        pruned=pruned,
        health_checked=health_check is not None,
        committed=commit,
    )


class Committed(msgspec.Struct, forbid_unknown_fields=True):
    release: str
    pruned: list[str]


async def commit_update(store: ReleaseStore, *, keep: int = 3) -> Committed:
    """Second phase: make the installed pending release the committed one, then prune."""
    name, pruned = await asyncio.to_thread(store.commit_pending, keep)
    return Committed(release=name, pruned=pruned)


async def rollback_update(
    store: ReleaseStore, restore: Restore | None = None, *, only_pending: bool = False
) -> Path | None:
    """Undo the pending release, or go back to the previous committed one; `restore(release)`
    (the daemon's reload) is awaited afterwards. Returns the release now current."""
    release = await asyncio.to_thread(store.rollback, only_pending=only_pending)
    if restore is not None:
        await restore(release)
    return release
