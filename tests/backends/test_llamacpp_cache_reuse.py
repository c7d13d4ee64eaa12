"""llama-server's cache reuse (the model's `cache_reuse` parameter, a request's
`n_cache_reuse`) in the llama.cpp backend, on a tiny random GGUF, against numpy: the slot's
cells of runs the new prompt has again are moved (their keys rotated to the new positions,
what was computed after their old prefix kept), and the rest is decoded after them. The
numpy side keeps each cell's key before RoPE and its value, as llama.cpp's K-shift treats
them, so moved cells, their positions and the tokens decoded after them are all checked."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_builder import read_weights, reference_greedy, write_tiny_llama

from daemon.backend import GenerateChunk, GenerateParams
from daemon.errors import ConfigError

pytest.importorskip("gguf")

Loader = Callable[..., Awaitable[Any]]
N_HEAD = 4
STEPS = 8

# The slot's first prompt: a shared start, then runs the next prompt drops (X*) or keeps (Q*).
P = [1, 300, 301, 320, 330]
X1 = [270, 280, 290]
Q1 = [310, 311, 312, 313, 314, 315, 316, 317, 318, 319]
X2 = [271, 281]
Q2 = [321, 322, 323, 324, 325, 326, 327, 328]
FIRST = P + X1 + Q1 + X2 + Q2
# The next prompt: the start, the kept runs, and new tokens.
R = [331, 332, 333]
SECOND = P + Q1 + Q2 + R


class _Cells:
    """One layer's cached cells: keys before RoPE, values, positions."""

    def __init__(self, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> None:
        self.k, self.v, self.pos = k, v, pos

    def take(self, index: list[int], pos: list[int]) -> _Cells:
        return _Cells(self.k[index], self.v[index], np.asarray(pos))


def _rope(m: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """llama's RoPE (adjacent pairs), each row at its own position."""
    hd = m.shape[-1]
    angle = pos[:, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    out = np.empty_like(m)
    out[..., 0::2] = m[..., 0::2] * cos - m[..., 1::2] * sin
    out[..., 1::2] = m[..., 0::2] * sin + m[..., 1::2] * cos
    return out


def _forward(w: dict[str, np.ndarray], tokens: list[int], pos: np.ndarray,
             past: list[_Cells] | None) -> tuple[np.ndarray, list[_Cells]]:
    """Hidden states of `tokens` at positions `pos`, attending to the `past` cells (each
    layer's) and to each other, masked by position as llama.cpp masks; and their own cells."""
    x = w["token_embd.weight"][tokens]
    n, d = x.shape
    hd = d // N_HEAD

    def rms(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-5) * g

    cells = []
    for layer in range(sum(1 for name in w if name.endswith(".attn_q.weight"))):
        p = f"blk.{layer}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T).reshape(n, N_HEAD, hd)
        k = (h @ w[p + "attn_k.weight"].T).reshape(n, N_HEAD, hd)
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, N_HEAD, hd)
        own = _Cells(k, v, pos)
        cells.append(own)
        seen = own if past is None else _Cells(np.concatenate([past[layer].k, k]), np.concatenate([past[layer].v, v]),
                                               np.concatenate([past[layer].pos, pos]))
        mask = np.where(seen.pos[None, :] <= pos[:, None], 0.0, -np.inf)
        scores = np.einsum("qhd,khd->hqk", _rope(q, pos), _rope(seen.k, seen.pos)) / np.sqrt(hd) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, seen.v).reshape(n, d) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate = h @ w[p + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]), cells


def greedy_after_moved_cells(w: dict[str, np.ndarray], first: list[int], moved: list[tuple[int, int]],
                             new: list[int]) -> tuple[list[int], list[float]]:
    """STEPS greedy tokens after `new`, decoded after the cells of `first` (computed together
    at positions 0..) that `moved` keeps, (old position, new position) each, and each
    token's log probability."""
    _, cells = _forward(w, first, np.arange(len(first)), None)
    past = [layer.take([old for old, _ in moved], [at for _, at in moved]) for layer in cells]
    start = len(moved)
    tokens = list(new)
    logprobs = []
    for _ in range(STEPS):
        hidden, _ = _forward(w, tokens, np.arange(start, start + len(tokens)), past)
        logits = hidden[-1] @ w["output.weight"].T
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 0.1, "reference has a near tie; pick other tokens"
        tokens.append(int(np.argmax(logits)))
        logprobs.append(float(logits.max() - logits.max() - np.log(np.exp(logits - logits.max()).sum())))
    return tokens[len(new) :], logprobs


