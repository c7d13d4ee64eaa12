"""Seeded combinations of this daemon's LLM request features on thinking models (reasoning
budgets and their messages, tools and tool_choice, response formats, llama.cpp's samplers and
their order, stop strings, n, streaming), end to end on tiny real GGUFs: every answer is a 200 or a 4xx,
every stream ends with [DONE], and the daemon stays up. The features meet inside one sampler
chain and one grammar, where a forced token the grammar refuses, or a grammar that admits
nothing, aborts llama.cpp (and the daemon): this found one (a budget message holding the
closing tag, now a 400, and a forced token a grammar refuses, now the budget giving way)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from support import gguf_daemon

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
MODELS = {
    "r1": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",  # the prompt opens the reasoning
    "qwen3": "Qwen-Qwen3-0.6B.jinja",  # the model opens it; Hermes tool calls
    "q35": "Qwen3.5-4B.jinja",  # XML tool calls; <tool_call> also ends the reasoning
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
OPTIONS: dict[str, list[Any]] = {
    "reasoning_budget_tokens": [None, 0, 1, 5, -1],
    "reasoning_budget_message": [None, "", "Stop.", "</think>", "<tool_call>", "<think>"],
    "tools": [None, [TOOL]], "tool_choice": [None, "auto", "required", "none"],
    "response_format": [None, {"type": "json_object"}], "stream": [False, True], "n": [1, 2],
    "stop": [None, ["a"], "</think>"], "temperature": [0, 1.0], "seed": [1, 2], "max_tokens": [8, 40],
    "mirostat": [None, 2], "xtc_probability": [None, 0.5], "dry_multiplier": [None, 1.0],
    "dynatemp_range": [None, 0.5], "top_n_sigma": [None, 1.0],
    # Orders where the grammar (tools, formats) meets samplers placed anywhere, none at all
    # (a draw from the model's own distribution), or temperature 0 not listed.
    "samplers": [None, None, "xkt", ["top_p", "temperature", "dry", "penalties"], "", "edskypmxt"],
    "top_p": [None, 0.0, 0.5],
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    tokens = ("<think>", "</think>", "<tool_call>", "</tool_call>")
    process = gguf_daemon(tmp_path_factory, {
        name: {"n_ctx": 2048, "chat_template": (TEMPLATES / template).read_text(), "user_tokens": tokens}
        for name, template in MODELS.items()
    })
    yield process
    process.stop()


def test_feature_combinations_never_take_the_daemon_down(daemon: Any) -> None:
    rng = random.Random(7)
    for _ in range(72):
        body: dict[str, Any] = {"model": rng.choice(sorted(MODELS)), "messages": [{"role": "user", "content": "hi"}]}
        for field, values in OPTIONS.items():
            value = rng.choice(values)
            if value is not None:
                body[field] = value
        if "tools" not in body:
            body.pop("tool_choice", None)
        reply = daemon.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"},
                               timeout=120)
        assert reply.status < 500, (body, reply.body)
        if reply.status == 200 and body.get("stream"):
            assert reply.body.rstrip().endswith(b"data: [DONE]"), (body, reply.body[-300:])
    assert daemon.request("GET", "/v2/health/ready").status == 200
