"""Plugin discovery: manifests first, lazy import under a private namespace, failures named and
not cached, changes detected."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from daemon.backend import Backend
from daemon.core.plugins import NAMESPACE, PluginRegistry
from daemon.errors import NotFound, PluginError

GOOD = """
from daemon.backend import TensorBackend

class Impl(TensorBackend):
    name = "{name}"
    factor = {factor}

    def load_sync(self, config, artifact, device):
        pass

    def infer(self, inputs):
        return {{"Y": inputs["X"] * self.factor}}
"""


def write_plugin(root: Path, name: str, *, code: str | None = None, manifest: str | None = None,
                 factor: float = 2.0) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    (folder / "manifest.toml").write_text(manifest if manifest is not None else (
        f'name = "{name}"\nversion = "1.0.0"\napi-version = 1\nentrypoint = "impl:Impl"\n'
        'artifacts = ["model.bin"]\nplatforms = ["custom_platform"]\nrequires = ["numpy"]\n'
    ))
    (folder / "impl.py").write_text(code if code is not None else GOOD.format(name=name, factor=factor))
    return folder


def test_scan_reads_manifests_without_importing(tmp_path: Path) -> None:
    write_plugin(tmp_path, "alpha")
    registry = PluginRegistry([tmp_path])
    result = registry.scan()
    assert result.added == ["alpha"]
    assert registry.manifest("alpha").platforms == ["custom_platform"]
    assert f"{NAMESPACE}.alpha.impl" not in sys.modules  # import is lazy
    cls = registry.resolve("alpha")
    assert issubclass(cls, Backend) and cls.name == "alpha"
    assert sys.modules[f"{NAMESPACE}.alpha.impl"].__name__ == f"{NAMESPACE}.alpha.impl"


def test_two_plugins_with_same_module_names_do_not_collide(tmp_path: Path) -> None:
    write_plugin(tmp_path, "one", factor=1.0)
    write_plugin(tmp_path, "two", factor=2.0)
    registry = PluginRegistry([tmp_path])
    registry.scan()
    assert registry.resolve("one").factor == 1.0  # type: ignore[attr-defined]
    assert registry.resolve("two").factor == 2.0  # type: ignore[attr-defined]


def test_a_second_registry_imports_its_own_directorys_plugin_of_the_same_name(tmp_path: Path) -> None:
    # The modules of a plugin are kept by name for the process; another registry's plugin of
    # that name from another directory must not be taken for this one's.
    write_plugin(tmp_path / "a", "same", factor=3.0)
    write_plugin(tmp_path / "b", "same", factor=5.0)
    first = PluginRegistry([tmp_path / "a"])
    first.scan()
    assert first.resolve("same").factor == 3.0  # type: ignore[attr-defined]
    second = PluginRegistry([tmp_path / "b"])
    second.scan()
    assert second.resolve("same").factor == 5.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("manifest", "needle"),
    [
        ('name = "bad"\nversion = "1"\napi-version = 1\n', "entrypoint"),
        ('name = "bad"\nversion = "1"\napi-version = 99\nentrypoint = "impl:Impl"\n', "api-version 99"),
        ('name = "other"\nversion = "1"\napi-version = 1\nentrypoint = "impl:Impl"\n', "directory name"),
        ('name = "bad"\nversion = "1"\napi-version = 1\nentrypoint = "impl:Impl"\ncolour = "red"\n', "colour"),
        ("name = [", "invalid"),
        # Each of these two ended the daemon's start (a RecursionError, a UnicodeDecodeError).
        ("x = " + "[" * 100_000 + "]" * 100_000, "nested too deeply to be read"),
        (b'name = "\xff\xfe"\n', "can't decode byte 0xff"),
    ],
)
def test_broken_manifests_are_reported_and_skipped(tmp_path: Path, manifest: str | bytes, needle: str) -> None:
    folder = write_plugin(tmp_path, "bad", manifest=manifest if isinstance(manifest, str) else "")
    if isinstance(manifest, bytes):
        (folder / "manifest.toml").write_bytes(manifest)
    write_plugin(tmp_path, "good")
    registry = PluginRegistry([tmp_path])
    result = registry.scan()
    assert result.broken == ["bad"]
    assert registry.names() == ["good"]
    infos = {i.name: i for i in registry.info()}
    assert infos["bad"].state == "broken" and needle in infos["bad"].reason
    assert infos["good"].state == "ready"


def test_import_error_names_plugin_and_is_not_cached(tmp_path: Path) -> None:
    folder = write_plugin(tmp_path, "flaky", code="raise RuntimeError('not today')\n")
    registry = PluginRegistry([tmp_path])
    registry.scan()
    with pytest.raises(PluginError, match=r"flaky.*not today"):
        registry.resolve("flaky")
    (folder / "impl.py").write_text(GOOD.format(name="flaky", factor=3.0))
    registry.scan()
    assert registry.resolve("flaky").factor == 3.0  # type: ignore[attr-defined]


def test_a_plugin_whose_import_hangs_holds_up_only_itself(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    write_plugin(tmp_path / "plugins", "good")
    write_plugin(tmp_path / "plugins", "stuck", code=(
        f"import pathlib, time\nwhile not pathlib.Path({str(gate)!r}).exists():\n    time.sleep(0.01)\n"
        + GOOD.format(name="stuck", factor=3.0)
    ))
    registry = PluginRegistry([tmp_path / "plugins"])
    registry.scan()
    stuck = threading.Thread(target=registry.resolve, args=("stuck",), daemon=True)
    stuck.start()
    try:
        for _ in range(500):
            if f"{NAMESPACE}.stuck.impl" in sys.modules:
                break
            time.sleep(0.01)
        # One lock for every import made these wait for the stuck one: run aside, with a limit.
        done: dict[str, object] = {}
        aside = threading.Thread(target=lambda: done.update(good=registry.resolve("good"), infos=registry.info()),
                                 daemon=True)
        aside.start()
        aside.join(30)
        assert done.get("good") is not None and done["good"].factor == 2.0  # type: ignore[attr-defined]
        infos = {i.name: i for i in done["infos"]}  # type: ignore[attr-defined]
        assert (infos["stuck"].state, infos["stuck"].reason) == ("discovered", "its import has not finished")
        assert infos["good"].state == "ready"
    finally:
        gate.touch()
    stuck.join(10)
    assert registry.resolve("stuck").factor == 3.0  # type: ignore[attr-defined]


def test_missing_runtime_is_unavailable(tmp_path: Path) -> None:
    write_plugin(tmp_path, "needy", manifest=(
        'name = "needy"\nversion = "1"\napi-version = 1\nentrypoint = "impl:Impl"\n'
        'requires = ["surely_not_an_installed_module_xyz"]\n'
    ))
    registry = PluginRegistry([tmp_path])
    registry.scan()
    with pytest.raises(PluginError, match=r"surely_not_an_installed_module_xyz.*not installed"):
        registry.resolve("needy")


def test_wrong_class_and_name_mismatch(tmp_path: Path) -> None:
    write_plugin(tmp_path, "notbackend", code="class Impl:\n    pass\n")
    write_plugin(tmp_path, "misnamed", code=GOOD.format(name="something_else", factor=1.0))
    registry = PluginRegistry([tmp_path])
    registry.scan()
    with pytest.raises(PluginError, match=r"not a daemon\.backend\.Backend subclass"):
        registry.resolve("notbackend")
    with pytest.raises(PluginError, match="differs from manifest name"):
        registry.resolve("misnamed")
    with pytest.raises(NotFound, match="unknown backend 'nope'"):
        registry.resolve("nope")


def test_change_and_removal_are_detected(tmp_path: Path) -> None:
    folder = write_plugin(tmp_path, "alpha", factor=2.0)
    registry = PluginRegistry([tmp_path])
    registry.scan()
    assert registry.resolve("alpha").factor == 2.0  # type: ignore[attr-defined]
    time.sleep(0.01)
    (folder / "impl.py").write_text(GOOD.format(name="alpha", factor=5.0))
    result = registry.scan()
    assert result.changed == ["alpha"]
    assert registry.resolve("alpha").factor == 5.0  # type: ignore[attr-defined]
    import shutil

    shutil.rmtree(folder)
    assert registry.scan().removed == ["alpha"]
    assert f"{NAMESPACE}.alpha" not in sys.modules


def test_group_writable_plugin_refused(tmp_path: Path) -> None:
    folder = write_plugin(tmp_path, "loose")
    folder.chmod(0o775)
    registry = PluginRegistry([tmp_path])
    assert registry.scan().broken == ["loose"]
    assert "writable" in registry.info()[0].reason
    assert PluginRegistry([tmp_path], check_ownership=False).scan().added == ["loose"]


def test_later_directory_wins(tmp_path: Path) -> None:
    write_plugin(tmp_path / "a", "alpha", factor=1.0)
    write_plugin(tmp_path / "b", "alpha", factor=7.0)
    (tmp_path / "a").chmod(0o755)
    (tmp_path / "b").chmod(0o755)
    registry = PluginRegistry([tmp_path / "a", tmp_path / "b"])
    registry.scan()
    assert registry.resolve("alpha").factor == 7.0  # type: ignore[attr-defined]


def test_repository_plugins_discovered(plugin_registry: PluginRegistry) -> None:
    assert {"onnxruntime", "python"} <= set(plugin_registry.names())


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("    def load_sync(self, config, artifact):\n        pass\n",
         "method 'load_sync': takes 2 argument(s) (config, artifact), the contract passes 3"),
        ("    def execute(self, batch):\n        return []\n",
         "method 'execute': must be async, is a plain (non-async) method"),
        ("    async def unload_sync(self):\n        pass\n",
         "method 'unload_sync': must be a plain (non-async) method, is async"),
        ("    def probe(self):\n        pass\n",
         "method 'probe': must be a classmethod, as in daemon.backend.Backend"),
    ],
)
def test_contract_is_checked_at_registration(tmp_path: Path, body: str, needle: str) -> None:
    # A name per case: plugin modules live in sys.modules under their plugin's name.
    name = "bad_" + needle.split("'")[1]
    code = f'from daemon.backend import TensorBackend\n\nclass Impl(TensorBackend):\n    name = "{name}"\n\n{body}'
    write_plugin(tmp_path, name, code=code)
    registry = PluginRegistry([tmp_path])
    registry.scan()
    with pytest.raises(PluginError) as caught:
        registry.resolve(name)
    assert f"backend plugin '{name}'" in caught.value.message
    assert needle in caught.value.message


def test_keyword_arguments_added_to_the_contract_are_optional_for_plugins() -> None:
    """embed's `truncate` and chat_prompt's `template_kwargs` came after API version 1: an
    override without them registers, and the daemon sees whether it takes them."""
    from collections.abc import Sequence

    from daemon.backend import GenerationBackend
    from daemon.core.plugins import check_backend_class, takes_keyword

    class Old(GenerationBackend):
        async def embed(self, texts: Sequence[str]) -> tuple[list[list[float]], int]:
            return [], 0

    class New(GenerationBackend):
        async def embed(self, texts: Sequence[str], *, truncate: bool = False) -> tuple[list[list[float]], int]:
            return [], 0

    class Loose(GenerationBackend):
        async def embed(self, texts: Sequence[str], **options: bool) -> tuple[list[list[float]], int]:
            return [], 0

    assert check_backend_class(Old) == check_backend_class(New) == check_backend_class(Loose) == ""
    assert not takes_keyword(Old.embed, "truncate")
    assert takes_keyword(New.embed, "truncate") and takes_keyword(Loose.embed, "truncate")


@pytest.mark.parametrize("raise_", ["SystemExit(3)", "KeyboardInterrupt()", "BaseException('odd')"])
def test_plugin_raising_base_exceptions_at_import_is_broken_not_fatal(tmp_path: Path, raise_: str) -> None:
    dies = "dies_" + raise_.split("(")[0].lower()
    write_plugin(tmp_path, dies, code=f"raise {raise_}\n")
    write_plugin(tmp_path, "fine")
    registry = PluginRegistry([tmp_path])
    registry.scan()
    with pytest.raises(PluginError, match=f"backend plugin '{dies}'"):
        registry.resolve(dies)
    assert registry.resolve("fine").name == "fine"
    states = {info.name: info.state for info in registry.info()}
    assert states == {dies: "broken", "fine": "ready"}


def test_writable_file_inside_a_plugin_is_refused(tmp_path: Path) -> None:
    folder = write_plugin(tmp_path, "loosefile")
    (folder / "impl.py").chmod(0o666)
    registry = PluginRegistry([tmp_path])
    assert registry.scan().broken == ["loosefile"]
    assert f"{folder / 'impl.py'} is group- or world-writable" in registry.info()[0].reason


def test_foreign_owned_file_and_symlink_target_are_refused(tmp_path: Path) -> None:
    import os

    if os.getuid() != 0:
        pytest.skip("needs root to chown a file to another uid")
    folder = write_plugin(tmp_path / "a", "foreign")
    helper = folder / "helper.py"
    helper.write_text("X = 1\n")
    os.chown(helper, 65534, 65534)
    registry = PluginRegistry([tmp_path / "a"])
    assert registry.scan().broken == ["foreign"]
    assert "is owned by uid 65534" in registry.info()[0].reason

    outside = tmp_path / "outside.py"
    outside.write_text("X = 2\n")
    outside.chmod(0o666)
    linked = write_plugin(tmp_path / "b", "linked")
    (linked / "extra.py").symlink_to(outside)
    registry = PluginRegistry([tmp_path / "b"])
    assert registry.scan().broken == ["linked"]
    assert f"{linked / 'extra.py'} is group- or world-writable" in registry.info()[0].reason


def test_shipped_plugins_import_only_the_contract() -> None:
    """A plugin imports nothing of the daemon's but daemon.backend (which re-exports errors,
    config and hardware types): the rest of the daemon can change without breaking plugins."""
    import ast

    from support import REPO_BACKENDS

    offenders = []
    for source in sorted(REPO_BACKENDS.glob("*/*.py")):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            names = (
                [alias.name for alias in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            offenders += [
                f"{source.relative_to(REPO_BACKENDS)}: {name}"
                for name in names
                if (name == "daemon" or name.startswith("daemon.")) and name != "daemon.backend"
            ]
    assert offenders == []


def test_rerank_is_part_of_the_contract() -> None:
    from collections.abc import Sequence

    from daemon.backend import GenerationBackend
    from daemon.core.plugins import check_backend_class

    class Sync(GenerationBackend):
        def rerank(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:  # type: ignore[override]
            return [], 0

    class Narrow(GenerationBackend):
        async def rerank(self, query: str) -> tuple[list[float], int]:  # type: ignore[override]
            return [], 0

    class Good(GenerationBackend):
        async def rerank(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
            return [0.5] * len(documents), 0

        def reranker(self) -> bool:
            return True

    assert check_backend_class(Sync) == "method 'rerank': must be async, is a plain (non-async) method"
    assert "method 'rerank': takes 1 argument(s)" in check_backend_class(Narrow)
    assert check_backend_class(Good) == ""
