"""The llama.cpp backend against real llama.cpp, on tiny random GGUF models written per test.

The reference for "correct" is numpy: a 2-layer llama forward pass written out below from the
GGUF's own tensors (read back with the `gguf` package). The engine's tests then check the
things continuous batching could break: sequences decoded together give exactly what each
gives alone, cancellation frees slots, stop strings, limits, queue and context errors.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import re
import resource
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_builder import (
    SPACE,
    read_weights,
    reference_forward,
    reference_greedy,
    reference_logprobs,
    with_fim_tokens,
    write_tiny_llama,
)

from daemon.backend import GenerateChunk, GenerateParams
from daemon.errors import BackendError, ConfigError, InvalidArgument, Unavailable

gguf = pytest.importorskip("gguf")

GREEDY = GenerateParams(greedy=True, max_tokens=24)
# Different lengths (several longer than the batched engine's n_batch of 16) and contents.
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "x",
    "1 2 3 4 5 6 7 8 9 10 11 12 13",
    "What is the capital of France? Answer in one word:",
    "def main(): return 42",
    "zzz QQQ zzz QQQ",
    "In the beginning the Universe was created. This has made a lot of people very angry.",
]


@dataclass
class Result:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    chunks: list[GenerateChunk] = field(default_factory=list)

    @property
    def last(self) -> GenerateChunk:
        return self.chunks[-1]


async def collect(chunks: AsyncIterator[GenerateChunk]) -> Result:
    result = Result()
    async for chunk in chunks:
        result.chunks.append(chunk)
        result.text += chunk.text
        result.ids += chunk.token_ids
    return result


async def head(chunks: AsyncIterator[GenerateChunk]) -> GenerateChunk:
    return await anext(chunks)


# The plugin class is imported by the registry at run time, invisible to mypy: Any it is.
Loader = Callable[..., Awaitable[Any]]


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "model.gguf")


@pytest.fixture
def load(load_llamacpp: Loader) -> Loader:
    """`await load(path, n_parallel="8", ...)`: see tests/backends/conftest.py."""
    return load_llamacpp


async def wait_until(predicate: Callable[[], bool]) -> None:
    # Engine state lives on the engine thread: poll it (no asyncio.Event can be set there).
    async with asyncio.timeout(20):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- numpy reference


def token_id(path: Path, piece: str) -> int:
    reader = gguf.GGUFReader(str(path))
    field_ = reader.fields["tokenizer.ggml.tokens"]
    pieces = [bytes(field_.parts[i]).decode() for i in field_.data]
    return pieces.index(piece)


# --------------------------------------------------------------------------- pure helpers


def test_piece_decoder_buffers_split_utf8(backend_class: Callable[[str], type[Any]]) -> None:
    backend_class("llamacpp")
    from edged_backends.llamacpp.text import PieceDecoder

    decoder = PieceDecoder()
    data = "aé€😀".encode()  # 1-, 2-, 3- and 4-byte characters
    out = [decoder.decode(data[i : i + 1]) for i in range(len(data))]
    # Nothing is emitted until a character is complete, then exactly that character.
    assert out == ["a", "", "é", "", "", "€", "", "", "", "😀"]
    assert decoder.decode(b"\xe2\x82") == "" and decoder.flush() == "\ufffd"


def test_stop_matcher_holds_back_partial_matches(backend_class: Callable[[str], type[Any]]) -> None:
    backend_class("llamacpp")
    from edged_backends.llamacpp.text import StopMatcher

    matcher = StopMatcher(["END", "stop here"])
    assert matcher.feed("hello E") == ("hello ", False)  # "E" may start "END"
    assert matcher.feed("N") == ("", False)
    assert matcher.feed("X st") == ("ENX ", False)  # "ENX" is no stop; "st" may be
    assert matcher.feed("op her") == ("", False)
    assert matcher.feed("e and more") == ("", True)  # hit: nothing of it is emitted
    released = StopMatcher(["END"])
    assert released.feed("abcEN") == ("abc", False)
    assert released.flush() == "EN"  # the stream ended: the partial match was plain text


def test_reasoning_tracker_follows_tags_across_pieces(backend_class: Callable[[str], type[Any]]) -> None:
    backend_class("llamacpp")
    from edged_backends.llamacpp.text import ReasoningTracker

    tracker = ReasoningTracker(b"<think>", (b"</think>", b"<tool_call>"), inside=False)
    assert not tracker.feed(b"Hi <th") and not tracker.inside  # a tag's start is held
    assert tracker.feed(b"ink>plan <tool") and tracker.inside
    assert not tracker.feed(b"_ca") and tracker.inside  # "<tool_ca" may still end it...
    assert tracker.feed(b"ll> x") and not tracker.inside and tracker.ended_by == b"<tool_call>"  # ...and does
    assert tracker.feed(b"<think> </thi") and tracker.inside
    assert tracker.feed(b"nk>") and not tracker.inside and tracker.ended_by == b"</think>"
    # A second block enters it again; open and close in one piece is no change.
    assert not tracker.feed(b"<think>x</think>") and not tracker.inside
    assert tracker.feed(b"<think>again") and tracker.inside
    # Nothing to look for on one side (grammar_after: only its closing text).
    after = ReasoningTracker(b"", (b"</think>",), inside=True)
    assert after.feed(b"</think><think>") and not after.inside


# --------------------------------------------------------------------------- generation


def test_probe_reports_runtime(backend_class: Callable[[str], type[Any]]) -> None:
    import llama_cpp

    probe = backend_class("llamacpp").probe()
    assert probe.available
    assert llama_cpp.__version__ in probe.runtime_version
    assert "gpu offload" in probe.runtime_version and "CPU" in probe.devices


async def test_greedy_matches_numpy_reference(load: Loader, model_path: Path) -> None:
    prompt = [1, 300, 301, 320, 330, 270, 280]
    expected = reference_greedy(read_weights(model_path), prompt, 8)
    backend = await load(model_path)
    result = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=8)))
    assert result.ids == expected
    assert result.last.finish_reason == "length"
    assert (result.last.prompt_tokens, result.last.completion_tokens) == (len(prompt), 8)


async def test_concurrent_sequences_match_each_alone(load: Loader, model_path: Path) -> None:
    # Two threads here (one elsewhere, for speed): ggml splits each matmul across threads,
    # and that must not make results depend on the batch either.
    # Alone: one slot, each prompt prefilled in one step.
    single = await load(model_path, n_parallel="1", n_threads="2")
    alone = [await collect(single.generate(p, GREEDY)) for p in PROMPTS]
    # Otherwise mixed-up sequences could go unnoticed.
    assert len({tuple(r.ids) for r in alone}) == len(PROMPTS)
    assert all(len(r.ids) == GREEDY.max_tokens for r in alone)

    # Together: 8 slots and a 16-token batch, so long prompts prefill in chunks while other
    # sequences decode; half the requests join after the first half is generating.
    batched = await load(model_path, n_parallel="8", n_batch="16", n_threads="2")
    first_half = [batched.generate(p, GREEDY) for p in PROMPTS[:4]]
    heads = [await anext(it) for it in first_half]
    tasks = [asyncio.create_task(collect(batched.generate(p, GREEDY))) for p in PROMPTS[4:]]
    rest = [await collect(it) for it in first_half]
    together = [
        Result(h.text + r.text, h.token_ids + r.ids, [h, *r.chunks])
        for h, r in zip(heads, rest, strict=True)
    ] + list(await asyncio.gather(*tasks))

    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert b.ids == a.ids, f"prompt {i} decoded differently when batched"
        assert b.text == a.text
        assert b.last.finish_reason == "length"
        assert b.last.prompt_tokens == a.last.prompt_tokens
    assert batched.engine_stats()["busy"] == 0


async def test_seeded_sampling_is_reproducible(load: Loader, model_path: Path) -> None:
    def sampled(seed: int) -> GenerateParams:
        return GenerateParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=24)

    backend = await load(model_path, n_parallel="4")
    first = await collect(backend.generate(PROMPTS[0], sampled(1234)))
    again = await collect(backend.generate(PROMPTS[0], sampled(1234)))
    other = await collect(backend.generate(PROMPTS[0], sampled(99)))
    assert first.ids == again.ids
    assert first.ids != other.ids
    # The same seed gives the same tokens while other sequences share the batch.
    mixed = await asyncio.gather(
        collect(backend.generate(PROMPTS[0], sampled(1234))),
        *(collect(backend.generate(p, sampled(7))) for p in PROMPTS[1:4]),
    )
    assert mixed[0].ids == first.ids


async def test_max_tokens_finishes_with_length(load: Loader, model_path: Path) -> None:
    backend = await load(model_path)
    result = await collect(backend.generate(PROMPTS[1], GenerateParams(greedy=True, max_tokens=5)))
    assert result.last.finish_reason == "length"
    assert result.last.completion_tokens == 5 == len(result.ids)
    assert all(c.finish_reason is None for c in result.chunks[:-1])


async def test_context_end_finishes_with_length(load: Loader, model_path: Path) -> None:
    backend = await load(model_path, n_parallel="1", n_ctx="256")
    prompt = [1] + [300] * 249
    result = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=100)))
    # 256 cells: 250 prompt tokens + 6 decoded, the last sampled token needs no cell.
    assert result.last.finish_reason == "length"
    assert result.last.completion_tokens == 7


async def test_context_shift_goes_on_past_the_slot(
    load: Loader, model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """llama-server's --context-shift: a generation that fills its slot drops tokens after the
    first n_keep (+1: the vocabulary adds a BOS) and goes on, each time its next token would
    take the slot's last cell. Same tokens as without the shift up to it; each shift's
    (n_keep, n_discard) as llama-server's arithmetic gives them (n_discard 0: half of the
    rest; at most all but one)."""
    prompt = [1] + [300] * 249  # 256 cells: the 6th token's step would fill the last one
    plain = await collect((await load(model_path, n_parallel="1", n_ctx="256")).generate(prompt, GenerateParams(greedy=True, max_tokens=100)))
    assert plain.last.completion_tokens == 7 and plain.last.discarded_tokens == 0
    backend = await load(model_path, n_parallel="1", n_ctx="256", context_shift="true")
    cases = [(0, 0, 100, [(1, 127)]), (-1, 0, 20, [(251, 2)] * 7), (0, 10, 30, [(1, 10)] * 3), (5, 400, 200, [(6, 248)])]
    for n_keep, n_discard, max_tokens, shifts in cases:
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            params = GenerateParams(greedy=True, max_tokens=max_tokens, n_keep=n_keep, n_discard=n_discard)
            result = await collect(backend.generate(prompt, params))
        assert result.last.finish_reason == "length" and result.last.completion_tokens == max_tokens == len(result.ids)
        assert result.ids[:6] == plain.ids[:6]
        logged = [tuple(map(int, m.groups())) for r in caplog.records if (m := re.search(r"context shift, n_keep (\d+), n_discard (\d+)", r.getMessage()))]
        assert logged == shifts, (n_keep, n_discard)
        kept = shifts[0][0]
        # Of the prompt and the output but its last token, all but the unmoved cells.
        assert result.last.discarded_tokens == len(prompt) + max_tokens - 1 - kept
        assert backend._engine._cached[0] == (prompt + result.ids)[:kept]


def ollama_shifts(prompt: int, n_keep: int, window: int, max_tokens: int) -> list[tuple[int, int]]:
    """The (kept, dropped) of each shift Ollama's runner makes (InputCache.ShiftDiscard) for a
    reply of `max_tokens` after a prompt of `prompt` tokens: before a token would go past
    `window` cells, keep the first n_keep (-1: the prompt; at most window - 1) and drop
    enough that half of the rest of the window is free."""
    shifts, n_past = [], prompt
    for _ in range(1, max_tokens):  # each token but the last is decoded after it
        if n_past >= window:
            keep = min(prompt if n_keep < 0 else n_keep, window - 1)
            drop = max((window - keep) // 2, 1) - (window - n_past)
            shifts.append((keep, drop))
            n_past -= drop
        n_past += 1  # the token just sampled, decoded next
    return shifts


async def test_ollamas_context_shift(load: Loader, model_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """GenerateParams.shift_window (Ollama's routes' `shift`), on a model without the
    llama-server shift: the reply goes on past its window, each shift keeping and dropping
    what Ollama's runner's arithmetic gives; the tokens before the first shift are the
    unshifted reply's; a sequence of several shifts gives the same tokens beside others."""
    prompt = [1] + [300] * 249
    backend = await load(model_path, n_parallel="2", n_ctx="512")  # 256 cells per slot
    plain = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=7)))
    for n_keep, window, max_tokens in ((4, 256, 100), (-1, 256, 20), (4, 200, 80), (0, 251, 30), (-1, 252, 12)):
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            params = GenerateParams(greedy=True, max_tokens=max_tokens, n_keep=n_keep, shift_window=window)
            result = await collect(backend.generate(prompt if window > 250 else prompt[:150], params))
        assert result.last.finish_reason == "length" and len(result.ids) == max_tokens
        logged = [tuple(map(int, m.groups())) for r in caplog.records if (m := re.search(r"context shift, n_keep (\d+), n_discard (\d+)", r.getMessage()))]
        assert logged == ollama_shifts(250 if window > 250 else 150, n_keep, window, max_tokens), (n_keep, window)
        assert logged
        if window == 256:
            assert result.ids[:6] == plain.ids[:6]
    alone = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=60, n_keep=4, shift_window=256)))
    pair = await asyncio.gather(
        collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=60, n_keep=4, shift_window=256))),
        collect(backend.generate(prompt[:100], GenerateParams(greedy=True, max_tokens=60))),
    )
    assert pair[0].ids == alone.ids


