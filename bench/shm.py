"""An 11 MB camera frame through system shared memory vs through the HTTP body, same model.

    .venv/bin/python bench/shm.py [--clients 4] [--duration 8] [--rounds 2]

Each client owns one FP32 [1, 3, 720, 1280] frame (11 059 200 bytes) of its own values. Rows:

- `shm`: the frame sits in a POSIX shared memory object the client registered
  (`/v2/systemsharedmemory/region/<name>/register`); the request is a ~200-byte JSON header
  naming the region, the daemon reads the frame in place (a read-only numpy view of its
  mapping, no copy).
- `body`: the frame travels in the request body (binary tensor data extension).

Same model for both: a Triton-style Python model (`model.py`, run unchanged by our python
backend) that returns a strided per-channel sum over the whole frame, which each client checks
against numpy during warm-up, so a wrong or stale frame fails the run. The work is deliberately
small: the rows measure moving the frame, not computing on it. Both rows go over the Unix
socket with the closed-loop client of bench/common.py, interleaved round by round.

Rows run over the Unix socket and over TCP (edged with `server.shared-memory = "all"`).
Real Triton runs beside it when `EDGED_ORACLE` names a venv holding `nvidia-pytriton==0.7.0`
(Triton 2.51, the oracle of the Triton-fidelity work; `make compat` builds one): the same
`model.py` and config on its python backend, the same objects registered with it, the same
client over TCP. Without it those rows are skipped and the issue's measured anchor (Triton 2.51
python backend on this CPU: 691 req/s shm, 119 req/s body) is printed for reference.

Prints req/s and p50/p99 per row, then shm/body per server and edged/Triton per transport.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Endpoint,
    Request,
    Workload,
    WrongOutput,
    free_port,
    http_request,
    interleaved,
    kserve_infer,
    kserve_output,
    machine,
    running_daemon,
    running_triton,
)

SHAPE = (1, 3, 720, 1280)
STRIDE = 97
MODEL = "frame"
MODEL_PY = f'''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            y = x[:, :, ::{STRIDE}, ::{STRIDE}].sum(axis=(2, 3), dtype=np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
        return responses
'''
CONFIG = f'''\
name: "{MODEL}"
backend: "python"
max_batch_size: 0
input [{{ name: "INPUT0" data_type: TYPE_FP32 dims: {list(SHAPE)} }}]
output [{{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [1, 3] }}]
instance_group [{{ count: 2 kind: KIND_CPU }}]
'''


def expected(frame: np.ndarray) -> np.ndarray:
    return frame[:, :, ::STRIDE, ::STRIDE].sum(axis=(2, 3), dtype=np.float32)


class Checker:
    def __init__(self, wanted: list[np.ndarray]) -> None:
        self.wanted = wanted

    def __call__(self, index: int, status: int, headers: dict[str, str], body: bytes) -> None:
        if status != 200:
            raise WrongOutput(f"client {index}: HTTP {status}: {body[:300]!r}")
        got = kserve_output(headers, body)
        if not np.allclose(got, self.wanted[index], rtol=1e-4):
            raise WrongOutput(f"client {index}: {got} != {self.wanted[index]}")


def shm_request(region: str, size: int) -> Request:
    header = {
        "inputs": [{"name": "INPUT0", "shape": list(SHAPE), "datatype": "FP32",
                    "parameters": {"shared_memory_region": region, "shared_memory_byte_size": size}}],
        "parameters": {"binary_data_output": True},
    }
    return http_request("POST", f"/v2/models/{MODEL}/infer", json.dumps(header).encode(),
                        {"Content-Type": "application/json"})


@contextlib.contextmanager
def shm_objects(frames: list[np.ndarray]) -> Iterator[list[str]]:
    """One /dev/shm object per frame (what shm_open + ftruncate + a write do); unlinked after."""
    keys = [f"/edged_bench_{uuid.uuid4().hex[:10]}" for _ in frames]
    try:
        for key, frame in zip(keys, frames, strict=True):
            fd = os.open(f"/dev/shm{key}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, frame.astype("<f4").tobytes())
            finally:
                os.close(fd)
        yield keys
    finally:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm{key}")


def register(endpoint: Endpoint, name: str, key: str, size: int) -> None:
    conn = endpoint.connection()
    try:
        conn.request("POST", f"/v2/systemsharedmemory/region/{name}/register",
                     json.dumps({"key": key, "offset": 0, "byte_size": size}),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        body = reply.read()
        if reply.status != 200:
            raise SystemExit(f"{endpoint}: register {name}: HTTP {reply.status}: {body!r}")
    finally:
        conn.close()


def workloads_for(label: str, endpoint: Endpoint, frames: list[np.ndarray], checker: Checker,
                  keys: list[str]) -> dict[str, Workload]:
    size = frames[0].nbytes
    for i, key in enumerate(keys):
        register(endpoint, f"frame{i}", key, size)
    return {
        f"{label} shm": Workload(endpoint, [shm_request(f"frame{i}", size) for i in range(len(frames))], checker),
        f"{label} body": Workload(endpoint, [kserve_infer(MODEL, "INPUT0", f, binary=True) for f in frames],
                                  checker),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per row, all rounds")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=1.0)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    frames = [rng.random(SHAPE, dtype=np.float32) for _ in range(args.clients)]
    checker = Checker([expected(f) for f in frames])
    oracle = os.environ.get("EDGED_ORACLE")
    print(f"# bench/shm.py: {machine()}")
    print(f"# FP32 {list(SHAPE)} = {frames[0].nbytes} bytes per request, {args.clients} clients, "
          f"{args.duration:g} s per row in {args.rounds} rounds")
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edged-bench-shm-")))
        keys = stack.enter_context(shm_objects(frames))
        repo = tmp / "repo"
        (repo / MODEL / "1").mkdir(parents=True)
        (repo / MODEL / "1" / "model.py").write_text(MODEL_PY)
        (repo / MODEL / "config.pbtxt").write_text(CONFIG)
        config = tmp / "edged.toml"
        config.write_text('[server]\nshared-memory = "all"\n')
        port = free_port()
        unix = stack.enter_context(running_daemon(tmp, repo, ready_model=MODEL, http=f"127.0.0.1:{port}",
                                                  flags=["--config", str(config)]))
        workloads = workloads_for("edged unix", unix, frames, checker, keys)
        # Region names are per server: the TCP rows reach the same daemon and regions.
        tcp = Endpoint(port=port)
        workloads.update({label.replace("unix", "tcp"): Workload(tcp, work.requests, work.check)
                          for label, work in workloads.items()})
        if oracle:
            triton_dir = tmp / "triton"
            triton_dir.mkdir()
            triton = stack.enter_context(running_triton(Path(oracle), repo, triton_dir, MODEL))
            workloads.update(workloads_for("triton tcp", triton, frames, checker, keys))
        results = interleaved(workloads, rounds=args.rounds, duration=args.duration, warmup=args.warmup)
    for label, result in results.items():
        print(result.line(label))
    rate = {label: result.throughput for label, result in results.items()}
    for server in ("edged unix", "edged tcp", "triton tcp"):
        if f"{server} shm" in rate:
            print(f"{server}: shm / body throughput {rate[f'{server} shm'] / rate[f'{server} body']:.2f}x")
    if oracle:
        for kind in ("shm", "body"):
            print(f"edged tcp / triton tcp, {kind}: {rate[f'edged tcp {kind}'] / rate[f'triton tcp {kind}']:.2f}x")
    else:
        print("real Triton: EDGED_ORACLE not set (a venv with nvidia-pytriton==0.7.0); skipped. Issue "
              "anchor, Triton 2.51 python backend on this CPU: 691 req/s shm, 119 req/s body (5.8x); "
              f"edged tcp shm / that anchor: {rate['edged tcp shm'] / 691:.2f}x")


if __name__ == "__main__":
    main()
