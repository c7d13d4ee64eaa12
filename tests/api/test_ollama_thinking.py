"""Ollama's `think` end to end with the official `ollama` client: tiny GGUF models carrying the
real Qwen 3 template (the model opens `<think>` itself) and DeepSeek R1's (the prompt opens it),
their vocabularies holding `<think>` and `</think>` as tokens, next to a model without thinking.

The replies are checked against the raw text the OpenAI route gives for the same prompt,
sampling options and seed with `reasoning_format: "none"` (the same tokens), split as Ollama
splits it (reasoning.split with trim)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
ollama = pytest.importorskip("ollama")

from gguf_builder import write_tiny_llama  # noqa: E402

from daemon.api.reasoning import split  # noqa: E402

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
R1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
# Qwen 3's template with a thinking level, as templates with levels read it.
EFFORT = "{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}" + QWEN3
TAGS = ("<think>", "</think>")
HI = [{"role": "user", "content": "Hi"}]
LLAMA = 'backend: "llamacpp"\nparameters { key: "n_parallel" value { string_value: "2" } }\n'
ON_DEMAND = 'parameters { key: "load" value { string_value: "on-demand" } }\n'
# Ollama's sampling defaults but temperature 1, spelled out so the OpenAI route samples alike.
SAMPLING = {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1, "repeat_last_n": 64}
SEEDS = range(60)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    repo = tmp_path_factory.mktemp("ollama-thinking")
    for name, template, config in (
        ("qwen3", QWEN3, LLAMA),
        ("r1", R1, LLAMA),
        ("effort", EFFORT, LLAMA + ON_DEMAND),  # not loaded until asked: /api/show reads its file
        ("plain", None, LLAMA),  # ChatML: no thinking
    ):
        (repo / name / "1").mkdir(parents=True)
        kwargs = {} if template is None else {"chat_template": template}
        write_tiny_llama(repo / name / "1" / "model.gguf", n_ctx=1024, user_tokens=TAGS, **kwargs)
        (repo / name / "config.pbtxt").write_text(config)
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


@pytest.fixture
def client(daemon) -> ollama.Client:
    return ollama.Client(host=f"http://127.0.0.1:{daemon.http_port}", timeout=120)


def options(seed: int, num_predict: int) -> dict[str, Any]:
    return {**SAMPLING, "seed": seed, "num_predict": num_predict}


def raw_reply(daemon, model: str, seed: int, num_predict: int, messages: list[dict[str, Any]] = HI,
              **extra: Any) -> str:
    """The model's text, tags and all, for the prompt the chat template makes of `messages`."""
    body = {"model": model, "messages": messages, "seed": seed, "max_tokens": num_predict,
            "reasoning_format": "none", **SAMPLING, **extra}
    reply = daemon.post_json("/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    return str(json.loads(reply.body)["choices"][0]["message"]["content"])


def r1_generated(daemon, seed: int, num_predict: int) -> str:
    """What R1 writes after the prompt's opening tag (the OpenAI route shows the tag too)."""
    raw = raw_reply(daemon, "r1", seed, num_predict)
    assert raw.startswith("<think>\n"), raw
    return raw[len("<think>\n"):]


def r1_seed(daemon, num_predict: int) -> tuple[int, str]:
    """A seed whose R1 reply reasons, closes the reasoning and answers, and that reply;
    drawn, since which seed does depends on the CPU's arithmetic."""
    for seed in SEEDS:
        generated = r1_generated(daemon, seed, num_predict)
        thought, answer = split(generated, TAGS, opened="\n", trim=True)
        if thought and answer:
            return seed, generated
    pytest.fail(f"no seed of {len(SEEDS)} reasoned and answered")


def streamed_chat(client: ollama.Client, **kwargs: Any) -> tuple[str, str, list[Any]]:
    parts = list(client.chat(stream=True, **kwargs))
    assert parts[-1].done and all(not p.done for p in parts[:-1])
    thought = "".join(p.message.thinking or "" for p in parts)
    return thought, "".join(p.message.content or "" for p in parts), parts


def kinds(pieces: list[tuple[str, str]]) -> list[str]:
    """Which of (reasoning, answer) each streamed piece carries; never both."""
    out = []
    for thought, answer in pieces:
        assert not (thought and answer), (thought, answer)
        if thought or answer:
            out.append("thinking" if thought else "answer")
    return out


def test_show_lists_thinking_for_thinking_templates(client: ollama.Client) -> None:
    for name in ("qwen3", "r1", "effort"):  # effort: from its file, not loaded yet
        assert client.show(name).capabilities == ["completion", "tools", "thinking"], name
    client.chat(model="effort", messages=HI, options={"num_predict": 1})
    assert client.show("effort").capabilities == ["completion", "tools", "thinking"]  # the loaded model says
    assert client.show("plain").capabilities == ["completion", "tools"]


def test_r1_chat_thinks_unless_think_is_false(client: ollama.Client, daemon) -> None:
    seed, generated = r1_seed(daemon, 64)
    thought, answer = split(generated, TAGS, opened="\n", trim=True)
    for think in (None, True):
        reply = client.chat(model="r1", messages=HI, options=options(seed, 64), think=think)
        assert (reply.message.thinking, reply.message.content) == (thought, answer), think
        # Streamed: the pieces add up to the same, each the reasoning's or the answer's, the
        # reasoning first.
        streamed_thought, streamed_answer, parts = streamed_chat(
            client, model="r1", messages=HI, options=options(seed, 64), think=think)
        assert (streamed_thought, streamed_answer) == (thought, answer)
        order = kinds([(p.message.thinking or "", p.message.content or "") for p in parts])
        assert order == sorted(order, key=lambda kind: kind != "thinking") and "answer" in order
    # think false: the template closes the reasoning (enable_thinking false), nothing is split.
    closed = raw_reply(daemon, "r1", seed, 64, chat_template_kwargs={"enable_thinking": False})
    off = client.chat(model="r1", messages=HI, options=options(seed, 64), think=False)
    assert off.message.thinking is None and off.message.content == closed
    on = client.chat(model="r1", messages=HI, options=options(seed, 64))
    assert off.prompt_eval_count == on.prompt_eval_count + 1  # the </think> token


def test_r1_reply_cut_inside_the_reasoning_is_all_thinking(client: ollama.Client, daemon) -> None:
    for seed in SEEDS:
        generated = r1_generated(daemon, seed, 6)
        if "</think>" not in generated and generated.strip():
            break
    else:
        pytest.fail("every seed closed the reasoning at once")
    reply = client.chat(model="r1", messages=HI, options=options(seed, 6))
    assert reply.done_reason == "length"
    assert reply.message.thinking == generated.lstrip() and reply.message.content == ""


def test_r1_generate_puts_the_reasoning_in_thinking(client: ollama.Client, daemon) -> None:
    seed, generated = r1_seed(daemon, 64)
    thought, answer = split(generated, TAGS, opened="\n", trim=True)
    reply = client.generate(model="r1", prompt="Hi", options=options(seed, 64))
    assert (reply.thinking, reply.response) == (thought, answer)
    parts = list(client.generate(model="r1", prompt="Hi", options=options(seed, 64), stream=True))
    assert "".join(p.thinking or "" for p in parts) == thought and "".join(p.response for p in parts) == answer
    kinds([(p.thinking or "", p.response) for p in parts])
    off = client.generate(model="r1", prompt="Hi", options=options(seed, 64), think=False)
    assert off.thinking is None
    assert off.response == raw_reply(daemon, "r1", seed, 64, chat_template_kwargs={"enable_thinking": False})
    # A raw prompt that ends with the opening tag opened the reasoning too.
    prompt = "<\uff5cUser\uff5c>Hi<\uff5cAssistant\uff5c><think>\n"  # DeepSeek's bars are full-width
    raw = client.generate(model="r1", prompt=prompt, raw=True, options=options(seed, 64))
    assert (raw.thinking, raw.response) == (thought, answer)


def test_qwen3_reply_agrees_with_its_raw_text(client: ollama.Client, daemon) -> None:
    # The model opens the reasoning itself, or does not: what it writes, split as Ollama does.
    for seed in range(4):
        generated = raw_reply(daemon, "qwen3", seed, 32)
        thought, answer = split(generated, TAGS, opened=None, trim=True)
        for think in (None, True):
            reply = client.chat(model="qwen3", messages=HI, options=options(seed, 32), think=think)
            assert ((reply.message.thinking or ""), reply.message.content) == (thought, answer)
            streamed_thought, streamed_answer, _ = streamed_chat(
                client, model="qwen3", messages=HI, options=options(seed, 32), think=think)
            assert (streamed_thought, streamed_answer) == (thought, answer)
            generated_reply = client.generate(model="qwen3", prompt="Hi", options=options(seed, 32), think=think)
            assert ((generated_reply.thinking or ""), generated_reply.response) == (thought, answer)
    # think false: the template writes an empty reasoning into the prompt; no split.
    closed = raw_reply(daemon, "qwen3", 0, 32, chat_template_kwargs={"enable_thinking": False})
    off = client.chat(model="qwen3", messages=HI, options=options(0, 32), think=False)
    assert off.message.thinking is None and off.message.content == closed
    on = client.chat(model="qwen3", messages=HI, options=options(0, 32), think=True)
    assert off.prompt_eval_count > on.prompt_eval_count


def test_past_thinking_reaches_the_template(daemon) -> None:
    # Qwen 3's template shows an assistant's reasoning after the last user message (a tool-call
    # loop): the thinking sent back makes the prompt longer.
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

    def prompt_tokens(thinking: str | None) -> int:
        assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
        if thinking is not None:
            assistant["thinking"] = thinking
        messages = [{"role": "user", "content": "Weather in Paris?"}, assistant,
                    {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
        reply = daemon.post_json("/api/chat", {"model": "qwen3", "messages": messages, "stream": False,
                                               "options": {"num_predict": 1}})
        assert reply.status == 200, reply.body
        return int(json.loads(reply.body)["prompt_eval_count"])

    assert prompt_tokens("The user wants the weather in Paris, so call the tool.") > prompt_tokens(None)
    assert prompt_tokens("") == prompt_tokens(None)
    reply = daemon.post_json("/api/chat", {"model": "qwen3", "messages": [
        {"role": "user", "content": "Hi", "thinking": "mine"}], "stream": False})
    assert reply.status == 400 and "messages[0].thinking" in json.loads(reply.body)["error"], reply.body


def test_levels_need_a_template_that_reads_them(client: ollama.Client) -> None:
    # Qwen 3's template reads no reasoning_effort: a level would do nothing.
    for call in (lambda: client.chat(model="qwen3", messages=HI, think="high"),
                 lambda: client.generate(model="r1", prompt="Hi", think="low")):
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 400 and caught.value.error.startswith("think:"), caught.value.error
        assert "reasoning_effort" in caught.value.error
    # One that reads it gets it; "max" is "high".
    base = client.chat(model="effort", messages=HI, options=options(3, 8), think=True)
    high = client.chat(model="effort", messages=HI, options=options(3, 8), think="high")
    top = client.chat(model="effort", messages=HI, options=options(3, 8), think="max")
    assert high.prompt_eval_count > base.prompt_eval_count
    assert (top.prompt_eval_count, top.message.content, top.message.thinking) == (
        high.prompt_eval_count, high.message.content, high.message.thinking)
    # A prompt that is not the chat template's has no place for a level.
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="effort", prompt="Hi", raw=True, think="high")
    assert caught.value.status_code == 400 and "raw" in caught.value.error


def test_a_model_without_thinking_keeps_ollamas_400(client: ollama.Client, daemon) -> None:
    for call in (lambda: client.chat(model="plain", messages=HI, think=True),
                 lambda: client.generate(model="plain", prompt="Hi", think="high"),
                 lambda: client.chat(model="plain", messages=[], think=True)):  # a load too
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 400 and caught.value.error == '"plain" does not support thinking'
    # Unset and false: its text, tags and all, is the answer.
    for think in (None, False):
        reply = client.chat(model="plain", messages=HI, options=options(0, 16), think=think)
        assert reply.message.thinking is None
        assert reply.message.content == raw_reply(daemon, "plain", 0, 16)


def test_format_holds_after_an_opened_reasoning(client: ollama.Client) -> None:
    # R1's prompt opens the reasoning: the model thinks freely, and its answer after </think>
    # is the format's. Without thinking, the answer is the format's from the first token.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for seed in SEEDS:
        reply = client.chat(model="r1", messages=HI, options=options(seed, 96), format=schema)
        if reply.done_reason == "stop" and reply.message.thinking:
            break
    else:
        pytest.fail(f"no seed of {len(SEEDS)} closed the reasoning")
    assert json.loads(reply.message.content) in ({"ok": True}, {"ok": False}), reply.message.content
    assert reply.message.thinking and "{" not in reply.message.thinking[:1]
    off = client.chat(model="r1", messages=HI, options=options(seed, 96), format=schema, think=False)
    assert off.message.thinking is None and json.loads(off.message.content) in ({"ok": True}, {"ok": False})