async def test_shifted_sequences_batched_are_as_alone(load: Loader, model_path: Path) -> None:
    """Four sequences decoded together, each shifting at its own step (prompts of different
    lengths, different n_keep / n_discard): each gives the tokens it gives alone."""
    backend = await load(model_path, n_parallel="4", n_ctx="1024", context_shift="true")
    cases = [([1] + [300 + i] * (200 + 15 * i), GenerateParams(greedy=True, max_tokens=90, n_keep=keep, n_discard=drop))
             for i, (keep, drop) in enumerate(((0, 0), (-1, 0), (7, 30), (3, 5)))]
    alone = [await collect(backend.generate(prompt, params)) for prompt, params in cases]
    assert all(r.last.discarded_tokens > 0 for r in alone)
    together = await asyncio.gather(*(collect(backend.generate(prompt, params)) for prompt, params in cases))
    assert [r.ids for r in together] == [r.ids for r in alone]


async def test_a_shifted_slot_leaves_only_unmoved_cells_to_the_cache(load: Loader, model_path: Path) -> None:
    """The cells a shift moved were decoded beside tokens it dropped: a request that found
    them in the slot's cache would not get the output of a cold decode of its prompt. The
    slot keeps the unmoved ones; the next request's output is the same as from a cold slot."""
    prompt = [1] + [300] * 249
    backend = await load(model_path, n_parallel="1", n_ctx="256", context_shift="true", prefix_store_mib="0")
    shifted = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=40, n_keep=-1)))
    follow = [*prompt, *shifted.ids[:3]]
    again = await collect(backend.generate(follow, GenerateParams(greedy=True, max_tokens=4)))
    assert again.last.cached_tokens == 251  # the prompt and one generated token: unmoved
    cold = await load(model_path, n_parallel="1", n_ctx="256", context_shift="true")
    assert (await collect(cold.generate(follow, GenerateParams(greedy=True, max_tokens=4)))).ids == again.ids


