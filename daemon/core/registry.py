"""Model registry: which model versions are loaded, and which one a request gets.

Loading is *load-new-then-swap*: the loader (daemon.core.loading) builds the new version set
completely beside the old one, it is swapped in with one assignment, and only then is the old
set drained and unloaded. Requests in flight finish on the version they started on, and a
failed reload keeps the old model serving (Triton unloads first; users complain about exactly
that). Requests themselves run on the `LoadedVersion` that `get` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from daemon.core.ensemble import Releasable
from daemon.core.hardware import Hardware
from daemon.core.host_policy import HostPolicies
from daemon.core.loading import ModelLoader
from daemon.core.model import LoadedVersion
from daemon.core.plugins import PluginRegistry
from daemon.core.stats import MetricsRegistry
from daemon.errors import EdgedError, InvalidArgument, NotFound, Unavailable
from daemon.model_config import ModelConfig

log = logging.getLogger(__name__)

ModelState = Literal["UNKNOWN", "READY", "UNAVAILABLE", "LOADING", "UNLOADING"]

# Loads of a model whose files change while it loads, before the load fails.
TORN_LOAD_ATTEMPTS = 3

__all__ = ["IndexEntry", "LoadedVersion", "ModelEntry", "ModelRegistry", "ModelState", "Releasable", "Staged"]


@dataclass
class ModelEntry:
    name: str
    path: Path | None = None
    state: ModelState = "UNKNOWN"
    reason: str = ""
    versions: dict[int, LoadedVersion] = field(default_factory=dict)
    fingerprint: str = ""
    # The directory the versions serving now were loaded from (`path` is where the repository
    # has the model now: in explicit mode it moves ahead of what is loaded).
    loaded_from: Path | None = None
    # Every version a load has tried (loaded or not): like Triton, a request naming one of
    # them that is not loaded is "not at ready state" (503), any other is "not found" (404).
    tried: set[int] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Counts the changes of `versions` (loads, unloads, swaps): an update's staged copy, planned
    # at one count, is swapped in only if it is still the count (see `publish`).
    generation: int = 0

    @property
    def unloaded(self) -> bool:
        """Unloaded on request (not a failed load): Triton then answers as for an unknown model."""
        return self.state == "UNAVAILABLE" and self.reason == "unloaded"


@dataclass
class Staged:
    """A model's versions loaded from `path` beside the ones serving (see `ModelRegistry.stage`)."""

    name: str
    path: Path
    versions: dict[int, LoadedVersion] = field(default_factory=dict)
    fingerprint: str = ""
    tried: set[int] = field(default_factory=set)
    # The entry's generation when the switch was planned (see `publish`).
    generation: int = 0


class IndexEntry(msgspec.Struct, omit_defaults=True):
    """One row of Triton's repository index."""

    name: str
    version: str = ""
    state: str = ""
    reason: str = ""


def _not_loaded(entry: ModelEntry) -> ModelState:
    """The state of a version that a load tried but that is not loaded now."""
    return entry.state if entry.state in ("LOADING", "UNLOADING", "UNAVAILABLE") else "UNAVAILABLE"


