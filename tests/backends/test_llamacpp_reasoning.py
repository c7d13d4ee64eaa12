"""Thinking models on the llama.cpp backend, against real llama.cpp on tiny random GGUFs: the
template's reasoning tags, prompts rendered as llama-server renders them (reasoning in history,
`enable_thinking`), and a grammar that holds only after the reasoning (grammar_after)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from gguf_builder import _vocab, write_tiny_llama

from daemon.backend import GenerateParams, ToolCallFrame
from daemon.errors import InvalidArgument

pytest.importorskip("gguf")

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
CAPTURE = json.loads((TEMPLATES / "reasoning_replies.json").read_text())
TAGS = ("<think>", "</think>")

Loader = Callable[..., Awaitable[Any]]


@pytest.fixture
def load(load_llamacpp: Loader) -> Loader:
    return load_llamacpp


@pytest.mark.parametrize(("family", "tags"), [
    ("Qwen-Qwen3-0.6B", TAGS), ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", TAGS),
    ("mistralai-Ministral-3-14B-Reasoning-2512", ("[THINK]", "[/THINK]")),
    ("Qwen-Qwen2.5-7B-Instruct", ("", "")), ("meta-llama-Llama-3.1-8B-Instruct", ("", "")),
])
async def test_thinking_tags_are_read_from_the_template(load: Loader, tmp_path: Path, family: str, tags: tuple[str, str]) -> None:
    template = (TEMPLATES / f"{family}.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template))
    assert backend.thinking_tags() == tags
    assert backend.engine_stats()["chat_template_thinking"] == "".join(tags)


@pytest.mark.parametrize("family", sorted(CAPTURE["templates"]))
async def test_prompts_render_what_llama_server_renders(load: Loader, tmp_path: Path, family: str) -> None:
    """reasoning_replies.json's prompts: a plain turn (R1's prompt opens the reasoning, with
    `enable_thinking` true as llama-server passes it), `enable_thinking: false`, past
    reasoning in history, and an agent's loop whose call carries its reasoning."""
    template = (TEMPLATES / f"{family}.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template, user_tokens=TAGS))
    for case, body in CAPTURE["prompt_requests"].items():
        prompt = backend.chat_prompt(body["messages"], template_kwargs=body.get("chat_template_kwargs"),
                                     tools=body.get("tools"))
        assert prompt == CAPTURE["templates"][family]["prompts"][case], case


async def _text(backend: Any, prompt: str, params: GenerateParams) -> tuple[str, str | None]:
    text, finish = "", None
    async for chunk in backend.generate(prompt, params):
        text, finish = text + chunk.text, chunk.finish_reason
    return text, finish


async def test_a_grammar_holds_only_after_the_reasoning(load: Loader, tmp_path: Path) -> None:
    template = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template, user_tokens=TAGS))
    prompt = backend.chat_prompt([{"role": "user", "content": "Hi"}])
    close = len(_vocab()[0]) + 1
    grammar = 'root ::= "yes" | "no"'
    seen_free_text = False
    for seed in range(40):
        params = GenerateParams(max_tokens=40, temperature=1.0, seed=seed, grammar=grammar, grammar_after="</think>",
                                logit_bias={close: 3.0})
        text, finish = await _text(backend, prompt, params)
        reasoning, closed, answer = text.partition("</think>")
        seen_free_text = seen_free_text or bool(reasoning.strip())
        if closed and finish == "stop":
            assert answer.strip() in ("yes", "no")
            break
    else:
        pytest.fail("no seed of 40 closed the reasoning")
    assert seen_free_text  # before the tag the grammar held nothing
    # Without grammar_after the same grammar holds from the first token.
    text, _ = await _text(backend, prompt, GenerateParams(max_tokens=8, seed=0, grammar=grammar))
    assert text in ("yes", "no")


async def test_the_output_does_not_end_before_its_grammar_holds(load: Loader, tmp_path: Path) -> None:
    """llama-server's grammar for a thinking prompt with a required answer (tool_choice
    required, a response format) spans the reasoning, so the reply cannot end before the
    answer; nor can edged's: no end-of-generation token before grammar_after's text. Biased to
    end at once (+100 on </s>) and to close the reasoning (+50 on </think>), the output closes
    it, writes the grammar's answer, then ends (before, it ended at once with nothing)."""
    template = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    path = write_tiny_llama(tmp_path / "model.gguf", chat_template=template, user_tokens=TAGS)
    backend = await load(path)
    prompt = backend.chat_prompt([{"role": "user", "content": "Hi"}])
    close, eos = len(_vocab()[0]) + 1, 2
    params = GenerateParams(max_tokens=16, temperature=0.0, grammar='root ::= "yes"', grammar_after="</think>",
                            logit_bias={eos: 100.0, close: 50.0})
    text, finish = await _text(backend, prompt, params)
    reasoning, closed, answer = text.partition("</think>")
    assert (reasoning, closed, answer.strip(), finish) == ("", "</think>", "yes", "stop")
    # Once the grammar's answer is complete, the end is the one thing it allows.
    assert text.endswith("yes")
    # A lazy tool frame (tool_choice auto) may still end before its trigger: no call is due.
    frame = ToolCallFrame(call_schema='{"type": "object"}', open="<tool_call>\n", close="\n</tool_call>", lazy=True)
    text, finish = await _text(backend, prompt, GenerateParams(max_tokens=16, temperature=0.0, tool_calls=frame,
                                                               logit_bias={eos: 100.0, close: 50.0}))
    assert (text, finish) == ("", "stop")