async def test_n_keep_needs_the_context_shift(load: Loader, model_path: Path) -> None:
    backend = await load(model_path, n_parallel="1")
    for name in ("n_keep", "n_discard"):
        with pytest.raises(InvalidArgument, match=f"^{name}: model '.*' has no context shift"):
            await collect(backend.generate(PROMPTS[0], GenerateParams(max_tokens=2, **{name: 3})))
    assert (await collect(backend.generate(PROMPTS[0], GenerateParams(max_tokens=2, n_keep=0)))).last.completion_tokens == 2


async def test_stop_string_cuts_text_before_it(load: Loader, model_path: Path) -> None:
    backend = await load(model_path)
    full = await collect(backend.generate(PROMPTS[7], GenerateParams(greedy=True, max_tokens=40)))
    stop = full.text[12:15]
    cut = full.text.find(stop)
    assert cut > 0
    result = await collect(
        backend.generate(PROMPTS[7], GenerateParams(greedy=True, max_tokens=40, stop=["@@never", stop]))
    )
    assert result.text == full.text[:cut]
    assert result.last.finish_reason == "stop"
    assert result.last.completion_tokens < 40
    # The stop string's own tokens were generated (and counted) but never emitted.
    assert result.ids == full.ids[: result.last.completion_tokens]


async def test_cancelled_sequence_frees_its_slot(load: Loader, tmp_path: Path) -> None:
    # Room for a 4000-token sequence, so a cancellation that is ignored cannot go unnoticed.
    path = write_tiny_llama(tmp_path / "long.gguf", n_ctx=4096)
    backend = await load(path, n_parallel="2", n_ctx="8192")
    expected_b = await collect(backend.generate(PROMPTS[3], GREEDY))
    expected_a = await collect(backend.generate(PROMPTS[0], GREEDY))

    stats = backend.engine_stats
    before = stats()["tokens_generated"]
    long_a = backend.generate(PROMPTS[0], GenerateParams(greedy=True, max_tokens=4000))
    b_task = asyncio.create_task(collect(backend.generate(PROMPTS[3], GREEDY)))
    for _ in range(3):
        await anext(long_a)
    await long_a.aclose()

    # The other sequence is served to the end, unchanged.
    b = await b_task
    assert b.ids == expected_b.ids and b.last.finish_reason == "length"
    await wait_until(lambda: stats()["busy"] == 0)
    # The cancelled sequence stopped at the next step after the close (the engine may have
    # run some steps ahead of this consumer before it), far short of its 4000 tokens.
    assert stats()["tokens_generated"] - before - len(b.ids) < 1000
    # The freed slot holds no stale KV cells: the same prompt decodes as before.
    again = await asyncio.gather(
        collect(backend.generate(PROMPTS[0], GREEDY)), collect(backend.generate(PROMPTS[3], GREEDY))
    )
    assert [r.ids for r in again] == [expected_a.ids, expected_b.ids]


async def test_full_queue_is_unavailable(load: Loader, tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "long.gguf", n_ctx=2048)
    backend = await load(path, n_parallel="1", max_queue="2", n_ctx="2048")
    running = backend.generate(PROMPTS[0], GenerateParams(greedy=True, max_tokens=2000))
    await anext(running)  # it holds the only slot now
    waiting = [backend.generate(p, GREEDY) for p in PROMPTS[1:3]]
    tasks = [asyncio.create_task(head(it)) for it in waiting]
    await asyncio.sleep(0)  # both are submitted and wait for the slot
    assert backend.engine_stats()["queued"] == 2
    with pytest.raises(Unavailable, match="generation queue for model 'tiny' is full") as info:
        backend.generate(PROMPTS[3], GREEDY)
    assert info.value.status == 503
    # A slot action is not a generation: it waits for its slot however full the queue is.
    erase = asyncio.create_task(backend.slot_action("erase", 0))
    await asyncio.sleep(0.05)
    assert not erase.done()
    await running.aclose()
    assert (await erase).n_tokens > 0
    heads = await asyncio.gather(*tasks)  # the queued ones get the slot in turn
    assert all(isinstance(h, GenerateChunk) for h in heads)
    for it in waiting:
        await it.aclose()


async def test_prompt_longer_than_context_is_invalid(load: Loader, model_path: Path) -> None:
    backend = await load(model_path, n_parallel="2")
    with pytest.raises(InvalidArgument) as info:
        await anext(backend.generate([1] + [300] * 299, GREEDY))
    assert info.value.status == 400
    assert "prompt is 300 tokens" in info.value.message
    assert "context of 256 tokens per sequence" in info.value.message
    with pytest.raises(InvalidArgument, match=r"prompt is \d+ tokens .* context of 256 tokens"):
        await anext(backend.generate("word " * 300, GREEDY))
    with pytest.raises(InvalidArgument, match="token id 5000 is out of range"):
        await anext(backend.generate([1, 5000], GREEDY))
    # The engine is unharmed.
    assert (await collect(backend.generate(PROMPTS[0], GREEDY))).last.finish_reason == "length"


async def test_unload_cancels_running_sequences(load: Loader, model_path: Path) -> None:
    backend = await load(model_path, n_parallel="1")
    stream = backend.generate(PROMPTS[0], GenerateParams(greedy=True, max_tokens=200))
    await anext(stream)
    await backend.unload()
    rest = await collect(stream)
    assert rest.last.finish_reason == "cancelled"
    with pytest.raises(Unavailable, match="not loaded"):
        backend.generate(PROMPTS[0], GREEDY)


# --------------------------------------------------------------------------- chat, config


