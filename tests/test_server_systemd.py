"""The daemon under systemd's protocols, with real sockets: sd_notify (READY, RELOADING,
WATCHDOG, STOPPING) to a datagram listener, and a listening socket passed as LISTEN_FDS."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from support import REPO_ROOT, DaemonProcess, python_model


class NotifyListener:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []

    def wait_for(self, needle: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self.messages:
                if needle in message:
                    self.messages.remove(message)
                    return message
            with contextlib.suppress(TimeoutError):
                self.messages.append(self.sock.recv(4096).decode())
        raise AssertionError(f"no {needle!r} within {timeout}s; got {self.messages}")


def _x() -> bytes:
    return json.dumps({"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}).encode()


def test_sd_notify_lifecycle(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x * 2")
    listener = NotifyListener(tmp_path / "notify.sock")
    daemon = start_daemon("--model-repository", str(repo), env={
        "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "400000",
    })
    ready = listener.wait_for("READY=1")
    assert "STATUS=1/1 models ready" in ready
    listener.wait_for("WATCHDOG=1")  # pinged at half of WATCHDOG_USEC from the event loop
    python_model(repo, "n", "y = x")
    daemon.proc.send_signal(signal.SIGHUP)
    reloading = listener.wait_for("RELOADING=1")
    usec = int(reloading.split("MONOTONIC_USEC=")[1].split("\n")[0])
    assert abs(usec - time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000) < 60_000_000
    assert "STATUS=2/2 models ready" in listener.wait_for("READY=1")
    daemon.proc.send_signal(signal.SIGTERM)
    listener.wait_for("STOPPING=1")
    assert daemon.proc.wait(30) == 0


def test_socket_passed_by_systemd(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x * 2")
    path = tmp_path / "activated.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(path))
    listening.listen(16)
    # What systemd does: the socket on fd 3, LISTEN_PID = the service's own pid (kept by exec).
    launcher = (
        "import os, sys\n"
        "fd = int(sys.argv[1])\n"
        "os.dup2(fd, 3)\n"
        "os.environ.update(LISTEN_FDS='1', LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES='api')\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'daemon', *sys.argv[2:]])\n"
    )
    log = tmp_path / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", launcher, str(listening.fileno()), "serve",
             "--model-repository", str(repo), "--state-dir", str(tmp_path / "state"),
             "--socket", str(tmp_path / "unused.sock")],
            pass_fds=(listening.fileno(),), cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    listening.close()  # the daemon owns it now
    daemon = DaemonProcess(proc, path, tmp_path / "state", log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if daemon.request("GET", "/v2/health/ready", timeout=5).status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, daemon.log()
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.1)
        reply = daemon.request("POST", "/v2/models/m/infer", _x(), {"Content-Type": "application/json"})
        assert reply.json()["outputs"][0]["data"] == [2.0, 4.0]
        assert not (tmp_path / "unused.sock").exists()  # passed sockets replace our own
        assert "listening on systemd socket api" in daemon.log()
    finally:
        assert daemon.stop() == 0
