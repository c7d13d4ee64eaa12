"""Wires offline update releases into the running daemon.

A release (from a signed bundle) holds `models/` (a model repository) and `plugins/` (backend
plugins). The live release's directories come *first* among the repositories (its models win
a name) and *last* among the plugin directories (its plugins override shipped ones). Applying
an update switches the release store, points the daemon at the new directories, reloads, and
health-checks every model of the release with a warm-up request; on failure the store switches
back and the daemon reloads the old release.

The store, not this object, says what is served: every reload (SIGHUP, an update, a rollback,
the `edged update` command asking over the socket) re-reads `current`, so a release switched by
another process is picked up, and the daemon records what it serves so prune keeps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from daemon.backend import NUMPY_DTYPES, GenerateParams, InferRequest
from daemon.core.layout import scan_repository
from daemon.core.plugins import PluginRegistry
from daemon.core.registry import ModelRegistry
from daemon.core.repository import RepositoryManager
from daemon.core.residency import Lease, Residency
from daemon.errors import EdgedError
from daemon.model_config import ModelConfig
from daemon.updates.errors import HealthCheckFailed, StoreBusy
from daemon.updates.store import ReleaseStore, StoreStatus

if TYPE_CHECKING:
    from daemon.updates.apply import AppliedUpdate, Committed

log = logging.getLogger(__name__)


def warmup_request(config: ModelConfig) -> InferRequest:
    """Zeros shaped like the config (variable dims = 1, batch of 1) for every required input."""
    inputs: dict[str, np.ndarray] = {}
    for tensor in config.input:
        if tensor.optional:
            continue
        shape = [1 if d < 0 else d for d in tensor.dims]
        if config.max_batch_size > 0:
            shape = [1, *shape]
        if tensor.data_type == "BYTES":
            inputs[tensor.name] = np.full(shape, b"", dtype=object)
        else:
            inputs[tensor.name] = np.zeros(shape, dtype=NUMPY_DTYPES[tensor.data_type])
    return InferRequest(inputs, id="warmup")


def _not_loaded(name: str, reason: str) -> HealthCheckFailed:
    return HealthCheckFailed(f"model '{name}' did not load from the new release: {reason}")


class ReleaseManager:
    def __init__(
        self,
        store: ReleaseStore,
        trusted_keys: Path,
        registry: ModelRegistry,
        repository: RepositoryManager,
        plugins: PluginRegistry,
        lock: asyncio.Lock,
        *,
        keep: int = 3,
        residency: Residency | None = None,
    ) -> None:
        self.store = store
        self.residency = residency
        self.trusted_keys = trusted_keys
        self.registry = registry
        self.repository = repository
        self.plugins = plugins
        self.lock = lock
        self.keep = keep
        # What the operator configured, without any release directories.
        self._base_repositories = list(repository.repositories)
        self._base_plugin_dirs = list(plugins.directories)

    def point_at(self, release: Path | None) -> None:
        """Make the repository and plugin search paths those of `release` (None = no release)."""
        self.store.set_active(release)
        models = release / "models" if release is not None else None
        plugins = release / "plugins" if release is not None else None
        self.repository.repositories = (
            [models] if models is not None and models.is_dir() else []
        ) + self._base_repositories
        self.plugins.directories = self._base_plugin_dirs + (
            [plugins] if plugins is not None and plugins.is_dir() else []
        )

    async def reload(self, release: Path | None) -> None:
        """Point at `release` and bring plugins and models in line with it."""
        async with self.lock:
            self.point_at(release)
            await self.registry.sync_plugins()
            await self.repository.rescan()

    async def reload_current(self) -> Path | None:
        """SIGHUP: finish or undo an update another process left interrupted (unless one holds
        the store right now), then serve whatever `current` names."""
        # StoreBusy: an apply is in progress; it asks us to reload once it has switched.
        with contextlib.suppress(StoreBusy):
            await asyncio.to_thread(self.store.recover)
        release = self.store.current_release()
        await self.reload(release)
        return release

    async def check_current(self) -> list[str]:
        """Reload `current` and health-check it (the `edged update` command's health check, asked
        over the socket while it holds the store). Returns the release's model names."""
        release = self.store.current_release()
        if release is None:
            await self.reload(None)
            return []
        await self.health_check(release)
        models = release / "models"
        return sorted(scan_repository(models)) if models.is_dir() else []

    async def health_check(self, release: Path) -> None:
        await self.reload(release)
        models = release / "models"
        names = sorted(scan_repository(models)) if models.is_dir() else []
        # In explicit mode a model neither loaded nor in the startup set stays unloaded (and
        # unchecked) until someone loads it.
        checked = [name for name in names if self.repository.follows(name)]
        for name in checked:
            lease = await self._load_on_demand(name, models / name)
            try:
                entry = self.registry.entry(name)
                # loaded_from, not path: the versions serving may still be the old release's.
                if entry is None or entry.state != "READY" or entry.reason or entry.loaded_from != models / name:
                    reason = (entry.reason if entry is not None else "") or "it was not loaded"
                    raise _not_loaded(name, reason)
                await self._warm_up(name)
            finally:
                if lease is not None:
                    lease.release()  # it idles out by its keep_alive, as after any request
        log.info("release %s: %d model(s) loaded and answered a warm-up request%s", release.name, len(checked),
                 f" ({len(names) - len(checked)} not loaded: explicit mode)" if len(checked) < len(names) else "")

    async def _load_on_demand(self, name: str, path: Path) -> Lease | None:
        """An on-demand model is loaded by the request that needs it, not by the rescan: the
        check is such a request (None for other models)."""
        if self.residency is None or not await self.residency.on_demand(name, path):
            return None
        try:
            lease = await self.residency.acquire(name)
        except EdgedError as exc:
            raise _not_loaded(name, exc.message) from exc
        entry = self.registry.entry(name)
        if entry is not None and entry.loaded_from != path:
            # A request that began before the switch loaded it from the old release meanwhile.
            try:
                await self.registry.load(name, path)
            except EdgedError as exc:
                lease.release()
                raise _not_loaded(name, exc.message) from exc
        return lease

    async def _warm_up(self, name: str) -> None:
        model = self.registry.get(name)
        try:
            generator = model.generator
            if generator is not None:
                if generator.reranker():
                    await generator.rerank("Hello", ["Hello"])
                elif model.config.parameters.get("embedding") == "true":
                    await generator.embed(["Hello"])
                else:
                    async for _ in generator.generate("Hello", GenerateParams(max_tokens=1, greedy=True)):
                        pass
                return
            await self.registry.get(name).infer(warmup_request(model.config))
        except EdgedError as exc:
            raise HealthCheckFailed(f"model '{name}' failed its warm-up request: {exc.message}") from exc

    async def apply(
        self, bundle: Path, progress: Callable[[str], None] | None = None, *, commit: bool = True
    ) -> AppliedUpdate:
        def report(line: str) -> None:
            log.info("update: %s", line)
            if progress is not None:
                progress(line)

        # Imported on first use: verifying bundles needs `cryptography`; serving does not.
        from daemon.updates.apply import apply_update

        return await apply_update(
            bundle, self.store, self.trusted_keys, self.health_check, report,
            restore=self.reload, keep=self.keep, commit=commit,
        )

    async def commit(self) -> Committed:
        from daemon.updates.apply import commit_update

        return await commit_update(self.store, keep=self.keep)

    async def rollback(self, *, only_pending: bool = False) -> Path | None:
        from daemon.updates.apply import rollback_update

        return await rollback_update(self.store, self.reload, only_pending=only_pending)

    def status(self) -> StoreStatus:
        return self.store.status()
