"""Helpers for packaging/smoke.sh; standard library only, so any python3 can run them.

    smoke_helper.py listen SOCKET LOG      fake systemd: log each sd_notify datagram as
                                           "<unix time> <sender pid> <assignments...>"
    smoke_helper.py http SOCKET PATH [BODY-FILE]
                                           GET (or POST the file as JSON) over a Unix socket; print
                                           the body, fail on a non-2xx status (when curl is absent)
    smoke_helper.py second-connection SOCKET PATH BODY-FILE
                                           POST the file on a second connection while a first
                                           stays open (with --workers: served by a worker)
    smoke_helper.py infer-body             print the KServe v2 request for the `simple` models
    smoke_helper.py check-infer MODEL      read the infer response on stdin; check the numbers
    smoke_helper.py check-completion MAX-TOKENS
                                           read an OpenAI completion on stdin; fail unless it
                                           generated MAX-TOKENS tokens (or stopped early)
    smoke_helper.py check-backends [NAME...]
                                           read /v2/backends on stdin; fail unless every NAME is
                                           "ready" and no plugin is "broken"
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import sys
import time

# Two rows so the batch dimension is exercised; values chosen so sum and difference differ.
INPUT0 = [[i for i in range(16)], [100 * i - 7 for i in range(16)]]
INPUT1 = [[16 - i for i in range(16)], [3] * 16]


def listen(path: str, log_path: str) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    # SO_PASSCRED: the kernel attaches the sender's pid, which is what NotifyAccess=main checks.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.bind(path)
    creds_size = struct.calcsize("3i")
    with open(log_path, "a", encoding="utf-8") as log:
        while True:
            data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(creds_size))
            now = time.time()
            pid = 0
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:creds_size])[0]
            text = data.decode(errors="replace").replace("\n", " ")
            log.write(f"{now:.6f} {pid} {text}\n")
            log.flush()


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=60)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self._path)


def http_request(sock_path: str, path: str, body_file: str | None) -> int:
    conn = _UnixConnection(sock_path)
    if body_file is None:
        conn.request("GET", path)
    else:
        with open(body_file, "rb") as f:
            conn.request("POST", path, body=f.read(), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    body = response.read()
    sys.stdout.write(body.decode(errors="replace"))
    if not 200 <= response.status < 300:
        print(f"\nHTTP {response.status} for {path}", file=sys.stderr)
        return 1
    return 0


def second_connection(sock_path: str, path: str, body_file: str) -> int:
    """POST `body_file` to `path` on a second connection while a first one stays open: with
    `--workers`, the daemon serves the first itself and hands the second to a worker. Prints
    the reply's body."""
    keeper = _UnixConnection(sock_path)
    keeper.request("GET", "/v2/health/live")
    first = keeper.getresponse()
    first.read()
    if first.status != 200:
        print(f"HTTP {first.status} for /v2/health/live", file=sys.stderr)
        return 1
    try:
        return http_request(sock_path, path, body_file)
    finally:
        keeper.close()


def infer_body() -> int:
    inputs = [
        {"name": name, "shape": [2, 16], "datatype": "INT32", "data": [v for row in rows for v in row]}
        for name, rows in (("INPUT0", INPUT0), ("INPUT1", INPUT1))
    ]
    print(json.dumps({"inputs": inputs}))
    return 0


def check_infer(model: str) -> int:
    reply = json.load(sys.stdin)
    flat0 = [v for row in INPUT0 for v in row]
    flat1 = [v for row in INPUT1 for v in row]
    expected = {
        "OUTPUT0": [a + b for a, b in zip(flat0, flat1, strict=True)],
        "OUTPUT1": [a - b for a, b in zip(flat0, flat1, strict=True)],
    }
    got = {out["name"]: out for out in reply.get("outputs", [])}
    ok = True
    for name, want in expected.items():
        out = got.get(name)
        if out is None:
            print(f"{model}: output {name} missing in {reply}", file=sys.stderr)
            ok = False
        elif out["data"] != want or out["shape"] != [2, 16] or out["datatype"] != "INT32":
            print(f"{model}: {name} = {out}, want shape [2, 16] INT32 {want}", file=sys.stderr)
            ok = False
    return 0 if ok else 1


def check_completion(max_tokens: str) -> int:
    """An OpenAI completion that generated: text, and `max_tokens` tokens unless it stopped."""
    reply = json.load(sys.stdin)
    choice, usage = reply["choices"][0], reply["usage"]
    done = usage["completion_tokens"] == int(max_tokens) or choice["finish_reason"] == "stop"
    if not isinstance(choice["text"], str) or usage["completion_tokens"] < 1 or not done:
        print(f"completion: {reply}", file=sys.stderr)
        return 1
    return 0


def check_backends(required: list[str]) -> int:
    infos = {b["name"]: b for b in json.load(sys.stdin)["backends"]}
    ok = True
    for name in required:
        state = infos.get(name, {}).get("state", "absent")
        if state != "ready":
            print(f"backend {name}: {state}: {infos.get(name, {}).get('reason', '')}", file=sys.stderr)
            ok = False
    for name, info in infos.items():
        if info["state"] == "broken":
            print(f"backend {name} is broken: {info['reason']}", file=sys.stderr)
            ok = False
    summary = ", ".join(f"{n}={i['state']}" for n, i in sorted(infos.items()))
    print(f"backends: {summary}")
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    command, args = argv[0], argv[1:]
    if command == "listen" and len(args) == 2:
        return listen(*args)
    if command == "http" and len(args) in (2, 3):
        return http_request(args[0], args[1], args[2] if len(args) == 3 else None)
    if command == "second-connection" and len(args) == 3:
        return second_connection(*args)
    if command == "infer-body" and not args:
        return infer_body()
    if command == "check-infer" and len(args) == 1:
        return check_infer(args[0])
    if command == "check-completion" and len(args) == 1:
        return check_completion(args[0])
    if command == "check-backends":
        return check_backends(args)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
