"""Qwen 3.5 / Qwen3-Coder XML tool calls end to end: the `openai` client, Ollama's API and the
Responses API against a tiny GGUF carrying Qwen 3.5's real chat template (`<tool_call>`,
`</tool_call>`, `<think>` and `</think>` single tokens, as in Qwen's vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from gguf_builder import _vocab  # noqa: E402

from support import LIGHT_TOOL, check_light, gguf_daemon, streamed_chat  # noqa: E402

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "Qwen3.5-4B.jinja"
USER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
THINK, UNTHINK, TOOL_CALL = (len(_vocab()[0]) + i for i in range(3))
LIGHT = LIGHT_TOOL
QUESTION = [{"role": "user", "content": "Lights in the hall?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    process = gguf_daemon(tmp_path_factory, {"qwen35": {
        "seed": 3, "n_ctx": 4096, "chat_template": TEMPLATE.read_text(), "user_tokens": USER_TOKENS}})
    yield process
    process.stop()


def test_calls_are_read_by_their_parameters_types(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "qwen35", "messages": QUESTION, "tools": [LIGHT], "tool_choice": "required",
                              "temperature": 1.0, "max_tokens": 2000, "extra_body": NO_THINKING}
    for seed in range(4):
        choice = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
        calls = choice.message.tool_calls or []
        assert calls and all(call.function.name == "set_light" for call in calls)
        whole = [check_light(call.function.arguments) for call in calls]
        # llama-server's compact JSON: no spaces between members.
        assert calls[0].function.arguments == json.dumps(whole[0], separators=(",", ":"))
        _, content, streamed, finish = streamed_chat(client.chat.completions.create(stream=True, seed=seed, **kwargs))
        assert content == "" and finish == "tool_calls"
        assert [name for name, _ in streamed] == ["set_light"] * len(calls)
        assert [json.loads(arguments) for _, arguments in streamed] == whole
    single = client.chat.completions.create(parallel_tool_calls=False, seed=1, **kwargs).choices[0]
    assert len(single.message.tool_calls or []) == 1


def test_the_model_reasons_before_it_calls(client: openai.OpenAI) -> None:
    # The prompt opens <think>: a required call holds after the model closes its reasoning
    # (pushed by a bias on </think>), which comes back apart.
    kwargs: dict[str, Any] = {"model": "qwen35", "messages": QUESTION, "tools": [LIGHT], "tool_choice": "required",
                              "parallel_tool_calls": False, "temperature": 1.0, "max_tokens": 2000,
                              "logit_bias": {str(UNTHINK): 4}}
    for seed in range(2):
        message = client.chat.completions.create(seed=seed, **kwargs).choices[0].message
        assert getattr(message, "reasoning_content", None) and message.content is None
        check_light((message.tool_calls or [])[0].function.arguments)
        reasoning, content, streamed, finish = streamed_chat(
            client.chat.completions.create(stream=True, seed=seed, **kwargs))
        assert (reasoning, content, finish) == (message.reasoning_content, "", "tool_calls")
        assert [json.loads(a) for _, a in streamed] == [json.loads(c.function.arguments) for c in message.tool_calls or []]


def test_a_call_inside_the_reasoning_ends_it(client: openai.OpenAI) -> None:
    # As llama-server reads these templates: `<tool_call>` ends unclosed reasoning, and the call
    # is a call ("auto": the lazy grammar holds from that token on, pushed by a bias).
    kwargs: dict[str, Any] = {"model": "qwen35", "messages": QUESTION, "tools": [LIGHT], "temperature": 1.0,
                              "max_tokens": 2000, "parallel_tool_calls": False, "seed": 2,
                              "logit_bias": {str(TOOL_CALL): 6}}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    message = choice.message
    # This seed writes "e" and the call, no </think> (the tiny model's choice); the newline the
    # prompt put after <think> is not reasoning (llama-server drops it for these templates).
    assert getattr(message, "reasoning_content", None) == "e" and message.content is None
    check_light((message.tool_calls or [])[0].function.arguments)
    reasoning, content, streamed, finish = streamed_chat(client.chat.completions.create(stream=True, **kwargs))
    assert (reasoning or None, content, finish) == (getattr(message, "reasoning_content", None), "", "tool_calls")
    assert [a for _, a in streamed] == [c.function.arguments for c in message.tool_calls or []]
    # Unsplit (reasoning_format none), the text before the call is the content, with the tag
    # the prompt opened in front.
    raw = client.chat.completions.create(extra_body={"reasoning_format": "none"}, **kwargs).choices[0].message
    assert raw.content == "<think>\ne"
    assert [c.function.arguments for c in raw.tool_calls or []] == [c.function.arguments for c in message.tool_calls or []]


def test_the_tool_loop_goes_back_through_the_template(client: openai.OpenAI, daemon: Any) -> None:
    """A call and its result go back through the template (which iterates the arguments as an
    object: backends/test_llamacpp_tools.py checks the prompt against llama-server's), from
    the `openai` client and from Ollama's API, whose arguments are objects already."""
    kwargs: dict[str, Any] = {"model": "qwen35", "tools": [LIGHT], "tool_choice": "required", "temperature": 0,
                              "parallel_tool_calls": False, "max_tokens": 2000, "extra_body": NO_THINKING}
    reply = client.chat.completions.create(messages=QUESTION, **kwargs).choices[0].message
    assert reply.tool_calls
    answered = [*QUESTION, reply, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "done"}]
    base = client.chat.completions.create(model="qwen35", messages=QUESTION, tools=[LIGHT], max_tokens=1)
    after = client.chat.completions.create(model="qwen35", messages=answered, tools=[LIGHT], max_tokens=1)
    assert base.usage is not None and after.usage is not None
    call_text = "<tool_call>\n<function=set_light>\n</function>\n</tool_call>" + "done"
    assert after.usage.prompt_tokens > base.usage.prompt_tokens + len(call_text)
    arguments = json.loads(reply.tool_calls[0].function.arguments)
    body = {"model": "qwen35", "stream": False, "tools": [LIGHT], "think": False, "options": {"num_predict": 1},
            "messages": [*QUESTION, {"role": "assistant", "content": "",
                                     "tool_calls": [{"function": {"name": "set_light", "arguments": arguments}}]},
                         {"role": "tool", "tool_name": "set_light", "content": "done"}]}
    response = httpx.post(f"http://127.0.0.1:{daemon.http_port}/api/chat", json=body, timeout=60)
    assert response.status_code == 200, response.text
    # The same conversation, the same prompt (Ollama's think false is enable_thinking false).
    no_thinking = client.chat.completions.create(model="qwen35", messages=answered, tools=[LIGHT], max_tokens=1,
                                                 extra_body=NO_THINKING)
    assert no_thinking.usage is not None
    assert response.json()["prompt_eval_count"] == no_thinking.usage.prompt_tokens


def test_responses_function_calls(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "set_light", "parameters": LIGHT["function"]["parameters"]}
    response = client.responses.create(model="qwen35", input="Lights in the hall?", tools=[tool], tool_choice="required",
                                       temperature=1.0, max_output_tokens=2000, parallel_tool_calls=False)
    calls = [item for item in response.output if item.type == "function_call"]
    # The reasoning the prompt opened (the tiny model closes it soon), then the call.
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.status == "completed" and len(calls) == 1
    assert calls[0].name == "set_light" and check_light(calls[0].arguments)


def test_what_raw_text_cannot_hold_is_refused(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="qwen35", messages=QUESTION, tools=[tool], tool_choice="required",
                                       max_tokens=10)
    assert "tools[f].parameters.properties.code: keyword 'pattern' cannot be enforced" in str(caught.value)
