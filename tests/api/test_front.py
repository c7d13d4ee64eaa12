"""The lean HTTP front (daemon.api.front) over a real Unix socket: plain infer and health
requests are served by the front, everything else is relayed to aiohttp on the same connection,
and one connection's answers come back in request order whichever path served them."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from support import (
    RawResponse,
    json_outputs,
    python_model,
    raw_request,
    simple_binary_body,
    simple_json_body,
    wait_until,
)

pytest.importorskip("onnxruntime")


@pytest.fixture
def daemon(start_daemon: Callable[..., object], simple_repo: Path) -> object:
    return start_daemon("--model-repository", str(simple_repo))


def _exchange(
    path: Path, raw: bytes, heads: frozenset[int] = frozenset(), timeout: float = 30
) -> list[RawResponse]:
    """Send `raw` at once (pipelined); every response, read until the server closes.
    `heads`: the indexes of HEAD requests (their responses have no body)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    responses: list[RawResponse] = []
    answered = 0
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = 0 if answered in heads else int(headers.get("content-length", "0"))
        answered += status >= 200  # an interim 100 Continue answers nothing yet
        responses.append((status, headers, data[:length]))
        data = data[length:]
    return responses


def _chunked(body: bytes) -> bytes:
    half = len(body) // 2
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:])) + b"0\r\n\r\n"


def test_pipelined_requests_on_both_paths_are_answered_in_order(daemon) -> None:
    body, total, difference = simple_json_body()
    raw = b"".join([
        raw_request("GET", "/v2/health/live"),                                     # front
        raw_request("GET", "/v2"),                                                 # relayed
        raw_request("POST", "/v2/models/simple/infer", body),                      # front
        raw_request("HEAD", "/v2/models/simple"),                                  # relayed, no body
        raw_request("POST", "/v2/models/simple/infer", body, ("Expect: 100-continue",)),  # relayed
        raw_request("POST", "/v2/models/simple/infer", _chunked(body), ("Transfer-Encoding: chunked",)),
        raw_request("POST", "/v2/models/simple/infer", gzip.compress(body), ("Content-Encoding: gzip",)),
        raw_request("POST", "/v2/models/simple_python/versions/1/infer", body),    # front, versioned
        raw_request("POST", "/v2/models/nope/infer", body),                        # front, an error
        raw_request("GET", "/v2/health/ready"),                                    # front
        raw_request("GET", "/v2/models/nope", headers=("Connection: close",)),     # relayed, last
    ])
    responses = _exchange(daemon.socket, raw, heads=frozenset({3}))
    assert [status for status, _, _ in responses] == [200, 200, 200, 200, 100, 200, 200, 200, 200, 404, 200, 404]
    # Which path answered: aiohttp names itself in `Server`, the front sends no such header.
    # (aiohttp's interim 100 Continue carries no headers at all.)
    served_by_aiohttp = ["server" in headers for _, headers, _ in responses]
    assert served_by_aiohttp == [False, True, False, True, False, True, True, True, False, False, False, True]
    assert json.loads(responses[1][2])["name"] == "edged"
    # Health as the Open Inference Protocol answers it (KServe's client reads the body).
    assert json.loads(responses[0][2]) == {"live": True} and json.loads(responses[10][2]) == {"ready": True}
    assert responses[3][2] == b""  # HEAD: headers only, and the next response still parses
    expected = {"OUTPUT0": total.ravel().tolist(), "OUTPUT1": difference.ravel().tolist()}
    for index in (2, 5, 6, 7, 8):
        assert json_outputs(responses[index][2]) == expected, index
    assert responses[2][1]["content-type"] == "application/json"
    assert json.loads(responses[9][2]) == {"error": "Request for unknown model: 'nope' is not found"}
    assert json.loads(responses[11][2]) == {"error": "Request for unknown model: 'nope' is not found"}


def test_binary_infer_on_the_front(daemon) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.arange(16, 32, dtype=np.int32).reshape(1, 16)
    body, length = simple_binary_body(a, b, [{"name": "OUTPUT0", "parameters": {"binary_data": True}}])
    raw = raw_request("POST", "/v2/models/simple/infer", body, (length, "Connection: close"))
    (status, headers, payload), = _exchange(daemon.socket, raw)
    assert status == 200 and "server" not in headers
    assert headers["content-type"] == "application/octet-stream"
    json_length = int(headers["inference-header-content-length"])
    assert json.loads(payload[:json_length])["outputs"][0]["parameters"] == {"binary_data_size": 64}
    np.testing.assert_array_equal(np.frombuffer(payload[json_length:], dtype=np.int32), (a + b).ravel())


