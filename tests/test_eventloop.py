"""daemon.eventloop: the loop `server.event-loop` names is the one the daemon and its HTTP
workers run on, and one that cannot be had is an error naming the setting."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from daemon import eventloop
from daemon.errors import EdgedError
from support import raw_request


async def _running() -> tuple[asyncio.AbstractEventLoop, str]:
    loop = asyncio.get_running_loop()
    return loop, eventloop.describe(loop)


def test_asyncio_runs_the_standard_librarys_loop() -> None:
    loop, name = eventloop.run(_running(), "asyncio")
    assert type(loop).__module__.startswith("asyncio.") and name == "asyncio"
    assert loop.is_closed()  # as asyncio.run leaves it


def test_uvloop_runs_uvloops_loop() -> None:
    loop, name = eventloop.run(_running(), "uvloop")
    assert isinstance(loop, uvloop.Loop) and name == f"uvloop {uvloop.__version__}"
    assert loop.is_closed()


def test_uvloop_that_cannot_be_imported_is_an_error_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what `import uvloop` finds without it
    main = _running()
    with pytest.raises(EdgedError, match=r'server\.event-loop = "uvloop", but uvloop cannot be imported.*"asyncio"'):
        eventloop.run(main, "uvloop")
    assert main.cr_frame is None  # closed, never left to warn that it was not awaited


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_the_daemon_and_its_worker_run_on_the_configured_loop(
    start_daemon: Callable[..., object], tmp_path: Path, kind: str
) -> None:
    (tmp_path / "repo").mkdir()
    daemon = start_daemon("--model-repository", str(tmp_path / "repo"), "--workers", "1", "--event-loop", kind)
    expected = f"uvloop {uvloop.__version__}" if kind == "uvloop" else "asyncio"
    assert f"event loop: {expected}" in daemon.log()  # type: ignore[attr-defined]
    (worker,) = _children(daemon.proc.pid)  # type: ignore[attr-defined]
    with _connect(daemon) as kept, _connect(daemon) as second:
        _live(kept)  # the daemon's own
        _live(second)  # a worker answers this itself: its loop runs
    # Seen from outside: uvloop's extension is mapped into the worker or not.
    assert ("uvloop/loop." in Path(f"/proc/{worker}/maps").read_text()) == (kind == "uvloop")


def _connect(daemon: Any) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(str(daemon.socket))
    return sock


def _live(sock: socket.socket) -> None:
    sock.sendall(raw_request("GET", "/v2/health/live"))
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return sorted(int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split())
