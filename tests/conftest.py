"""Fixtures shared by every test package."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from daemon.backend import Backend
from daemon.core.plugins import PluginRegistry
from daemon.errors import PluginError

REPO_ROOT = Path(__file__).resolve().parent.parent
BACKENDS_DIR = REPO_ROOT / "backends"


@pytest.fixture
def plugin_registry() -> PluginRegistry:
    """The repository's real backends/ directory, scanned."""
    registry = PluginRegistry([BACKENDS_DIR])
    registry.scan()
    return registry


@pytest.fixture
def backend_class(plugin_registry: PluginRegistry) -> Callable[[str], type[Backend]]:
    """`backend_class("onnxruntime")` imports a real plugin from backends/ the way the daemon
    does, and skips the test when that plugin's runtime is not installed here."""

    def resolve(name: str) -> type[Backend]:
        try:
            return plugin_registry.resolve(name)
        except PluginError as exc:
            if "is not installed" in exc.message or "cannot run here" in exc.message:
                pytest.skip(exc.message)
            raise

    return resolve


# --------------------------------------------------------------------------- a real daemon


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket: what `curl --unix-socket` does, from Python."""

    def __init__(self, path: Path, timeout: float = 60.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class DaemonProcess:
    """`edged serve` running as a real child process, reached over its real Unix socket."""

    proc: subprocess.Popen[bytes]
    socket: Path
    state_dir: Path
    log_path: Path
    http_port: int | None = None

    def request(
        self, method: str, path: str, body: bytes | str | None = None,
        headers: dict[str, str] | None = None, timeout: float = 60.0,
    ) -> Reply:
        conn = UnixHTTPConnection(self.socket, timeout=timeout)
        try:
            payload = body.encode() if isinstance(body, str) else body
            conn.request(method, path, body=payload, headers=headers or {})
            resp = conn.getresponse()
            return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def post_json(self, path: str, payload: object) -> Reply:
        return self.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def start_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., DaemonProcess]]:
    """Factory: start `python -m daemon serve` with the given flags; stopped at teardown."""
    started: list[DaemonProcess] = []

    def start(
        *flags: str, http: bool = False, env: dict[str, str] | None = None,
        wait: bool = True, timeout: float = 120.0,
    ) -> DaemonProcess:
        base = tmp_path_factory.mktemp("edged")
        sock = base / "edged.sock"
        state = base / "state"
        log_path = base / "daemon.log"
        args = [sys.executable, "-m", "daemon", "serve", "--socket", str(sock), "--state-dir", str(state), *flags]
        port = None
        if http:
            port = free_port()
            args += ["--http", f"127.0.0.1:{port}"]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(args, cwd=REPO_ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT)
        daemon = DaemonProcess(proc, sock, state, log_path, port)
        started.append(daemon)
        if wait:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"daemon exited with {proc.returncode}:\n{daemon.log()}")
                if sock.exists():
                    try:
                        if daemon.request("GET", "/v2/health/ready", timeout=5).status == 200:
                            break
                    except OSError:
                        pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"daemon not ready after {timeout}s:\n{daemon.log()}")
                time.sleep(0.1)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
