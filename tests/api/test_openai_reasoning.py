"""A thinking model's reasoning on the chat route, end to end with the `openai` client: tiny
GGUF models carrying the real Qwen 3 template (the model opens `<think>` itself) and DeepSeek
R1's (the prompt opens it), their vocabularies holding `<think>` and `</think>` as tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")

from gguf_builder import _vocab, write_tiny_llama  # noqa: E402

from daemon.api.reasoning import split  # noqa: E402

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
MODELS = {
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "r1": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "qwen25": "Qwen-Qwen2.5-7B-Instruct.jinja",  # no thinking
    # [THINK] ... [/THINK], control tokens in Ministral's vocabulary (they write no text unless kept).
    "ministral": "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
}
TAGS = ("<think>", "</think>")
OPEN, CLOSE = len(_vocab()[0]), len(_vocab()[0]) + 1
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    repo = tmp_path_factory.mktemp("thinking")
    for name, template in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        tokens = {"control_tokens": ("[THINK]", "[/THINK]")} if name == "ministral" else {"user_tokens": TAGS}
        write_tiny_llama(repo / name / "1" / "model.gguf", n_ctx=2048, chat_template=(TEMPLATES / template).read_text(),
                         **tokens)
        (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n')
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


def ask(client: Any, **kwargs: Any) -> Any:
    return client.chat.completions.create(messages=HI, temperature=1.0, **kwargs).choices[0]


def streamed(client: Any, **kwargs: Any) -> tuple[str, str, list[str]]:
    """(reasoning, content, the kind of each delta in order) of a streamed reply."""
    reasoning, content, kinds = "", "", []
    for event in client.chat.completions.create(messages=HI, temperature=1.0, stream=True, **kwargs):
        for choice in event.choices:
            thought = (choice.delta.model_extra or {}).get("reasoning_content")
            if thought:
                reasoning += thought
                kinds.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                kinds.append("content")
    return reasoning, content, kinds


def thinking_seed(client: Any, bias: dict[str, int], max_tokens: int, model: str = "qwen3",
                  tags: tuple[str, str] = TAGS) -> tuple[int, str]:
    """A seed whose raw reply (reasoning_format none) reasons and then answers, and that raw
    reply; drawn, since which seed does so depends on the CPU's arithmetic."""
    for seed in range(60):
        raw = ask(client, model=model, seed=seed, max_tokens=max_tokens, logit_bias=bias,
                  extra_body={"reasoning_format": "none"}).message.content
        if raw.startswith(tags[0]) and tags[1] in raw and not raw.startswith("".join(tags)):
            tail = raw.partition(tags[1])[2]
            if tail.strip():
                return seed, raw
    pytest.fail("no seed of 60 reasoned and answered")


def test_the_reasoning_comes_apart_from_the_answer(client: Any) -> None:
    bias = {str(OPEN): 16, str(CLOSE): 6}
    seed, raw = thinking_seed(client, bias, 24)
    kwargs = {"model": "qwen3", "seed": seed, "max_tokens": 24, "logit_bias": bias}
    message = ask(client, **kwargs).message
    reasoning, content = split(raw, TAGS, opened=None, trim=False)
    assert reasoning and content
    assert (message.model_extra or {}).get("reasoning_content") == reasoning
    assert message.content == content
    # "auto" and "deepseek" are the default; streamed, the deltas add up to the same, the
    # reasoning first.
    same = ask(client, extra_body={"reasoning_format": "deepseek"}, **kwargs).message
    assert (same.content, (same.model_extra or {}).get("reasoning_content")) == (content, reasoning)
    thought, answer, kinds = streamed(client, **kwargs)
    assert (thought, answer) == (reasoning, content)
    assert kinds == sorted(kinds, key=lambda kind: kind != "reasoning")


