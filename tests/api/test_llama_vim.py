"""llama.vim and llama.vscode (llama.cpp's editor plugins) against the daemon: its requests exactly as its
autoload/llama.vim builds them, to a daemon serving one FIM-capable tiny GGUF, as a user who
points the plugin at edged instead of llama-server would send them (no model name: the plugin
sends "" unless told one; its extra context chunks carry their time; `t_max_prompt_ms`,
which llama-server takes and does not act on)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from gguf_builder import with_fim_tokens, write_tiny_llama

PRE, SUF, MID = 379, 380, 381
EXTRA = [
    {"text": "def helper(value):\n    return value * 2\n" * 4, "time": [1733400000, 123456], "filename": "util.py"},
    {"text": "CONSTANT = 42\n" * 6, "time": [1733400001, 5], "filename": "const.py"},
]
TIMINGS = ["timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms", "timings/prompt_per_second",
           "timings/predicted_n", "timings/predicted_ms", "timings/predicted_per_token_ms", "timings/predicted_per_second"]


def ring_update(extra: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.vim's s:ring_update: the extra context evaluated ahead, nothing generated."""
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "", "n_predict": 0,
            "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""], "model": ""}


def fim(extra: list[dict[str, Any]], prefix: str, middle: str) -> dict[str, Any]:
    """llama.vim's llama#fim request."""
    return {"id_slot": 0, "input_prefix": prefix, "input_suffix": "\n", "input_extra": extra, "prompt": middle,
            "n_predict": 16, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000, "response_fields": ["content", *TIMINGS, "truncated", "tokens_cached"], "model": ""}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    repo = tmp_path_factory.mktemp("vim-repo")
    (repo / "coder" / "1").mkdir(parents=True)
    # The FIM tokens are control tokens that come last in the tiny vocabulary (379 on).
    source = write_tiny_llama(repo / "base.gguf", seed=1, n_ctx=2048, control_tokens=("[FP]", "[FS]", "[FM]"))
    with_fim_tokens(source, repo / "coder" / "1" / "model.gguf", PRE, SUF, MID)
    (repo / "coder" / "config.pbtxt").write_text(
        'backend: "llamacpp"\nparameters { key: "n_parallel" value: { string_value: "1" } }\n'
    )
    (repo / "base.gguf").unlink()
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo))
    yield process
    process.stop()


def test_the_ring_warm_up_puts_the_context_in_the_cache(daemon: Any) -> None:
    # An empty slot first, so that what the completion finds cached came from the warm-up.
    daemon.post_ok("/slots/0?action=erase", {"model": "coder"})
    assert daemon.post_ok("/infill", ring_update(EXTRA)) == {}
    answer = daemon.post_ok("/infill", fim(EXTRA, "def main():\n", "    "))
    assert set(answer) == {"content", *TIMINGS, "truncated", "tokens_cached"}
    assert isinstance(answer["content"], str) and answer["truncated"] is False
    # Only the prefix, suffix and middle were evaluated (21 tokens of this char-level
    # vocabulary, as llama-server evaluates them): the extra context was in the slot.
    assert answer["timings/prompt_n"] == 21 and answer["tokens_cached"] > 200
    # Cold (nothing warmed), the whole prompt is evaluated.
    daemon.post_ok("/slots/0?action=erase", {"model": "coder"})
    cold = daemon.post_ok("/infill", fim(EXTRA, "def main():\n", "    "))
    assert cold["timings/prompt_n"] > 200


def test_the_instruction_requests(daemon: Any) -> None:
    """llama#inst's warm-up (llama-server's n_predict 0 on the chat route) and its request."""
    messages = [{"role": "system", "content": "You are a code assistant."},
                {"role": "user", "content": "Rewrite this: x = 1"}]
    warm = daemon.post_ok("/v1/chat/completions", {"id_slot": 0, "messages": messages, "samplers": [], "n_predict": 0,
                                                   "stream": False, "cache_prompt": True, "response_fields": [""],
                                                   "model": ""})
    assert warm["model"] == "coder" and warm["choices"][0]["message"]["content"] == ""
    assert warm["usage"]["completion_tokens"] == 0
    reply = daemon.post_json("/v1/chat/completions", {"id_slot": 0, "messages": messages, "min_p": 0.1,
                                                      "temperature": 0.1, "samplers": ["min_p", "temperature"],
                                                      "stream": True, "cache_prompt": True, "model": "",
                                                      "max_tokens": 4})
    assert reply.status == 200 and reply.body.rstrip().endswith(b"data: [DONE]")
    # The warm-up left the conversation in the slot: all of it but its last token was cached.
    again = daemon.post_ok("/v1/chat/completions", {"messages": messages, "max_tokens": 1, "id_slot": 0})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm["usage"]["prompt_tokens"] - 1


