"""LoRA adapters of the llama.cpp backend (the model's `lora` parameter), on a tiny random
GGUF and a random adapter written for it (tests/gguf_builder.py), against two independent
computations: llama-cpp-python's own high-level `Llama(model, lora_path=, lora_scale=)` (the
same llama.cpp, set up by other code) and numpy with the adapter merged into the weights."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_builder import (
    llama_cpp_python_greedy,
    merged_weights,
    reference_forward,
    reference_greedy,
    write_tiny_llama,
    write_tiny_lora,
)

from daemon.backend import GenerateChunk, GenerateParams, LoraAdapter
from daemon.errors import ConfigError, InvalidArgument

pytest.importorskip("gguf")

Loader = Callable[..., Awaitable[Any]]
STEPS = 16
GREEDY = GenerateParams(greedy=True, max_tokens=STEPS)
PROMPTS = ["Hello world", "Once upon a time", "1 2 3 4 5 6 7", "def main(): return 42"]


@pytest.fixture
def load(load_llamacpp: Loader) -> Loader:
    return load_llamacpp


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "model.gguf")


@pytest.fixture
def adapter(tmp_path: Path, base: Path) -> Path:
    return write_tiny_lora(tmp_path / "adapter.gguf", base, task_name="shout", prompt_prefix="LOUD: ")


async def ids_of(chunks: AsyncIterator[GenerateChunk]) -> list[int]:
    ids: list[int] = []
    async for chunk in chunks:
        ids += chunk.token_ids
    return ids


async def greedy_all(backend: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt's greedy continuation, all decoded together (the slots share each step)."""
    import asyncio

    return list(await asyncio.gather(*(ids_of(backend.generate(p, GREEDY)) for p in prompts)))




async def tokens_of(backend: Any, prompts: list[str]) -> list[list[int]]:
    return [await backend.tokenize(p, add_special=True) for p in prompts]


# --------------------------------------------------------------------------- applied


@pytest.mark.parametrize("scale", [1.0, 0.5])
async def test_adapter_output_is_llama_cpp_pythons(load: Loader, base: Path, adapter: Path, scale: float) -> None:
    parameter = "adapter.gguf" if scale == 1.0 else f"adapter.gguf:{scale}"
    backend = await load(base, n_parallel="4", lora=parameter)
    prompts = await tokens_of(backend, PROMPTS)
    adapted = await greedy_all(backend, prompts)
    await backend.unload()
    plain = await greedy_all(await load(base, n_parallel="4"), prompts)
    # The adapter changes what the model writes, for every prompt...
    assert all(a != p for a, p in zip(adapted, plain, strict=True))
    # ...to what llama-cpp-python's Llama(lora_path=, lora_scale=) writes, and without it the same.
    assert adapted == llama_cpp_python_greedy(base, prompts, STEPS, (adapter, scale))
    assert plain == llama_cpp_python_greedy(base, prompts, STEPS)


async def test_adapter_output_is_numpys_with_the_adapter_merged(load: Loader, base: Path, tmp_path: Path) -> None:
    # Two adapters, the second also on the output matrix, at their own scales: llama.cpp adds
    # scale * alpha / rank * B @ A of each to the product of each weight.
    first = write_tiny_lora(tmp_path / "a.gguf", base, seed=5)
    (tmp_path / "sub").mkdir()
    second = write_tiny_lora(tmp_path / "sub" / "b.gguf", base, seed=5, rank=2, alpha=0.0, targets=("attn_v", "output"))
    backend = await load(base, lora="a.gguf:0.75, sub/b.gguf:-0.5")
    prompt = [1, 300, 301, 320, 330, 270, 280]
    weights = merged_weights(base, ((first, 0.75), (second, -0.5)))
    assert await ids_of(backend.generate(prompt, GenerateParams(greedy=True, max_tokens=8))) == reference_greedy(weights, prompt)
    assert reference_greedy(weights, prompt) != reference_greedy(merged_weights(base), prompt)
    assert backend.lora_adapters() == [LoraAdapter(path="a.gguf", scale=0.75), LoraAdapter(path="sub/b.gguf", scale=-0.5)]