# A template llama.cpp's built-in matcher does not know (no marker of a known format), with a
# default system prompt, a BOS, names, and an error for a bad role order (Qwen-like features).
CUSTOM_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}[SYS]You are helpful.[/SYS]{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' and loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'user' %}"
    "{{ raise_exception('two user messages in a row') }}{% endif %}"
    "[{{ m['role'] | upper }}{% if m.name %} {{ m.name }}{% endif %}]{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)


async def test_chat_template_kwargs_reach_a_jinja_template(load: Loader, tmp_path: Path) -> None:
    """llama-server's chat_template_kwargs: more variables for the Jinja template (a Qwen3-style
    `enable_thinking` switch here); names the renderer sets, and non-Jinja templates, refuse them."""
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    thinker = await load(write_tiny_llama(tmp_path / "think.gguf", chat_template=template))
    messages = [{"role": "user", "content": "hi"}]
    assert thinker.chat_prompt(messages) == "<user>hi\n<assistant>"
    assert thinker.chat_prompt(messages, template_kwargs={"enable_thinking": True}) == "<user>hi\n<assistant>"
    assert thinker.chat_prompt(messages, template_kwargs={"enable_thinking": False}) == (
        "<user>hi\n<assistant><think></think>"
    )
    with pytest.raises(InvalidArgument, match="chat_template_kwargs: 'messages' is set by the server"):
        thinker.chat_prompt(messages, template_kwargs={"messages": []})
    builtin = await load(write_tiny_llama(tmp_path / "zephyr.gguf"), chat_template="zephyr")
    with pytest.raises(InvalidArgument, match=r"chat_template_kwargs: the model's chat template .* takes no variables"):
        builtin.chat_prompt(messages, template_kwargs={"enable_thinking": False})
    assert builtin.chat_prompt(messages, template_kwargs={}).startswith("<|user|>")


async def test_chat_prompt_uses_the_gguf_template(load: Loader, model_path: Path, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chatml = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    plain = await load(model_path)
    assert plain.chat_prompt(messages) == chatml
    assert plain.engine_stats()["chat_template"] == "gguf (jinja)"
    # No template in the GGUF: ChatML fallback, same text, and the metadata says so.
    bare = await load(write_tiny_llama(tmp_path / "bare.gguf", chat_template=None))
    assert bare.chat_prompt(messages) == chatml
    assert bare.engine_stats()["chat_template"] == "chatml (fallback)"
    # A llama.cpp built-in template chosen by name in the config.
    zephyr = await load(model_path, chat_template="zephyr")
    assert zephyr.chat_prompt(messages) == (
        "<|system|>\nbe brief<|endoftext|>\n<|user|>\nhi<|endoftext|>\n<|assistant|>\n"
    )
    assert zephyr.engine_stats()["chat_template"].startswith("config (llama.cpp built-in")
    with pytest.raises(InvalidArgument, match=r"messages\[1\]: 'content'"):
        zephyr.chat_prompt([messages[0], {"role": "user"}])
    # The built-in formats cannot show a name: an error, not a silently dropped field.
    with pytest.raises(InvalidArgument, match=r"messages\[1\]\.name"):
        zephyr.chat_prompt([messages[0], {"role": "user", "content": "hi", "name": "bob"}])
    with pytest.raises(ConfigError, match="chat_template does not render as Jinja"):
        await load(model_path, chat_template="{{ made up }}")
    with pytest.raises(ConfigError, match=r"neither Jinja nor a template llama\.cpp knows"):
        await load(model_path, chat_template="made up")


async def test_custom_jinja_template_from_the_gguf(load: Loader, tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "custom.gguf", chat_template=CUSTOM_TEMPLATE)
    backend = await load(path)
    assert backend.engine_stats()["chat_template"] == "gguf (jinja)"
    # Its default system prompt and EOS text are there; the leading BOS text is cut because
    # the tokenizer adds BOS itself (one BOS token, not two).
    prompt = backend.chat_prompt([{"role": "user", "content": "hi", "name": "bob"}])
    assert prompt == "[SYS]You are helpful.[/SYS][USER bob]hi</s>[ASSISTANT]"
    result = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=2)))
    with_bos = await collect(backend.generate("<s>" + prompt, GenerateParams(greedy=True, max_tokens=2)))
    assert with_bos.last.prompt_tokens == result.last.prompt_tokens + 1
    with pytest.raises(InvalidArgument, match="two user messages in a row"):
        backend.chat_prompt([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    # A template that is not valid Jinja but carries a known format's markers: llama.cpp's matcher.
    broken = write_tiny_llama(tmp_path / "broken.gguf", chat_template="<|im_start|>{% bogus %}")
    matched = await load(broken)
    assert matched.engine_stats()["chat_template"] == "gguf (llama.cpp built-in match)"
    assert matched.chat_prompt([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user\nhi")
    # A Jinja override in the config wins over the GGUF's template.
    override = await load(path, chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert override.chat_prompt([{"role": "user", "content": "hi"}]) == "<user>hi"
    assert override.engine_stats()["chat_template"] == "config (jinja)"


# Real chat templates of popular families, and the prompts llama.cpp's llama-server (--jinja,
# same llama.cpp as llama-cpp-python) renders for them at POST /apply-template.
TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
APPLY_TEMPLATE = json.loads((TEMPLATES / "apply_template.json").read_text())


@pytest.mark.parametrize("family", sorted(APPLY_TEMPLATE["prompts"]))
async def test_real_templates_render_what_llama_server_renders(load: Loader, tmp_path: Path, family: str) -> None:
    """Hermes 2 Pro loops over `tools` when none are given (undefined, not None); Gemma 2 has no
    system role (the system text goes before the first user message); Llama 3.1 prints today's
    `date_string` (llama-server's extra context), as llama-server does for each."""
    template = (TEMPLATES / f"{family}.jinja").read_text()
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template))
    assert backend.engine_stats()["chat_template"] == "gguf (jinja)"
    today = datetime.datetime.now().strftime("%d %b %Y")
    for case, messages in APPLY_TEMPLATE["cases"].items():
        expected = APPLY_TEMPLATE["prompts"][family][case].replace("{date_string}", today)
        assert backend.chat_prompt(messages) == expected, case
    if family == "google-gemma-2-2b-it":
        # Nothing after the system message to carry its text: not silently dropped.
        with pytest.raises(InvalidArgument, match="has no system role"):
            backend.chat_prompt([{"role": "system", "content": "Be brief."}])


async def test_a_template_failing_on_a_request_is_invalid_argument(load: Loader, tmp_path: Path) -> None:
    """Whatever the template's code raises on a request's messages (here a division by zero,
    not a Jinja error) is the request's 400, not a server error."""
    template = "{% for m in messages %}{{ m.content }}{% if m.content == 'zero' %}{{ 1 // 0 }}{% endif %}{% endfor %}"
    backend = await load(write_tiny_llama(tmp_path / "model.gguf", chat_template=template))
    assert backend.chat_prompt([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(InvalidArgument, match="chat template refused them: integer division"):
        backend.chat_prompt([{"role": "user", "content": "zero"}])


async def test_invalid_parameters_name_the_field(load: Loader, model_path: Path) -> None:
    with pytest.raises(ConfigError, match="n_paralel"):
        await load(model_path, n_paralel="2")
    with pytest.raises(ConfigError, match=r"n_batch \(2\) must be >= n_parallel \(4\)"):
        await load(model_path, n_batch="2")
    with pytest.raises(ConfigError, match="n_parallel"):
        await load(model_path, n_parallel="many")
    with pytest.raises(ConfigError, match="flash_attn"):
        await load(model_path, flash_attn="maybe")
    # Beyond what llama.cpp's C fields hold: ctypes would keep the low bits (n_batch 2**32+1
    # became 1 and a GGML_ASSERT ended the process; n_ctx 2**40 became 0, the default).
    for name, value, bound in (("n_ctx", 2**40, "<= 2147483647"), ("n_batch", 2**32 + 1, "<= 2147483647"),
                               ("n_threads", 513, "<= 512"), ("n_gpu_layers", 2**32, "<= 2147483647"),
                               ("n_gpu_layers", -2, ">= -1")):
        with pytest.raises(ConfigError, match=rf"invalid llamacpp parameters: Expected `int` {bound} - at `\$\.{name}`"):
            await load(model_path, **{name: str(value)})


async def test_unreadable_gguf_fails_load(load: Loader, tmp_path: Path) -> None:
    broken = tmp_path / "model.gguf"
    broken.write_bytes(b"GGUF not really")
    with pytest.raises(BackendError, match="could not load model 'tiny'") as info:
        await load(broken)
    assert info.value.status == 500


# --------------------------------------------------------------------------- embeddings


async def test_embeddings_match_numpy_mean_pooling(load: Loader, tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "embed.gguf", pooling=1)
    backend = await load(path, embedding="true")
    texts = ["Q", "the quick brown fox", "Q", "zzz"]
    vectors, tokens = await backend.embed(texts)
    array = np.array(vectors)
    assert array.shape == (4, 64)
    np.testing.assert_allclose(np.linalg.norm(array, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(array[0], array[2], atol=1e-4)  # same text, other batch row
    assert not np.allclose(array[0], array[1], atol=1e-2)
    # "Q" is <s> "▁" "Q": compare with mean pooling of the numpy reference, normalised.
    ids = [1, token_id(path, SPACE), token_id(path, "Q")]
    expected = reference_forward(read_weights(path), ids).mean(axis=0)
    np.testing.assert_allclose(array[0], expected / np.linalg.norm(expected), atol=2e-3)
    singles = [await backend.embed([text]) for text in texts]
    assert singles[0][1] == 3
    assert tokens == sum(count for _, count in singles)
    for (single, _), batched in zip(singles, array, strict=True):
        np.testing.assert_allclose(single[0], batched, atol=1e-4)
    with pytest.raises(InvalidArgument, match="embedding model"):
        await anext(backend.generate("hi", GREEDY))


@pytest.mark.parametrize("add_eos", [False, True])
async def test_truncated_embedding_is_the_models_for_the_first_tokens(
    load: Loader, tmp_path: Path, add_eos: bool
) -> None:
    """Ollama's `truncate`: a text longer than the model embeds at once keeps its first tokens,
    and the end token its tokenizer appends (here </s>, as a BERT vocabulary appends SEP)."""
    path = write_tiny_llama(tmp_path / "embed.gguf", pooling=1, add_eos=add_eos)
    backend = await load(path, embedding="true", n_batch="16")
    text = "QZ" * 20  # no merge joins Q and Z: <s> ▁ Q Z Q Z ... (</s>)
    with pytest.raises(InvalidArgument, match="embeds at most 16 tokens"):
        await backend.embed([text])
    vectors, count = await backend.embed([text, "QZ"], truncate=True)
    assert count == 16 + 4 + add_eos  # the short text is not touched
    ids = [1, token_id(path, SPACE), *(token_id(path, c) for c in text)]
    kept = [*ids[:15], 2] if add_eos else ids[:16]
    expected = reference_forward(read_weights(path), kept).mean(axis=0)
    np.testing.assert_allclose(vectors[0], expected / np.linalg.norm(expected), atol=2e-3)


@pytest.mark.parametrize("add_eos", [False, True])
async def test_token_ids_are_embedded_as_given(load: Loader, tmp_path: Path, add_eos: bool) -> None:
    """Token input (OpenAI's, llama-server's): the ids are the sequence, no BOS/EOS added, so
    the text's own ids give the text's vector and ids without BOS give their own."""
    path = write_tiny_llama(tmp_path / "embed.gguf", pooling=1, add_eos=add_eos)
    backend = await load(path, embedding="true")
    weights = read_weights(path)
    text_ids = [1, token_id(path, SPACE), token_id(path, "Q"), *([2] if add_eos else [])]
    bare = [token_id(path, SPACE), token_id(path, "Q")]
    vectors, count = await backend.embed(["Q", text_ids, bare])
    assert count == 2 * len(text_ids) + 2
    np.testing.assert_allclose(vectors[1], vectors[0], atol=1e-5)
    expected = reference_forward(weights, bare).mean(axis=0)
    np.testing.assert_allclose(vectors[2], expected / np.linalg.norm(expected), atol=2e-3)


async def test_token_ids_outside_the_vocabulary_or_too_many(load: Loader, tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "embed.gguf", pooling=1)
    backend = await load(path, embedding="true", n_batch="16")
    n_vocab = len(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)
    with pytest.raises(InvalidArgument) as info:
        await backend.embed(["Q", [1, 5, n_vocab]])
    assert info.value.message == f"input[1][2]: token id {n_vocab} is out of range (vocabulary {n_vocab})"
    with pytest.raises(InvalidArgument, match=r"^input\[0\]\[0\]: token id -1 is out of range"):
        await backend.embed([[-1]])
    with pytest.raises(InvalidArgument, match=r"^input\[1\]: an empty list of token ids has nothing to embed$"):
        await backend.embed([[1], []])
    ids = [1, *(token_id(path, c) for c in "QZ" * 20)]
    with pytest.raises(InvalidArgument, match=r"^input\[0\] is 41 tokens but model .* embeds at most 16 tokens"):
        await backend.embed([ids])
    # Ollama's `truncate` cuts token input plainly: nothing was appended to keep.
    vectors, count = await backend.embed([ids], truncate=True)
    assert count == 16
    expected = reference_forward(read_weights(path), ids[:16]).mean(axis=0)
    np.testing.assert_allclose(vectors[0], expected / np.linalg.norm(expected), atol=2e-3)
    assert (await backend.embed(["Q"]))[1] == 3  # the engine still serves after the refusals


async def test_generation_model_refuses_embeddings(load: Loader, model_path: Path) -> None:
    backend = await load(model_path)
    with pytest.raises(InvalidArgument, match="embedding=true"):
        await backend.embed(["hello"])


# --------------------------------------------------------------------------- prefix cache


async def test_repeat_prompt_decodes_only_its_last_token(load: Loader, model_path: Path) -> None:
    prompt = [1, *range(300, 340)]
    backend = await load(model_path, n_parallel="2")
    cold = await collect(backend.generate(prompt, GREEDY))
    assert cold.last.cached_tokens == 0
    before = backend.engine_stats()
    again = await collect(backend.generate(prompt, GREEDY))
    after = backend.engine_stats()
    assert again.ids == cold.ids
    # Every prompt token but the last came from the slot's cache (the last one is decoded
    # again for its logits).
    assert again.last.cached_tokens == len(prompt) - 1
    assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == len(prompt) - 1
    assert after["prompt_tokens_evaluated"] - before["prompt_tokens_evaluated"] == 1
    # The idle slot keeps its cells: prompt + generated tokens but the last (never decoded).
    assert after["kv_cells_used"] == len(prompt) + len(cold.ids) - 1


async def test_next_turn_reuses_the_conversation_and_matches_cold(load: Loader, model_path: Path) -> None:
    first = [1, *range(300, 330)]
    backend = await load(model_path, n_parallel="2")
    turn1 = await collect(backend.generate(first, GREEDY))
    # Another conversation in between takes the other (least recently used) slot.
    other = [1, *range(340, 360)]
    await collect(backend.generate(other, GREEDY))
    second = first + turn1.ids + [350, 351, 352]
    turn2 = await collect(backend.generate(second, GREEDY))
    # The prompt, and what was generated for it, came from the cache.
    assert turn2.last.cached_tokens == len(first) + len(turn1.ids) - 1
    back = await collect(backend.generate([*other, 360], GREEDY))
    assert back.last.cached_tokens == len(other)
    # Same greedy tokens as a cold engine computing everything from scratch.
    cold = await load(model_path, n_parallel="1")
    assert (await collect(cold.generate(second, GREEDY))).ids == turn2.ids
    assert (await collect(cold.generate([*other, 360], GREEDY))).ids == back.ids


async def test_long_prompts_share_exactly_their_common_prefix(load: Loader, tmp_path: Path) -> None:
    # Prompts longer than the prefix search's 256-token blocks, differing inside the third block.
    rng = np.random.default_rng(7)
    first = [1, *(int(t) for t in rng.integers(3, 379, 700))]
    second = [*first[:600], *(int(t) for t in rng.integers(3, 379, 50))]
    assert second[600] != first[600]
    path = write_tiny_llama(tmp_path / "long.gguf", n_ctx=1024)
    backend = await load(path, n_parallel="1", n_ctx="1024")
    await collect(backend.generate(first, GREEDY))
    turn = await collect(backend.generate(second, GREEDY))
    assert turn.last.cached_tokens == 600
    cold = await load(path, n_parallel="1", n_ctx="1024")
    assert (await collect(cold.generate(second, GREEDY))).ids == turn.ids


async def test_repeated_text_prompt_matches_cold(load: Loader, model_path: Path) -> None:
    # A text prompt seen before skips the tokenizer (the engine remembers recent prompts):
    # same tokens, same output, and every prompt token but the last from the cache.
    backend = await load(model_path, n_parallel="1")
    text = PROMPTS[7]
    cold = await collect(backend.generate(text, GREEDY))
    # More other prompts than the engine remembers: the first repeat is tokenized afresh,
    # the second comes from the memo.
    for i in range(10):
        await collect(backend.generate(f"{PROMPTS[i % 7]} {i}", GenerateParams(greedy=True, max_tokens=2)))
    again = [await collect(backend.generate(text, GREEDY)) for _ in range(2)]
    assert [r.ids for r in again] == [cold.ids, cold.ids]
    assert again[0].last.prompt_tokens == cold.last.prompt_tokens
    assert again[1].last.cached_tokens == cold.last.prompt_tokens - 1


async def test_held_first_chunk_does_not_stall_other_sequences(load: Loader, model_path: Path) -> None:
    # After a request's first chunk the engine waits for its consumer to send it on, but only
    # briefly: a consumer that never comes back must not hold up anyone else.
    backend = await load(model_path, n_parallel="2")
    alone = [await collect(backend.generate(p, GREEDY)) for p in (PROMPTS[0], PROMPTS[3])]
    held = backend.generate(PROMPTS[0], GREEDY)
    first = await anext(held)  # and not back for more until the other request is done
    other = await asyncio.wait_for(collect(backend.generate(PROMPTS[3], GREEDY)), 30)
    assert other.ids == alone[1].ids and other.last.finish_reason == "length"
    rest = await collect(held)
    assert first.token_ids + rest.ids == alone[0].ids


async def test_unrelated_prompt_takes_the_least_recently_used_slot(load: Loader, model_path: Path) -> None:
    a, b, c = ([1, *range(start, start + 20)] for start in (260, 290, 320))
    # Slots alone: with the host-RAM store (on by default) an evicted prompt comes back from it.
    backend = await load(model_path, n_parallel="2", prefix_store_mib="0")
    # c evicts a's slot (used longest ago), not b's; it shares only the BOS with a.
    for prompt, cached in ((a, 0), (b, 0), (c, 1)):
        assert (await collect(backend.generate(prompt, GREEDY))).last.cached_tokens == cached
    assert (await collect(backend.generate(b, GREEDY))).last.cached_tokens == len(b) - 1
    assert (await collect(backend.generate(c, GREEDY))).last.cached_tokens == len(c) - 1
    assert (await collect(backend.generate(a, GREEDY))).last.cached_tokens == 1


# --------------------------------------------------------------------------- sampling parameters


async def test_logit_bias_and_penalties_change_the_output(load: Loader, model_path: Path) -> None:
    prompt = [1, *range(300, 320)]
    backend = await load(model_path)
    base = await collect(backend.generate(prompt, GREEDY))
    forced = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=6, logit_bias={305: 100.0})))
    assert forced.ids == [305] * 6
    banned = await collect(
        backend.generate(prompt, GenerateParams(greedy=True, max_tokens=24, logit_bias={base.ids[0]: -100.0}))
    )
    assert base.ids[0] not in banned.ids
    # OpenAI's penalties: logit - frequency * count - presence * [count > 0], counting the
    # prompt's tokens too. Find prompts (numpy reference logits) where that changes the first
    # greedy token, with clear margins, and check llama.cpp picks the predicted one.
    weights = read_weights(model_path)
    rng = np.random.default_rng(0)
    checked = {"frequency_penalty": 0, "presence_penalty": 0}
    for _ in range(200):
        candidate = [1, *(int(t) for t in rng.integers(300, 379, 12)), *([int(rng.integers(300, 379))] * 3)]
        logits = reference_forward(weights, candidate)[-1] @ weights["output.weight"].T
        counts = np.bincount(candidate, minlength=len(logits)).astype(np.float64)
        for name, penalty in (("frequency_penalty", 1.5 * counts), ("presence_penalty", 1.5 * (counts > 0))):
            if checked[name] >= 2:
                continue
            penalised = np.sort(logits - penalty)
            if int(np.argmax(logits - penalty)) == int(np.argmax(logits)) or penalised[-1] - penalised[-2] < 0.1:
                continue
            params = GenerateParams(greedy=True, max_tokens=1, **{name: 1.5})
            first = await collect(backend.generate(candidate, params))
            assert first.ids == [int(np.argmax(logits - penalty))], name
            checked[name] += 1
        if min(checked.values()) >= 2:
            break
    assert min(checked.values()) >= 2, checked
    with pytest.raises(InvalidArgument, match="logit_bias: token id 99999"):
        await collect(backend.generate(prompt, GenerateParams(logit_bias={99999: 1.0})))
    with pytest.raises(InvalidArgument, match=r"presence_penalty must be in \[-2, 2\]"):
        await collect(backend.generate(prompt, GenerateParams(presence_penalty=3.0)))


async def test_penalty_window_is_one_for_all_penalties(load: Loader, model_path: Path) -> None:
    """`penalty_last_n` (Ollama's repeat_last_n): the penalties count only the last N tokens;
    0 turns them off, -1 is the whole context. Checked against numpy reference logits on
    prompts where the window changes the first greedy token."""
    backend = await load(model_path)
    weights = read_weights(model_path)
    rng = np.random.default_rng(1)
    window, checked = 4, 0
    for _ in range(300):
        candidate = [1, *(int(t) for t in rng.integers(300, 379, 14))]
        logits = reference_forward(weights, candidate)[-1] @ weights["output.weight"].T
        seen_all = np.bincount(candidate, minlength=len(logits)) > 0
        seen_last = np.bincount(candidate[-window:], minlength=len(logits)) > 0
        expected = {n: logits - 1.5 * seen for n, seen in ((window, seen_last), (-1, seen_all))}
        expected[0] = logits
        picks = {n: int(np.argmax(v)) for n, v in expected.items()}
        margins = [np.diff(np.sort(v)[-2:])[0] for v in expected.values()]
        if picks[window] == picks[-1] or min(margins) < 0.1:
            continue  # the window must matter, and clearly
        for last_n, pick in picks.items():
            params = GenerateParams(greedy=True, max_tokens=1, presence_penalty=1.5, penalty_last_n=last_n)
            assert (await collect(backend.generate(candidate, params))).ids == [pick], last_n
        checked += 1
        if checked == 2:
            break
    assert checked == 2
    with pytest.raises(InvalidArgument, match="penalty_last_n must be between -1 and 2147483647, got -2"):
        await collect(backend.generate([1, 300], GenerateParams(penalty_last_n=-2)))


async def test_windows_past_every_token_count_them_all_without_allocating_them(
    load: Loader, model_path: Path
) -> None:
    """A penalty or DRY window longer than a generation can ever be counts what -1 (the
    context) counts. llama.cpp allocates a window whole when the sampler is made: 2**31 - 1
    tokens of DRY took 16 GB and 42 s of one request before. Past 32 bits a count would reach
    llama.cpp as another number (2**32 + 1 as 1): refused, as is a window a shifting
    generation without max_tokens could fill."""
    backend = await load(model_path, n_parallel="1", n_ctx="256")
    prompt = [1, *range(300, 330), *range(300, 330)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    penalties = [(await collect(backend.generate(prompt, GenerateParams(
        greedy=True, max_tokens=24, presence_penalty=1.5, frequency_penalty=0.5, penalty_last_n=n)))).ids
        for n in (-1, 2**31 - 1, 0)]
    assert penalties[0] == penalties[1] != penalties[2]  # the window matters, and all of it counts
    # DRY as in the OpenAI route's test: after "abcdabc", "d" (biased +100) would extend a run
    # of 3 past the allowed 2 and loses 100 * 1.75; with the last 3 tokens only, it wins.
    letters = [259 + ord(c) - 0x20 for c in "abcdabc"]
    dry = {"dry_multiplier": 100.0, "dry_base": 1.75, "dry_allowed_length": 2, "logit_bias": {letters[3]: 100.0}}
    picks = [(await collect(backend.generate(letters, GenerateParams(
        greedy=True, max_tokens=1, dry_penalty_last_n=n, **dry)))).ids for n in (-1, 2**31 - 1, 3)]
    assert picks[0] == picks[1] != picks[2] == [letters[3]]
    for name in ("penalty_last_n", "dry_penalty_last_n"):
        with pytest.raises(InvalidArgument, match=f"{name} must be between -1 and 2147483647, got 2147483648"):
            await collect(backend.generate(prompt, GenerateParams(**{name: 2**31})))
        endless = GenerateParams(max_tokens=None, shift_window=128, **{name: 2**31 - 1})
        with pytest.raises(InvalidArgument, match=f"{name}: a window of 2147483647 tokens is more than this "
                                                  r"generation may hold in memory \(1048576 tokens\)"):
            await collect(backend.generate(prompt, endless))
    # KiB on Linux: the old windows raised the peak by 8 and 16 GB.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 512 * 1024
    with pytest.raises(InvalidArgument, match="top_k must be between -2147483648 and 2147483647, got 4294967297"):
        await collect(backend.generate(prompt, GenerateParams(top_k=2**32 + 1)))
    # A finite number past float32 would reach llama.cpp's samplers as infinity.
    for name in ("temperature", "repeat_penalty", "dry_base", "mirostat_tau", "top_n_sigma"):
        with pytest.raises(InvalidArgument, match=rf"{name} must be within llama.cpp's 32-bit floats \(at most "
                                                  r"3.40282e\+38 either way\), got 1e\+300"):
            await collect(backend.generate(prompt, GenerateParams(**{name: 1e300})))


async def test_default_max_tokens_is_the_rest_of_the_context(load: Loader, model_path: Path) -> None:
    backend = await load(model_path, n_parallel="1", n_ctx="256")
    prompt = [1, *range(300, 340)]
    result = await collect(backend.generate(prompt, GenerateParams(greedy=True)))
    assert result.last.finish_reason == "length"
    assert result.last.completion_tokens == 256 - len(prompt) + 1
    nothing = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=0)))
    assert (nothing.text, nothing.last.finish_reason, nothing.last.prompt_tokens) == ("", "length", len(prompt))
    assert nothing.last.completion_tokens == 0


async def test_grammar_constrains_the_output(load: Loader, model_path: Path) -> None:
    backend = await load(model_path)
    grammar = 'root ::= "yes" | "no"'
    for seed in range(3):
        params = GenerateParams(temperature=1.0, seed=seed, max_tokens=20, grammar=grammar)
        result = await collect(backend.generate(PROMPTS[seed], params))
        assert result.text in ("yes", "no")
        assert result.last.finish_reason == "stop"  # the grammar leaves only end-of-text
    with pytest.raises(InvalidArgument, match=r"grammar: llama\.cpp could not parse it"):
        await collect(backend.generate(PROMPTS[0], GenerateParams(grammar="root ::= (")))
    # Where llama.cpp's log says why, so does the answer.
    for bad, why in (('root ::= root "a"', "left recursion"), ('x ::= "a"', "grammar does not contain a 'root' symbol")):
        with pytest.raises(InvalidArgument, match=rf"^grammar: llama\.cpp could not parse it: .*{why}"):
            await collect(backend.generate(PROMPTS[0], GenerateParams(grammar=bad)))


async def test_logprobs_are_the_models_distribution(load: Loader, model_path: Path) -> None:
    prompt = [1, 300, 301, 320, 330, 270, 280]
    backend = await load(model_path)
    result = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=6, logprobs=3)))
    entries = [e for chunk in result.chunks for e in chunk.logprobs]
    assert [e.token_id for e in entries] == result.ids
    weights = read_weights(model_path)
    logits = reference_forward(weights, prompt)[-1] @ weights["output.weight"].T
    expected = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    first = entries[0]
    assert first.logprob == pytest.approx(expected[first.token_id], abs=0.05)
    assert [t.token_id for t in first.top] == list(np.argsort(-expected)[:3])
    for entry in entries:
        # Greedy: the chosen token is the most likely one; alternatives sorted, all <= 0.
        assert entry.top[0].token_id == entry.token_id and entry.top[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
        assert entry.logprob <= 0 and entry.piece
    plain = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=6)))
    assert plain.ids == result.ids and all(not c.logprobs for c in plain.chunks)


