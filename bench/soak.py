"""Hot reloads under load: does any request fail, or answer from an older model than it should?

    .venv/bin/python bench/soak.py [--seconds 60] [--clients 12] [--rewrite-secs 1]
                                   [--workers N] [--on-demand] [--event-loop asyncio|uvloop]

Three models compute y = x + K: a python model without batching, a python model and an ONNX
Runtime model with dynamic batching. The daemon (this checkout) polls the repository every
0.3 s; every `--rewrite-secs` each model's file is replaced (write, then rename, as a deploy
tool does) with K one higher, so the daemon loads a new copy and swaps it in while requests run.
`--clients` threads send infer requests back to back on keep-alive connections (every fourth
over the Unix socket, the others over TCP; binary and JSON tensors alternately), each one model.
`--on-demand` makes every model on-demand with `keep_alive` 0 (loaded by the request that
needs it, unloaded when the last one ends); `--workers` hands connections to HTTP workers.

Every answer is checked: status 200, y - x one K for the whole tensor, K no lower than any K
this client saw before from that model (a swap never goes back) and no higher than the last
one written; and after the load the last K is what each model answers. Printed: requests per
model, reloads the daemon logged, failures by kind. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from common import (
    ROOT,
    Endpoint,
    free_port,
    machine,
    stop_process,
    wait_until_ready,
)

MODELS = ("python", "python_batched", "onnx_batched")
WIDTH = 4

PYTHON_MODEL = """import numpy as np
import triton_python_backend_utils as pb_utils

K = {k}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", (x + K).astype(np.float32))]))
        return responses
