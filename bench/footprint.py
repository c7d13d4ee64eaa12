"""Idle footprint of the daemon: RSS, PSS and start -> `/v2/health/ready`, median of several runs.

    python bench/footprint.py [--runs N] [--python PY] [--binary dist/edged/edged] [--triton EXE]

Measured for the daemon started from the source tree (`PY -m daemon serve`, PY defaulting to
the interpreter running this script) and, when `dist/edged/edged` (or --binary) exists, for the
frozen onedir executable, each with an empty model repository and with the bundled demo
repository (no --model-repository flag; its state directory is kept between runs, so the demo
models are written once by an unmeasured warm-up start). With --triton (or when
`nvidia-pytriton` is importable) real Triton serves an empty repository side by side.

Start -> ready: from just before the process is spawned until `GET /v2/health/ready` answers
200 (polled every 5 ms). RSS (VmRSS) and PSS (`/proc/<pid>/smaps_rollup`) are read after the
process has been idle for --settle seconds, summed over the process and its children (Triton's
Python backend runs stubs in child processes; edged runs everything in one); PSS shares pages
with other processes mapping the same files (other Python processes of the same venv), so it
drops when the machine runs more of them. With the demo repository, one JSON inference on
`simple` is then timed (the first request: what lazily imported or probed code costs it).
Runs are taken round-robin across the configurations so a shared machine's load drifts over
all of them.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT, Endpoint, http_status, machine, stop_process

READY_TIMEOUT_S = 120.0
POLL_S = 0.005


@dataclass
class Sample:
    start_s: float
    rss_kib: int
    pss_kib: int
    # The first inference after the memory reading (demo repository only).
    first_infer_s: float | None = None


@dataclass
class Target:
    """One configuration to measure: how to start it and where it answers."""

    label: str
    # (workdir) -> (argv, endpoint); the workdir is fresh per run, `state` is kept across runs.
    command: Callable[[Path], tuple[list[str], Endpoint]]
    env: dict[str, str] = field(default_factory=dict)
    warmup: bool = False
    # Model to send one inference to after the idle reading (the demo's `simple`).
    infer_model: str | None = None
    samples: list[Sample] = field(default_factory=list)
    failure: str = ""


# --------------------------------------------------------------------------- /proc


def _status_kib(pid: int, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _pss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def _tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc/<pid>/task/*/children)."""
    found = [pid]
    for current in found:
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError):
                found.extend(int(c) for c in (task / "children").read_text().split())
    return found


# --------------------------------------------------------------------------- one run


def run_once(target: Target, workdir: Path, settle: float) -> Sample:
    argv, endpoint = target.command(workdir)
    env = {**os.environ, **target.env}
    begin = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = begin + READY_TIMEOUT_S
        while http_status(endpoint, "GET", "/v2/health/ready", timeout=2) != 200:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"exited with {proc.returncode} before ready: {err[-600:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready within {READY_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        elapsed = time.monotonic() - begin
        time.sleep(settle)
        pids = _tree(proc.pid)
        sample = Sample(
            elapsed,
            sum(_status_kib(p, "VmRSS") for p in pids),
            sum(_pss_kib(p) for p in pids),
        )
        if target.infer_model:
            sample.first_infer_s = first_infer(endpoint, target.infer_model)
        return sample
    finally:
        stop_process(proc)
        if proc.stderr:
            proc.stderr.close()


