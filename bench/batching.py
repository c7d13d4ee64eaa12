"""Dynamic batching ON vs OFF: throughput and latency of an FP32 MLP under concurrent load.

    .venv/bin/python bench/batching.py [--backend onnxruntime|openvino] [--clients 32]
        [--duration 12] [--rounds 3] [--width 1024] [--depth 4] [--instances 2]
        [--delay-us 2000] [--preferred 16,32] [--json]

One daemon serves two copies of the same model (same weights):

- `mlp_batched`:   max_batch_size 32, `dynamic_batching { max_queue_delay_microseconds: N }`;
- `mlp_unbatched`: max_batch_size 0 (no batch dimension: every request runs alone),

both with the same instance count. `--clients` closed-loop clients (one keep-alive connection
each, over the Unix socket, binary tensor extension unless --json) each send a [1, width] row
for `--duration` seconds per mode, split into `--rounds` ON/OFF alternations (the machine is
shared; alternating spreads drifting background load over both modes). Every response of each
round's warm-up is compared with numpy (`mlp_reference`), so merged batches are checked to
split back to the right clients.

Prints throughput and p50/p99 of both modes and the ratio (target: >= 4x throughput with
batching), then what the daemon's own statistics (`/v2/models/{m}/stats`) say: rows per
execution, time per execution, and how busy the instances were. Instances busy well under
100% with batching ON means the limit is the per-request HTTP path, not the runtime.

Why N = 2000 us by default: with 32 clients and the instances busy, a queue of requests forms
anyway while a batch computes, so the delay rarely binds; it only caps how long a lone request
waits for company when the load is light. 0, 500 and 5000 us measured the same here within
noise. ~35 s with the defaults.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    MlpChecker,
    Workload,
    executions,
    interleaved,
    kserve_infer,
    machine,
    running_daemon,
    write_mlp_model,
)
from model_builders import mlp_reference

# (label, model name, batched)
MODES = (("dynamic batching ON", "mlp_batched", True), ("dynamic batching OFF", "mlp_unbatched", False))


def model_config(backend: str, width: int, batched: bool, instances: int, delay_us: int,
                 preferred: list[int], max_batch: int) -> str:
    dims = f"[ {width} ]" if batched else f"[ -1, {width} ]"
    text = (
        f'backend: "{backend}"\n'
        f"max_batch_size: {max_batch if batched else 0}\n"
        f'input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: {dims} }} ]\n'
        f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: {dims} }} ]\n'
        f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
    )
    if batched:
        sizes = ", ".join(str(s) for s in preferred)
        text += (
            "dynamic_batching {\n"
            + (f"  preferred_batch_size: [ {sizes} ]\n" if preferred else "")
            + f"  max_queue_delay_microseconds: {delay_us}\n}}\n"
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["onnxruntime", "openvino"], default="onnxruntime")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=12.0, help="measured seconds per mode")
    parser.add_argument("--rounds", type=int, default=3, help="ON/OFF alternations the duration is split into")
    parser.add_argument("--warmup", type=float, default=1.0,
                        help="checked, unmeasured seconds before each round")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--instances", type=int, default=2, help="instance count of both models")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--delay-us", type=int, default=2000, help="max_queue_delay_microseconds")
    parser.add_argument("--preferred", default="", help="preferred_batch_size list, e.g. 16,32")
    parser.add_argument("--json", action="store_true", help="JSON tensors instead of binary")
    args = parser.parse_args()
    preferred = [int(s) for s in args.preferred.split(",") if s]

    rng = np.random.default_rng(1)
    rows = [rng.standard_normal((1, args.width)).astype(np.float32) for _ in range(args.clients)]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        for _, name, batched in MODES:
            config = model_config(args.backend, args.width, batched, args.instances, args.delay_us,
                                  preferred, args.max_batch)
            # Same seed: both models hold the same weights.
            weights = write_mlp_model(repo, name, args.width, args.depth, config, seed=0)
        expected = [mlp_reference(row, weights) for row in rows]
        with running_daemon(tmp, repo, ready_model="mlp_batched") as endpoint:
            checks = {label: MlpChecker(expected) for label, _, _ in MODES}
            workloads = {
                label: Workload(
                    endpoint,
                    [kserve_infer(name, "INPUT0", row, binary=not args.json) for row in rows],
                    checks[label],
                )
                for label, name, _ in MODES
            }
            results = interleaved(workloads, rounds=args.rounds, duration=args.duration, warmup=args.warmup)
            summaries = {label: executions(endpoint, name) for label, name, _ in MODES}
    for label, check in checks.items():
        if check.verified == 0:
            raise SystemExit(f"{label}: no warm-up response was checked; raise --warmup")
    verified = sum(check.verified for check in checks.values())

    on, off = results["dynamic batching ON"], results["dynamic batching OFF"]
    print(f"# bench/batching.py  {datetime.date.today()}  {machine()}  "
          f"load average before/after: {load_before:.2f}/{os.getloadavg()[0]:.2f}")
    print(f"# model: FP32 MLP {args.width} wide x {args.depth} layers, backend {args.backend}, "
          f"{args.instances} instance(s); {args.clients} clients over UDS "
          f"({'JSON' if args.json else 'binary tensors'}), {args.duration:g} s each "
          f"in {args.rounds} alternating rounds")
    print(f"# ON: max_batch_size {args.max_batch}, max_queue_delay_microseconds {args.delay_us}"
          + (f", preferred_batch_size {preferred}" if preferred else "")
          + "; OFF: max_batch_size 0")
    # Wall time each model was under load (warm-ups included, as are their executions).
    loaded_seconds = args.duration + args.rounds * args.warmup
    for label, result in results.items():
        print(result.line(label))
    for label, summary in summaries.items():
        busy = summary.busy_seconds / (args.instances * loaded_seconds)
        print(f"  {label:<20}: {summary.rows_per_execution:5.1f} rows per execution, "
              f"{summary.ms_per_execution:6.2f} ms per execution, instances busy {100 * busy:3.0f}% "
              f"of the time")
    print(f"throughput ON/OFF: {on.throughput / off.throughput:5.2f}x   "
          f"p50 ON/OFF: {on.p50_us / off.p50_us:5.2f}x   p99 ON/OFF: {on.p99_us / off.p99_us:5.2f}x")
    print(f"correctness: {verified} warm-up responses matched numpy (rtol 1e-3, atol 1e-3)")


if __name__ == "__main__":
    main()