def test_infer_responses_are_compressed_as_accept_encoding_asks_on_both_paths(daemon) -> None:
    """As Triton: the whole body gzip- or zlib-wrapped, Inference-Header-Content-Length the
    JSON header's length before compression; served by the front and by aiohttp (chunked)."""
    import zlib

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 7, dtype=np.int32)
    body, length = simple_binary_body(
        a, b, [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}]
    )
    cases = [  # (Accept-Encoding, chunked, expected encoding)
        (None, False, None),
        ("gzip", False, "gzip"),
        ("deflate", True, "deflate"),
        ("gzip;q=0.2, deflate;q=0.9", False, "deflate"),
        ("gzip, deflate, br", True, "gzip"),
        ("br, identity", False, None),
        ("gzip;q=0", False, None),
    ]
    raw = b""
    for accept, chunked, _ in cases:
        headers = (length,) + ((f"Accept-Encoding: {accept}",) if accept else ())
        if chunked:
            raw += raw_request("POST", "/v2/models/simple/infer", _chunked(body), (*headers, "Transfer-Encoding: chunked"))
        else:
            raw += raw_request("POST", "/v2/models/simple/infer", body, headers)
    raw += raw_request("GET", "/v2/health/live", headers=("Connection: close",))
    responses = _exchange(daemon.socket, raw)
    assert len(responses) == len(cases) + 1
    _, plain_headers, plain = responses[0]
    for (accept, _, expected), (status, headers, payload) in zip(cases, responses, strict=False):
        assert status == 200, (accept, payload)
        assert headers.get("content-encoding") == expected, accept
        inflated = {None: lambda p: p, "gzip": gzip.decompress, "deflate": zlib.decompress}[expected](payload)
        if expected is not None:
            assert len(payload) == int(headers["content-length"]) and payload != inflated
        assert headers["inference-header-content-length"] == plain_headers["inference-header-content-length"]
        json_length = int(headers["inference-header-content-length"])
        result = json.loads(inflated[:json_length])
        assert {o["name"] for o in result["outputs"]} == {"OUTPUT0", "OUTPUT1"}
        np.testing.assert_array_equal(np.frombuffer(inflated[json_length:], dtype=np.int32), (a + b).ravel())
        assert inflated == plain
    # An error is not compressed (nor is it in Triton).
    bad = raw_request("POST", "/v2/models/nope/infer", body, (length, "Accept-Encoding: gzip", "Connection: close"))
    (status, headers, payload), = _exchange(daemon.socket, bad)
    assert status == 404 and "content-encoding" not in headers and b"nope" in payload


