"""Loading one model: config -> versions -> backend selection -> instances -> scheduler.

Everything blocking here (reading config files and version directories, fingerprinting,
importing plugin code and runtimes, reading artifacts for auto-complete, probing hardware)
runs on worker threads, so a slow load never stalls requests to other models. The registry
decides *when* to load and swaps the result in; this module only builds `LoadedVersion`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import NamedTuple

from daemon.backend import (
    Backend,
    Device,
    ExecuteResult,
    GenerationBackend,
    InferRequest,
    InferResponse,
    InstanceContext,
    ModelControl,
)
from daemon.core import checksum, decoupled, labels, layout, sequence, warmup
from daemon.core.ensemble import EnsembleRunner, Leaser, Resolver
from daemon.core.hardware import Hardware
from daemon.core.host_policy import HostPolicies, format_cpus, process_cpus
from daemon.core.model import LoadedVersion
from daemon.core.plugins import PluginRegistry
from daemon.core.rate_limiter import InstanceLimits, RateLimiter, Ticket
from daemon.core.response_cache import ResponseCache
from daemon.core.scheduler import Scheduler, make_scheduler
from daemon.core.selection import Selection, choose_backends
from daemon.core.stats import MetricsRegistry, ModelStats
from daemon.errors import BackendError, ConfigError, EdgedError, NotFound, PluginError
from daemon.model_config import (
    InstanceGroup,
    ModelConfig,
    check_batch_io,
    check_completed,
)

log = logging.getLogger(__name__)


class LoadPlan(NamedTuple):
    """What one load will try: the model's config and the versions its policy selects."""

    name: str
    model_dir: Path
    config: ModelConfig
    versions: list[int]


