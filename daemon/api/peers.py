"""Who is on the other end of a connection: a Unix socket caller (and its uid) or TCP.

Shared by the front (daemon.api.front), the access middleware (daemon.api.access) and the
shared-memory rules (daemon.api.shm); imports nothing of aiohttp.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any


def unix_socket(transport: asyncio.BaseTransport | None) -> Any:
    """The connection's socket when the caller came over the Unix socket; None for TCP."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock if sock is not None and sock.family == socket.AF_UNIX else None


def peer_uid(sock: Any) -> int:
    """The Unix socket caller's uid (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def uid_allowed(uid: int, allowed: frozenset[int]) -> bool:
    """`server.allowed-uids`: root is always allowed."""
    return uid == 0 or uid in allowed
