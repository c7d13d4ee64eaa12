"""daemon.logs: what aiohttp logs about a client's fault stays out of the error log."""

from __future__ import annotations

import logging

import pytest
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError, InvalidURLError

from daemon.logs import ClientFaults


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException as raised:
        return logging.getLogger("aiohttp.server").makeRecord(
            "aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s", ("127.0.0.1",),
            (type(raised), raised, raised.__traceback__),
        )


@pytest.mark.parametrize(
    "exc",
    [
        BadHttpMessage("Missing 'Host' header in request."),
        InvalidURLError("*"),
        ClientConnectionResetError("Cannot write to closing transport"),
        ConnectionResetError(104, "Connection reset by peer"),
    ],
)
def test_a_clients_fault_becomes_one_debug_line(exc: BaseException) -> None:
    record = _record(exc)
    assert ClientFaults().filter(record)
    assert record.levelno == logging.DEBUG and record.levelname == "DEBUG"
    assert record.exc_info is None
    message = record.getMessage()
    assert message.startswith(f"Error handling request from 127.0.0.1: {type(exc).__name__}: ")
    assert "\n" not in message


@pytest.mark.parametrize("exc", [RuntimeError("a bug"), HttpProcessingError(code=500, message="boom")])
def test_a_server_fault_keeps_its_level_and_traceback(exc: BaseException) -> None:
    record = _record(exc)
    assert ClientFaults().filter(record)
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None and record.exc_info[1] is exc


def test_throttled_says_how_many_lines_it_held_back(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from daemon import logs

    now = [1000.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    throttled = logs.Throttled(logging.getLogger("edged.test.throttled"), interval=60.0)
    with caplog.at_level(logging.WARNING, logger="edged.test.throttled"):
        for _ in range(5):
            throttled.warning(503, "queue full for %s", "m")
        throttled.warning(500, "model %s failed", "m")  # another kind: its own line
        now[0] += 61
        throttled.warning(503, "queue full for %s", "m")
        throttled.warning(503, "queue full for %s", "m")
    assert [r.getMessage() for r in caplog.records] == [
        "queue full for m",
        "model m failed",
        "queue full for m (4 more like it held back in the last 60 s)",
    ]