async def test_scale_zero_is_no_adapter(load: Loader, base: Path, adapter: Path) -> None:
    backend = await load(base, n_parallel="4", lora="adapter.gguf:0")
    prompts = await tokens_of(backend, PROMPTS)
    zero = await greedy_all(backend, prompts)
    await backend.unload()
    assert zero == await greedy_all(await load(base, n_parallel="4"), prompts)


async def test_adapters_are_listed_with_their_metadata(load: Loader, base: Path, adapter: Path) -> None:
    backend = await load(base, lora="adapter.gguf:1.5")
    assert backend.lora_adapters() == [LoraAdapter(path="adapter.gguf", scale=1.5, task_name="shout", prompt_prefix="LOUD: ")]
    plain = await load(base)
    assert plain.lora_adapters() == []


async def test_an_embedding_model_embeds_with_its_adapter(load: Loader, tmp_path: Path) -> None:
    base = write_tiny_llama(tmp_path / "model.gguf", pooling=1)
    adapter = write_tiny_lora(tmp_path / "adapter.gguf", base)
    backend = await load(base, embedding="true", lora="adapter.gguf")
    [vector], _ = await backend.embed(["Hello world"])
    tokens = await backend.tokenize("Hello world", add_special=True)
    expected = reference_forward(merged_weights(base, ((adapter, 1.0),)), tokens).mean(axis=0)
    assert np.allclose(vector, expected / np.linalg.norm(expected), atol=2e-3)


# --------------------------------------------------------------------------- other scales


def scaled(scale: float) -> GenerateParams:
    """Greedy, with the request's own scale for adapter 0."""
    return GenerateParams(greedy=True, max_tokens=STEPS, lora=((0, scale),))


async def test_a_request_decodes_with_its_own_scales(load: Loader, base: Path, adapter: Path) -> None:
    # Loaded at 1.0; two prompts ask for 0.5 and one for 0 (the base model) while the fourth
    # takes the loaded scale: all four at once, so the engine decodes the sets in turns.
    import asyncio

    backend = await load(base, n_parallel="4", lora="adapter.gguf")
    prompts = await tokens_of(backend, PROMPTS)
    params = [scaled(0.5), GREEDY, scaled(0.5), scaled(0.0)]
    together = list(await asyncio.gather(*(ids_of(backend.generate(p, q)) for p, q in zip(prompts, params, strict=True))))
    at_half = llama_cpp_python_greedy(base, prompts, STEPS, (adapter, 0.5))
    at_one = llama_cpp_python_greedy(base, prompts, STEPS, (adapter, 1.0))
    plain = llama_cpp_python_greedy(base, prompts, STEPS)
    assert together == [at_half[0], at_one[1], at_half[2], plain[3]]
    assert at_half[0] != at_one[0] and plain[3] != at_one[3]


async def test_sets_of_scales_take_turns(load: Loader, base: Path, adapter: Path) -> None:
    # A long generation at the loaded scale does not hold the decode: a short one at 0.5,
    # asked at the same time, gets its turns and ends first.
    import asyncio

    backend = await load(base, n_parallel="2", lora="adapter.gguf")
    prompts = await tokens_of(backend, PROMPTS[:2])
    ended: list[str] = []

    async def run(name: str, tokens: list[int], params: GenerateParams) -> list[int]:
        ids = await ids_of(backend.generate(tokens, params))
        ended.append(name)
        return ids

    long = GenerateParams(greedy=True, max_tokens=150, ignore_eos=True)
    short = GenerateParams(greedy=True, max_tokens=STEPS, lora=((0, 0.5),))
    _, quick = await asyncio.gather(run("long", prompts[0], long), run("short", prompts[1], short))
    assert ended == ["short", "long"]
    assert quick == llama_cpp_python_greedy(base, prompts[1:], STEPS, (adapter, 0.5))[0]


