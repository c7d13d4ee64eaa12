"""sd_notify, watchdog and socket activation against real sockets and a real child process."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.errors import ConfigError
from daemon.ops.systemd import Notifier, listen_fds, watchdog_interval, watchdog_loop

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def notify_listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()


def _recv(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_notify_messages_reach_the_socket(notify_listener: tuple[socket.socket, str]) -> None:
    sock, path = notify_listener
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled

    assert notifier.ready("serving 2 models")
    assert _recv(sock) == ["READY=1", "STATUS=serving 2 models"]

    assert notifier.status("loading resnet\nstep 2")
    assert _recv(sock) == ["STATUS=loading resnet step 2"]

    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    reloading, stamp = _recv(sock)
    assert reloading == "RELOADING=1"
    key, value = stamp.split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after

    assert notifier.watchdog()
    assert _recv(sock) == ["WATCHDOG=1"]
    assert notifier.extend_timeout(90.5)
    assert _recv(sock) == ["EXTEND_TIMEOUT_USEC=90500000"]
    assert notifier.stopping()
    assert _recv(sock) == ["STOPPING=1"]
    notifier.close()


def test_abstract_notify_socket() -> None:
    name = f"edged-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready()
        assert _recv(sock) == ["READY=1"]
    finally:
        sock.close()


def test_notifier_is_a_noop_without_notify_socket() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert not notifier.ready("x")
    assert not notifier.watchdog()


def test_notifier_reads_environment_once(
    notify_listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = notify_listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    notifier = Notifier()
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notifier.stopping()
    assert _recv(sock) == ["STOPPING=1"]


def test_send_failure_is_reported_not_raised(tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert notifier.enabled
    assert not notifier.ready()


def test_full_notify_queue_does_not_block_forever(
    notify_listener: tuple[socket.socket, str],
) -> None:
    # A receiver that never reads (a stuck PID 1): sends must fail after a bounded wait instead
    # of freezing the event loop they run on.
    _, path = notify_listener
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.watchdog()
    for _ in range(100_000):
        if not notifier.watchdog():
            break
    else:
        pytest.fail("the receive queue never filled up")


def test_watchdog_interval() -> None:
    me = str(os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": me}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "5000", "WATCHDOG_PID": me}) == 0.0025
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


async def test_watchdog_loop_pings_from_the_event_loop(
    notify_listener: tuple[socket.socket, str],
) -> None:
    sock, path = notify_listener
    sock.setblocking(False)
    notifier = Notifier({"NOTIFY_SOCKET": path})
    task = asyncio.create_task(watchdog_loop(notifier, 0.05))
    # Three pings keep coming while the loop runs: received as they come, not counted after a
    # sleep (a stalled machine can fire two 50 ms timers in the same loop pass).
    loop = asyncio.get_running_loop()
    pings = []
    async with asyncio.timeout(10):
        while len(pings) < 3:
            pings.append(await loop.sock_recv(sock, 64))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    while True:
        try:
            pings.append(sock.recv(64))
        except BlockingIOError:
            break
    assert set(pings) == {b"WATCHDOG=1"}

    # A blocked loop sends nothing: that is what lets systemd notice a hang.
    task = asyncio.create_task(watchdog_loop(notifier, 0.01))
    await asyncio.sleep(0)  # first ping
    time.sleep(0.2)  # noqa: ASYNC251 -- the point: the loop is stuck
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pings = []
    while True:
        try:
            pings.append(sock.recv(64))
        except BlockingIOError:
            break
    assert pings == [b"WATCHDOG=1"]


def test_listen_fds_ignores_other_pid() -> None:
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b"}
    assert listen_fds(env) == []
    assert env == {}  # unset so children do not inherit them


def test_listen_fds_nothing_passed() -> None:
    assert listen_fds({}) == []


def test_listen_fds_rejects_garbage() -> None:
    with pytest.raises(ConfigError, match="LISTEN_FDS='two'"):
        listen_fds({"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "two"})


# The child plays the daemon: LISTEN_PID can only be known after fork, so it sets it itself
# (as systemd does between fork and exec), then calls listen_fds() and serves one line per socket.
_CHILD = """
import json, os, socket, sys
os.environ["LISTEN_PID"] = str(os.getpid())
from daemon.ops.systemd import listen_fds
pairs = listen_fds()
report = {
    "names": [name for _, name in pairs],
    "fds": [s.fileno() for s, _ in pairs],
    "families": [int(s.family) for s, _ in pairs],
    "types": [int(s.type) for s, _ in pairs],
    "inheritable": [os.get_inheritable(s.fileno()) for s, _ in pairs],
    "env_left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
}
print(json.dumps(report), flush=True)
for sock, name in pairs:
    conn, _ = sock.accept()
    conn.sendall(name.encode() + b":" + conn.recv(64))
    conn.close()
"""


def _dup_high(fd: int) -> int:
    # Park the descriptors above 3/4 so dup2 onto 3 and 4 cannot clobber one another.
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)


def test_listen_fds_in_a_child_like_systemd(tmp_path: Path) -> None:
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_path = str(tmp_path / "api.sock")
    unix.bind(unix_path)
    unix.listen()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    port = tcp.getsockname()[1]
    high_unix, high_tcp = _dup_high(unix.fileno()), _dup_high(tcp.fileno())

    def place_fds() -> None:
        os.dup2(high_unix, 3)  # dup2 leaves the copy inheritable, like systemd's fds
        os.dup2(high_tcp, 4)

    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    env.update(LISTEN_FDS="2", LISTEN_FDNAMES="api:http", PYTHONPATH=str(REPO_ROOT))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        pass_fds=(3, 4),
        preexec_fn=place_fds,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, child.stderr.read() if child.stderr else ""
        report = json.loads(line)
        assert report["names"] == ["api", "http"]
        assert report["fds"] == [3, 4]
        assert report["families"] == [int(socket.AF_UNIX), int(socket.AF_INET)]
        assert report["types"] == [int(socket.SOCK_STREAM)] * 2
        assert report["inheritable"] == [False, False]
        assert report["env_left"] == []

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(10)
            client.connect(unix_path)
            client.sendall(b"ping-unix")
            assert client.recv(64) == b"api:ping-unix"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(b"ping-tcp")
            assert client.recv(64) == b"http:ping-tcp"
        assert child.wait(timeout=10) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for fd in (high_unix, high_tcp):
            os.close(fd)
        unix.close()
        tcp.close()
