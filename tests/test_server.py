"""Daemon lifecycle over a real Unix socket: graceful SIGTERM, SIGHUP rescan, control modes,
zero-failure reloads, hot-loaded and broken plugins."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from support import REPO_BACKENDS, REPO_ROOT, python_model, wait_until


def _x(values: list[float]) -> dict[str, object]:
    return {"inputs": [{"name": "X", "shape": [len(values)], "datatype": "FP32", "data": values}]}


def test_sigterm_drains_in_flight_requests(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    marker = tmp_path / "executing"
    python_model(repo, "slow", f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(1.5)\ny = x * 2")
    daemon = start_daemon("--model-repository", str(repo))
    result: dict[str, object] = {}

    def call() -> None:
        reply = daemon.post_json("/v2/models/slow/infer", _x([1, 2]))
        result["status"], result["body"] = reply.status, reply.json()

    worker = threading.Thread(target=call)
    worker.start()
    wait_until(marker.exists)  # the request is inside execute now
    daemon.proc.send_signal(signal.SIGTERM)
    worker.join(30)
    assert result["status"] == 200, result
    assert result["body"]["outputs"][0]["data"] == [2.0, 4.0]
    assert daemon.proc.wait(30) == 0
    assert not daemon.socket.exists()
    assert "stopped" in daemon.log()


def test_socket_mode_is_0660(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x")
    daemon = start_daemon("--model-repository", str(repo))
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660


def test_sighup_rescans_repository(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "first", "y = x")
    daemon = start_daemon("--model-repository", str(repo))
    python_model(repo, "second", "y = x + 1")
    assert daemon.request("GET", "/v2/models/second/ready").status == 400  # Triton: "Model version not ready"
    daemon.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: daemon.request("GET", "/v2/models/second/ready").status == 200)
    reply = daemon.post_json("/v2/models/second/infer", _x([1, 2]))
    assert reply.json()["outputs"][0]["data"] == [2.0, 3.0]


def test_explicit_mode_load_unload(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "a", "y = x * 3")
    python_model(repo, "b", "y = x * 4")
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit",
                          "--load-model", "a")
    index = {r["name"]: r for r in daemon.post_json("/v2/repository/index", {}).json()}
    assert index["a"]["state"] == "READY" and index["b"] == {"name": "b"}  # never loaded: name only, as Triton
    assert daemon.post_json("/v2/models/b/infer", _x([1])).status in (404, 503)
    assert daemon.request("POST", "/v2/repository/models/b/load").status == 200
    assert daemon.post_json("/v2/models/b/infer", _x([1])).json()["outputs"][0]["data"] == [4.0]
    assert daemon.request("POST", "/v2/repository/models/a/unload").status == 200
    assert daemon.request("GET", "/v2/models/a/ready").status == 400
    assert daemon.request("POST", "/v2/repository/models/zzz/load").status == 404
    # A load with a config override (Triton's parameters.config).
    override = {"backend": "python", "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [-1]}],
                "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}]}
    reply = daemon.post_json("/v2/repository/models/a/load", {"parameters": {"config": json.dumps(override)}})
    assert reply.status == 200, reply.body
    assert daemon.post_json("/v2/models/a/infer", _x([1, 2, 3])).json()["outputs"][0]["shape"] == [3]


def test_load_refused_when_not_explicit(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "a", "y = x")
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "poll",
                          "--repository-poll-secs", "60")
    reply = daemon.request("POST", "/v2/repository/models/a/load")
    assert reply.status == 400
    assert "explicit model load / unload is not allowed if polling is enabled" in reply.json()["error"]


def test_poll_reload_swaps_without_failed_requests(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x + 1")
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "poll",
                          "--repository-poll-secs", "0.3")
    statuses: list[int] = []
    seen: set[float] = set()
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            reply = daemon.post_json("/v2/models/m/infer", _x([1]))
            statuses.append(reply.status)
            if reply.status == 200:
                seen.add(reply.json()["outputs"][0]["data"][0])

    workers = [threading.Thread(target=hammer) for _ in range(3)]
    for w in workers:
        w.start()
    wait_until(lambda: 2.0 in seen, timeout=30)  # the old version answers first
    python_model(repo, "m", "import time\ntime.sleep(0.2)\ny = x + 100")  # rewrite in place
    wait_until(lambda: 101.0 in seen, timeout=30)
    time.sleep(0.5)
    stop.set()
    for w in workers:
        w.join(30)
    assert seen == {2.0, 101.0}
    assert statuses and set(statuses) == {200}, f"{len(statuses) - statuses.count(200)} failed requests"


def test_failed_reload_keeps_old_model(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x + 1")
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "poll",
                          "--repository-poll-secs", "0.3")
    (repo / "m" / "1" / "model.py").write_text("this is not python(\n")
    wait_until(lambda: "not python" in json.dumps(daemon.post_json("/v2/repository/index", {}).json())
               or "SyntaxError" in daemon.log(), timeout=30)
    reply = daemon.post_json("/v2/models/m/infer", _x([1]))
    assert reply.status == 200 and reply.json()["outputs"][0]["data"] == [2.0]


def _plugin(root: Path, name: str, factor: float, broken: bool = False) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    (folder / "manifest.toml").write_text(
        f'name = "{name}"\nversion = "1.0"\napi-version = 1\nentrypoint = "impl:Scale"\n'
        'artifacts = ["scale.txt"]\nrequires = ["numpy"]\n'
    )
    (folder / "impl.py").write_text(
        ("raise ImportError('this plugin is broken on purpose')\n" if broken else "")
        + "from daemon.backend import TensorBackend\n"
        "class Scale(TensorBackend):\n"
        f"    name = {name!r}\n"
        "    def load_sync(self, config, artifact, device):\n"
        f"        self.k = float(artifact.read_text()) * {factor}\n"
        "    def infer(self, inputs):\n"
        "        return {'Y': inputs['X'] * self.k}\n"
    )


def test_plugin_hot_load_and_broken_plugin_report(start_daemon, tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    plugins.chmod(0o755)
    shutil.copytree(REPO_BACKENDS / "python", plugins / "python")
    _plugin(plugins, "broken", 1.0, broken=True)
    repo = tmp_path / "repo"
    (repo / "scaled" / "1").mkdir(parents=True)
    (repo / "scaled" / "1" / "scale.txt").write_text("2.5")
    (repo / "scaled" / "config.pbtxt").write_text(
        'backend: "scale"\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
    )
    python_model(repo, "ok", "y = x")
    config = tmp_path / "edged.toml"
    config.write_text("[backends]\npoll-secs = 0.3\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo),
                          "--model-control-mode", "explicit", "--load-model", "ok",
                          "--backend-directory", str(plugins))
    backends = {b["name"]: b for b in daemon.request("GET", "/v2/backends").json()["backends"]}
    assert backends["broken"]["state"] == "broken"
    assert "broken on purpose" in backends["broken"]["reason"]
    assert backends["python"]["state"] == "ready"
    first = daemon.request("POST", "/v2/repository/models/scaled/load")
    assert first.status >= 400 and "scale" in first.json()["error"]
    _plugin(plugins, "scale", 2.0)  # dropped in while running
    wait_until(lambda: daemon.request("POST", "/v2/repository/models/scaled/load").status == 200)
    reply = daemon.post_json("/v2/models/scaled/infer", _x([1, 2]))
    np.testing.assert_allclose(reply.json()["outputs"][0]["data"], [5.0, 10.0])
    assert daemon.post_json("/v2/models/ok/infer", _x([7])).json()["outputs"][0]["data"] == [7.0]


def _scaled_by_plugin(start_daemon, tmp_path: Path):
    """A daemon watching a plugins directory (polled every 0.3 s) whose plugin "scale" (x2)
    serves the model "scaled"; the daemon and the directory."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    plugins.chmod(0o755)
    _plugin(plugins, "scale", 2.0)
    repo = tmp_path / "repo"
    (repo / "scaled" / "1").mkdir(parents=True)
    (repo / "scaled" / "1" / "scale.txt").write_text("1")
    (repo / "scaled" / "config.pbtxt").write_text(
        'backend: "scale"\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
    )
    config = tmp_path / "edged.toml"
    config.write_text("[backends]\npoll-secs = 0.3\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo),
                          "--backend-directory", str(plugins))
    assert daemon.post_json("/v2/models/scaled/infer", _x([1])).json()["outputs"][0]["data"] == [2.0]
    return daemon, plugins


