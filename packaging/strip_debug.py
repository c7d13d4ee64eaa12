"""Debug information out of the executable's shared libraries, their loadable segments untouched.

Many wheels (aiohttp, uvloop, yaml, brotli, ...), libpython and CPython's own extension
modules keep their DWARF sections: 50 MB of the 404 MB onedir, measured 2026-12-06. Nothing
reads them at run time (a debugger can use the wheel's own file).

`strip --strip-debug` removes only sections the loader never maps. It is not PyInstaller's
`strip=True`, which runs a plain `strip` on every binary: binutils then rewrites the layout of
a library that patchelf edited (auditwheel's repaired wheels), and numpy's OpenBLAS stopped
loading here ("ELF load command address/offset not page-aligned"). Even `--strip-debug` moves
that library's segments. So each library is stripped to a copy, and the copy replaces it only
when it is smaller and its program headers (what the dynamic loader maps) are byte for byte the
original's; otherwise the original ships as it was.

    python packaging/strip_debug.py DIR    # what packaging/edged.spec runs on the built onedir

Without a `strip` program (binutils) it strips nothing and says so: the executable works the
same, only larger.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ELF_MAGIC = b"\x7fELF"


def program_headers(path: Path) -> bytes | None:
    """The raw program header table of an ELF file; None when `path` is not ELF."""
    with path.open("rb") as file:
        ident = file.read(64)
        if len(ident) < 52 or ident[:4] != ELF_MAGIC:
            return None
        order = "<" if ident[5] == 1 else ">"
        if ident[4] == 2:  # ELFCLASS64
            (offset,) = struct.unpack_from(order + "Q", ident, 0x20)
            size, count = struct.unpack_from(order + "HH", ident, 0x36)
        else:
            (offset,) = struct.unpack_from(order + "I", ident, 0x1C)
            size, count = struct.unpack_from(order + "HH", ident, 0x2A)
        file.seek(offset)
        return file.read(size * count)


def strip_file(path: Path, strip: str) -> int:
    """Strip `path`'s debug sections in place if that leaves its segments as they were;
    the bytes saved (0 when the file was kept)."""
    headers = program_headers(path)
    if headers is None:
        return 0
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        stripped = Path(scratch) / path.name
        done = subprocess.run(
            [strip, "--strip-debug", "-o", str(stripped), str(path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
        )
        if done.returncode != 0 or not stripped.is_file():
            return 0  # not something strip knows (an ELF of another machine): ship it as it is
        saved = path.stat().st_size - stripped.stat().st_size
        if saved <= 0 or program_headers(stripped) != headers:
            return 0
        os.chmod(stripped, path.stat().st_mode & 0o7777)
        os.replace(stripped, path)
        return saved


def is_shared_library(path: Path) -> bool:
    return path.suffix == ".so" or ".so." in path.name


def strip_tree(root: Path, strip: str) -> tuple[int, int]:
    """Every shared library under `root`: (files stripped, bytes saved). Not the executable:
    PyInstaller appends its archive to the bootloader, outside any section, and strip would drop
    it. Links are left alone (their target is stripped once)."""
    files = saved = 0
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file() or not is_shared_library(path):
            continue
        gained = strip_file(path, strip)
        if gained:
            files += 1
            saved += gained
    return files, saved


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python packaging/strip_debug.py DIR", file=sys.stderr)
        return 2
    strip = shutil.which("strip")
    if strip is None:
        print("strip_debug.py: no `strip` program (binutils): the libraries keep their debug sections")
        return 0
    files, saved = strip_tree(Path(argv[0]), strip)
    print(f"strip_debug.py: debug sections removed from {files} libraries, {saved / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
