"""Quantized GGUFs (q8_0 and q4_0; what users run, where the other tests' models are f32 or
f16) load and generate through the engine as llama-cpp-python's own `Llama` does with them.

llama.cpp repacks quantized weights for the CPU's fastest kernels, and a prompt of several
tokens runs them. A llama.cpp compiled with `-march=native` by GCC 12 on an Intel Xeon with
AMX (Debian 12's compiler; llama.cpp's default when it is built from source, as pip builds
llama-cpp-python) runs its AMX kernels without a tile configuration: GCC 12's
`_tile_loadconfig` tells the compiler it reads 8 bytes, so the compiler drops the stores of
the tile shapes. The first prompt then dies of SIGILL, and the daemon with it. The Makefile
builds llama.cpp's CPU code once per x86 generation and deletes the AMX variant
(docs/operations.md). The probe runs in a child process first, so that such a build fails
these tests with its reason instead of killing the test run."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from gguf_builder import llama_cpp_python_greedy, write_tiny_llama

from daemon.backend import GenerateParams

pytest.importorskip("gguf")

Loader = Callable[..., Awaitable[Any]]
STEPS = 8
PROMPTS = [[1, 300, 301, 302, 303, 304, 305], [1, 310, 311, 312]]

# A prompt of several tokens (argv[2:]) through llama-cpp-python's own API: the kernels that
# repacked weights use for a batch (AMX tiles where the library was built with them).
PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=256, n_threads=1, verbose=False)
llm.eval([int(token) for token in sys.argv[2:]])
print("ok")
"""


@pytest.fixture(scope="module", params=["q8_0", "q4_0"])
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_llama(tmp_path_factory.mktemp(request.param) / "model.gguf", dtype=request.param)
    command = [sys.executable, "-c", PROBE, str(path), *map(str, PROMPTS[0])]
    probe = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if probe.returncode < 0:
        pytest.fail(
            f"llama.cpp died of {signal.Signals(-probe.returncode).name} on a {request.param} prompt: this "
            "llama-cpp-python was compiled for another CPU or with AMX kernels GCC 12 breaks; rebuild it "
            "as the Makefile does (docs/operations.md, \"llama.cpp's CPU build\")"
        )
    assert probe.returncode == 0 and probe.stdout.strip() == "ok", probe.stderr[-2000:]
    return path


async def test_a_quantized_model_generates_as_llama_cpp_python(load_llamacpp: Loader, quantized: Path) -> None:
    """Greedy tokens of two prompts decoded together (a batch of both prompts' tokens, then
    one token of each per step) equal llama-cpp-python's, each prompt decoded alone."""
    backend = await load_llamacpp(quantized, n_parallel="2", prefix_store_mib="0")
    greedy = GenerateParams(greedy=True, max_tokens=STEPS)

    async def run(prompt: list[int]) -> list[int]:
        ids: list[int] = []
        async for chunk in backend.generate(prompt, greedy):
            ids += chunk.token_ids
        return ids

    got = await asyncio.gather(*(run(prompt) for prompt in PROMPTS))
    expected = llama_cpp_python_greedy(quantized, PROMPTS, STEPS)
    assert got == expected
    assert all(len(ids) == STEPS for ids in got)
