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


class _Running:
    def __init__(self, bundle: Path, args: list[str], models: Path, log: Path) -> None:
        """Run `args` in the image's root filesystem as the image's user, `models` mounted at
        /mnt/models (what a container runtime does, minus the network namespace)."""
        spec = json.loads((bundle / "config.json").read_text())
        rootfs = bundle / "rootfs"
        user = spec["process"]["user"]
        env = " ".join(spec["process"]["env"])
        script = (
            f"mount --rbind /proc {rootfs}/proc && mount --rbind /dev {rootfs}/dev && "
            f"mount --bind {models} {rootfs}/mnt/models && cd {rootfs} && "
            f"exec env -i {env} chroot --userspec={user['uid']}:{user['gid']} {rootfs} "
            + " ".join(args)
        )
        self.log = log
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def wait_ready(self, base: str) -> None:
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if _get(f"{base}/v2/health/ready")[0] == 200:
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def _infer_simple(base: str, name: str) -> None:
    ones = list(range(16))
    status, body = _get(f"{base}/v2/models/{name}/infer", {"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": ones},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]})
    assert status == 200, body
    outputs = {o["name"]: o["data"] for o in body["outputs"]}  # type: ignore[index]
    assert outputs["OUTPUT0"] == [v + 1 for v in ones]


def test_image_serves_the_demo_as_its_non_root_user(bundle: Path, tmp_path: Path) -> None:
    spec = json.loads((bundle / "config.json").read_text())
    process = spec["process"]
    assert (process["user"]["uid"], process["user"]["gid"]) == (10001, 10001)
    args = process["args"]
    assert args[0] == "/opt/edged/edged" and "--model-repository=/mnt/models" in args
    assert "--http=0.0.0.0:8080" in args
    port = free_port()
    # The image's own command, our port instead of 8080 (we share the host's network).
    args = [a.replace("0.0.0.0:8080", f"127.0.0.1:{port}") for a in args]
    run = _Running(bundle, args, REPO / "daemon" / "demo_models", tmp_path / "image.log")
    try:
        base = f"http://127.0.0.1:{port}"
        run.wait_ready(base)
        assert _get(f"{base}/v2/health/live")[0] == 200
        _infer_simple(base, "simple")
        owners = {int(p.stat().st_uid) for p in Path("/proc").iterdir()
                  if p.name.isdigit() and b"/opt/edged/edged" in _cmdline(p)}
        assert owners == {10001}  # not root
    finally:
        run.stop()


def test_image_as_the_kserve_runtime_runs_it(bundle: Path, tmp_path: Path) -> None:
    """The image's entrypoint with the ServingRuntime's args (KServe replaces the command's
    args, keeps the entrypoint), a single bare ONNX file in /mnt/models."""
    yaml = pytest.importorskip("yaml")
    from model_builders import build_simple_onnx

    runtime = yaml.safe_load((REPO / "deploy" / "kserve" / "servingruntime.yaml").read_text())
    (container,) = runtime["spec"]["containers"]
    port = free_port()
    args = [a.replace("{{.Name}}", "my-isvc").replace("--http_port=8080", f"--http_port={port}")
            for a in container["args"]]
    entrypoint = json.loads((bundle / "config.json").read_text())["process"]["args"][0]
    models = tmp_path / "models"
    models.mkdir()
    build_simple_onnx(models / "model.onnx")
    run = _Running(bundle, [entrypoint, *args], models, tmp_path / "kserve.log")
    try:
        base = f"http://127.0.0.1:{port}"
        run.wait_ready(base)
        assert _get(f"{base}/v2/models/my-isvc/ready")[0] == 200
        _infer_simple(base, "my-isvc")
    finally:
        run.stop()


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