# The demo's `simple` model: INPUT0 + INPUT1 and INPUT0 - INPUT1, INT32 [1, 16].
SIMPLE_INFER = json.dumps({"inputs": [
    {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
    {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
]}).encode()


def first_infer(endpoint: Endpoint, model: str) -> float:
    """Seconds for one JSON inference on a fresh connection, checked for status 200."""
    conn = endpoint.connection(timeout=60)
    try:
        begin = time.monotonic()
        conn.request("POST", f"/v2/models/{model}/infer", SIMPLE_INFER, {"Content-Type": "application/json"})
        response = conn.getresponse()
        body = response.read()
        elapsed = time.monotonic() - begin
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"first inference on {model!r} answered {response.status}: {body[:300]!r}")
    return elapsed


# --------------------------------------------------------------------------- targets


def edged_target(label: str, exe: Sequence[str], state: Path, empty_repo: Path | None) -> Target:
    def command(workdir: Path) -> tuple[list[str], Endpoint]:
        sock = workdir / "edged.sock"
        argv = [*exe, "serve", "--socket", str(sock), "--state-dir", str(state), "--log-level", "warning"]
        if empty_repo is not None:
            argv += ["--model-repository", str(empty_repo)]
        return argv, Endpoint(unix=str(sock))

    # The demo repository is written on the first start: keep that out of the figures.
    demo = empty_repo is None
    return Target(label, command, warmup=demo, infer_model="simple" if demo else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_triton(explicit: str | None) -> tuple[Path, dict[str, str]] | None:
    """tritonserver and the env it needs, from --triton or the nvidia-pytriton wheel."""
    if explicit:
        exe = Path(explicit)
    else:
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            return None
        exe = Path(next(iter(spec.submodule_search_locations))) / "tritonserver" / "bin" / "tritonserver"
    if not exe.is_file():
        return None
    # The wheel's layout: pytriton/tritonserver/bin/tritonserver, its shared libraries in
    # pytriton/tritonserver/lib and nvidia_pytriton.libs beside the package.
    server = exe.parent.parent
    paths = [str(server.parent.parent / "nvidia_pytriton.libs"), str(server / "lib")]
    old = os.environ.get("LD_LIBRARY_PATH", "")
    return exe, {"LD_LIBRARY_PATH": ":".join([*paths, old] if old else paths)}


def triton_target(exe: Path, env: dict[str, str], empty_repo: Path) -> Target:
    def command(workdir: Path) -> tuple[list[str], Endpoint]:
        port = _free_port()
        argv = [
            str(exe), "--model-repository", str(empty_repo), "--http-port", str(port),
            "--allow-grpc", "false", "--allow-metrics", "false", "--log-verbose", "0",
        ]
        return argv, Endpoint(port=port)

    return Target("triton 2.x, empty repository", command, env=env)


# --------------------------------------------------------------------------- report


def report(targets: Sequence[Target], runs: int) -> None:
    print(f"\n{machine()}; load average {os.getloadavg()[0]:.1f}; median of {runs} runs")
    print(f"{'':44} {'RSS MiB':>8} {'PSS MiB':>8} {'first infer ms':>15} {'start->ready s':>15}")
    for target in targets:
        if target.failure:
            print(f"{target.label:44} failed: {target.failure}")
            continue
        if not target.samples:
            continue
        rss = statistics.median(s.rss_kib for s in target.samples) / 1024
        pss = statistics.median(s.pss_kib for s in target.samples) / 1024
        start = statistics.median(s.start_s for s in target.samples)
        spread = f"({min(s.start_s for s in target.samples):.3f}-{max(s.start_s for s in target.samples):.3f})"
        firsts = [s.first_infer_s for s in target.samples if s.first_infer_s is not None]
        first = f"{1000 * statistics.median(firsts):15.1f}" if firsts else f"{'-':>15}"
        print(f"{target.label:44} {rss:8.1f} {pss:8.1f} {first} {start:8.3f} {spread}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="measured starts per configuration")
    parser.add_argument("--settle", type=float, default=1.0, help="idle seconds before reading memory")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the source tree")
    parser.add_argument("--binary", default=str(ROOT / "dist" / "edged" / "edged"))
    parser.add_argument("--triton", help="tritonserver executable (default: from nvidia-pytriton)")
    parser.add_argument("--no-demo", action="store_true", help="only the empty repository")
    args = parser.parse_args()

    # Byte-compile the source tree first, as `pip install` does for an installed daemon: with
    # PYTHONDONTWRITEBYTECODE set (common in CI and dev shells) every start would otherwise
    # compile the daemon's modules from source (measured: +0.14 s of start->ready).
    for tree in ("daemon", "backends"):
        compileall.compile_dir(str(ROOT / tree), quiet=1)
    with tempfile.TemporaryDirectory(prefix="edged-footprint.", dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        empty = tmp / "empty-repository"
        empty.mkdir()
        source = [args.python, "-m", "daemon"]
        targets = [edged_target("edged source, empty repository", source, tmp / "s-empty", empty)]
        if not args.no_demo:
            targets.append(edged_target("edged source, demo repository", source, tmp / "s-demo", None))
        binary = Path(args.binary)
        if binary.is_file() and os.access(binary, os.X_OK):
            targets.append(edged_target("edged frozen, empty repository", [str(binary)], tmp / "f-empty", empty))
            if not args.no_demo:
                targets.append(edged_target("edged frozen, demo repository", [str(binary)], tmp / "f-demo", None))
        else:
            print(f"frozen binary: skipped, {binary} does not exist (bash packaging/build.sh builds it)")
        triton = find_triton(args.triton)
        if triton is None:
            print("triton: skipped, no tritonserver (install nvidia-pytriton or pass --triton)")
        else:
            targets.append(triton_target(triton[0], triton[1], empty))

        for i, target in enumerate(targets):
            if target.warmup:
                work = tmp / f"warm{i}"
                work.mkdir()
                try:
                    run_once(target, work, 0)
                except RuntimeError as exc:
                    target.failure = str(exc)
        for run in range(args.runs):
            for i, target in enumerate(targets):
                if target.failure:
                    continue
                work = tmp / f"run{run}-{i}"
                work.mkdir()
                try:
                    target.samples.append(run_once(target, work, args.settle))
                except RuntimeError as exc:
                    target.failure = str(exc)
                shutil.rmtree(work, ignore_errors=True)
        report(targets, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