class ModelRegistry:
    def __init__(
        self,
        plugins: PluginRegistry,
        hardware: Hardware,
        metrics: MetricsRegistry,
        state_dir: Path,
        *,
        cpu_count: int | None = None,
        drain_timeout: float = 30.0,
        overlap_executions: bool = True,
        host_policies: HostPolicies | None = None,
    ) -> None:
        self.plugins = plugins
        self.hardware = hardware
        self.metrics = metrics
        self.drain_timeout = drain_timeout
        self._models: dict[str, ModelEntry] = {}
        # Set only while an update's check warms up staged models (`resolving_staged`).
        self._staged_steps: contextvars.ContextVar[Mapping[str, Staged] | None] = contextvars.ContextVar(
            "staged_steps", default=None
        )
        # Loads an on-demand model if needed and holds it for one request (the service's
        # `hold`, set once residency exists: it is built on this registry). None: every model
        # is loaded at start or on request, and a step not loaded is an error.
        self.lease: Callable[[str], Awaitable[Releasable]] | None = None
        self.loader = ModelLoader(
            plugins, hardware, metrics, state_dir, self._step_model, self.lease_step, cpu_count=cpu_count,
            overlap=overlap_executions, host_policies=host_policies,
        )

    def _step_model(self, name: str, version: str | None) -> LoadedVersion:
        view = self._staged_steps.get()
        staged = view.get(name) if view is not None else None
        if staged is None:
            return self.get(name, version)
        # A staged model answers alone for its name: a version the release lacks is missing.
        if version in (None, "", "-1"):
            return staged.versions[max(staged.versions)]
        if version is not None and version.isdigit() and int(version) in staged.versions:
            return staged.versions[int(version)]
        raise NotFound(f"Request for unknown model: '{name}' version {version} is not found")

    async def lease_step(self, name: str) -> Releasable | None:
        """Hold step model `name` for one ensemble request (daemon.core.ensemble): an
        on-demand model is loaded first, and neither an idle unload nor an eviction takes it
        until the lease is released (the service's `hold`: an empty lease for a model residency
        does not manage). None where nothing is held: no hook, or an update's check resolving
        staged models (the check may hold residency's lock for an on-demand probe, which a load
        from here would wait for without end)."""
        if self.lease is None or self._staged_steps.get() is not None:
            return None
        return await self.lease(name)

    # ------------------------------------------------------------------ queries
    def entry(self, name: str) -> ModelEntry | None:
        return self._models.get(name)

    def names(self) -> list[str]:
        return sorted(self._models)

    def get(self, name: str, version: str | int | None = None) -> LoadedVersion:
        """The version to serve: the given one, else the highest loaded.

        Raises Triton's errors: NotFound (404) for an unknown model or version, Unavailable
        (503) for a version a load tried that is not loaded now.
        """
        entry = self._models.get(name)
        if entry is None or (entry.state == "UNKNOWN" and not entry.versions and not entry.tried):
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        if version in (None, "", -1, "-1"):
            if entry.versions:
                return entry.versions[max(entry.versions)]
            if entry.unloaded:
                raise NotFound(f"Request for unknown model: '{name}' is not found")
            # Loading, failed to load, or unloading: Triton's 404 too.
            raise NotFound(f"Request for unknown model: '{name}' has no available versions")
        try:
            number = int(version)
        except ValueError:
            raise InvalidArgument(f"model version must be an integer, got {version!r}") from None
        if not -(2**63) <= number < 2**63:  # Triton parses it as a 64-bit integer
            raise InvalidArgument(
                f"failed to get model version from specified version string '{version}': "
                "version should be an integral value > 0"
            )
        loaded = entry.versions.get(number)
        if loaded is not None:
            return loaded
        if number in entry.tried:
            raise Unavailable(f"Request for unknown model: '{name}' version {number} is not at ready state")
        raise NotFound(f"Request for unknown model: '{name}' version {number} is not found")

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
            if entry.versions or entry.tried:
                # As Triton: a row per version tried, loaded or not (a failed load, an unload).
                rows.extend(
                    IndexEntry(name=name, version=str(v), state=entry.state, reason=entry.reason)
                    if v in entry.versions
                    else IndexEntry(name=name, version=str(v), state=_not_loaded(entry), reason=entry.reason)
                    for v in sorted(set(entry.versions) | entry.tried)
                )
            elif not ready_only:
                rows.append(IndexEntry(name=name, state=entry.state, reason=entry.reason))
        if ready_only:
            rows = [r for r in rows if r.state == "READY"]
        return rows

    def loaded(self) -> list[LoadedVersion]:
        return [v for e in self._models.values() for v in e.versions.values()]

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
            # The entry's own `tried`: the index lists the versions while they load.
            staged = Staged(name, model_dir, tried=entry.tried)
            try:
                await self._build(staged, override)
            except EdgedError as exc:
                self._failed(entry, staged, exc, previous_state)
                raise
            old = self._swap(entry, staged)
        await self._retire(old)

    def generation(self, name: str) -> int:
        entry = self._models.get(name)
        return entry.generation if entry is not None else 0

    async def stage(
        self, name: str, model_dir: Path, generation: int, *, record_failure: bool = False
    ) -> Staged:
        """Load `model_dir` beside the versions serving `name`, without serving it: `publish`
        swaps staged models in, `discard` drops them. `generation`: `self.generation(name)`
        when the caller decided to load it. Nothing about `name` changes here, except with
        `record_failure` a failure, as `load` records it (the old versions serve on)."""
        staged = Staged(name, model_dir, generation=generation)
        try:
            await self._build(staged, None)
        except EdgedError as exc:
            if record_failure:
                entry = self.note_unknown(name, model_dir)
                self._failed(entry, staged, exc, entry.state)
            raise
        return staged

    @staticmethod
    def _failed(entry: ModelEntry, staged: Staged, exc: EdgedError, previous_state: ModelState) -> None:
        entry.reason = exc.message
        entry.tried |= staged.tried
        # Seen: a poller retries only once the directory changes again.
        entry.fingerprint = staged.fingerprint
        # A failed reload keeps the old versions serving.
        entry.state = "READY" if entry.versions else "UNAVAILABLE"
        log.error("model %s: load failed: %s", entry.name, exc.message)
        if previous_state == "READY" and entry.versions:
            log.warning("model %s: keeping the previously loaded versions", entry.name)

    async def publish(self, staged: Sequence[Staged]) -> None:
        """Swap every staged model in at once (no await between the swaps: no request sees some
        of them new and some old), then drain and unload the versions they replace."""
        entries = [self.note_unknown(s.name, s.path) for s in staged]
        try:
            # No load or unload of them half-way: wait until none holds its entry's lock (one
            # at a time, never holding one while waiting for another: a model's initialize
            # may load another). From the check to the swaps nothing awaits.
            while busy := next((e.lock for e in entries if e.lock.locked()), None):
                async with busy:
                    pass
        except BaseException:  # cancelled: nothing swapped, nothing may stay loaded
            await self.discard(staged)
            raise
        old: list[LoadedVersion] = []
        for entry, one in zip(entries, staged, strict=True):
            if entry.generation != one.generation:
                # Loaded or unloaded since the switch was planned (a request loading an
                # on-demand model, an idle unload, an explicit load or unload): that stands.
                old += one.versions.values()
                continue
            old += self._swap(entry, one)
        # Together: each waits for its own requests, within the one drain timeout.
        await asyncio.gather(*(version.retire(self.drain_timeout) for version in old))

    async def discard(self, staged: Iterable[Staged]) -> None:
        await self._retire(v for one in list(staged) for v in one.versions.values())

    @contextlib.contextmanager
    def resolving_staged(self, staged: Mapping[str, Staged]) -> Iterator[None]:
        """Within this block (this task and those it starts), an ensemble finds its step models
        among `staged` first: a release's ensemble is checked with the release's steps."""
        token = self._staged_steps.set(staged)
        try:
            yield
        finally:
            self._staged_steps.reset(token)

    async def _build(self, staged: Staged, override: ModelConfig | None) -> None:
        """Load `staged`'s versions into it; on an error `staged.fingerprint` is what was seen."""
        name, model_dir = staged.name, staged.path
        staged.fingerprint = await self.loader.fingerprint(model_dir)
        for attempt in range(1, TORN_LOAD_ATTEMPTS + 1):
            plan = await self.loader.plan(name, model_dir, override)
            staged.tried.update(plan.versions)
            versions = await self.loader.load(plan)
            # Each instance reads the files itself: if they changed meanwhile (a deploy
            # replacing them), instances of one version may hold different copies and
            # answer differently. Such a load is thrown away and done again.
            after = await self.loader.fingerprint(model_dir)
            if after == staged.fingerprint:
                staged.versions = versions
                return
            await self._retire(versions.values())
            staged.fingerprint = after
            if attempt == TORN_LOAD_ATTEMPTS:
                staged.fingerprint = ""  # not seen: the poller tries again at its next look
                raise Unavailable(
                    f"model '{name}': its files changed during each of {TORN_LOAD_ATTEMPTS} "
                    "loads (its instances could hold different copies); not loaded"
                )
            log.warning("model %s: its files changed while it loaded; loading it again", name)

    @staticmethod
    def _swap(entry: ModelEntry, staged: Staged) -> list[LoadedVersion]:
        """Make `staged` the entry's serving versions; returns the versions it replaced."""
        old = list(entry.versions.values())
        entry.versions = staged.versions
        entry.generation += 1
        entry.state = "READY"
        entry.reason = ""
        entry.fingerprint = staged.fingerprint
        entry.loaded_from = staged.path
        entry.tried |= staged.tried
        log.info(
            "model %s: ready (versions %s)",
            entry.name,
            ", ".join(f"{v}:{m.backend}" for v, m in sorted(staged.versions.items())),
        )
        return old

    def refuse(self, name: str, model_dir: Path, exc: EdgedError) -> None:
        """Record a load refused before it began (an ensemble whose step models are not
        there), as a failed load is recorded, except that the directory counts as unseen: the
        poller tries again at its next look (the steps may have come)."""
        entry = self.note_unknown(name, model_dir)
        if entry.reason != exc.message:  # once, not at every look of the poller
            log.error("model %s: not loaded: %s", name, exc.message)
        entry.reason = exc.message
        entry.fingerprint = ""
        entry.state = "READY" if entry.versions else "UNAVAILABLE"

    async def unload(self, name: str) -> None:
        entry = self._models.get(name)
        if entry is None:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        async with entry.lock:
            if not entry.versions and entry.state == "UNAVAILABLE":
                # Nothing loaded (a failed load, or already unloaded): Triton leaves the model's
                # state and reason as they are, a failure's included.
                return
            old = entry.versions
            entry.state = "UNLOADING"
            entry.versions = {}
            entry.generation += 1
            await self._retire(old.values())
            entry.state = "UNAVAILABLE"
            entry.reason = "unloaded"
            entry.loaded_from = None
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
        result = await asyncio.to_thread(self.plugins.scan)
        for name in result.added:
            log.info("backend plugin %s discovered", name)
            # Removed and put back between two scans (a directory replaced by rm and copy), it
            # comes back as added, while models loaded from its old copy still run: they reload
            # as for a change. No model runs on a plugin new to this daemon.
            reloaded = await self.reload_backend(name)
            if reloaded:
                log.info("backend plugin %s came back; reloaded models %s", name, reloaded)
        for name in result.changed:
            log.info("backend plugin %s changed; reloading its models", name)
            await self.reload_backend(name)

    def running_on(self, backend: str) -> list[str]:
        """The models with a version loaded on `backend` (a plugin's name)."""
        return [
            e.name
            for e in self._models.values()
            if e.path is not None and any(v.backend == backend for v in e.versions.values())
        ]

    async def reload_backend(self, backend: str) -> list[str]:
        """Reload every model running on a plugin that changed on disk; returns their names."""
        names = self.running_on(backend)
        for name in names:
            entry = self._models[name]
            assert entry.path is not None
            # A failure is already logged, and the old version keeps serving.
            with contextlib.suppress(EdgedError):
                await self.load(name, entry.path)
        return names

    # ------------------------------------------------------------------ internals

    async def _retire(self, versions: Iterable[LoadedVersion]) -> None:
        for model in list(versions):
            await model.retire(self.drain_timeout)