class ModelLoader:
    """Builds loaded versions of a model directory; holds no loaded state itself."""

    def __init__(
        self,
        plugins: PluginRegistry,
        hardware: Hardware,
        metrics: MetricsRegistry,
        state_dir: Path,
        resolve_model: Resolver,
        lease_model: Leaser,
        *,
        cpu_count: int | None = None,
        overlap: bool = True,
        host_policies: HostPolicies | None = None,
    ) -> None:
        self.plugins = plugins
        self.hardware = hardware
        self.metrics = metrics
        self.state_dir = state_dir
        # Ensembles find their step models through this (the registry's `get`).
        self.resolve_model = resolve_model
        # ... and hold them for a request through this (the registry's `lease_step`).
        self.lease_model = lease_model
        # The process's CPUs as read before the event loop was placed (a host policy): read
        # now, from the loop's thread, they would be the loop's.
        self._allowed = host_policies.allowed if host_policies is not None else frozenset()
        self.cpu_count = cpu_count or len(self._allowed) or usable_cpus()
        # Passed to each tensor model's scheduler (daemon.core.scheduler: `overlap`).
        self.overlap = overlap
        # None: instances' threads are left where they start.
        self.host_policies = host_policies
        # The repository's control, for models that load others; set by the service once the
        # repository exists (it is built on the registry, which owns this loader).
        self.control: ModelControl | None = None
        # The daemon's response cache (None: it has none), for models whose config enables it.
        self.response_cache: ResponseCache | None = None
        # Triton's rate limiter (None: --rate-limit off), for instance groups with a rate_limiter.
        self.rate_limiter: RateLimiter | None = None

    async def _infer_other(self, name: str, version: str | None, request: InferRequest) -> InferResponse:
        """A request from inside a model (Triton BLS) to another loaded model."""
        return await self.resolve_model(name, version).infer(request)

    async def _stream_other(
        self, name: str, version: str | None, request: InferRequest
    ) -> AsyncGenerator[ExecuteResult, None]:
        """A decoupled request from inside a model (Triton BLS with decoupled=True)."""
        async with contextlib.aclosing(decoupled.responses(self.resolve_model(name, version), request)) as results:
            async for result in results:
                yield result

    async def fingerprint(self, model_dir: Path) -> str:
        return await asyncio.to_thread(layout.fingerprint, model_dir)

    async def plan(self, name: str, model_dir: Path, override: ModelConfig | None = None) -> LoadPlan:
        """The config and the versions its policy selects (ConfigError if none)."""
        config, versions = await asyncio.to_thread(self._plan, name, model_dir, override)
        return LoadPlan(name, model_dir, config, versions)

    async def load(self, plan: LoadPlan) -> dict[int, LoadedVersion]:
        """Every version of the plan, all loaded, or an EdgedError and none."""
        loaded: dict[int, LoadedVersion] = {}
        try:
            for version in plan.versions:
                model = loaded[version] = await self._load_version(
                    plan.name, version, plan.model_dir / str(version), plan.config
                )
                if plan.config.caches_responses() and self.response_cache is not None and model.scheduler is not None:
                    model.cache, model.cache_owner = self.response_cache, self.response_cache.owner()
                    model.stats.cache_enabled = True
        except BaseException:
            for model in loaded.values():
                await model.retire(0)
            raise
        return loaded

    # ------------------------------------------------------------------ steps

    def _plan(self, name: str, model_dir: Path, override: ModelConfig | None) -> tuple[ModelConfig, list[int]]:
        """The config and the version numbers to load (worker thread: reads files)."""
        if override is not None:
            config, warnings = override, list[str]()
        else:
            config, warnings = layout.read_model_config(model_dir)
        for warning in warnings:
            log.warning("model %s: %s", name, warning)
        if not config.name:
            config.name = name
        if config.name != name:
            raise ConfigError(f"model directory {name!r} holds a config named {config.name!r}")
        if config.caches_responses():
            # Triton's checks and words (model_config_utils), made whether or not the daemon
            # has a cache, as there.
            if config.sequence_batching is not None:
                raise ConfigError(
                    f"Response Cache does not currently support model {name} with sequence batching "
                    "scheduler. Please disable the response cache."
                )
            if config.model_transaction_policy.decoupled:
                raise ConfigError(
                    f"Response Cache does not currently support model {name} with 'decoupled' "
                    "transaction policy. Please disable the response cache."
                )
        checksum.verify(config, model_dir)
        available = layout.list_versions(model_dir)
        versions = layout.select_versions(available, config.version_policy, model=name)
        if not versions:
            raise ConfigError(f"model '{name}': no version directories under {model_dir}")
        return config, versions

    async def _load_version(
        self, name: str, version: int, version_dir: Path, config: ModelConfig
    ) -> LoadedVersion:
        stats = ModelStats(name, str(version), self.metrics, tags=config.metric_tags)
        if config.platform == "ensemble" or config.ensemble_scheduling is not None:
            runner = EnsembleRunner(self.resolve_model, self.lease_model, decoupled.responses, name, config, stats)
            return LoadedVersion(
                name, version, config, "ensemble", version_dir, [], stats, runner,
                selection={"backend": "ensemble", "reason": "ensemble_scheduling"},
            )
        selection = await asyncio.to_thread(self._select, config, version_dir)
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
                                           candidate.artifact, candidate.device, stats, selection,
                                           version_dir.parent)
            except EdgedError as exc:
                # Backends name themselves in their messages ("python: model ..."); say it once.
                prefix = f"{candidate.backend}: "
                failures.append(exc.message if exc.message.startswith(prefix) else prefix + exc.message)
                selection.skipped.append((candidate.backend, f"load failed: {exc.message}"))
                log.warning("model %s: backend %s failed, trying the next: %s", name, candidate.backend, exc.message)
        stats.close()
        raise BackendError(f"model '{name}' version {version} failed to load: " + "; ".join(failures))

    def _select(self, config: ModelConfig, version_dir: Path) -> Selection:
        files = {p.name: p for p in version_dir.iterdir()} if version_dir.is_dir() else {}
        return choose_backends(config, files, self.plugins.manifests(), self.hardware, self._resolve_plugin)

    def _resolve_plugin(self, backend: str) -> type[Backend] | str:
        try:
            return self.plugins.resolve(backend)
        except (PluginError, NotFound) as exc:
            return exc.message

    async def _load_on(
        self,
        name: str,
        version: int,
        config: ModelConfig,
        backend: str,
        artifact: Path,
        device: Device,
        stats: ModelStats,
        selection: Selection,
        model_dir: Path,
    ) -> LoadedVersion:
        cls = await asyncio.to_thread(self.plugins.resolve, backend)
        try:
            # Reading the artifact can be slow (a TensorRT engine, a big ONNX file).
            config = await asyncio.to_thread(cls.autocomplete, sequence.for_autocomplete(config), artifact)
        except EdgedError:
            raise
        except Exception as exc:
            raise BackendError(f"backend {backend!r} could not read {artifact}: {exc}") from exc
        # Sequence models: clients see Triton's config (control and state tensors only under
        # sequence_batching); backends load one where they are ordinary inputs and outputs.
        config = sequence.client_config(config)
        check_completed(config)  # on the completed config, as Triton checks them
        await asyncio.to_thread(labels.check_files, model_dir, config)
        check_batch_io(config)
        runtime = sequence.runtime_config(config)
        check_capabilities(backend, cls, runtime)
        # Files under <model>/warmup/ are read here, off the loop; errors fail the load.
        warmups = await asyncio.to_thread(warmup.samples, config, model_dir) if config.model_warmup else []
        manifest = self.plugins.manifest(backend)
        count = sum(g.count for g in config.instance_group) or manifest.default_instances
        if cls.capabilities.kind == "generation":
            count = 1  # one engine owns the context; its slots are the parallelism
        threads = max(1, self.cpu_count // count)
        placement = self._placement(name, config, count, device)
        state = self.state_dir / "models" / name / str(version)
        await asyncio.to_thread(state.mkdir, parents=True, exist_ok=True)
        tickets = self._register_limits(name, config, cls, count, device)
        instances: list[Backend] = []
        started = time.monotonic()
        try:
            for index in range(count):
                cpus = placement[index][1]
                # infer, stream: BLS calls from python models run other loaded models.
                context = InstanceContext(
                    name, version, index, count, state, min(threads, len(cpus) or threads),
                    infer=self._infer_other, stream=self._stream_other, cpus=cpus,
                    metrics=self.metrics.custom, control=self.control,
                )
                instance = cls(context)
                instances.append(instance)
                await instance.load(runtime, artifact, device)
                # Each instance warms up before the model is served, as in Triton.
                await warmup.warm_up(instance, warmups, stats, decoupled=config.model_transaction_policy.decoupled)
        except BaseException as exc:
            if self.rate_limiter is not None:
                self.rate_limiter.unregister(tickets)
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
        if isinstance(instances[0], GenerationBackend):
            stats.engine_stats = instances[0].engine_stats
        limits: InstanceLimits | None = None
        if self.rate_limiter is not None and any(tickets):
            limits = InstanceLimits(
                self.rate_limiter, {i: t for i, t in zip(instances, tickets, strict=True) if t is not None}
            )
        scheduler: Scheduler | None = None
        if cls.capabilities.kind == "tensor":
            scheduler = make_scheduler(config, instances, stats, overlap=self.overlap, limits=limits)
            await scheduler.start()
        explain = selection.explain()
        explain["backend"] = backend
        explain["device"] = str(device)
        explain["instances"] = count
        explain["threads_per_instance"] = instances[0].context.threads
        pinned = {policy: format_cpus(cpus) for policy, cpus in placement if cpus and cpus != self._allowed}
        if pinned:
            explain["host_policies"] = pinned
        explain["load_seconds"] = round(time.monotonic() - started, 3)
        return LoadedVersion(
            name, version, config, backend, artifact, instances, stats, scheduler, explain, device, limits=limits
        )

    def _register_limits(
        self, name: str, config: ModelConfig, cls: type[Backend], count: int, device: Device
    ) -> list[Ticket | None]:
        """Each instance's rate limiter ticket (None: not limited), in instance order."""
        limited = [g for g in config.instance_group if g.rate_limiter is not None]
        if self.rate_limiter is None:
            if limited:
                log.info("model %s: instance_group rate_limiter is ignored: the rate limiter is off "
                         "(--rate-limit=execution_count turns it on)", name)
            return [None] * count
        if any(g.rate_limiter is not None and g.rate_limiter.resources for g in limited) and (
            cls.capabilities.kind != "tensor"
        ):
            # One engine decodes every slot's tokens together: there is no execution to hold.
            raise ConfigError(
                f"model '{name}': instance_group rate_limiter resources are not supported by the "
                f"{cls.capabilities.kind} backend (its engine schedules its own work)"
            )
        # Triton keeps CPU instances' resources on device 0.
        index = device.index if device.kind not in ("auto", "cpu") else 0
        return self.rate_limiter.register((group, index) for group in instance_groups(config, count))

    def _placement(self, name: str, config: ModelConfig, count: int, device: Device) -> list[tuple[str, frozenset[int]]]:
        """Each instance's host policy and CPUs, in instance order (groups' counts laid end
        to end; past them, the last group's)."""
        if self.host_policies is None:
            return [("", frozenset())] * count
        for undefined in self.host_policies.undefined(config.instance_group):
            log.warning("model %s: instance_group host_policy %r is not defined; its instances run without one "
                        "(as in Triton)", name, undefined)
        return [
            self.host_policies.for_instance(group, device.kind, device.index)
            for group in instance_groups(config, count)
        ]


def instance_groups(config: ModelConfig, count: int) -> list[InstanceGroup | None]:
    """Each of `count` instances' group, in instance order: the groups' counts laid end to end,
    past them the last group's; None for a config without groups."""
    groups: list[InstanceGroup | None] = [g for g in config.instance_group for _ in range(g.count)] or [None]
    return [groups[min(index, len(groups) - 1)] for index in range(count)]


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, cgroup cpusets), not the
    machine's count, so instances in a 1-CPU container do not oversubscribe it."""
    return len(process_cpus()) or os.cpu_count() or 1  # no mask to read: not on Linux


