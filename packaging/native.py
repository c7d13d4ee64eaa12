"""The infer hot path compiled to C with mypyc, in place beside its sources.

At load the event loop's Python is what limits small requests (docs/performance.md, "The
infer path compiled with mypyc"). mypyc compiles these typed modules, unchanged, into C
extensions; Python imports an extension before a `.py` of the same name, so the daemon, the
tests and the executable all run the compiled code once it is built, and the plain modules
when it is not. The modules were chosen by the profile of a small request; a module joins
the list only if its tests pass compiled (mypyc checks annotations at run time and its
classes take no weak references or new attributes).

    python packaging/native.py build     # make serve / make test run this when a source changed
    python packaging/native.py clean     # remove the extensions (back to plain Python)
    python packaging/native.py sources   # the compiled sources, for the Makefile

Used by the Makefile, packaging/edged.spec (the extensions' own imports are invisible to
PyInstaller's analysis) and tests/packaging/test_native.py (every module is compiled, none
changed since the last build, and an installed daemon imports them).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Paths relative to the repository root; daemon.api.worker because its front subclasses
# daemon.api.front's (an interpreted class cannot). Not here: modules whose classes are weakly
# referenced (daemon.core.stats) or hold async generators (daemon.core.model), which mypyc
# refuses; daemon.backend, whose classes plugins subclass; daemon.core.residency, whose
# tests replace its functions (a compiled module calls its own functions directly).
SOURCES: tuple[str, ...] = (
    "daemon/api/front.py",
    "daemon/api/infer.py",
    "daemon/api/kserve_codec.py",
    "daemon/api/channel.py",
    "daemon/api/worker.py",
    "daemon/core/scheduler.py",
    "daemon/core/validate.py",
    "daemon/core/labels.py",
)
# The extensions share mypyc's runtime (and the compiled code itself) in one more extension,
# kept inside the package: the editable install and the console script put only the package
# on the path, never the repository root.
GROUP = "daemon.native"
RUNTIME_MODULE = f"{GROUP}__mypyc"
RUNTIME_GLOB = "daemon/native__mypyc.*.so"
BUILD_DIR = REPO / "build" / "native"
# Written after a build, removed by `clean`: the Makefile's target (its prerequisites are SOURCES).
STAMP = BUILD_DIR / "built"


def module_names() -> list[str]:
    return [source.removesuffix(".py").replace("/", ".") for source in SOURCES]


def _built(source: str) -> list[Path]:
    """The extension files compiled from `source` (one per interpreter ABI tag)."""
    path = REPO / source
    return sorted(path.parent.glob(path.stem + ".*.so"))


def extensions() -> list[Path]:
    """The built extension files present now (compiled modules and the shared runtime)."""
    return [p for source in SOURCES for p in _built(source)] + sorted(REPO.glob(RUNTIME_GLOB))


def problems() -> list[str]:
    """Why the extensions present do not match SOURCES: a module not compiled, or changed since
    the last build (Python would import the old extension, not the edit). Judged by the stamp:
    a build rewrites only the extensions whose C changed, and with one shared runtime a
    module's own extension is a small shim that rarely does."""
    found = [f"{source} is not compiled" for source in SOURCES if not _built(source)]
    if not list(REPO.glob(RUNTIME_GLOB)):
        found.append(f"{RUNTIME_MODULE} (mypyc's runtime) is not built")
    built = STAMP.stat().st_mtime if STAMP.exists() else None
    if built is None:
        found.append(f"{STAMP.relative_to(REPO)} is missing: no build finished")
    else:
        found += [f"{source} changed after the last build" for source in SOURCES
                  if (REPO / source).stat().st_mtime > built]
    return found


def build() -> None:
    # Imported here: `sources` and `clean` run before the venv (and mypyc) exist.
    from mypyc.build import mypycify
    from setuptools import setup

    os.chdir(REPO)  # mypyc takes the module names from the paths
    # setuptools reads pyproject.toml's [tool.setuptools] too and calls it beta: not ours.
    warnings.filterwarnings("ignore", message=".*is still \\*beta\\*")

    modules = mypycify(
        list(SOURCES), opt_level="3", group_name=GROUP, target_dir=str(BUILD_DIR / "c")
    )
    setup(
        name="edged-native",
        ext_modules=modules,
        script_args=["--quiet", "build_ext", "--inplace", "--build-temp", str(BUILD_DIR / "temp")],
    )
    STAMP.touch()


def clean() -> None:
    for path in extensions():
        path.unlink()
    STAMP.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) == 2 else ""
    if command == "sources":
        print(" ".join(SOURCES))
    elif command == "build":
        build()
    elif command == "clean":
        clean()
    else:
        print("usage: python packaging/native.py build|clean|sources", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
