"""DeepSeek R1 end to end: tool calls in R1's own markers (`<\uff5ctool\u2581calls\u2581begin\uff5c>`, per call
`<\uff5ctool\u2581call\u2581begin\uff5c>function<\uff5ctool\u2581sep\uff5c>set_light` and its arguments in a JSON code block,
`<\uff5ctool\u2581calls\u2581end\uff5c>`), with the `openai` client and Ollama's API against a tiny GGUF carrying
the R1 Qwen distill's real chat template (whose prompt opens the reasoning with `<think>\\n`, and
which writes past calls back in that form)."""

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
CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
# Control tokens, as in R1's vocabulary; `<think>` and `</think>` user-defined.
MARKERS = (
    "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", CALLS, CALLS_END, "<\uff5ctool\u2581call\u2581begin\uff5c>",
    "<\uff5ctool\u2581call\u2581end\uff5c>", "<\uff5ctool\u2581sep\uff5c>", "<\uff5ctool\u2581outputs\u2581begin\uff5c>",
    "<\uff5ctool\u2581outputs\u2581end\uff5c>", "<\uff5ctool\u2581output\u2581begin\uff5c>",
    "<\uff5ctool\u2581output\u2581end\uff5c>",
)
THINK = ("<think>", "</think>")
TOKEN = {marker: len(_vocab()[0]) + index for index, marker in enumerate((*MARKERS, *THINK))}
EOS = 2
QUESTION = [{"role": "user", "content": "Lights in the hall?"}]
# The end of the reply, which the grammar allows only once the calls are complete, the calls'
# end (the tiny model would go on writing calls) and the "}" that ends the arguments; the
# reasoning the prompt opens, closed at once (the grammar holds from `</think>` on).
ENDING = {str(EOS): 60, str(TOKEN["</think>"]): 100, str(TOKEN[CALLS_END]): 50, str(_vocab()[0].index("}")): 50}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    template = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    process = gguf_daemon(tmp_path_factory, {
        "r1": {"seed": 3, "n_ctx": 4096, "chat_template": template, "control_tokens": MARKERS, "user_tokens": THINK},
    })
    yield process
    process.stop()


def test_the_model_metadata_names_its_syntax(daemon: Any) -> None:
    engine = httpx.get(f"http://127.0.0.1:{daemon.http_port}/v2/models/r1", timeout=30).json()["engine"]
    assert engine["chat_template_tools"] == "deepseek_r1"
    assert engine["chat_template_thinking"] == "<think></think>"


def test_required_calls_come_back_as_json_whole_and_streamed(client: openai.OpenAI) -> None:
    check_required_calls(client, "r1", ENDING)


def test_auto_calls_hold_from_the_call_marker_on(client: openai.OpenAI) -> None:
    """tool_choice auto: free text until the calls' marker, then the grammar holds: a bias that
    makes the model write "x" wherever it may is overruled there. Thinking off closes the
    reasoning in the prompt (`<think>\\n</think>`; a call written inside the reasoning is
    reasoning, as llama-server reads it too)."""
    free = str(_vocab()[0].index("x"))
    bias = {**ENDING, str(EOS): 50, str(TOKEN[CALLS]): 100, free: 90}
    del bias[str(TOKEN["</think>"])]  # the prompt closed the reasoning
    kwargs: dict[str, Any] = {"model": "r1", "messages": QUESTION, "tools": [LIGHT_TOOL], "temperature": 1.0,
                              "max_tokens": 300, "logit_bias": bias,
                              "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    check_auto_calls(client, kwargs)


def test_the_tool_loop_goes_back_through_the_template(client: openai.OpenAI, daemon: Any) -> None:
    """The template writes a past call back in R1's markers (its arguments read as an object,
    written with tojson) and the result between its tool-output markers; Ollama's shape of the
    same conversation renders the same prompt."""
    kwargs: dict[str, Any] = {"tools": [LIGHT_TOOL], "tool_choice": "required", "temperature": 0,
                              "parallel_tool_calls": False, "max_tokens": 600, "logit_bias": ENDING}
    check_tool_loop(client, daemon.http_port, "r1", kwargs, 'set_light\n```json\n{"room": "')
