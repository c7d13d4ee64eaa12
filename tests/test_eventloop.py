"""daemon.eventloop: the loop `server.event-loop` names is the one the daemon and its HTTP
workers run on, and one that cannot be had is an error naming the setting."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import uvloop

from daemon import eventloop
from daemon.errors import EdgedError
from support import DaemonProcess, UnixHTTPConnection, child_pids


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
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, kind: str
) -> None:
    (tmp_path / "repo").mkdir()
    daemon = start_daemon("--model-repository", str(tmp_path / "repo"), "--workers", "1", "--event-loop", kind)
    expected = f"uvloop {uvloop.__version__}" if kind == "uvloop" else "asyncio"
    assert f"event loop: {expected}" in daemon.log()
    (worker,) = child_pids(daemon.proc.pid)
    kept = UnixHTTPConnection(daemon.socket)
    second = UnixHTTPConnection(daemon.socket)
    try:
        for connection in (kept, second):  # the daemon keeps the first; a worker answers the second itself
            connection.request("GET", "/v2/health/live")
            response = connection.getresponse()
            response.read()
            assert response.status == 200
    finally:
        kept.close()
        second.close()
    # Seen from outside, now that the worker's loop runs: uvloop's extension is mapped into it or not.
    assert ("uvloop/loop." in Path(f"/proc/{worker}/maps").read_text()) == (kind == "uvloop")
