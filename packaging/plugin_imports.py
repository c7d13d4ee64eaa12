"""What the frozen edged must carry so that plugins outside the executable can still import.

A PyInstaller build can import only the modules bundled into it, but backend plugins live beside
the executable as plain source (`dist/edged/backends/`) and are imported at run time, so the
analysis never sees them. This module derives the set to force-bundle from the plugins
themselves: each manifest's `requires` plus every absolute import in the plugin's `.py` files
(read with `ast`, nothing is imported). The standard library is bundled whole (bar GUI, test
and packaging tools): model.py files run by the Python backend and plugins dropped in later
may import any of it, and it costs a few MB.

Used by packaging/edged.spec (build time) and tests/packaging/test_spec.py. Run it directly to
print the set: `.venv/bin/python packaging/plugin_imports.py [backends-dir]`, or with
`--runnable` to list the plugins whose required modules are all installed here.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import sysconfig
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "manifest.toml"

# Stdlib parts no plugin needs on a headless edge device; some also drag in data or binaries.
STDLIB_EXCLUDED: frozenset[str] = frozenset(
    {
        "__phello__", "_tkinter", "antigravity", "distutils", "ensurepip", "idlelib", "lib2to3",
        "pydoc_data", "test", "this", "tkinter", "turtle", "turtledemo", "venv",
    }
)
# Sub-packages holding the stdlib's own test suites.
_TEST_DIRS: frozenset[str] = frozenset({"test", "tests", "idle_test"})


@dataclass
class PluginImports:
    """The import set of the plugins under one backends directory."""

    # plugin name -> its manifest's `requires` (top-level modules).
    requires: dict[str, list[str]] = field(default_factory=dict)
    # Names that are modules for sure: `import a.b` and the `a.b` of `from a.b import c`.
    modules: set[str] = field(default_factory=set)
    # `from a.b import c` may import the submodule `a.b.c` or just an attribute of `a.b`.
    maybe_submodules: set[str] = field(default_factory=set)

    def declared(self) -> set[str]:
        """Every module name the plugins declare or import for sure."""
        return self.modules | {m for reqs in self.requires.values() for m in reqs}


def plugin_dirs(backends: Path) -> list[Path]:
    """Plugin directories, as the daemon's scan sees them (a manifest, no leading `.`/`_`)."""
    return sorted(
        p for p in backends.iterdir()
        if p.is_dir() and not p.name.startswith((".", "_")) and (p / MANIFEST).is_file()
    )


def manifest_requires(plugin: Path) -> list[str]:
    raw = tomllib.loads((plugin / MANIFEST).read_text(encoding="utf-8"))
    requires = raw.get("requires", [])
    if not isinstance(requires, list) or not all(isinstance(r, str) for r in requires):
        raise ValueError(f"{plugin / MANIFEST}: `requires` must be a list of module names")
    return requires


def source_imports(path: Path) -> tuple[set[str], set[str]]:
    """(modules, maybe-submodules) imported by one file; relative imports are plugin-local."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    modules: set[str] = set()
    maybe: set[str] = set()
    # ast.walk also finds imports inside functions and try/except fallbacks: plugins import
    # their runtime lazily, and those imports matter just as much.
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            maybe.update(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
    return modules, maybe


def collect(backends: Path) -> PluginImports:
    result = PluginImports()
    for plugin in plugin_dirs(backends):
        result.requires[plugin.name] = manifest_requires(plugin)
        for source in sorted(plugin.rglob("*.py")):
            if "__pycache__" in source.parts:
                continue
            modules, maybe = source_imports(source)
            result.modules |= modules
            result.maybe_submodules |= maybe
    # `from a import b` where `a.b` was also imported outright is already certain.
    result.maybe_submodules -= result.modules
    return result


def _with_parents(names: set[str]) -> set[str]:
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def is_installed(top_level: str) -> bool:
    """Whether a top-level module can be found, without importing it."""
    return top_level in sys.builtin_module_names or importlib.util.find_spec(top_level) is not None


def is_module(name: str) -> bool:
    """Whether a dotted name is a module (imports its parent packages to find out)."""
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # a parent that is no package, or fails to import: not bundleable
        return False


def hidden_imports(imports: PluginImports) -> tuple[list[str], list[str]]:
    """(to bundle, not installed here): the installed part of the set, and what is missing.

    Only top-level packages are checked for certain modules (no imports); `from a import b`
    names are kept only when `a.b` really is a module, which imports `a` (the runtimes are
    imported by PyInstaller's analysis anyway).
    """
    certain = _with_parents(imports.declared())
    bundle = {m for m in certain if is_installed(m.split(".")[0])}
    missing = {m.split(".")[0] for m in certain} - {m.split(".")[0] for m in bundle}
    bundle |= {
        m for m in imports.maybe_submodules
        if is_installed(m.split(".")[0]) and is_module(m)
    }
    return sorted(bundle), sorted(missing)


def runnable_plugins(imports: PluginImports) -> list[str]:
    """Plugins whose required modules are all installed here (their runtime gets bundled)."""
    return sorted(
        name for name, reqs in imports.requires.items() if all(is_installed(r) for r in reqs)
    )


def stdlib_modules() -> list[str]:
    """Every importable standard-library module except STDLIB_EXCLUDED and the test suites."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names: set[str] = set()
    for top in sorted(sys.stdlib_module_names - STDLIB_EXCLUDED):
        if top in sys.builtin_module_names:
            continue  # compiled into the interpreter: always there
        spec = importlib.util.find_spec(top)
        if spec is None:
            continue  # another platform's module (winreg, msvcrt, ...)
        names.add(top)
        if not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            root = Path(location)
            if stdlib not in root.parents:
                continue
            names |= _package_modules(top, root)
    return sorted(names)


def _package_modules(package: str, root: Path) -> set[str]:
    names: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames
            if d not in _TEST_DIRS and d != "__pycache__" and (Path(dirpath, d) / "__init__.py").exists()
        )
        rel = Path(dirpath).relative_to(root)
        prefix = ".".join((package, *rel.parts))
        names.add(prefix)
        names.update(
            f"{prefix}.{f[:-3]}" for f in filenames if f.endswith(".py") and f != "__init__.py"
        )
    return names


def main(argv: list[str]) -> int:
    runnable = "--runnable" in argv
    args = [a for a in argv if a != "--runnable"]
    backends = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "backends"
    imports = collect(backends)
    if runnable:
        print("\n".join(runnable_plugins(imports)))
        return 0
    bundle, missing = hidden_imports(imports)
    print("\n".join(bundle))
    if missing:
        print(f"# not installed here (their plugins will report unavailable): {', '.join(missing)}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
