"""Apertus end to end: tool calls as one JSON list whose objects are keyed by the tool's name
(`<|tools_prefix|>[{"set_light": {"room": "hall", "on": true}}]<|tools_suffix|>`), with the
`openai` client and Ollama's API against a tiny GGUF carrying Swiss AI's real chat template
(which writes past calls back in that form and their results as one list after them)."""

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
# Control tokens, as in Apertus's vocabulary.
MARKERS = (
    "<|system_start|>", "<|system_end|>", "<|developer_start|>", "<|developer_end|>",
    "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
    "<|inner_prefix|>", "<|inner_suffix|>", "<|tools_prefix|>", "<|tools_suffix|>",
)
TOKEN = {marker: len(_vocab()[0]) + index for index, marker in enumerate(MARKERS)}
EOS = 2
QUESTION = [{"role": "user", "content": "Lights in the hall?"}]
# The end of the reply, which the grammar allows only once the calls are complete, and the
# "]" that closes them (the tiny model would go on writing calls).
ENDING = {str(EOS): 60, str(_vocab()[0].index("]")): 50}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    process = gguf_daemon(tmp_path_factory, {
        "apertus": {"seed": 3, "n_ctx": 4096, "chat_template": (TEMPLATES / "Apertus-8B-Instruct.jinja").read_text(),
                    "control_tokens": MARKERS},
    })
    yield process
    process.stop()


def test_the_model_metadata_names_its_syntax(daemon: Any) -> None:
    engine = httpx.get(f"http://127.0.0.1:{daemon.http_port}/v2/models/apertus", timeout=30).json()["engine"]
    assert engine["chat_template_tools"] == "apertus"


def test_required_calls_come_back_as_json_whole_and_streamed(client: openai.OpenAI) -> None:
    check_required_calls(client, "apertus", ENDING)


def test_auto_calls_hold_from_the_call_marker_on(client: openai.OpenAI) -> None:
    """tool_choice auto: free text until `<|tools_prefix|>`, then the grammar holds: a bias
    that makes the model write "x" wherever it may is overruled there."""
    free = str(_vocab()[0].index("x"))
    bias = {**ENDING, str(EOS): 50, str(TOKEN["<|tools_prefix|>"]): 100, free: 90}
    kwargs: dict[str, Any] = {"model": "apertus", "messages": QUESTION, "tools": [LIGHT_TOOL], "temperature": 1.0,
                              "max_tokens": 300, "logit_bias": bias}
    check_auto_calls(client, kwargs)


def test_the_tool_loop_goes_back_through_the_template(client: openai.OpenAI, daemon: Any) -> None:
    """The template writes a past call back as `<|tools_prefix|>[{"set_light": {...}}]` (its
    arguments read as an object) and the result as `[...]` after it; Ollama's shape of the same
    conversation renders the same prompt."""
    kwargs: dict[str, Any] = {"tools": [LIGHT_TOOL], "tool_choice": "required", "temperature": 0,
                              "parallel_tool_calls": False, "max_tokens": 600, "logit_bias": ENDING}
    check_tool_loop(client, daemon.http_port, "apertus", kwargs, '[{"set_light": {"room": "')
