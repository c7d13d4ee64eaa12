"""The daemon as a service: one object that owns its parts and their lifecycle.

`Service.build(config)` is the composition root: it wires plugins, hardware facts, registry,
repository and releases together, and nothing else constructs them. The transport
(daemon.api) and the entry points (daemon.server, daemon.cli) only call its methods:

    start()   scan plugins -> load the startup model set -> start pollers and the update inbox
    reload()  SIGHUP and updates: rescan plugins (models may need a new one), then the repository
    stop()    refuse new work (503) -> cancel pollers -> drain schedulers -> unload every model

Draining in-flight HTTP requests happens between "refuse" and "unload", in the server, which
owns the listeners.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from daemon.config import DaemonConfig, parse_quantiles, state_dir, trusted_keys_dir, updates_root
from daemon.core import uploads
from daemon.core.hardware import Hardware
from daemon.core.host_policy import HostPolicies
from daemon.core.plugins import PluginRegistry
from daemon.core.rate_limiter import RateLimiter
from daemon.core.registry import ModelRegistry
from daemon.core.releases import ReleaseManager
from daemon.core.repository import ModelControlHook, RepositoryManager
from daemon.core.residency import Lease, Residency
from daemon.core.response_cache import ResponseCache
from daemon.core.stats import LatencyMetrics, MetricsRegistry
from daemon.model_config import parse_memory_size
from daemon.updates.store import ReleaseStore

log = logging.getLogger(__name__)


def shipped_backends_dir() -> Path:
    """`backends/` beside the executable (frozen) or beside the `daemon` package (source)."""
    if getattr(sys, "frozen", False):
        return Path(sys.executable).resolve().parent / "backends"
    return Path(__file__).resolve().parent.parent / "backends"


def demo_repository() -> Path:
    """The no-flag demo (Triton's `simple` as ONNX and as a Python model), shipped as package
    data: served in place, never written."""
    return Path(__file__).resolve().parent / "demo_models"


@dataclass
class Service:
    config: DaemonConfig
    state_dir: Path
    plugins: PluginRegistry
    hardware: Hardware
    metrics: MetricsRegistry
    registry: ModelRegistry
    repository: RepositoryManager
    releases: ReleaseManager
    # On-demand loading, keep_alive and the memory budget (daemon.core.residency).
    residency: Residency | None = None
    # False once shutdown begins: new work is answered 503 while in-flight work drains.
    accepting: bool = True
    # True once the startup model set has been loaded (the readiness gate for /v2/health/ready).
    started: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Serializes repository rescans, plugin rescans and update applies.
    control_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def build(cls, config: DaemonConfig, host_policies: HostPolicies | None = None) -> Service:
        """The composition root. Cheap: no model, plugin or runtime is touched until start()."""
        state = state_dir(config)
        store = ReleaseStore(updates_root(config))
        store.recover()  # a crash mid-update leaves a complete old or new release, never a mix
        backend_dirs = [Path(d) for d in config.backends.directories] or [shipped_backends_dir()]
        plugins = PluginRegistry(backend_dirs, check_ownership=config.backends.check_ownership)
        repositories = [Path(r) for r in config.models.repository]
        release = store.current_release()
        if not repositories and not (release is not None and (release / "models").is_dir()):
            repositories = [demo_repository()]
            log.info("no model repository configured: serving the demo models from %s", repositories[0])
        metrics = MetricsRegistry(LatencyMetrics(
            config.metrics.counter_latencies, config.metrics.summary_latencies,
            parse_quantiles(config.metrics.summary_quantiles),
        ))
        hardware = Hardware()
        # Checked here, so that a policy this box cannot honour stops the daemon at start.
        host_policies = host_policies or HostPolicies.from_config(config)
        registry = ModelRegistry(
            plugins, hardware, metrics, state, drain_timeout=config.server.shutdown_timeout,
            # With HTTP worker processes feeding it, the daemon's loop is what limits small
            # requests at load, and a second execution queued on a model's thread cost it
            # a third of its throughput at 32 clients (docs/performance.md); alone, it gains.
            overlap_executions=config.server.workers == 0,
            host_policies=host_policies,
        )
        repository = RepositoryManager(
            registry, repositories, config.models.control_mode, startup_models=config.models.load,
            state_dir=state,
        )
        residency = Residency(registry, config.residency)
        repository.on_demand = residency.on_demand
        control_lock = asyncio.Lock()
        releases = ReleaseManager(
            store, trusted_keys_dir(config), registry, repository, plugins, control_lock,
            keep=config.updates.keep_releases, residency=residency,
        )
        releases.point_at(release)
        service = cls(
            config=config,
            state_dir=state,
            plugins=plugins,
            hardware=hardware,
            metrics=metrics,
            registry=registry,
            repository=repository,
            releases=releases,
            control_lock=control_lock,
            residency=residency,
        )
        # Models that load others (pb_utils.load_model) go through the repository, as long as
        # the service accepts work.
        registry.loader.control = ModelControlHook(repository, lambda: service.accepting)
        # Ensembles hold their step models for each request, loading on-demand ones.
        registry.lease = service.hold
        if config.server.response_cache_size:
            cache = ResponseCache(parse_memory_size(config.server.response_cache_size))
            metrics.register(cache.families)
            registry.loader.response_cache = cache
        if config.rate_limit.mode == "execution_count":
            # Off (Triton's default), every instance group's rate_limiter is ignored.
            registry.loader.rate_limiter = RateLimiter(config.rate_limit.resources)
        return service

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(uploads.clean_incoming, self.state_dir)
        await asyncio.to_thread(self.plugins.scan)
        failed = await self.repository.startup()
        if failed:
            log.error("models that failed to load at start: %s", ", ".join(failed))
        self.started = True
        if self.config.backends.poll_secs > 0:
            self._every(self.config.backends.poll_secs, self.rescan_plugins, "plugin scan")
        if self.config.models.control_mode == "poll":
            self._every(self.config.models.poll_secs, self.rescan_models, "repository poll")
        if self.config.updates.inbox:
            from daemon.updates.inbox import watch_inbox

            inbox = Path(self.config.updates.inbox)

            async def apply(path: Path) -> object:
                return await self.releases.apply(path)

            self.tasks.append(
                asyncio.create_task(watch_inbox(inbox, apply, self.config.updates.inbox_poll_secs))
            )

    async def stop(self) -> None:
        self.accepting = False
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()
        if self.residency is not None:
            await self.residency.close()
        await self.registry.close()

    async def reload(self) -> None:
        """SIGHUP: serve the release store's `current` (`edged update` may have switched it),
        plugins first (models may need a new plugin), then models."""
        await self.releases.reload_current()

    async def rescan_plugins(self) -> None:
        """Pick up new, changed and removed plugins; reload models whose plugin changed."""
        async with self.control_lock:
            await self.registry.sync_plugins()

    async def rescan_models(self) -> None:
        async with self.control_lock:
            await self.repository.rescan()

    # ------------------------------------------------------------------ requests

    async def hold(self, name: str, keep_alive: float | Literal["default"] | None = "default") -> Lease:
        """Load an on-demand model if needed and lease it for one request: while the lease is
        held, no idle unload or eviction takes the model. The caller releases it once its
        response is written. No loads once shutdown has begun."""
        residency = self.residency
        if residency is None or not self.accepting:
            return Lease(None, None)
        return residency.try_acquire(name, keep_alive) or await residency.acquire(name, keep_alive)

    # ------------------------------------------------------------------ state

    def ready(self) -> bool:
        return self.accepting and self.started and self.registry.all_ready()

    def status(self) -> str:
        names = self.registry.names()
        ready = sum(1 for name in names if self.registry.is_ready(name))
        return f"{ready}/{len(names)} models ready"

    def _every(self, interval: float, action: Callable[[], Awaitable[None]], what: str) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await action()
                except Exception:  # a failing poll must never end the poller
                    log.exception("%s failed", what)

        self.tasks.append(asyncio.create_task(loop()))
