"""systemd integration without libsystemd: sd_notify, the watchdog and socket activation.

The protocols are small and stable (see sd_notify(3), sd_watchdog_enabled(3),
sd_listen_fds(3)), so they are spoken directly over the socket API instead of pulling in a C
binding that the frozen (PyInstaller) build would also have to carry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Mapping, MutableMapping

from daemon.errors import ConfigError

log = logging.getLogger(__name__)

# sd_listen_fds(3): passed descriptors start right after stdin/stdout/stderr.
LISTEN_FDS_START = 3
_LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
_SEND_TIMEOUT = 0.5


def _monotonic_usec() -> int:
    # RELOADING=1 must carry CLOCK_MONOTONIC (not time.monotonic's unspecified clock) so systemd
    # can tell this reload apart from an earlier one.
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends sd_notify datagrams to the socket named by $NOTIFY_SOCKET.

    The variable is read once, at construction. Without it (not started by systemd, or a unit
    that is not Type=notify) every method is a no-op, so callers never need to check. Send
    failures are logged, never raised: a daemon that serves fine must not die because its
    supervisor went away.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = self._parse_address(env.get("NOTIFY_SOCKET", ""))
        self._sock: socket.socket | None = None

    @staticmethod
    def _parse_address(value: str) -> str | bytes | None:
        if not value:
            return None
        if value.startswith("@"):
            # Abstract namespace: a leading NUL byte instead of '@' (unix(7)).
            return b"\0" + value[1:].encode()
        if value.startswith("/"):
            return value
        # systemd 254+ also knows "vsock:CID:PORT"; nothing we are started by uses it.
        log.warning("NOTIFY_SOCKET=%r is not a unix socket path; notifications are off", value)
        return None

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *assignments: str) -> bool:
        """Send `KEY=VALUE` lines as one datagram. Returns False when nothing was sent."""
        if self._address is None:
            return False
        message = "\n".join(assignments).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                # A datagram send blocks while the receiver's queue is full. This runs on the
                # event loop, so bound the stall: a stuck PID 1 must not freeze the daemon.
                self._sock.settimeout(_SEND_TIMEOUT)
            self._sock.sendto(message, self._address)
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self._address, exc)
            return False
        return True

    @staticmethod
    def _status_line(text: str) -> str:
        # One datagram holds newline-separated assignments: a newline would end STATUS early.
        return "STATUS=" + " ".join(text.splitlines())

    def ready(self, status: str | None = None) -> bool:
        lines = ["READY=1"]
        if status is not None:
            lines.append(self._status_line(status))
        return self.send(*lines)

    def status(self, text: str) -> bool:
        return self.send(self._status_line(text))

    def reloading(self) -> bool:
        """Say a reload started; send `ready()` when it is done (what notify-reload expects)."""
        return self.send("RELOADING=1", f"MONOTONIC_USEC={_monotonic_usec()}")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more before TimeoutStartSec/TimeoutStopSec fires (a large model
        still loading, a long drain). Repeat it while the work goes on."""
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings, or None when the watchdog is off for this process.

    Half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) recommends, so one late tick is not fatal.
    $WATCHDOG_PID, when set, must name this process: a forked child must not ping for its parent.
    """
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None
    if value <= 0:
        return None
    return value / 2 / 1_000_000


async def watchdog_loop(notifier: Notifier, interval: float) -> None:
    """Ping WATCHDOG=1 every `interval` seconds until cancelled.

    It runs as a task on the daemon's event loop on purpose: if the loop is blocked or hung, the
    pings stop and systemd restarts the service (Restart=on-failure), which a pinging thread
    would hide.
    """
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)


def listen_fds(environ: MutableMapping[str, str] | None = None) -> list[tuple[socket.socket, str]]:
    """Sockets passed by systemd socket activation, each with its FileDescriptorName=.

    Returns [] when nothing was passed to this process. The LISTEN_* variables are removed
    either way so that child processes (and a second call) do not pick the descriptors up
    again; the descriptors are made close-on-exec for the same reason.
    """
    env = os.environ if environ is None else environ
    pid, count, names = (env.pop(name, "") for name in _LISTEN_VARS)
    if not pid or not count:
        return []
    try:
        if int(pid) != os.getpid():
            return []  # meant for another process (we inherited a parent's environment)
        n = int(count)
    except ValueError:
        raise ConfigError(f"invalid socket activation variables LISTEN_PID={pid!r} "
                          f"LISTEN_FDS={count!r}") from None
    if n <= 0:
        return []
    labels = names.split(":") if names else []
    if len(labels) != n:
        if labels:
            log.warning("LISTEN_FDNAMES has %d names for %d descriptors; using 'unknown'",
                        len(labels), n)
        labels = ["unknown"] * n
    result: list[tuple[socket.socket, str]] = []
    for fd, label in zip(range(LISTEN_FDS_START, LISTEN_FDS_START + n), labels, strict=True):
        os.set_inheritable(fd, False)
        try:
            # With only fileno, Python asks the kernel for family, type and protocol.
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise ConfigError(f"descriptor {fd} ({label!r}) passed by systemd is not a "
                              f"socket: {exc.strerror}") from None
        result.append((sock, label))
    return result