async def test_suffix_builds_the_fill_in_the_middle_prompt(load: Loader, model_path: Path, tmp_path: Path) -> None:
    plain = await load(model_path)
    with pytest.raises(InvalidArgument, match="suffix: model 'tiny' has no fill-in-the-middle tokens"):
        await collect(plain.generate("def f(", GenerateParams(suffix="): pass")))
    fim = await load(with_fim_tokens(model_path, tmp_path / "fim.gguf", 300, 301, 302))
    result = await collect(fim.generate("def f(", GenerateParams(greedy=True, max_tokens=8, suffix="): pass")))
    # The same tokens by hand: BOS, FIM prefix, the text before, FIM suffix, the text after, FIM middle.
    from llama_cpp import Llama

    vocab = Llama(str(model_path), vocab_only=True, verbose=False)
    manual = [1, 300, *vocab.tokenize(b"def f(", add_bos=False), 301, *vocab.tokenize(b"): pass", add_bos=False), 302]
    assert result.last.prompt_tokens == len(manual)
    assert (await collect(fim.generate(manual, GenerateParams(greedy=True, max_tokens=8)))).ids == result.ids
    with pytest.raises(InvalidArgument, match="suffix: only supported with a text prompt"):
        await collect(fim.generate([1, 300], GenerateParams(suffix="x")))


