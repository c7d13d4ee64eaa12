"""Reasoning split from the answer (daemon/api/reasoning.py), against llama-server's own split
of the same replies (tests/fixtures/chat_templates/reasoning_replies.json), whole and streamed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from daemon.api.reasoning import ChannelSplit, ThinkingSplit, hold_grammar_after, opened_by, split
from daemon.backend import GenerateParams, ToolCallFrame

TAGS = ("<think>", "</think>")
CAPTURE = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "chat_templates" / "reasoning_replies.json").read_text()
)
REPLIES = [
    (family, reply) for family, record in CAPTURE["templates"].items() for reply in record["replies"]
]


def generated(family: str, reply: dict) -> tuple[str, str | None]:
    """What the model wrote and what the prompt opened: with `reasoning_format: none`
    llama-server puts the prompt's opening tag back in front of the output."""
    opened = opened_by(CAPTURE["templates"][family]["prompts"]["user"], TAGS)
    raw = reply["raw"]
    if opened is not None:
        assert raw.startswith(TAGS[0] + opened)
        raw = raw[len(TAGS[0] + opened):]
    return raw, opened


@pytest.mark.parametrize(("family", "reply"), REPLIES, ids=[f"{f}-{r['case']}-{r['seed']}" for f, r in REPLIES])
def test_whole_and_streamed_as_llama_server_splits(family: str, reply: dict) -> None:
    raw, opened = generated(family, reply)
    reasoning, content = split(raw, TAGS, opened=opened, trim=False)
    assert (reasoning or None, content) == (reply["reasoning_content"], reply["content"])
    # Fed in llama-server's own pieces (one per token; the first one carries the tag it put
    # back), the parts add up to the same.
    pieces = list(reply["pieces"])
    if opened is not None:
        assert pieces[0].startswith(TAGS[0] + opened)
        pieces[0] = pieces[0][len(TAGS[0] + opened):]
    assert "".join(pieces) == raw
    stream = ThinkingSplit(TAGS, opened=opened, trim=False)
    parts = [stream.feed(piece, False) for piece in pieces] + [stream.feed("", True)]
    assert "".join(r for r, _ in parts) == reasoning
    assert "".join(c for _, c in parts) == content
    # llama-server's streamed deltas add up to its whole reply too.
    assert "".join(d.get("reasoning_content", "") for d in reply["deltas"]) == (reply["reasoning_content"] or "")
    assert "".join(d.get("content", "") for d in reply["deltas"]) == reply["content"]


def test_prompts_that_open_the_reasoning() -> None:
    r1 = CAPTURE["templates"]["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"]["prompts"]
    qwen = CAPTURE["templates"]["Qwen-Qwen3-0.6B"]["prompts"]
    assert opened_by(r1["user"], TAGS) == "\n"
    assert opened_by(r1["no_thinking"], TAGS) is None
    assert opened_by(qwen["user"], TAGS) is None
    assert opened_by(qwen["no_thinking"], TAGS) is None
    assert opened_by("x<think>", ("", "")) is None


@pytest.mark.parametrize("trim", [False, True])
def test_every_split_point_streams_alike(trim: bool) -> None:
    # Whitespace around the tags, a tag cut anywhere, an answer without reasoning.
    texts = [" <think>\n a b \n</think>\n\n Answer </think> x", "<think>abc", "<thi", "Plain <think>x</think>",
             "\n\n", "<think></think>", "<think>x</thin", "<think>x</think>   "]
    for text in texts:
        for opened in (None, "\n"):
            whole = split(text, TAGS, opened=opened, trim=trim)
            for cut in range(len(text) + 1):
                stream = ThinkingSplit(TAGS, opened=opened, trim=trim)
                parts = [stream.feed(text[:cut], False), stream.feed(text[cut:], False), stream.feed("", True)]
                assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == whole, (text, cut, opened)


def test_ollama_trims_the_reasoning_start_llama_server_keeps_it() -> None:
    text = "<think>\n\nWhy.\n</think>\n\nBecause."
    assert split(text, TAGS, opened=None, trim=True) == ("Why.\n", "Because.")
    assert split(text, TAGS, opened=None, trim=False) == ("\n\nWhy.\n", "Because.")
    assert split("x</think>y", TAGS, opened="\n", trim=False) == ("\nx", "y")
    assert split("x</think>y", TAGS, opened="\n", trim=True) == ("x", "y")
    # Cut while thinking: all reasoning; no tag at the start: all answer, untouched.
    assert split("<think>abc", TAGS, opened=None, trim=False) == ("abc", "")
    assert split(" Hi <think>x</think>", TAGS, opened=None, trim=False) == ("", " Hi <think>x</think>")


