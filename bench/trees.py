"""Two source trees of edged side by side: which one serves small infer requests faster.

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/trees.py /tmp/base . [--rounds 16] [--window 1.5] [--clients 1,8,32]

Both daemons run at once (TCP, the `simple` python model of bench/triton_http.py, binary tensor
data, or JSON with `--json`; `--model mlp`: bench/batching.py's ONNX Runtime MLP, 256 wide,
with dynamic batching, each client its own row, answers checked against numpy), and every
round measures each client count on both, in alternating order. On a shared machine a change of a few percent is smaller than the drift
between two runs of one tree; measured in pairs a minute apart it is not. Printed per client
count: the medians of each tree and the medians of the per-round ratios B / A of p50 latency,
throughput and server CPU per request (utime + stime of the daemon and its child processes,
HTTP workers included, over the measured window). `--a-flags` / `--b-flags` compare one tree
under two settings (`. . --b-flags "--workers 1"`). Run it with the same tree twice to see the noise floor of the machine at that moment.
Both trees run with this checkout's interpreter and packages.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from pathlib import Path
from statistics import median

import numpy as np
from batching import model_config
from common import (
    Endpoint,
    MlpChecker,
    Request,
    free_port,
    kserve_infer,
    machine,
    running_daemon,
    write_mlp_model,
)
from model_builders import mlp_reference
from triton_http import SimpleCheck, _measured, simple_request, write_repository


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="tree A (the baseline)")
    parser.add_argument("b", type=Path, help="tree B")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--window", type=float, default=1.5, help="measured seconds per row and round")
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--json", action="store_true", help="JSON tensors instead of binary")
    parser.add_argument("--model", choices=("simple", "mlp"), default="simple")
    parser.add_argument("--a-flags", default="", help="extra `edged serve` flags for A, space-separated")
    parser.add_argument("--b-flags", default="", help="extra `edged serve` flags for B, space-separated")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]

    rng = np.random.default_rng(0)
    a = rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
    b = rng.integers(-1000, 1000, (1, 16), dtype=np.int32)
    request = simple_request(a, b, binary=not args.json)
    print(f"# bench/trees.py: {machine()}")
    print(f"# A = {args.a.resolve()}, B = {args.b.resolve()}; {args.rounds} rounds of {args.window:g} s per row")
    rows: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edged-bench-trees-")))
        repo = tmp / "repo"
        write_repository(repo)  # bench/triton_http.py's models; only `simple` is measured
        requests: list[Request] = [request] * max(counts)
        check: object = SimpleCheck(a, b)
        if args.model == "mlp":
            weights = write_mlp_model(repo, "mlp", 256, 4, model_config("onnxruntime", 256, True, 2, 2000, [], 32))
            rows_in = [rng.standard_normal((1, 256)).astype(np.float32) for _ in range(max(counts))]
            requests = [kserve_infer("mlp", "INPUT0", row, binary=not args.json) for row in rows_in]
            check = MlpChecker([mlp_reference(row, weights) for row in rows_in])
        endpoints = {}
        for name, tree, flags in (("A", args.a, args.a_flags), ("B", args.b, args.b_flags)):
            (tmp / name).mkdir()
            port = free_port()
            unix = stack.enter_context(running_daemon(
                tmp / name, repo, ready_model=args.model, http=f"127.0.0.1:{port}", tree=tree.resolve(),
                flags=flags.split()))
            endpoints[name] = Endpoint(port=port, pid=unix.pid)
        for round_ in range(args.rounds):
            for count in counts:
                for name in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                    row = asyncio.run(_measured(endpoints[name], requests[:count], args.window, args.warmup, check))
                    rows.setdefault((name, count), []).append(
                        (row.result.p50_us, row.result.throughput, row.tree_cpu_us))
    with open("/proc/loadavg") as f:
        print(f"# load average after: {' '.join(f.read().split()[:3])}")
    for count in counts:
        ra, rb = rows[("A", count)], rows[("B", count)]
        line = [f"{count:>2} clients:"]
        for name, runs in (("A", ra), ("B", rb)):
            line.append(f"{name} p50 {median(r[0] for r in runs):5.0f} us {median(r[1] for r in runs):6.0f} req/s "
                        f"cpu {median(r[2] for r in runs):4.0f} us/req |")
        ratios = [median(y[i] / x[i] for x, y in zip(ra, rb, strict=True)) for i in range(3)]
        line.append(f"B/A p50 {ratios[0]:.3f} throughput {ratios[1]:.3f} cpu/req {ratios[2]:.3f}")
        print(" ".join(line))


if __name__ == "__main__":
    main()
