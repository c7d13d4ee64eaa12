"""Start->READY=1 time of edged executables, the way systemd sees it.

    python3 packaging/startup_bench.py [--runs N] EXE [EXE...]
    e.g. python3 packaging/startup_bench.py dist/edged/edged dist/onefile/edged .venv/bin/edged

Each EXE serves the demo repository under a fake NOTIFY_SOCKET: one cold start (fresh state
directory, so the demo models are written first) then N warm starts (state kept), taken
round-robin across the EXEs so a shared machine's load drifts over all of them. Prints the
median warm time, the cold time, whether READY=1 came from the started pid (what
NotifyAccess=main requires) and each EXE's ratio to the first. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT_S = 120.0


@dataclass
class Start:
    seconds: float
    sender_is_main: bool


def start_once(exe: str, workdir: Path, state: Path) -> Start:
    notify_path = workdir / "notify.sock"
    notify_path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    listener.bind(str(notify_path))
    listener.settimeout(READY_TIMEOUT_S)
    env = {**os.environ, "NOTIFY_SOCKET": str(notify_path)}
    begin = time.monotonic()
    proc = subprocess.Popen(
        [exe, "serve", "--socket", str(workdir / "edged.sock"), "--state-dir", str(state),
         "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    creds = struct.calcsize("3i")
    try:
        while True:
            data, ancdata, _, _ = listener.recvmsg(4096, socket.CMSG_SPACE(creds))
            if b"READY=1" in data.split(b"\n"):
                elapsed = time.monotonic() - begin
                pid = next(
                    (struct.unpack("3i", d[:creds])[0] for lvl, kind, d in ancdata
                     if lvl == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS),
                    0,
                )
                return Start(elapsed, pid == proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        listener.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="warm starts per executable")
    parser.add_argument("exes", nargs="+")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="edged-bench.", dir="/tmp") as tmp:
        workdirs = [Path(tmp) / str(i) for i in range(len(args.exes))]
        for workdir in workdirs:
            workdir.mkdir()
        cold = [start_once(exe, w, w / "state") for exe, w in zip(args.exes, workdirs, strict=True)]
        warm: list[list[Start]] = [[] for _ in args.exes]
        # Round-robin, so a load change on a shared machine hits every executable alike.
        for _ in range(args.runs):
            for i, (exe, workdir) in enumerate(zip(args.exes, workdirs, strict=True)):
                warm[i].append(start_once(exe, workdir, workdir / "state"))
    rows: list[tuple[str, float, float, bool]] = []
    for exe, first, starts in zip(args.exes, cold, warm, strict=True):
        median = statistics.median(s.seconds for s in starts)
        main_pid = first.sender_is_main and all(s.sender_is_main for s in starts)
        rows.append((exe, median, first.seconds, main_pid))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    base = rows[0][1]
    print(f"{'executable':<28} {'warm median s':>13} {'cold s':>7} {'ratio':>6}  READY from started pid")
    for exe, median, cold_s, main_pid in rows:
        print(f"{exe:<28} {median:>13.2f} {cold_s:>7.2f} {median / base:>6.2f}  {'yes' if main_pid else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
