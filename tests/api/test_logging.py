"""Triton's logging extension on a real daemon: `GET/POST /v2/logging` read and change what the
daemon writes to its log at run time (checked in the log itself, not in the settings only)."""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Iterator

import pytest

from support import DaemonProcess, python_model, start_daemon_process, wait_until

# Each request logs one line per severity, tagged with the request's marker.
_BODY = """\
tag = str(int(x[0]))
pb_utils.Logger.log_verbose("VERBOSE-" + tag)
pb_utils.Logger.log_info("INFO-" + tag)
pb_utils.Logger.log_warn("WARNING-" + tag)
pb_utils.Logger.log_error("ERROR-" + tag)
y = x
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    repo = tmp_path_factory.mktemp("repo")
    python_model(repo, "chatty", _BODY)
    daemon = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo))
    yield daemon
    daemon.stop()


def _post(daemon: DaemonProcess, payload: object) -> tuple[int, dict[str, object]]:
    reply = daemon.request("POST", "/v2/logging", json.dumps(payload))
    return reply.status, reply.json()


def _logged(daemon: DaemonProcess) -> set[str]:
    """Run one request and return which severities it logged (after the ERROR line shows up,
    or after a sentinel request when errors are off)."""
    tag = str(uuid.uuid4().int % 1_000_000)
    body = {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [int(tag)]}]}
    assert daemon.post_json("/v2/models/chatty/infer", body).status == 200
    # The log is written by the daemon process: the request's lines are there once it answered
    # (the handler logs synchronously before the response), but stderr may lag; wait a little.
    found: set[str] = set()

    def seen() -> bool:
        found.clear()
        for severity in ("VERBOSE", "INFO", "WARNING", "ERROR"):
            if f"{severity}-{tag}" in daemon.log():
                found.add(severity)
        return "ERROR" in found or "WARNING" in found
    with contextlib.suppress(AssertionError):
        wait_until(seen, timeout=5)
    return found


def test_defaults_match_the_daemon_config(daemon: DaemonProcess) -> None:
    reply = daemon.request("GET", "/v2/logging")
    assert reply.status == 200
    assert reply.json() == {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
                            "log_verbose_level": 0, "log_format": "default"}
    assert _logged(daemon) == {"INFO", "WARNING", "ERROR"}


def test_switches_change_what_is_logged(daemon: DaemonProcess) -> None:
    try:
        status, settings = _post(daemon, {"log_verbose_level": 1})
        assert status == 200 and settings["log_verbose_level"] == 1 and settings["log_info"] is True
        assert _logged(daemon) == {"VERBOSE", "INFO", "WARNING", "ERROR"}
        status, settings = _post(daemon, {"log_verbose_level": 0, "log_info": False, "log_error": None})
        assert status == 200 and settings["log_info"] is False and settings["log_error"] is True
        assert _logged(daemon) == {"WARNING", "ERROR"}
        _post(daemon, {"log_warning": False})
        assert _logged(daemon) == {"ERROR"}
    finally:
        _post(daemon, {"log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0})
    assert _logged(daemon) == {"INFO", "WARNING", "ERROR"}


def test_formats(daemon: DaemonProcess) -> None:
    try:
        assert _post(daemon, {"log_format": "ISO8601"}) [1]["log_format"] == "ISO8601"
        _logged(daemon)
        last = daemon.log().rstrip().splitlines()[-1]
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z level=", last), last
        assert _post(daemon, {"log_format": "json"})[1]["log_format"] == "json"
        _logged(daemon)
        entry = json.loads(daemon.log().rstrip().splitlines()[-1])
        assert entry["level"] in ("warning", "error") and entry["msg"].split("-")[0] in ("WARNING", "ERROR")
    finally:
        _post(daemon, {"log_format": "default"})
    _logged(daemon)
    assert " level=" in daemon.log().rstrip().splitlines()[-1]


@pytest.mark.parametrize(
    ("payload", "status", "message"),
    [
        ({"log_file": "/tmp/x.log"}, 501, "log file location can not be updated through network protocol"),
        ({"log_format": "fancy"}, 400, "invalid argument for --log_format, got: fancy"),
        ({"log_verbose_level": -1}, 400, "log_verbose_level"),
        ({"log_info": "yes"}, 400, "log_info"),
        ({"log_colour": True}, 400, "log_colour"),
    ],
)
def test_bad_settings_change_nothing(daemon: DaemonProcess, payload: dict[str, object], status: int,
                                     message: str) -> None:
    before = daemon.request("GET", "/v2/logging").json()
    reply = daemon.request("POST", "/v2/logging", json.dumps({"log_info": False, **payload}))
    assert reply.status == status and message in reply.json()["error"]
    assert daemon.request("GET", "/v2/logging").json() == before


def test_empty_post_reads_the_settings(daemon: DaemonProcess) -> None:
    reply = daemon.request("POST", "/v2/logging", b"")
    assert reply.status == 200 and reply.json()["log_error"] is True