async def test_grammar_after_and_reasoning_with_a_lazy_tool_frame(load: Loader, tmp_path: Path) -> None:
    template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template, user_tokens=TAGS))
    frame = ToolCallFrame(call_schema='{"type": "object"}', open="<tool_call>\n", close="\n</tool_call>", lazy=True)
    with pytest.raises(InvalidArgument, match="grammar_after: with a lazy tool_calls frame, grammar_reasoning's closing tag"):
        await _text(backend, "x", GenerateParams(max_tokens=4, tool_calls=frame, grammar_after="</think>"))
    with pytest.raises(InvalidArgument, match="grammar_after and grammar_reasoning cannot be used together"):
        await _text(backend, "x", GenerateParams(max_tokens=4, grammar='root ::= "x"', grammar_after="</think>",
                                                 grammar_reasoning=TAGS))


CALL = ToolCallFrame(
    call_schema='{"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"], "additionalProperties": false}',
    open="<tool_call>\n", close="\n</tool_call>", lazy=True, max_calls=1,
)


@pytest.mark.parametrize("opened", [True, False])
async def test_a_call_marker_inside_the_reasoning_starts_no_call(load: Loader, tmp_path: Path, opened: bool) -> None:
    """llama-server's lazy grammar does not see the reasoning (its reasoning tracker keeps it
    from applying there), so a call marker the model writes while it thinks starts no call;
    once the reasoning is closed, the marker starts one. Biases and a repeat penalty (which
    halves a biased logit once its token has appeared) steer the tiny model; before, the
    first marker started a call inside the reasoning.

    `opened`: the prompt opened the reasoning (DeepSeek R1; grammar_after): the marker inside,
    the closing tag, the marker again, which starts the call. Else the model opens it (Qwen 3):
    the opening tag, the marker inside, the closing tag."""
    family = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B" if opened else "Qwen-Qwen3-0.6B"
    path = write_tiny_llama(tmp_path / "model.gguf", chat_template=(TEMPLATES / f"{family}.jinja").read_text(),
                            user_tokens=(*TAGS, "<tool_call>"))
    backend = await load(path)
    first = len(_vocab()[0])
    think, close, call = first, first + 1, first + 2
    prompt = backend.chat_prompt([{"role": "user", "content": "Hi"}])
    bias = {call: 70.0, close: 40.0} if opened else {think: 100.0, call: 70.0, close: 40.0}
    params = GenerateParams(max_tokens=60, temperature=0.0, tool_calls=CALL, logit_bias=bias, repeat_penalty=4.0,
                            grammar_reasoning=TAGS, grammar_after="</think>" if opened else "")
    text, finish = await _text(backend, prompt, params)
    reasoning, closed, answer = text.partition("</think>")
    assert (reasoning, closed) == ("<tool_call>" if opened else "<think><tool_call>", "</think>"), text
    if opened:
        assert "<tool_call>\n{" in answer and answer.endswith("</tool_call>") and finish == "stop", text


@pytest.mark.parametrize("ends", [True, False])
async def test_a_trigger_that_ends_the_reasoning_starts_a_required_call(load: Loader, tmp_path: Path, ends: bool) -> None:
    """Qwen 3.5's `<tool_call>` also ends its reasoning (llama-server counts it among the
    closing tags, and its grammar for a required call lets the call begin there): with
    ToolCallFrame.ends_reasoning, the marker written inside the reasoning starts the required
    call, which then ends the reply; without it, the grammar waits for `</think>` and the marker
    is reasoning text (biased, written until max_tokens)."""
    template = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template,
                                          user_tokens=(*TAGS, "<tool_call>")))
    call = len(_vocab()[0]) + 2
    prompt = backend.chat_prompt([{"role": "user", "content": "Hi"}])
    frame = msgspec.structs.replace(CALL, lazy=False, ends_reasoning=ends)
    params = GenerateParams(max_tokens=40, temperature=0.0, tool_calls=frame, logit_bias={call: 70.0, 2: 100.0},
                            grammar_after="</think>")
    text, finish = await _text(backend, prompt, params)
    if ends:
        assert text.startswith("<tool_call>\n{") and text.endswith("</tool_call>") and finish == "stop", text
    else:
        assert text == "<tool_call>" * 40 and finish == "length", text


