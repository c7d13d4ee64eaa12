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
    merged_weights,
    reference_forward,
    reference_greedy,
    write_tiny_llama,
    write_tiny_lora,
)

from daemon.backend import GenerateChunk, GenerateParams, LoraAdapter
from daemon.errors import ConfigError

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


def llama_cpp_python_greedy(base: Path, prompts: list[list[int]], lora: tuple[Path, float] | None) -> list[list[int]]:
    """What llama-cpp-python's high-level API generates greedily, one prompt at a time."""
    from llama_cpp import Llama

    kwargs: dict[str, Any] = {} if lora is None else {"lora_path": str(lora[0]), "lora_scale": lora[1]}
    llm = Llama(str(base), n_ctx=256, n_threads=1, verbose=False, **kwargs)
    try:
        out = []
        for prompt in prompts:
            ids: list[int] = []
            for token in llm.generate(prompt, temp=0.0, reset=True):
                ids.append(token)
                if len(ids) == STEPS:
                    break
            out.append(ids)
        return out
    finally:
        llm.close()




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
    assert adapted == llama_cpp_python_greedy(base, prompts, (adapter, scale))
    assert plain == llama_cpp_python_greedy(base, prompts, None)


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
