"""LFM2 / LFM2.5 end to end: tool calls as Python-style calls
(`<|tool_call_start|>[set_light(room="hall", on=true)]<|tool_call_end|>`), with the `openai`
client and Ollama's API against tiny GGUFs carrying Liquid's real chat templates (LFM2.5's
writes past calls back in that form; LFM2's lists the tools between its own tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from gguf_builder import _vocab  # noqa: E402

from support import (  # noqa: E402
    LIGHT_TOOL,
    check_auto_calls,
    check_required_calls,
    check_tool_loop,
    gguf_daemon,
)

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
# Control tokens, as in LFM2's vocabulary (`<think>` and `</think>` are user-defined there).
MARKERS = ("<|im_start|>", "<|im_end|>", "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_list_start|>",
           "<|tool_list_end|>", "<|tool_response_start|>", "<|tool_response_end|>")
THINK = ("<think>", "</think>")
TOKEN = {marker: len(_vocab()[0]) + index for index, marker in enumerate((*MARKERS, *THINK))}
QUESTION = [{"role": "user", "content": "Lights in the hall?"}]
# The end of the reply, which the grammar allows only once the calls are complete, and the
# "]" that closes them (the tiny model would go on writing calls); reasoning, which the grammar lets LFM2.5 write first,
# closed as soon as it opens.
ENDING = {str(TOKEN["<|im_end|>"]): 100, str(TOKEN["</think>"]): 100, str(_vocab()[0].index("]")): 50}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    process = gguf_daemon(tmp_path_factory, {
        name: {"seed": 3, "n_ctx": 4096, "chat_template": (TEMPLATES / template).read_text(),
               "control_tokens": MARKERS, "user_tokens": THINK}
        for name, template in (("lfm25", "LFM2.5-8B-A1B.jinja"), ("lfm2", "LFM2-8B-A1B.jinja"))
    })
    yield process
    process.stop()


def test_the_model_metadata_names_its_syntax(daemon: Any) -> None:
    for name, thinking in (("lfm25", "<think></think>"), ("lfm2", "")):
        engine = httpx.get(f"http://127.0.0.1:{daemon.http_port}/v2/models/{name}", timeout=30).json()["engine"]
        assert engine["chat_template_tools"] == "lfm2"
        assert engine.get("chat_template_thinking", "") == thinking


@pytest.mark.parametrize("model", ["lfm25", "lfm2"])
def test_required_calls_come_back_as_json_whole_and_streamed(client: openai.OpenAI, model: str) -> None:
    check_required_calls(client, model, ENDING, compact=True)


def test_auto_calls_hold_from_the_call_marker_on(client: openai.OpenAI) -> None:
    """tool_choice auto: free text until `<|tool_call_start|>`, then the grammar holds: a bias
    that makes the model write "x" wherever it may is overruled there."""
    free = str(_vocab()[0].index("x"))
    bias = {**ENDING, str(TOKEN["<|im_end|>"]): 50, str(TOKEN["<|tool_call_start|>"]): 100, free: 90}
    kwargs: dict[str, Any] = {"model": "lfm25", "messages": QUESTION, "tools": [LIGHT_TOOL], "temperature": 1.0,
                              "max_tokens": 300, "logit_bias": bias}
    check_auto_calls(client, kwargs)


def test_the_tool_loop_goes_back_through_the_template(client: openai.OpenAI, daemon: Any) -> None:
    """LFM2.5's template writes a past call back as `name(key='value', ...)` (its arguments read
    as an object); Ollama's shape of the same conversation renders the same prompt."""
    kwargs: dict[str, Any] = {"tools": [LIGHT_TOOL], "tool_choice": "required", "temperature": 0,
                              "parallel_tool_calls": False, "max_tokens": 600, "logit_bias": ENDING}
    check_tool_loop(client, daemon.http_port, "lfm25", kwargs, "set_light(room='hall', on=True)")
