"""Backend plugin discovery: manifests first, import later.

A plugin is a directory `backends/<name>/` holding `manifest.toml` and Python code. A scan reads
manifests only (cheap, no runtime imports). The plugin's code is imported the first time its
backend is needed, under the private package `edged_backends.<name>` so plugins never collide with
each other or with installed packages. Failures name the plugin and are *not* cached: a fixed
plugin loads on the next scan, and one broken plugin never stops the others.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import stat
import sys
import threading
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from daemon.backend import API_VERSION, Backend, DeviceKind, GenerationBackend, Probe
from daemon.errors import NotFound, PluginError

log = logging.getLogger(__name__)

NAMESPACE = "edged_backends"
MANIFEST = "manifest.toml"


class PluginManifest(msgspec.Struct, forbid_unknown_fields=True, rename="kebab"):
    name: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]*$")]
    version: str
    api_version: int
    # "module:Class", module relative to the plugin directory.
    entrypoint: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]
    # Artifact file names this backend loads, in order of preference.
    artifacts: list[str] = []
    # Triton `platform` values that select this backend (e.g. "onnxruntime_onnx").
    platforms: list[str] = []
    # Top-level Python modules the plugin needs; checked before importing it.
    requires: list[str] = []
    description: str = ""
    # Automatic selection: among plugins with an artifact in the version directory, the
    # highest rank is tried first (ties by name). A model's backend_preference comes first.
    rank: int = 0
    # Device kinds the backend can run on. A plugin that lists only GPU kinds is skipped on a
    # machine without such a device; one listing gpu:nvidia gets an NVIDIA GPU when present.
    devices: list[DeviceKind] = msgspec.field(default_factory=lambda: ["cpu"])
    # Instances per model when the config's instance_group gives no count.
    default_instances: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # Triton's CPU execution accelerators this plugin stands in for (optimization
    # execution_accelerators cpu_execution_accelerator name): a model asking for one is offered
    # to this plugin before the backend its config names.
    accelerators: list[str] = []


PluginState = Literal["discovered", "ready", "unavailable", "broken"]


class PluginInfo(msgspec.Struct):
    """What `GET /v2/backends` reports for one plugin."""

    name: str
    path: str
    state: PluginState
    version: str = ""
    api_version: int = 0
    artifacts: list[str] = []
    platforms: list[str] = []
    reason: str = ""
    devices: list[str] = []
    runtime_version: str = ""


@dataclass
class _Plugin:
    path: Path
    manifest: PluginManifest | None
    fingerprint: str
    error: str = ""
    backend_class: type[Backend] | None = None
    probe: Probe | None = None
    # Held while the plugin's code is imported: one import per plugin, and a plugin whose
    # import never returns holds up only the loads that need it.
    importing: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class ScanResult:
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)


def _fingerprint(directory: Path) -> str:
    """Cheap change detector: every file's path, size and mtime (no content hashing)."""
    parts: list[str] = []
    for path in sorted(directory.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        st = path.stat()
        parts.append(f"{path.relative_to(directory)}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def _check_ownership(path: Path) -> str:
    """A plugin runs inside the daemon: refuse code anyone else could have written.

    Every directory, file and symlink under the plugin directory (and what a symlink points
    to) must be owned by root or the daemon's user and writable by nobody else. The daemon's
    own bytecode caches are skipped.
    """
    trusted = (0, os.getuid())

    def problem(entry: Path, st: os.stat_result) -> str:
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{entry} is group- or world-writable; refusing to load plugin {path.name!r}"
        if st.st_uid not in trusted:
            return f"{entry} is owned by uid {st.st_uid}, not root or the daemon user; refusing to load plugin {path.name!r}"
        return ""

    entries = [path]
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        entries.extend(Path(root) / name for name in [*dirs, *files])
    for entry in entries:
        try:
            st = entry.lstat()
            if stat.S_ISLNK(st.st_mode):
                # The link itself is always 0777 on Linux: judge its owner, then its target.
                if st.st_uid not in trusted:
                    return f"symlink {entry} is owned by uid {st.st_uid}; refusing to load plugin {path.name!r}"
                st = entry.stat()
        except OSError as exc:
            return f"cannot check {entry}: {exc.strerror or exc}"
        if reason := problem(entry, st):
            return reason
    return ""


class PluginRegistry:
    """The plugins found under one or more backend directories (later directories win)."""

    def __init__(self, directories: list[Path], *, check_ownership: bool = True) -> None:
        self.directories = directories
        self.check_ownership = check_ownership
        # Guards the plugin table. Plugins are imported on worker threads (never on the event
        # loop), each under its own lock (_Plugin.importing), not this one.
        self._lock = threading.RLock()
        self._plugins: dict[str, _Plugin] = {}
        # Directories that failed to parse, keyed by path (no name to key them by).
        self._broken_dirs: dict[str, str] = {}

    # ------------------------------------------------------------------ discovery

    def scan(self) -> ScanResult:
        """Re-read the directories (blocking file I/O: call it on a worker thread)."""
        with self._lock:
            return self._scan()

    def _scan(self) -> ScanResult:
        result = ScanResult()
        found: dict[str, _Plugin] = {}
        self._broken_dirs = {}
        for directory in self.directories:
            if not directory.is_dir():
                continue
            for path in sorted(p for p in directory.iterdir() if p.is_dir()):
                if path.name.startswith((".", "_")) or not (path / MANIFEST).is_file():
                    continue
                plugin = self._read(path)
                if plugin.manifest is None:
                    self._broken_dirs[str(path)] = plugin.error
                    result.broken.append(path.name)
                    log.error("backend plugin %s: %s", path, plugin.error)
                    continue
                found[plugin.manifest.name] = plugin
        for name, plugin in found.items():
            old = self._plugins.get(name)
            if old is None:
                result.added.append(name)
            elif old.fingerprint != plugin.fingerprint or old.path != plugin.path:
                result.changed.append(name)
            else:
                # Unchanged: keep the imported class (and a previous error, which is retried
                # on resolve because failures are not cached).
                found[name] = old
        result.removed = [name for name in self._plugins if name not in found]
        for name in result.changed + result.removed:
            _purge_modules(name)
        self._plugins = found
        return result

    def _read(self, path: Path) -> _Plugin:
        fingerprint = _fingerprint(path)
        if self.check_ownership and (problem := _check_ownership(path)):
            return _Plugin(path, None, fingerprint, error=problem)
        manifest_path = path / MANIFEST
        try:
            raw = tomllib.loads(manifest_path.read_text(encoding="utf-8"))
            manifest = msgspec.convert(raw, PluginManifest)
        except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            return _Plugin(path, None, fingerprint, error=f"invalid {manifest_path}: {exc}")
        except RecursionError:  # tomllib recurses once per nested array or table
            return _Plugin(path, None, fingerprint, error=f"invalid {manifest_path}: nested too deeply to be read")
        if manifest.name != path.name:
            return _Plugin(
                path, None, fingerprint,
                error=f"{manifest_path}: name {manifest.name!r} must equal the directory name {path.name!r}",
            )
        if manifest.api_version != API_VERSION:
            return _Plugin(
                path, None, fingerprint,
                error=f"{manifest_path}: api-version {manifest.api_version} is not supported "
                f"(this daemon speaks backend API {API_VERSION})",
            )
        return _Plugin(path, manifest, fingerprint)

    # ------------------------------------------------------------------ lookup

    def names(self) -> list[str]:
        return sorted(self._plugins)

    def manifest(self, name: str) -> PluginManifest:
        plugin = self._plugins.get(name)
        if plugin is None or plugin.manifest is None:
            raise NotFound(f"unknown backend {name!r}; known backends: {self.names()}")
        return plugin.manifest

    def manifests(self) -> list[PluginManifest]:
        return [p.manifest for p in self._plugins.values() if p.manifest is not None]

    def fingerprint(self, name: str) -> str:
        plugin = self._plugins.get(name)
        return plugin.fingerprint if plugin else ""

    def resolve(self, name: str) -> type[Backend]:
        """Import (once) and validate the plugin's backend class; raise PluginError if unusable.

        Imports run plugin code: call this on a worker thread, never on the event loop."""
        with self._lock:
            plugin = self._plugins.get(name)
            if plugin is None or plugin.manifest is None:
                raise NotFound(f"unknown backend {name!r}; known backends: {self.names()}")
        with plugin.importing:
            return self._resolve(name, plugin, plugin.manifest)

    def _resolve(self, name: str, plugin: _Plugin, manifest: PluginManifest) -> type[Backend]:
        if plugin.backend_class is not None:
            return plugin.backend_class
        missing = [m for m in manifest.requires if importlib.util.find_spec(m) is None]
        if missing:
            # The runtime is simply not installed here: "unavailable", not "broken".
            reason = (
                f"required Python module {missing[0]!r} is not installed "
                f"(install the runtime, e.g. `pip install edged[{name}]`)"
            )
            plugin.probe = Probe(available=False, reason=reason)
            plugin.error = f"backend plugin {name!r}: {reason}"
            raise PluginError(plugin.error)
        try:
            cls = self._import(plugin.path, manifest)
            probe = cls.probe()
        except PluginError as exc:
            plugin.error = exc.message
            raise
        except BaseException as exc:
            # Plugin code can raise anything, SystemExit and KeyboardInterrupt included: one
            # broken plugin is reported and skipped, it never stops the daemon.
            plugin.error = f"backend plugin {name!r}: {type(exc).__name__}: {exc}"
            _purge_modules(name)
            raise PluginError(plugin.error) from exc
        plugin.probe = probe
        if not probe.available:
            plugin.error = f"backend {name!r} cannot run here: {probe.reason}"
            raise PluginError(plugin.error)
        plugin.error = ""
        plugin.backend_class = cls
        return cls

    def info(self) -> list[PluginInfo]:
        """State of every plugin; resolves each so the report says whether it really loads."""
        infos: list[PluginInfo] = []
        for name in self.names():
            plugin = self._plugins[name]
            manifest = plugin.manifest
            assert manifest is not None
            state: PluginState = "ready"
            # Another thread importing it: reported as it stands, not waited for (an import
            # that never returns would hold up the whole report).
            importing = plugin.backend_class is None and plugin.importing.locked()
            if importing:
                state = "discovered"
            else:
                try:
                    self.resolve(name)
                except PluginError:
                    probe = plugin.probe
                    state = "unavailable" if probe is not None and not probe.available else "broken"
            probe = None if importing else plugin.probe
            infos.append(
                PluginInfo(
                    name=name,
                    path=str(plugin.path),
                    state=state,
                    version=manifest.version,
                    api_version=manifest.api_version,
                    artifacts=manifest.artifacts,
                    platforms=manifest.platforms,
                    reason="its import has not finished" if importing else plugin.error,
                    devices=list(probe.devices) if probe else [],
                    runtime_version=probe.runtime_version if probe else "",
                )
            )
        for path, error in sorted(self._broken_dirs.items()):
            infos.append(PluginInfo(name=Path(path).name, path=path, state="broken", reason=error))
        return infos

    # ------------------------------------------------------------------ import

    def _import(self, path: Path, manifest: PluginManifest) -> type[Backend]:
        where = f"backend plugin {manifest.name!r} ({path})"
        package = _ensure_package(manifest.name, path)
        module_name, _, class_name = manifest.entrypoint.partition(":")
        try:
            module = importlib.import_module(f"{package.__name__}.{module_name}")
        except BaseException as exc:
            raise PluginError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type) or not issubclass(cls, Backend):
            raise PluginError(f"{where}: entrypoint {manifest.entrypoint!r} is not a daemon.backend.Backend subclass")
        if cls.api_version != API_VERSION:
            raise PluginError(f"{where}: class speaks backend API {cls.api_version}, daemon speaks {API_VERSION}")
        if cls.name != manifest.name:
            raise PluginError(f"{where}: class name attribute {cls.name!r} differs from manifest name")
        if problem := check_backend_class(cls):
            raise PluginError(f"{where}: {problem}")
        return cls


# Contract methods a plugin may override, with the base that defines each.
_CONTRACT_METHODS: tuple[tuple[type[Backend], str], ...] = (
    (Backend, "probe"),
    (Backend, "autocomplete"),
    (Backend, "fit"),
    (Backend, "load"),
    (Backend, "load_sync"),
    (Backend, "execute"),
    (Backend, "execute_stream"),
    (Backend, "execute_step"),
    (Backend, "unload"),
    (Backend, "unload_sync"),
    (Backend, "describe"),
    (GenerationBackend, "generate"),
    (GenerationBackend, "chat_prompt"),
    (GenerationBackend, "tokenize"),
    (GenerationBackend, "token_pieces"),
    (GenerationBackend, "tool_syntax"),
    (GenerationBackend, "thinking_tags"),
    (GenerationBackend, "embed"),
    (GenerationBackend, "rerank"),
    (GenerationBackend, "reranker"),
    (GenerationBackend, "engine_stats"),
    (GenerationBackend, "props"),
    (GenerationBackend, "slots"),
    (GenerationBackend, "infill_tokens"),
)


def _kind(fn: object) -> str:
    if inspect.isasyncgenfunction(fn):
        return "an async generator"
    return "async" if inspect.iscoroutinefunction(fn) else "a plain (non-async) method"


def check_backend_class(cls: type[Backend]) -> str:
    """Why `cls` breaks the contract ("method 'load': ..."), or "" when it keeps it.

    Checked at registration so a mistake surfaces with the plugin's and the method's name,
    not as a TypeError deep inside a request.
    """
    for base, name in _CONTRACT_METHODS:
        if not issubclass(cls, base):
            continue
        mine, theirs = inspect.getattr_static(cls, name), inspect.getattr_static(base, name)
        if mine is theirs:
            continue  # not overridden
        if isinstance(theirs, classmethod) and not isinstance(mine, classmethod):
            return f"method {name!r}: must be a classmethod, as in daemon.backend.{base.__name__}"
        fn, ref = getattr(cls, name), getattr(base, name)
        # generate() and execute_stream() are declared plain in the base (they return async
        # iterators); only coroutine-ness of the others matters.
        if name not in ("generate", "execute_stream") and _kind(fn) != _kind(ref):
            return f"method {name!r}: must be {_kind(ref)}, is {_kind(fn)}"
        try:
            params = [p for p in inspect.signature(ref).parameters.values() if p.name != "self"]
            have = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        want = [p for p in params if p.kind != p.KEYWORD_ONLY]
        positional = [p for p in have if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                      and p.name != "self"]
        varargs = any(p.kind == p.VAR_POSITIONAL for p in have)
        required = [p for p in positional if p.default is p.empty]
        if len(required) > len(want) or (len(positional) < len(want) and not varargs):
            return (
                f"method {name!r}: takes {len(positional)} argument(s) "
                f"({', '.join(p.name for p in positional) or 'none'}), the contract passes "
                f"{len(want)} ({', '.join(p.name for p in want) or 'none'})"
            )
        # The contract's keyword-only arguments (embed's `truncate`, chat_prompt's
        # `template_kwargs` and `tools`) came later than API version 1: an override without them stays
        # valid; the daemon passes them only to methods that take them (`takes_keyword`).
    return ""


def takes_keyword(method: object, name: str) -> bool:
    """Does `method` (a plugin's override) take the keyword argument `name`?"""
    try:
        parameters = inspect.signature(method).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return any(
        p.kind == p.VAR_KEYWORD or (p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for p in parameters
    )


def _ensure_package(name: str, path: Path) -> types.ModuleType:
    """Register `edged_backends.<name>` as a package rooted at the plugin directory."""
    if NAMESPACE not in sys.modules:
        root = types.ModuleType(NAMESPACE)
        root.__path__ = []
        sys.modules[NAMESPACE] = root
    full = f"{NAMESPACE}.{name}"
    existing = sys.modules.get(full)
    if existing is not None:
        if list(getattr(existing, "__path__", ())) == [str(path)]:
            return existing
        # Another registry in this process imported a plugin of this name from elsewhere: its
        # modules are not this directory's.
        _purge_modules(name)
    init = path / "__init__.py"
    if init.exists():
        spec = importlib.util.spec_from_file_location(
            full, init, submodule_search_locations=[str(path)]
        )
    else:
        # A plugin without __init__.py is still a package: its directory is the search path.
        spec = importlib.machinery.ModuleSpec(full, None, is_package=True)
        spec.submodule_search_locations = [str(path)]
    if spec is None:
        raise PluginError(f"backend plugin {name!r}: cannot make an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    if spec.loader is not None:
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[full]
            raise
    return module


def _purge_modules(name: str) -> None:
    """Forget a plugin's modules so a changed plugin is imported afresh."""
    prefix = f"{NAMESPACE}.{name}"
    for module in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        del sys.modules[module]
    importlib.invalidate_caches()