@pytest.fixture
def plugin(backend_class: Callable[[str], type[Any]]) -> Any:
    """The plugin's module, as the registry imported it (for its module-level helpers)."""
    return sys.modules[backend_class("llamacpp").__module__]


async def test_prefix_store_brings_back_an_evicted_conversation(load: Loader, model_path: Path, plugin: Any) -> None:
    a, b = [1, *range(300, 340)], [1, *range(340, 378)]
    # Without a store (turned off), one slot: b pushes a out, a is decoded again (only the
    # BOS is shared).
    cold = await load(model_path, n_parallel="1", prefix_store_mib="0")
    expected = [await collect(cold.generate(p, GREEDY)) for p in (a, b)]
    await collect(cold.generate(a, GREEDY))
    assert (await collect(cold.generate(a, GREEDY))).last.cached_tokens == len(a) - 1
    await collect(cold.generate(b, GREEDY))
    assert (await collect(cold.generate(a, GREEDY))).last.cached_tokens == 1
    assert cold.engine_stats()["prefix_store_budget_bytes"] == 0

    # On by default, as llama-server's --cache-ram: a comes back from host RAM.
    stored = await load(model_path, n_parallel="1")
    await collect(stored.generate(a, GREEDY))
    await collect(stored.generate(b, GREEDY))  # a's cells go to the store
    again = await collect(stored.generate(a, GREEDY))  # and come back from it
    assert again.last.cached_tokens == len(a) - 1
    assert again.ids == expected[0].ids
    back = await collect(stored.generate(b, GREEDY))  # b was stored when a came back
    assert back.last.cached_tokens == len(b) - 1 and back.ids == expected[1].ids
    stats = stored.engine_stats()
    assert stats["prefix_store_hits"] == 2 and stats["prefix_store_entries"] == 2
    assert stats["prefix_store_budget_bytes"] == plugin.default_prefix_store_mib() * 2**20
    assert 0 < stats["prefix_store_bytes"] <= stats["prefix_store_budget_bytes"]