async def _ids(backend: Any, prompt: str, params: GenerateParams) -> list[int]:
    ids: list[int] = []
    async for chunk in backend.generate(prompt, params):
        ids += chunk.token_ids
    return ids


async def test_a_reasoning_budget_forces_the_end(load: Loader, tmp_path: Path) -> None:
    """llama-server's reasoning budget, token by token: where the prompt opened the reasoning
    (DeepSeek R1), the budget's tokens, then the end (the message and the closing tag) forced
    though the closing tag is biased away, then the answer; where the model opens it (Qwen 3),
    the opening tag is not counted, and a second reasoning block gets the budget again."""
    first = len(_vocab()[0])
    think, close = first, first + 1
    r1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "r1.gguf", chat_template=r1, user_tokens=TAGS))
    prompt = backend.chat_prompt([{"role": "user", "content": "Hi"}])
    base = GenerateParams(max_tokens=12, temperature=1.0, seed=3, logit_bias={close: -100.0, think: -100.0},
                          reasoning_tags=TAGS, reasoning_opened=True)
    free = await _ids(backend, prompt, base)
    assert close not in free and len(free) == 12
    # gguf_builder: printable ASCII from id 260 (259 is SPM's space, which the tokenizer puts
    # before the message's text, as llama-server's tokenizing of it does).
    end = [259] + [ord(c) - 0x20 + 259 for c in "Ok."] + [close]
    capped = await _ids(backend, prompt, msgspec.structs.replace(base, reasoning_budget=3, reasoning_end="Ok.</think>"))
    # The prompt's tokens after its "<think>" count too, as llama-server counts them (its budget
    # sampler is fed the generation prompt): fewer than 3 generated tokens, then the end.
    at = next(i for i in range(4) if capped[i : i + len(end)] == end)
    assert at < 3 and capped[:at] == free[:at] and close not in capped[at + len(end) :] and len(capped) == 12
    none = await _ids(backend, prompt, msgspec.structs.replace(base, reasoning_budget=0, reasoning_end="</think>"))
    assert none[0] == close and len(none) == 12

    qwen3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "qwen3.gguf", chat_template=qwen3, user_tokens=TAGS))
    prompt = backend.chat_prompt([{"role": "user", "content": "Hi"}])
    params = GenerateParams(max_tokens=10, temperature=0.0, logit_bias={think: 100.0, close: -100.0},
                            reasoning_tags=TAGS, reasoning_budget=2, reasoning_end="</think>")
    ids = await _ids(backend, prompt, params)
    # <think>, two tokens (the bias makes them <think> again: inside, they count), </think>, ...
    assert ids[0] == think and ids[3] == close and ids[4] == think and ids[7] == close, ids


def _byte_or_char(token: int) -> bytes:
    """A tiny vocabulary's token as text: bytes from id 3, printable ASCII from id 259."""
    return bytes([token - 3]) if 3 <= token < 259 else chr(token - 259 + 0x20).encode() if token < 259 + 95 else b""


async def test_a_budget_never_splits_a_character(load: Loader, tmp_path: Path) -> None:
    """The budget runs out after the first two bytes of a three-byte character (byte tokens):
    the forced end waits for the character's last byte instead of writing between its bytes."""
    close = len(_vocab()[0]) + 1
    r1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "r1.gguf", chat_template=r1, user_tokens=TAGS))
    prompt = backend.chat_prompt([{"role": "user", "content": "Hi"}])
    lead, cont = 3 + 0xE2, 3 + 0x82  # two bytes of "€" (E2 82 AC), of "₂" (E2 82 82), ...
    end = [259] + [ord(c) - 0x20 + 259 for c in "Ok."] + [close]
    waited = 0
    plain = GenerateParams(max_tokens=12, temperature=0.0, reasoning_tags=TAGS, reasoning_opened=True,
                           logit_bias={close: -100.0}, reasoning_budget=3, reasoning_end="Ok.</think>")
    ids = await _ids(backend, prompt, plain)
    out = next(i for i in range(len(ids)) if ids[i : i + len(end)] == end)  # where the budget runs out
    assert all(259 <= t < 259 + 95 for t in ids[:out]), ids  # ASCII: nothing held back
    for seed in range(40):
        params = GenerateParams(max_tokens=12, temperature=1.0, seed=seed, reasoning_tags=TAGS, reasoning_opened=True,
                                logit_bias={lead: 100.0, cont: 100.0, close: -100.0},
                                reasoning_budget=3, reasoning_end="Ok.</think>")
        ids = await _ids(backend, prompt, params)
        # Where the budget runs out (the prompt's tokens after "<think>" count), the end
        # comes at the first point where no character is left incomplete (by Python's own
        # UTF-8 decoder), or three tokens later at most.
        want = out
        while want < out + 3:
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            decoder.decode(b"".join(_byte_or_char(t) for t in ids[:want]))
            if decoder.getstate()[0] == b"":
                break
            want += 1
        assert ids[want : want + len(end)] == end, (ids, want)
        waited += want > out
    assert waited  # the case arose: the budget ran out inside a character


