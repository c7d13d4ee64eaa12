"""edged as a KServe serving runtime: the ServingRuntime's own command line, run locally exactly as
KServe runs it (arguments from deploy/kserve/servingruntime.yaml, {{.Name}} filled in, the model
where the storage initializer puts it), and the /mnt/models layouts it must accept."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from model_builders import build_simple_onnx, write_simple_repository

from daemon.config import DaemonConfig
from daemon.errors import ConfigError
from daemon.ops.kserve import apply_kserve_flags, kserve_repository
from support import free_port

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "deploy" / "kserve" / "servingruntime.yaml"
ISVC = REPO / "deploy" / "kserve" / "inferenceservice.yaml"


def _runtime() -> dict:
    return yaml.safe_load(RUNTIME.read_text())


def test_manifests_declare_what_kserve_needs() -> None:
    spec = _runtime()["spec"]
    assert spec["protocolVersions"] == ["v2"]
    formats = {f["name"]: f for f in spec["supportedModelFormats"]}
    assert set(formats) == {"onnx", "openvino", "gguf", "tensorrt", "python"}
    assert all(f["autoSelect"] is True for f in formats.values())
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container"
    assert container["ports"][0]["containerPort"] == 8080
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
    isvc = yaml.safe_load(ISVC.read_text())["spec"]["predictor"]["model"]
    assert isvc["protocolVersion"] == "v2" and isvc["runtime"] == _runtime()["metadata"]["name"]
    assert isvc["storageUri"] and isvc["modelFormat"]["name"] in formats


def _kserve_argv(name: str, mnt: Path, port: int, state: Path) -> list[str]:
    """The container's args as KServe passes them, with the pod's paths and port moved to ours."""
    (container,) = _runtime()["spec"]["containers"]
    argv = []
    for arg in container["args"]:
        arg = arg.replace("{{.Name}}", name).replace("/mnt/models", str(mnt))
        arg = arg.replace("--http_port=8080", f"--http_port={port}")
        arg = arg.replace("--state-dir=/tmp/edged", f"--state-dir={state}")
        argv.append(arg)
    assert f"--model_dir={mnt}" in argv and f"--model_name={name}" in argv
    return argv


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
def run_runtime(tmp_path: Path) -> Iterator:
    procs: list[subprocess.Popen[bytes]] = []

    def run(name: str, mnt: Path) -> str:
        port = free_port()
        log = (tmp_path / f"{name}.log").open("wb")
        # The container's entrypoint is the frozen `edged`; from source it is `python -m daemon`.
        proc = subprocess.Popen([sys.executable, "-m", "daemon", *_kserve_argv(name, mnt, port, tmp_path / "state")],
                                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
            try:
                if _get(base + "/v2/health/ready")[0] == 200:
                    return base
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()
            time.sleep(0.1)

    yield run
    for proc in procs:
        proc.terminate()
        proc.wait(60)


def _infer_simple(base: str, name: str) -> None:
    ones = list(range(16))
    status, body = _get(f"{base}/v2/models/{name}/infer", {"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": ones},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]})
    assert status == 200, body
    outputs = {o["name"]: o["data"] for o in body["outputs"]}  # type: ignore[index]
    assert outputs["OUTPUT0"] == [v + 1 for v in ones] and outputs["OUTPUT1"] == [v - 1 for v in ones]


def test_single_bare_model_file_as_kserve_mounts_it(run_runtime, tmp_path: Path) -> None:
    """storageUri pointing at one file: /mnt/models/<file>, no repository layout, no config."""
    mnt = tmp_path / "mnt" / "models"
    mnt.mkdir(parents=True)
    build_simple_onnx(mnt / "resnet-ish.onnx")
    base = run_runtime("my-isvc", mnt)
    assert _get(base + "/v2/health/live")[0] == 200
    assert _get(base + "/v2/models/my-isvc/ready")[0] == 200
    status, meta = _get(base + "/v2/models/my-isvc")
    assert status == 200 and meta["name"] == "my-isvc"  # type: ignore[index]
    _infer_simple(base, "my-isvc")
    assert os.listdir(mnt) == ["resnet-ish.onnx"]  # /mnt/models is never written to


def test_triton_repository_in_mnt_models(run_runtime, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt" / "models"
    mnt.mkdir(parents=True)
    write_simple_repository(mnt, python=False)
    base = run_runtime("simple", mnt)
    _infer_simple(base, "simple")


def test_one_model_directory_in_mnt_models(run_runtime, tmp_path: Path) -> None:
    """A model directory (config.pbtxt + version directory) copied as /mnt/models itself."""
    repo = tmp_path / "repo"
    write_simple_repository(repo, python=False)
    (repo / "simple" / "config.pbtxt").write_text(
        (repo / "simple" / "config.pbtxt").read_text().replace('name: "simple"', ""))
    base = run_runtime("simple-v2", repo / "simple")
    _infer_simple(base, "simple-v2")


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"model_name": None, "model_dir": None, "http_port": None, **kw})


def test_flags_map_onto_the_config(tmp_path: Path) -> None:
    assert apply_kserve_flags(DaemonConfig(), _args()) == DaemonConfig()
    mnt = tmp_path / "m"
    mnt.mkdir()
    (mnt / "model.gguf").write_bytes(b"GGUF")
    config = apply_kserve_flags(DaemonConfig(state_dir=str(tmp_path / "s")),
                                _args(model_name="phi", model_dir=str(mnt), http_port=8080))
    assert config.server.http == "0.0.0.0:8080"
    assert config.models.repository == [str(tmp_path / "s" / "kserve-repository")]
    assert config.models.control_mode == "none"
    link = tmp_path / "s" / "kserve-repository" / "phi" / "1" / "model.gguf"
    assert link.resolve() == (mnt / "model.gguf").resolve()
    with pytest.raises(ConfigError, match="--model_name needs --model_dir"):
        apply_kserve_flags(DaemonConfig(), _args(model_name="x"))
    with pytest.raises(ConfigError, match=r"--http_port must be 1\.\.65535"):
        apply_kserve_flags(DaemonConfig(), _args(http_port=70000))


def test_openvino_pair_and_refusals(tmp_path: Path) -> None:
    work = tmp_path / "work"
    mnt = tmp_path / "ov"
    mnt.mkdir()
    (mnt / "net.xml").write_text("<net/>")
    with pytest.raises(ConfigError, match=r"needs its weights file net\.bin"):
        kserve_repository(mnt, "net", work)
    (mnt / "net.bin").write_bytes(b"\0")
    repo = kserve_repository(mnt, "net", work)
    assert sorted(p.name for p in (repo / "net" / "1").iterdir()) == ["model.bin", "model.xml"]

    two = tmp_path / "two"
    two.mkdir()
    (two / "a.onnx").write_bytes(b"1")
    (two / "b.onnx").write_bytes(b"2")
    with pytest.raises(ConfigError, match=r"more than one \.onnx model \(a\.onnx, b\.onnx\)"):
        kserve_repository(two, "x", work)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README").write_text("hi")
    with pytest.raises(ConfigError, match=r"no model artifact in .* \(found: README\)"):
        kserve_repository(empty, "x", work)
    with pytest.raises(ConfigError, match="--model_name is required"):
        kserve_repository(mnt, None, work)
    with pytest.raises(ConfigError, match="does not exist"):
        kserve_repository(tmp_path / "nope", "x", work)
    full = tmp_path / "full"
    write_simple_repository(full, python=False)
    with pytest.raises(ConfigError, match=r"--model_name 'other' is not a model of the repository"):
        kserve_repository(full, "other", work)
    assert kserve_repository(full, None, work) == full


def test_bad_kserve_arguments_exit_with_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "daemon", "--model_name=x",
                           f"--model_dir={tmp_path / 'absent'}", "--socket=none",
                           f"--state-dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert done.returncode == 2
    assert "--model_dir" in done.stderr and "does not exist" in done.stderr


def test_gguf_file_serves_the_openai_routes_under_kserve(run_runtime, tmp_path: Path) -> None:
    """A bare GGUF file as /mnt/models: the OpenAI routes answer for --model_name, with the real
    `openai` client, next to the v2 protocol."""
    pytest.importorskip("llama_cpp")
    openai = pytest.importorskip("openai")
    from gguf_builder import write_tiny_llama

    mnt = tmp_path / "mnt" / "models"
    mnt.mkdir(parents=True)
    write_tiny_llama(mnt / "tiny-chat.gguf", seed=1)
    base = run_runtime("tiny-chat", mnt)
    assert _get(base + "/v2/models/tiny-chat/ready")[0] == 200
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    reply = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 4
