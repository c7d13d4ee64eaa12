"""HTTP worker processes (`server.workers`, daemon.api.workers) in a real daemon: connections
past the first are served by a worker, which answers infer requests through the daemon and hands
the connection back for anything else; the cap on connections, a worker's death and the
shutdown drain hold across the processes."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support import (
    RawResponse,
    child_pids,
    json_outputs,
    raw_request,
    read_response,
    simple_binary_body,
    simple_json_body,
    wait_until,
)

pytest.importorskip("onnxruntime")

SLOW_MODEL = """\
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(1.5)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests
        ]
"""


ECHO_MODEL = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests
        ]
"""


def _echo_repo(tmp_path: Path, name: str, source: str, dims: str) -> Path:
    """A repository with one python model `name` (`source`) of an FP32 `IN` and `OUT` of `dims`."""
    repo = tmp_path / "repo"
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(
        'backend: "python"\n'
        f'input [{{ name: "IN", data_type: TYPE_FP32, dims: {dims} }}]\n'
        f'output [{{ name: "OUT", data_type: TYPE_FP32, dims: {dims} }}]\n'
    )
    return repo


def _slow_repo(tmp_path: Path) -> Path:
    """`slow`: a python model that takes 1.5 s to echo its input."""
    return _echo_repo(tmp_path, "slow", SLOW_MODEL, "[2]")


def _exchange(sock: socket.socket, raw: bytes, count: int) -> list[RawResponse]:
    """Send `raw` at once (pipelined) and read `count` responses. A connection over
    `max-connections` is answered 503 and closed at once, unread: sending to it may find it
    closed already (EPIPE), but its answer is there to read (and with none, reading fails)."""
    with contextlib.suppress(BrokenPipeError):
        sock.sendall(raw)
    buffered = bytearray()
    return [read_response(sock, buffered) for _ in range(count)]


