"""Per-request latency: the daemon over its Unix socket vs `session.run` in-process, same model.

    .venv/bin/python bench/latency.py [--requests 2000] [--json]

Prints p50/p99 of both and their ratio (target: daemon p50 <= 1.5x in-process for a tiny model).
The client keeps one connection open (like tritonclient does) and sends the binary tensor
extension unless --json is given.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Endpoint, percentiles, running_daemon
from model_builders import write_simple_repository


def bench_in_process(model: Path, a: np.ndarray, b: np.ndarray, n: int) -> list[float]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    feeds = {"INPUT0": a, "INPUT1": b}
    for _ in range(50):
        session.run(None, feeds)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return times


def bench_daemon(endpoint: Endpoint, a: np.ndarray, b: np.ndarray, n: int, use_json: bool) -> list[float]:
    if use_json:
        body = json.dumps({"inputs": [
            {"name": "INPUT0", "shape": list(a.shape), "datatype": "INT32", "data": a.ravel().tolist()},
            {"name": "INPUT1", "shape": list(b.shape), "datatype": "INT32", "data": b.ravel().tolist()},
        ]}).encode()
        headers = {"Content-Type": "application/json"}
    else:
        header = json.dumps({
            "inputs": [
                {"name": "INPUT0", "shape": list(a.shape), "datatype": "INT32", "parameters": {"binary_data_size": a.nbytes}},
                {"name": "INPUT1", "shape": list(b.shape), "datatype": "INT32", "parameters": {"binary_data_size": b.nbytes}},
            ],
            "parameters": {"binary_data_output": True},
        }).encode()
        body = header + a.tobytes() + b.tobytes()
        headers = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}
    conn = endpoint.connection()
    times = []
    for i in range(n + 50):
        start = time.perf_counter()
        conn.request("POST", "/v2/models/simple/infer", body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        elapsed = time.perf_counter() - start
        if resp.status != 200:
            raise SystemExit(f"daemon answered {resp.status}")
        if i >= 50:
            times.append(elapsed)
    conn.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="JSON tensors instead of binary")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        write_simple_repository(repo, python=False)
        (repo / "simple" / "config.pbtxt").write_text(
            (repo / "simple" / "config.pbtxt").read_text() + "\ninstance_group [{ count: 1 kind: KIND_CPU }]\n"
        )
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        b = np.ones((1, 16), dtype=np.int32)
        with running_daemon(Path(tmp), repo, ready_model="simple") as endpoint:
            local = bench_in_process(repo / "simple" / "1" / "model.onnx", a, b, args.requests)
            remote = bench_daemon(endpoint, a, b, args.requests, args.json)
    lp50, lp99 = percentiles(local)
    rp50, rp99 = percentiles(remote)
    mode = "json" if args.json else "binary"
    print(f"in-process session.run : p50 {lp50:8.1f} us   p99 {lp99:8.1f} us")
    print(f"daemon over UDS ({mode}) : p50 {rp50:8.1f} us   p99 {rp99:8.1f} us")
    print(f"ratio daemon/in-process: p50 {rp50 / lp50:6.2f}x  p99 {rp99 / lp99:6.2f}x")
    print(f"added per request      : p50 {rp50 - lp50:8.1f} us")


if __name__ == "__main__":
    main()
