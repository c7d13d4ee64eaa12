"""The objects a running daemon is made of, held by the aiohttp app under one typed key.

Handlers reach the data plane only through this; nothing lives in module globals.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from daemon.api.kserve_codec import Codec
from daemon.config import DaemonConfig
from daemon.core.hardware import HardwareInfo
from daemon.core.plugins import PluginRegistry
from daemon.core.registry import ModelRegistry
from daemon.core.releases import ReleaseManager
from daemon.core.repository import RepositoryManager
from daemon.core.residency import Residency
from daemon.core.stats import MetricsRegistry


@dataclass
class Daemon:
    config: DaemonConfig
    state_dir: Path
    plugins: PluginRegistry
    hardware: HardwareInfo
    metrics: MetricsRegistry
    registry: ModelRegistry
    repository: RepositoryManager
    codec: Codec
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


DAEMON = web.AppKey("daemon", Daemon)


def daemon_of(request: web.Request) -> Daemon:
    return request.app[DAEMON]
