"""Model repository control: Triton's `none | poll | explicit` model control modes.

- none: every model in the repositories is loaded at start; nothing changes afterwards
  (except a SIGHUP rescan, which the operator asked for).
- poll: like none, then the repositories are rescanned every `poll_secs`; a changed model is
  reloaded (load-then-swap), a new one loaded, a removed one unloaded.
- explicit: only the models named at start (or `*`) are loaded; the rest wait for
  `POST /v2/repository/models/{m}/load`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from daemon.config import ControlMode
from daemon.core import layout, uploads
from daemon.core.registry import IndexEntry, ModelRegistry
from daemon.errors import BackendError, Conflict, EdgedError, InvalidArgument, NotFound, Unavailable
from daemon.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class Rescan:
    """What a rescan found: every model the repositories hold, and those to load from there."""

    found: dict[str, Path]
    to_load: dict[str, Path]
    # Each entry's generation when it was chosen to load (ModelRegistry.generation).
    generations: dict[str, int] = field(default_factory=dict)


class RepositoryManager:
    def __init__(
        self,
        registry: ModelRegistry,
        repositories: list[Path],
        mode: ControlMode,
        *,
        startup_models: list[str] | None = None,
        state_dir: Path | None = None,
    ) -> None:
        self.registry = registry
        # Where model files sent in load requests are written (uploads).
        self.state_dir = state_dir or Path(tempfile.gettempdir()) / "edged"
        self.repositories = repositories
        self.mode = mode
        self.startup_models = startup_models or []
        # Residency hook: models it says load on demand are left out of startup and rescans.
        self.on_demand: Callable[[str, Path], Awaitable[bool]] | None = None

    async def _on_demand(self, name: str, path: Path) -> bool:
        return self.on_demand is not None and await self.on_demand(name, path)

    def scan(self) -> dict[str, Path]:
        """Model name -> directory over every repository (the first repository wins a name)."""
        found: dict[str, Path] = {}
        for repo in self.repositories:
            for name, path in layout.scan_repository(repo).items():
                if name in found:
                    log.warning("model %s found in %s and %s; using the first", name, found[name], path)
                    continue
                found[name] = path
        return found

    async def startup(self) -> list[str]:
        """Load the startup set; returns the names that failed (they stay UNAVAILABLE)."""
        models = await asyncio.to_thread(self.scan)
        for name, path in models.items():
            self.registry.note_unknown(name, path)
        if self.mode == "explicit":
            wanted = list(models) if "*" in self.startup_models else self.startup_models
            # As in Triton, an ensemble named at start brings its step models (`_load_many`
            # loads them before it).
            if "*" not in self.startup_models:
                wanted = list(dict.fromkeys(wanted + await self._steps_of(wanted, models)))
        else:
            wanted = list(models)
        deferred = [n for n in wanted if n in models and await self._on_demand(n, models[n])]
        if deferred:
            log.info("models loaded on first request (load: on-demand): %s", ", ".join(deferred))
        wanted = [n for n in wanted if n not in deferred]
        missing = [n for n in wanted if n not in models]
        for name in missing:
            log.error("model %s was asked for at start but is not in the repository", name)
        return missing + await self._load_many({n: models[n] for n in wanted if n in models})

    async def _load_many(self, models: dict[str, Path]) -> list[str]:
        # The ensembles after the rest: each is checked against the step models loaded then.
        others, ensembles = await self.step_order(models)
        results = list(await asyncio.gather(
            *(self.registry.load(name, models[name]) for name in others), return_exceptions=True,
        ))
        found: dict[str, Path] | None = None
        for name, steps in ensembles.items():  # no backends: quick, each after those it leads to
            try:
                if found is None:
                    found = await asyncio.to_thread(self.scan)
                await self._check_steps_there(name, models[name], steps, found)
                await self.registry.load(name, models[name])
            except Exception as exc:  # reported below, as gather's are
                results.append(exc)
            else:
                results.append(None)
        failed: list[str] = []
        for name, result in zip([*others, *ensembles], results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, EdgedError):
                    log.error("model %s: unexpected load failure", name, exc_info=result)
                failed.append(name)
        return failed

    async def _check_steps_there(self, name: str, path: Path, steps: list[str], found: Mapping[str, Path]) -> None:
        """As Triton at start and when it polls, an ensemble loads only once its step models
        (`steps`) are loaded (or load on demand): one in no repository, or whose load failed,
        refuses it with Triton's texts (recorded as its load failure; a rescan tries it again)."""
        for step in dict.fromkeys(steps):
            entry = self.registry.entry(step)
            if entry is not None and entry.versions:
                continue
            step_path = found.get(step)
            if step_path is not None and await self._on_demand(step, step_path):
                continue
            if step_path is None:
                reason = _not_available(name, step)
            elif entry is not None and entry.state == "UNAVAILABLE" and entry.reason and not entry.unloaded:
                reason = _no_loaded_version(name, step, entry.reason)  # its load failed
            else:
                reason = _no_loaded_version(name, step)
            refusal = InvalidArgument(reason)
            self.registry.refuse(name, path, refusal)
            raise refusal

    async def step_order(self, models: Mapping[str, Path]) -> tuple[list[str], dict[str, list[str]]]:
        """`models` split into those that are not ensembles (by name) and the ensembles with
        their step models, each after the ensembles among `models` it leads to (a cycle in any
        order: its load refuses it). A config that does not read counts as no ensemble; its load
        says why."""
        configs = await asyncio.to_thread(_read_configs, models)
        steps: dict[str, list[str]] = {}
        others: list[str] = []
        for name in sorted(models):
            config = configs[name]
            if config is None or config.ensemble_scheduling is None:
                others.append(name)
            else:
                steps[name] = [step.model_name for step in config.ensemble_scheduling.step]
        ordered: dict[str, list[str]] = {}

        def visit(name: str, path: set[str]) -> None:
            if name in ordered or name in path:
                return
            for step in steps[name]:
                if step in steps:
                    visit(step, path | {name})
            ordered[name] = steps[name]

        for name in steps:
            visit(name, set())
        return others, ordered

    async def rescan(self) -> None:
        """Bring loaded models in line with the repository (poll mode, SIGHUP, updates)."""
        plan = await self.plan()
        for name, path in plan.found.items():
            self.registry.note_unknown(name, path)
        await self._load_many(plan.to_load)
        await self.drop_removed(plan)

    async def plan(self) -> Rescan:
        """What a rescan would do now; changes nothing."""
        models = await asyncio.to_thread(self.scan)
        to_load: dict[str, Path] = {}
        generations: dict[str, int] = {}
        for name, path in models.items():
            entry = self.registry.entry(name)
            # Read with what decides (before any await): see ModelRegistry.publish.
            generation = entry.generation if entry is not None else 0
            if entry is None or entry.path != path:
                loaded = entry is not None and bool(entry.versions)
                # An on-demand model loads when a request needs it, but one loaded now (from
                # the release an update replaces) moves to the new directory at once.
                if self.follows(name) and (loaded or not await self._on_demand(name, path)):
                    to_load[name], generations[name] = path, generation
                continue
            if not entry.versions and (self.mode == "explicit" or await self._on_demand(name, path)):
                continue
            if entry.unloaded:
                continue
            if await asyncio.to_thread(layout.fingerprint, path) != entry.fingerprint:
                to_load[name], generations[name] = path, generation
        return Rescan(models, to_load, generations)

    async def settle(self, plan: Rescan, skip: set[str]) -> None:
        """After an update published a release's models (loaded per `plan`; `skip`: those
        that failed to load, which keep their old versions): every model's directory is the
        new one; one loaded from an old one meanwhile (a request loading an on-demand model
        while the release was checked) moves at once; models no repository holds go."""
        moved: dict[str, Path] = {}
        for name, path in plan.found.items():
            entry = self.registry.note_unknown(name, path)
            if entry.versions and entry.loaded_from not in (None, path) and self.follows(name) and name not in skip:
                moved[name] = path
        await self._load_many(moved)
        await self.drop_removed(plan)

    async def drop_removed(self, plan: Rescan) -> None:
        """Unload and forget the models no repository holds any more, and, as Triton does, the
        loaded ensembles over them (refused until their steps are back: a rescan tries them)."""
        gone: set[str] = set()
        for name in self.registry.names():
            if name not in plan.found:
                entry = self.registry.entry(name)
                if entry is not None and entry.versions:
                    await self.registry.unload(name)
                    gone.add(name)
                self.registry.forget(name)
        for name, step in await self._unload_dependents(gone):
            entry = self.registry.entry(name)
            if entry is not None and entry.path is not None and not entry.versions:
                self.registry.refuse(name, entry.path, InvalidArgument(_no_loaded_version(name, step)))

    def follows(self, name: str) -> bool:
        """Whether the model loads from wherever the repository has it now: every model,
        except in explicit mode, where only those loaded now (an update moves them to the new
        release, as a change of their files reloads them) and the startup set (a restart
        would load them from the new release)."""
        if self.mode != "explicit":
            return True
        entry = self.registry.entry(name)
        loaded = entry is not None and bool(entry.versions)
        return loaded or "*" in self.startup_models or name in self.startup_models

    async def poll_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.rescan()
            except Exception:  # a bad scan must never end the poller
                log.exception("repository poll failed")

    # ------------------------------------------------------------------ explicit control

    def _check_explicit(self, action: str) -> None:
        if self.mode != "explicit":
            raise Conflict(f"explicit model {action} is not allowed if polling is enabled"
                           if self.mode == "poll"
                           else f"explicit model {action} is not allowed if model control mode is none")

    async def load(
        self, name: str, config_json: str | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Explicit load; `config_json` (Triton's JSON layout) replaces the config on disk.
        `files` (relative path -> contents, Triton's `file:` load parameters) are written to a
        fresh directory under the state dir, which then replaces the repository's directory;
        it is removed again if the load fails, and older uploads of the model are pruned."""
        self._check_explicit("load / unload")
        layout.check_model_name(name)
        if not files:
            models = await asyncio.to_thread(self.scan)
            path = models.get(name)
            if path is None:
                raise NotFound(f"failed to load '{name}', failed to poll from model repository")
            await self._load(name, path, config_json)
            return
        uploaded = await asyncio.to_thread(uploads.write, self.state_dir, name, files)
        try:
            await self._load(name, uploaded, config_json)
        except BaseException:
            await asyncio.to_thread(uploads.remove, uploaded)
            raise
        await asyncio.to_thread(uploads.prune, self.state_dir, name, uploaded)

    async def _load(self, name: str, path: Path, config_json: str | None) -> None:
        override = None
        if config_json is not None:
            from daemon.core.triton_config import PbtxtParser

            override, warnings = await asyncio.to_thread(
                PbtxtParser().parse_json, config_json, source="parameters.config"
            )
            for warning in warnings:
                log.warning("model %s: %s", name, warning)
        await self._load_steps(name, path, override, {name})
        await self.registry.load(name, path, override)

    async def _config_of(self, path: Path) -> ModelConfig | None:
        """The config on disk, or None where it does not read (its load then says why)."""
        return (await asyncio.to_thread(_read_configs, {"": path}))[""]

    async def _steps_of(self, names: list[str], models: Mapping[str, Path]) -> list[str]:
        """The step models that the ensembles among `names` lead to (through nested ensembles),
        as far as the repositories have them, except those that load on demand."""
        found: list[str] = []
        pending = list(names)
        seen = set(names)
        while pending:
            path = models.get(pending.pop())
            config = await self._config_of(path) if path is not None else None
            if config is None or config.ensemble_scheduling is None:
                continue
            for step in config.ensemble_scheduling.step:
                step_path = models.get(step.model_name)
                if step.model_name in seen or step_path is None or await self._on_demand(step.model_name, step_path):
                    continue
                seen.add(step.model_name)
                found.append(step.model_name)
                pending.append(step.model_name)
        return found

    async def _load_steps(self, name: str, path: Path, override: ModelConfig | None, loading: set[str]) -> None:
        """Triton's explicit load of an ensemble loads its step models that are not loaded
        (and theirs) first, and fails with its texts if one is in no repository or fails to
        load. On-demand steps load with the requests that need them; a step under way in
        this same load (`loading`, a cycle) is left to the ensemble's own cycle check."""
        config = override or await self._config_of(path)
        if config is None or config.ensemble_scheduling is None:
            return
        models: dict[str, Path] | None = None
        for step in config.ensemble_scheduling.step:
            entry = self.registry.entry(step.model_name)
            if entry is not None and entry.versions:
                continue
            if step.model_name in loading:  # not loaded and under way in this load: a cycle
                raise InvalidArgument(
                    f"load failed for model '{name}': ensemble '{name}' contains a cycle: its "
                    f"steps lead back to '{step.model_name}'"
                )
            if models is None:
                models = await asyncio.to_thread(self.scan)
            step_path = models.get(step.model_name)
            if step_path is None:
                raise InvalidArgument(f"load failed for model '{name}': {_not_available(name, step.model_name)}")
            if await self._on_demand(step.model_name, step_path):
                continue
            loading.add(step.model_name)
            try:
                await self._load_steps(step.model_name, step_path, None, loading)
                await self.registry.load(step.model_name, step_path)
            except EdgedError as exc:
                raise InvalidArgument(
                    f"load failed for model '{name}': {_no_loaded_version(name, step.model_name, exc.message)}"
                ) from exc

    async def unload(self, name: str, *, dependents: bool = False) -> None:
        """Explicit unload. A model that is not loaded is already unloaded (as in Triton).
        With `dependents` (Triton's `unload_dependents`), an ensemble's step models go too;
        the ensembles over an unloaded model always go (`_unload_dependents`)."""
        self._check_explicit("load / unload")
        steps: list[str] = []
        entry = self.registry.entry(name)
        if dependents and entry is not None:
            for model in entry.versions.values():
                ensemble = model.config.ensemble_scheduling
                if ensemble is not None:
                    steps += [s.model_name for s in ensemble.step if s.model_name not in steps]
        for target in [name, *steps]:
            with contextlib.suppress(NotFound):
                await self.registry.unload(target)
        await self._unload_dependents({name, *steps})

    async def _unload_dependents(self, gone: set[str]) -> list[tuple[str, str]]:
        """As in Triton, the loaded ensembles that lead to an unloaded model are unloaded too:
        they could no longer answer. Not for an on-demand model: a request loads it again.
        Returns each ensemble unloaded, with the step model it lost."""
        unloaded: list[tuple[str, str]] = []
        while gone:
            for name in list(gone):
                entry = self.registry.entry(name)
                if entry is not None and entry.path is not None and await self._on_demand(name, entry.path):
                    gone.discard(name)
            dependents = [(other, step) for other in self.registry.names()
                          if (step := self._step_among(other, gone)) is not None]
            for other, _ in dependents:
                log.info("model %s: unloaded with a step model it needs", other)
                with contextlib.suppress(NotFound):
                    await self.registry.unload(other)
            unloaded += dependents
            gone = {other for other, _ in dependents}
        return unloaded

    def _step_among(self, name: str, models: set[str]) -> str | None:
        """The first step model among `models` of `name`, if it is a loaded ensemble."""
        entry = self.registry.entry(name)
        for version in entry.versions.values() if entry is not None else ():
            ensemble = version.config.ensemble_scheduling
            for step in ensemble.step if ensemble is not None else ():
                if step.model_name in models:
                    return step.model_name
        return None

    async def index(self, ready_only: bool = False) -> list[IndexEntry]:
        # Models present on disk but never seen are listed too, like Triton.
        for name, path in (await asyncio.to_thread(self.scan)).items():
            if self.registry.entry(name) is None:
                self.registry.note_unknown(name, path)
        return self.registry.index(ready_only)


def _read_configs(models: Mapping[str, Path]) -> dict[str, ModelConfig | None]:
    """Each model's config on disk, None where it does not read (its load then says why)."""
    configs: dict[str, ModelConfig | None] = {}
    for name, path in models.items():
        try:
            configs[name] = layout.read_model_config(path)[0]
        except EdgedError:
            configs[name] = None
    return configs


def _not_available(ensemble: str, step: str) -> str:
    """Triton's text for an ensemble whose step model is in no repository."""
    return f"ensemble {ensemble} contains models that are not available or ambiguous: {step}"


def _no_loaded_version(ensemble: str, step: str, error: str | None = None) -> str:
    """Triton's text for an ensemble whose step model is not loaded (`error`: why its load failed)."""
    text = f"ensemble '{ensemble}' depends on '{step}' which has no loaded version"
    return text if error is None else f"{text}. Model '{step}' loading failed with error: {error}"


def load_failure(name: str, exc: BackendError) -> InvalidArgument:
    """Triton answers a model that fails to load with a 400 starting this way."""
    return InvalidArgument(f"load failed for model '{name}': {exc.message}")


class ModelControlHook:
    """The repository's explicit control as a model calls it (the contract's ModelControl):
    Triton's C API takes the load parameters by name, so `file:` paths are checked here."""

    def __init__(self, repository: RepositoryManager, accepting: Callable[[], bool]) -> None:
        self._repository = repository
        # False once the daemon shuts down: a model still running then loads nothing new,
        # which the registry's close would not see (as the repository API answers then).
        self._accepting = accepting

    async def load(self, name: str, config_json: str | None, files: Mapping[str, bytes]) -> None:
        self._check_accepting()
        try:
            await self._repository.load(name, config_json, uploads.model_files(files, config_json))
        except BackendError as exc:
            raise load_failure(name, exc) from None

    async def unload(self, name: str, dependents: bool) -> None:
        self._check_accepting()
        await self._repository.unload(name, dependents=dependents)

    def _check_accepting(self) -> None:
        if not self._accepting():
            raise Unavailable("server is shutting down")

    def is_ready(self, name: str, version: str) -> bool:
        # Digits only: Triton 2.51 reads the number a text starts with ("1.0" is 1, "-1" is
        # refused) and answers "0", a version no model has, with not ready.
        if version and not (version.isascii() and version.isdigit() and int(version) < 2**63):
            raise InvalidArgument(
                f"failed to get model version from specified version string '{version}': "
                "version should be an integral value > 0"
            )
        return self._repository.registry.is_ready(name, version or None)