def test_the_limit_names_must_agree(daemon: Any) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "n_predict": 3, "max_tokens": 4}
    message = daemon.post_ok("/v1/chat/completions", body, 400)["error"]["message"]
    assert message == "max_tokens and n_predict disagree; send one of them"
    assert daemon.post_ok("/v1/chat/completions", {**body, "max_tokens": 3})["usage"]["completion_tokens"] <= 3
    # OpenAI's own name keeps OpenAI's floor: 0 only under llama-server's name.
    message = daemon.post_ok("/v1/chat/completions", {**body, "n_predict": None, "max_tokens": 0}, 400)["error"]["message"]
    assert "max_tokens must be >= 1" in message


def test_model_left_out_with_several_models_is_a_400(tmp_path: Path) -> None:
    from support import start_daemon_process

    repo = tmp_path / "repo"
    for name in ("a", "b"):
        (repo / name / "1").mkdir(parents=True)
        write_tiny_llama(repo / name / "1" / "model.gguf", seed=1)
        (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n')
    (tmp_path / "d").mkdir()
    process = start_daemon_process(tmp_path / "d", "--model-repository", str(repo))
    try:
        for path, body in (("/completion", {"prompt": "x", "n_predict": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                           ("/tokenize", {"content": "x"})):
            message = process.post_ok(path, body, 400)["error"]["message"]
            assert message == "model: required here (the generation models loaded are 'a', 'b')", (path, message)
        assert process.post_ok("/completion", {"model": "a", "prompt": "x", "n_predict": 1})["tokens_predicted"] == 1
    finally:
        process.stop()


def test_llama_vscode_completions(daemon: Any) -> None:
    """llama.vscode's FIM requests (src/llama-server.ts): no model name, chunks timed in ms,
    and three completions of which the first is slot 0's, as llama-server's child tasks."""
    chunks = [{"text": "CONSTANT = 42\n" * 6, "time": 1733400000123, "filename": "/src/const.py"}]
    prepare = {"id_slot": 0, "input_prefix": "x = ", "input_suffix": "\n", "input_extra": chunks, "prompt": "",
               "n_predict": 0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1}
    assert daemon.post_ok("/infill", prepare)["tokens_predicted"] == 0
    ask = {"id_slot": 0, "input_prefix": "x = ", "input_suffix": "\n", "input_extra": chunks, "prompt": "",
           "n_predict": 8, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
           "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4, "t_max_prompt_ms": 500,
           "t_max_predict_ms": 1000}
    answers = daemon.post_ok("/infill", ask)
    assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1, 2]
    assert answers[0]["id_slot"] == 0 and all(isinstance(a["content"], str) for a in answers)
    # The first found the prepared prompt in slot 0.
    assert answers[0]["timings"]["cache_n"] > 50


def test_continue_llama_cpp_provider(daemon: Any) -> None:
    """Continue's "llama.cpp" provider (core/llm/llms/LlamaCpp.ts): /completion, streamed, no
    model name, its options under llama-server's names."""
    body = {"prompt": "def add(a, b):", "stream": True, "n_predict": 6, "stop": ["\n\n"], "top_k": 40, "top_p": 0.9,
            "temperature": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_p": 0.05}
    reply = daemon.post_json("/completion", body)
    assert reply.status == 200, reply.body
    events = [json.loads(line[6:]) for line in reply.body.decode().split("\n") if line.startswith("data: ")]
    whole = daemon.post_ok("/completion", {**body, "stream": False})
    assert "".join(e["content"] for e in events) == whole["content"] and events[-1]["stop"] is True


def test_the_get_routes_without_a_model(daemon: Any) -> None:
    """llama.vscode reads GET /props without a model (a single-model llama-server), and with
    `?model=...&autoload=false` (the router's "do not load it for this")."""
    props = daemon.get_json("/props")
    assert props["model_alias"] == "coder" and props["total_slots"] == 1
    assert daemon.get_json("/props?model=coder&autoload=false")["model_alias"] == "coder"
    assert [s["id"] for s in daemon.get_json("/slots")] == [0]
    error = daemon.get_json("/props?model=coder&autoload=false&x=1", 400)["error"]["message"]
    assert error == "x: not a query field of /props (it takes model, autoload)"


def test_embeddings_without_a_model_name_the_one_loaded(daemon: Any) -> None:
    # llama.vscode's /v1/embeddings call sends no model: it means the one loaded, which here
    # computes no embeddings (an embedding model is loaded with embedding=true).
    message = daemon.post_ok("/v1/embeddings", {"input": "x"}, 400)["error"]["message"]
    assert message == "model 'coder' is a text generation model; load it with parameters embedding=true to serve embeddings"
