"""Shared helpers for the bench scripts: the daemon as a subprocess, a closed-loop HTTP load
generator over a Unix socket or TCP, KServe v2 request/response bodies, and percentiles.

The load generator is a hand-rolled HTTP/1.1 keep-alive client (a bare asyncio Protocol)
rather than aiohttp's client or threads with http.client: on a 2-core machine the client
shares the CPUs with the server it measures, and a request that is prebuilt bytes plus one
header scan costs ~55 us of CPU, a fraction of what a client library spends per request, so
the figures say more about the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The model builders are test fixtures (tests/model_builders.py, tests/gguf_builder.py).
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))


# --------------------------------------------------------------------------- statistics


def percentile_us(samples: Sequence[float], q: float) -> float:
    """The q-th percentile of `samples` (seconds), in microseconds."""
    return float(np.percentile(np.asarray(samples) * 1e6, q))


def percentiles(samples: Sequence[float]) -> tuple[float, float]:
    """(p50, p99) of `samples` (seconds), in microseconds."""
    return percentile_us(samples, 50), percentile_us(samples, 99)


def machine() -> str:
    """One line describing the CPU this runs on, for the printed report."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores, {model}, Python {sys.version.split()[0]}{idle_polling()}"


def idle_polling() -> str:
    """How long an idle vCPU of a KVM guest polls before it halts, when the guest's cpuidle
    driver is haltpoll: at 0 every wake-up of an idle vCPU goes through the host, which made
    one client's small requests 1.3x (Triton) to 1.6x (edged) slower (docs/performance.md,
    "Rounds read one by one")."""
    try:
        driver = Path("/sys/devices/system/cpu/cpuidle/current_driver").read_text().strip()
        poll_ns = int(Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns").read_text())
    except (OSError, ValueError):
        return ""
    return f", cpuidle {driver} (guest_halt_poll_ns {poll_ns})"


# --------------------------------------------------------------------------- endpoints


@dataclass(frozen=True)
class Endpoint:
    """Where an HTTP server listens: a Unix socket path, or host and port."""

    unix: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    # The server's process, when we started it (for its CPU time in /proc).
    pid: int | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"unix:{self.unix}" if self.unix else f"tcp:{self.host}:{self.port}"

    def connection(self, timeout: float = 60) -> http.client.HTTPConnection:
        """A blocking http.client connection, for control requests and one-at-a-time benches."""
        if self.unix:
            return UnixConnection(self.unix, timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 60) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def http_status(endpoint: Endpoint, method: str, path: str, timeout: float = 5) -> int | None:
    """Status of one request, or None when the server is not reachable (yet)."""
    conn = endpoint.connection(timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return None
    finally:
        conn.close()


def wait_until_ready(
    endpoint: Endpoint,
    path: str,
    proc: subprocess.Popen[bytes] | None,
    timeout: float = 120,
    what: str = "server",
) -> None:
    """Poll `GET path` until it answers 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode} before it was ready")
        if http_status(endpoint, "GET", path) == 200:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} was not ready at {endpoint}{path} within {timeout:.0f} s")
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class Executions:
    """What the daemon's statistics say about one model's backend executions so far."""

    executions: int
    rows: int
    # Summed wall time of all executions, every compute phase (parallel instances add up).
    busy_seconds: float

    @property
    def rows_per_execution(self) -> float:
        return self.rows / max(self.executions, 1)

    @property
    def ms_per_execution(self) -> float:
        return 1000 * self.busy_seconds / max(self.executions, 1)


def executions(endpoint: Endpoint, model: str) -> Executions:
    """Read `GET /v2/models/{model}/stats` (Triton's statistics extension)."""
    conn = endpoint.connection()
    try:
        conn.request("GET", f"/v2/models/{model}/stats")
        stats = json.loads(conn.getresponse().read())["model_stats"][0]
    finally:
        conn.close()
    phases = ("compute_input", "compute_infer", "compute_output")
    busy_ns = sum(int(row[phase]["ns"]) for row in stats["batch_stats"] for phase in phases)
    return Executions(int(stats["execution_count"]), int(stats["inference_count"]), busy_ns / 1e9)


@contextlib.contextmanager
def running_daemon(
    tmp: Path,
    repository: Path,
    *,
    ready_model: str | None = None,
    http: str | None = None,
    log_level: str = "warning",
    flags: Sequence[str] = (),
    tree: Path = ROOT,
) -> Iterator[Endpoint]:
    """`python -m daemon serve` on a Unix socket under `tmp` (and TCP `http` if given);
    yields its socket endpoint once `ready_model` (or the server) is ready. `tree` is the
    source tree whose `daemon` package runs (started from its root, it is imported first)."""
    sock = str(tmp / "edged.sock")
    command = [
        sys.executable, "-m", "daemon", "serve", "--socket", sock,
        "--state-dir", str(tmp / "state"), "--model-repository", str(repository),
        "--log-level", log_level,
    ]
    if http:
        command += ["--http", http]
    command += list(flags)
    proc = subprocess.Popen(command, cwd=tree, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        endpoint = Endpoint(unix=sock, pid=proc.pid)
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("daemon did not start")
            time.sleep(0.05)
        ready = f"/v2/models/{ready_model}/ready" if ready_model else "/v2/health/ready"
        wait_until_ready(endpoint, ready, proc, what="daemon")
        yield endpoint
    finally:
        stop_process(proc)


def log_errors(log_text: str) -> list[str]:
    """A daemon log's error lines and tracebacks (the soak scripts allow none)."""
    return [line for line in log_text.splitlines() if "level=error" in line or "Traceback" in line]


def print_failures(failures: Mapping[str, int], errors: Sequence[str], first: Mapping[str, str] | None = None) -> None:
    """The soak scripts' report of what failed, most frequent first, then the log's errors."""
    for kind, count in sorted(failures.items(), key=lambda item: -item[1])[:20]:
        print(f"FAILED {count} x {kind}" + (f" (first at {first[kind]})" if first and kind in first else ""))
    for line in errors[:10]:
        print(f"LOG {line}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_triton(
    venv: Path, repo: Path, workdir: Path, ready_model: str, flags: Sequence[str] = ()
) -> Iterator[Endpoint]:
    """Triton 2.51 from the nvidia-pytriton wheel in `venv` (see docs in DESIGN.md: the python
    stub is copied next to the backend, the wheel's libraries go on LD_LIBRARY_PATH), with
    extra `flags`."""
    sites = sorted(venv.glob("lib/python3.*/site-packages"))
    root = sites[0] / "pytriton" / "tritonserver" if sites else None
    if root is None or not (root / "bin" / "tritonserver").exists():
        raise SystemExit(f"EDGED_ORACLE={venv} holds no pytriton tritonserver")
    stub = root / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():
        shutil.copy2(root / "python_backend_stubs" / sites[0].parent.name.removeprefix("python") / stub.name, stub)
    port = free_port()
    env = {**os.environ, "LD_LIBRARY_PATH": str(sites[0] / "nvidia_pytriton.libs"),
           "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    env.pop("PYTHONPATH", None)
    with (workdir / "tritonserver.log").open("wb") as log:
        proc = subprocess.Popen(
            [str(root / "bin" / "tritonserver"), "--model-repository", str(repo),
             "--backend-directory", str(root / "backends"), "--http-port", str(port),
             "--allow-grpc", "false", "--allow-metrics", "false", *flags],
            cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        endpoint = Endpoint(port=port, pid=proc.pid)
        wait_until_ready(endpoint, f"/v2/models/{ready_model}/ready", proc, timeout=180, what="tritonserver")
        yield endpoint
    finally:
        stop_process(proc)


# --------------------------------------------------------------------------- models


def write_mlp_model(
    repository: Path, name: str, width: int, depth: int, config: str, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """An FP32 MLP (see tests/model_builders.py: build_mlp_onnx) as `<repository>/<name>/1/model.onnx` with
    `config` as its config.pbtxt; returns the weights for `mlp_reference`."""
    from model_builders import build_mlp_onnx

    weights = build_mlp_onnx(repository / name / "1" / "model.onnx", width, depth, seed)
    (repository / name / "config.pbtxt").write_text(f'name: "{name}"\n{config}', encoding="utf-8")
    return weights


# --------------------------------------------------------------------------- KServe v2 bodies


@dataclass(frozen=True)
class Request:
    """One prebuilt HTTP/1.1 request: the bytes to send."""

    raw: bytes


def http_request(method: str, path: str, body: bytes, headers: dict[str, str]) -> Request:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(body)}"]
    lines += [f"{key}: {value}" for key, value in headers.items()]
    return Request(("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body)


def kserve_infer(model: str, name: str, array: np.ndarray, *, binary: bool) -> Request:
    """A KServe v2 infer request for one FP32 input: binary tensor extension or plain JSON."""
    path = f"/v2/models/{model}/infer"
    tensor: dict[str, object] = {"name": name, "shape": list(array.shape), "datatype": "FP32"}
    if not binary:
        tensor["data"] = array.ravel().tolist()
        body = json.dumps({"inputs": [tensor]}).encode()
        return http_request("POST", path, body, {"Content-Type": "application/json"})
    raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
    return http_request(
        "POST",
        path,
        header + raw,
        {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))},
    )


def kserve_output(headers: dict[str, str], body: bytes, index: int = 0) -> np.ndarray:
    """Output `index` of a KServe v2 infer response (JSON or binary tensor extension) as FP32."""
    json_length = headers.get("inference-header-content-length")
    header = json.loads(body[: int(json_length)] if json_length else body)
    outputs = header["outputs"]
    shape = outputs[index]["shape"]
    if not json_length:
        return np.asarray(outputs[index]["data"], dtype=np.float32).reshape(shape)
    offset = int(json_length)
    for position, output in enumerate(outputs):
        size = int(output.get("parameters", {}).get("binary_data_size", 0))
        if position == index:
            return np.frombuffer(body, dtype="<f4", count=size // 4, offset=offset).reshape(shape)
        offset += size
    raise ValueError(f"response has no output {index}")


# --------------------------------------------------------------------------- load generator


class HttpError(Exception):
    pass


class WrongOutput(Exception):
    """A checked response did not match the numpy reference."""


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if line:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
    return status, headers


class _Client(asyncio.Protocol):
    """One closed-loop client on one keep-alive connection.

    A bare Protocol rather than asyncio streams or an HTTP client library: the next request is
    written straight from `data_received`, with no task switch per request, so the client
    spends a few tens of microseconds per request and leaves the CPUs to the server it measures.
    Responses must carry Content-Length (both servers measured here send it).
    """

    def __init__(self, run: _Run, index: int, request: Request) -> None:
        self.run = run
        self.index = index
        self.request = request.raw
        self.buffer = bytearray()
        # Where the body ends in `buffer` once the head is parsed, else -1.
        self.body_end = -1
        self.body_start = 0
        self.head = b""
        self.sent = 0.0
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.sent = time.monotonic()
        if self.sent >= self.run.measure_to:
            self.transport.close()
            if not self.done.done():
                self.done.set_result(None)
            return
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if self.body_end < 0:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                self.head = bytes(self.buffer[:end])
                lower = self.head.lower()
                at = lower.find(b"\r\ncontent-length:")
                if at < 0:
                    self._fail(HttpError(f"client {self.index}: response without Content-Length"))
                    return
                line_end = lower.find(b"\r\n", at + 2)
                length = int(lower[at + 17 : line_end if line_end > 0 else len(lower)])
                self.body_start = end + 4
                self.body_end = self.body_start + length
            if len(self.buffer) < self.body_end:
                return
            self._response(bytes(self.buffer[self.body_start : self.body_end]))
            del self.buffer[: self.body_end]
            self.body_end = -1
            if self.done.done():
                return
            self._send()

    def _response(self, body: bytes) -> None:
        finished = time.monotonic()
        run = self.run
        status = int(self.head[9:12])
        if status != 200:
            self._fail(HttpError(f"client {self.index} got HTTP {status}: {body[:300]!r}"))
            return
        if self.sent >= run.measure_from:
            if finished <= run.measure_to:
                run.latencies.append(finished - self.sent)
        elif run.check is not None:
            try:
                run.check(self.index, status, _parse_head(self.head)[1], body)
            except Exception as exc:
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(HttpError(f"client {self.index}: connection lost ({exc})"))


# check(client index, status, headers, body) raises when a response is wrong.
Check = Callable[[int, int, dict[str, str], bytes], None]


@dataclass
class LoadResult:
    requests: int
    seconds: float
    latencies: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds

    @property
    def p50_us(self) -> float:
        return percentile_us(self.latencies, 50)

    @property
    def p99_us(self) -> float:
        return percentile_us(self.latencies, 99)

    @classmethod
    def merge(cls, parts: Sequence[LoadResult]) -> LoadResult:
        return cls(
            sum(p.requests for p in parts),
            sum(p.seconds for p in parts),
            [t for p in parts for t in p.latencies],
        )

    def line(self, label: str) -> str:
        return (
            f"{label:<34} {self.throughput:9.0f} req/s   p50 {self.p50_us / 1000:7.2f} ms   "
            f"p99 {self.p99_us / 1000:7.2f} ms   ({self.requests} requests)"
        )


@dataclass
class _Run:
    measure_from: float
    measure_to: float
    check: Check | None
    latencies: list[float] = field(default_factory=list)


async def closed_loop(
    endpoint: Endpoint,
    requests: Sequence[Request],
    *,
    duration: float,
    warmup: float = 1.0,
    check: Check | None = None,
) -> LoadResult:
    """One client per entry of `requests`, each on its own keep-alive connection, sending its
    request again as soon as the answer arrives. Latencies count from `warmup` seconds on and
    for `duration` seconds; every warm-up response goes through `check` (so correctness is
    verified under the same concurrency, batches merged), timed ones only need status 200."""
    loop = asyncio.get_running_loop()
    now = time.monotonic()
    run = _Run(now + warmup, now + warmup + duration, check)
    clients: list[_Client] = []
    for index, request in enumerate(requests):
        factory = functools.partial(_Client, run, index, request)
        # asyncio turns TCP_NODELAY on for TCP sockets, so small requests are not delayed.
        if endpoint.unix:
            _, client = await loop.create_unix_connection(factory, endpoint.unix)
        else:
            _, client = await loop.create_connection(factory, endpoint.host, endpoint.port)
        clients.append(client)
    try:
        await asyncio.gather(*(client.done for client in clients))
    finally:
        for client in clients:
            if client.transport is not None:
                client.transport.close()
    if not run.latencies:
        raise HttpError(f"{endpoint}: no request finished inside the measured window")
    return LoadResult(len(run.latencies), duration, run.latencies)


class MlpChecker:
    """A `Check` comparing output 0 of client i's response with `expected[i]`; counts passes."""

    def __init__(self, expected: Sequence[np.ndarray], rtol: float = 1e-3, atol: float = 1e-3) -> None:
        self.expected = list(expected)
        self.rtol = rtol
        self.atol = atol
        self.verified = 0

    def __call__(self, index: int, status: int, headers: dict[str, str], body: bytes) -> None:
        got = kserve_output(headers, body)
        want = self.expected[index]
        if got.shape != want.shape or not np.allclose(got, want, rtol=self.rtol, atol=self.atol):
            worst = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("nan")
            raise WrongOutput(
                f"client {index}: wrong output (shape {got.shape} vs {want.shape}, "
                f"max abs error {worst:g})"
            )
        self.verified += 1


@dataclass
class Workload:
    """One row of a comparison: where to send which per-client requests, and how to check them."""

    endpoint: Endpoint
    requests: Sequence[Request]
    check: Check | None = None


def interleaved(
    workloads: dict[str, Workload], *, rounds: int, duration: float, warmup: float
) -> dict[str, LoadResult]:
    """Run every workload `rounds` times, round-robin, `duration / rounds` measured seconds each.

    The machine this runs on is shared and its background load drifts; interleaving spreads
    that drift evenly over the rows instead of charging it to whichever ran last.
    """
    parts: dict[str, list[LoadResult]] = {label: [] for label in workloads}
    for _ in range(rounds):
        for label, work in workloads.items():
            result = asyncio.run(closed_loop(
                work.endpoint, work.requests, duration=duration / rounds, warmup=warmup, check=work.check
            ))
            parts[label].append(result)
    return {label: LoadResult.merge(p) for label, p in parts.items()}
