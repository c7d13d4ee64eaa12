"""Who may call what: admin routes over TCP need the bearer token; the Unix socket's peer uid."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.api.access import is_admin
from support import python_model

TOKEN = "s3cret-token-for-tests-0123"


def tcp(daemon, method: str, path: str, body: object | None = None, token: str | None = None,
        api_key: str | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", daemon.http_port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if api_key is not None:
        headers["X-Api-Key"] = api_key
    try:
        conn.request(method, path, None if body is None else json.dumps(body), headers)
        reply = conn.getresponse()
        return reply.status, reply.read(), dict(reply.getheaders())
    finally:
        conn.close()


def _config(tmp_path: Path, extra: str = "") -> Path:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    config = tmp_path / "edged.toml"
    config.write_text(f'[server]\ntoken-file = "{token}"\n{extra}')
    return config


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    python_model(tmp_path / "repo", "m", "y = x + 1")
    return tmp_path / "repo"


def _infer() -> dict[str, object]:
    return {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]}


def test_admin_routes_over_tcp_are_refused_without_a_token_file(start_daemon, repo: Path) -> None:
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit",
                          "--load-model", "*", http=True)
    status, body, _ = tcp(daemon, "POST", "/v2/repository/models/m/unload")
    assert status == 403
    assert "admin route: over TCP it needs server.token-file" in json.loads(body)["error"]
    # Inference and reads stay open over TCP; the Unix socket may do everything.
    assert tcp(daemon, "POST", "/v2/models/m/infer", _infer())[0] == 200
    assert tcp(daemon, "POST", "/v2/repository/index", {})[0] == 200
    assert daemon.request("POST", "/v2/repository/models/m/unload").status == 200


def test_token_gates_admin_over_tcp(start_daemon, repo: Path, tmp_path: Path) -> None:
    daemon = start_daemon("--config", str(_config(tmp_path)), "--model-repository", str(repo),
                          "--model-control-mode", "explicit", "--load-model", "*", http=True)
    status, _, headers = tcp(daemon, "POST", "/v2/repository/models/m/unload", token="wrong")
    assert status == 401 and headers.get("WWW-Authenticate") == 'Bearer realm="edged"'
    assert tcp(daemon, "POST", "/v1/updates", token=None)[0] == 401
    assert tcp(daemon, "POST", "/v2/models/m/infer", _infer())[0] == 200
    assert tcp(daemon, "POST", "/v2/repository/models/m/unload", token=TOKEN)[0] == 200
    assert TOKEN not in daemon.log()


def test_tcp_auth_all_gates_inference_but_not_health(start_daemon, repo: Path, tmp_path: Path) -> None:
    config = _config(tmp_path, 'tcp-auth = "all"\n')
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo), http=True)
    assert tcp(daemon, "POST", "/v2/models/m/infer", _infer())[0] == 401
    assert tcp(daemon, "POST", "/v2/models/m/infer", _infer(), token=TOKEN)[0] == 200
    assert tcp(daemon, "GET", "/v2/health/ready")[0] == 200
    # llama-server's health check is public there too (no API key).
    assert tcp(daemon, "GET", "/health")[0] == 200 and tcp(daemon, "GET", "/v1/health")[0] == 200
    assert tcp(daemon, "GET", "/v2/models/m")[0] == 401
    # Anthropic's clients send the key as X-Api-Key (llama-server takes it there too); an
    # Authorization header, when sent, is what counts.
    assert tcp(daemon, "POST", "/v2/models/m/infer", _infer(), api_key=TOKEN)[0] == 200
    assert tcp(daemon, "POST", "/v2/models/m/infer", _infer(), api_key="wrong")[0] == 401
    assert tcp(daemon, "POST", "/v2/models/m/infer", _infer(), token="wrong", api_key=TOKEN)[0] == 401
    # Anthropic's routes answer in Anthropic's error shape.
    status, body, _ = tcp(daemon, "POST", "/v1/messages", {})
    assert status == 401 and json.loads(body) == {
        "type": "error", "error": {"type": "authentication_error", "message": "missing or wrong bearer token"}}


def test_a_token_file_others_can_read_is_refused_at_start(repo: Path, tmp_path: Path) -> None:
    config = _config(tmp_path)
    (tmp_path / "token").chmod(0o644)
    result = subprocess.run(
        [sys.executable, "-m", "daemon", "serve", "--config", str(config), "--socket", str(tmp_path / "s"),
         "--state-dir", str(tmp_path / "state"), "--model-repository", str(repo)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "is readable by group or others; chmod 600 it" in result.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_unix_socket_peer_uid_not_allowed_is_403(start_daemon, repo: Path, tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"
    config.write_text('[server]\nsocket-mode = "0666"\nallowed-uids = [4242]\n')
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo))

    def as_uid(uid: int) -> str:
        code = (
            "import os, socket, sys\n"
            f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "s.sendall(b'GET /v2/models/m HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n')\n"
            "print(s.recv(65536).split(b'\\r\\n')[0].decode())\n"
        )
        out = subprocess.run([sys.executable, "-c", code, str(daemon.socket)], capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip() or out.stderr

    # Let other uids reach the socket through pytest's private temp dirs (restored after).
    opened: list[tuple[Path, int]] = []
    for parent in reversed(daemon.socket.parents):
        mode = parent.stat().st_mode
        if not mode & 0o001:
            opened.append((parent, mode))
            parent.chmod(mode | 0o001)
    try:
        assert as_uid(65534) == "HTTP/1.1 403 Forbidden"
        assert as_uid(4242) == "HTTP/1.1 200 OK"
    finally:
        for parent, mode in opened:
            parent.chmod(mode)
    assert daemon.request("GET", "/v2/models/m").status == 200  # root is always allowed


@pytest.mark.parametrize(
    ("method", "path", "admin"),
    [
        ("POST", "/v2/repository/models/m/load", True),
        ("POST", "/v2/repository/models/m/unload", True),
        ("POST", "/v2/repository/index", False),
        ("POST", "/v1/updates", True),
        ("POST", "/v1/updates/rollback", True),
        ("GET", "/v1/updates", False),
        ("POST", "/v2/logging", True),
        ("GET", "/v2/logging", False),
        ("POST", "/v2/systemsharedmemory/region/r/register", False),  # server.shared-memory decides
        ("GET", "/v2/systemsharedmemory/status", False),
        ("POST", "/v2/models/m/infer", False),
        ("DELETE", "/api/delete", False),  # edged deletes nothing: 501 for everyone
        ("POST", "/api/pull", False),  # offline: it only checks the repository
        ("POST", "/api/chat", False),
        ("POST", "/slots/0", True),  # llama-server's save, restore, erase
        ("GET", "/slots", False),
        ("POST", "/lora-adapters", True),  # llama-server's change of every later request's scales
        ("GET", "/lora-adapters", False),
    ],
)
def test_admin_route_classification(method: str, path: str, admin: bool) -> None:
    assert is_admin(method, path) is admin


def test_socket_free_port_unused() -> None:
    # Sanity for the helpers above: TCP tests bind only to loopback.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[0] == "127.0.0.1"