def test_a_prompt_that_opens_the_reasoning(client: Any) -> None:
    # DeepSeek R1's prompt ends with "<think>\n": the reply is reasoning up to "</think>",
    # which starts with that newline (llama-server's split); cut before it, all reasoning.
    raw = ask(client, model="r1", seed=1, max_tokens=12, extra_body={"reasoning_format": "none"}).message.content
    assert raw.startswith("<think>\n")  # as llama-server's "none" shows it
    generated = raw[len("<think>\n"):]
    message = ask(client, model="r1", seed=1, max_tokens=12).message
    assert (message.model_extra or {}).get("reasoning_content") == split(generated, TAGS, opened="\n", trim=False)[0]
    assert "</think>" in generated or (message.content == "" and message.model_extra["reasoning_content"] == "\n" + generated)
    thought, answer, _ = streamed(client, model="r1", seed=1, max_tokens=12)
    assert (thought, answer) == (message.model_extra["reasoning_content"], message.content)


def test_reasoning_format_none_and_non_thinking_models_leave_the_text(client: Any) -> None:
    bias = {str(OPEN): 16, str(CLOSE): 6}
    seed, raw = thinking_seed(client, bias, 24)
    none = ask(client, model="qwen3", seed=seed, max_tokens=24, logit_bias=bias, extra_body={"reasoning_format": "none"})
    assert "reasoning_content" not in (none.message.model_extra or {})
    thought, answer, _ = streamed(client, model="qwen3", seed=seed, max_tokens=24, logit_bias=bias,
                                  extra_body={"reasoning_format": "none"})
    assert (thought, answer) == ("", raw)
    # A template without thinking tags: its text, tags and all, is the answer.
    for seed in range(60):
        plain = ask(client, model="qwen25", seed=seed, max_tokens=24, logit_bias=bias).message
        if plain.content.startswith("<think>") and "</think>" in plain.content:
            break
    else:
        pytest.fail("no seed of 60 wrote the tags")
    assert "reasoning_content" not in (plain.model_extra or {})
    with pytest.raises(openai.BadRequestError, match="reasoning_format: 'deepseek-legacy' is not one of none, auto"):
        ask(client, model="qwen3", max_tokens=1, extra_body={"reasoning_format": "deepseek-legacy"})


def test_enable_thinking_false_closes_the_reasoning_in_the_prompt(client: Any) -> None:
    on = client.chat.completions.create(model="r1", messages=HI, max_tokens=1)
    off = client.chat.completions.create(model="r1", messages=HI, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 1  # "</think>" after "<think>\n"
    # Closed in the prompt, the reply is the answer.
    message = ask(client, model="r1", seed=0, max_tokens=8,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}}).message
    assert "reasoning_content" not in (message.model_extra or {})


def test_past_reasoning_goes_back_to_the_template(client: Any) -> None:
    # Qwen 3 shows the reasoning of the turns after the last user message (an agent's loop).
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    def turn(reasoning: str | None) -> int:
        assistant: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
        if reasoning is not None:
            assistant["reasoning_content"] = reasoning
        messages = [*HI, assistant, {"role": "tool", "content": "18 C", "tool_call_id": "call00001"}]
        return client.chat.completions.create(model="qwen3", messages=messages, tools=[tool], max_tokens=1).usage.prompt_tokens
    assert turn("Let me look the weather up first.") > turn(None)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.reasoning_content: only on assistant messages"):
        client.chat.completions.create(model="qwen3", max_tokens=1,
                                       messages=[{"role": "user", "content": "x", "reasoning_content": "y"}])


def test_a_json_answer_after_an_opened_reasoning(client: Any) -> None:
    # R1's prompt opened the reasoning: the output grammar holds after "</think>", so the
    # answer, not the reasoning, is the JSON (before, the JSON went into the reasoning).
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for seed in range(40):
        choice = ask(client, model="r1", seed=seed, max_tokens=60, response_format=fmt, logit_bias={str(CLOSE): 3})
        if choice.finish_reason == "stop":
            break
    else:
        pytest.fail("no seed of 40 closed the reasoning and finished the JSON")
    assert (choice.message.model_extra or {}).get("reasoning_content")
    assert set(json.loads(choice.message.content)) == {"a"}


