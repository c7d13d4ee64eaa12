"""llama-server's GET /props and /slots (daemon/api/llama_native.py) against the daemon serving
tiny GGUFs on llama.cpp, over its real sockets. The shapes are llama-server's
(tests/fixtures/oracle/llama_native.py compares them)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from gguf_builder import CHATML_TEMPLATE

from support import llamacpp_models, python_model, start_daemon_process, wait_until

QWEN = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    repo = tmp_path_factory.mktemp("props-repo")
    models: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
        # Two slots of 8192 tokens: long enough that a generation is still running when looked at.
        "tiny": ({"n_ctx": 8192}, {"n_parallel": "2", "n_ctx": "16384"}),
        "qwen": ({"chat_template": QWEN.read_text(), "dtype": "f16"}, {"n_parallel": "3"}),
        "named": ({}, {"chat_template": "chatml", "n_parallel": "1"}),
        "embed": ({"pooling": 1}, {"embedding": "true"}),
    }
    llamacpp_models(repo, {name: ({"seed": 1, **options}, parameters) for name, (options, parameters) in models.items()})
    python_model(repo, "plain", "y = x")
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


def test_props_describe_the_model(daemon: Any) -> None:
    props = daemon.get_json("/props?model=tiny")
    # n_ctx is per slot, as llama-server's: 16384 over two slots.
    assert props["default_generation_settings"]["n_ctx"] == 8192
    assert props["total_slots"] == 2
    assert props["chat_template"] == CHATML_TEMPLATE  # the GGUF's
    assert (props["bos_token"], props["eos_token"]) == ("<s>", "</s>")
    assert props["model_alias"] == "tiny" and props["model_ftype"] == "all F32"
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert props["is_sleeping"] is False and props["endpoint_slots"] is True and props["endpoint_props"] is False
    assert props["build_info"].startswith("llama-cpp-python ")
    # Nothing that would say where the daemon keeps its files, nor fields edged cannot fill.
    assert "model_path" not in props and "chat_template_caps" not in props
    qwen = daemon.get_json("/props?model=qwen")
    assert qwen["chat_template"] == QWEN.read_text() and qwen["total_slots"] == 3
    assert qwen["model_ftype"] == "F16"
    assert qwen["default_generation_settings"]["n_ctx"] == 256  # the GGUF's trained context
    # A template chosen by name in the config has no text edged renders: left out.
    named = daemon.get_json("/props?model=named")
    assert "chat_template" not in named and named["total_slots"] == 1


def test_props_sampling_defaults_are_the_engines(daemon: Any) -> None:
    params = daemon.get_json("/props?model=tiny")["default_generation_settings"]["params"]
    assert params == {
        "seed": 4294967295, "temperature": 0.8, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
        "top_k": 40, "top_p": 0.95, "min_p": 0.05, "top_n_sigma": -1.0, "xtc_probability": 0.0,
        "xtc_threshold": 0.1, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
        "dry_penalty_last_n": 64, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
        "max_tokens": -1, "n_predict": -1, "n_keep": 0, "n_discard": 0, "ignore_eos": False, "n_probs": 0, "post_sampling_probs": False, "min_keep": 0,
        "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
        "lora": [],
    }


@contextmanager
def streaming(daemon: Any, **body: Any) -> Iterator[socket.socket]:
    """A streamed completion whose first event has arrived; closing the socket cancels it."""
    payload = json.dumps({"model": "tiny", "prompt": "Go on", "stream": True, "ignore_eos": True, **body}).encode()
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(daemon.socket))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        received = b""
        while b"data:" not in received:
            received += s.recv(4096)
        assert received.startswith(b"HTTP/1.1 200"), received
        yield s
    finally:
        s.close()


def test_slots_show_a_generation_while_it_runs(daemon: Any) -> None:
    idle = daemon.get_json("/slots?model=tiny")
    assert idle == [{"id": i, "n_ctx": 8192, "speculative": False, "is_processing": False} for i in range(2)]
    n_prompt = len(daemon.post_json("/tokenize", {"model": "tiny", "content": "Go on", "add_special": True}).json()["tokens"])
    with streaming(daemon, max_tokens=8000, temperature=0.5, top_k=7, seed=42):
        slots = daemon.get_json("/slots?model=tiny")
        busy = [slot for slot in slots if slot["is_processing"]]
        assert len(busy) == 1 and len(slots) == 2, slots
        slot = busy[0]
        assert slot["n_ctx"] == 8192 and slot["speculative"] is False and isinstance(slot["id_task"], int)
        assert slot["n_prompt_tokens"] == n_prompt
        assert slot["n_prompt_tokens_cache"] + slot["n_prompt_tokens_processed"] == n_prompt
        params = slot["params"]
        assert (params["seed"], params["temperature"], params["top_k"], params["ignore_eos"]) == (42, 0.5, 7, True)
        assert params["n_predict"] == params["max_tokens"] == 8000
        (step,) = slot["next_token"]
        assert step["has_next_token"] is True and 1 <= step["n_decoded"] < 8000
        assert step["n_remain"] == 8000 - step["n_decoded"]
        # One slot is still idle.
        assert daemon.request("GET", "/slots?model=tiny&fail_on_no_slot=1").status == 200
    # The client went: the generation is cancelled and the slot idle again.
    wait_until(lambda: not any(slot["is_processing"] for slot in daemon.get_json("/slots?model=tiny")), timeout=60)


def test_fail_on_no_slot(daemon: Any) -> None:
    with streaming(daemon, max_tokens=8000), streaming(daemon, max_tokens=8000):
        slots = daemon.get_json("/slots?model=tiny")
        assert all(slot["is_processing"] for slot in slots), slots
        assert len({slot["id_task"] for slot in slots}) == 2
        for flag in ("1", "true"):
            error = daemon.get_json(f"/slots?model=tiny&fail_on_no_slot={flag}", status=503)
            assert error == {"error": {"message": "no slot available", "type": "unavailable_error", "code": 503}}
        # Without the flag the busy slots are listed.
        assert len(daemon.get_json("/slots?model=tiny&fail_on_no_slot=")) == 2
    wait_until(lambda: daemon.request("GET", "/slots?model=tiny&fail_on_no_slot=1").status == 200, timeout=60)


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("/props", "model"),
        ("/slots", "model"),
        ("/props?model=", "model"),
        ("/slots?model=tiny&fail_on_no_slot=0", "fail_on_no_slot"),
        ("/props?model=tiny&model=qwen", "model"),
        ("/props?model=tiny&fail_on_no_slot=1", "fail_on_no_slot"),
        ("/props?model=embed", "embedding"),
        ("/slots?model=embed", "embedding"),
        ("/props?model=plain", "does not generate"),
        ("/slots?model=plain", "does not generate"),
    ],
)
def test_bad_requests(daemon: Any, path: str, named: str) -> None:
    error = daemon.get_json(path, status=400)["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error


def test_unknown_model_is_404(daemon: Any) -> None:
    for path in ("/props?model=nope", "/slots?model=nope"):
        error = daemon.get_json(path, status=404)["error"]
        assert error["type"] == "not_found_error" and "nope" in error["message"]


def test_changing_settings_is_not_offered(daemon: Any) -> None:
    """As llama-server started without `--props` (its default) answers: 501, its error shape."""
    reply = daemon.post_json("/props", {"model": "tiny"})
    assert reply.status == 501, reply.body
    assert json.loads(reply.body) == {"error": {
        "message": "This server does not support changing global properties", "type": "not_supported_error", "code": 501}}
    assert daemon.get_json("/props?model=tiny")["endpoint_props"] is False


def test_over_tcp_as_tokenize(tmp_path: Path) -> None:
    """With tcp-auth "all" the token is needed, as for /tokenize; /health stays public."""
    repo = tmp_path / "repo"
    llamacpp_models(repo, {"tiny": ({}, {"n_parallel": "1"})})
    (tmp_path / "token").write_text("s3cret-token-0123456789\n")
    (tmp_path / "token").chmod(0o600)
    config = tmp_path / "edged.toml"
    config.write_text(f'[server]\ntoken-file = "{tmp_path / "token"}"\ntcp-auth = "all"\n')
    (tmp_path / "d").mkdir()
    process = start_daemon_process(tmp_path / "d", "--config", str(config), "--model-repository", str(repo), http=True)
    try:
        base = f"http://127.0.0.1:{process.http_port}"

        def status(path: str, token: str = "") -> int:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            try:
                with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers)) as reply:
                    return int(reply.status)
            except urllib.error.HTTPError as exc:
                return exc.code

        for path in ("/props?model=tiny", "/slots?model=tiny"):
            assert status(path) == 401 and status(path, "s3cret-token-0123456789") == 200
        assert status("/health") == 200
    finally:
        process.stop()
