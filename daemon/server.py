"""Running the daemon: listeners (Unix socket, TCP, sockets passed by systemd), signals, sd_notify.

Shutdown order (SIGTERM/SIGINT): STOPPING=1 -> stop accepting connections -> in-flight requests
drain for `shutdown_timeout` -> remaining handlers cancelled -> models unloaded (cleanup_ctx).
SIGHUP: RELOADING=1 -> rescan plugins and repository -> READY=1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

from aiohttp import web

from daemon.api.app import create_app
from daemon.config import DaemonConfig, parse_host_port, socket_path
from daemon.ops.systemd import Notifier, listen_fds, watchdog_interval, watchdog_loop
from daemon.service import Service

log = logging.getLogger(__name__)


async def _start_unix_site(runner: web.AppRunner, path: Path, mode: int) -> web.UnixSite:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        # A stale socket from a crashed run would make bind() fail.
        if path.is_socket():
            path.unlink()
    # The umask makes bind() create the socket with the right mode: no chmod race window.
    old = os.umask(0o777 & ~mode)
    try:
        site = web.UnixSite(runner, str(path))
        await site.start()
    finally:
        os.umask(old)
    return site


async def serve(config: DaemonConfig, *, stop: asyncio.Event | None = None) -> None:
    notifier = Notifier()
    service = Service.build(config)
    app = create_app(service)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that goes away cancels its generation
        shutdown_timeout=config.server.shutdown_timeout,
        access_log=None,
    )
    notifier.status("loading models")
    await runner.setup()
    sites: list[web.BaseSite] = []
    passed = listen_fds()
    for sock, name in passed:
        sock_site = web.SockSite(runner, sock)
        await sock_site.start()
        sites.append(sock_site)
        log.info("listening on systemd socket %s (%s)", name or "unnamed", sock.getsockname())
    uds = socket_path(config)
    if not passed and uds is not None:
        sites.append(await _start_unix_site(runner, uds, int(config.server.socket_mode, 8)))
        log.info("listening on unix:%s  (try: curl --unix-socket %s http://localhost/v2/models/simple)", uds, uds)
    if config.server.http:
        host, port = parse_host_port(config.server.http)
        tcp_site = web.TCPSite(runner, host, port, reuse_address=True)
        await tcp_site.start()
        sites.append(tcp_site)
        log.info("listening on http://%s:%d", host, port)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    reloading = asyncio.Lock()

    async def reload() -> None:
        async with reloading:
            notifier.reloading()
            log.info("SIGHUP: rescanning plugins and model repository")
            try:
                await service.reload()
            finally:
                notifier.ready(service.status())

    reload_tasks: set[asyncio.Task[None]] = set()

    def on_hup() -> None:
        task = asyncio.create_task(reload())
        reload_tasks.add(task)
        task.add_done_callback(reload_tasks.discard)

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    watchdog: asyncio.Task[None] | None = None
    interval = watchdog_interval()
    if interval:
        watchdog = asyncio.create_task(watchdog_loop(notifier, interval))
    notifier.ready(service.status())
    log.info("ready: %s", service.status())
    try:
        await stop.wait()
    finally:
        notifier.stopping()
        log.info("shutting down: draining in-flight requests (up to %.0fs)", config.server.shutdown_timeout)
        service.accepting = False
        if watchdog is not None:
            watchdog.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        if uds is not None and not passed:
            with contextlib.suppress(OSError):
                uds.unlink()
        log.info("stopped")

