"""The shipped systemd units: hardening score and syntax, checked by systemd's own analyzer."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"
ANALYZE = shutil.which("systemd-analyze")

pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def _exposure(unit: Path) -> float:
    assert ANALYZE is not None
    proc = subprocess.run(
        [ANALYZE, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr
    # Last line: "→ Overall exposure level for edged.service: 1.4 OK 🙂"
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", lines[-1])
    assert match, f"unexpected systemd-analyze output: {lines[-1]!r}\n{proc.stderr}"
    return float(match.group(1))


def test_service_exposure_is_low() -> None:
    assert _exposure(UNITS / "edged.service") <= 2.0


def test_gpu_drop_in_keeps_exposure_low(tmp_path: Path) -> None:
    # A drop-in's [Service] lines act as if appended to the unit.
    combined = tmp_path / "edged.service"
    combined.write_text((UNITS / "edged.service").read_text() + (UNITS / "edged-gpu.conf").read_text())
    assert _exposure(combined) <= 2.0


def test_exposure_parser_sees_an_unhardened_unit(tmp_path: Path) -> None:
    # Guard for the parser above: an unhardened unit must score high.
    bare = tmp_path / "bare.service"
    bare.write_text("[Service]\nExecStart=/bin/true\n")
    assert _exposure(bare) > 5.0


def _verify(*units: Path) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run(
        [ANALYZE, "verify", "--man=no", *[str(u) for u in units]],
        capture_output=True, text=True, timeout=60, check=False, cwd=units[0].parent,
    )


def _verifiable_copy(tmp_path: Path, extra: str = "") -> tuple[Path, Path]:
    # `verify` insists that ExecStart= exists; point it at a real binary, change nothing else.
    service = tmp_path / "edged.service"
    text = (UNITS / "edged.service").read_text().replace("/opt/edged/edged", sys.executable)
    service.write_text(text + extra)
    socket_unit = tmp_path / "edged.socket"
    socket_unit.write_text((UNITS / "edged.socket").read_text())
    return service, socket_unit


def test_units_verify(tmp_path: Path) -> None:
    service, socket_unit = _verifiable_copy(tmp_path)
    proc = _verify(service, socket_unit)
    if "Failed to initialize" in proc.stderr or "Failed to set up" in proc.stderr:
        pytest.skip(f"systemd-analyze verify cannot run here: {proc.stderr.strip()}")
    # verify exits 0 on unknown keys and bad values, but says so: silence is the pass condition.
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout + proc.stderr == ""

    # The same check does catch a typo (so the assertion above can fail).
    service, socket_unit = _verifiable_copy(tmp_path, extra="WatchdogSecs=30\n")
    proc = _verify(service, socket_unit)
    assert "Unknown key" in proc.stderr


def test_gpu_drop_in_verifies(tmp_path: Path) -> None:
    service, socket_unit = _verifiable_copy(tmp_path, extra=(UNITS / "edged-gpu.conf").read_text())
    proc = _verify(service, socket_unit)
    if "Failed to initialize" in proc.stderr or "Failed to set up" in proc.stderr:
        pytest.skip(f"systemd-analyze verify cannot run here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout + proc.stderr == ""


def test_units_agree_with_each_other() -> None:
    service = (UNITS / "edged.service").read_text()
    socket_unit = (UNITS / "edged.socket").read_text()
    sysusers = (UNITS / "edged.sysusers").read_text()
    assert "Type=notify\n" in service and "NotifyAccess=main\n" in service
    assert "FileDescriptorName=api\n" in socket_unit
    # The socket lives in the service's RuntimeDirectory, which must survive service stops.
    assert "ListenStream=/run/edged/edged.sock\n" in socket_unit
    assert "RuntimeDirectory=edged\n" in service and "RuntimeDirectoryPreserve=yes\n" in service
    # The socket's group is the service's group, created by sysusers before either starts.
    assert "SocketGroup=edged\n" in socket_unit and "Group=edged\n" in service
    assert re.search(r"^u edged ", sysusers, re.MULTILINE)


def test_sysusers_creates_the_user(tmp_path: Path) -> None:
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed")
    (tmp_path / "etc").mkdir()
    proc = subprocess.run([sysusers, f"--root={tmp_path}", str(UNITS / "edged.sysusers")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    assert re.search(r"^edged:x:\d+:\d+:[^:]*:/var/lib/edged:/usr/sbin/nologin$", passwd, re.M)
    assert re.search(r"^edged:x:\d+:", (tmp_path / "etc" / "group").read_text(), re.M)


def test_service_sets_resource_limits() -> None:
    text = (Path(__file__).resolve().parents[2] / "systemd" / "edged.service").read_text()
    settings = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )
    assert int(settings["LimitNOFILE"]) >= 4 * 512  # server.max-connections' default, with room
    assert settings["MemoryMax"].endswith("%") and settings["MemoryHigh"].endswith("%")
    assert "TasksMax" in settings
