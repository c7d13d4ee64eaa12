"""A thinking model's reasoning on the Responses route, end to end with the `openai` client:
a `reasoning` item before the message, whole and streamed, its tokens counted in `usage`, and
reasoning items sent back in `input`. Tiny GGUF models carry DeepSeek R1's template (the
prompt opens `<think>`, so the model reasons until it writes `</think>`), Qwen 3's (it shows
past reasoning to the model) and Qwen 2.5's (no thinking). The Responses API has no seed or
logit_bias, so the replies compared with the chat route are greedy, and the inputs are drawn
until a reply does what a test needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from gguf_builder import write_tiny_llama  # noqa: E402

from daemon.api.openai_responses import _Thinking  # noqa: E402
from daemon.api.reasoning import split  # noqa: E402
from daemon.backend import GenerateChunk, TokenLogprob  # noqa: E402

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
MODELS = {
    "r1": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "qwen25": "Qwen-Qwen2.5-7B-Instruct.jinja",  # no thinking
}
TAGS = ("<think>", "</think>")
LOGPROBS = "message.output_text.logprobs"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    repo = tmp_path_factory.mktemp("thinking")
    for name, template in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        write_tiny_llama(repo / name / "1" / "model.gguf", n_ctx=1024, user_tokens=TAGS,
                         chat_template=(TEMPLATES / template).read_text())
        (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n')
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


def raw_reply(client: Any, model: str, question: str, max_tokens: int) -> str:
    """The greedy reply's text as the model wrote it (the chat route's reasoning_format none)."""
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=max_tokens,
        extra_body={"reasoning_format": "none"},
    ).choices[0].message.content


def r1_question(client: Any, max_tokens: int, *, closes: bool) -> tuple[str, str]:
    """A question whose greedy R1 reply closes its reasoning and answers (`closes`) or is cut
    while it reasons, and what it generated after the prompt's "<think>"; drawn, since which
    does so depends on the CPU's arithmetic."""
    for number in range(40):
        question = f"Question {number}"
        raw = raw_reply(client, "r1", question, max_tokens)
        assert raw.startswith("<think>\n")  # the prompt's tag and whitespace, as llama-server shows them
        generated = raw.removeprefix("<think>")
        _, answer = split(generated, TAGS, opened="", trim=False)
        if (bool(answer.strip()) if closes else TAGS[1] not in generated):
            return question, generated
    pytest.fail(f"no question of 40 {'closed the reasoning and answered' if closes else 'kept reasoning'}")


def test_the_reasoning_is_an_item_before_the_message(client: Any) -> None:
    question, generated = r1_question(client, 24, closes=True)
    thought, answer = split(generated, TAGS, opened="", trim=False)
    response = client.responses.create(model="r1", input=question, temperature=0, max_output_tokens=24,
                                       include=[LOGPROBS])
    assert [item.type for item in response.output] == ["reasoning", "message"]
    item, message = response.output
    assert item.id.startswith("rs_") and item.summary == [] and item.encrypted_content is None
    assert item.status == "completed" and message.status == "incomplete" and response.status == "incomplete"
    assert [(part.type, part.text) for part in item.content or []] == [("reasoning_text", thought)]
    assert thought.startswith("\n")  # the whitespace after the prompt's tag, as the chat route's split
    assert response.output_text == answer
    # The answer's logprobs are the answer's tokens only (none after the tag here is whitespace).
    assert "".join(entry.token for entry in message.content[0].logprobs) == answer
    # The reasoning's tokens run to the closing tag: one token less and it is not out yet.
    usage = response.usage
    reasoning_tokens = usage.output_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < usage.output_tokens == 24
    assert TAGS[1] in raw_reply(client, "r1", question, reasoning_tokens)
    if reasoning_tokens > 1:
        assert TAGS[1] not in raw_reply(client, "r1", question, reasoning_tokens - 1)


