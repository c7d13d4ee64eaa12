"""LoRA adapters over the daemon's real socket: llama-server's GET and POST /lora-adapters, the
per-request `lora` of /completion, /infill and the OpenAI routes (the request's own scales:
the same text as a model loaded at them), and an adapter that fails its model's load with a
clear reason while the daemon serves the rest. The adapters are real
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


def _model(
    repo: Path, name: str, adapters: dict[str, dict[str, Any]], lora: str | None, *, embedding: bool = False
) -> None:
    version = repo / name / "1"
    version.mkdir(parents=True)
    base = write_tiny_llama(version / "model.gguf", seed=1, pooling=1 if embedding else None)
    for file, options in adapters.items():
        (version / file).parent.mkdir(parents=True, exist_ok=True)
        write_tiny_lora(version / file, base, **options)
    parameters = 'parameters { key: "n_parallel" value: { string_value: "2" } }\n'
    if embedding:
        parameters += 'parameters { key: "embedding" value: { string_value: "true" } }\n'
    if lora is not None:
        parameters += f'parameters {{ key: "lora" value: {{ string_value: "{lora}" }} }}\n'
    (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n' + parameters)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    repo = tmp_path_factory.mktemp("lora-repo")
    _model(repo, "tiny", {}, None)
    shout = {"adapter.gguf": {"task_name": "shout", "prompt_prefix": "LOUD: "}}
    _model(repo, "lora", shout, "adapter.gguf")
    _model(repo, "half", shout, "adapter.gguf:0.5")  # the same file at 0.5
    _model(repo, "switch", shout, "adapter.gguf")  # for POST /lora-adapters alone
    _model(repo, "two", {"adapters/a.gguf": {"seed": 2}, "b.gguf": {"seed": 3}}, "adapters/a.gguf:0.5,b.gguf")
    _model(repo, "missing", {}, "nowhere.gguf")
    _model(repo, "wrongarch", {"qwen3.gguf": {"arch": "qwen3"}}, "qwen3.gguf")
    # Scaled until its outputs overflow: logits and embeddings that are not numbers.
    _model(repo, "overflow", {"adapter.gguf": {}}, "adapter.gguf:1e30", embedding=True)
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), wait=False)
    # Until every model has loaded or failed (two must fail: the daemon is never "ready").
    deadline = time.monotonic() + 120
    while True:
        try:
            reply = process.post_json("/v2/repository/index", {})
            if reply.status == 200 and len(rows := reply.json()) == 8 and all(
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


def test_lora_adapters_needs_a_known_model(daemon: DaemonProcess) -> None:
    error = daemon.get_json("/lora-adapters", 400)["error"]
    # Left out, the one generation model loaded; this daemon has several.
    assert error["message"].startswith("model: required here (the generation models loaded are ")
    error = daemon.get_json("/lora-adapters?model=nope", 404)["error"]
    assert error["type"] == "not_found_error" and "nope" in error["message"]
    error = daemon.get_json("/lora-adapters?model=lora&id=0", 400)["error"]
    assert error["message"] == "id: not a query field of /lora-adapters (it takes model, autoload)"


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


def test_a_request_decodes_with_the_scales_it_asks_for(daemon: DaemonProcess) -> None:
    # "lora" and "half" load the same adapter file at 1.0 and 0.5: a request to "lora" that asks
    # for 0.5 writes what "half" writes, and 0 what the model without adapters writes.
    for prompt in ("Hello world", "Once upon a time"):
        full = _completion(daemon, "lora", prompt=prompt)["content"]
        halved = _completion(daemon, "half", prompt=prompt)["content"]
        assert halved != full
        asked = _completion(daemon, "lora", prompt=prompt, lora=[{"id": 0, "scale": 0.5}])
        assert asked["content"] == halved
        assert asked["generation_settings"]["lora"] == [{"id": 0, "scale": 0.5}]
        assert _completion(daemon, "half", prompt=prompt, lora=[{"id": 0, "scale": 1}])["content"] == full
        assert _completion(daemon, "lora", prompt=prompt, lora=[{"id": 0, "scale": 0}])["content"] == (
            _completion(daemon, "tiny", prompt=prompt)["content"]
        )


def test_a_prompt_cached_at_other_scales_is_decoded_again(daemon: DaemonProcess) -> None:
    prompt = "A prompt of its own, cached at one scale and asked at another"
    first = _completion(daemon, "lora", prompt=prompt)
    again = _completion(daemon, "lora", prompt=prompt)
    assert again["content"] == first["content"] and again["timings"]["cache_n"] > 0
    other = _completion(daemon, "lora", prompt=prompt, lora=[{"id": 0, "scale": 0.5}])
    assert other["timings"]["cache_n"] == 0
    assert other["content"] == _completion(daemon, "half", prompt=prompt)["content"]


def test_a_bad_lora_is_refused_naming_it(daemon: DaemonProcess) -> None:
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


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_completion_route_reads_lora(daemon: DaemonProcess, path: str) -> None:
    fields: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 8}
    if path == "/v1/chat/completions":
        fields = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}

    def text(model: str, **more: Any) -> str:
        choice = _completion(daemon, model, 200, path, **fields, **more)["choices"][0]
        return str(choice["text"] if "text" in choice else choice["message"]["content"])

    assert text("lora", lora=[{"id": 0, "scale": 0.5}]) == text("half")
    assert text("lora", lora=[{"id": 0, "scale": 0.5}]) != text("lora")


def test_infill_reads_lora(daemon: DaemonProcess) -> None:
    # The tiny model has no fill-in-the-middle tokens, so only the check shows here.
    message = _error(daemon, "lora", [{"id": 3, "scale": 1.0}], "/infill", input_prefix="def f(", input_suffix=")")
    assert message.startswith("lora[0]: model 'lora' has no LoRA adapter with id 3")


# --------------------------------------------------------------------------- POST /lora-adapters


def test_post_lora_adapters_sets_the_scales_of_later_requests(daemon: DaemonProcess) -> None:
    def post(body: Any, status: int = 200) -> Any:
        reply = daemon.post_json("/lora-adapters?model=switch", body)
        assert reply.status == status, reply.body
        return reply.json()

    full = _completion(daemon, "switch")["content"]
    try:
        assert post([{"id": 0, "scale": 0.5}]) == {"success": True}
        assert daemon.get_json("/lora-adapters?model=switch")[0]["scale"] == 0.5
        assert _completion(daemon, "switch")["content"] == _completion(daemon, "half")["content"]
        # A request's own scales still win; the list it echoes is its own.
        own = _completion(daemon, "switch", lora=[{"id": 0, "scale": 1}])
        assert own["content"] == full and own["generation_settings"]["lora"] == [{"id": 0, "scale": 1.0}]
        # As llama-server reads the list: an adapter left out gets 0.
        assert post([]) == {"success": True}
        assert daemon.get_json("/lora-adapters?model=switch")[0]["scale"] == 0.0
        assert _completion(daemon, "switch")["content"] == _completion(daemon, "tiny")["content"]
        # Refused, naming what is wrong; the scales stay.
        assert post({"id": 0, "scale": 1}, 400)["error"]["message"] == (
            "invalid request: Expected `array`, got `object`"
        )
        assert post([{"id": 2, "scale": 1}], 400)["error"]["message"] == (
            "body[0]: model 'switch' has no LoRA adapter with id 2; its adapters: ids 0 to 0 "
            "(GET /lora-adapters?model=switch)"
        )
        reply = daemon.request("POST", "/lora-adapters?model=switch", '[{"id": 0, "scale": 1e999}]')
        assert reply.status == 400 and reply.json()["error"]["message"] == (
            "invalid request: Number out of range - at `$[0].scale`"
        )
        assert daemon.get_json("/lora-adapters?model=switch")[0]["scale"] == 0.0
        reply = daemon.post_json("/lora-adapters?model=nope", [])
        assert reply.status == 404, reply.body
        # A model without adapters takes [] (nothing to set), as llama-server without --lora.
        assert daemon.post_json("/lora-adapters?model=tiny", []).json() == {"success": True}
        # Other models keep theirs.
        assert daemon.get_json("/lora-adapters?model=lora")[0]["scale"] == 1.0
    finally:
        post([{"id": 0, "scale": 1}])
    assert _completion(daemon, "switch")["content"] == full


# --------------------------------------------------------------------------- load errors


def test_outputs_that_are_not_numbers_are_an_error_not_null(daemon: DaemonProcess) -> None:
    """An adapter scaled to 1e30 overflows the model: NaN logits and embeddings. JSON has no NaN,
    and msgspec writes it as null, a logprob or a vector component the model did not compute:
    the request fails naming the model instead. Without logprobs the tokens drawn from such
    logits are still tokens (as llama-server's)."""
    message = "model 'lora' computed logits that are not numbers (NaN or infinite): their logprobs cannot be written"
    for path, fields in (
        ("/completion", {"n_probs": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1, "echo": True}),
    ):
        body = _completion(daemon, "lora", 500, path, lora=[{"id": 0, "scale": 1e30}], **fields)
        assert body["error"]["message"] == message, body
    assert _completion(daemon, "lora", 200, lora=[{"id": 0, "scale": 1e30}])["tokens_predicted"] == 12
    reply = daemon.post_json("/v1/embeddings", {"model": "overflow", "input": "x"})
    assert reply.status == 500, reply.body
    assert reply.json()["error"]["message"] == "model 'overflow' computed an output that is not numbers (NaN or infinite)"
    assert _completion(daemon, "lora", 200, n_probs=2)["completion_probabilities"]  # still serving


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
