"""The OCI image from `make image` (packaging/oci/build-image.sh): unpacked with umoci and its
own entrypoint + command run in its root filesystem (chroot, as its non-root user, in a private
mount namespace), serving the demo models mounted at /mnt/models over TCP.

Skipped unless the image was built (dist/oci/edged.oci.tar, or $EDGED_IMAGE) and umoci, unshare
and root are available: building it takes minutes and is not part of `make test`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from support import free_port

REPO = Path(__file__).resolve().parents[2]
IMAGE = Path(os.environ.get("EDGED_IMAGE", REPO / "dist" / "oci" / "edged.oci.tar"))


def _get(url: str, body: object | None = None) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else None


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    if not IMAGE.is_file():
        pytest.skip(f"{IMAGE} not built (make image)")
    if not (shutil.which("umoci") and shutil.which("unshare")) or os.geteuid() != 0:
        pytest.skip("needs root, umoci and unshare to run the image's root filesystem")
    layout = tmp_path / "layout"
    layout.mkdir()
    subprocess.run(["tar", "-C", str(layout), "-xf", str(IMAGE)], check=True)
    out = tmp_path / "bundle"
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:latest", str(out)], check=True,
                   capture_output=True)
    return out


def test_image_serves_the_demo_as_its_non_root_user(bundle: Path, tmp_path: Path) -> None:
    spec = json.loads((bundle / "config.json").read_text())
    process = spec["process"]
    assert (process["user"]["uid"], process["user"]["gid"]) == (10001, 10001)
    args = process["args"]
    assert args[0] == "/opt/edged/edged" and "--model-repository=/mnt/models" in args
    assert "--http=0.0.0.0:8080" in args
    rootfs = bundle / "rootfs"
    port = free_port()
    # What a runtime does: the image's command, our port instead of 8080 (we share the host's
    # network namespace), the demo models as the /mnt/models volume.
    args = [a.replace("0.0.0.0:8080", f"127.0.0.1:{port}") for a in args]
    env = [e for e in process["env"]]
    script = (
        f"mount --rbind /proc {rootfs}/proc && mount --rbind /dev {rootfs}/dev && "
        f"mount --bind {REPO / 'daemon' / 'demo_models'} {rootfs}/mnt/models && "
        f"cd {rootfs} && exec env -i {' '.join(env)} chroot --userspec=10001:10001 {rootfs} "
        + " ".join(args)
    )
    log = (tmp_path / "image.log").open("wb")
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "image.log").read_text()
            try:
                if _get(f"http://127.0.0.1:{port}/v2/health/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "image.log").read_text()
            time.sleep(0.2)
        assert _get(f"http://127.0.0.1:{port}/v2/health/live")[0] == 200
        ones = list(range(16))
        status, body = _get(f"http://127.0.0.1:{port}/v2/models/simple/infer", {"inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": ones},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]})
        assert status == 200, body
        outputs = {o["name"]: o["data"] for o in body["outputs"]}  # type: ignore[index]
        assert outputs["OUTPUT0"] == [v + 1 for v in ones]
        # It runs as uid 10001, not root.
        pids = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
        owners = {int(p.stat().st_uid) for p in pids
                  if b"/opt/edged/edged" in _cmdline(p)}
        assert owners == {10001}
    finally:
        proc.terminate()
        proc.wait(60)


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
