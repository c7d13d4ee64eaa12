"""One llama_decode, four ways, against llama.cpp's own llama-bench: is the call itself slower?

    .venv/bin/python bench/llm_decode.py --model M.gguf [--tokens 84] [--depth 1973] [--threads 2]
                                         [--rounds 8] [--blocks 4] [--llama-bench PATH]

Decodes the same `--tokens` tokens at `--depth` (a chat's second turn after a long first one)
again and again with llama-cpp-python's low-level API, the way the engine does (flash attention
auto, n_batch = n_ubatch = 512, one sequence, logits for the last token only), and times each
`llama_decode`. Variants, interleaved in alternating order within each block:

- main / thread: called from the main thread or from a long-lived Python thread (the engine's
  case; that thread then is OpenMP's master thread);
- +tp: with a ggml threadpool attached (`llama_attach_threadpool`), as llama-server and
  llama-bench do; without one, ggml makes a throwaway one per graph.

With `--llama-bench PATH` (built from the same llama.cpp sources: `make llama-bench`) the blocks
alternate (ABBA) with llama-bench's `-p TOKENS -n 0 -d DEPTH`, same threads, flash attention
and batch sizes. Prints min / p25 / median per variant; on a shared machine compare the lows.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp.llama_cpp as llama


def libs() -> tuple[ctypes.CDLL, ctypes.CDLL, ctypes.CDLL]:
    """The threadpool calls, which llama-cpp-python 0.3.36 does not bind (its libraries export them)."""
    directory = Path(llama.__file__).parent / "lib"
    base = ctypes.CDLL(str(directory / "libggml-base.so"))
    cpu = ctypes.CDLL(str(directory / "libggml-cpu.so"))
    lib = ctypes.CDLL(str(directory / "libllama.so"))
    # The params struct is filled by ggml itself (its defaults are llama-server's: poll 50,
    # normal priority, no CPU mask), so a buffer larger than it is enough: no layout declared.
    base.ggml_threadpool_params_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
    cpu.ggml_threadpool_new.argtypes = [ctypes.c_void_p]
    cpu.ggml_threadpool_new.restype = ctypes.c_void_p
    cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
    lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
    return base, cpu, lib


def summary(name: str, ms: list[float]) -> str:
    q = sorted(ms)
    return f"{name:12s} min {q[0]:6.1f}  p25 {q[len(q) // 4]:6.1f}  median {statistics.median(q):6.1f} ms  (n={len(q)})"


def native(path: str, args: argparse.Namespace) -> list[float]:
    cmd = [path, "-m", str(args.model), "-p", str(args.tokens), "-n", "0", "-d", str(args.depth), "-t", str(args.threads),
           "-fa", "1", "-b", "512", "-ub", "512", "-r", str(args.rounds), "-o", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return [ns / 1e6 for ns in json.loads(out)[0]["samples_ns"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=84)
    parser.add_argument("--depth", type=int, default=1973)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8, help="decodes per variant per block")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--llama-bench", help="llama.cpp's llama-bench binary, run in alternate blocks")
    args = parser.parse_args()
    base, cpu, lib = libs()
    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(str(args.model).encode(), llama.llama_model_default_params())
    cp = llama.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 512, 1
    cp.n_threads = cp.n_threads_batch = args.threads
    cp.no_perf, cp.kv_unified, cp.flash_attn_type = True, False, llama.LLAMA_FLASH_ATTN_TYPE_AUTO
    ctx = llama.llama_init_from_model(model, cp)
    memory = llama.llama_get_memory(ctx)
    n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    rng = random.Random(0)
    prefix = [rng.randrange(n_vocab) for _ in range(args.depth)]
    suffix = [rng.randrange(n_vocab) for _ in range(args.tokens)]
    batch = llama.llama_batch_init(512, 0, 1)

    def decode(tokens: list[int], pos0: int) -> float:
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        start = time.perf_counter()
        if llama.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return (time.perf_counter() - start) * 1000

    for chunk in range(0, args.depth, 512):
        decode(prefix[chunk : chunk + 512], chunk)

    def once() -> float:
        llama.llama_memory_seq_rm(memory, 0, args.depth, -1)
        return decode(suffix, args.depth)

    jobs: list[Callable[[], float]] = []
    results: list[float] = []
    wake, done = threading.Semaphore(0), threading.Semaphore(0)

    def worker() -> None:  # a long-lived thread, as the engine's
        while True:
            wake.acquire()
            results.append(jobs.pop()())
            done.release()

    threading.Thread(target=worker, daemon=True).start()

    def on_thread() -> float:
        jobs.append(once)
        wake.release()
        done.acquire()
        return results.pop()

    params = ctypes.create_string_buffer(4096)
    base.ggml_threadpool_params_init(params, args.threads)
    pool = cpu.ggml_threadpool_new(params)
    variants: dict[str, tuple[Callable[[], float], bool]] = {
        "main": (once, False), "thread": (on_thread, False), "main+tp": (once, True), "thread+tp": (on_thread, True)}
    times: dict[str, list[float]] = {name: [] for name in [*variants, "llama-bench"]}
    for run, _ in variants.values():
        run()  # warm each path
    print("load average at start", os.getloadavg(), flush=True)
    for block in range(args.blocks):
        if args.llama_bench and block % 4 in (0, 3):
            times["llama-bench"] += native(args.llama_bench, args)
            continue
        for r in range(args.rounds):
            names = list(variants) if r % 2 == 0 else list(variants)[::-1]
            for name in names:
                run, with_pool = variants[name]
                if with_pool:
                    lib.llama_attach_threadpool(ctx, pool, None)
                times[name].append(run())
                if with_pool:
                    lib.llama_detach_threadpool(ctx)
    print("load average at end", os.getloadavg())
    for name, ms in times.items():
        if ms:
            print(summary(name, ms))
    for name in list(variants)[1:]:
        ratios = [b / a for a, b in zip(times["main"], times[name], strict=True)]
        print(f"paired {name}/main: median {statistics.median(ratios):.3f}")
    llama.llama_batch_free(batch)
    llama.llama_free(ctx)
    cpu.ggml_threadpool_free(pool)
    llama.llama_model_free(model)


if __name__ == "__main__":
    main()