async def test_a_budget_message_cannot_end_the_output(load: Loader, tmp_path: Path) -> None:
    """An end-of-generation token's text in the message would end the output, or, banned by a
    grammar or ignore_eos, leave no token to sample: a 400 naming the field, before any token.
    A budget without tags or an end is refused too (the engine could not keep it)."""
    r1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "r1.gguf", chat_template=r1, user_tokens=TAGS))
    prompt = backend.chat_prompt([{"role": "user", "content": "Hi"}])
    base = GenerateParams(max_tokens=12, temperature=0.0, grammar='root ::= "yes"', grammar_after="</think>",
                          reasoning_tags=TAGS, reasoning_opened=True, reasoning_budget=0)
    for end, match in (("</s></think>", "reasoning_budget_message: holds '</s>'"),
                       ("", "needs reasoning_end")):
        with pytest.raises(InvalidArgument, match=match):
            await _ids(backend, prompt, msgspec.structs.replace(base, reasoning_end=end))
    with pytest.raises(InvalidArgument, match="needs reasoning_tags"):
        await _ids(backend, prompt, msgspec.structs.replace(base, reasoning_end="</think>", reasoning_tags=("", "")))
    with pytest.raises(InvalidArgument, match="reasoning_budget must be >= 0"):
        await _ids(backend, prompt, msgspec.structs.replace(base, reasoning_end="</think>", reasoning_budget=-1))
    # The engine is fine afterwards.
    assert await _ids(backend, prompt, msgspec.structs.replace(base, reasoning_end="</think>"))


async def test_a_budget_gives_way_to_the_grammar(load: Loader, tmp_path: Path) -> None:
    """A forced end the grammar does not admit (here the budget's message is a call marker that
    starts a required call, after which the closing tag does not fit): the budget gives way to
    the grammar instead of leaving no token to sample (which aborts llama.cpp)."""
    template = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template,
                                          user_tokens=(*TAGS, "<tool_call>")))
    prompt = backend.chat_prompt([{"role": "user", "content": "Hi"}])
    frame = msgspec.structs.replace(CALL, lazy=False, ends_reasoning=True)
    params = GenerateParams(max_tokens=60, temperature=0.0, tool_calls=frame, grammar_after="</think>",
                            reasoning_tags=TAGS, reasoning_opened=True, reasoning_budget=0,
                            reasoning_end="<tool_call></think>", logit_bias={2: 100.0})
    text, finish = await _text(backend, prompt, params)
    assert text.startswith("<tool_call>\n{") and text.endswith("</tool_call>") and finish == "stop", text


async def test_a_grammar_holds_after_reasoning_the_model_opens(load: Loader, tmp_path: Path) -> None:
    """grammar_reasoning (Qwen 3 opens its reasoning itself): the output may open the tag,
    reason freely up to the closing one, and the grammar holds after it; or the grammar holds
    at once. Never text the grammar rejects outside the reasoning."""
    template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template, user_tokens=TAGS))
    prompt = backend.chat_prompt([{"role": "user", "content": "Hi"}])
    tokens = len(_vocab()[0])
    grammar = 'root ::= "yes" | "no"'
    kinds = set()
    # Even seeds: pushed to reason first; odd ones: kept from opening the tag (its token and
    # its first character), so that the grammar holds at once.
    biases = [{tokens: 4.0, tokens + 1: 4.0}, {tokens: -100.0, _vocab()[0].index("<"): -100.0}]
    for seed in range(12):
        params = GenerateParams(max_tokens=60, temperature=1.0, seed=seed, grammar=grammar, grammar_reasoning=TAGS,
                                logit_bias=biases[seed % 2])
        text, finish = await _text(backend, prompt, params)
        assert finish == "stop", text
        if text.startswith("<think>"):
            reasoning, closed, answer = text[len("<think>"):].partition("</think>")
            assert closed and "</think>" not in reasoning
            kinds.add("reasoned" if reasoning else "empty")
        else:
            answer = text
            kinds.add("at once")
        assert answer.strip() in ("yes", "no") and len(answer) - len(answer.lstrip()) <= 8, text
    assert {"reasoned", "at once"} <= kinds, kinds
