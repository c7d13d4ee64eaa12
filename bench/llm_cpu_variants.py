"""llama.cpp's CPU variants side by side on this machine: which one is fastest, per weight type?

    .venv/bin/python bench/llm_cpu_variants.py [--dtypes f16,q8_0,q4_0,q4_k_m] [--threads 2] [--rounds 3]
                                               [--variants zen4,haswell]

On x86-64 the Makefile builds llama.cpp's CPU code once per x86 generation, and ggml loads the
variant whose score ranks highest for the running CPU: the most instruction-set features, not
the most speed. This runs each variant the CPU can run in a process of its own (with a copy of
llama_cpp/lib that holds that variant alone) on the same random llama (n_embd 512, 8 layers)
in each weight type, and times `llama_decode`: one token for each of 1 and 8 sequences after
300 cells, and a 256-token prompt. Flash attention at llama.cpp's default, `--threads` threads.
Rounds alternate the variants. Prints the median of each and its ratio to ggml's own choice
(the variant the plugin loads; > 1 is faster than it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the model builder is a test fixture

from gguf_builder import K_QUANTS, quantize_gguf, write_tiny_llama  # noqa: E402

from backends.llamacpp.ggml_backends import library_dir  # noqa: E402

CASES = ("1 seq, fill 300", "8 seq, fill 300", "prompt 256")

# Runs in a child whose LLAMA_CPP_LIB_PATH names a directory with one CPU variant: the plugin's
# loader loads it (or fails: this CPU cannot run it), then times each model and case.
CHILD = r"""
import ctypes, importlib.util, json, statistics, sys, time
spec = importlib.util.spec_from_file_location("ggml_backends", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
try:
    features = module.load_backends()
except RuntimeError:
    print(json.dumps(None)); raise SystemExit
import llama_cpp.llama_cpp as llama
threads, reps = int(sys.argv[2]), int(sys.argv[3])
quiet = llama.llama_log_callback(lambda level, text, data: None)  # kept: llama.cpp holds the pointer
llama.llama_log_set(quiet, ctypes.c_void_p(0))
llama.llama_backend_init()
result = {"features": features, "times": {}}
for path in sys.argv[4:]:
    model = llama.llama_model_load_from_file(path.encode(), llama.llama_model_default_params())
    params = llama.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 4096, 512, 512, 8
    params.n_threads = params.n_threads_batch = threads
    ctx = llama.llama_init_from_model(model, params)
    memory = llama.llama_get_memory(ctx)
    batch = llama.llama_batch_init(512, 0, 8)

    def decode(tokens):
        batch.n_tokens = len(tokens)
        for i, (token, pos, seq, logits) in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        assert llama.llama_decode(ctx, batch) == 0

    def timed(tokens, keep):
        samples = []
        for _ in range(reps):
            started = time.perf_counter()
            decode(tokens)
            samples.append(time.perf_counter() - started)
            for seq in {t[2] for t in tokens}:
                llama.llama_memory_seq_rm(memory, seq, keep, -1)
        return statistics.median(samples) * 1000

    for seq in range(8):
        for start in (0, 256):
            n = min(256, 300 - start)
            decode([(100 + (start + i) % 200, start + i, seq, i == n - 1) for i in range(n)])
    times = {
        "1 seq, fill 300": timed([(7, 300, 0, True)], 300),
        "8 seq, fill 300": timed([(7, 300, seq, True) for seq in range(8)], 300),
    }
    llama.llama_memory_clear(memory, True)
    times["prompt 256"] = timed([(100 + i % 200, i, 0, i == 255) for i in range(256)], 0)
    result["times"][path] = times
    llama.llama_batch_free(batch)
    llama.llama_free(ctx)
    llama.llama_model_free(model)
print(json.dumps(result))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="f16,q8_0,q4_0,q4_k_m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30, help="decodes timed per case and round")
    parser.add_argument("--variants", default="", help="comma-separated names (default: all built)")
    args = parser.parse_args()

    lib = library_dir()
    built = sorted(p.name.removeprefix("libggml-cpu-").removesuffix(".so") for p in lib.glob("libggml-cpu-*.so"))
    if not built:
        raise SystemExit(f"no CPU variants in {lib}: llama-cpp-python was not built as the Makefile builds it")
    wanted = [v for v in args.variants.split(",") if v] or built
    with tempfile.TemporaryDirectory(prefix="edged-variants-") as tmp:
        models = []
        shape = {"n_embd": 512, "n_layer": 8, "n_head": 8, "n_ff": 1536, "n_ctx": 4096}
        for dtype in args.dtypes.split(","):
            path = Path(tmp) / f"{dtype}.gguf"
            if dtype in K_QUANTS:  # llama.cpp's own quantizer, from the f16 model
                source = write_tiny_llama(Path(tmp) / f"{dtype}-source.gguf", dtype="f16", **shape)  # type: ignore[arg-type]
                quantize_gguf(source, path, dtype)  # type: ignore[arg-type]
            else:
                write_tiny_llama(path, dtype=dtype, **shape)  # type: ignore[arg-type]
            models.append(str(path))
        dirs = {}
        for variant in [*wanted, "chosen"]:
            directory = Path(tmp) / variant
            directory.mkdir()
            for item in lib.iterdir():
                if not item.name.startswith("libggml-cpu-") or variant in ("chosen", item.name[12:-3]):
                    shutil.copy2(item, directory / item.name)
            dirs[variant] = directory

        def run(variant: str, paths: list[str]) -> dict[str, object] | None:
            command = [sys.executable, "-c", CHILD, str(ROOT / "backends/llamacpp/ggml_backends.py"),
                       str(args.threads), str(args.reps), *paths]
            env = {"PATH": "/usr/bin:/bin", "LLAMA_CPP_LIB_PATH": str(dirs[variant])}
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=True)
            result: dict[str, object] | None = json.loads(done.stdout.splitlines()[-1])
            return result

        picked = run("chosen", [])  # ggml's own choice among them all: its features
        assert picked is not None, "this CPU runs none of the variants"
        features: dict[str, str] = {}
        samples: dict[tuple[str, str, str], list[float]] = {}
        runnable = list(wanted)
        for round_ in range(args.rounds):
            for variant in list(runnable if round_ % 2 == 0 else runnable[::-1]):
                result = run(variant, models)
                if result is None:  # this CPU cannot run it
                    runnable.remove(variant)
                    continue
                features[variant] = str(result["features"])
                times = result["times"]
                assert isinstance(times, dict)
                for model, cases in times.items():
                    for case, ms in cases.items():
                        samples.setdefault((variant, Path(model).stem, case), []).append(ms)

    chosen = next((v for v in runnable if features[v] == picked["features"]), None)
    print(f"# {args.rounds} rounds, {args.threads} threads, {args.reps} decodes per case and round")
    print(f"# ggml's choice here: {chosen or 'not among --variants'} ({picked['features']})")
    for dtype in args.dtypes.split(","):
        for case in CASES:
            base = statistics.median(samples[(chosen, dtype, case)]) if chosen else None
            cells = []
            for variant in runnable:
                ms = statistics.median(samples[(variant, dtype, case)])
                cells.append(f"{variant} {ms:7.2f} ms" + (f" ({base / ms:4.2f}x)" if base else ""))
            print(f"{dtype:5} {case:16} " + "  ".join(cells))


if __name__ == "__main__":
    main()
