"""Model registry: which model versions are loaded, on which backend, behind which scheduler.

Loading is *load-new-then-swap*: the new version set is loaded completely beside the old one,
swapped in with one assignment, and only then is the old set drained and unloaded. Requests in
flight finish on the version they started on, and a failed reload keeps the old model serving
(Triton unloads first; users complain about exactly that).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from daemon.backend import (
    Backend,
    GenerateChunk,
    GenerateParams,
    GenerationBackend,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from daemon.core import model_files
from daemon.core.hardware import HardwareInfo
from daemon.core.plugins import PluginRegistry
from daemon.core.scheduler import Scheduler, make_scheduler
from daemon.core.selection import Selection, choose_backends
from daemon.core.stats import FailureReason, MetricsRegistry, ModelStats
from daemon.core.validate import validate_request
from daemon.errors import (
    BackendError,
    ConfigError,
    EdgedError,
    InvalidArgument,
    NotFound,
    PluginError,
    Unavailable,
)
from daemon.model_config import ModelConfig

log = logging.getLogger(__name__)

ModelState = Literal["UNKNOWN", "READY", "UNAVAILABLE", "LOADING", "UNLOADING"]

# Triton's default instance count for KIND_CPU: 2 for ONNX Runtime, 1 for everything else.
DEFAULT_INSTANCES = {"onnxruntime": 2}


@dataclass
class LoadedVersion:
    """One version of one model, ready to serve."""

    name: str
    version: int
    config: ModelConfig
    backend: str
    artifact: Path
    instances: list[Backend]
    stats: ModelStats
    # None for generation backends: their engine loop schedules, not the dynamic batcher.
    scheduler: Scheduler | None
    selection: dict[str, object] = field(default_factory=dict)
    # The ensemble runner for platform "ensemble" (set by daemon.core.ensemble).
    ensemble: object | None = None

    @property
    def generator(self) -> GenerationBackend | None:
        first = self.instances[0] if self.instances else None
        return first if isinstance(first, GenerationBackend) else None


@dataclass
class ModelEntry:
    name: str
    path: Path | None = None
    state: ModelState = "UNKNOWN"
    reason: str = ""
    versions: dict[int, LoadedVersion] = field(default_factory=dict)
    fingerprint: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class IndexEntry(msgspec.Struct, omit_defaults=True):
    """One row of Triton's repository index."""

    name: str
    version: str = ""
    state: str = ""
    reason: str = ""