def test_a_json_answer_after_reasoning_the_model_opens(client: Any) -> None:
    # Qwen 3 opens its reasoning itself: the output grammar lets it reason first (its opening
    # tag, any text, its closing tag) and holds after that, as llama-server's does; before,
    # the grammar held from the first token and the model could not think.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    bias = {str(OPEN): 8, str(CLOSE): 8}
    for seed in range(40):
        choice = ask(client, model="qwen3", seed=seed, max_tokens=80, response_format=fmt, logit_bias=bias)
        if choice.finish_reason == "stop" and (choice.message.model_extra or {}).get("reasoning_content"):
            break
    else:
        pytest.fail("no seed of 40 closed the reasoning and finished the JSON")
    thought = (choice.message.model_extra or {}).get("reasoning_content")
    assert thought and "</think>" not in thought
    assert set(json.loads(choice.message.content)) == {"a"}
    # Streamed alike.
    reasoning, content, _ = streamed(client, model="qwen3", seed=seed, max_tokens=80, response_format=fmt,
                                     logit_bias=bias)
    assert (reasoning, content) == (thought, choice.message.content)
    # A model that does not open its reasoning (here: pushed to "{") answers in the format at once.
    brace = _vocab()[0].index("{")
    plain = ask(client, model="qwen3", seed=0, max_tokens=80, response_format=fmt, logit_bias={str(brace): 30})
    assert plain.finish_reason == "stop" and set(json.loads(plain.message.content)) == {"a"}
    assert not (plain.message.model_extra or {}).get("reasoning_content")


def test_control_token_tags_keep_their_text(client: Any) -> None:
    # Ministral 3's [THINK] and [/THINK] are control tokens, which write no text: kept (as
    # llama-server's preserved tokens), the reasoning comes apart as with <think>.
    tags = ("[THINK]", "[/THINK]")
    bias = {str(OPEN): 26, str(CLOSE): 26}  # zero output rows: the logit is the bias
    seed, raw = thinking_seed(client, bias, 24, model="ministral", tags=tags)
    message = ask(client, model="ministral", seed=seed, max_tokens=24, logit_bias=bias).message
    reasoning, content = split(raw, tags, opened=None, trim=False)
    assert reasoning and content
    assert ((message.model_extra or {}).get("reasoning_content"), message.content) == (reasoning, content)
    # Their logprob entries carry the text too, so the tokens still spell the reply.
    scored = ask(client, model="ministral", seed=seed, max_tokens=24, logit_bias=bias, logprobs=True,
                 extra_body={"reasoning_format": "none"})
    assert "".join(entry.token for entry in scored.logprobs.content) == raw


def test_a_reasoning_budget_ends_the_reasoning(client: Any) -> None:
    """llama-server's `reasoning_budget_tokens` (or `thinking_budget_tokens`): the reasoning
    the prompt opened (R1) ends after that many tokens, with `reasoning_budget_message` and the
    closing tag forced in, though the closing tag is biased away here, and the answer follows.
    Without a budget the same seed reasons to max_tokens; with one, its reasoning is where that
    reasoning starts."""
    kwargs: dict[str, Any] = {"model": "r1", "seed": 5, "max_tokens": 16, "logit_bias": {str(CLOSE): -100}}
    free = ask(client, **kwargs).message
    assert free.content == "" and free.model_extra["reasoning_content"]
    capped = ask(client, extra_body={"reasoning_budget_tokens": 4}, **kwargs).message
    thought = capped.model_extra["reasoning_content"]
    assert thought and free.model_extra["reasoning_content"].startswith(thought) and thought != free.model_extra["reasoning_content"]
    assert capped.content
    assert streamed(client, extra_body={"thinking_budget_tokens": 4}, **kwargs)[:2] == (thought, capped.content)
    said = ask(client, extra_body={"reasoning_budget_tokens": 0, "reasoning_budget_message": "Enough."}, **kwargs).message
    assert said.model_extra["reasoning_content"].strip() == "Enough." and said.content


