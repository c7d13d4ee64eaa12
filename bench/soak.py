"""Hot reloads under load: does any request fail, or answer from an older model than it should?

    .venv/bin/python bench/soak.py [--seconds 60] [--clients 12] [--rewrite-secs 1]
                                   [--workers N] [--on-demand] [--versions | --updates]
                                   [--event-loop asyncio|uvloop] [--log PATH]

Three models compute y = x + K: a python model without batching, a python model and an ONNX
Runtime model with dynamic batching. The daemon (this checkout) polls the repository every
0.3 s; every `--rewrite-secs` each model's file is replaced (write, then rename, as a deploy
tool does) with K one higher, so the daemon loads a new copy and swaps it in while requests run.
`--clients` threads send infer requests back to back on keep-alive connections (every fourth
over the Unix socket, the others over TCP; binary and JSON tensors alternately), each one model;
of each client's requests one in four has a gzip-compressed body and asks for a compressed
answer, one in four a chunked body.
`--versions` adds a version directory K instead (renamed in whole; the default version policy
serves the latest) and deletes the one before last. `--updates` posts each K as a signed update
bundle to `/v1/updates` instead (the daemon switches releases), one in five tampered with after
signing, which must be refused (400), and another one in five broken (a model that cannot
load, the last the check reaches), which must fail its health check (422): nothing of either
may be served. `--on-demand` makes every
model on-demand with `keep_alive` 0 (loaded by the request that needs it, unloaded when the
last one ends); `--workers` hands connections to HTTP workers.

Every answer is checked: status 200, the id of its own request, y - x one K for the whole
tensor (x has a random base per request), K no lower than any K this client saw before from
that model (a swap never goes back) and no higher than the last one written; and after the
load the last K is what each model answers. Printed: requests per model, reloads the daemon
logged, failures by kind. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import http.client
import json
import os
import random
import shutil
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
    log_errors,
    machine,
    print_failures,
    stop_process,
    wait_until_ready,
)

MODELS = ("python", "python_batched", "onnx_batched")
# Broken in a broken bundle (--updates): the last model the health check reaches (it goes by
# name), so that the others were loaded and checked before it fails.
BROKEN = "python_batched"
# How each client frames its requests, in turn.
FRAMINGS = ("plain", "gzip", "plain", "chunked")
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


def write_models(repo: Path, k: int, on_demand: bool, versions: bool = False) -> None:
    """K into each model: its version 1 rewritten in place, or with `versions` a new version
    directory K (the default policy serves the latest), the one before last deleted."""
    for name in MODELS:
        if not (repo / name / "config.pbtxt").exists():
            backend = "onnxruntime" if name.startswith("onnx") else "python"
            (repo / name).mkdir(parents=True)
            (repo / name / "config.pbtxt").write_text(_config(backend, "batched" in name, on_demand))
        version = repo / name / str(k if versions else 1)
        if versions:
            # Written aside and renamed in: the poller never sees a version without its file.
            staging = repo / name / f".{k}"
            staging.mkdir()
            _write_model(name, staging, k)
            os.replace(staging, version)
            shutil.rmtree(repo / name / str(k - 2), ignore_errors=True)
        else:
            version.mkdir(exist_ok=True)
            _write_model(name, version, k)


def _write_model(name: str, version: Path, k: int) -> None:
    if name.startswith("onnx"):
        _replace(version / "model.onnx", _onnx_add(k))
    else:
        _replace(version / "model.py", PYTHON_MODEL.format(k=k).encode())


def _request(x: np.ndarray, binary: bool, ident: str) -> tuple[bytes, dict[str, str]]:
    tensor: dict[str, object] = {"name": "x", "shape": list(x.shape), "datatype": "FP32"}
    if not binary:
        tensor["data"] = x.ravel().tolist()
        return json.dumps({"id": ident, "inputs": [tensor]}).encode(), {"Content-Type": "application/json"}
    raw = x.astype("<f4").tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = json.dumps({"id": ident, "inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
    return header + raw, {
        "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header)),
    }


def _output(response: http.client.HTTPResponse, body: bytes) -> tuple[str, np.ndarray]:
    """The answer's id and output."""
    length = response.getheader("Inference-Header-Content-Length")
    header = json.loads(body if length is None else body[: int(length)])
    if length is None:
        return header.get("id", ""), np.asarray(header["outputs"][0]["data"], np.float32)
    return header.get("id", ""), np.frombuffer(body, "<f4", offset=int(length))


