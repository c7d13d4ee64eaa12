"""Running the daemon: listeners (Unix socket, TCP, sockets passed by systemd), signals, sd_notify.

Shutdown order (SIGTERM/SIGINT): STOPPING=1 -> stop accepting connections -> in-flight requests
drain for `shutdown_timeout` (the front's, then aiohttp's) -> remaining handlers cancelled -> models
unloaded.
SIGHUP: RELOADING=1 -> rescan plugins and repository -> READY=1.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from daemon import eventloop
from daemon.api.front import RELAY_KEEPALIVE_S, Front
from daemon.api.workers import WorkerPool
from daemon.config import DaemonConfig, parse_host_port, read_token, socket_path
from daemon.core.host_policy import HostPolicies, format_cpus
from daemon.errors import EdgedError
from daemon.ops.systemd import Notifier, listen_fds, watchdog_interval, watchdog_loop
from daemon.service import Service

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)


def _check_socket_dir(directory: Path) -> None:
    """Create the socket's directory, and refuse one that others could have planted.

    Under a world-writable parent (/tmp) anyone could pre-create `/tmp/edged-<uid>` and swap
    our socket for theirs: the directory must be ours and writable by nobody else.
    """
    parent_mode = directory.parent.stat().st_mode if directory.parent.exists() else 0
    shared_parent = bool(parent_mode & stat.S_IWOTH)
    directory.mkdir(mode=0o700 if shared_parent else 0o755, parents=True, exist_ok=True)
    if not shared_parent:
        return
    st = directory.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise EdgedError(f"socket directory {directory} is not a plain directory; refusing to use it")
    if st.st_uid != os.getuid():
        raise EdgedError(
            f"socket directory {directory} is owned by uid {st.st_uid}, not {os.getuid()}; refusing to use it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise EdgedError(f"socket directory {directory} is writable by group or others; refusing to use it")


def _claim_socket_path(path: Path) -> None:
    """Unlink a stale socket left by a crashed run; refuse to take over a live one."""
    if not path.is_socket():
        if path.exists():
            raise EdgedError(f"{path} exists and is not a socket; refusing to replace it")
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # nobody listens: a leftover
        return
    except OSError:
        pass  # e.g. a timeout: someone holds it but does not answer; do not steal it either
    finally:
        probe.close()
    raise EdgedError(f"another daemon is already listening on {path}; stop it or choose another --socket")


async def _listen_unix(factory: Callable[[], asyncio.BaseProtocol], path: Path, mode: int) -> asyncio.Server:
    # The umask makes bind() create the socket with the right mode: no chmod race window.
    old = os.umask(0o777 & ~mode)
    try:
        return await asyncio.get_running_loop().create_unix_server(factory, str(path))
    finally:
        os.umask(old)


async def serve(config: DaemonConfig, *, stop: asyncio.Event | None = None) -> None:
    notifier = Notifier()
    loop = asyncio.get_running_loop()
    log.info("event loop: %s", eventloop.describe(loop))
    passed = listen_fds()
    uds = socket_path(config) if not passed else None
    if uds is not None:
        # Before anything else (the release store's recovery included): a second instance
        # must not touch a running one's state.
        if len(os.fsencode(uds)) > 107:  # sun_path holds 108 bytes with the final NUL
            raise EdgedError(f"server.socket {uds}: the path is longer than a Unix socket's 107 bytes")
        _check_socket_dir(uds.parent)
        _claim_socket_path(uds)
    token = read_token(config.server.token_file)  # a bad token file stops the daemon here
    # Before the models load (minutes for a large one), so that a typo fails at once.
    tcp = parse_host_port(config.server.http) if config.server.http else None
    # Read before the loop is placed: threads without a policy go back to these CPUs.
    host_policies = HostPolicies.from_config(config)
    if config.server.host_policy:
        loop.set_default_executor(host_policies.place_loop(config.server.host_policy))
        log.info("event loop on CPUs %s (host policy %r)",
                 format_cpus(host_policies.cpus[config.server.host_policy]), config.server.host_policy)
    service = Service.build(config, host_policies)
    notifier.status("loading models")
    await service.start()
    # Every connection goes through the front; what it does not serve itself it relays to
    # aiohttp, which is attached once loaded (see _start_http).
    front = Front(config.server, service)
    if config.server.workers:
        front.pool = WorkerPool(config.server.workers, front, config)
        await front.pool.start()
    factory = front.factory
    servers: list[asyncio.Server] = []
    where = "a systemd socket"
    try:
        for sock, name in passed:
            servers.append(await loop.create_server(factory, sock=sock))
            log.info("listening on systemd socket %s (%s)", name or "unnamed", sock.getsockname())
        if uds is not None:
            where = f"server.socket {uds}"
            servers.append(await _listen_unix(factory, uds, int(config.server.socket_mode, 8)))
            log.info("listening on unix:%s  (try: curl --unix-socket %s http://localhost/v2/models/simple)", uds, uds)
        if tcp is not None:
            where = f"server.http {config.server.http}"
            servers.append(await loop.create_server(factory, *tcp, reuse_address=True))
            log.info("listening on http://%s:%d", *tcp)
    except OSError as exc:
        # A port in use or a host that does not resolve: the models and workers started above
        # are stopped as at shutdown, and the reason is one line, not a traceback.
        for server in servers:
            server.close()
        if front.pool is not None:
            await front.pool.stop(0.0)
        await service.stop()
        if uds is not None and servers:
            uds.unlink(missing_ok=True)
        raise EdgedError(f"{where}: cannot listen: {exc.strerror or exc}") from None

    stop = stop or asyncio.Event()
    reloading = asyncio.Lock()
    stopping = False

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
        if stopping:
            # SIGHUP's default action would kill the process mid-drain: acknowledge, ignore.
            log.info("SIGHUP ignored: shutting down")
            return
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
    http = asyncio.create_task(_start_http(service, front, token))

    def http_done(task: asyncio.Task[web.AppRunner]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.critical("the HTTP layer failed to start: %r", task.exception())
            stop.set()

    http.add_done_callback(http_done)
    try:
        await stop.wait()
    finally:
        stopping = True
        notifier.stopping()
        log.info("shutting down: draining in-flight requests (up to %.0fs)", config.server.shutdown_timeout)
        service.accepting = False
        if watchdog is not None:
            watchdog.cancel()
        for task in list(reload_tasks):
            task.cancel()
        for server in servers:
            server.close()  # stop accepting; connections in flight drain below
        # The front's own requests first, then aiohttp drains what it was relayed; the models
        # go last, once nothing uses them.
        await front.drain(config.server.shutdown_timeout)
        await asyncio.wait([http])  # an import in progress cannot be cut short
        runner = None if http.cancelled() or http.exception() is not None else http.result()
        if runner is not None:
            await runner.cleanup()
        await service.stop()
        front.close_all()
        # Signal handlers stay installed until here: SIGTERM/SIGINT repeat the stop, SIGHUP is
        # ignored, and none of them kills the drain half-way.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        if uds is not None:
            with contextlib.suppress(OSError):
                uds.unlink()
        log.info("stopped")
    if not http.cancelled() and (error := http.exception()) is not None:
        raise error  # the HTTP layer never came up: the daemon fails (after a clean stop)


async def _start_http(service: Service, front: Front, token: str | None) -> web.AppRunner:
    """Import and build the aiohttp side and attach it to the front.

    aiohttp and the route modules are most of the daemon's start time (~0.2 s of imports on a
    2-core box): they load on a worker thread after the daemon is ready, while health requests
    are answered and other requests wait (daemon.api.front)."""
    await asyncio.to_thread(importlib.import_module, "daemon.api.app")
    from aiohttp import web

    from daemon.api.app import create_app
    from daemon.api.kserve import INFER

    app = create_app(service, token)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that goes away cancels its generation
        # Bodies are inflated by daemon.api.body, off the event loop and with a size cap.
        auto_decompress=False,
        # Idle connections are the front's to close (server.keepalive-timeout).
        keepalive_timeout=RELAY_KEEPALIVE_S,
        shutdown_timeout=service.config.server.shutdown_timeout,
        access_log=None,
    )
    await runner.setup()
    assert runner.server is not None
    front.attach(app[INFER], runner.server)
    return runner