def test_default_prefix_store_is_llama_servers_capped_by_memory(plugin: Any) -> None:
    physical_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    assert plugin.LLAMA_SERVER_CACHE_RAM_MIB == 8192  # llama-server's --cache-ram default
    assert plugin.default_prefix_store_mib() == min(8192, physical_mib // 8)


async def test_prompt_logprobs_score_each_token_given_those_before(load: Loader, model_path: Path) -> None:
    """`prompt_logprobs` (OpenAI's echo with logprobs): entry i is token i's log probability
    after tokens 0..i-1, as numpy computes it; the first is unscored. A cached prefix does not
    cut the scores short, and max_tokens 0 scores without generating."""
    prompt = [1, 300, 301, 320, 330, 270, 280, 290, 311, 345, 302, 377]
    expected = reference_logprobs(model_path, prompt)
    backend = await load(model_path)
    await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=2)))  # now cached
    for max_tokens in (0, 3):
        params = GenerateParams(greedy=True, max_tokens=max_tokens, prompt_logprobs=2)
        result = await collect(backend.generate(prompt, params))
        entries = result.chunks[0].prompt_logprobs
        assert all(not chunk.prompt_logprobs for chunk in result.chunks[1:])
        assert [e.token_id for e in entries] == prompt
        assert (entries[0].logprob, entries[0].top) == (0.0, [])
        for position, entry in enumerate(entries[1:], start=1):
            assert entry.logprob == pytest.approx(expected[position - 1][prompt[position]], abs=0.05)
            assert [t.token_id for t in entry.top] == list(np.argsort(-expected[position - 1])[:2])
        assert result.last.completion_tokens == max_tokens
        assert (result.last.prompt_tokens, result.last.cached_tokens) == (len(prompt), 0)
    alone = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=3)))
    assert alone.ids == result.ids  # scoring the prompt does not change what follows it


