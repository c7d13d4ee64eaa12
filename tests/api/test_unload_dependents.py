"""`model_repository(unload_dependents)`: unloading a model with `unload_dependents` also unloads
the ensembles that use it, directly or through another ensemble (real tritonclient over TCP)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnxruntime")
httpclient = pytest.importorskip("tritonclient.http")

from daemon.demo import build_simple_onnx  # noqa: E402
from support import DaemonProcess  # noqa: E402

TENSOR = "data_type: TYPE_INT32 dims: [ 16 ]"


def _ensemble(repo: Path, name: str, step_model: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'platform: "ensemble"\nmax_batch_size: 8\n'
        f'input [{{ name: "A" {TENSOR} }}, {{ name: "B" {TENSOR} }}]\n'
        f'output [{{ name: "SUM" {TENSOR} }}]\n'
        f'ensemble_scheduling {{ step [ {{ model_name: "{step_model}" model_version: -1 '
        f'input_map {{ key: "{"INPUT0" if step_model.startswith("simple") else "A"}" value: "A" }} '
        f'input_map {{ key: "{"INPUT1" if step_model.startswith("simple") else "B"}" value: "B" }} '
        f'output_map {{ key: "{"OUTPUT0" if step_model.startswith("simple") else "SUM"}" value: "SUM" }} }} ] }}\n'
    )


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    for name in ("simple", "simple_other"):
        build_simple_onnx(repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(
            'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
            f'input [{{ name: "INPUT0" {TENSOR} }}, {{ name: "INPUT1" {TENSOR} }}]\n'
            f'output [{{ name: "OUTPUT0" {TENSOR} }}, {{ name: "OUTPUT1" {TENSOR} }}]\n'
        )
    _ensemble(repo, "sum", "simple")
    _ensemble(repo, "outer", "sum")  # uses `simple` through `sum`
    _ensemble(repo, "sum_other", "simple_other")
    return repo


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProcess], repo: Path) -> DaemonProcess:
    return start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit",
                        "--load-model", "*", http=True)


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Any]:
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
    yield client
    client.close()


def _ready(client: Any) -> set[str]:
    return {m["name"] for m in client.get_model_repository_index() if m.get("state") == "READY"}


ALL = {"simple", "simple_other", "sum", "outer", "sum_other"}


def test_unload_with_and_without_dependents(client: Any) -> None:
    assert _ready(client) == ALL
    client.unload_model("simple")  # as Triton: the ensembles stay loaded
    assert _ready(client) == ALL - {"simple"}
    client.load_model("simple")
    client.unload_model("simple", unload_dependents=True)
    assert _ready(client) == {"simple_other", "sum_other"}
    client.unload_model("sum_other", unload_dependents=True)  # no dependents: just the model
    assert _ready(client) == {"simple_other"}


def test_bad_unload_parameters(client: Any, daemon: DaemonProcess) -> None:
    reply = daemon.request("POST", "/v2/repository/models/simple/unload",
                           json.dumps({"parameters": {"unload_dependents": "yes"}}))
    assert reply.status == 400 and "Unable to parse 'unload_dependents'" in reply.json()["error"]
    reply = daemon.request("POST", "/v2/repository/models/simple/unload",
                           json.dumps({"parameters": {"unload_everything": True}}))
    assert reply.status == 400 and "unload_everything" in reply.json()["error"]
    assert _ready(client) == ALL
