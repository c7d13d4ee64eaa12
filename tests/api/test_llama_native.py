"""llama-server's /tokenize, /detokenize and /apply-template against the daemon serving a tiny
GGUF on llama.cpp. The expected answers are llama-server's own on the same GGUF
(tests/fixtures/oracle/llama_native.py asks both)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from gguf_builder import write_tiny_llama

# Ids in the tiny vocabulary (gguf_builder._vocab): <s> 1, </s> 2, byte 0xNN 3 + NN, "▁" 259,
# then printable ASCII and merges; the extra control and user tokens come last.
BOS, CTRL, THINK = 1, 379, 380
HELLO = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "get weather",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llm-repo")
    for name in ("tiny", "other"):
        (path / name / "1").mkdir(parents=True)
        write_tiny_llama(path / name / "1" / "model.gguf", seed=1, n_ctx=1024,
                         control_tokens=("[CTRL]",), user_tokens=("<think>",))
        (path / name / "config.pbtxt").write_text('backend: "llamacpp"\n')
    return path


@pytest.fixture(scope="module")
def daemon(repo: Path, tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


def tokens(daemon: Any, content: Any, **options: Any) -> Any:
    return daemon.post_ok("/tokenize", {"model": "tiny", "content": content, **options})["tokens"]


def test_tokenize_detokenize_round_trip(daemon: Any) -> None:
    ids = tokens(daemon, "Hello world")
    assert ids == [259, 299, 328, 335, 335, 338, 371, 366, 335, 327]  # llama-server's
    # The pieces joined, as llama-server: SentencePiece's space prefix stays.
    assert daemon.post_ok("/detokenize", {"model": "tiny", "tokens": ids}) == {"content": " Hello world"}
    assert tokens(daemon, "") == [] and tokens(daemon, None) == []
    assert daemon.post_ok("/detokenize", {"model": "tiny"}) == {"content": ""}


def test_add_special_puts_the_bos_first(daemon: Any) -> None:
    plain = tokens(daemon, "Hello world")
    assert tokens(daemon, "Hello world", add_special=True) == [BOS, *plain]
    assert tokens(daemon, "Hello world", add_special=False) == plain  # llama-server's default


def test_parse_special(daemon: Any) -> None:
    text = "a[CTRL]b<think>c<s>"
    # Control and user-defined tokens' texts are those tokens (the default)...
    assert tokens(daemon, text) == [369, CTRL, 259, 325, THINK, 259, 326, BOS]
    # ...or plain text.
    assert tokens(daemon, text, parse_special=False) == [369, 318, 294, 311, 309, 303, 320, 325, THINK, 259, 326, 287, 342, 289]


def test_pieces_with_byte_fallback(daemon: Any) -> None:
    # "é" and "€" have no piece: one byte token each byte, a piece that is not UTF-8 as its bytes.
    assert tokens(daemon, "héllo € [CTRL]<s>", with_pieces=True) == [
        {"id": 259, "piece": " "}, {"id": 331, "piece": "h"}, {"id": 198, "piece": [195]},
        {"id": 172, "piece": [169]}, {"id": 335, "piece": "l"}, {"id": 335, "piece": "l"},
        {"id": 338, "piece": "o"}, {"id": 259, "piece": " "}, {"id": 229, "piece": [226]},
        {"id": 133, "piece": [130]}, {"id": 175, "piece": [172]}, {"id": 259, "piece": " "},
        {"id": CTRL, "piece": "[CTRL]"}, {"id": BOS, "piece": "<s>"},
    ]


def test_mixed_content_and_detokenize_bytes(daemon: Any) -> None:
    # Texts and ids in order; only a text that comes first gets the BOS (llama-server's rule).
    assert tokens(daemon, ["ab", 5, "cd"], add_special=True) == [BOS, 369, 325, 5, 259, 326, 327]
    assert tokens(daemon, [5, "ab"], add_special=True) == [5, 369, 325]
    detok = {"model": "tiny", "tokens": [229, 133]}  # two bytes of "€": llama-server writes U+FFFD
    assert daemon.post_ok("/detokenize", detok, status=400)["error"]["message"] == (
        "tokens: the tokens' bytes are not UTF-8 text (byte 0 of 2: a character cut between tokens); "
        "POST /tokenize with these ids as content and with_pieces true gives each token's bytes"
    )
    assert daemon.post_ok("/detokenize", {**detok, "tokens": [229, 133, 175]}) == {"content": "€"}
    # Control tokens' texts are written.
    assert daemon.post_ok("/detokenize", {**detok, "tokens": [CTRL, THINK, 2, 0]}) == {"content": "[CTRL]<think></s><unk>"}


def test_apply_template_is_the_chat_routes_prompt(daemon: Any) -> None:
    prompt = daemon.post_ok("/apply-template", {"model": "tiny", "messages": HELLO})["prompt"]
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # llama-server's
    greedy = {"model": "tiny", "temperature": 0, "max_tokens": 8}
    chat = daemon.post_ok("/v1/chat/completions", {**greedy, "messages": HELLO})
    completion = daemon.post_ok("/v1/completions", {**greedy, "prompt": prompt})
    # Greedy on the same tokens: the same reply from the same prompt.
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == completion["usage"]["prompt_tokens"]
    assert len(tokens(daemon, prompt, add_special=True)) == chat["usage"]["prompt_tokens"]


def test_apply_template_with_tools(daemon: Any) -> None:
    # ChatML has no tool syntax: the chat route describes the tools in a system message.
    body = {"model": "tiny", "messages": HELLO, "tools": [WEATHER]}
    prompt = daemon.post_ok("/apply-template", body)["prompt"]
    assert prompt.startswith("<|im_start|>system\n") and "get_weather" in prompt
    chat = daemon.post_ok("/v1/chat/completions", {**body, "max_tokens": 1})
    assert len(tokens(daemon, prompt, add_special=True)) == chat["usage"]["prompt_tokens"]
    # The chat route's rules for what shapes the prompt hold here too.
    error = daemon.post_ok("/apply-template", {**body, "reasoning_effort": "high"}, status=400)
    assert "reasoning_effort" in error["error"]["message"]
    error = daemon.post_ok("/apply-template", {"model": "tiny", "messages": HELLO, "tool_choice": "auto"}, status=400)
    assert "tool_choice" in error["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/tokenize", {"content": "x"}, "model"),
        ("/detokenize", {"tokens": [1]}, "model"),
        ("/apply-template", {"messages": HELLO}, "model"),
        ("/tokenize", {"model": "tiny", "content": "x", "bogus": 1}, "bogus"),
        ("/tokenize", {"model": "tiny", "content": "x", "add_special": "yes"}, "add_special"),
        ("/tokenize", {"model": "tiny", "content": 12}, "content"),
        ("/tokenize", {"model": "tiny", "content": ["x", 99999]}, "content"),
        ("/tokenize", {"model": "tiny", "content": [-1], "with_pieces": True}, "content"),
        ("/detokenize", {"model": "tiny", "tokens": [99999]}, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": ["a"]}, "tokens"),
        ("/apply-template", {"model": "tiny", "messages": HELLO, "temperature": 0.5}, "temperature"),
        ("/apply-template", {"model": "tiny", "messages": []}, "messages"),
        ("/apply-template", {"model": "tiny"}, "messages"),
    ],
)
def test_bad_requests_name_the_field(daemon: Any, path: str, body: dict[str, Any], named: str) -> None:
    error = daemon.post_ok(path, body, status=400)["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [("/tokenize", {"content": "x"}), ("/detokenize", {"tokens": [1]}), ("/apply-template", {"messages": HELLO})],
)
def test_unknown_model_is_404(daemon: Any, path: str, body: dict[str, Any]) -> None:
    error = daemon.post_ok(path, {"model": "nope", **body}, status=404)["error"]
    assert error["type"] == "not_found_error" and "nope" in error["message"]


def test_health(daemon: Any) -> None:
    """llama-server's GET /health and /v1/health: `{"status": "ok"}` once ready (the 503 while
    starting and for a failed model: tests/api/test_kserve.py's failing repository)."""
    for path in ("/health", "/v1/health"):
        reply = daemon.request("GET", path)
        assert (reply.status, reply.json()) == (200, {"status": "ok"})
        assert daemon.request("HEAD", path).status == 200


def test_not_under_v1(daemon: Any) -> None:
    # llama-server has them at the root only.
    for path, body in (("/tokenize", {"content": "x"}), ("/detokenize", {"tokens": [1]}),
                       ("/apply-template", {"messages": HELLO})):
        assert daemon.post_json(path, {"model": "tiny", **body}).status == 200
        assert daemon.post_json("/v1" + path, {"model": "tiny", **body}).status == 404


def test_over_tcp_and_each_model(daemon: Any) -> None:
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{daemon.http_port}/tokenize",
        json.dumps({"model": "other", "content": "Hello world", "add_special": True}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request) as reply:
        assert json.load(reply) == {"tokens": [BOS, 259, 299, 328, 335, 335, 338, 371, 366, 335, 327]}
