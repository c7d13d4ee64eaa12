"""Our daemon vs Seldon MLServer: same ONNX MLP, same load, side by side.

    .venv/bin/python bench/peers.py [--clients 32] [--duration 12] [--rounds 3] [--width 1024]
        [--depth 4] [--mlserver-workers 1] [--skip-mlserver]

MLServer runs from its own virtualenv, `bench/.peers-venv` (created here with
`pip install mlserver onnxruntime numpy "uvloop<0.22"` when missing: its pins would fight the
project's; see PEERS_PACKAGES for the uvloop pin), with a 20-line custom runtime (an `MLModel` subclass calling `onnxruntime`) and adaptive batching on.
Settings written for it (and why):

- settings.json: `host` 127.0.0.1, `http_port` free port, `grpc_port` free port (gRPC cannot
  be turned off; it idles), `metrics_endpoint` null (no metrics server or middleware: ours keeps
  its /metrics, which costs nothing until scraped), `parallel_workers` from --mlserver-workers
  (default 1, MLServer's own default: one inference worker process fed over IPC, the fastest
  setting measured here; 0 runs `predict` on the server's event loop, which then blocks while
  ONNX Runtime computes; more than 1 only oversubscribes 2 cores), `debug` false, `gzip_enabled` false
  (responses are incompressible floats), `load_models_at_startup` true.
- model-settings.json: `max_batch_size` 32, `max_batch_time` 0.002 s (the same bound as our
  `max_queue_delay_microseconds: 2000`), `parameters.uri` the same model.onnx.

The ONNX Runtime session there uses ORT's defaults (intra-op threads = cores), as a user's
runtime would. Ours: `max_batch_size: 32`, `dynamic_batching { max_queue_delay_microseconds:
2000 }`, the default 2 instances (1 intra-op thread each).

Both servers are up for the whole run and the rows alternate round by round (`--rounds`), so
drifting background load on a shared machine is spread over all of them. Same closed-loop
client for all (bench/common.py: one keep-alive connection per client), each
client sending a [1, width] FP32 row; warm-up responses are checked against numpy. MLServer's
REST API takes JSON only (no binary tensor extension), so ours is measured with JSON too, which
is the like-for-like row, and with binary tensors, over the Unix socket and over TCP.

Prints throughput and p50/p99 per row, then ours/MLServer ratios (target: >= 2x throughput at
equal or better p99). Also reports whether a `perf_analyzer` binary exists here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    ROOT,
    Endpoint,
    MlpChecker,
    Workload,
    interleaved,
    kserve_infer,
    machine,
    running_daemon,
    stop_process,
    wait_until_ready,
    write_mlp_model,
)
from model_builders import mlp_reference

PEERS_VENV = ROOT / "bench" / ".peers-venv"
# uvloop 0.22+ no longer creates a loop in get_event_loop(), which MLServer 1.7.1's inference
# worker processes rely on (they die at start with "There is no current event loop").
PEERS_PACKAGES = ["mlserver", "onnxruntime", "numpy", "uvloop<0.22"]
MLSERVER = "MLServer   TCP  JSON"

RUNTIME = '''\
"""A minimal ONNX Runtime runtime for MLServer (the bench's peer)."""

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxModel(MLModel):
    async def load(self) -> bool:
        path = await get_model_uri(self._settings)
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        (y,) = self.session.run([self.output_name], {self.input_name: x})
        output = NumpyCodec.encode_output(self.output_name, y)
        return InferenceResponse(model_name=self.name, outputs=[output])
'''

OUR_CONFIG = """backend: "onnxruntime"
max_batch_size: 32
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ WIDTH ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ WIDTH ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_peers_venv() -> Path:
    """The separate venv holding MLServer; created on first use."""
    python = PEERS_VENV / "bin" / "python"
    mlserver = PEERS_VENV / "bin" / "mlserver"
    if mlserver.exists():
        return mlserver
    print(f"creating {PEERS_VENV} with {' '.join(PEERS_PACKAGES)} (once) ...", flush=True)
    # The base interpreter, not this venv's: the peer must not see the project's packages.
    base = Path(getattr(sys, "_base_executable", sys.executable))
    subprocess.run([str(base), "-m", "venv", str(PEERS_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PEERS_PACKAGES], check=True)
    return mlserver


def perf_analyzer_status() -> str:
    """Whether a perf_analyzer binary exists here (pip's `perf-analyzer` is a placeholder)."""
    found = shutil.which("perf_analyzer") or shutil.which("perf_analyzer", path=str(PEERS_VENV / "bin"))
    if found:
        return f"perf_analyzer: found at {found}"
    return ("perf_analyzer: no binary on PATH or in the peers venv (pip `perf-analyzer` 0.1.0 is a "
            "placeholder package with no executable); not used")


@contextlib.contextmanager
def running_mlserver(tmp: Path, model: Path, workers: int) -> Iterator[Endpoint]:
    mlserver = ensure_peers_venv()
    root = tmp / "mlserver"
    (root / "mlp").mkdir(parents=True)
    (root / "onnx_runtime.py").write_text(RUNTIME, encoding="utf-8")
    http_port, grpc_port = free_port(), free_port()
    settings = {
        "host": "127.0.0.1",
        "http_port": http_port,
        "grpc_port": grpc_port,
        "metrics_endpoint": None,
        "parallel_workers": workers,
        "debug": False,
        "gzip_enabled": False,
        "load_models_at_startup": True,
    }
    model_settings = {
        "name": "mlp",
        "implementation": "onnx_runtime.OnnxModel",
        "max_batch_size": 32,
        "max_batch_time": 0.002,
        "parameters": {"uri": str(model)},
    }
    (root / "settings.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    (root / "mlp" / "model-settings.json").write_text(json.dumps(model_settings, indent=2), encoding="utf-8")
    log = (tmp / "mlserver.log").open("wb")
    proc = subprocess.Popen(
        [str(mlserver), "start", str(root)],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        # Its runtime module is imported from the model folder's parent (cwd on sys.path).
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    endpoint = Endpoint(host="127.0.0.1", port=http_port)
    try:
        wait_until_ready(endpoint, "/v2/models/mlp/ready", proc, timeout=180, what="MLServer")
        yield endpoint
    except SystemExit:
        log.flush()
        print((tmp / "mlserver.log").read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        stop_process(proc)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=12.0, help="measured seconds per row")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds the duration is split into")
    parser.add_argument("--warmup", type=float, default=1.0,
                        help="checked, unmeasured seconds before each round")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--mlserver-workers", type=int, default=1,
                        help="MLServer parallel_workers (its default, 1, measured fastest here)")
    parser.add_argument("--skip-mlserver", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(1)
    rows = [rng.standard_normal((1, args.width)).astype(np.float32) for _ in range(args.clients)]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        weights = write_mlp_model(repo, "mlp", args.width, args.depth,
                                  OUR_CONFIG.replace("WIDTH", str(args.width)), seed=0)
        expected = [mlp_reference(row, weights) for row in rows]
        port = free_port()
        uds = stack.enter_context(running_daemon(tmp, repo, ready_model="mlp", http=f"127.0.0.1:{port}"))
        tcp = Endpoint(host="127.0.0.1", port=port)
        # Both servers stay up for the whole run; an idle one costs nothing, and the rows
        # alternate between them round by round.
        rows_to_run: dict[str, tuple[Endpoint, bool]] = {}
        if not args.skip_mlserver:
            theirs = stack.enter_context(
                running_mlserver(tmp, repo / "mlp" / "1" / "model.onnx", args.mlserver_workers)
            )
            rows_to_run[MLSERVER] = (theirs, False)
        rows_to_run |= {
            "edged      TCP  JSON": (tcp, False),
            "edged      UDS  JSON": (uds, False),
            "edged      TCP  binary": (tcp, True),
            "edged      UDS  binary": (uds, True),
        }
        checks = {label: MlpChecker(expected) for label in rows_to_run}
        workloads = {
            label: Workload(
                endpoint, [kserve_infer("mlp", "INPUT0", row, binary=binary) for row in rows], checks[label]
            )
            for label, (endpoint, binary) in rows_to_run.items()
        }
        results = interleaved(workloads, rounds=args.rounds, duration=args.duration, warmup=args.warmup)
    for label, check in checks.items():
        if check.verified == 0:
            raise SystemExit(f"{label}: no warm-up response was checked; raise --warmup")

    print(f"# bench/peers.py  {datetime.date.today()}  {machine()}  "
          f"load average before/after: {load_before:.2f}/{os.getloadavg()[0]:.2f}")
    print(f"# model: FP32 MLP {args.width} wide x {args.depth} layers; {args.clients} closed-loop "
          f"clients, {args.duration:g} s per row in {args.rounds} interleaved rounds; "
          f"MLServer parallel_workers {args.mlserver_workers}")
    for label, result in results.items():
        print(result.line(label))
    if not args.skip_mlserver:
        theirs_result = results[MLSERVER]
        for label, ours in results.items():
            if label.startswith("edged"):
                print(f"{label} / MLServer: throughput {ours.throughput / theirs_result.throughput:5.2f}x   "
                      f"p50 {ours.p50_us / theirs_result.p50_us:5.2f}x   "
                      f"p99 {ours.p99_us / theirs_result.p99_us:5.2f}x")
    verified = sum(check.verified for check in checks.values())
    print(f"correctness: {verified} warm-up responses matched numpy (rtol 1e-3, atol 1e-3)")
    print(perf_analyzer_status())


if __name__ == "__main__":
    main()