def test_malformed_request_is_a_400_and_the_connection_closes(daemon) -> None:
    responses = _exchange(daemon.socket, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\nNOT HTTP AT ALL\r\n\r\n")
    assert [status for status, _, _ in responses] == [200, 400]
    assert json.loads(responses[1][2])["error"].startswith("malformed HTTP request")
    assert responses[1][1]["connection"] == "close"
    assert daemon.request("GET", "/v2/health/live").status == 200  # the daemon is fine


def test_requests_received_whole_before_a_malformed_one_are_answered_first(daemon) -> None:
    """As Triton: every request that arrived whole before the bytes that do not parse is
    answered, in order (served by the front or relayed, in flight or waiting), then the 400,
    then the connection closes. A POST without Content-Length whose body follows is one such
    client mistake: its body is an empty request's, the bytes after it a malformed request."""
    body, total, _ = simple_json_body()
    raw = b"".join([
        raw_request("POST", "/v2/models/simple/infer", body),                     # front, in flight
        raw_request("GET", "/v2"),                                                # relayed, waiting
        raw_request("POST", "/v2/models/simple/infer", _chunked(body), ("Transfer-Encoding: chunked",)),
        b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\n\r\n" + body,   # no Content-Length
    ])
    responses = _exchange(daemon.socket, raw)
    assert [status for status, _, _ in responses] == [200, 200, 200, 400, 400]
    assert json_outputs(responses[0][2])["OUTPUT0"] == total.ravel().tolist()
    assert json.loads(responses[1][2])["name"] == "edged"
    assert json_outputs(responses[2][2])["OUTPUT0"] == total.ravel().tolist()
    assert "malformed JSON" in json.loads(responses[3][2])["error"]  # the empty body
    assert json.loads(responses[4][2])["error"].startswith("malformed HTTP request")
    assert responses[4][1]["connection"] == "close"
    assert daemon.request("GET", "/v2/health/live").status == 200


def test_a_request_line_without_version_is_a_400_and_the_connection_closes(daemon) -> None:
    # HTTP/0.9: a bare body would be the only answer such a client reads; Triton closes
    # without a word, aiohttp would answer "HTTP/0.9 200" with headers.
    responses = _exchange(daemon.socket, b"GET /v2\r\n\r\n")
    assert [status for status, _, _ in responses] == [400]
    assert json.loads(responses[0][2]) == {
        "error": "HTTP/0.9 requests are not supported: send HTTP/1.0 or HTTP/1.1"
    }
    assert responses[0][1]["connection"] == "close"


def test_http_1_1_without_host_is_answered_on_both_paths(daemon) -> None:
    """Triton answers HTTP/1.1 requests that lack Host; so does the front, and a relayed one
    must not meet aiohttp's 400 (and its logged traceback) instead."""
    body, total, _ = simple_json_body()
    raw = (
        b"GET /v2 HTTP/1.1\r\n\r\n"
        b"GET /v2/health/live HTTP/1.1\r\n\r\n"
        b"POST /v2/models/simple/infer HTTP/1.1\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (len(body), body)
    )
    responses = _exchange(daemon.socket, raw)
    assert [status for status, _, _ in responses] == [200, 200, 200]
    assert json.loads(responses[0][2])["name"] == "edged"
    assert json_outputs(responses[2][2])["OUTPUT0"] == total.ravel().tolist()
    assert "Traceback" not in daemon.log()


def test_http_1_0_and_oversized_bodies_go_to_aiohttp(daemon) -> None:
    body, total, _ = simple_json_body()
    raw = b"POST /v2/models/simple/infer HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    (status, headers, payload), = _exchange(daemon.socket, raw)
    assert status == 200 and "server" in headers
    assert json_outputs(payload)["OUTPUT0"] == total.ravel().tolist()
    # Over max-request-bytes (64 MiB by default): Triton's 400 text, from aiohttp's route,
    # without the body ever being sent.
    raw = raw_request("POST", "/v2/models/simple/infer", headers=(f"Content-Length: {1 << 27}",))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(daemon.socket))
        sock.sendall(raw)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"request size of 134217728 bytes exceeds the maximum allowed input size" in answer


def test_an_upgrade_request_is_answered_in_http_1_1_and_the_connection_goes_on(daemon) -> None:
    """`curl --http2` on http:// asks for h2c: nothing here switches protocols, the request is
    answered like any other and the next one on the connection is parsed as usual."""
    body, total, _ = simple_json_body()
    raw = raw_request(
        "GET", "/v2",
        headers=("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"),
    ) + raw_request("POST", "/v2/models/simple/infer", body, ("Connection: close",))
    responses = _exchange(daemon.socket, raw)
    assert [status for status, _, _ in responses] == [200, 200]
    assert json.loads(responses[0][2])["name"] == "edged"
    assert json_outputs(responses[1][2])["OUTPUT0"] == total.ravel().tolist()


def test_oversized_request_head_is_a_431_and_the_connection_closes(daemon) -> None:
    raw = raw_request("GET", "/v2/health/live", headers=("X-Padding: " + "a" * 70_000,))
    responses = _exchange(daemon.socket, raw)
    assert [status for status, _, _ in responses] == [431]
    assert json.loads(responses[0][2]) == {"error": "request line and headers exceed 65536 bytes"}
    assert daemon.request("GET", "/v2/health/live").status == 200


def test_idle_connections_close_after_keepalive_timeout_busy_ones_stay(
    start_daemon: Callable[..., object], simple_repo: Path, tmp_path: Path
) -> None:
    config = tmp_path / "edged.toml"
    config.write_text("[server]\nkeepalive-timeout = 2.0\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(simple_repo))
    live = raw_request("GET", "/v2/health/live")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(daemon.socket))
        # Busy for 3 s (longer than the timeout), a request every 0.2 s: never closed.
        for _ in range(15):
            sock.sendall(live)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 OK")
            answered = time.monotonic()
            time.sleep(0.2)
        # Then idle: closed by the daemon (recv returns b"" rather than timing out), not at once
        # (counted from the last answer, so time this process spent descheduled counts too).
        assert sock.recv(4096) == b""
        assert time.monotonic() - answered >= 1.0