class Soak:
    def __init__(self, tcp: Endpoint, unix: Endpoint) -> None:
        self.tcp, self.unix = tcp, unix
        self.written = 1  # the last K written; read by clients, raised by the rewriter
        self.failed: set[int] = set()  # Ks written only in refused bundles (--updates)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.answered: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self.first_failed: dict[str, str] = {}
        self.sent = 0

    def fail(self, kind: str) -> None:
        with self.lock:
            if not self.failures[kind]:
                self.first_failed[kind] = time.strftime("%H:%M:%S")
            self.failures[kind] += 1

    def ask(
        self, conn: http.client.HTTPConnection, model: str, x: np.ndarray, binary: bool, framing: str = "plain"
    ) -> int | None:
        """K of one answer, or None (the failure counted). `framing`: "plain", "gzip" (the body
        compressed, a compressed answer asked for) or "chunked" (the body in chunks)."""
        self.sent += 1
        ident = f"{threading.get_ident()}-{self.sent}"  # each answer must echo its request's
        body, headers = _request(x, binary, ident)
        path = f"/v2/models/{model}/infer"
        if framing == "gzip":
            headers |= {"Content-Encoding": "gzip", "Accept-Encoding": "gzip"}
            conn.request("POST", path, gzip.compress(body), headers)
        elif framing == "chunked":
            half = len(body) // 2
            conn.request("POST", path, iter((body[:half], body[half:])), headers, encode_chunked=True)
        else:
            conn.request("POST", path, body, headers)
        response = conn.getresponse()
        data = response.read()
        if response.getheader("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
        if response.status != 200:
            self.fail(f"{model}: {response.status} {data[:160]!r}")
            return None
        if framing == "gzip" and response.getheader("Content-Encoding") != "gzip":
            self.fail(f"{model}: a gzip answer was asked for, got Content-Encoding {response.getheader('Content-Encoding')}")
            return None
        answered, y = _output(response, data)
        if answered != ident:
            self.fail(f"{model} ({framing}): the answer to request {answered!r} came for {ident!r}")
            return None
        ks = np.unique(y - x.ravel())
        if len(ks) != 1 or ks[0] != round(float(ks[0])):
            self.fail(f"{model}: y - x is {ks.tolist()}, not one whole K")
            return None
        return int(ks[0])

    def client(self, index: int) -> None:
        model = MODELS[index % len(MODELS)]
        binary = index % 2 == 0
        endpoint = self.unix if index % 4 == 3 else self.tcp
        conn: http.client.HTTPConnection | None = None
        rng = random.Random(index)
        highest = 0
        step = 0
        while not self.stop.is_set():
            if conn is None:
                conn = endpoint.connection(timeout=60)
            # A base of its own per request: an answer holding another request's row is seen.
            x = (np.arange(WIDTH, dtype=np.float32) + rng.randrange(1 << 20)).reshape(1, WIDTH)
            step += 1
            newest = self.written  # read before sending: the answer's K may not exceed it
            framing = FRAMINGS[step % len(FRAMINGS)]
            try:
                k = self.ask(conn, model, x, binary, framing)
            except (OSError, http.client.HTTPException) as exc:
                self.fail(f"{model}: {type(exc).__name__}: {exc}")
                conn.close()
                conn = None
                continue
            if k is None:
                continue
            if k in self.failed:
                self.fail(f"{model}: K {k} answered from a bundle the daemon refused")
            elif k < highest:
                self.fail(f"{model} ({framing}): K {k} after this client saw {highest} (a swap went back)")
            elif k > max(newest, self.written):
                self.fail(f"{model} ({framing}): K {k} was never written")
            highest = max(highest, k)
            with self.lock:
                self.answered[model] += 1
        if conn is not None:
            conn.close()


class Updates:
    """Each K as a signed update bundle posted to the daemon (`--updates`)."""

    def __init__(self, tmp: Path, sock: Path, on_demand: bool) -> None:
        from daemon.updates.keys import keygen

        self.tmp, self.on_demand = tmp, on_demand
        self.unix = Endpoint(unix=str(sock))
        keys = tmp / "keys"
        keys.mkdir()
        self.key = tmp / "signing.key"
        keygen(self.key, keys / "fleet.pub")
        (tmp / "base").mkdir()
        self.config = tmp / "edged.toml"
        self.config.write_text(
            f'[models]\nrepository = ["{tmp / "base"}"]\n[updates]\nroot = "{tmp / "store"}"\nkeys = "{keys}"\n'
        )
        self.sequence = 0
        self.answers: collections.Counter[int] = collections.Counter()

    def apply(self, soak: Soak, k: int, fault: str = "") -> None:
        """Post the bundle of K; `fault` "tampered": one byte of it changed after signing, which
        the daemon must refuse (400); "broken": its last model raises on import, which fails
        the health check (422). Nothing of either may be served."""
        from daemon.updates.bundle import create_bundle

        source = self.tmp / f"bundle-{k}"
        write_models(source / "models", k, self.on_demand)
        if fault == "broken":
            code = source / "models" / BROKEN / "1" / "model.py"
            code.write_text("raise RuntimeError('a broken release')\n" + code.read_text())
        bundle = self.tmp / f"{k}.edgebundle"
        create_bundle(source, bundle, self.key, self.sequence + 1, f"1.0.{k}")
        shutil.rmtree(source)
        data = bytearray(bundle.read_bytes())
        bundle.unlink()
        if fault == "tampered":
            at = data.find(b"K = ")
            data[at + 4] = ord("9") if data[at + 4] != ord("9") else ord("8")
        conn = self.unix.connection(timeout=300)  # admin routes: over the socket
        try:
            conn.request("POST", "/v1/updates", bytes(data), {"Content-Type": "application/octet-stream"})
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        self.answers[response.status] += 1
        if fault:
            soak.failed.add(k)
            expected = 400 if fault == "tampered" else 422
            if response.status != expected:
                soak.fail(f"update {k} ({fault}): {response.status} {body[:200]!r}, not {expected}")
        elif response.status != 200:
            soak.fail(f"update {k}: {response.status} {body[:200]!r}")
        else:
            self.sequence += 1


def _without_broken(log_text: str) -> str:
    """The log less what broken bundles are expected to leave: their model's import error and
    its traceback, which ends in the error the broken model raises."""
    kept: list[str] = []
    skipping = False
    for line in log_text.splitlines():
        if "level=error" in line and f"model '{BROKEN}'" in line and "import failed" in line:
            skipping = True
        elif skipping and "a broken release" in line:
            skipping = False
        elif not skipping:
            kept.append(line)
    return "\n".join(kept)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--rewrite-secs", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--on-demand", action="store_true")
    parser.add_argument("--versions", action="store_true", help="each rewrite a new version directory")
    parser.add_argument("--updates", action="store_true", help="each rewrite a signed update bundle")
    parser.add_argument("--log", type=Path, help="keep the daemon's log (debug level) here")
    parser.add_argument("--event-loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        repo = tmp / "repo"
        port = free_port()
        sock = tmp / "edged.sock"
        log_path = tmp / "daemon.log"
        command = [
            sys.executable, "-m", "daemon", "serve", "--socket", str(sock), "--http", f"127.0.0.1:{port}",
            "--state-dir", str(tmp / "state"), "--workers", str(args.workers), "--event-loop", args.event_loop,
            "--log-level", "debug" if args.log is not None else "info",
        ]
        updates = Updates(tmp, sock, args.on_demand) if args.updates else None
        if updates is not None:
            command += ["--config", str(updates.config)]
        else:
            write_models(repo, 1, args.on_demand, args.versions)
            command += ["--model-repository", str(repo), "--model-control-mode", "poll", "--repository-poll-secs", "0.3"]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        tcp = Endpoint(port=port, pid=proc.pid)
        try:
            wait_until_ready(tcp, "/v2/health/ready", proc, what="daemon")
            soak = Soak(tcp, Endpoint(unix=str(sock)))
            if updates is not None:
                updates.apply(soak, 1)
            clients = [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(args.clients)]
            for thread in clients:
                thread.start()
            started = time.monotonic()
            while time.monotonic() - started < args.seconds:
                time.sleep(args.rewrite_secs)
                # Raised first: an on-demand load reads the files at once, before the poller.
                soak.written += 1
                if updates is None:
                    write_models(repo, soak.written, args.on_demand, args.versions)
                else:
                    # One bundle in five is tampered with, another broken: nothing of them served.
                    updates.apply(soak, soak.written, {0: "tampered", 3: "broken"}.get(soak.written % 5, ""))
            soak.stop.set()
            for thread in clients:
                thread.join(120)
            if updates is not None and soak.written in soak.failed:
                soak.written += 1  # end on a good release
                updates.apply(soak, soak.written)
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
        if args.log is not None:
            shutil.copyfile(log_path, args.log)

    reloads = {m: log_text.count(f"model {m}: ready (versions") - (0 if args.on_demand else 1) for m in MODELS}
    errors = log_errors(_without_broken(log_text) if args.updates else log_text)
    if not alive:
        soak.fail("the daemon exited")
    total = sum(soak.answered.values())
    print(f"# {machine()}")
    print(f"# {args.seconds:.0f} s, {args.clients} clients, a rewrite every {args.rewrite_secs} s "
          f"({soak.written - 1} in all{', new versions' if args.versions else ''}), workers {args.workers}, "
          f"on-demand {args.on_demand}, {args.event_loop}")
    for model in MODELS:
        print(f"{model:16s} {soak.answered[model]:8d} answered, {reloads[model]:4d} loads after the first")
    print(f"{'all':16s} {total:8d} answered, {sum(soak.failures.values())} failed, "
          f"{len(errors)} error lines in the daemon's log")
    print_failures(soak.failures, errors, soak.first_failed)
    return 1 if soak.failures or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