def test_streamed_reasoning_adds_up_to_the_whole(client: Any) -> None:
    question, _ = r1_question(client, 24, closes=True)
    kwargs = {"model": "r1", "input": question, "temperature": 0, "max_output_tokens": 24}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.reasoning_text.delta")
    assert deltas > 0 and kinds[:4 + deltas + 3] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
    ]
    assert kinds[4 + deltas + 3:4 + deltas + 5] == ["response.output_item.added", "response.content_part.added"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    thought = whole.output[0].content[0].text
    assert "".join(event.delta for event in events if event.type == "response.reasoning_text.delta") == thought
    added, part, done = events[2], events[3], events[4 + deltas]
    assert added.output_index == 0 and added.item.type == "reasoning" and added.item.status == "in_progress"
    assert part.part.type == "reasoning_text" and part.part.text == ""
    assert done.text == thought and done.item_id == added.item.id and done.output_index == 0
    assert {event.output_index for event in events if event.type == "response.output_text.delta"} == {1}
    final = events[-1].response
    assert final.output_text == whole.output_text and final.output[0].content[0].text == thought
    assert final.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens


def test_a_json_answer_after_the_reasoning_with_the_clients_helpers(client: Any) -> None:
    # R1's prompt opened the reasoning: text.format's grammar holds from "</think>" on, so the
    # answer is the JSON and the reply completes (the helpers parse only completed replies).
    class Answer(pydantic.BaseModel):
        ok: bool

    for number in range(40):
        kwargs = {"model": "r1", "input": f"Question {number}", "temperature": 0, "max_output_tokens": 60,
                  "text_format": Answer}
        parsed = client.responses.parse(**kwargs)
        if parsed.status == "completed":
            break
    else:
        pytest.fail("no question of 40 closed the reasoning and finished the JSON")
    assert [item.type for item in parsed.output] == ["reasoning", "message"]
    thought = parsed.output[0].content[0].text
    assert thought and isinstance(parsed.output_parsed, Answer)
    with client.responses.stream(**kwargs) as stream:
        texts = [event.delta for event in stream if event.type == "response.reasoning_text.delta"]
        helped = stream.get_final_response()
    assert "".join(texts) == thought
    assert [item.type for item in helped.output] == ["reasoning", "message"]
    assert helped.output[0].content[0].text == thought and helped.output_parsed == parsed.output_parsed


def test_a_reply_cut_while_it_reasons_is_the_reasoning_alone(client: Any) -> None:
    question, generated = r1_question(client, 8, closes=False)
    kwargs = {"model": "r1", "input": question, "temperature": 0, "max_output_tokens": 8}
    response = client.responses.create(**kwargs)
    # No message item: OpenAI's reply cut while reasoning holds no message either.
    [item] = response.output
    assert item.type == "reasoning" and item.status == "incomplete" and response.status == "incomplete"
    assert item.content[0].text == generated  # from the newline after the prompt's tag
    assert response.output_text == ""
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 8
    events = list(client.responses.create(stream=True, **kwargs))
    assert not any(event.type.startswith("response.output_text") for event in events)
    assert events[-1].type == "response.incomplete"
    assert [i.type for i in events[-1].response.output] == ["reasoning"]
    assert events[-1].response.output[0].content[0].text == item.content[0].text


def test_a_model_without_thinking_tags_is_unchanged(client: Any) -> None:
    # Its tags, written as text, are its answer's, as on the chat route.
    for number in range(40):
        question = f"Question {number}"
        raw = raw_reply(client, "qwen25", question, 24)
        if TAGS[1] in raw:
            break
    else:
        pytest.fail("no question of 40 wrote a tag")
    response = client.responses.create(model="qwen25", input=question, temperature=0, max_output_tokens=24)
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == raw
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    kinds = {event.type for event in client.responses.create(model="qwen25", input=question, temperature=0,
                                                              max_output_tokens=24, stream=True)}
    assert not any("reasoning" in kind for kind in kinds)


def chat_prompt_tokens(client: Any, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    return client.chat.completions.create(model="qwen3", messages=messages, max_tokens=1, **kwargs).usage.prompt_tokens


def test_reasoning_items_go_back_into_the_prompt(client: Any) -> None:
    # A reply's output sent back as it came (the client's own objects): its reasoning is the
    # next prompt's, where Qwen 3's template shows it (an assistant turn after the last user
    # message), as the chat route's reasoning_content.
    question, _ = r1_question(client, 24, closes=True)
    reply = client.responses.create(model="r1", input=question, temperature=0, max_output_tokens=24)
    thought, answer = reply.output[0].content[0].text, reply.output_text
    user = {"role": "user", "content": question}

    def input_tokens(items: list[Any]) -> int:
        return client.responses.create(model="qwen3", input=[user, *items], max_output_tokens=1).usage.input_tokens

    with_reasoning = input_tokens(list(reply.output))
    assert with_reasoning > input_tokens(list(reply.output[1:]))
    # (The chat route continues a trailing assistant message, as llama-server: its prompt for
    # these messages ends inside the reply, where the Responses input starts a new turn.)
    continued = chat_prompt_tokens(client, [user, {"role": "assistant", "content": answer, "reasoning_content": thought}])
    assert with_reasoning > continued
    # Before a function call, the reasoning is the calling turn's.
    reasoning = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]}
    call = {"type": "function_call", "call_id": "call00001", "name": "get_weather", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "call00001", "output": "18 C"}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    chat_call = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    responses = client.responses.create(
        model="qwen3", input=[user, reasoning, call, result], max_output_tokens=1,
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    ).usage.input_tokens
    assert responses == chat_prompt_tokens(client, [
        user, {"role": "assistant", "content": None, "tool_calls": [chat_call], "reasoning_content": "Look it up."},
        {"role": "tool", "content": "18 C", "tool_call_id": "call00001"},
    ], tools=[tool])
    # A reply cut while it reasoned, sent back before the next question: a turn of its own.
    cut = input_tokens([reasoning, {"role": "user", "content": "And?"}])
    assert cut == chat_prompt_tokens(client, [
        user, {"role": "assistant", "content": "", "reasoning_content": "Look it up."},
        {"role": "user", "content": "And?"}])