_H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA")


def _open_fds(daemon) -> int:
    return len(list(Path(f"/proc/{daemon.proc.pid}/fd").iterdir()))


def test_an_upgrade_request_with_a_body_is_answered_and_its_body_is_not_the_next_request(daemon) -> None:
    """`curl --http2 -d ...` sends Upgrade: h2c with a body. llhttp ends such a request at its
    head (the rest would be the new protocol's); here its body is read as its body, on both
    paths, and a client that leaves without reading frees its connection."""
    body, total, _ = simple_json_body()
    raw = b"".join([
        raw_request("POST", "/v2/models/simple/infer", body, _H2C),
        raw_request("POST", "/v2/models/simple/infer", _chunked(body), (*_H2C, "Transfer-Encoding: chunked")),
        raw_request("GET", "/v2", b"GET /v2/health/live HTTP/1.1\r\n\r\n", ("Connection: Upgrade", "Upgrade: websocket")),
        raw_request("GET", "/v2/health/live", headers=("Connection: close",)),
    ])
    responses = _exchange(daemon.socket, raw, timeout=10)
    assert [status for status, _, _ in responses] == [200, 200, 200, 200]
    assert json_outputs(responses[0][2])["OUTPUT0"] == total.ravel().tolist()
    assert json_outputs(responses[1][2])["OUTPUT0"] == total.ravel().tolist()
    assert json.loads(responses[2][2])["name"] == "edged"
    assert json.loads(responses[3][2]) == {"live": True}
    before = _open_fds(daemon)
    for _ in range(5):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(daemon.socket))
            sock.sendall(raw_request("POST", "/v2/models/simple/infer", body, ("Connection: Upgrade", "Upgrade: foo")))
    wait_until(lambda: _open_fds(daemon) <= before, timeout=10)


def test_a_stalled_or_trickled_body_is_a_408_on_both_paths(
    start_daemon: Callable[..., object], simple_repo: Path, tmp_path: Path
) -> None:
    """A body must keep coming (at least 1 KiB per server.header-timeout): a client that stops
    or trickles must not hold a connection, and its server.max-connections slot, forever."""
    config = tmp_path / "edged.toml"
    config.write_text("[server]\nheader-timeout = 1.0\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(simple_repo))
    stalled = [
        raw_request("POST", "/v2/models/simple/infer", headers=("Content-Length: 1000",)) + b"{",  # front
        raw_request("POST", "/v2/repository/index", headers=("Content-Length: 1000",)) + b"{",  # relayed
        raw_request("POST", "/v2/models/simple/infer", headers=("Transfer-Encoding: chunked",)) + b"400\r\n{",
    ]
    socks = []
    for raw in stalled:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(30)
        sock.connect(str(daemon.socket))
        sock.sendall(raw)
        socks.append(sock)
    trickled = socket.socket(socket.AF_UNIX)
    trickled.settimeout(0.2)
    trickled.connect(str(daemon.socket))
    trickled.sendall(raw_request("POST", "/v2/models/simple/infer", headers=("Content-Length: 100000",)))
    answer = b""
    deadline = time.monotonic() + 30
    while not answer and time.monotonic() < deadline:
        trickled.sendall(b" ")  # one byte every 0.2 s
        with contextlib.suppress(TimeoutError):
            answer = trickled.recv(65536)
    socks.append(trickled)
    for index, sock in enumerate(socks):
        with sock:
            sock.settimeout(30)
            data = answer if sock is trickled else b""
            while chunk := sock.recv(65536):
                data += chunk
        head, _, payload = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), (index, data)
        assert b"Connection: close" in head
        assert "server.header-timeout" in json.loads(payload)["error"]
    assert daemon.request("GET", "/v2/health/live").status == 200


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_an_error_answer_reaches_a_client_still_sending_its_body(
    start_daemon: Callable[..., object], simple_repo: Path, transport: str
) -> None:
    """After a framing error the server stops reading the request, but the client does not know
    yet and goes on sending its body. Closing with its bytes unread resets the connection (over
    TCP the reset can destroy the answer unread); the server half-closes and drops what comes."""
    daemon = start_daemon("--model-repository", str(simple_repo), http=transport == "tcp")
    if transport == "tcp":
        sock = socket.create_connection(("127.0.0.1", daemon.http_port))
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(daemon.socket))

    def upload() -> None:
        # A good first chunk, then a bad one: the server finds it while the client is still
        # streaming what follows.
        with contextlib.suppress(OSError):  # the old server's reset
            sock.sendall(b"100000\r\n" + b"x" * 0x100000 + b"\r\nzz\r\n" + b"x" * (4 << 20))

    with sock:
        sock.settimeout(10)
        sock.sendall(raw_request("POST", "/v2/models/simple/infer", headers=("Transfer-Encoding: chunked",)))
        uploader = threading.Thread(target=upload)
        uploader.start()
        answer = b""
        try:
            while chunk := sock.recv(65536):  # the answer, then the server's end of the stream
                answer += chunk
        finally:
            uploader.join()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer
    assert b"Connection: close" in head
    assert json.loads(payload)["error"].startswith("malformed HTTP request")
    assert daemon.request("GET", "/v2/health/live").status == 200


