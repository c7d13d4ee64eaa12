"""Fast checks of the PyInstaller packaging (no build): the plugin import set the spec bundles.

The real proof is `bash packaging/build.sh && bash packaging/smoke.sh` (minutes); these catch the
cheap mistakes early: a plugin import the frozen build would miss, a broken script.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from daemon.core.plugins import PluginRegistry
from support import load_script

REPO = Path(__file__).resolve().parents[2]
PACKAGING = REPO / "packaging"
BACKENDS = REPO / "backends"


pi = load_script(PACKAGING / "plugin_imports.py", "edged_plugin_imports")


def _write_plugin(root: Path, name: str, requires: list[str], source: str) -> Path:
    plugin = root / name
    plugin.mkdir(parents=True)
    (plugin / "manifest.toml").write_text(
        f'name = "{name}"\nversion = "0.1.0"\napi-version = 1\n'
        f'entrypoint = "backend:Backend"\nrequires = {requires!r}\n'.replace("'", '"'),
        encoding="utf-8",
    )
    (plugin / "backend.py").write_text(source, encoding="utf-8")
    return plugin


def test_plugin_dirs_match_what_the_daemon_discovers() -> None:
    registry = PluginRegistry([BACKENDS], check_ownership=False)
    registry.scan()
    assert [p.name for p in pi.plugin_dirs(BACKENDS)] == registry.names()
    assert registry.names(), "no plugins found in backends/"


def test_every_manifest_requirement_is_declared() -> None:
    declared = pi.collect(BACKENDS).declared()
    for manifest in BACKENDS.glob("*/manifest.toml"):
        for module in tomllib.loads(manifest.read_text(encoding="utf-8")).get("requires", []):
            assert module in declared, f"{manifest}: requires {module!r} but the spec would not bundle it"


@pytest.mark.parametrize(("plugin", "runtime"), [
    ("onnxruntime", "onnxruntime"),
    ("openvino", "openvino"),
    ("llamacpp", "llama_cpp"),
    ("tensorrt", "tensorrt"),
])
def test_runtime_of_each_shipped_plugin_is_in_the_set(plugin: str, runtime: str) -> None:
    if not (BACKENDS / plugin / "manifest.toml").is_file():
        pytest.skip(f"backends/{plugin} is not in this tree")
    assert runtime in pi.collect(BACKENDS).declared()


def test_stdlib_and_lazy_imports_of_shipped_plugins_are_in_the_set() -> None:
    declared = pi.collect(BACKENDS).declared()
    # llamacpp drives libllama through ctypes and hands futures across threads; the Python
    # backend parses model_config JSON. All three are imported by plugin code only.
    expected = {"ctypes": "llamacpp", "concurrent.futures": "llamacpp", "json": "python"}
    for module, plugin in expected.items():
        if (BACKENDS / plugin).is_dir():
            assert module in declared
    # Imported inside a function (lazily), not at module top.
    if (BACKENDS / "llamacpp").is_dir():
        assert "llama_cpp.llama_cpp" in declared


def test_daemon_imports_of_plugins_exist() -> None:
    """collect_submodules('daemon') bundles the package; a plugin naming a missing module fails here."""
    imports = pi.collect(BACKENDS)
    daemon_modules = {m for m in imports.declared() if m.split(".")[0] == "daemon"}
    assert daemon_modules
    for module in daemon_modules:
        assert importlib.util.find_spec(module) is not None, module


def test_source_imports_finds_lazy_and_fallback_imports(tmp_path: Path) -> None:
    source = tmp_path / "backend.py"
    source.write_text(
        "import os.path\n"
        "from . import sibling\n"
        "from .engine import Engine\n"
        "from json import decoder, loads\n"
        "def probe():\n"
        "    try:\n"
        "        from cuda.bindings import runtime\n"
        "    except ImportError:\n"
        "        import cudart_old as runtime\n",
        encoding="utf-8",
    )
    modules, maybe = pi.source_imports(source)
    assert modules == {"os.path", "json", "cuda.bindings", "cudart_old"}
    assert maybe == {"json.decoder", "json.loads", "cuda.bindings.runtime"}


def test_hidden_imports_keep_installed_modules_and_report_missing(tmp_path: Path) -> None:
    _write_plugin(
        tmp_path, "fake", ["edged_no_such_runtime", "numpy"],
        "import concurrent.futures\nfrom json import decoder, loads\nimport edged_no_such_runtime.sub\n",
    )
    imports = pi.collect(tmp_path)
    bundle, missing = pi.hidden_imports(imports)
    assert {"numpy", "concurrent", "concurrent.futures", "json", "json.decoder"} <= set(bundle)
    assert "json.loads" not in bundle  # a function, not a module
    assert not any(m.startswith("edged_no_such_runtime") for m in bundle)
    assert missing == ["edged_no_such_runtime"]
    assert pi.runnable_plugins(imports) == []


def test_hidden_imports_of_shipped_plugins_are_importable_here() -> None:
    bundle, missing = pi.hidden_imports(pi.collect(BACKENDS))
    assert "numpy" in bundle and "numpy" not in missing
    for module in bundle:
        assert importlib.util.find_spec(module) is not None, module


def test_stdlib_set_is_whole_but_without_tests_and_gui() -> None:
    stdlib = set(pi.stdlib_modules())
    assert {"ctypes", "json", "concurrent.futures", "email.mime.text", "asyncio.subprocess",
            "xml.etree.ElementTree", "sqlite3"} <= stdlib
    for name in stdlib:
        top = name.split(".")[0]
        assert top not in pi.STDLIB_EXCLUDED, name
        assert not {"test", "tests", "idle_test"} & set(name.split(".")[1:]), name
        assert top not in sys.builtin_module_names, name


def test_spec_compiles_and_scripts_parse() -> None:
    compile((PACKAGING / "edged.spec").read_text(encoding="utf-8"), "edged.spec", "exec")
    for script in ("build.sh", "smoke.sh"):
        result = subprocess.run(["bash", "-n", str(PACKAGING / script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_spec_derives_its_hidden_imports() -> None:
    """The spec must take the plugin set from plugin_imports, not from a second, hand-kept list."""
    tree = ast.parse((PACKAGING / "edged.spec").read_text(encoding="utf-8"))
    calls = {
        ast.unparse(node.func) + "(" + ", ".join(ast.unparse(a) for a in node.args) + ")"
        for node in ast.walk(tree) if isinstance(node, ast.Call)
    }
    assert "plugin_imports.collect(REPO / 'backends')" in calls
    assert "plugin_imports.hidden_imports(imports)" in calls
    assert "plugin_imports.stdlib_modules()" in calls
    assert "collect_submodules('daemon')" in calls
    assert any(c.startswith("COLLECT(") for c in calls), "the shipped build must be onedir"


def test_spec_strips_debug_sections_with_the_checked_script_only() -> None:
    """PyInstaller's own strip breaks patchelf-edited libraries (tests/packaging/
    test_strip_debug.py); the onedir is stripped by packaging/strip_debug.py instead."""
    tree = ast.parse((PACKAGING / "edged.spec").read_text(encoding="utf-8"))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    builders = [call for call in calls if ast.unparse(call.func) in ("EXE", "COLLECT")]
    assert len(builders) == 3
    for call in builders:
        strip = [kw.value for kw in call.keywords if kw.arg == "strip"]
        assert [ast.unparse(value) for value in strip] == ["False"], ast.unparse(call)
    assert "strip_debug.main" in {ast.unparse(call.func) for call in calls}
