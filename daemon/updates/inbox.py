"""Watch a directory (e.g. a mounted USB stick) for bundles and apply each one once."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from daemon.errors import EdgedError
from daemon.updates.bundle import BUNDLE_SUFFIX
from daemon.updates.errors import PendingRelease, StoreBusy

log = logging.getLogger(__name__)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


async def watch_inbox(
    inbox: Path, apply: Callable[[Path], Awaitable[object]], interval: float
) -> None:
    """Poll `inbox` every `interval` seconds for `*.edgebundle` files and `apply` each.

    A file is picked up only once its size and mtime held still for one interval (a copy to the
    stick may be in progress). Bundles are remembered by sha256 once they reached a verdict
    (applied, or rejected with an EdgedError), so a bad bundle is reported once instead of every
    poll; an I/O error (stick pulled out mid-read), a busy store or a two-phase release waiting for
    commit is retried. A missing inbox is waited for.
    Nothing short of cancellation stops the loop.
    """
    seen: set[str] = set()
    sizes: dict[Path, tuple[int, int]] = {}
    while True:
        try:
            await _poll(Path(inbox), apply, seen, sizes)
        except Exception:  # the watcher must outlive any single bad bundle or I/O hiccup
            log.exception("update inbox %s: poll failed", inbox)
        await asyncio.sleep(interval)


async def _poll(
    inbox: Path,
    apply: Callable[[Path], Awaitable[object]],
    seen: set[str],
    sizes: dict[Path, tuple[int, int]],
) -> None:
    try:
        candidates = sorted(p for p in inbox.iterdir() if p.name.endswith(BUNDLE_SUFFIX))
    except OSError:
        sizes.clear()
        return
    for gone in set(sizes) - set(candidates):
        del sizes[gone]
    for path in candidates:
        try:
            st = path.stat()
        except OSError:
            continue
        if not path.is_file():
            continue
        stamp = (st.st_size, st.st_mtime_ns)
        if sizes.get(path) != stamp:
            sizes[path] = stamp  # changed (or new): look again next poll
            continue
        try:
            digest = await asyncio.to_thread(_sha256, path)
        except OSError as exc:
            log.warning("update inbox: cannot read %s: %s", path, exc)
            continue
        if digest in seen:
            continue
        try:
            log.info("update inbox: applying %s", path)
            await apply(path)
        except (StoreBusy, PendingRelease) as exc:  # not a verdict on the bundle: retried
            log.info("update inbox: %s deferred: %s", path.name, exc.message)
        except EdgedError as exc:
            if path.exists():  # else the medium went away mid-read: not a verdict on the bundle
                seen.add(digest)
            log.error("update inbox: %s rejected: %s", path.name, exc.message)
        except OSError as exc:
            log.warning("update inbox: %s could not be read (%s); will retry", path.name, exc)
        except Exception:
            seen.add(digest)
            log.exception("update inbox: applying %s failed", path.name)
        else:
            seen.add(digest)
            log.info("update inbox: applied %s", path.name)