async def test_long_prompt_is_scored_over_several_steps(load: Loader, tmp_path: Path) -> None:
    # More prompt tokens than one scored step evaluates (64), beside another sequence.
    path = write_tiny_llama(tmp_path / "model.gguf", n_ctx=1024)
    backend = await load(path, n_parallel="2")
    prompt = [1, *(300 + (i * 7) % 79 for i in range(150))]
    expected = reference_logprobs(path, prompt)
    other = collect(backend.generate([1, 310, 311], GenerateParams(greedy=True, max_tokens=40)))
    scored, _ = await asyncio.gather(
        collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=1, prompt_logprobs=0))), other
    )
    entries = scored.chunks[0].prompt_logprobs
    assert len(entries) == len(prompt)
    got = np.array([e.logprob for e in entries[1:]])
    want = expected[np.arange(len(prompt) - 1), prompt[1:]]
    assert np.abs(got - want).max() < 0.05


async def test_fim_stops_and_prompt_progress_chunks(load: Loader, model_path: Path) -> None:
    """llama-server's n_indent and t_max_predict_ms end the output with finish_reason length
    and say which (finish_detail); n_indent's last chunk names the characters a whole answer
    cuts. return_progress: chunks with prompt_progress before the first token."""
    backend = await load(model_path, n_batch="16")
    grammar = 'root ::= "a\\n    b\\n  c\\nd"'
    free = await collect(backend.generate(PROMPTS[0], GenerateParams(greedy=True, max_tokens=32, grammar=grammar)))
    assert free.text == "a\n    b\n  c\nd" and free.last.finish_reason == "stop"
    params = GenerateParams(greedy=True, max_tokens=32, grammar=grammar, n_indent=2)
    got = await collect(backend.generate(PROMPTS[0], params))
    assert got.text == free.text and got.last.finish_reason == "length"  # the chunks sent the line
    assert got.last.finish_detail == "indent" and got.last.cut == 1 and got.ids == free.ids[: len(got.ids)]
    newline = 3 + 10
    lines = GenerateParams(greedy=True, max_tokens=400, logit_bias={newline: 60.0}, t_max_predict_ms=1)
    timed = await collect(backend.generate(PROMPTS[0], lines))
    assert timed.last.finish_detail == "time" and timed.last.finish_reason == "length"
    assert timed.last.cut == 0 and 2 <= len(timed.ids) < 400
    assert (await collect(backend.generate(PROMPTS[0], GREEDY))).last.finish_detail == ""
    prompt = [1] + [300 + i % 40 for i in range(39)]  # 40 tokens in batches of 16
    streamed = await collect(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=2, cache_prompt=False, return_progress=True)))
    progress = [c.prompt_progress for c in streamed.chunks if c.prompt_progress is not None]
    assert [p[:3] for p in progress] == [(40, 0, 0), (40, 0, 16), (40, 0, 32), (40, 0, 40)]
    assert all(c.prompt_progress is not None for c in streamed.chunks[:4]) and not streamed.chunks[0].text
    with pytest.raises(InvalidArgument, match="n_indent must be >= 0, got -1"):
        await collect(backend.generate(PROMPTS[0], GenerateParams(n_indent=-1)))
