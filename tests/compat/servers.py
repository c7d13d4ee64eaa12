"""Start real tritonserver (from the nvidia-pytriton wheel) and edged side by side.

The oracle is a venv holding `nvidia-pytriton==0.7.0` and `numpy<2` (`make compat` builds it);
`EDGED_ORACLE` names it. Triton's python stub embeds the system libpython and finds its
packages through the venv's `bin/` on PATH, the way pytriton itself starts it.
"""

from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from support import free_port

ORACLE_ENV = "EDGED_ORACLE"


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    # Sent with every request: edged's admin routes over TCP need its bearer token (Triton has
    # no such rule, so the oracle compares the answers behind it).
    auth: dict[str, str] = field(default_factory=dict)
    # Where GET /metrics answers: Triton serves it on its own port, edged on the API port.
    metrics_port: int = 0

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None, timeout: float = 60.0, chunked: bool = False) -> Reply:
        """`chunked`: the body goes out with `Transfer-Encoding: chunked`, in two chunks."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload: bytes | list[bytes] | None = body
            if chunked and body is not None:
                # An iterable body of unknown length: http.client frames it as chunks.
                payload = [body[: len(body) // 2], body[len(body) // 2 :]]
            conn.request(method, path, body=payload, headers={**(headers or {}), **self.auth})
            resp = conn.getresponse()
            return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def oracle_problem() -> str | None:
    """Why the oracle cannot run here, or None when it can."""
    venv = os.environ.get(ORACLE_ENV)
    if not venv:
        return (f"{ORACLE_ENV} is not set: run `make compat` (it builds a venv with "
                "nvidia-pytriton==0.7.0 and points EDGED_ORACLE at it)")
    if _triton_root(Path(venv)) is None:
        return f"{ORACLE_ENV}={venv} has no nvidia-pytriton tritonserver (pip install nvidia-pytriton==0.7.0)"
    return None


def _site_packages(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    return found[0] if found else None


def _triton_root(venv: Path) -> Path | None:
    site = _site_packages(venv)
    if site is None:
        return None
    root = site / "pytriton" / "tritonserver"
    return root if (root / "bin" / "tritonserver").exists() else None


def _wait_ready(server: Server, timeout: float, path: str = "/v2/health/ready") -> None:
    """Until `path` answers 200 (`/v2/models/<m>/ready` for a server that is not ready as a
    whole: a model of its repository failed to load)."""
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise AssertionError(f"{server.name} exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if server.request("GET", path, timeout=5).status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"{server.name} not ready after {timeout}s:\n{server.log()[-4000:]}")
        time.sleep(0.2)


def start_triton(
    venv: Path, repo: Path, workdir: Path, models: list[str], flags: Sequence[str] = (),
    ready: str = "/v2/health/ready",
) -> Server:
    root = _triton_root(venv)
    site = _site_packages(venv)
    assert root is not None and site is not None
    python_backend = root / "backends" / "python"
    stub = python_backend / "triton_python_backend_stub"
    if not stub.exists():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        venv_version = site.parent.name.removeprefix("python")
        source = root / "python_backend_stubs" / (venv_version or version) / stub.name
        shutil.copy2(source, stub)  # copy2 keeps the run bit
    port, metrics_port = free_port(), free_port()
    log_path = workdir / "tritonserver.log"
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(site / "nvidia_pytriton.libs"),
        "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    env.pop("PYTHONPATH", None)
    args = [
        str(root / "bin" / "tritonserver"), "--model-repository", str(repo),
        "--backend-directory", str(root / "backends"), "--http-port", str(port),
        "--allow-grpc", "false", "--allow-metrics", "true", "--allow-gpu-metrics", "false",
        "--metrics-port", str(metrics_port),
        "--model-control-mode", "explicit", *[f"--load-model={m}" for m in models], *flags,
    ]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    server = Server("tritonserver", port, proc, log_path, metrics_port=metrics_port)
    _wait_ready(server, 180, ready)
    return server


def start_edged(
    repo: Path, workdir: Path, models: list[str], flags: Sequence[str] = (), ready: str = "/v2/health/ready",
) -> Server:
    from support import start_daemon_process

    token = workdir / "token"
    token.write_text(EDGED_TOKEN)
    token.chmod(0o600)
    config = workdir / "edged.toml"
    # Shared memory as Triton offers it (to TCP callers; these carry the token).
    config.write_text(f'[server]\ntoken-file = "{token}"\nshared-memory = "token"\n')
    args = ["--config", str(config), "--model-repository", str(repo), "--model-control-mode", "explicit", *flags]
    for model in models:
        args += ["--load-model", model]
    daemon = start_daemon_process(workdir, *args, http=True, wait=ready == "/v2/health/ready")
    assert daemon.http_port is not None
    server = Server("edged", daemon.http_port, daemon.proc, daemon.log_path,
                    {"Authorization": f"Bearer {EDGED_TOKEN}"}, metrics_port=daemon.http_port)
    if ready != "/v2/health/ready":
        _wait_ready(server, 120, ready)
    return server


EDGED_TOKEN = "compat-oracle-token-0123456789"