def _connect(daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(str(daemon.socket))
    return sock


@contextlib.contextmanager
def _kept(daemon) -> Iterator[socket.socket]:
    """The daemon's own connection (it serves the first one itself): answered once, so that the
    daemon has taken it before the test connects again."""
    with _connect(daemon) as sock:
        assert _exchange(sock, raw_request("GET", "/v2/health/live"), 1)[0][0] == 200
        yield sock


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's parent may never reap it in a container)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(params=["uvloop", "asyncio"])
def daemon(start_daemon: Callable[..., object], simple_repo: Path, request: pytest.FixtureRequest) -> object:
    """A daemon with one worker, on each event loop (server.event-loop): passing sockets
    between processes is where the two loops' transports differ most."""
    return start_daemon("--model-repository", str(simple_repo), "--workers", "1", "--event-loop", request.param)


def test_a_worker_answers_infer_and_hands_other_requests_back_in_order(daemon) -> None:
    body, total, difference = simple_json_body()
    expected = {"OUTPUT0": total.ravel().tolist(), "OUTPUT1": difference.ravel().tolist()}
    raw = b"".join([
        raw_request("POST", "/v2/models/simple/infer", body),                       # worker
        raw_request("GET", "/v2/health/live"),                                       # worker
        raw_request("GET", "/v2/models/simple"),                                     # handed back
        raw_request("POST", "/v2/models/simple/infer", body),                        # daemon now
        raw_request("POST", "/v2/models/simple/infer", gzip.compress(body), ("Content-Encoding: gzip",)),
        raw_request("GET", "/v2/health/ready"),
        raw_request("POST", "/v2/models/nope/infer", body),
    ])
    with _kept(daemon), _connect(daemon) as sock:
        assert len(child_pids(daemon.proc.pid)) == 1
        responses = _exchange(sock, raw, 7)
    assert [status for status, _, _ in responses] == [200, 200, 200, 200, 200, 200, 404]
    for index in (0, 3, 4):
        assert json_outputs(responses[index][2]) == expected, index
    assert json.loads(responses[1][2]) == {"live": True} and json.loads(responses[5][2]) == {"ready": True}
    assert json.loads(responses[2][2])["name"] == "simple"
    assert json.loads(responses[6][2]) == {"error": "Request for unknown model: 'nope' is not found"}


def test_a_first_request_with_a_body_is_handed_back_whole(daemon) -> None:
    """The connection's first request is one the worker does not serve, and its body came in
    with its head: all of it reaches the daemon, and so does the request pipelined after it."""
    body, total, _ = simple_json_body()
    raw = b"".join([
        raw_request("POST", "/v2/models/simple/infer", gzip.compress(body), ("Content-Encoding: gzip",)),
        raw_request("POST", "/v2/models/simple/infer", body),
    ])
    with _kept(daemon), _connect(daemon) as sock:
        responses = _exchange(sock, raw, 2)
    assert [r[0] for r in responses] == [200, 200]
    assert all(json_outputs(r[2])["OUTPUT0"] == total.ravel().tolist() for r in responses)


def test_infer_through_a_worker_binary_large_and_compressed(daemon) -> None:
    """Every answer the same as the daemon's own: binary tensors, a body large enough to be
    received into a buffer of its own on both sides (padded JSON), a gzip answer, an error."""
    a = np.arange(128, dtype=np.int32).reshape(8, 16)
    b = np.arange(128, 256, dtype=np.int32).reshape(8, 16)
    body, length = simple_binary_body(a, b, [{"name": "OUTPUT0", "parameters": {"binary_data": True}}])
    binary = raw_request("POST", "/v2/models/simple_python/infer", body, (length,))
    large, total, _ = simple_json_body(rows=8, pad=100_000)
    raw = b"".join([
        binary,
        raw_request("POST", "/v2/models/simple/infer", large, ("Accept-Encoding: gzip",)),
        raw_request("POST", "/v2/models/simple/infer", b'{"inputs": []}'),
    ])
    with _kept(daemon) as kept, _connect(daemon) as sock:
        through_worker = _exchange(sock, raw, 3)
        own = _exchange(kept, raw, 3)
    for (status, headers, payload), (own_status, own_headers, own_payload) in zip(through_worker, own, strict=True):
        assert (status, payload) == (own_status, own_payload)
        assert {k: v for k, v in headers.items() if k != "date"} == {k: v for k, v in own_headers.items() if k != "date"}
    status, headers, payload = through_worker[0]
    json_length = int(headers["inference-header-content-length"])
    np.testing.assert_array_equal(np.frombuffer(payload[json_length:], dtype=np.int32), (a + b).ravel())
    status, headers, payload = through_worker[1]
    assert headers["content-encoding"] == "gzip"
    assert json_outputs(gzip.decompress(payload))["OUTPUT0"] == total.ravel().tolist()
    assert through_worker[2][0] == 400


def test_a_large_body_is_answered_on_a_workers_connection(daemon) -> None:
    """Past 256 KiB a body costs more to pass on than its HTTP framing costs the daemon: the
    connection goes to the daemon, which reads the body in place, and comes back."""
    large, total, _ = simple_json_body(rows=8, pad=300_000)
    small, small_total, _ = simple_json_body()
    with _kept(daemon), _connect(daemon) as sock:
        for body, expected in ((large, total), (small, small_total), (large, total)):
            status, _, payload = _exchange(sock, raw_request("POST", "/v2/models/simple/infer", body), 1)[0]
            assert status == 200 and json_outputs(payload)["OUTPUT0"] == expected.ravel().tolist()


def test_a_connection_handed_back_returns_to_a_worker_once(daemon) -> None:
    """A client asking for metadata first has its later infer requests served by a worker again;
    one that is handed back a second time stays with the daemon (no bounce per request)."""
    body, total, _ = simple_json_body()
    metadata = raw_request("GET", "/v2/models/simple")
    infer = raw_request("POST", "/v2/models/simple/infer", body)
    with _kept(daemon) as kept:
        with _connect(daemon) as first, _connect(daemon) as second:
            assert _exchange(first, metadata, 1)[0][0] == 200
            assert _exchange(first, infer, 1)[0][0] == 200
            for _ in range(2):  # handed back, returned; handed back again: kept
                assert _exchange(second, metadata, 1)[0][0] == 200
                time.sleep(0.3)
            (worker,) = child_pids(daemon.proc.pid)
            os.kill(worker, signal.SIGKILL)
            with pytest.raises(ConnectionError):  # it was on the worker again
                _exchange(first, infer, 1)
            status, _, payload = _exchange(second, infer, 1)[0]  # the daemon's for good
        assert status == 200 and json_outputs(payload)["OUTPUT0"] == total.ravel().tolist()
        assert _exchange(kept, infer, 1)[0][0] == 200


def test_a_large_answer_through_a_worker(start_daemon: Callable[..., object], tmp_path: Path) -> None:
    """An answer of 64 KiB or more reaches the worker in a buffer of its own and is written
    from it, plain and gzip-compressed: the same bytes as on the daemon's own connection."""
    repo = _echo_repo(tmp_path, "echo", ECHO_MODEL, "[-1]")
    daemon = start_daemon("--model-repository", str(repo), "--workers", "1")
    values = np.random.default_rng(0).standard_normal(40_000).astype(np.float32)  # 160 KB each way
    header = json.dumps({
        "inputs": [{"name": "IN", "shape": [40_000], "datatype": "FP32", "parameters": {"binary_data_size": values.nbytes}}],
        "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}],
    }).encode()
    body = header + values.tobytes()
    raw = b"".join(
        raw_request("POST", "/v2/models/echo/infer", body, (f"Inference-Header-Content-Length: {len(header)}", *extra))
        for extra in ((), ("Accept-Encoding: gzip",))
    )
    with _kept(daemon) as kept, _connect(daemon) as sock:
        through_worker = _exchange(sock, raw, 2)
        own = _exchange(kept, raw, 2)
    assert [(s, p) for s, _, p in through_worker] == [(s, p) for s, _, p in own]
    (status, headers, payload), (_, zipped_headers, zipped) = through_worker
    json_length = int(headers["inference-header-content-length"])
    assert status == 200 and len(payload) > 64 * 1024
    np.testing.assert_array_equal(np.frombuffer(payload[json_length:], dtype=np.float32), values)
    assert zipped_headers["content-encoding"] == "gzip" and gzip.decompress(zipped) == payload


@pytest.mark.parametrize(("workers", "executions"), [("0", 3), ("1", 2)])
def test_a_models_executions_overlap_only_without_workers(
    start_daemon: Callable[..., object], tmp_path: Path, workers: str, executions: int
) -> None:
    """A batching python model busy with A gets B, then C, on connections of their own. Without
    workers, B is taken at once as a second execution queued on the model's thread, and C waits
    for an execution of its own; with workers (which leave the daemon's loop no time to spare at
    load), B waits and C joins its batch."""
    repo = _echo_repo(tmp_path, "slow", SLOW_MODEL, "[2]")
    config = repo / "slow" / "config.pbtxt"
    config.write_text("max_batch_size: 4\n" + config.read_text())
    daemon = start_daemon("--model-repository", str(repo), "--workers", workers)
    body = json.dumps({"inputs": [{"name": "IN", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}).encode()
    infer = raw_request("POST", "/v2/models/slow/infer", body)
    with _connect(daemon) as a, _connect(daemon) as b, _connect(daemon) as c:
        for sock in (a, b, c):
            sock.sendall(infer)
            time.sleep(0.4)  # each one arrives while the 1.5 s execution of A runs
        answers = [_exchange(sock, b"", 1)[0] for sock in (a, b, c)]
        assert [status for status, _, _ in answers] == [200, 200, 200]
        assert all(json_outputs(payload)["OUT"] == [1.0, 2.0] for _, _, payload in answers)
        (status, _, stats), = _exchange(a, raw_request("GET", "/v2/models/slow/stats"), 1)
    assert status == 200
    model = json.loads(stats)["model_stats"][0]
    assert (model["inference_count"], model["execution_count"]) == (3, executions)


def test_a_worker_that_dies_is_started_again(daemon) -> None:
    body, total, _ = simple_json_body()
    infer = raw_request("POST", "/v2/models/simple/infer", body)
    with _kept(daemon) as kept:
        with _connect(daemon) as sock:
            assert _exchange(sock, infer, 1)[0][0] == 200
            (worker,) = child_pids(daemon.proc.pid)
            os.kill(worker, signal.SIGKILL)
            with pytest.raises(ConnectionError):  # its connection went with it
                _exchange(sock, infer, 1)
        assert _exchange(kept, infer, 1)[0][0] == 200  # the daemon's own is untouched
        deadline = time.monotonic() + 30
        while child_pids(daemon.proc.pid) in ([], [worker]):
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.1)
        time.sleep(0.5)  # the new worker's channels are set up after it starts
        with _connect(daemon) as sock:
            status, _, payload = _exchange(sock, infer, 1)[0]
    assert status == 200 and json_outputs(payload)["OUTPUT0"] == total.ravel().tolist()
    assert "HTTP worker 0 stopped" in daemon.log()


def test_connections_on_workers_count_towards_max_connections(
    start_daemon: Callable[..., object], simple_repo: Path, tmp_path: Path
) -> None:
    config = tmp_path / "edged.toml"
    config.write_text("[server]\nmax-connections = 2\nworkers = 1\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(simple_repo))
    live = raw_request("GET", "/v2/health/live")
    with _kept(daemon):
        with _connect(daemon) as second:
            assert _exchange(second, live, 1)[0][0] == 200
            with _connect(daemon) as third:
                assert _exchange(third, live, 1)[0][0] == 503
        # Once the worker's connection has closed, its place is free again.
        deadline = time.monotonic() + 10
        while True:
            with _connect(daemon) as again:
                if _exchange(again, live, 1)[0][0] == 200:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_stop_lets_a_workers_request_finish_and_the_workers_exit(
    start_daemon: Callable[..., object], tmp_path: Path
) -> None:
    repo = _slow_repo(tmp_path)
    daemon = start_daemon("--model-repository", str(repo), "--workers", "1")
    body = json.dumps({"inputs": [{"name": "IN", "shape": [2], "datatype": "FP32", "data": [1.5, 2.5]}]}).encode()
    with _kept(daemon), _connect(daemon) as sock:
        (worker,) = child_pids(daemon.proc.pid)
        sock.sendall(raw_request("POST", "/v2/models/slow/infer", body))
        time.sleep(0.5)  # the request is running
        daemon.proc.send_signal(signal.SIGTERM)
        status, headers, payload = read_response(sock, bytearray())
    assert status == 200 and headers["connection"] == "close"
    assert json.loads(payload)["outputs"][0]["data"] == [1.5, 2.5]
    assert daemon.proc.wait(30) == 0
    assert not _running(worker)


def test_tcp_auth_all_holds_on_a_workers_connection(
    start_daemon: Callable[..., object], simple_repo: Path, tmp_path: Path
) -> None:
    """With `tcp-auth = "all"` every TCP request needs the token: a worker hands each one back to
    the daemon, whose access check sees the client's own socket."""
    token = tmp_path / "token"
    token.write_text("s3cret-token-for-tests-0123\n")
    token.chmod(0o600)
    config = tmp_path / "edged.toml"
    config.write_text(f'[server]\ntoken-file = "{token}"\ntcp-auth = "all"\nworkers = 1\n')
    daemon = start_daemon("--config", str(config), "--model-repository", str(simple_repo), http=True)
    body, total, _ = simple_json_body()
    with _kept(daemon), socket.create_connection(("127.0.0.1", daemon.http_port), timeout=30) as sock:
        assert _exchange(sock, raw_request("GET", "/v2/health/live"), 1)[0][0] == 200  # on the worker
        refused, allowed = _exchange(sock, b"".join([
            raw_request("POST", "/v2/models/simple/infer", body),
            raw_request("POST", "/v2/models/simple/infer", body, ("Authorization: Bearer s3cret-token-for-tests-0123",)),
        ]), 2)
    assert refused[0] == 401
    assert allowed[0] == 200 and json_outputs(allowed[2])["OUTPUT0"] == total.ravel().tolist()


def test_tritonclient_and_shared_memory_rules_through_a_worker(
    start_daemon: Callable[..., object], simple_repo: Path
) -> None:
    """The real `tritonclient` over TCP with several connections of its pool on the worker, and
    the shared-memory rule that tells a Unix socket caller from a TCP one (`shared-memory =
    "socket"`, the default) kept across the processes."""
    httpclient = pytest.importorskip("tritonclient.http")
    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    from tritonclient.utils import InferenceServerException

    daemon = start_daemon("--model-repository", str(simple_repo), "--workers", "1", http=True)
    input0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    input1 = np.full((1, 16), 5, dtype=np.int32)
    handle = shm.create_shared_memory_region("in", f"/edged_workers_{os.getpid()}", 128)
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}", concurrency=4)
    try:
        shm.set_shared_memory_region(handle, [input0, input1])
        with _kept(daemon):
            inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_data_from_numpy(input0)
            inputs[1].set_data_from_numpy(input1)
            pending = [client.async_infer("simple", inputs) for _ in range(32)]
            for result in pending:
                np.testing.assert_array_equal(result.get_result().as_numpy("OUTPUT0"), input0 + input1)
            assert child_pids(daemon.proc.pid)
            reply = daemon.post_json("/v2/systemsharedmemory/region/in/register", {"key": str(handle._shm_key), "byte_size": 128})
            assert reply.status == 200, reply.body
            shm_inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            shm_inputs[0].set_shared_memory("in", 64)
            shm_inputs[1].set_shared_memory("in", 64, offset=64)
            with pytest.raises(InferenceServerException, match="disabled for callers over TCP"):
                client.infer("simple", shm_inputs)
            body = json.dumps({"inputs": [
                {"name": name, "shape": [1, 16], "datatype": "INT32",
                 "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 64, "shared_memory_offset": offset}}
                for name, offset in (("INPUT0", 0), ("INPUT1", 64))
            ]}).encode()
            with _connect(daemon) as sock:  # a Unix socket caller on the worker
                status, _, payload = _exchange(sock, raw_request("POST", "/v2/models/simple/infer", body), 1)[0]
        assert status == 200 and json_outputs(payload)["OUTPUT0"] == (input0 + input1).ravel().tolist()
    finally:
        client.close()
        shm.destroy_shared_memory_region(handle)


def test_workers_exit_when_the_daemon_is_killed(daemon) -> None:
    with _kept(daemon):
        workers = child_pids(daemon.proc.pid)
    assert workers
    daemon.proc.kill()
    daemon.proc.wait()
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived its daemon"
        time.sleep(0.05)


def test_a_worker_is_not_started_by_hand() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "daemon", "worker"], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2
    assert "`edged worker` is started by the daemon" in proc.stderr


def test_a_client_leaving_a_workers_connection_cancels_its_request_as_on_the_daemons(
    start_daemon: Callable[..., object], tmp_path: Path
) -> None:
    """The worker tells the daemon; the request is counted exactly as when the client leaves a
    connection the daemon serves itself."""
    repo = _slow_repo(tmp_path)
    daemon = start_daemon("--model-repository", str(repo), "--workers", "1")
    body = json.dumps({"inputs": [{"name": "IN", "shape": [2], "datatype": "FP32", "data": [1.5, 2.5]}]}).encode()

    def stats() -> dict[str, Any]:
        return daemon.get_json("/v2/models/slow/stats")["model_stats"][0]["inference_stats"]

    def leave(sock: socket.socket, failures: int) -> dict[str, Any]:
        sock.sendall(raw_request("POST", "/v2/models/slow/infer", body))
        time.sleep(0.3)  # in the daemon (running in the model, or queued behind the last one)
        sock.close()
        wait_until(lambda: stats()["fail"]["count"] >= failures)
        time.sleep(1.6)  # the model's call has returned: nothing more is counted for it
        return stats()

    with _kept(daemon) as kept:
        own = leave(kept, 1)
    with _kept(daemon), _connect(daemon) as sock:
        through_worker = leave(sock, 2)
    assert own["fail"]["count"] == 1 and own["success"]["count"] == 0, own
    assert through_worker["fail"]["count"] == 2 and through_worker["success"]["count"] == 0, through_worker


def _until_closed(sock: socket.socket) -> RawResponse:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, body


def test_a_bad_or_stalled_body_on_a_workers_connection_is_answered(
    start_daemon: Callable[..., object], simple_repo: Path, tmp_path: Path
) -> None:
    """A relayed request whose chunk does not parse, a body that stops coming, a request with
    Upgrade and a body: answered on a worker's connection as on the daemon's, then closed."""
    config = tmp_path / "edged.toml"
    config.write_text("[server]\nheader-timeout = 1.0\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(simple_repo), "--workers", "1")
    body, total, _ = simple_json_body()
    with _kept(daemon):
        with _connect(daemon) as sock:  # relayed: handed back to the daemon, which answers
            sock.sendall(raw_request("POST", "/v2/repository/index", headers=("Transfer-Encoding: chunked",)) + b"zz\r\n")
            status, headers, payload = _until_closed(sock)
            assert status == 400 and json.loads(payload)["error"].startswith("malformed HTTP request")
        for path in ("/v2/models/simple/infer", "/v2/repository/index"):
            with _connect(daemon) as sock:
                sock.sendall(raw_request("POST", path, headers=("Content-Length: 1000",)) + b"{")
                status, headers, payload = _until_closed(sock)
                assert status == 408 and "server.header-timeout" in json.loads(payload)["error"], path
                assert headers["connection"] == "close"
        with _connect(daemon) as sock:
            raw = raw_request("POST", "/v2/models/simple/infer", body, ("Connection: Upgrade", "Upgrade: h2c"))
            assert _exchange(sock, raw, 1)[0][0] == 200
            raw = raw_request("POST", "/v2/models/simple/infer", body, ("Connection: close",))
            (status, _, payload), = _exchange(sock, raw, 1)
            assert status == 200 and json_outputs(payload)["OUTPUT0"] == total.ravel().tolist()