def cold(w: dict[str, np.ndarray], prompt: list[int]) -> tuple[list[int], list[float]]:
    """A cold decode of `prompt` (nothing moved): every cell at its own position."""
    return greedy_after_moved_cells(w, prompt[:-1], [(i, i) for i in range(len(prompt) - 1)], prompt[-1:])


async def run(backend: Any, prompt: list[int], params: GenerateParams) -> tuple[tuple[list[int], list[float]],
                                                                                 GenerateChunk]:
    """The greedy tokens and their log probabilities (the model's, before sampling), and the
    last chunk."""
    ids: list[int] = []
    logprobs: list[float] = []
    params.logprobs = 1
    chunks: AsyncIterator[GenerateChunk] = backend.generate(prompt, params)
    last = None
    async for chunk in chunks:
        ids += chunk.token_ids
        logprobs += [entry.logprob for entry in chunk.logprobs]
        last = chunk
    assert last is not None
    return (ids, logprobs), last


def same(got: tuple[list[int], list[float]], expected: tuple[list[int], list[float]]) -> bool:
    """The same tokens with log probabilities within llama.cpp's f16 cells' error."""
    return got[0] == expected[0] and bool(np.allclose(got[1], expected[1], atol=0.03))


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "model.gguf")


def llama_servers_loop(cached: list[int], tokens: list[int], common: int, size: int) -> list[tuple[int, int, int]]:
    """llama-server's reuse loop as its source reads, cell by cell: the runs it moves."""
    moves = []
    head_c = head_p = common
    while head_c < len(cached) and head_p < len(tokens):
        run = 0
        while head_c + run < len(cached) and head_p + run < len(tokens) and cached[head_c + run] == tokens[head_p + run]:
            run += 1
        if run >= size:
            moves.append((head_c, head_p, run))
            head_c += run
            head_p += run
        else:
            head_c += 1
    return moves


def test_the_plan_is_llama_servers_loop(backend_class: Callable[[str], type[Any]]) -> None:
    """The engine finds the runs by bytes.find over the ids; llama-server walks the cells.
    Random caches and prompts over small alphabets (many partial runs, ids of every size,
    negative ones too, whose bytes straddle) must give the same moves."""
    backend_class("llamacpp")
    from edged_backends.llamacpp.engine import _reuse_plan

    rng = np.random.default_rng(7)
    checked = moved = 0
    for _ in range(3000):
        alphabet = rng.choice([2, 3, 300, 70000, 2**31 - 1])
        values = rng.integers(-alphabet, alphabet, size=4)
        cached = [int(v) for v in rng.choice(values, size=int(rng.integers(0, 60)))]
        # A prompt that often shares a prefix and runs of the cache.
        pieces = [cached[int(a):int(a) + int(n)] for a, n in rng.integers(0, 60, size=(3, 2))]
        tokens = cached[: int(rng.integers(0, 8))] + [t for piece in pieces for t in piece]
        tokens += [int(v) for v in rng.choice(values, size=int(rng.integers(0, 5)))]
        common = 0
        while common < min(len(cached), len(tokens)) and cached[common] == tokens[common]:
            common += 1
        size = int(rng.integers(1, 10))
        expected = llama_servers_loop(cached, tokens, common, size)
        assert _reuse_plan(cached, tokens, common, size) == expected, (cached, tokens, common, size)
        checked += 1
        moved += bool(expected)
    assert moved > checked // 4  # the cases move runs, not only find none


def test_the_numpy_side_is_the_plain_forward_when_nothing_moves(model_path: Path) -> None:
    """The reference's cache path against the whole-sequence reference: keeping every cell
    where it is, the tokens are a cold greedy decode's."""
    w = read_weights(model_path)
    kept = [(i, i) for i in range(len(P) + len(X1))]
    assert greedy_after_moved_cells(w, P + X1, kept, Q1)[0] == reference_greedy(w, P + X1 + Q1, STEPS)


