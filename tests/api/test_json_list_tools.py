"""Nemotron Nano v2 end to end: tool calls as one JSON list
(`<TOOLCALL>[{"name": "set_light", "arguments": {"room": "hall", "on": true}}]</TOOLCALL>`), with
the `openai` client and Ollama's API against a tiny GGUF carrying NVIDIA's real chat template
(whose prompt opens the reasoning with `<think>`, and which writes past calls back in that form)."""

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
# Control tokens, as in Nemotron Nano v2's vocabulary; `<think>` and `</think>` user-defined.
MARKERS = ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOLCALL>", "</TOOLCALL>")
THINK = ("<think>", "</think>")
TOKEN = {marker: len(_vocab()[0]) + index for index, marker in enumerate((*MARKERS, *THINK))}
EOS = 2
QUESTION = [{"role": "user", "content": "Lights in the hall?"}]
# The end of the reply, which the grammar allows only once the calls are complete, and the
# "]" that closes them (the tiny model would go on writing calls); the reasoning the prompt
# opens, closed at once (above the end, which the grammar allows there: it holds from `</think>` on).
ENDING = {str(EOS): 60, str(TOKEN["</think>"]): 100, str(_vocab()[0].index("]")): 50}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    process = gguf_daemon(tmp_path_factory, {
        "nemotron": {"seed": 3, "n_ctx": 4096, "chat_template": (TEMPLATES / "NVIDIA-Nemotron-Nano-v2.jinja").read_text(),
                     "control_tokens": MARKERS, "user_tokens": THINK},
    })
    yield process
    process.stop()


def test_the_model_metadata_names_its_syntax(daemon: Any) -> None:
    engine = httpx.get(f"http://127.0.0.1:{daemon.http_port}/v2/models/nemotron", timeout=30).json()["engine"]
    assert engine["chat_template_tools"] == "nemotron_v2"
    assert engine["chat_template_thinking"] == "<think></think>"


def test_required_calls_come_back_as_json_whole_and_streamed(client: openai.OpenAI) -> None:
    check_required_calls(client, "nemotron", ENDING)


def test_auto_calls_hold_from_the_call_marker_on(client: openai.OpenAI) -> None:
    """tool_choice auto: free text until `<TOOLCALL>`, then the grammar holds: a bias that makes
    the model write "x" wherever it may is overruled there. `/no_think` closes the reasoning in
    the prompt (the lazy grammar would hold a call written inside it, which is reasoning as
    llama-server reads it too)."""
    free = str(_vocab()[0].index("x"))
    bias = {**ENDING, str(EOS): 50, str(TOKEN["<TOOLCALL>"]): 100, free: 90}
    question = [{"role": "user", "content": "Lights in the hall? /no_think"}]
    kwargs: dict[str, Any] = {"model": "nemotron", "messages": question, "tools": [LIGHT_TOOL], "temperature": 1.0,
                              "max_tokens": 300, "logit_bias": bias}
    check_auto_calls(client, kwargs)


def test_the_tool_loop_goes_back_through_the_template(client: openai.OpenAI, daemon: Any) -> None:
    """The template writes a past call back as `<TOOLCALL>[{"name": ..., "arguments": {...}}]`
    (its arguments read as an object) and the result as `<TOOL_RESPONSE>[...]`; Ollama's shape
    of the same conversation renders the same prompt."""
    kwargs: dict[str, Any] = {"tools": [LIGHT_TOOL], "tool_choice": "required", "temperature": 0,
                              "parallel_tool_calls": False, "max_tokens": 600, "logit_bias": ENDING}
    check_tool_loop(client, daemon.http_port, "nemotron", kwargs, '<TOOLCALL>[{"name": "set_light", "arguments": {"room": "')