def test_plugin_change_reloads_its_models(start_daemon, tmp_path: Path) -> None:
    daemon, plugins = _scaled_by_plugin(start_daemon, tmp_path)
    shutil.rmtree(plugins / "scale")
    _plugin(plugins, "scale", 3.0)
    wait_until(lambda: daemon.post_json("/v2/models/scaled/infer", _x([1])).json()["outputs"][0]["data"] == [3.0])


def test_plugin_removed_then_put_back_reloads_its_models(start_daemon, tmp_path: Path) -> None:
    # A scan between the removal and the new copy (rm -rf, then copy) sees the plugin gone, the
    # next one sees it added: the models still running the old copy must reload all the same.
    daemon, plugins = _scaled_by_plugin(start_daemon, tmp_path)
    shutil.rmtree(plugins / "scale")
    wait_until(lambda: "scale" not in {b["name"] for b in daemon.request("GET", "/v2/backends").json()["backends"]})
    assert daemon.post_json("/v2/models/scaled/infer", _x([1])).json()["outputs"][0]["data"] == [2.0]
    _plugin(plugins, "scale", 3.0)
    wait_until(lambda: daemon.post_json("/v2/models/scaled/infer", _x([1])).json()["outputs"][0]["data"] == [3.0])


def test_world_writable_plugin_is_refused(start_daemon, tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    _plugin(plugins, "scale", 1.0)
    (plugins / "scale").chmod(0o777)
    repo = tmp_path / "repo"
    repo.mkdir()
    daemon = start_daemon("--model-repository", str(repo), "--backend-directory", str(plugins))
    backends = {b["name"]: b for b in daemon.request("GET", "/v2/backends").json()["backends"]}
    assert backends["scale"]["state"] == "broken"
    assert "writable" in backends["scale"]["reason"]


@pytest.mark.parametrize("bad", ['[server]\nsockett = "x"\n', "[models]\ncontrol-mode = 'sometimes'\n"])
def test_bad_config_names_the_key(tmp_path: Path, bad: str) -> None:
    import subprocess
    import sys

    config = tmp_path / "edged.toml"
    config.write_text(bad)
    out = subprocess.run([sys.executable, "-m", "daemon", "serve", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert str(config) in out.stderr
    assert ("sockett" in out.stderr) or ("control-mode" in out.stderr)


# --------------------------------------------------------------------------- hardening


def test_a_second_instance_refuses_the_live_socket(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x")
    first = start_daemon("--model-repository", str(repo))
    second = subprocess.run(
        [sys.executable, "-m", "daemon", "serve", "--socket", str(first.socket), "--state-dir",
         str(tmp_path / "state2"), "--model-repository", str(repo)],
        capture_output=True, text=True, timeout=60,
    )
    assert second.returncode == 2
    assert f"another daemon is already listening on {first.socket}" in second.stderr
    assert first.post_json("/v2/models/m/infer", _x([1])).status == 200
    assert not (tmp_path / "state2").exists()  # it touched nothing


def test_a_port_in_use_is_one_line_and_a_clean_stop(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    sock = tmp_path / "run" / "edged.sock"
    try:
        result = subprocess.run(
            [sys.executable, "-m", "daemon", "serve", "--socket", str(sock), "--http", address,
             "--workers", "1", "--state-dir", str(tmp_path / "state"), "--model-repository", str(repo)],
            capture_output=True, text=True, timeout=60,
        )
    finally:
        taken.close()
    assert result.returncode == 2
    assert f"edged: error: server.http {address}: cannot listen: " in result.stderr
    assert "address already in use" in result.stderr and "Traceback" not in result.stderr
    assert not sock.exists()  # the Unix socket bound before it is gone again
    long = tmp_path / ("d" * (108 - len(str(tmp_path)))) / "edged.sock"
    result = subprocess.run(
        [sys.executable, "-m", "daemon", "serve", "--socket", str(long), "--state-dir", str(tmp_path / "state"),
         "--model-repository", str(repo)], capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert f"server.socket {long}: the path is longer than a Unix socket's 107 bytes" in result.stderr
    assert "model m: ready" not in result.stderr  # refused before any model loads


def test_sighup_during_the_shutdown_drain_is_ignored(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    marker = tmp_path / "executing"
    gate = tmp_path / "finish"
    # The request is held in execute until the test opens the gate (60 s at most), so the
    # SIGHUP surely lands mid-drain however slow the machine is.
    python_model(repo, "slow", (
        f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\n"
        "deadline = time.monotonic() + 60\n"
        f"while not pathlib.Path({str(gate)!r}).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "y = x * 2"
    ))
    daemon = start_daemon("--model-repository", str(repo))
    result: dict[str, object] = {}

    def call() -> None:
        result["status"] = daemon.post_json("/v2/models/slow/infer", _x([1])).status

    worker = threading.Thread(target=call)
    worker.start()
    wait_until(marker.exists)
    daemon.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "shutting down" in daemon.log())
    daemon.proc.send_signal(signal.SIGHUP)
    try:
        wait_until(lambda: "SIGHUP ignored: shutting down" in daemon.log())
    finally:
        gate.touch()
    worker.join(30)
    assert result["status"] == 200
    assert daemon.proc.wait(30) == 0
    assert "SIGHUP ignored: shutting down" in daemon.log()


def test_wrong_method_is_405_unknown_path_404(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x")
    daemon = start_daemon("--model-repository", str(repo))
    reply = daemon.request("GET", "/v2/models/m/infer")
    assert reply.status == 405 and reply.json() == {"error": "Method Not Allowed"}
    assert daemon.request("DELETE", "/v2/health/live").status == 405
    reply = daemon.request("GET", "/v2/nothing/here")
    assert reply.status == 404 and reply.json() == {"error": "Not Found"}


def test_socket_directory_planted_under_tmp_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    planted = shared / "edged-dir"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    result = subprocess.run(
        [sys.executable, "-m", "daemon", "serve", "--socket", str(planted / "edged.sock"),
         "--state-dir", str(tmp_path / "state"), "--model-repository", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert f"socket directory {planted} is writable by group or others" in result.stderr


def test_connection_cap_and_header_deadline(start_daemon, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "m", "y = x")
    config = tmp_path / "edged.toml"
    config.write_text("[server]\nmax-connections = 2\nheader-timeout = 5.0\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo))
    held = []
    for first in (b"", b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(daemon.socket))
        # Headers never finished: on a new connection, and on one after a finished request.
        s.sendall(first + b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n")
        held.append(s)
    try:
        # The daemon accepts the two held connections in its own time: ask until it has.
        answer = b""
        for _ in range(20):
            third = socket.socket(socket.AF_UNIX)
            third.settimeout(0.5)
            third.connect(str(daemon.socket))
            try:
                answer = third.recv(4096)
            except TimeoutError:
                answer = b""
            finally:
                third.close()
            if answer:
                break
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable"), answer
        assert b"server.max-connections" in answer
        # The silent ones are closed at their header deadline; then new clients get in.
        answers = []
        for s in held:
            s.settimeout(30)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            answers.append(data)
        assert answers[0] == b""
        assert answers[1].startswith(b"HTTP/1.1 200 OK") and answers[1].count(b"HTTP/1.1") == 1
        assert daemon.request("GET", "/v2/health/ready").status == 200
        assert "no request headers within server.header-timeout" in daemon.log()
    finally:
        for s in held:
            s.close()


def test_ready_before_the_http_layer_loads_and_requests_wait_for_it(tmp_path: Path) -> None:
    """The daemon is ready (health answers) before aiohttp is imported; a request for a route
    aiohttp serves, sent meanwhile, waits and is answered once it has loaded."""
    repository = tmp_path / "repo"
    repository.mkdir()
    script = Path(__file__).resolve().parent / "fixtures" / "gated_http.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "s.sock"), str(repository), str(tmp_path / "state")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stdout + done.stderr
    assert json.loads(line.removeprefix("RESULT ")) == {
        "aiohttp_at_ready": False,
        "before_gate": None,
        "live_while_gated": "HTTP/1.1 200 OK",
        "after_gate_status": "HTTP/1.1 200 OK",
        "after_gate_name": "edged",
    }
    assert done.returncode == 0, done.stderr