@pytest.mark.parametrize(("extra", "pattern"), [
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
     r"input\[0\]\.encrypted_content: not supported; this server never issues encrypted reasoning"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}]},
     r"input\[0\]\.summary: not supported"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "text", "text": "x"}]}]},
     r"input\[0\]: .*content\[0\]\.type"),
    ({"reasoning": {"effort": "low"}}, r"reasoning\.effort: the chat template of model .r1. has no reasoning levels"),
    ({"reasoning": {"summary": "auto"}}, r"reasoning\.summary: not supported"),
    ({"reasoning": {"budget": 3}}, "unknown field `budget`"),
])
def test_what_is_not_offered_is_a_400_naming_it(client: Any, extra: dict[str, Any], pattern: str) -> None:
    with pytest.raises(openai.BadRequestError, match=pattern):
        client.responses.create(model="r1", extra_body={"input": "x", "max_output_tokens": 1, **extra})
    # All null is accepted (as clients send the defaults).
    client.responses.create(model="r1", input="x", max_output_tokens=1, reasoning={"effort": None, "summary": None})


def entry(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, piece=b"", logprob=-1.0)


def test_a_reply_that_opens_its_reasoning_itself() -> None:
    # Qwen 3's way (its prompt does not open the reasoning); a random model writes "<think>"
    # first only with a logit bias, which the Responses API does not take: the route's split
    # on the chunks the engine sends, one per token.
    thinking = _Thinking(TAGS, None)
    chunks = [(" ", 1), ("<think>", 2), ("Hm", 3), ("</think>", 4), ("\n\n", 5), ("Hi", 6)]
    fed = [thinking.feed(GenerateChunk(text=text, token_ids=[i], logprobs=[entry(i)])) for text, i in chunks]
    last = thinking.feed(GenerateChunk(text="", token_ids=[7], logprobs=[entry(7)], finish_reason="stop"))
    assert "".join(thought for thought, _, _ in fed) == "Hm" and "".join(answer for _, answer, _ in fed) == "Hi"
    # The space, the tags and the reasoning are the reasoning's tokens; the answer's logprobs
    # are its text's and the end token's.
    assert thinking.tokens == 4
    assert [[e.token_id for e in logprobs] for _, _, logprobs in [*fed, last]] == [[], [], [], [], [], [6], [7]]
    # An answer that only starts like the tag: its held tokens are the answer's.
    plain = _Thinking(TAGS, None)
    held = [plain.feed(GenerateChunk(text=text, token_ids=[i], logprobs=[entry(i)])) for text, i in ((" <", 1), ("b>", 2))]
    assert held[0] == ("", "", []) and held[1][:2] == ("", " <b>")
    assert [e.token_id for e in held[1][2]] == [1, 2] and plain.tokens == 0
