"""Does this box pay for handing a call to an instance thread on another CPU?

    .venv/bin/python bench/handoff.py [--calls 4000] [--rounds 6] [--gap-us 300]

Every model call goes from the event loop to its instance's thread and back
(`Backend.run_blocking`, daemon/backend.py). This times that round trip for an empty call, one
at a time, with an idle gap after each (as one client's requests arrive), in two placements
that alternate round by round, on the daemon's event loop (`--event-loop`, uvloop by default): the threads where the kernel puts them, and both on the one CPU
the loop runs on (what a host policy naming one CPU for the loop and a python model does;
docs/operations.md, "Host policies"). Printed: the median p50 and p90 of each placement and
the median per-round ratio. On a small VM whose idle vCPUs halt (`guest_halt_poll_ns` 0), a
hand-over to the other vCPU waits for the host to wake it: measured 50-59 us against 12 us on
one CPU on a 2-vCPU AMD EPYC KVM guest (docs/performance.md). A ratio near 1 means the
placement does not matter on this box.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from statistics import median

from common import machine

from daemon import eventloop
from daemon.backend import Backend, InstanceContext


class _Empty(Backend):
    name = "handoff"


async def _round(backend: Backend, calls: int, gap_s: float) -> tuple[float, float]:
    """p50 and p90 of `calls` round trips, in microseconds."""
    samples: list[int] = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        await backend.run_blocking(int)
        samples.append(time.perf_counter_ns() - started)
        await asyncio.sleep(gap_s)
    samples.sort()
    return samples[len(samples) // 2] / 1000, samples[int(len(samples) * 0.9)] / 1000


async def _measure(calls: int, rounds: int, gap_s: float) -> dict[str, list[tuple[float, float]]]:
    everywhere = os.sched_getaffinity(0)
    backend = _Empty(InstanceContext("handoff", 1))
    instance_thread = await backend.run_blocking(threading.get_native_id)
    results: dict[str, list[tuple[float, float]]] = {"free": [], "one CPU": []}
    try:
        for round_ in range(rounds):
            order = ("free", "one CPU") if round_ % 2 == 0 else ("one CPU", "free")
            for placement in order:
                if placement == "one CPU":
                    cpu = min(everywhere)
                    os.sched_setaffinity(0, {cpu})
                    os.sched_setaffinity(instance_thread, {cpu})
                else:
                    os.sched_setaffinity(0, everywhere)
                    os.sched_setaffinity(instance_thread, everywhere)
                await backend.run_blocking(int)  # settle where the threads now run
                results[placement].append(await _round(backend, calls, gap_s))
    finally:
        os.sched_setaffinity(0, everywhere)
        await backend.unload()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=4000, help="round trips per placement and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--gap-us", type=float, default=300.0, help="idle time after each call")
    parser.add_argument("--event-loop", choices=("uvloop", "asyncio"), default="uvloop", help="as server.event-loop")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("this process may use one CPU only: there is no other CPU to hand over to")
    print(f"# bench/handoff.py: {machine()}")
    print(f"# {args.rounds} rounds of {args.calls} calls per placement, {args.gap_us:g} us idle after each, "
          f"{args.event_loop} event loop")
    results = eventloop.run(_measure(args.calls, args.rounds, args.gap_us / 1e6), args.event_loop)
    for placement, rows in results.items():
        print(f"{placement:>8}: p50 {median(r[0] for r in rows):6.1f} us   p90 {median(r[1] for r in rows):6.1f} us")
    ratios = [free[0] / one[0] for free, one in zip(results["free"], results["one CPU"], strict=True)]
    print(f"free / one CPU, p50 per round: median {median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