def test_a_malformed_chunk_of_a_relayed_request_is_a_400(daemon) -> None:
    """The bad chunk arrives while aiohttp already has the request's head (it is the first on
    its connection): nothing has answered it yet, so the 400 does."""
    for path in ("/v2/models/simple/infer", "/v2/repository/index"):
        raw = raw_request("POST", path, headers=("Transfer-Encoding: chunked",)) + b"zz\r\n{}\r\n0\r\n\r\n"
        responses = _exchange(daemon.socket, raw, timeout=10)
        assert [status for status, _, _ in responses] == [400], path
        assert json.loads(responses[0][2])["error"].startswith("malformed HTTP request"), path
        assert responses[0][1]["connection"] == "close"


ECHO_VALUES = 1 << 20  # 4 MiB in, 4 MiB out


def _echo_request(values: int) -> bytes:
    """A binary infer request to the `echo` python model (y = x) of `values` FP32 ones,
    answered in binary."""
    header = json.dumps({
        "inputs": [{"name": "X", "shape": [values], "datatype": "FP32", "parameters": {"binary_data_size": 4 * values}}],
        "outputs": [{"name": "Y", "parameters": {"binary_data": True}}],
    }).encode()
    body = header + np.ones(values, dtype=np.float32).tobytes()
    return raw_request("POST", "/v2/models/echo/infer", body, (f"Inference-Header-Content-Length: {len(header)}",))


def test_pipelined_infer_stops_being_read_while_its_answers_are_not(
    start_daemon: Callable[..., object], tmp_path: Path
) -> None:
    """A client that pipelines large infer requests and reads nothing: once the answers wait in
    the daemon's write buffer, it reads no more of its requests (it would hold them all, and
    their answers, in memory); the client's sends block instead."""
    repo = tmp_path / "repo"
    python_model(repo, "echo", "y = x")
    daemon = start_daemon("--model-repository", str(repo))
    request = _echo_request(ECHO_VALUES)
    count = 16
    data = memoryview(request * count)
    sent = 0
    with socket.socket(socket.AF_UNIX) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(str(daemon.socket))
        sock.settimeout(10)  # the daemon reads nothing more: sending stops here
        with contextlib.suppress(TimeoutError):
            while sent < len(data):
                sent += sock.send(data[sent : sent + (1 << 20)])
        assert sent < len(request) * 8, f"{sent} bytes read by the daemon, its answers unread"
    assert daemon.request("GET", "/v2/health/live").status == 200


