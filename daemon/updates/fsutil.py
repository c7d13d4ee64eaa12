"""Durability helpers: a rename or symlink swap is only crash-safe once its directory is synced."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o640) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new content."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def seal_tree(root: Path) -> None:
    """fsync every file and directory under `root` (children before parents) and clear group and
    other write bits, so the daemon's plugin ownership check accepts what was staged."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(Path(dirpath, name))
        for name in dirnames:
            fsync_dir(Path(dirpath, name))
        mode = stat.S_IMODE(os.stat(dirpath).st_mode)
        if mode & 0o022:
            os.chmod(dirpath, mode & ~0o022)
    fsync_dir(root)


def link_or_copy_tree(src: Path, dst: Path) -> None:
    """Recreate `src` at `dst` with hard links (releases never change in place, so sharing inodes
    between them is safe and costs no disk), copying where linking is not possible."""

    def link_or_copy(s: str, d: str) -> object:
        try:
            os.link(s, d, follow_symlinks=False)
        except OSError:  # another file system, or fs.protected_hardlinks for a foreign owner
            shutil.copy2(s, d, follow_symlinks=False)
        return d

    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=link_or_copy)
    else:
        link_or_copy(str(src), str(dst))
