"""Sequence batching, `oldest` vs `direct`: throughput with 64 concurrent sequences.

    .venv/bin/python bench/sequence.py [--clients 64] [--steps 8] [--duration 6] [--rounds 2]
        [--width 256] [--max-batch 8] [--instances 1] [--delay-us 2000]

One daemon serves two copies of the same stateful model (a recurrent cell kept in *implicit
state*: H = tanh(H @ U + x), see tests/sequence_models.py), identical but for the strategy:

- `seq_direct`: `direct {}`: each instance has max_batch_size slots, a sequence keeps its
  batch row for life, idle rows are padded; sequences beyond the slots wait in the backlog.
- `seq_oldest`: `oldest { max_candidate_sequences: <clients> max_queue_delay_microseconds: N }`:
  every sequence gets a candidate slot and each batch takes the oldest ready request of up to
  max_batch_size sequences.

`--clients` closed-loop clients (one keep-alive connection each, over the Unix socket, binary
tensor extension) each run sequences of `--steps` requests back to back (START on the first,
END on the last) for `--duration` seconds per mode, split into `--rounds` alternations; a
client finishes its current sequence when time is up, so no sequence outlives its round.
Every output is compared with numpy (`rnn_cell_reference`), so a request that ran with the
wrong state, or a response that went to the wrong client, fails the run.

Prints the throughput of both modes and the ratio oldest / direct, and rows per execution
from the daemon's statistics. ~20 s with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from common import executions, machine, running_daemon  # noqa: E402
from sequence_models import rnn_cell_config, rnn_cell_onnx, rnn_cell_reference  # noqa: E402

MODES = (("direct", "seq_direct"), ("oldest", "seq_oldest"))


def _request(model: str, x: np.ndarray, corrid: int, start: bool, end: bool) -> bytes:
    raw = np.ascontiguousarray(x.reshape(1, -1), dtype="<f4").tobytes()
    header = json.dumps({
        "inputs": [{"name": "INPUT", "shape": [1, x.size], "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)}}],
        "parameters": {"sequence_id": corrid, "sequence_start": start, "sequence_end": end,
                       "binary_data_output": True},
    }).encode()
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: localhost\r\n"
            f"Content-Length: {len(header) + len(raw)}\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n\r\n")
    return head.encode() + header + raw


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def _output(headers: dict[str, str], body: bytes) -> np.ndarray:
    length = int(headers["inference-header-content-length"])
    header = json.loads(body[:length])
    shape = header["outputs"][0]["shape"]
    return np.frombuffer(body, dtype="<f4", offset=length, count=int(np.prod(shape))).reshape(shape)


@dataclass
class ModeResult:
    requests: int = 0
    seconds: float = 0.0


async def _client(sock: str, model: str, index: int, steps: int, width: int, u: np.ndarray,
                  deadline: float, first_id: int) -> int:
    reader, writer = await asyncio.open_unix_connection(sock)
    rng = np.random.default_rng(index)
    done = 0
    sequence = 0
    try:
        while time.monotonic() < deadline:
            corrid = first_id + index * 100_000 + sequence
            sequence += 1
            xs = rng.standard_normal((steps, width)).astype(np.float32)
            expected = rnn_cell_reference(xs, u)
            for step in range(steps):
                writer.write(_request(model, xs[step], corrid, step == 0, step == steps - 1))
                status, headers, body = await _response(reader)
                if status != 200:
                    raise SystemExit(f"{model}: HTTP {status}: {body[:300]!r}")
                got = _output(headers, body)[0]
                if not np.allclose(got, expected[step], rtol=1e-4, atol=1e-5):
                    raise SystemExit(f"{model}: sequence {corrid} step {step}: wrong output")
                done += 1
    finally:
        writer.close()
    return done


async def _run_mode(sock: str, model: str, args: argparse.Namespace, u: np.ndarray, seconds: float,
                    first_id: int) -> ModeResult:
    started = time.monotonic()
    deadline = started + seconds
    counts = await asyncio.gather(*(
        _client(sock, model, i, args.steps, args.width, u, deadline, first_id) for i in range(args.clients)
    ))
    return ModeResult(sum(counts), time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--delay-us", type=int, default=2000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="edged-seq-bench-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        strategies = {
            "seq_direct": "direct { }",
            "seq_oldest": (f"oldest {{ max_candidate_sequences: {args.clients} "
                           f"max_queue_delay_microseconds: {args.delay_us} }}"),
        }
        u = np.zeros(0)
        for name, strategy in strategies.items():
            u = rnn_cell_onnx(repo / name / "1" / "model.onnx", args.width, seed=3)
            (repo / name / "config.pbtxt").write_text(rnn_cell_config(
                name, args.width, strategy, max_batch_size=args.max_batch, instances=args.instances))
        with running_daemon(tmp, repo) as endpoint:
            assert endpoint.unix is not None
            totals = {model: ModeResult() for _, model in MODES}
            before = {model: executions(endpoint, model) for _, model in MODES}
            slice_s = args.duration / args.rounds
            first_id = 1
            for _ in range(args.rounds):
                for _, model in MODES:
                    result = asyncio.run(_run_mode(endpoint.unix, model, args, u, slice_s, first_id))
                    first_id += 10_000_000
                    totals[model].requests += result.requests
                    totals[model].seconds += result.seconds
            after = {model: executions(endpoint, model) for _, model in MODES}

    print(f"machine: {machine()}")
    print(f"{args.clients} concurrent sequences of {args.steps} steps, width {args.width}, "
          f"max_batch_size {args.max_batch}, {args.instances} instance(s), "
          f"{args.duration:.0f} s per mode in {args.rounds} rounds")
    rates = {}
    for label, model in MODES:
        total = totals[model]
        rates[label] = total.requests / total.seconds
        runs = after[model].executions - before[model].executions
        rows = after[model].rows - before[model].rows
        print(f"  {label:7s} {rates[label]:8.0f} req/s  ({total.requests} requests; "
              f"{rows / max(1, runs):.1f} requests per execution)")
    print(f"oldest / direct throughput: {rates['oldest'] / rates['direct']:.2f}x")


if __name__ == "__main__":
    main()
