"""packaging/native.py: the infer hot path runs compiled, and compiled from its current source.

Every other test then runs the compiled modules (the daemons they start import the same files),
so these two checks are what makes the suite's pass mean "the shipped code passes".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support import REPO_ROOT as REPO
from support import load_script

native = load_script(REPO / "packaging" / "native.py", "edged_native_build")


def test_every_listed_module_is_compiled_from_its_current_source() -> None:
    assert native.problems() == [], "run `make test` (or `.venv/bin/python packaging/native.py build`)"


# A fresh interpreter that sees the `daemon` package and nothing else of the checkout, as the
# console script (`.venv/bin/edged`) and the editable install see it: the repository root is
# not on its path, so an extension the compiled modules need must live inside the package.
_IMPORT_AS_INSTALLED = """
import importlib, importlib.util, sys
repo = sys.argv[1]
sys.path[:] = [p for p in sys.path if p not in ("", ".", repo)]
spec = importlib.util.spec_from_file_location(
    "daemon", repo + "/daemon/__init__.py", submodule_search_locations=[repo + "/daemon"])
package = importlib.util.module_from_spec(spec)
sys.modules["daemon"] = package
spec.loader.exec_module(package)
print("\\n".join(importlib.import_module(name).__file__ for name in sys.argv[2:]))
"""


def test_the_daemon_imports_the_compiled_modules(tmp_path: Path) -> None:
    names = native.module_names()
    files = subprocess.run(
        [sys.executable, "-c", _IMPORT_AS_INSTALLED, str(REPO), *names],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.split()
    assert len(files) == len(names)
    for name, file in zip(names, files, strict=True):
        assert file.endswith(".so"), f"{name} imported from {file}"
        assert Path(file).is_relative_to(REPO / "daemon"), f"{name} imported from {file}"
    # And the list the Makefile rebuilds from is the same one.
    listed = subprocess.run(
        [sys.executable, str(REPO / "packaging" / "native.py"), "sources"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert listed == list(native.SOURCES)