def test_a_client_that_reads_none_of_its_answers_is_dropped(
    start_daemon: Callable[..., object], tmp_path: Path
) -> None:
    """Reading stops while the answers wait (above); after server.keepalive-timeout without
    the client reading any, the connection is dropped rather than held for good."""
    repo = tmp_path / "repo"
    python_model(repo, "echo", "y = x")
    config = tmp_path / "edged.toml"
    config.write_text("[server]\nkeepalive-timeout = 1\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo))
    request = _echo_request(ECHO_VALUES)
    data = memoryview(request * 16)
    sent = received = 0
    with socket.socket(socket.AF_UNIX) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(str(daemon.socket))
        sock.settimeout(3)  # the daemon reads nothing more: sending stops here (or breaks)
        with contextlib.suppress(TimeoutError, BrokenPipeError, ConnectionResetError):
            while sent < len(data):
                sent += sock.send(data[sent : sent + (1 << 20)])
        time.sleep(2)  # over keepalive-timeout (1 s) without reading a byte
        sock.settimeout(30)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
    # Served whole, each request fully sent would have its answer (then the idle close).
    answered = sent // len(request)
    assert received < answered * 4 * ECHO_VALUES, (received, answered)
    assert daemon.request("GET", "/v2/health/live").status == 200


def test_a_body_larger_than_memory_is_a_503_naming_it(
    start_daemon: Callable[..., object], simple_repo: Path, tmp_path: Path
) -> None:
    """The front reserves an infer body's buffer when its head arrives; when memory cannot hold
    it the answer is the server's condition (503), not a malformed request (400)."""
    config = tmp_path / "edged.toml"
    config.write_text(f"[server]\nmax-request-bytes = {1 << 60}\n")
    daemon = start_daemon("--config", str(config), "--model-repository", str(simple_repo))
    length = 1 << 50  # a pebibyte: no machine has that much to allocate
    raw = raw_request(
        "POST", "/v2/models/simple/infer", headers=(f"Content-Length: {length}", "Inference-Header-Content-Length: 10")
    )
    responses = _exchange(daemon.socket, raw, timeout=10)
    assert [status for status, _, _ in responses] == [503]
    assert json.loads(responses[0][2]) == {"error": f"not enough memory to receive a body of {length} bytes"}
    assert daemon.request("GET", "/v2/health/live").status == 200


def test_an_abandoned_upload_is_freed_when_its_connection_goes(daemon) -> None:
    """An infer body read in place (binary, Content-Length) that the client abandons half-way
    is freed with its connection, not at the next full garbage collection."""

    def rss_mib() -> int:
        status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) >> 10

    length, sent = 48 << 20, 40 << 20
    head = raw_request(
        "POST", "/v2/models/simple/infer", headers=(f"Content-Length: {length}", "Inference-Header-Content-Length: 10")
    )
    assert daemon.request("GET", "/v2/health/live").status == 200
    baseline = rss_mib()
    for _ in range(3):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect(str(daemon.socket))
            sock.sendall(head + bytes(sent))
            wait_until(lambda: rss_mib() >= baseline + 30, timeout=30)
    # 3 x 40 MiB held until a garbage collection without the fix; freed at once with it.
    wait_until(lambda: rss_mib() < baseline + 30, timeout=20)


def test_http_2_0_on_a_request_line_is_a_505(daemon) -> None:
    responses = _exchange(daemon.socket, b"GET /v2/health/live HTTP/2.0\r\nHost: x\r\n\r\n", timeout=10)
    assert [status for status, _, _ in responses] == [505]
    assert json.loads(responses[0][2]) == {"error": "HTTP/2.0 is not supported: send HTTP/1.0 or HTTP/1.1"}
    assert responses[0][1]["connection"] == "close"


def test_binary_offset_reads_ascii_digits_only() -> None:
    from daemon.api.front import binary_offset

    assert binary_offset("10") == 10 and binary_offset(" 10\t") == 10 and binary_offset(None) is None
    for value in ("1_0", "+10", "-1", "\uff11\uff10", "", "10 0", "0x10"):
        assert binary_offset(value) is None, value


def test_a_body_waiting_for_100_continue_behind_a_slow_request_is_not_timed_out(
    start_daemon: Callable[..., object], tmp_path: Path
) -> None:
    """`Expect: 100-continue` pipelined behind a request that takes longer than the body's
    timeout: its client rightly sends nothing until its 100 Continue, which comes in turn."""
    config = tmp_path / "edged.toml"
    config.write_text("[server]\nheader-timeout = 1.0\n")
    repo = tmp_path / "repo"
    python_model(repo, "slow", "import time\ntime.sleep(2.5)\ny = x")
    daemon = start_daemon("--config", str(config), "--model-repository", str(repo))
    body = json.dumps({"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]}).encode()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(daemon.socket))
        sock.sendall(
            raw_request("POST", "/v2/models/slow/infer", body)
            + raw_request("POST", "/v2/models/slow/infer", headers=(f"Content-Length: {len(body)}", "Expect: 100-continue"))
        )
        data = b""
        while b"100 Continue" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        assert data.startswith(b"HTTP/1.1 200 OK\r\n")
        sock.sendall(body)
        while data.count(b"HTTP/1.1 200 OK") < 2 or not data.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
