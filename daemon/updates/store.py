"""The release store: complete, immutable releases and an atomically switched `current` link.

    root/
      releases/<sequence>-<version>/{models,configs,plugins,manifest.json}
      current -> releases/<name>     (relative symlink; the daemon serves root/current/...)
      staging/                       (releases being built; never pointed at)
      state.json                     (committed releases, pending switch, last sequence, history)
      lock                           (flock: one writer at a time, daemon or CLI)
      active                         (written by a running daemon: the release it serves, its pid)

Invariant: `current` always names a complete release, because a release is built under
staging/ and renamed into releases/ only once every file is written and synced. state.json
records intent before the link moves, so recover() can finish or undo any interrupted step.

Two-phase updates: a pending release is either *switching* (an apply holds the lock; a crash
leaves it for recover() to undo) or *installed* (`apply --no-commit` finished: `current` points at
it and it waits for `commit` or `rollback`; recover() keeps it). Prune never removes the live,
the pending, the `current` or the daemon's active release.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import msgspec

from daemon.updates.errors import PendingRelease, StoreBusy, UpdateConflict, UpdateError
from daemon.updates.fsutil import atomic_write, fsync_dir, link_or_copy_tree, seal_tree
from daemon.updates.manifest import CATEGORIES, Manifest, encode_manifest, split_path

log = logging.getLogger(__name__)

Checkpoint = Callable[[str], None]
Action = Literal["committed", "failed", "interrupted", "rolled-back", "pruned"]
_HISTORY_LIMIT = 200


class HistoryEntry(msgspec.Struct, forbid_unknown_fields=True):
    at: str
    action: Action
    release: str
    detail: str = ""


class StoreState(msgspec.Struct, forbid_unknown_fields=True):
    format: Literal[1] = 1
    # Highest sequence ever committed: the replay/downgrade guard. A manual rollback does not
    # lower it, so the bundle that was rolled back cannot simply be applied again.
    last_sequence: int = 0
    # Committed releases, oldest first; the last one is live. rollback() pops it.
    committed: list[str] = []
    # Release that `current` was (or is about to be) switched to but not yet committed.
    pending: str | None = None
    # True once the pending release finished installing (two-phase apply): it survives restarts
    # and waits for commit or rollback. False while an apply is still switching to it.
    pending_installed: bool = False
    history: list[HistoryEntry] = []

    @property
    def live(self) -> str | None:
        return self.committed[-1] if self.committed else None


class ActiveRelease(msgspec.Struct, forbid_unknown_fields=True):
    """What a running daemon serves (the `active` file); prune keeps it while `pid` lives."""

    release: str | None
    pid: int


class StoreStatus(msgspec.Struct, forbid_unknown_fields=True):
    root: str
    current: str | None
    pending: str | None
    pending_installed: bool
    last_sequence: int
    rollback_to: str | None
    releases: list[str]
    history: list[HistoryEntry]


def _now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def release_sequence(name: str) -> int:
    """Sequence number of a release directory name; -1 for anything that is not one."""
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else -1


class ReleaseStore:
    """One store directory. Mutating methods other than recover/rollback/prune must be called
    inside `with store.locked():` (apply_update does that)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.releases = self.root / "releases"
        self.staging = self.root / "staging"
        self.current = self.root / "current"
        self._state_path = self.root / "state.json"
        self._active_path = self.root / "active"
        self._lock_fd: int | None = None

    # --- locking and state -----------------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive use of the store across processes; UpdateConflict if someone else has it.

        Not re-entrant, on purpose: in the daemon two coroutines share one ReleaseStore, and a
        rollback must not slip in while an apply awaits its health check.
        """
        self.root.mkdir(mode=0o750, parents=True, exist_ok=True)
        for d in (self.releases, self.staging):
            d.mkdir(mode=0o750, exist_ok=True)
        if self._lock_fd is not None:
            raise StoreBusy(f"release store {self.root} is busy with another update")
        try:
            # Read-only is enough for flock, and works on a lock file another user created.
            fd = os.open(self.root / "lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            raise UpdateError(f"cannot open {self.root / 'lock'}: {exc.strerror}; run as the "
                              "user that owns the release store") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreBusy(f"release store {self.root} is locked by another process "
                                 "(an update is in progress)") from None
        self._lock_fd = fd
        try:
            yield
        finally:
            self._lock_fd = None
            os.close(fd)  # releases the flock

    def _require_lock(self) -> None:
        if self._lock_fd is None:
            raise RuntimeError("ReleaseStore: call this inside `with store.locked():`")

    def load_state(self) -> StoreState:
        try:
            data = self._state_path.read_bytes()
        except FileNotFoundError:
            return StoreState()
        try:
            return msgspec.json.decode(data, type=StoreState)
        except msgspec.DecodeError as exc:
            raise UpdateError(f"{self._state_path} is invalid: {exc}") from None

    def _save(self, state: StoreState) -> None:
        del state.history[:-_HISTORY_LIMIT]
        atomic_write(self._state_path, msgspec.json.format(msgspec.json.encode(state)))

    def _record(self, state: StoreState, action: Action, release: str, detail: str = "") -> None:
        state.history.append(HistoryEntry(at=_now(), action=action, release=release, detail=detail))

    # --- queries ---------------------------------------------------------------------------

    def release_path(self, name: str) -> Path:
        return self.releases / name

    def current_release(self) -> Path | None:
        """The release `current` points at, resolved (load from this, not via the link, so a
        switch during a load cannot mix two releases)."""
        try:
            target = os.readlink(self.current)
        except FileNotFoundError:
            return None
        return (self.root / target).resolve()

    def status(self) -> StoreStatus:
        state = self.load_state()
        current = self.current_release()
        names = sorted(
            (p.name for p in self.releases.iterdir() if p.is_dir()), key=release_sequence
        ) if self.releases.is_dir() else []
        return StoreStatus(
            root=str(self.root),
            current=current.name if current else None,
            pending=state.pending,
            pending_installed=state.pending is not None and state.pending_installed,
            last_sequence=state.last_sequence,
            rollback_to=state.committed[-2] if len(state.committed) > 1 else None,
            releases=names,
            history=state.history[-20:],
        )

    def set_active(self, release: Path | None) -> None:
        """Record the release this process now serves (a daemon calls this on every reload)."""
        if not self.root.is_dir():
            return  # no store yet: nothing for a prune to protect
        record = ActiveRelease(release=release.name if release is not None else None, pid=os.getpid())
        try:
            atomic_write(self._active_path, msgspec.json.encode(record))
        except OSError as exc:  # a read-only store still serves; prune just cannot see us
            log.warning("cannot record the active release in %s: %s", self._active_path, exc)

    def active_release(self) -> str | None:
        """The release a live daemon serves, from the `active` file; None if no daemon lives."""
        try:
            record = msgspec.json.decode(self._active_path.read_bytes(), type=ActiveRelease)
        except (OSError, msgspec.DecodeError):
            return None
        return record.release if _pid_alive(record.pid) else None

    def check_sequence(self, manifest: Manifest) -> None:
        last = self.load_state().last_sequence
        if manifest.sequence <= last:
            raise UpdateConflict(
                f"bundle {manifest.bundle_version} has sequence {manifest.sequence}, not newer "
                f"than the last applied sequence {last}: downgrade or replay refused"
            )

    # --- building and switching (inside locked()) ------------------------------------------

    def stage(self, bundle: Path, manifest: Manifest, checkpoint: Checkpoint | None = None) -> Path:
        """Build the complete release for a verified bundle; returns releases/<name>.

        The payload is extracted into staging/, everything the bundle does not replace is
        carried over from the live release (hard links), all of it is synced, and only then is
        the directory renamed into releases/.
        """
        self._require_lock()
        name = manifest.release_name
        final = self.release_path(name)
        state = self.load_state()
        if name in state.committed:
            raise UpdateConflict(f"release {name} is already committed")
        if final.exists():  # left by an earlier attempt that failed its health check
            shutil.rmtree(final)
        free = shutil.disk_usage(self.root).free
        if manifest.payload_bytes > free:
            raise UpdateError(f"bundle {manifest.bundle_version} needs {manifest.payload_bytes} "
                              f"bytes in {self.root}, {free} are free")
        work = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=self.staging))
        try:
            # Imported here: bundles need `cryptography`, the daemon's start does not.
            from daemon.updates.bundle import extract_payload

            extract_payload(bundle, manifest, work)
            if checkpoint:
                checkpoint("extracted")
            live = state.live
            for category in CATEGORIES:
                (work / category).mkdir(exist_ok=True)
                if live is None:
                    continue
                dropped = set(manifest.replaces.of(category))
                dropped.update(split_path(f.path)[1] for f in manifest.files
                               if f.path.startswith(category + "/"))
                source = self.release_path(live) / category
                for entry in sorted(source.iterdir()) if source.is_dir() else []:
                    if entry.name not in dropped:
                        link_or_copy_tree(entry, work / category / entry.name)
            if checkpoint:
                checkpoint("carried-over")
            (work / "manifest.json").write_bytes(encode_manifest(manifest))
            seal_tree(work)
            work.chmod(0o755)
            os.rename(work, final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        fsync_dir(self.releases)
        fsync_dir(self.staging)
        return final

    def switch(self, release: Path | None) -> None:
        """Point `current` at `release` atomically (None removes it): a new link is made under a
        temporary name and renamed over the old one, then the directory is synced."""
        if release is None:
            try:
                self.current.unlink()
            except FileNotFoundError:
                return
            fsync_dir(self.root)
            return
        release = Path(release)
        if release.parent != self.releases or not release.is_dir():
            raise UpdateError(f"{release} is not a release of the store {self.root}")
        tmp = self.root / "current.tmp"
        with suppress(FileNotFoundError):
            tmp.unlink()
        # Relative, so the store keeps working when mounted elsewhere (e.g. in a chroot).
        os.symlink(os.path.relpath(release, self.root), tmp)
        os.replace(tmp, self.current)
        fsync_dir(self.root)

    def begin(self, release: Path) -> None:
        """Record `release` as pending, then switch to it (intent first, for recover())."""
        self._require_lock()
        state = self.load_state()
        state.pending = release.name
        state.pending_installed = False
        self._save(state)
        self.switch(release)

    def mark_installed(self) -> str:
        """Two-phase apply: the switched-to release stays pending across restarts until commit
        or rollback; returns its name."""
        self._require_lock()
        state = self.load_state()
        if state.pending is None:
            raise UpdateConflict(f"release store {self.root} has no pending release")
        state.pending_installed = True
        self._save(state)
        return state.pending

    def require_no_pending(self) -> None:
        state = self.load_state()
        if state.pending is not None:
            raise PendingRelease(
                f"release {state.pending} is installed and waits for `edged update commit` or "
                "`edged update rollback`; finish that first"
            )

    def commit(self) -> str:
        """Make the pending release the committed, live one; returns its name."""
        self._require_lock()
        state = self.load_state()
        if state.pending is None:
            raise UpdateConflict(f"release store {self.root} has no pending release to commit")
        name = state.pending
        state.committed.append(name)
        state.pending = None
        state.pending_installed = False
        state.last_sequence = max(state.last_sequence, release_sequence(name))
        self._record(state, "committed", name)
        self._save(state)
        return name

    def abort(self, detail: str, action: Action = "failed") -> Path | None:
        """Switch back from the pending release to the live one; returns the live release."""
        self._require_lock()
        state = self.load_state()
        live = self.release_path(state.live) if state.live else None
        self.switch(live)
        if state.pending is not None:
            self._record(state, action, state.pending, detail)
            state.pending = None
            state.pending_installed = False
            self._save(state)
        return live

    # --- self-locking operations -----------------------------------------------------------

    def recover(self) -> list[str]:
        """Undo whatever a crash interrupted; call once at start-up. Returns what it did.

        Half-built releases in staging/ are deleted; an uncommitted switch is switched back to
        the last committed release; `current` is made to match state.json.
        """
        with self.locked():
            return self._recover()

    def _recover(self) -> list[str]:
        notes: list[str] = []
        for leftover in sorted(self.staging.iterdir()):
            shutil.rmtree(leftover, ignore_errors=True)
            notes.append(f"removed half-staged {leftover.name}")
        try:
            (self.root / "current.tmp").unlink()
            notes.append("removed current.tmp")
        except FileNotFoundError:
            pass
        state = self.load_state()
        if state.pending is not None and not (
            state.pending_installed and self.release_path(state.pending).is_dir()
        ):
            notes.append(f"update to {state.pending} was interrupted before commit; back to "
                         f"{state.live or 'no release'}")
            self.abort("interrupted before commit (crash or restart)", action="interrupted")
            state = self.load_state()
        # An installed pending release stays current until commit or rollback.
        serve = state.pending or state.live
        target = self.release_path(serve) if serve else None
        if self.current_release() != (target.resolve() if target else None):
            self.switch(target)
            notes.append(f"current repointed to {serve or 'nothing'}")
        for note in notes:
            log.warning("release store %s: %s", self.root, note)
        return notes

    def commit_pending(self, keep: int = 3) -> tuple[str, list[str]]:
        """Second phase: commit the installed pending release, then prune; (name, pruned)."""
        with self.locked():
            self._recover()
            name = self.commit()
            return name, self._prune(keep)

    def rollback(self, *, only_pending: bool = False) -> Path | None:
        """Undo the pending release if there is one (back to the live release, None when there
        is none); otherwise go back to the release committed before the live one. With
        `only_pending`, no pending release means nothing to do: returns `current` unchanged."""
        with self.locked():
            self._recover()
            state = self.load_state()
            if state.pending is not None:
                return self.abort("rolled back before commit", action="rolled-back")
            if only_pending:
                return self.current_release()
            if len(state.committed) < 2:
                raise UpdateConflict(f"release store {self.root} has no earlier release to roll "
                                     "back to")
            previous = self.release_path(state.committed[-2])
            if not previous.is_dir():
                raise UpdateConflict(f"release {previous.name} is gone; cannot roll back")
            left = state.committed.pop()
            self._record(state, "rolled-back", left, f"back to {previous.name}")
            self._save(state)  # intent first: a crash before the switch is finished by recover()
            self.switch(previous)
            return previous

    def prune(self, keep: int = 3) -> list[str]:
        with self.locked():
            return self._prune(keep)

    def _prune(self, keep: int) -> list[str]:
        """Delete all but the newest `keep` committed releases and any release directory that is
        neither committed nor pending. Never removed: the live and the pending release, the one
        `current` names, and the one a running daemon serves (it may not have reloaded yet)."""
        self._require_lock()
        keep = max(keep, 1)
        state = self.load_state()
        kept = set(state.committed[-keep:])
        current = self.current_release()
        for name in (state.pending, current.name if current else None, self.active_release()):
            if name:
                kept.add(name)
        removed = [p.name for p in self.releases.iterdir() if p.name not in kept]
        if not removed:
            return []
        state.committed = [name for name in state.committed if name not in removed]
        for name in removed:
            self._record(state, "pruned", name)
        self._save(state)  # forget them first: a crash mid-delete leaves only unreferenced dirs
        for name in sorted(removed, key=release_sequence):
            shutil.rmtree(self.release_path(name), ignore_errors=True)
        fsync_dir(self.releases)
        return removed