def test_a_marker_that_ends_the_reasoning_begins_the_answer() -> None:
    # Qwen 3.5's `<tool_call>` inside reasoning the prompt opened (llama-server's reading).
    text = "Let me call.\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    assert split(text, TAGS, opened="\n", trim=False, ends="<tool_call>") == (
        "\nLet me call.\n", "<tool_call>\n<function=f>\n</function>\n</tool_call>")
    # The closing tag first: as before; the marker later is the answer's.
    assert split("a</think>b<tool_call>", TAGS, opened="", trim=False, ends="<tool_call>") == ("a", "b<tool_call>")
    for cut in range(len(text) + 1):
        stream = ThinkingSplit(TAGS, opened="\n", trim=False, ends="<tool_call>")
        parts = [stream.feed(text[:cut], False), stream.feed(text[cut:], False), stream.feed("", True)]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (
            "\nLet me call.\n", "<tool_call>\n<function=f>\n</function>\n</tool_call>"), cut


GEMMA = json.loads((Path(__file__).parent.parent / "fixtures" / "chat_templates" / "gemma4_replies.json").read_text())
GEMMA_TAGS = ("<|channel>thought", "<channel|>")


@pytest.mark.parametrize("reply", [r for r in GEMMA["replies"] if r["case"] in (
    "chat_thought", "chat_thought_cut", "chat_thought_no_thinking", "chat_thought_spaces", "chat_empty_channel")],
    ids=lambda r: f"{r['case']}-{r['seed']}")
def test_gemma_thought_channel_as_llama_server_splits_it(reply: dict) -> None:
    """gemma4_replies.json: the thought channel's reasoning and the answer, whitespace as
    llama-server leaves it, whole and streamed. (Where llama-server drops text, after a stray
    `<channel|>` or a `<|channel>` that opens no thought, edged keeps it as the answer's.)"""
    text, message = reply["raw"], reply["message"]
    if reply["case"] == "chat_empty_channel":
        # An empty channel before the thought: llama-server skips it; here it is the answer's.
        assert split(text, GEMMA_TAGS, opened=None, trim=True, keep_after=True)[0] == ""
        return
    whole = split(text, GEMMA_TAGS, opened=None, trim=True, keep_after=True)
    assert whole == (message["reasoning_content"], message["content"])
    for cut in range(len(text) + 1):
        stream = ThinkingSplit(GEMMA_TAGS, opened=None, trim=True, keep_after=True)
        parts = [stream.feed(text[:cut], False), stream.feed(text[cut:], False), stream.feed("", True)]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == whole, cut


@pytest.mark.parametrize("keep", [False, True])
def test_a_harmony_reply_streams_as_it_reads_whole(keep: bool) -> None:
    """Seeded soups of gpt-oss's markers and text (headers that are and are not ones, cuts
    anywhere), fed 1, 2 and 5 characters at a time: the same reasoning and answer as whole."""
    rng = random.Random(0)
    pieces = ["<|channel|>", "analysis", "final", "commentary", " to=functions.get_weather", "<|message|>", "<|end|>",
              "<|start|>assistant", " <|constrain|>json", "{", '"city"', ":", '"P"', "}", "x", " ", "\n", "to=",
              "browser.search"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        whole = ChannelSplit(keep_reasoning=keep).feed(text, True)
        for step in (1, 2, 5):
            split = ChannelSplit(keep_reasoning=keep)
            parts = [split.feed(text[k : k + step], False) for k in range(0, len(text), step)] + [split.feed("", True)]
            assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == whole, text


def test_a_lazy_tool_frame_gets_the_reasoning_tags() -> None:
    """tool_choice auto (a lazy frame): the engine keeps its grammar from seeing the reasoning,
    so it gets the tags and whether the prompt opened the reasoning; a required frame holds
    after it (grammar_after) or after reasoning the model may open (grammar_reasoning)."""
    lazy = ToolCallFrame(call_schema="{}", open="<tool_call>", lazy=True)
    eager = ToolCallFrame(call_schema="{}", open="<tool_call>")
    cases = {
        # prompt end -> (lazy: grammar_after, grammar_reasoning), (required: the same)
        "<|Assistant|><think>\n": (("</think>", TAGS), ("</think>", ("", ""))),
        "<|im_start|>assistant\n": (("", TAGS), ("", TAGS)),
        "<|im_start|>assistant\n<think>\n\n</think>\n\n": (("", ("", "")), ("", ("", ""))),
    }
    for prompt, expected in cases.items():
        got = []
        for frame in (lazy, eager):
            params = GenerateParams(tool_calls=frame)
            hold_grammar_after(params, TAGS, prompt)
            got.append((params.grammar_after, params.grammar_reasoning))
        assert tuple(got) == expected, prompt