@pytest.mark.parametrize(("model", "extra", "message"), [
    ("r1", {"reasoning_budget_tokens": 2, "thinking_budget_tokens": 3}, "reasoning_budget_tokens and thinking_budget_tokens disagree"),
    ("r1", {"reasoning_budget_message": "x"}, "reasoning_budget_message: only with reasoning_budget_tokens"),
    ("r1", {"reasoning_budget_tokens": -2}, "reasoning_budget_tokens must be -1 (none) or between 0 and 2147483647, got -2"),
    ("qwen25", {"reasoning_budget_tokens": 8}, "reasoning_budget_tokens: the model's chat template has no reasoning"),
    ("r1", {"reasoning_budget_tokens": 8, "reasoning_budget_message": "Done.</think>"},
     "reasoning_budget_message: must not hold the closing tag '</think>'"),
    # The end-of-generation token's text would end the output instead of the reasoning.
    ("r1", {"reasoning_budget_tokens": 0, "reasoning_budget_message": "Done.</s>"},
     "reasoning_budget_message: holds '</s>', model 'r1''s end-of-generation token, which would end the output there"),
])
def test_reasoning_budget_fields_are_checked(client: Any, model: str, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        ask(client, model=model, max_tokens=2, extra_body=extra)
    # -1 is no budget, as llama-server reads it.
    assert ask(client, model="r1", max_tokens=2, extra_body={"reasoning_budget_tokens": -1}).finish_reason == "length"


def control(daemon: Any, model: str, ident: str) -> Any:
    reply = daemon.post_json("/v1/chat/completions/control", {"model": model, "id": ident, "action": "reasoning_end"})
    assert reply.status == 200, reply.body
    return reply.json()


def test_reasoning_control_ends_the_reasoning_while_it_runs(client: Any, daemon: Any) -> None:
    """llama-server's `reasoning_control` and POST /v1/chat/completions/control (its web UI's
    "stop thinking"): the reasoning the prompt opened (R1), which the bias keeps from ever
    closing, ends when asked; its closing tag is forced in and the answer follows."""
    kwargs: dict[str, Any] = {"model": "r1", "seed": 5, "max_tokens": 1500, "logit_bias": {str(CLOSE): -100},
                              "extra_body": {"ignore_eos": True, "reasoning_control": True,
                                             "reasoning_budget_message": " Enough."}}
    kinds: list[str] = []
    answer = thought = ""
    outcome: Any = None
    for event in client.chat.completions.create(messages=HI, temperature=1.0, stream=True, **kwargs):
        for choice in event.choices:
            if (choice.delta.model_extra or {}).get("reasoning_content"):
                kinds.append("reasoning")
                thought += choice.delta.model_extra["reasoning_content"]
            if choice.delta.content:
                kinds.append("content")
                answer += choice.delta.content
        if outcome is None and len(kinds) >= 3:
            outcome = control(daemon, "r1", event.id)
    assert outcome == {"success": True}
    assert "content" in kinds and answer
    # The message goes in before the closing tag, as when a budget runs out.
    assert thought.endswith(" Enough."), thought
    # Reasoning, then the answer: the reasoning did not come back.
    assert kinds == sorted(kinds, key=lambda kind: kind != "reasoning")
    # Without the control the same request reasons to its end.
    kwargs["max_tokens"] = 40
    free = ask(client, **kwargs).message
    assert free.content == "" and free.model_extra["reasoning_content"]


def test_reasoning_control_answers(client: Any, daemon: Any) -> None:
    assert control(daemon, "r1", "chatcmpl-none") == {"success": False, "message": "no active completion for this id"}
    # A completion that did not ask for control, and a model that does not reason (the UI
    # sends reasoning_control with every request: taken, nothing to end).
    # A reasoning budget alone arms no control either.
    for model, extra in (("r1", {}), ("r1", {"reasoning_budget_tokens": 1000}), ("qwen25", {"reasoning_control": True})):
        stream = client.chat.completions.create(messages=HI, model=model, max_tokens=1500, stream=True,
                                                extra_body={"ignore_eos": True, **extra})
        event = next(iter(stream))
        outcome = control(daemon, model, event.id)
        stream.close()
        assert outcome["success"] is False and outcome["message"].startswith("reasoning control not enabled")
    reply = daemon.post_json("/v1/chat/completions/control", {"model": "r1", "id": "x", "action": "pause"})
    assert reply.status == 400 and "action" in reply.json()["error"]["message"]


# llama-server's prompts for these conversations on these templates (its /apply-template,
# tests/fixtures/oracle/prefill.py): the last assistant message continued, its reasoning
# between the template's own tags.
R1_ASSISTANT = "<\uff5cAssistant\uff5c>"  # its bars are full-width
CONTINUED = {
    ("qwen25", "", "The sky is"): "<|im_start|>assistant\nThe sky is",
    ("r1", "", "The sky is"): R1_ASSISTANT + "<think></think>The sky is",
    ("r1", "Let me think", ""): R1_ASSISTANT + "<think>Let me think",
    ("r1", "Let me think", "Sure"): R1_ASSISTANT + "<think>Let me think</think>Sure",
    ("qwen3", "", "The sky is"): "<|im_start|>assistant\n<think>\n\n</think>\n\nThe sky is",
    ("qwen3", "Let me think", ""): "<|im_start|>assistant\n<think>\nLet me think",
    ("qwen3", "Let me think", "Sure"): "<|im_start|>assistant\n<think>\nLet me think\n</think>\n\nSure",
}


@pytest.mark.parametrize(("model", "thought", "said"), list(CONTINUED))
def test_a_trailing_assistant_message_is_continued(client: Any, daemon: Any, model: str, thought: str, said: str) -> None:
    """llama-server's default (--prefill-assistant), and its continue_final_message: the prompt
    ends inside the last assistant message, and the reply begins with it."""
    last: dict[str, Any] = {"role": "assistant", "content": said}
    if thought:
        last["reasoning_content"] = thought
    messages = [*HI, last]
    prompt = daemon.post_ok("/apply-template", {"model": model, "messages": messages})["prompt"]
    assert prompt.endswith(CONTINUED[model, thought, said]), prompt
    asked = daemon.post_ok("/apply-template", {"model": model, "messages": messages,
                                               "continue_final_message": True, "add_generation_prompt": False})
    assert asked["prompt"] == prompt
    body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(CLOSE): -100}}
    reply = daemon.post_ok("/v1/chat/completions", body)["choices"][0]["message"]
    # The model's own continuation of that prompt, after what the message held.
    more = daemon.post_ok("/completion", {"model": model, "prompt": prompt, "n_predict": 6, "temperature": 0,
                                          "ignore_eos": True, "logit_bias": [[CLOSE, -100]]})["content"]
    if said or not thought:
        assert reply["content"] == said + more and reply.get("reasoning_content", "") == thought
    else:  # the reasoning goes on
        assert reply["content"] == "" and reply["reasoning_content"] == thought + more
    events = [json.loads(line[6:]) for line in daemon.post_json("/v1/chat/completions", {**body, "stream": True})
              .body.decode().split("\n") if line.startswith("data: {")]
    streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert streamed == reply["content"]


