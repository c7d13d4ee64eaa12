"""MiniCPM5 end to end: tool calls in its XML syntax (`<function name="set_light"><param
name="room">hall</param>...</function>`), with the `openai` client and Ollama's API against a
tiny GGUF carrying openbmb's real chat template (which writes past calls back in that form and
opens the reasoning in `<think>`)."""

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

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "openbmb-MiniCPM5-1B.jinja"
# Control tokens, then the markers llama.cpp preserves for MiniCPM5 as user-defined tokens.
CONTROL = ("<|im_start|>", "<|im_end|>")
MARKERS = ("<think>", "</think>", "<function", "</function>", "<param", "</param>")
TOKEN = {marker: len(_vocab()[0]) + index for index, marker in enumerate((*CONTROL, *MARKERS))}
QUESTION = [{"role": "user", "content": "Lights in the hall?"}]
# The end of the reply, which the grammar allows only once the calls are complete, and the
# end of a call (the tiny model would go on writing parameters and calls); reasoning, which the
# grammar lets the model write first, closed as soon as it opens.
ENDING = {str(TOKEN["<|im_end|>"]): 100, str(TOKEN["</think>"]): 100, str(TOKEN["</function>"]): 50}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    process = gguf_daemon(tmp_path_factory, {"minicpm5": {
        "seed": 3, "n_ctx": 4096, "chat_template": TEMPLATE.read_text(), "control_tokens": CONTROL,
        "user_tokens": MARKERS}})
    yield process
    process.stop()


def test_the_model_metadata_names_its_syntax(daemon: Any) -> None:
    engine = httpx.get(f"http://127.0.0.1:{daemon.http_port}/v2/models/minicpm5", timeout=30).json()["engine"]
    assert engine["chat_template_tools"] == "minicpm5"
    assert engine["chat_template_thinking"] == "<think></think>"


def test_required_calls_come_back_as_json_whole_and_streamed(client: openai.OpenAI) -> None:
    check_required_calls(client, "minicpm5", ENDING, compact=True)


def test_auto_calls_hold_from_the_call_marker_on(client: openai.OpenAI) -> None:
    """tool_choice auto: free text until `<function`, then the grammar holds: a bias that makes
    the model write "x" wherever it may is overruled there. Thinking off (the prompt closes the
    reasoning), so that the bias toward the call does not meet the reasoning."""
    free = str(_vocab()[0].index("x"))
    bias = {str(TOKEN["</function>"]): 50, str(TOKEN["<|im_end|>"]): 50, str(TOKEN["<function"]): 100, free: 90}
    kwargs: dict[str, Any] = {"model": "minicpm5", "messages": QUESTION, "tools": [LIGHT_TOOL], "temperature": 1.0,
                              "max_tokens": 300, "logit_bias": bias,
                              "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    check_auto_calls(client, kwargs)


def test_the_tool_loop_goes_back_through_the_template(client: openai.OpenAI, daemon: Any) -> None:
    """MiniCPM5's template writes a past call back as `<function name="set_light"><param
    name="room">hall</param>...</function>` (its arguments read as an object); Ollama's shape
    of the same conversation renders the same prompt."""
    kwargs: dict[str, Any] = {"tools": [LIGHT_TOOL], "tool_choice": "required", "temperature": 0,
                              "parallel_tool_calls": False, "max_tokens": 600, "logit_bias": ENDING}
    check_tool_loop(client, daemon.http_port, "minicpm5", kwargs, '<function name="set_light"><param name="room">')
