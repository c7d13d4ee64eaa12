"""A model whose memory is a recurrent state (a tiny random Mamba, tests/gguf_builder.py),
not one cell per token: the slot's cache may serve a prompt only when the state is exactly
what the prompt begins with, since llama.cpp cannot cut it back to a shorter prefix. Checked
against llama-cpp-python's own high-level `Llama` decoding each prompt afresh."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from gguf_builder import llama_cpp_python_greedy, write_tiny_mamba

from daemon.backend import GenerateChunk, GenerateParams
from daemon.errors import ConfigError, InvalidArgument

pytest.importorskip("gguf")

Loader = Callable[..., Awaitable[Any]]
STEPS = 8


@pytest.fixture
def mamba(tmp_path: Path) -> Path:
    return write_tiny_mamba(tmp_path / "mamba.gguf")


def fresh(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return llama_cpp_python_greedy(path, prompts, STEPS)


async def run(backend: Any, prompt: list[int], params: GenerateParams) -> tuple[list[int], GenerateChunk]:
    ids: list[int] = []
    last = None
    async for chunk in backend.generate(prompt, params):
        ids += chunk.token_ids
        last = chunk
    assert last is not None
    return ids, last


async def test_a_state_serves_only_the_prompt_it_ends(load_llamacpp: Loader, mamba: Path) -> None:
    """A prompt that shares only part of the slot's tokens is decoded whole (the state
    cannot be cut back), one that goes on from all of them starts after them; both write
    what a fresh decode writes."""
    backend = await load_llamacpp(mamba, n_parallel="1", prefix_store_mib="0")
    greedy = GenerateParams(greedy=True, max_tokens=STEPS)
    first = [1, 300, 301, 302, 303, 304, 305]
    ids, last = await run(backend, first, greedy)
    assert ids == fresh(mamba, [first])[0] and last.cached_tokens == 0
    # The slot holds the prompt and the tokens decoded after it (all but the last sampled).
    held = first + ids[:-1]
    onward = [*held, 310, 311]
    partial = [*first[:4], 320, 321]
    repeat = list(first)
    expected = fresh(mamba, [onward, partial, repeat])
    ids, last = await run(backend, onward, greedy)
    assert (ids, last.cached_tokens) == (expected[0], len(held))
    ids, last = await run(backend, partial, greedy)
    assert (ids, last.cached_tokens) == (expected[1], 0)
    await run(backend, first, greedy)
    # The same prompt again: its last token must be decoded again, which the state cannot
    # undo either.
    ids, last = await run(backend, repeat, greedy)
    assert (ids, last.cached_tokens) == (expected[2], 0)


async def test_after_a_shift_the_state_serves_no_prefix(load_llamacpp: Loader, mamba: Path) -> None:
    """llama-server's context shift on a recurrent model renumbers the state's positions; the
    state still holds every token. The slot must then offer none of them as a cached prefix
    (it used to offer the first n_keep, and a prompt beginning with them was decoded after
    the whole old state)."""
    backend = await load_llamacpp(mamba, n_parallel="1", n_ctx="256", context_shift="true", prefix_store_mib="0")
    prompt = [1] + [300 + i % 40 for i in range(200)]
    _, last = await run(backend, prompt, GenerateParams(greedy=True, max_tokens=80, n_keep=4))
    assert last.completion_tokens == 80  # past the slot's 256 cells: it shifted
    again = [*prompt[:5], 330, 331, 332]
    ids, last = await run(backend, again, GenerateParams(greedy=True, max_tokens=STEPS))
    assert last.cached_tokens == 0
    assert ids == fresh(mamba, [again])[0]


async def test_cache_reuse_is_refused_for_a_state(load_llamacpp: Loader, mamba: Path) -> None:
    with pytest.raises(ConfigError, match="cache_reuse is set, but this model's memory has no cells"):
        await load_llamacpp(mamba, cache_reuse="8")
    backend = await load_llamacpp(mamba, n_parallel="1")
    with pytest.raises(InvalidArgument, match="n_cache_reuse: model 'tiny' has no cached cells to move"):
        await run(backend, [1, 300, 301], GenerateParams(greedy=True, max_tokens=2, n_cache_reuse=4))