def check_capabilities(backend: str, cls: type[Backend], config: ModelConfig) -> None:
    """Refuse a config the backend class says it cannot serve, naming what and why."""
    caps = cls.capabilities
    for tensor in [*config.input, *config.output]:
        if tensor.data_type not in caps.datatypes:
            raise ConfigError(
                f"model '{config.name}': tensor '{tensor.name}' has datatype {tensor.data_type}, "
                f"which backend {backend!r} does not support (it supports {sorted(caps.datatypes)})"
            )
    if config.model_transaction_policy.decoupled and not caps.decoupled:
        raise ConfigError(
            f"model '{config.name}': model_transaction_policy.decoupled is set, but backend "
            f"{backend!r} sends exactly one response per request"
        )
    if config.model_warmup and caps.kind != "tensor":
        raise ConfigError(
            f"model '{config.name}': model_warmup is set, but backend {backend!r} is not run by requests "
            "of tensors (it generates text)"
        )
    ragged = config.ragged_inputs()
    batch_io = "batch_input" if config.batch_input else "batch_output" if config.batch_output else ""
    what = f"input '{ragged[0]}' sets allow_ragged_batch" if ragged else f"{batch_io} is set"
    if (ragged or batch_io) and caps.ragged_batching == "none":
        raise ConfigError(f"model '{config.name}': {what}, but backend {backend!r} cannot batch ragged inputs")
    if batch_io and caps.ragged_batching == "requests":
        raise ConfigError(
            f"model '{config.name}': {batch_io} is set, but backend {backend!r} hands the model each request "
            "as sent, so there is no merged batch to describe (Triton's python backend ignores it)"
        )
    if (ragged or batch_io) and caps.ragged_batching == "merged" and config.max_batch_size == 0:
        raise ConfigError(
            f"model '{config.name}': {what}, which needs max_batch_size > 0 on backend {backend!r}: ragged "
            "inputs are concatenated across the requests of a batch"
        )
    if config.sequence_batching is not None and config.sequence_batching.iterative_sequence and not caps.rescheduling:
        raise ConfigError(
            f"model '{config.name}': sequence_batching.iterative_sequence is set, but backend "
            f"{backend!r} cannot reschedule a request"
        )


