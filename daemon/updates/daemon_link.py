"""How `edged update` reaches a running daemon: HTTP over its Unix socket (stdlib only).

The command changes the release store itself (the same `apply_update` the daemon's HTTP route
runs); the daemon is asked to serve the store's `current` and health-check it, which is the
health check of the command's apply. No daemon answering means an offline apply.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
from pathlib import Path

from daemon.updates.errors import HealthCheckFailed, UpdateError


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self._path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


class DaemonLink:
    def __init__(self, path: Path, timeout: float = 600.0) -> None:
        self.path = Path(path)
        self.timeout = timeout

    def _call(self, method: str, route: str, timeout: float) -> tuple[int, dict[str, object]]:
        conn = _UnixConnection(self.path, timeout)
        try:
            conn.request(method, route)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        try:
            payload = json.loads(body) if body else {}
        except ValueError:
            payload = {"error": body.decode(errors="replace")}
        return resp.status, payload if isinstance(payload, dict) else {}

    def reachable(self) -> bool:
        """Whether a daemon answers at all. Any HTTP answer counts (403 for a uid not allowed,
        503 while stopping): the health check then fails with that answer instead of the
        update silently going offline next to a running daemon."""
        try:
            self._call("GET", "/v2/health/live", 5.0)
        except OSError:
            return False
        return True

    def _reload_sync(self) -> dict[str, object]:
        try:
            status, payload = self._call("POST", "/v1/updates/reload", self.timeout)
        except OSError as exc:
            raise HealthCheckFailed(f"the daemon at {self.path} did not answer: {exc}") from None
        if status == 200:
            return payload
        message = str(payload.get("error", payload))
        if status == 422:
            raise HealthCheckFailed(message)
        raise UpdateError(f"the daemon at {self.path} answered {status}: {message}")

    async def health_check(self, release: Path | None) -> None:
        """Ask the daemon to serve `current` and check it; raises HealthCheckFailed."""
        payload = await asyncio.to_thread(self._reload_sync)
        expected = release.name if release is not None else None
        if payload.get("current") != expected:
            raise HealthCheckFailed(f"the daemon serves {payload.get('current')}, not {expected}")

    async def restore(self, release: Path | None) -> None:
        await self.health_check(release)
