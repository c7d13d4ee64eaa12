"""Builds the aiohttp application and owns the daemon's lifecycle through `cleanup_ctx`.

Start: scan plugins -> load the startup model set -> start pollers. Stop (after aiohttp has
stopped accepting and drained in-flight requests for `shutdown_timeout`): refuse new work,
cancel pollers, drain schedulers, unload every model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web

from daemon.api import admin, kserve, openai
from daemon.api.errors import error_response, make_error_middleware
from daemon.api.kserve_codec import Codec
from daemon.api.state import DAEMON, Daemon
from daemon.config import DaemonConfig, state_dir, trusted_keys_dir, updates_root
from daemon.core.ensemble import install_ensembles
from daemon.core.hardware import probe_hardware
from daemon.core.plugins import PluginRegistry
from daemon.core.registry import ModelRegistry
from daemon.core.releases import ReleaseManager
from daemon.core.repository import RepositoryManager
from daemon.core.stats import MetricsRegistry
from daemon.updates.store import ReleaseStore

log = logging.getLogger(__name__)


def shipped_backends_dir() -> Path:
    """`backends/` beside the executable (frozen) or beside the `daemon` package (source)."""
    if getattr(sys, "frozen", False):
        return Path(sys.executable).resolve().parent / "backends"
    return Path(__file__).resolve().parent.parent.parent / "backends"


def build_daemon(config: DaemonConfig) -> Daemon:
    state = state_dir(config)
    store = ReleaseStore(updates_root(config))
    store.recover()  # a crash mid-update leaves a complete old or new release, never a mix
    backend_dirs = [Path(d) for d in config.backends.directories] or [shipped_backends_dir()]
    plugins = PluginRegistry(backend_dirs, check_ownership=config.backends.check_ownership)
    repositories = [Path(r) for r in config.models.repository]
    release = store.current_release()
    if not repositories and not (release is not None and (release / "models").is_dir()):
        repositories = [ensure_demo_repository(state)]
    metrics = MetricsRegistry()
    registry = ModelRegistry(
        plugins, probe_hardware(), metrics, state, drain_timeout=config.server.shutdown_timeout
    )
    install_ensembles(registry)
    repository = RepositoryManager(
        registry, repositories, config.models.control_mode, startup_models=config.models.load
    )
    control_lock = asyncio.Lock()
    releases = ReleaseManager(
        store, trusted_keys_dir(config), registry, repository, plugins, control_lock, keep=config.updates.keep_releases
    )
    releases.point_at(release)
    return Daemon(
        config=config,
        state_dir=state,
        plugins=plugins,
        hardware=registry.hardware,
        metrics=metrics,
        registry=registry,
        repository=repository,
        codec=Codec(max_request_bytes=config.server.max_request_bytes),
        releases=releases,
        control_lock=control_lock,
    )


def ensure_demo_repository(state: Path) -> Path:
    """The no-flag demo: Triton's `simple` model as ONNX and as a Python model."""
    from daemon.demo import write_simple_repository

    repo = state / "demo-repository"
    if not (repo / "simple").exists():
        repo.mkdir(parents=True, exist_ok=True)
        write_simple_repository(repo)
        log.info("wrote the demo model repository to %s", repo)
    return repo


async def _every(interval: float, action: Callable[[], Awaitable[None]], what: str) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await action()
        except Exception:  # a failing poll must never end the poller
            log.exception("%s failed", what)


async def rescan_plugins(daemon: Daemon) -> None:
    """Pick up new, changed and removed plugins; reload models whose plugin changed."""
    async with daemon.control_lock:
        await daemon.registry.sync_plugins()


async def rescan_all(daemon: Daemon) -> None:
    """SIGHUP: serve the release store's `current` (`edged update` may have switched it), plugins
    first (models may need a new plugin), then models."""
    await daemon.releases.reload_current()


async def daemon_context(app: web.Application) -> AsyncIterator[None]:
    daemon = app[DAEMON]
    daemon.plugins.scan()
    failed = await daemon.repository.startup()
    if failed:
        log.error("models that failed to load at start: %s", ", ".join(failed))
    daemon.started = True
    if daemon.config.backends.poll_secs > 0:
        daemon.tasks.append(
            asyncio.create_task(
                _every(daemon.config.backends.poll_secs, lambda: rescan_plugins(daemon), "plugin scan")
            )
        )
    if daemon.config.models.control_mode == "poll":
        daemon.tasks.append(
            asyncio.create_task(
                _every(
                    daemon.config.models.poll_secs,
                    lambda: _locked_rescan(daemon),
                    "repository poll",
                )
            )
        )
    daemon.tasks.extend(admin.start_background(daemon))
    yield
    daemon.accepting = False
    for task in daemon.tasks:
        task.cancel()
    for task in daemon.tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    await daemon.registry.close()


async def _locked_rescan(daemon: Daemon) -> None:
    async with daemon.control_lock:
        await daemon.repository.rescan()


async def _not_found(request: web.Request) -> web.Response:
    return error_response(404, "Not Found")


def create_app(config: DaemonConfig, daemon: Daemon | None = None) -> web.Application:
    daemon = daemon or build_daemon(config)
    app = web.Application(
        client_max_size=config.server.max_request_bytes,
        middlewares=[make_error_middleware(frozenset(config.server.allowed_uids))],
    )
    app[DAEMON] = daemon
    kserve.add_routes(app)
    openai.add_routes(app)
    admin.add_routes(app)
    app.router.add_route("*", "/{tail:.*}", _not_found)
    app.cleanup_ctx.append(daemon_context)
    return app