@pytest.mark.parametrize(("messages", "extra", "pattern"), [
    ([*HI, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], {},
     "cannot have 2 or more assistant messages at the end of the list"),
    ([*HI, {"role": "assistant", "content": "a"}], {"continue_final_message": True},
     "continue_final_message: cannot be used with add_generation_prompt true"),
    (HI, {"continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message: the last message must be the assistant's"),
    (HI, {"add_generation_prompt": False}, "add_generation_prompt: false is only taken with a last assistant message"),
    ([*HI, {"role": "assistant", "content": "a"}], {"continue_final_message": "all", "add_generation_prompt": False},
     "continue_final_message: true, \"content\" or \"reasoning_content\", got 'all'"),
    ([{"role": "assistant", "content": "a"}], {}, "continuing an assistant message needs a message before it"),
    ([*HI, {"role": "assistant", "content": "{"}], {"response_format": {"type": "json_object"}},
     "response_format: not supported when continuing an assistant message"),
])
def test_continuing_refuses_what_it_cannot_do(client: Any, messages: list[Any], extra: dict[str, Any], pattern: str) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(pattern)):
        client.chat.completions.create(model="qwen25", messages=messages, max_tokens=1, extra_body=extra)


def test_a_continued_reasoning_counts_against_the_budget(daemon: Any) -> None:
    """The reasoning a continued message holds is inside the budget, as the tokens after a
    prompt's opening tag are for llama-server: spent already, the end is forced at once."""
    body = {"model": "r1", "messages": [*HI, {"role": "assistant", "content": "", "reasoning_content": "Let me think"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logit_bias": {str(CLOSE): -100}}
    free = daemon.post_ok("/v1/chat/completions", body)["choices"][0]["message"]
    assert free["content"] == "" and free["reasoning_content"].startswith("Let me think")
    capped = daemon.post_ok("/v1/chat/completions", {**body, "reasoning_budget_tokens": 2})["choices"][0]["message"]
    assert capped["reasoning_content"] == "Let me think" and capped["content"]