async def test_cached_cells_serve_only_requests_with_their_scales(load: Loader, base: Path, adapter: Path) -> None:
    # One slot, loaded at 1.0, and the prefix store (on by default) behind it.
    backend = await load(base, n_parallel="1", lora="adapter.gguf")
    prompt, other = await tokens_of(backend, PROMPTS[:2])
    [at_one] = llama_cpp_python_greedy(base, [prompt], STEPS, (adapter, 1.0))
    [at_half] = llama_cpp_python_greedy(base, [prompt], STEPS, (adapter, 0.5))

    async def run(tokens: list[int], params: GenerateParams) -> tuple[list[int], int]:
        cached = backend.engine_stats()["prompt_tokens_cached"]
        ids = await ids_of(backend.generate(tokens, params))
        return ids, int(backend.engine_stats()["prompt_tokens_cached"] - cached)

    assert await run(prompt, GREEDY) == (at_one, 0)
    # The slot's cells were decoded at 1.0: none serves 0.5 (they go to the store, under 1.0).
    assert await run(prompt, scaled(0.5)) == (at_half, 0)
    await run(other, GREEDY)  # the 0.5 cells go to the store too
    assert await run(prompt, GREEDY) == (at_one, len(prompt) - 1)  # restored: the 1.0 ones
    # A prompt that continues the 1.0 conversation, asked at 0.5: the stored 1.0 cells share
    # more of it, but only the 0.5 ones (the prompt, and the replies' common start) may serve.
    longer = prompt + at_one[:8]
    [expected] = llama_cpp_python_greedy(base, [longer], STEPS, (adapter, 0.5))
    shared = next((i for i, (a, b) in enumerate(zip(at_one[:8], at_half, strict=False)) if a != b), 8)
    assert shared < 8
    assert await run(longer, scaled(0.5)) == (expected, len(prompt) + shared)


async def test_cache_reuse_moves_only_cells_of_the_same_scales(load: Loader, base: Path, adapter: Path) -> None:
    """n_cache_reuse moves a slot's cells only for a request at the scales they were decoded
    with: at other scales the prompt is decoded whole, as a cold decode at them."""
    backend = await load(base, n_parallel="1", lora="adapter.gguf", prefix_store_mib="0")
    prompt, other = await tokens_of(backend, PROMPTS[2:4])
    first, second = prompt + other, other  # the second drops the first prompt (but its BOS)
    reuse = GenerateParams(greedy=True, max_tokens=STEPS, n_cache_reuse=2)

    async def cached_after(tokens: list[int], params: GenerateParams) -> int:
        before = backend.engine_stats()["prompt_tokens_cached"]
        await ids_of(backend.generate(tokens, params))
        return int(backend.engine_stats()["prompt_tokens_cached"] - before)

    await cached_after(first, GREEDY)
    assert await cached_after(second, reuse) == len(second) - 1  # moved (the last is decoded again)
    await cached_after(first, GREEDY)
    half = GenerateParams(greedy=True, max_tokens=STEPS, n_cache_reuse=2, lora=((0, 0.5),))
    assert await cached_after(second, half) == 0
    [expected] = llama_cpp_python_greedy(base, [second], STEPS, (adapter, 0.5))
    await cached_after(first, GREEDY)
    assert await ids_of(backend.generate(second, half)) == expected


async def test_set_lora_scales_is_what_later_requests_get(load: Loader, base: Path, adapter: Path) -> None:
    backend = await load(base, n_parallel="2", lora="adapter.gguf")
    prompts = await tokens_of(backend, PROMPTS)
    backend.set_lora_scales((0.5,))
    assert backend.lora_adapters() == [LoraAdapter(path="adapter.gguf", scale=0.5, task_name="shout", prompt_prefix="LOUD: ")]
    assert await greedy_all(backend, prompts) == llama_cpp_python_greedy(base, prompts, STEPS, (adapter, 0.5))
    # A request's own scales still win.
    assert await ids_of(backend.generate(prompts[0], scaled(1.0))) == llama_cpp_python_greedy(base, prompts[:1], STEPS, (adapter, 1.0))[0]
    with pytest.raises(InvalidArgument, match="model 'tiny' has 1 LoRA adapters, not 2"):
        backend.set_lora_scales((0.5, 1.0))