class ModelRegistry:
    def __init__(
        self,
        plugins: PluginRegistry,
        hardware: HardwareInfo,
        metrics: MetricsRegistry,
        state_dir: Path,
        *,
        cpu_count: int | None = None,
        drain_timeout: float = 30.0,
    ) -> None:
        self.plugins = plugins
        self.hardware = hardware
        self.metrics = metrics
        self.state_dir = state_dir
        self.cpu_count = cpu_count or os.cpu_count() or 1
        self.drain_timeout = drain_timeout
        self._models: dict[str, ModelEntry] = {}
        # Ensembles resolve their steps through the registry; set by daemon.core.ensemble.
        self.ensemble_factory: Callable[[ModelRegistry, str, int, ModelConfig, ModelStats], object] | None = None

    # ------------------------------------------------------------------ queries

    def entry(self, name: str) -> ModelEntry | None:
        return self._models.get(name)

    def names(self) -> list[str]:
        return sorted(self._models)

    def get(self, name: str, version: str | int | None = None) -> LoadedVersion:
        """The version to serve: the given one, else the highest loaded. Raises NotFound/Unavailable."""
        entry = self._models.get(name)
        if entry is None or (not entry.versions and entry.state == "UNKNOWN"):
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        if version in (None, "", -1, "-1"):
            if not entry.versions:
                raise Unavailable(f"Request for unknown model: '{name}' has no available versions")
            return entry.versions[max(entry.versions)]
        try:
            number = int(version)
        except ValueError:
            raise InvalidArgument(f"model version must be an integer, got {version!r}") from None
        loaded = entry.versions.get(number)
        if loaded is None:
            raise NotFound(f"Request for unknown model: '{name}' version {number} is not found")
        return loaded

    def is_ready(self, name: str, version: str | None = None) -> bool:
        try:
            self.get(name, version)
        except EdgedError:
            return False
        return True

    def all_ready(self) -> bool:
        return all(e.state == "READY" for e in self._models.values() if e.state != "UNKNOWN")

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        rows: list[IndexEntry] = []
        for name in self.names():
            entry = self._models[name]
            if entry.versions:
                rows.extend(
                    IndexEntry(name=name, version=str(v), state=entry.state, reason=entry.reason)
                    for v in sorted(entry.versions)
                )
            elif not ready_only:
                rows.append(IndexEntry(name=name, state=entry.state, reason=entry.reason))
        if ready_only:
            rows = [r for r in rows if r.state == "READY"]
        return rows

    def loaded(self) -> list[LoadedVersion]:
        return [v for e in self._models.values() for v in e.versions.values()]

    # ------------------------------------------------------------------ inference

    async def infer(self, name: str, version: str | None, request: InferRequest) -> InferResponse:
        model = self.get(name, version)
        try:
            validate_request(request, model.config)
        except InvalidArgument:
            model.stats.record_failure(0, "OTHER")
            raise
        if model.ensemble is not None:
            run = model.ensemble.infer  # type: ignore[attr-defined]
            return await run(request)
        if model.scheduler is None:
            raise InvalidArgument(
                f"model '{name}' is a generation model; use /v2/models/{name}/generate or /v1/completions"
            )
        return await model.scheduler.submit(request)

    async def generate(
        self, model: LoadedVersion, prompt: str | list[int], params: GenerateParams
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Stream a generation model's chunks, recording Triton-style statistics.

        Closing the iterator early (a client went away) cancels the sequence in the engine.
        """
        generator = self._generator_of(model)
        started = time.monotonic_ns()
        outcome: FailureReason | None = "CANCELED"
        try:
            async with contextlib.aclosing(generator.generate(prompt, params)) as chunks:
                async for chunk in chunks:
                    yield chunk
            outcome = None
        except EdgedError:
            outcome = "OTHER"
            raise
        finally:
            elapsed = time.monotonic_ns() - started
            if outcome is None:
                model.stats.record_success(elapsed)
            else:
                model.stats.record_failure(elapsed, outcome)

    async def embed(self, model: LoadedVersion, texts: list[str]) -> tuple[list[list[float]], int]:
        generator = self._generator_of(model)
        started = time.monotonic_ns()
        try:
            result = await generator.embed(texts)
        except EdgedError:
            model.stats.record_failure(time.monotonic_ns() - started)
            raise
        model.stats.record_success(time.monotonic_ns() - started, len(texts))
        return result

    def generation_model(self, name: str) -> LoadedVersion:
        """The served version of a model that generates text; InvalidArgument otherwise."""
        model = self.get(name)
        self._generator_of(model)
        return model

    def _generator_of(self, model: LoadedVersion) -> GenerationBackend:
        if model.generator is None:
            raise InvalidArgument(
                f"model '{model.name}' runs on backend '{model.backend}', which does not generate text"
            )
        return model.generator

    # ------------------------------------------------------------------ lifecycle

    def note_unknown(self, name: str, path: Path) -> ModelEntry:
        """Make a repository model visible in the index (state UNKNOWN) without loading it."""
        entry = self._models.get(name)
        if entry is None:
            entry = self._models[name] = ModelEntry(name=name, path=path)
        entry.path = path
        return entry

    async def load(self, name: str, model_dir: Path, override: ModelConfig | None = None) -> None:
        """Load (or reload) every version the policy selects; swap in only if all succeed."""
        entry = self.note_unknown(name, model_dir)
        async with entry.lock:
            previous_state = entry.state
            if not entry.versions:
                entry.state = "LOADING"
            fingerprint = model_files.fingerprint(model_dir)
            try:
                new_versions = await self._load_versions(name, model_dir, override)
            except EdgedError as exc:
                entry.reason = exc.message
                # Seen: a poller retries only once the directory changes again.
                entry.fingerprint = fingerprint
                # A failed reload keeps the old versions serving.
                entry.state = "READY" if entry.versions else "UNAVAILABLE"
                log.error("model %s: load failed: %s", name, exc.message)
                if previous_state == "READY" and entry.versions:
                    log.warning("model %s: keeping the previously loaded versions", name)
                raise
            old = entry.versions
            entry.versions = new_versions
            entry.state = "READY"
            entry.reason = ""
            entry.fingerprint = fingerprint
            log.info(
                "model %s: ready (versions %s)",
                name,
                ", ".join(f"{v}:{m.backend}" for v, m in sorted(new_versions.items())),
            )
        await self._retire(old.values())

    async def unload(self, name: str) -> None:
        entry = self._models.get(name)
        if entry is None:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        async with entry.lock:
            old = entry.versions
            entry.state = "UNLOADING"
            entry.versions = {}
            await self._retire(old.values())
            entry.state = "UNAVAILABLE"
            entry.reason = "unloaded"
        log.info("model %s: unloaded", name)

    def forget(self, name: str) -> None:
        """Drop an unloaded model from the index (its directory left the repository)."""
        entry = self._models.get(name)
        if entry is not None and not entry.versions:
            del self._models[name]

    async def close(self) -> None:
        for entry in list(self._models.values()):
            old, entry.versions = entry.versions, {}
            entry.state = "UNLOADING"
            await self._retire(old.values())
            entry.state = "UNAVAILABLE"

    async def sync_plugins(self) -> None:
        """Rescan the plugin directories; reload every model whose plugin changed on disk."""
        result = self.plugins.scan()
        for name in result.added:
            log.info("backend plugin %s discovered", name)
        for name in result.changed:
            log.info("backend plugin %s changed; reloading its models", name)
            await self.reload_backend(name)

    async def reload_backend(self, backend: str) -> list[str]:
        """Reload every model running on a plugin that changed on disk; returns their names."""
        names = [
            e.name
            for e in self._models.values()
            if e.path is not None and any(v.backend == backend for v in e.versions.values())
        ]
        for name in names:
            entry = self._models[name]
            assert entry.path is not None
            # A failure is already logged, and the old version keeps serving.
            with contextlib.suppress(EdgedError):
                await self.load(name, entry.path)
        return names

    # ------------------------------------------------------------------ internals

    async def _retire(self, versions: object) -> None:
        for model in list(versions):  # type: ignore[call-overload]
            assert isinstance(model, LoadedVersion)
            if model.scheduler is not None:
                await model.scheduler.stop(self.drain_timeout)
            for instance in model.instances:
                try:
                    await instance.unload()
                except Exception:  # a plugin failing to unload must not stop the others
                    log.exception("model %s: backend %s failed to unload", model.name, model.backend)
            model.stats.close()

    async def _load_versions(
        self, name: str, model_dir: Path, override: ModelConfig | None
    ) -> dict[int, LoadedVersion]:
        if override is not None:
            config, warnings = override, list[str]()
        else:
            config, warnings = model_files.read_model_config(model_dir)
        for warning in warnings:
            log.warning("model %s: %s", name, warning)
        if not config.name:
            config.name = name
        if config.name != name:
            raise ConfigError(f"model directory {name!r} holds a config named {config.name!r}")
        available = model_files.list_versions(model_dir)
        versions = model_files.select_versions(available, config.version_policy)
        if not versions:
            raise ConfigError(f"model '{name}': no version directories under {model_dir}")
        loaded: dict[int, LoadedVersion] = {}
        try:
            for version in versions:
                loaded[version] = await self._load_version(name, version, model_dir / str(version), config)
        except BaseException:
            await self._retire(loaded.values())
            raise
        return loaded

    async def _load_version(
        self, name: str, version: int, version_dir: Path, config: ModelConfig
    ) -> LoadedVersion:
        stats = ModelStats(name, str(version), self.metrics)
        if config.platform == "ensemble" or config.ensemble_scheduling is not None:
            if self.ensemble_factory is None:
                raise ConfigError(f"model '{name}': ensembles are not supported by this daemon")
            runner = self.ensemble_factory(self, name, version, config, stats)
            return LoadedVersion(
                name, version, config, "ensemble", version_dir, [], stats, None,
                selection={"backend": "ensemble", "reason": "ensemble_scheduling"}, ensemble=runner,
            )
        files = {p.name: p for p in version_dir.iterdir()} if version_dir.is_dir() else {}
        selection = choose_backends(
            config, files, self.plugins.manifests(), self.hardware, self._backend_problem
        )
        if not selection.candidates:
            raise ConfigError(
                f"model '{name}' version {version}: no backend can serve it: "
                + "; ".join(f"{b}: {r}" for b, r in selection.skipped)
                if selection.skipped
                else f"model '{name}' version {version}: no loadable artifact in {version_dir}"
            )
        failures: list[str] = []
        for candidate in selection.candidates:
            try:
                return await self._load_on(name, version, config, candidate.backend,
                                           candidate.artifact, candidate.device, stats, selection)
            except EdgedError as exc:
                failures.append(f"{candidate.backend}: {exc.message}")
                selection.skipped.append((candidate.backend, f"load failed: {exc.message}"))
                log.warning("model %s: backend %s failed, trying the next: %s", name, candidate.backend, exc.message)
        raise BackendError(f"model '{name}' version {version} failed to load: " + "; ".join(failures))

    def _backend_problem(self, backend: str) -> str | None:
        try:
            self.plugins.resolve(backend)
        except (PluginError, NotFound) as exc:
            return exc.message
        return None

    async def _load_on(
        self,
        name: str,
        version: int,
        config: ModelConfig,
        backend: str,
        artifact: Path,
        device: str,
        stats: ModelStats,
        selection: Selection,
    ) -> LoadedVersion:
        cls = self.plugins.resolve(backend)
        try:
            # Reading the artifact can be slow (a TensorRT engine, a big ONNX file): off the loop.
            config = await asyncio.get_running_loop().run_in_executor(
                None, cls.autocomplete, msgspec.structs.replace(config), artifact
            )
        except EdgedError:
            raise
        except Exception as exc:
            raise BackendError(f"backend {backend!r} could not read {artifact}: {exc}") from exc
        count = sum(g.count for g in config.instance_group) or DEFAULT_INSTANCES.get(backend, 1)
        if cls.capabilities.kind == "generation":
            count = 1  # one engine owns the context; its slots are the parallelism
        threads = max(1, self.cpu_count // count)
        state = self.state_dir / "models" / name / str(version)
        state.mkdir(parents=True, exist_ok=True)
        instances: list[Backend] = []
        started = time.monotonic()
        try:
            for index in range(count):
                # infer: BLS calls from python models run other models through us.
                context = InstanceContext(name, version, index, count, state, threads, infer=self.infer)
                instance = cls(context)
                instances.append(instance)
                await instance.load(config, artifact, device)
        except BaseException as exc:
            for instance in instances:
                try:
                    await instance.unload()
                except Exception:
                    log.exception("model %s: unload after failed load", name)
            if isinstance(exc, EdgedError):
                raise
            if isinstance(exc, Exception):
                raise BackendError(
                    f"backend {backend!r} failed to load model '{name}' from {artifact}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            raise
        scheduler: Scheduler | None = None
        if cls.capabilities.kind == "tensor":
            scheduler = make_scheduler(config, instances, stats)
            await scheduler.start()
        explain = selection.explain()
        explain["backend"] = backend
        explain["instances"] = count
        explain["threads_per_instance"] = threads
        explain["load_seconds"] = round(time.monotonic() - started, 3)
        return LoadedVersion(name, version, config, backend, artifact, instances, stats, scheduler, explain)
