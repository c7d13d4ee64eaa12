"""edged and real Triton side by side over HTTP: the same models, the same client, rows interleaved.

    EDGED_ORACLE=/path/to/venv-with-nvidia-pytriton .venv/bin/python bench/triton_http.py \
        [--duration 3] [--rounds 2] [--json]

Models (Triton python-backend code, loaded unchanged by both servers):
- `simple`: Triton's example, INT32 [1, 16] INPUT0/INPUT1 -> OUTPUT0 = sum, OUTPUT1 = difference.
- `frame`: an 11 MB FP32 [1, 3, 720, 1280] tensor through the request body (binary tensor data
  extension), reduced to a tiny strided sum, so the row measures moving the body.

Rows (each once per server, interleaved round by round, TCP for both servers): simple with 1
client (p50 latency), 8 and 32 clients (throughput), frame with 4 clients (throughput), and
`GET /v2/health/live` with 32 clients (the HTTP layer's floor, no model); `--json` adds simple
with 8 clients in plain JSON. Every response of the warm-up is checked against numpy.

Each round runs every row on both servers, the first server alternating from round to round.
The ratios are printed twice: over all rounds pooled, and as the median and range of the
per-round ratios. Triton's rows move a lot from one minute to the next on a shared box, so
read several rounds (`--rounds 8 --duration 12`), not one pooled figure.

Server CPU per request: utime + stime of the server process (and of its whole process tree:
Triton's python models run in stub processes) from /proc/<pid>/stat, read at the start and the
end of each measured window, divided by the requests answered in it.

`--edged-flags "--workers 1"` runs edged with one HTTP worker process (`server.workers`, off
by default): the load rows' configuration in docs/performance.md.

`--cpu-cores 0-0` gives both servers a host policy "cpu" with those CPUs, which their CPU model
instances run on (Triton's `--host-policy=cpu,cpu-cores=0-0`); edged's event loop runs on it too
(`--server-host-policy cpu`, which Triton has no counterpart for).

Without `EDGED_ORACLE` only edged's rows run. A run takes about a minute (Triton's start-up
included); everything it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Endpoint,
    LoadResult,
    Request,
    WrongOutput,
    closed_loop,
    free_port,
    http_request,
    kserve_infer,
    kserve_output,
    machine,
    running_daemon,
    running_triton,
)

SIMPLE_PY = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
'''
SIMPLE_CONFIG = '''\
name: "simple"
backend: "python"
max_batch_size: 8
input [{ name: "INPUT0" data_type: TYPE_INT32 dims: [16] },
       { name: "INPUT1" data_type: TYPE_INT32 dims: [16] }]
output [{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [16] },
        { name: "OUTPUT1" data_type: TYPE_INT32 dims: [16] }]
instance_group [{ count: 1 kind: KIND_CPU }]
'''
# The 11 MB frame model is bench/shm.py's: the same model measures body vs shared memory there.
from shm import CONFIG as FRAME_CONFIG  # noqa: E402
from shm import MODEL_PY as FRAME_PY  # noqa: E402
from shm import SHAPE as FRAME_SHAPE  # noqa: E402
from shm import STRIDE  # noqa: E402


def write_repository(repo: Path) -> None:
    for name, code, config in (("simple", SIMPLE_PY, SIMPLE_CONFIG), ("frame", FRAME_PY, FRAME_CONFIG)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(code)
        (repo / name / "config.pbtxt").write_text(config)


def simple_request(a: np.ndarray, b: np.ndarray, *, binary: bool) -> Request:
    """Triton's simple_http_infer_client request: two INT32 [1, 16] inputs."""
    path = "/v2/models/simple/infer"
    if not binary:
        body = json.dumps({"inputs": [
            {"name": name, "shape": [1, 16], "datatype": "INT32", "data": x.ravel().tolist()}
            for name, x in (("INPUT0", a), ("INPUT1", b))]}).encode()
        return http_request("POST", path, body, {"Content-Type": "application/json"})
    header = json.dumps({
        "inputs": [{"name": name, "shape": [1, 16], "datatype": "INT32",
                    "parameters": {"binary_data_size": 64}} for name in ("INPUT0", "INPUT1")],
        "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in ("OUTPUT0", "OUTPUT1")],
    }).encode()
    raw = a.astype("<i4").tobytes() + b.astype("<i4").tobytes()
    return http_request("POST", path, header + raw, {
        "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))})


def _output(headers: dict[str, str], body: bytes, index: int, dtype: str) -> np.ndarray:
    json_length = headers.get("inference-header-content-length")
    header = json.loads(body[: int(json_length)] if json_length else body)
    outputs = header["outputs"]
    if not json_length:
        return np.asarray(outputs[index]["data"], dtype=dtype).reshape(outputs[index]["shape"])
    offset = int(json_length)
    for position, output in enumerate(outputs):
        size = int(output["parameters"]["binary_data_size"])
        if position == index:
            return np.frombuffer(body, dtype=dtype, count=size // 4, offset=offset).reshape(output["shape"])
        offset += size
    raise WrongOutput(f"response has no output {index}")


class SimpleCheck:
    def __init__(self, a: np.ndarray, b: np.ndarray) -> None:
        self.a, self.b = a, b

    def __call__(self, index: int, status: int, headers: dict[str, str], body: bytes) -> None:
        got_sum, got_diff = _output(headers, body, 0, "<i4"), _output(headers, body, 1, "<i4")
        if not (np.array_equal(got_sum, self.a + self.b) and np.array_equal(got_diff, self.a - self.b)):
            raise WrongOutput(f"client {index}: simple returned {got_sum} / {got_diff}")


class FrameCheck:
    def __init__(self, frames: Sequence[np.ndarray]) -> None:
        self.wanted = [f[:, :, ::STRIDE, ::STRIDE].sum(axis=(2, 3), dtype=np.float32) for f in frames]

    def __call__(self, index: int, status: int, headers: dict[str, str], body: bytes) -> None:
        got = kserve_output(headers, body)
        if not np.allclose(got, self.wanted[index], rtol=1e-4):
            raise WrongOutput(f"client {index}: frame returned {got}, wanted {self.wanted[index]}")


def _children(pid: int) -> list[int]:
    found = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(the process's own utime + stime, its whole tree's) in seconds."""
    tick = os.sysconf("SC_CLK_TCK")

    def own(p: int) -> float:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)

    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += own(p)
        todo += _children(p)
    return own(pid), total


@dataclass
class Row:
    result: LoadResult
    cpu_us: float  # server process CPU per answered request
    tree_cpu_us: float


async def _measured(endpoint: Endpoint, requests: Sequence[Request], duration: float, warmup: float,
                    check: object) -> Row:
    assert endpoint.pid is not None

    async def cpu_window() -> tuple[float, float]:
        await asyncio.sleep(warmup)
        before = cpu_seconds(endpoint.pid)  # type: ignore[arg-type]
        await asyncio.sleep(duration)
        after = cpu_seconds(endpoint.pid)  # type: ignore[arg-type]
        return after[0] - before[0], after[1] - before[1]

    window = asyncio.create_task(cpu_window())
    result = await closed_loop(endpoint, requests, duration=duration, warmup=warmup, check=check)  # type: ignore[arg-type]
    own, tree = await window
    return Row(result, 1e6 * own / len(result.latencies), 1e6 * tree / len(result.latencies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per row, all rounds")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--json", action="store_true", help="add a JSON row (simple, 8 clients)")
    parser.add_argument("--edged-flags", default="", help="extra `edged serve` flags, space-separated")
    parser.add_argument("--cpu-cores", default="", help="a host policy for both servers' model instances, e.g. 0-0")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    a = rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
    b = rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
    frames = [rng.random(FRAME_SHAPE, dtype=np.float32) for _ in range(4)]
    simple = simple_request(a, b, binary=True)
    cases: dict[str, tuple[list[Request], object]] = {
        "simple c1": ([simple], SimpleCheck(a, b)),
        "simple c8": ([simple] * 8, SimpleCheck(a, b)),
        "simple c32": ([simple] * 32, SimpleCheck(a, b)),
        "frame 11MB c4": ([kserve_infer("frame", "INPUT0", f, binary=True) for f in frames], FrameCheck(frames)),
    }
    # The HTTP floor: an empty GET through each server's whole request machinery, no model.
    cases["health c32"] = ([Request(b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n\r\n")] * 32, None)
    if args.json:
        cases["simple json c8"] = ([simple_request(a, b, binary=False)] * 8, SimpleCheck(a, b))
    oracle = os.environ.get("EDGED_ORACLE")
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"# bench/triton_http.py: {machine()}; load average before: {load}")
    print(f"# {args.duration:g} s per row in {args.rounds} rounds, {args.warmup:g} s warm-up each; TCP for both"
          + (f"; host policy cpu-cores {args.cpu_cores} on both" if args.cpu_cores else ""))
    parts: dict[str, list[Row]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edged-bench-triton-")))
        repo = tmp / "repo"
        write_repository(repo)
        port = free_port()
        policy = [f"--host-policy=cpu,cpu-cores={args.cpu_cores}"] if args.cpu_cores else []
        edged_flags = args.edged_flags.split() + ([*policy, "--server-host-policy", "cpu"] if policy else [])
        unix = stack.enter_context(running_daemon(tmp, repo, ready_model="frame", http=f"127.0.0.1:{port}",
                                                  flags=edged_flags))
        servers = {"edged": Endpoint(port=port, pid=unix.pid)}
        if oracle:
            (tmp / "triton").mkdir()
            servers["triton"] = stack.enter_context(running_triton(Path(oracle), repo, tmp / "triton", "frame", policy))
        for round_no in range(args.rounds):
            # Which server goes first alternates, so that neither always follows the other's load.
            order = list(servers.items())[:: -1 if round_no % 2 else 1]
            for case, (requests, check) in cases.items():
                for server, endpoint in order:
                    row = asyncio.run(_measured(endpoint, requests, args.duration / args.rounds, args.warmup, check))
                    parts.setdefault(f"{server} {case}", []).append(row)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    rows = {}
    for label, runs in parts.items():
        result = LoadResult.merge([r.result for r in runs])
        cpu = sum(r.cpu_us * len(r.result.latencies) for r in runs) / len(result.latencies)
        tree = sum(r.tree_cpu_us * len(r.result.latencies) for r in runs) / len(result.latencies)
        rows[label] = (result, cpu, tree)
        print(f"{result.line(label)}   cpu {cpu:6.0f} us/req (tree {tree:6.0f})")
    print(f"# load average after: {load}")
    if not oracle:
        print("real Triton: EDGED_ORACLE not set (a venv with nvidia-pytriton==0.7.0); its rows skipped")
        return
    print("edged / Triton (all rounds pooled; then the median and range of the per-round ratios):")
    for case in cases:
        ours, _, _ = rows[f"edged {case}"]
        theirs, _, _ = rows[f"triton {case}"]
        pairs = zip(parts[f"edged {case}"], parts[f"triton {case}"], strict=True)
        if case == "simple c1":
            pooled = ours.p50_us / theirs.p50_us
            per_round = [e.result.p50_us / t.result.p50_us for e, t in pairs]
            what = "p50 latency", "(lower is better)"
        else:
            pooled = ours.throughput / theirs.throughput
            per_round = [e.result.throughput / t.result.throughput for e, t in pairs]
            what = "throughput ", "(higher is better)"
        print(f"  {case:<16} {what[0]} {pooled:5.2f}x {what[1]:<18}  per round: median "
              f"{statistics.median(per_round):4.2f}x, {min(per_round):4.2f}-{max(per_round):4.2f}x")
    for case in ("simple c1", "simple c32", "health c32"):
        _, cpu, tree = rows[f"edged {case}"]
        _, tcpu, ttree = rows[f"triton {case}"]
        print(f"  {case:<16} server CPU/request {cpu / tcpu:5.2f}x (process), {tree / ttree:5.2f}x (process tree)")


if __name__ == "__main__":
    main()
