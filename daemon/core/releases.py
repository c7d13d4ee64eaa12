"""Wires offline update releases into the running daemon.

A release (from a signed bundle) holds `models/` (a model repository) and `plugins/` (backend
plugins). The live release's directories come *first* among the repositories (its models win
a name) and *last* among the plugin directories (its plugins override shipped ones). Applying
an update switches the release store, points the daemon at the new directories, loads the
release's models beside the ones serving, health-checks each with a warm-up request, and only
then swaps them all in at once; on failure nothing of the release was served, the staged
models are dropped, and the store switches back. A rollback or SIGHUP swaps the same way,
without the warm-ups.

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
from daemon.core.registry import LoadedVersion, ModelRegistry, Staged
from daemon.core.repository import RepositoryManager
from daemon.core.residency import Residency
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
        # Makes room in the memory budget for an on-demand model the check loads.
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
        """Point at `release` and bring plugins and models in line with it, every changed model
        swapped in at once (a rollback, SIGHUP). A model that fails to load keeps its old
        versions and its failure in the index, as after a rescan."""
        async with self.lock:
            await self._switch(release, check=False)

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
        """Load the release's models beside those serving, warm each up, then swap them all in
        at once: no request sees part of a release, and none a model of a release that fails
        its check (the old versions serve throughout; the caller switches the store back)."""
        async with self.lock:
            ours, checked = await self._switch(release, check=True)
        log.info("release %s: %d model(s) loaded and answered a warm-up request%s", release.name, len(checked),
                 f" ({ours - len(checked)} not loaded: explicit mode)" if len(checked) < ours else "")

    async def _switch(self, release: Path | None, *, check: bool) -> tuple[int, list[str]]:
        """Point at `release`, load what changed beside what serves, then swap it all in at
        once. With `check`, the release's models must load and answer a warm-up request
        first (HealthCheckFailed, nothing swapped, otherwise). Returns how many models the
        release has, and the names of those checked."""
        searched = list(self.repository.repositories), list(self.plugins.directories)
        self.point_at(release)
        try:
            scanned = await asyncio.to_thread(self.plugins.scan)
            plan = await self.repository.plan()
        except BaseException:
            await self._search_again(*searched)
            raise
        models = release / "models" if release is not None else None
        ours = {name: path for name, path in plan.found.items() if path.parent == models}
        # In explicit mode a model neither loaded nor in the startup set stays unloaded (and
        # unchecked) until someone loads it.
        checked = [name for name in sorted(ours) if self.repository.follows(name)] if check else []
        targets = dict(plan.to_load)
        for plugin in scanned.added + scanned.changed:  # their models reload, as on a plugin scan
            log.info("backend plugin %s %s; reloading its models", plugin,
                     "discovered" if plugin in scanned.added else "changed")
            targets.update((n, plan.found[n]) for n in self.registry.running_on(plugin) if n in plan.found)
        # What each target's entry held when it was chosen: a load or unload since stands.
        generations = {name: plan.generations.get(name, self.registry.generation(name)) for name in targets}
        staged: dict[str, Staged] = {}
        try:
            # Staged within the view of each other: an ensemble's cycle check at its load and
            # its warm-up see the release's own steps.
            with self.registry.resolving_staged(staged):
                # One at a time: a small box holds the old release and one more load, and an
                # ensemble's cycle check sees the steps staged before it.
                others, ensembles = await self.repository.step_order(targets)
                for name in [*others, *ensembles]:  # an ensemble after its steps: checked with them
                    path = targets[name]
                    refusing = check and name in ours
                    try:
                        # A failure is recorded (old versions kept, the reason in the index, as
                        # a rescan does) unless it refuses the release, which changes nothing.
                        staged[name] = await self.registry.stage(
                            name, path, generations[name], record_failure=not refusing
                        )
                    except EdgedError as exc:
                        if refusing:
                            raise _not_loaded(name, exc.message) from exc
                    except Exception:
                        if refusing:
                            raise
                        log.exception("model %s: unexpected load failure", name)
                for name in checked:
                    await self._check(name, ours[name], staged.get(name))
        except BaseException:
            await self.registry.discard(staged.values())
            # Until the caller switches back, the poller and explicit loads find the release
            # they were at, not the refused one.
            await self._search_again(*searched)
            raise
        await self.registry.publish(list(staged.values()))
        # A target that failed to load keeps its old versions: not loaded again there.
        await self.repository.settle(plan, skip=set(targets) - set(staged))
        return len(ours), checked

    async def _search_again(self, repositories: list[Path], plugin_dirs: list[Path]) -> None:
        self.repository.repositories = repositories
        self.plugins.directories = plugin_dirs
        await asyncio.to_thread(self.plugins.scan)

    async def _check(self, name: str, path: Path, staged: Staged | None) -> None:
        """Warm up the release's model `name` as loaded from `path`."""
        if staged is not None:
            await self._warm_up(name, staged.versions[max(staged.versions)])
            return
        entry = self.registry.entry(name)
        if entry is not None and entry.versions and entry.loaded_from == path:
            await self._warm_up(name, self.registry.get(name))
            return
        # Not loaded, and left to the request that needs it (load: on-demand): loaded here as
        # that request would (room made in the memory budget), and dropped after its warm-up.
        room = self.residency.room_for(name, path) if self.residency is not None else contextlib.nullcontext()
        async with room:
            try:
                probe = await self.registry.stage(name, path, self.registry.generation(name))
            except EdgedError as exc:
                raise _not_loaded(name, exc.message) from exc
            try:
                await self._warm_up(name, probe.versions[max(probe.versions)])
            finally:
                await self.registry.discard([probe])

    async def _warm_up(self, name: str, model: LoadedVersion) -> None:
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
            await model.infer(warmup_request(model.config))
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
