"""Gemma 4 end to end: tool calls in its own syntax and reasoning in its thought channel, with
the `openai` client and Ollama's API against a tiny GGUF carrying Gemma 4's real chat template
(its markers single tokens, as in Gemma's vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from gguf_builder import _vocab  # noqa: E402

from support import LIGHT_TOOL, check_light, check_tool_loop, gguf_daemon, streamed_chat  # noqa: E402

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "google-gemma-4-31B-it.jinja"
MARKERS = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>", "<|turn>", "<turn|>",
           "<|tool_response>", "<tool_response|>", "<|think|>", "<|tool>", "<tool|>")
TOKEN = {marker: len(_vocab()[0]) + index for index, marker in enumerate(MARKERS)}
LIGHT = LIGHT_TOOL
QUESTION = [{"role": "user", "content": "Lights in the hall?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    process = gguf_daemon(tmp_path_factory, {"gemma4": {
        "seed": 3, "n_ctx": 4096, "chat_template": TEMPLATE.read_text(), "user_tokens": MARKERS}})
    yield process
    process.stop()


def test_the_model_metadata_names_its_syntax_and_tags(daemon: Any) -> None:
    engine = httpx.get(f"http://127.0.0.1:{daemon.http_port}/v2/models/gemma4", timeout=30).json()["engine"]
    assert engine["chat_template_tools"] == "gemma4"
    assert engine["chat_template_thinking"] == "<|channel>thought<channel|>"


def test_calls_come_back_as_json_whole_and_streamed(client: openai.OpenAI) -> None:
    # A bias on <turn|> (end of generation in Gemma 4's vocabulary, as llama.cpp reads it)
    # ends the run of parallel calls the tiny model would go on writing.
    kwargs: dict[str, Any] = {"model": "gemma4", "messages": QUESTION, "tools": [LIGHT], "tool_choice": "required",
                              "temperature": 1.0, "max_tokens": 1000, "logit_bias": {str(TOKEN["<turn|>"]): 100}}
    for seed in range(3):
        choice = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
        calls = choice.message.tool_calls or []
        whole = [check_light(call.function.arguments) for call in calls]
        assert calls and calls[0].function.arguments == json.dumps(whole[0], separators=(",", ":"))
        _, content, stream, finish = streamed_chat(client.chat.completions.create(stream=True, seed=seed, **kwargs))
        assert (content, finish) == ("", "tool_calls")
        assert [(name, json.loads(arguments)) for name, arguments in stream] == [("set_light", w) for w in whole]
    single = client.chat.completions.create(parallel_tool_calls=False, seed=1, **kwargs).choices[0]
    assert len(single.message.tool_calls or []) == 1


def test_thinking_reaches_the_template(client: openai.OpenAI) -> None:
    """Thinking is on by default for a thinking template (as llama-server passes it): the
    template asks for it in the system turn; off, it closes an empty thought channel in the
    prompt. (The split of a reply's thought channel: tests/api/test_reasoning.py, against
    llama-server's.)"""
    kwargs: dict[str, Any] = {"model": "gemma4", "messages": QUESTION, "max_tokens": 8, "temperature": 0}
    on = client.chat.completions.create(**kwargs)
    off = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kwargs)
    assert on.usage is not None and off.usage is not None
    # "<|turn>system\n<|think|>\n<turn|>\n" against "<|channel>thought\n<channel|>".
    assert on.usage.prompt_tokens != off.usage.prompt_tokens
    # A reply that does not open the channel is all answer, split or not.
    for response in (on, off):
        message = response.choices[0].message
        assert getattr(message, "reasoning_content", None) is None and message.content
    raw = client.chat.completions.create(extra_body={"reasoning_format": "none"}, **kwargs).choices[0].message
    assert raw.content == on.choices[0].message.content


def test_the_tool_loop_goes_back_through_the_template(client: openai.OpenAI, daemon: Any) -> None:
    kwargs: dict[str, Any] = {"tools": [LIGHT], "tool_choice": "required", "temperature": 0,
                              "parallel_tool_calls": False, "max_tokens": 1000}
    check_tool_loop(client, daemon.http_port, "gemma4", kwargs, "call:set_light{room:hall,on:true}")