async def test_runs_the_prompt_has_again_are_moved_not_decoded(load_llamacpp: Loader, model_path: Path) -> None:
    """The model's cache_reuse 8: both kept runs (10 and 8 tokens) move back over the dropped
    ones; only R is decoded, and the greedy tokens are numpy's after those moved cells."""
    w = read_weights(model_path)
    backend = await load_llamacpp(model_path, n_parallel="1", cache_reuse="8")
    first = GenerateParams(greedy=True, max_tokens=1)  # the slot then holds FIRST's cells, no more
    await run(backend, FIRST, first)
    got, last = await run(backend, SECOND, GenerateParams(greedy=True, max_tokens=STEPS))
    assert last.cached_tokens == len(P + Q1 + Q2)
    q1, q2 = len(P + X1), len(P + X1 + Q1 + X2)
    moved = [(i, i) for i in range(len(P))] + [(q1 + i, len(P) + i) for i in range(len(Q1))] + [
        (q2 + i, len(P + Q1) + i) for i in range(len(Q2))]
    assert same(got, greedy_after_moved_cells(w, FIRST, moved, R))
    # A cold decode of SECOND differs (the moved cells saw X1 and X2): without that, this
    # test could not tell a move from a decode.
    assert not same(got, cold(w, SECOND))
    stats = backend.engine_stats()
    assert stats["prompt_tokens_cached"] == len(P + Q1 + Q2)


async def test_a_run_shorter_than_asked_is_decoded(load_llamacpp: Loader, model_path: Path) -> None:
    """A request's n_cache_reuse 9 moves Q1 (10) but not Q2 (8), which is decoded again with
    R after it; 0 turns the model's reuse off (the prefix alone, a cold decode's tokens)."""
    w = read_weights(model_path)
    # No host-RAM store: SECOND would come back from it whole the second time.
    backend = await load_llamacpp(model_path, n_parallel="1", cache_reuse="8", prefix_store_mib="0")
    first = GenerateParams(greedy=True, max_tokens=1)
    await run(backend, FIRST, first)
    got, last = await run(backend, SECOND, GenerateParams(greedy=True, max_tokens=STEPS, n_cache_reuse=9))
    assert last.cached_tokens == len(P + Q1)
    q1 = len(P + X1)
    moved = [(i, i) for i in range(len(P))] + [(q1 + i, len(P) + i) for i in range(len(Q1))]
    # Q2 then R decoded after the moved cells: numpy decodes them as the new tokens.
    assert same(got, greedy_after_moved_cells(w, FIRST, moved, Q2 + R))
    assert not same(got, cold(w, SECOND))
    await run(backend, FIRST, first)
    got, last = await run(backend, SECOND, GenerateParams(greedy=True, max_tokens=STEPS, n_cache_reuse=0))
    assert last.cached_tokens == len(P)
    assert same(got, cold(w, SECOND))


async def test_off_by_default_and_asked_per_request(load_llamacpp: Loader, model_path: Path) -> None:
    """llama-server's default: no reuse unless the model's cache_reuse or the request asks."""
    backend = await load_llamacpp(model_path, n_parallel="1", prefix_store_mib="0")
    first = GenerateParams(greedy=True, max_tokens=1)
    await run(backend, FIRST, first)
    _, last = await run(backend, SECOND, GenerateParams(greedy=True, max_tokens=2))
    assert last.cached_tokens == len(P)
    await run(backend, FIRST, first)
    _, last = await run(backend, SECOND, GenerateParams(greedy=True, max_tokens=2, n_cache_reuse=4))
    assert last.cached_tokens == len(P + Q1 + Q2)
    # cache_prompt false: nothing of the slot is used, moved or not.
    await run(backend, FIRST, first)
    _, last = await run(backend, SECOND, GenerateParams(greedy=True, max_tokens=2, n_cache_reuse=4,
                                                        cache_prompt=False))
    assert last.cached_tokens == 0


async def test_a_negative_cache_reuse_fails_the_load(load_llamacpp: Loader, model_path: Path) -> None:
    with pytest.raises(ConfigError, match="cache_reuse"):
        await load_llamacpp(model_path, cache_reuse="-1")
