"""Does one large request hold up everyone else? Two source trees side by side.

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/stall.py /tmp/base . [--rounds 6] [--kind bytes|json]

One client sends large infer requests back to back to a python model that returns its input
(`--kind bytes`: 300 000 BYTES elements in binary, 2.4 MB; `json`: 400 000 FP32 values as
JSON, 8 MB), while a second client sends Triton's small `simple` request over and over on
its own connection. Printed per tree: the large request's median time, and the small
requests' p50 / p99 / max latency while large ones were in flight; then B / A of the medians
over rounds, which alternate between the trees. Both daemons run at once (TCP) with this
checkout's interpreter; each response is checked. With `EDGED_ORACLE` set to a venv holding
nvidia-pytriton (see bench/triton_http.py), real Triton 2.51 serves the same models in the
same rounds, as row T.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import struct
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

import numpy as np
from common import Endpoint, free_port, machine, percentile_us, running_daemon, running_triton
from triton_http import simple_request, write_repository

ECHO_PY = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""


def echo_config(name: str, datatype: str) -> str:
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        f'input [{{ name: "IN" data_type: {datatype} dims: [ -1 ] }}]\n'
        f'output [{{ name: "OUT" data_type: {datatype} dims: [ -1 ] }}]\n'
    )


def large_request(kind: str) -> tuple[str, bytes, dict[str, str], bytes]:
    """(path, body, headers, what the response must end with)."""
    rng = np.random.default_rng(0)
    if kind == "bytes":
        count = 300_000
        raw = b"".join(struct.pack("<I", 4) + rng.bytes(4) for _ in range(count))
        header = json.dumps({"inputs": [{"name": "IN", "shape": [count], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(raw)}}],
                             "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}]}).encode()
        headers = {"Inference-Header-Content-Length": str(len(header))}
        return "/v2/models/echo/infer", header + raw, headers, raw
    values = rng.standard_normal(400_000).astype(np.float32)
    body = json.dumps({"inputs": [{"name": "IN", "shape": [len(values)], "datatype": "FP32",
                                   "data": values.tolist()}]}).encode()
    return "/v2/models/echo_fp32/infer", body, {"Content-Type": "application/json"}, b"]}]}"


def round_of(endpoint: Endpoint, large: tuple[str, bytes, dict[str, str], bytes], count: int,
             small: bytes) -> tuple[list[float], list[float]]:
    """`count` large requests from one thread, small ones from here meanwhile: both latencies."""
    path, body, headers, tail = large
    large_s: list[float] = []
    done = threading.Event()

    def send_large() -> None:
        conn = endpoint.connection(120)
        try:
            for _ in range(count):
                started = time.perf_counter()
                conn.request("POST", path, body, headers)
                response = conn.getresponse()
                data = response.read()
                if response.status != 200 or not data.endswith(tail):
                    raise SystemExit(f"{endpoint}: large request answered {response.status}")
                large_s.append(time.perf_counter() - started)
        finally:
            conn.close()
            done.set()

    head, _, small_body = small.partition(b"\r\n\r\n")
    small_headers = dict(
        line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if not line.startswith(("Host", "Content-Length"))
    )
    conn = endpoint.connection(120)
    small_s: list[float] = []
    sender = threading.Thread(target=send_large)
    sender.start()
    try:
        while not done.is_set():
            started = time.perf_counter()
            conn.request("POST", "/v2/models/simple/infer", small_body, small_headers)
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise SystemExit(f"{endpoint}: small request answered {response.status}")
            small_s.append(time.perf_counter() - started)
    finally:
        sender.join()
        conn.close()
    return large_s, small_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="tree A (the baseline)")
    parser.add_argument("b", type=Path, help="tree B")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--large", type=int, default=4, help="large requests per round")
    parser.add_argument("--kind", choices=("bytes", "json"), default="bytes")
    args = parser.parse_args()

    large = large_request(args.kind)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    small = simple_request(a, a, binary=True).raw
    print(f"# bench/stall.py: {machine()}")
    print(f"# A = {args.a.resolve()}, B = {args.b.resolve()}; {args.kind}, {len(large[1]) / 1e6:.1f} MB "
          f"large requests, {args.large} per round, {args.rounds} rounds")
    oracle = os.environ.get("EDGED_ORACLE")
    names = ("A", "B", "T") if oracle else ("A", "B")
    rows: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edged-bench-stall-")))
        repo = tmp / "repo"
        write_repository(repo)
        for name, datatype in (("echo", "TYPE_STRING"), ("echo_fp32", "TYPE_FP32")):
            (repo / name / "1").mkdir(parents=True)
            (repo / name / "1" / "model.py").write_text(ECHO_PY)
            (repo / name / "config.pbtxt").write_text(echo_config(name, datatype))
        endpoints = {}
        for name, tree in (("A", args.a), ("B", args.b)):
            (tmp / name).mkdir()
            port = free_port()
            unix = stack.enter_context(running_daemon(
                tmp / name, repo, ready_model="echo", http=f"127.0.0.1:{port}", tree=tree.resolve()))
            endpoints[name] = Endpoint(port=port, pid=unix.pid)
        if oracle:
            (tmp / "T").mkdir()
            endpoints["T"] = stack.enter_context(running_triton(Path(oracle), repo, tmp / "T", "echo"))
        for name in names:  # warm-up: imports, first calls
            round_of(endpoints[name], large, 1, small)
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                large_s, small_s = round_of(endpoints[name], large, args.large, small)
                rows[name].append((median(large_s) * 1e3, percentile_us(small_s, 50) / 1e3,
                                   percentile_us(small_s, 99) / 1e3, max(small_s) * 1e3))
    with open("/proc/loadavg") as f:
        print(f"# load average after: {' '.join(f.read().split()[:3])}")
    medians = {}
    for name in names:
        medians[name] = [median(row[i] for row in rows[name]) for i in range(4)]
        big, p50, p99, worst = medians[name]
        print(f"{name}: large request {big:7.1f} ms | small requests meanwhile p50 {p50:6.2f} ms "
              f"p99 {p99:7.2f} ms max {worst:7.2f} ms")
    ratios = [b / a for a, b in zip(medians["A"], medians["B"], strict=True)]
    print(f"B/A: large {ratios[0]:.2f}x | small p50 {ratios[1]:.2f}x p99 {ratios[2]:.2f}x max {ratios[3]:.2f}x")
    if oracle:
        ratios = [b / t for t, b in zip(medians["T"], medians["B"], strict=True)]
        print(f"B/T: large {ratios[0]:.2f}x | small p50 {ratios[1]:.2f}x p99 {ratios[2]:.2f}x max {ratios[3]:.2f}x")


if __name__ == "__main__":
    main()