"""


def _config(backend: str, batched: bool, on_demand: bool) -> str:
    text = (
        f'backend: "{backend}"\nmax_batch_size: 8\n'
        f'input [{{ name: "x" data_type: TYPE_FP32 dims: [{WIDTH}] }}]\n'
        f'output [{{ name: "y" data_type: TYPE_FP32 dims: [{WIDTH}] }}]\n'
    )
    if batched:
        text += "dynamic_batching { max_queue_delay_microseconds: 200 }\n"
    if on_demand:
        text += 'parameters { key: "load" value { string_value: "on-demand" } }\n'
        text += 'parameters { key: "keep_alive" value { string_value: "0" } }\n'
    return text


def _replace(path: Path, data: bytes) -> None:
    """Write beside, then rename: the poller never sees a half-written file."""
    scratch = path.with_name(path.name + ".new")
    scratch.write_bytes(data)
    os.replace(scratch, path)


def _onnx_add(k: int) -> bytes:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "k"], ["y"])],
        "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        [numpy_helper.from_array(np.full(WIDTH, k, np.float32), "k")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def write_models(repo: Path, k: int, on_demand: bool) -> None:
    for name in MODELS:
        version = repo / name / "1"
        if not version.exists():
            version.mkdir(parents=True)
            backend = "onnxruntime" if name.startswith("onnx") else "python"
            (repo / name / "config.pbtxt").write_text(_config(backend, "batched" in name, on_demand))
        if name.startswith("onnx"):
            _replace(version / "model.onnx", _onnx_add(k))
        else:
            _replace(version / "model.py", PYTHON_MODEL.format(k=k).encode())


def _request(x: np.ndarray, binary: bool) -> tuple[bytes, dict[str, str]]:
    tensor: dict[str, object] = {"name": "x", "shape": list(x.shape), "datatype": "FP32"}
    if not binary:
        tensor["data"] = x.ravel().tolist()
        return json.dumps({"inputs": [tensor]}).encode(), {"Content-Type": "application/json"}
    raw = x.astype("<f4").tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
    return header + raw, {
        "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header)),
    }


def _output(response: http.client.HTTPResponse, body: bytes) -> np.ndarray:
    length = response.getheader("Inference-Header-Content-Length")
    if length is None:
        return np.asarray(json.loads(body)["outputs"][0]["data"], np.float32)
    return np.frombuffer(body, "<f4", offset=int(length))


class Soak:
    def __init__(self, tcp: Endpoint, unix: Endpoint) -> None:
        self.tcp, self.unix = tcp, unix
        self.written = 1  # the last K written; read by clients, raised by the rewriter
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.answered: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()

    def fail(self, kind: str) -> None:
        with self.lock:
            self.failures[kind] += 1

    def ask(self, conn: http.client.HTTPConnection, model: str, x: np.ndarray, binary: bool) -> int | None:
        """K of one answer, or None (the failure counted)."""
        body, headers = _request(x, binary)
        conn.request("POST", f"/v2/models/{model}/infer", body, headers)
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            self.fail(f"{model}: {response.status} {data[:160]!r}")
            return None
        ks = np.unique(_output(response, data) - x.ravel())
        if len(ks) != 1 or ks[0] != round(float(ks[0])):
            self.fail(f"{model}: y - x is {ks.tolist()}, not one whole K")
            return None
        return int(ks[0])

    def client(self, index: int) -> None:
        model = MODELS[index % len(MODELS)]
        binary = index % 2 == 0
        endpoint = self.unix if index % 4 == 3 else self.tcp
        conn: http.client.HTTPConnection | None = None
        highest = 0
        step = 0
        while not self.stop.is_set():
            if conn is None:
                conn = endpoint.connection(timeout=60)
            x = (np.arange(WIDTH, dtype=np.float32) + step % 11).reshape(1, WIDTH)
            step += 1
            newest = self.written  # read before sending: the answer's K may not exceed it
            try:
                k = self.ask(conn, model, x, binary)
            except (OSError, http.client.HTTPException) as exc:
                self.fail(f"{model}: {type(exc).__name__}: {exc}")
                conn.close()
                conn = None
                continue
            if k is None:
                continue
            if k < highest:
                self.fail(f"{model}: K {k} after this client saw {highest} (a swap went back)")
            elif k > max(newest, self.written):
                self.fail(f"{model}: K {k} was never written")
            highest = max(highest, k)
            with self.lock:
                self.answered[model] += 1
        if conn is not None:
            conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--rewrite-secs", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--on-demand", action="store_true")
    parser.add_argument("--event-loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        repo = tmp / "repo"
        write_models(repo, 1, args.on_demand)
        port = free_port()
        sock = tmp / "edged.sock"
        log_path = tmp / "daemon.log"
        command = [
            sys.executable, "-m", "daemon", "serve", "--socket", str(sock), "--http", f"127.0.0.1:{port}",
            "--state-dir", str(tmp / "state"), "--model-repository", str(repo),
            "--model-control-mode", "poll", "--repository-poll-secs", "0.3",
            "--workers", str(args.workers), "--event-loop", args.event_loop,
        ]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        tcp = Endpoint(port=port, pid=proc.pid)
        try:
            wait_until_ready(tcp, "/v2/health/ready", proc, what="daemon")
            soak = Soak(tcp, Endpoint(unix=str(sock)))
            clients = [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(args.clients)]
            for thread in clients:
                thread.start()
            started = time.monotonic()
            while time.monotonic() - started < args.seconds:
                time.sleep(args.rewrite_secs)
                # Raised first: an on-demand load reads the files at once, before the poller.
                soak.written += 1
                write_models(repo, soak.written, args.on_demand)
            soak.stop.set()
            for thread in clients:
                thread.join(120)
            # The last rewrite has landed once every model answers with its K.
            settle = time.monotonic() + 60
            last: dict[str, int | None] = {}
            conn = tcp.connection(timeout=60)
            for model in MODELS:
                while True:
                    last[model] = soak.ask(conn, model, np.zeros((1, WIDTH), np.float32), True)
                    if last[model] == soak.written or time.monotonic() > settle:
                        break
                    time.sleep(0.2)
                if last[model] != soak.written:
                    soak.fail(f"{model}: answers K {last[model]} after the load, not the last written {soak.written}")
            conn.close()
            alive = proc.poll() is None
        finally:
            stop_process(proc)
        log_text = log_path.read_text(errors="replace")

    reloads = {m: log_text.count(f"model {m}: ready (versions") - (0 if args.on_demand else 1) for m in MODELS}
    errors = [line for line in log_text.splitlines() if "level=error" in line or "Traceback" in line]
    if not alive:
        soak.fail("the daemon exited")
    total = sum(soak.answered.values())
    print(f"# {machine()}")
    print(f"# {args.seconds:.0f} s, {args.clients} clients, a rewrite every {args.rewrite_secs} s "
          f"({soak.written - 1} in all), workers {args.workers}, on-demand {args.on_demand}, {args.event_loop}")
    for model in MODELS:
        print(f"{model:16s} {soak.answered[model]:8d} answered, {reloads[model]:4d} loads after the first")
    print(f"{'all':16s} {total:8d} answered, {sum(soak.failures.values())} failed, "
          f"{len(errors)} error lines in the daemon's log")
    for kind, count in soak.failures.most_common(20):
        print(f"FAILED {count} x {kind}")
    for line in errors[:10]:
        print(f"LOG {line}")
    return 1 if soak.failures or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