async def test_an_embedding_model_embeds_with_the_scales_set(load: Loader, tmp_path: Path) -> None:
    base = write_tiny_llama(tmp_path / "model.gguf", pooling=1)
    write_tiny_lora(tmp_path / "adapter.gguf", base)
    backend = await load(base, embedding="true", lora="adapter.gguf")
    backend.set_lora_scales((0.0,))
    [vector], _ = await backend.embed(["Hello world"])
    tokens = await backend.tokenize("Hello world", add_special=True)
    expected = reference_forward(merged_weights(base), tokens).mean(axis=0)
    assert np.allclose(vector, expected / np.linalg.norm(expected), atol=2e-3)


# --------------------------------------------------------------------------- load errors


async def test_adapter_that_cannot_be_applied_fails_the_load(load: Loader, base: Path, tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    write_tiny_llama(tmp_path / "other-model.gguf")
    write_tiny_lora(tmp_path / "qwen3.gguf", base, arch="qwen3")
    write_tiny_lora(tmp_path / "big.gguf", write_tiny_llama(tmp_path / "big-model.gguf", n_embd=128))
    write_tiny_lora(tmp_path / "stranger.gguf", base, extra_tensor=("blk.9.attn_q.weight", (64, 64)))
    write_tiny_lora(tmp_path / "ia3.gguf", base, adapter_type="ia3")
    write_tiny_lora(tmp_path / "alora.gguf", base, alora_invocation_tokens=(300, 301))
    cases = {
        "missing.gguf": "no such file",
        "junk.gguf": "not a LoRA adapter for this model: .*(magic|failed to load lora adapter from file)",
        "other-model.gguf": "not a LoRA adapter for this model: .*expect general.type to be 'adapter', but got:",
        "qwen3.gguf": "not a LoRA adapter for this model: .*model arch and LoRA arch mismatch",
        "big.gguf": "not a LoRA adapter for this model: .*has incorrect shape",
        "stranger.gguf": "not a LoRA adapter for this model: .*'blk.9.attn_q.weight' does not exist in base model",
        "ia3.gguf": "not a LoRA adapter for this model: .*expect adapter.type to be 'lora', but got: ia3",
        "alora.gguf": r"an activated LoRA \(adapter.alora.invocation_tokens\)",
    }
    for name, reason in cases.items():
        with pytest.raises(ConfigError, match=rf"model 'tiny': parameters lora: adapter '{name}' \({tmp_path / name}\): {reason}") as info:
            await load(base, lora=name)
        assert info.value.status == 400


async def test_a_bad_second_adapter_fails_the_load_after_a_good_first(load: Loader, base: Path, adapter: Path) -> None:
    with pytest.raises(ConfigError, match=r"adapter 'missing.gguf' .*: no such file"):
        await load(base, lora="adapter.gguf,missing.gguf")
    # The engine freed what it had loaded: the same model loads again.
    backend = await load(base, lora="adapter.gguf")
    assert len(backend.lora_adapters()) == 1


@pytest.mark.parametrize(("value", "message"), [
    ("adapter.gguf:loud", r"adapter 0 \('adapter.gguf:loud'\): the scale after ':' must be a number, got 'loud'"),
    ("adapter.gguf:nan", r"adapter 0 \('adapter.gguf:nan'\): the scale after ':' must be a number, got 'nan'"),
    ("adapter.gguf,,", "adapter 1 has no path"),
    (":0.5", "adapter 0 has no path"),
])
async def test_a_malformed_lora_parameter_names_it(load: Loader, base: Path, adapter: Path, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"model 'tiny': parameters lora: {message}"):
        await load(base, lora=value)
