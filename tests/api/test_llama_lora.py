"""LoRA adapters over the daemon's real socket: llama-server's GET /lora-adapters, the
per-request `lora` of /completion, /infill and the OpenAI routes (taken when it asks for the
scales the model is loaded with, else a 400 saying why), and an adapter that fails its
model's load with a clear reason while the daemon serves the rest. The adapters are real
LoRA GGUFs for the tiny model (tests/gguf_builder.py); tests/backends/test_llamacpp_lora.py
checks what they compute, tests/fixtures/oracle/lora.py compares with llama-server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from gguf_builder import write_tiny_llama, write_tiny_lora

from support import DaemonProcess, start_daemon_process

PROMPT = "Hello world"


def _model(repo: Path, name: str, adapters: dict[str, dict[str, Any]], lora: str | None) -> None:
    version = repo / name / "1"
    version.mkdir(parents=True)
    base = write_tiny_llama(version / "model.gguf", seed=1)
    for file, options in adapters.items():
        (version / file).parent.mkdir(parents=True, exist_ok=True)
        write_tiny_lora(version / file, base, **options)
    parameters = 'parameters { key: "n_parallel" value: { string_value: "2" } }\n'
    if lora is not None:
        parameters += f'parameters {{ key: "lora" value: {{ string_value: "{lora}" }} }}\n'
    (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n' + parameters)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    repo = tmp_path_factory.mktemp("lora-repo")
    _model(repo, "tiny", {}, None)
    _model(repo, "lora", {"adapter.gguf": {"task_name": "shout", "prompt_prefix": "LOUD: "}}, "adapter.gguf")
    _model(repo, "two", {"adapters/a.gguf": {"seed": 2}, "b.gguf": {"seed": 3}}, "adapters/a.gguf:0.5,b.gguf")
    _model(repo, "missing", {}, "nowhere.gguf")
    _model(repo, "wrongarch", {"qwen3.gguf": {"arch": "qwen3"}}, "qwen3.gguf")
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), wait=False)
    # Until every model has loaded or failed (two must fail: the daemon is never "ready").
    deadline = time.monotonic() + 120
    while True:
        try:
            reply = process.post_json("/v2/repository/index", {})
            if reply.status == 200 and len(rows := reply.json()) == 5 and all(
                row.get("state") in ("READY", "UNAVAILABLE") for row in rows
            ):
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, process.log()
        time.sleep(0.1)
    yield process
    process.stop()


def _completion(daemon: DaemonProcess, model: str, status: int = 200, path: str = "/completion", **fields: Any) -> Any:
    body = {"model": model, "temperature": 0} | ({"prompt": PROMPT, "n_predict": 12} if path == "/completion" else {}) | fields
    reply = daemon.post_json(path, body)
    assert reply.status == status, reply.body
    return reply.json()


def _error(daemon: DaemonProcess, model: str, lora: Any, path: str = "/completion", **fields: Any) -> str:
    error = _completion(daemon, model, 400, path, lora=lora, **fields)["error"]
    assert error["type"] == "invalid_request_error", error
    return str(error["message"])


# --------------------------------------------------------------------------- GET /lora-adapters


def test_lora_adapters_lists_the_loaded_adapters(daemon: DaemonProcess) -> None:
    assert daemon.get_json("/lora-adapters?model=lora") == [
        {"id": 0, "path": "adapter.gguf", "scale": 1.0, "task_name": "shout", "prompt_prefix": "LOUD: "},
    ]
    assert daemon.get_json("/lora-adapters?model=two") == [
        {"id": 0, "path": "adapters/a.gguf", "scale": 0.5, "task_name": "", "prompt_prefix": ""},
        {"id": 1, "path": "b.gguf", "scale": 1.0, "task_name": "", "prompt_prefix": ""},
    ]
    assert daemon.get_json("/lora-adapters?model=tiny") == []


def test_lora_adapters_needs_a_known_model_and_is_get_only(daemon: DaemonProcess) -> None:
    error = daemon.get_json("/lora-adapters", 400)["error"]
    # Left out, the one generation model loaded; this daemon has several.
    assert error["message"].startswith("model: required here (the generation models loaded are ")
    error = daemon.get_json("/lora-adapters?model=nope", 404)["error"]
    assert error["type"] == "not_found_error" and "nope" in error["message"]
    error = daemon.get_json("/lora-adapters?model=lora&id=0", 400)["error"]
    assert error["message"] == "id: not a query field of /lora-adapters (it takes model, autoload)"
    # llama-server's POST /lora-adapters changes the scales of every request: not offered.
    reply = daemon.post_json("/lora-adapters", [{"id": 0, "scale": 0.5}])
    assert reply.status == 405, reply.body
    assert reply.json() == {"error": {"message": "Method Not Allowed", "type": "invalid_request_error", "param": None, "code": None}}


# --------------------------------------------------------------------------- per-request lora


def test_the_adapter_changes_the_output_and_a_request_may_name_its_scale(daemon: DaemonProcess) -> None:
    plain = _completion(daemon, "tiny")
    adapted = _completion(daemon, "lora")
    assert adapted["content"] != plain["content"]
    # No lora, [] and the loaded scale are the same request, as for llama-server; its
    # generation_settings echoes the request's list.
    assert adapted["generation_settings"]["lora"] == []
    same = _completion(daemon, "lora", lora=[{"id": 0, "scale": 1.0}])
    assert same["content"] == adapted["content"]
    assert same["generation_settings"]["lora"] == [{"id": 0, "scale": 1.0}]
    assert _completion(daemon, "lora", lora=[])["content"] == adapted["content"]
    # Several adapters: given in any order, echoed by id; lora on a model without adapters: [].
    two = _completion(daemon, "two", lora=[{"id": 1, "scale": 1}, {"id": 0, "scale": 0.5}])
    assert two["content"] == _completion(daemon, "two")["content"]
    assert two["generation_settings"]["lora"] == [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 1.0}]
    assert _completion(daemon, "tiny", lora=[])["content"] == plain["content"]


def test_other_scales_are_refused_naming_lora(daemon: DaemonProcess) -> None:
    why = ("edged decodes all of a model's sequences together, in one llama_decode with one set of adapters, so a "
           "request cannot change their scales for itself. Send the loaded scales (GET /lora-adapters?model={model}) "
           "or leave lora out, or load a model whose parameters lora give the scales wanted")
    assert _error(daemon, "lora", [{"id": 0, "scale": 0.5}]) == (
        "lora: adapter 0 (adapter.gguf) of model 'lora' is loaded with scale 1 and the request asks for 0.5; "
        + why.format(model="lora")
    )
    # Left out: scale 0, as llama-server reads the list.
    assert _error(daemon, "two", [{"id": 0, "scale": 0.5}]) == (
        "lora: adapter 1 (b.gguf) of model 'two' is loaded with scale 1 and the request asks for 0 (left out of the "
        "list: scale 0, as llama-server reads it); " + why.format(model="two")
    )
    assert _error(daemon, "lora", [{"id": 1, "scale": 1.0}]) == (
        "lora[0]: model 'lora' has no LoRA adapter with id 1; its adapters: ids 0 to 0 (GET /lora-adapters?model=lora)"
    )
    assert _error(daemon, "tiny", [{"id": 0, "scale": 0.0}]) == (
        "lora[0]: model 'tiny' has no LoRA adapter with id 0; its adapters: none (its parameters lora would load "
        "them) (GET /lora-adapters?model=tiny)"
    )
    assert _error(daemon, "lora", [{"id": 0, "scale": 1.0}, {"id": 0, "scale": 1.0}]) == (
        "lora[1]: adapter id 0 given twice"
    )
    assert _error(daemon, "lora", "adapter.gguf") == "invalid request: Expected `array | null`, got `str` - at `$.lora`"
    assert _error(daemon, "lora", [{"id": 0}]) == "invalid request: Object missing required field `scale` - at `$.lora[0]`"


@pytest.mark.parametrize("path", ["/infill", "/v1/completions", "/v1/chat/completions"])
def test_every_completion_route_reads_lora(daemon: DaemonProcess, path: str) -> None:
    fields: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 4}
    if path == "/infill":
        fields = {"input_prefix": "def f(", "input_suffix": ")"}
    elif path == "/v1/chat/completions":
        fields = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    message = _error(daemon, "lora", [{"id": 0, "scale": 2.0}], path, **fields)
    assert message.startswith("lora: adapter 0 (adapter.gguf) of model 'lora' is loaded with scale 1 and the request asks for 2;")
    if path != "/infill":  # the tiny model has no fill-in-the-middle tokens
        _completion(daemon, "lora", 200, path, lora=[{"id": 0, "scale": 1.0}], **fields)


# --------------------------------------------------------------------------- load errors


def test_an_adapter_that_cannot_load_fails_its_model_not_the_daemon(daemon: DaemonProcess) -> None:
    index = {row["name"]: row for row in daemon.post_json("/v2/repository/index", {}).json()}
    for name, reason in (
        ("missing", "model 'missing': parameters lora: adapter 'nowhere.gguf' ({}): no such file"),
        ("wrongarch", "model 'wrongarch': parameters lora: adapter 'qwen3.gguf' ({}): not a LoRA adapter for this "
         "model: failed to apply lora adapter: model arch and LoRA arch mismatch"),
    ):
        assert index[name]["state"] == "UNAVAILABLE"
        file = Path(index[name]["reason"].split("(", 1)[1].split(")", 1)[0])
        assert file.name in ("nowhere.gguf", "qwen3.gguf") and file.parent.name == "1"
        assert reason.format(file) in index[name]["reason"], index[name]["reason"]
    # The others serve on.
    assert _completion(daemon, "lora")["content"]
