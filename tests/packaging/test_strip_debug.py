"""packaging/strip_debug.py: the executable's libraries lose their debug sections, and a library
whose segments strip would move ships as it was.

Real files throughout: libraries compiled here with debug information (skipped without a C
compiler) and numpy's own OpenBLAS, a library auditwheel edited with patchelf, which binutils'
strip breaks (the reason the script checks the program headers).
"""

from __future__ import annotations

import ctypes
import shutil
import stat
import subprocess
from pathlib import Path

import numpy
import pytest

from support import REPO_ROOT, load_script

sd = load_script(REPO_ROOT / "packaging" / "strip_debug.py", "edged_strip_debug")

STRIP = shutil.which("strip")
CC = shutil.which("cc") or shutil.which("gcc")
needs_tools = pytest.mark.skipif(
    STRIP is None or CC is None or shutil.which("readelf") is None,
    reason="needs binutils (strip, readelf) and a C compiler",
)

SOURCE = "int answer(void) { return 42; }\nint main(void) { return answer() - 42; }\n"


def _compile(tmp_path: Path, name: str, *flags: str) -> Path:
    source = tmp_path / "answer.c"
    source.write_text(SOURCE, encoding="utf-8")
    out = tmp_path / name
    assert CC is not None
    subprocess.run([CC, "-g", "-O0", *flags, "-o", str(out), str(source)], check=True)
    return out


def _section_names(path: Path) -> str:
    return subprocess.run(["readelf", "-SW", str(path)], capture_output=True, text=True, check=True).stdout


@needs_tools
def test_a_library_loses_its_debug_sections_and_still_loads(tmp_path: Path) -> None:
    tree = tmp_path / "dist"
    (tree / "_internal").mkdir(parents=True)
    library = _compile(tmp_path, "libanswer.so", "-shared", "-fPIC")
    shipped = tree / "_internal" / "libanswer.so.1"
    shutil.copy2(library, shipped)
    shipped.chmod(0o750)
    (tree / "_internal" / "libanswer.so").symlink_to("libanswer.so.1")
    headers = sd.program_headers(shipped)
    assert ".debug_info" in _section_names(shipped)

    assert STRIP is not None
    files, saved = sd.strip_tree(tree, STRIP)

    assert files == 1 and saved == library.stat().st_size - shipped.stat().st_size > 0
    assert ".debug_info" not in _section_names(shipped)
    assert sd.program_headers(shipped) == headers
    assert stat.S_IMODE(shipped.stat().st_mode) == 0o750
    assert (tree / "_internal" / "libanswer.so").is_symlink()
    assert ctypes.CDLL(str(tree / "_internal" / "libanswer.so")).answer() == 42


@needs_tools
def test_the_executable_is_left_alone(tmp_path: Path) -> None:
    # PyInstaller's bootloader carries its archive after its sections: strip would cut it off.
    program = _compile(tmp_path, "edged")
    before = program.read_bytes()
    assert STRIP is not None
    assert sd.strip_tree(tmp_path, STRIP) == (0, 0)
    assert program.read_bytes() == before


@pytest.mark.skipif(STRIP is None, reason="needs binutils' strip")
def test_a_patchelf_edited_library_ships_unchanged(tmp_path: Path) -> None:
    libs = Path(numpy.__file__).parent.parent / "numpy.libs"
    blas = sorted(libs.glob("libscipy_openblas*.so*")) if libs.is_dir() else []
    if not blas:
        pytest.skip("this numpy wheel bundles no OpenBLAS in numpy.libs")
    shipped = tmp_path / blas[0].name
    shutil.copy2(blas[0], shipped)
    before = shipped.read_bytes()
    # What the check guards against: strip makes it smaller and moves its segments (as on
    # x86-64's numpy 2 wheels; another platform's build may give strip nothing to move).
    assert STRIP is not None
    moved = tmp_path / "moved.so"
    subprocess.run([STRIP, "--strip-debug", "-o", str(moved), str(shipped)], check=True)
    if moved.stat().st_size >= len(before) or sd.program_headers(moved) == sd.program_headers(shipped):
        pytest.skip("strip leaves this OpenBLAS's segments where they are")
    moved.unlink()

    assert sd.strip_tree(tmp_path, STRIP) == (0, 0)
    assert shipped.read_bytes() == before


def test_not_elf_and_no_strip_program(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = tmp_path / "notes.so"
    text.write_text("not a library", encoding="utf-8")
    assert sd.program_headers(text) is None
    assert sd.strip_file(text, "strip") == 0

    monkeypatch.setenv("PATH", str(tmp_path))  # no strip here
    assert sd.main([str(tmp_path)]) == 0
    assert "no `strip` program" in capsys.readouterr().out
