"""packaging/native.py: the infer hot path runs compiled, and compiled from its current source.

Every other test then runs the compiled modules (the daemons they start import the same files),
so these two checks are what makes the suite's pass mean "the shipped code passes".
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _load_native() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("edged_native_build", REPO / "packaging" / "native.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


native = _load_native()


def test_every_listed_module_is_compiled_from_its_current_source() -> None:
    assert native.problems() == [], "run `make test` (or `.venv/bin/python packaging/native.py build`)"


def test_the_daemon_imports_the_compiled_modules() -> None:
    names = native.module_names()
    # A fresh interpreter from the repository root, as the daemon's own command starts.
    code = "import importlib, sys; print('\\n'.join(importlib.import_module(n).__file__ for n in sys.argv[1:]))"
    files = subprocess.run(
        [sys.executable, "-c", code, *names], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(files) == len(names)
    for name, file in zip(names, files, strict=True):
        assert file.endswith(".so"), f"{name} imported from {file}"
        assert Path(file).is_relative_to(REPO), f"{name} imported from {file}"
    # And the list the Makefile rebuilds from is the same one.
    listed = subprocess.run(
        [sys.executable, str(REPO / "packaging" / "native.py"), "sources"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert listed == list(native.SOURCES)
