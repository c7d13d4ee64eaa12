"""LLM throughput: our continuous-batching llama.cpp engine vs llama-cpp-python's own server.

    .venv/bin/python bench/llm.py [--model PATH] [--streams 1,4,8] [--max-tokens 128]
                                  [--threads N] [--skip-daemon] [--skip-server]
                                  [--llama-server PATH]

For each concurrency it runs that many streams at once (different prompts, greedy,
`max-tokens` each) and prints aggregate generated tokens/s and mean time to first token for:

- ours, direct:  the llamacpp plugin's backend in-process (engine + asyncio fan-out);
- ours, daemon:  `python -m daemon serve` over TCP, streaming `/v1/chat/completions` (SSE;
  `--endpoint completions` for `/v1/completions`);
- llama_cpp.server: `python -m llama_cpp.server` (one request at a time), same endpoint,
  same client, same model and threads;
- llama-server (only with `--llama-server PATH`): llama.cpp's own C++ server binary, started on
  127.0.0.1 with the same model, threads, slots (`-np` = the largest concurrency) and total
  context (`-c` = slots x 512, as ours), same endpoint and client.

With `--cache` it measures the prompt cache instead: one slot of 4096 tokens, a chat whose first
user message is ~1900 tokens; time to first token for that message cold, for the identical
request again, and for the chat's second turn (history + reply + a short question), median of
`--rounds` conversations with different openings. The servers run at the same time and take
turns, one conversation each, in alternating order (ABBA...), so that load from other work on
a shared machine falls on all of them alike.

With `--interleave R` the HTTP servers (ours through the daemon, llama-server, llama_cpp.server
unless skipped) run at the same time and take turns: R rounds, each measuring every concurrency
on every server in alternating order (ABBA...), then medians per server and the median of the
per-round ratios. One measurement of a few hundred tokens lasts under a second, so a burst of
other work on a shared machine swings a single sequential run by +-30 %; interleaved rounds
spread it over all servers alike.

Then the ratio ours/theirs per concurrency (target: >= 4x at 8 streams over llama_cpp.server,
>= 0.9x over llama-server). Without --model it writes a random llama GGUF (n_embd 512,
8 layers, f16 or --dtype) to a temp dir. llama_cpp.server needs the package's [server]
extras (uvicorn, fastapi, sse-starlette, starlette-context, pydantic-settings).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the model builders are test fixtures

from gguf_builder import write_tiny_llama  # noqa: E402

from daemon.backend import Device, GenerateParams, InstanceContext  # noqa: E402
from daemon.core.plugins import PluginRegistry  # noqa: E402
from daemon.model_config import ModelConfig  # noqa: E402

PROMPT_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "seven", "wizards", "quietly", "hex"]


# The warm-up request's prompt differs from every measured one: llama_cpp.server reuses the KV
# of the previous prompt's common prefix, and an identical prompt would skip its prefill.
WARM_UP = 1000


def prompt(i: int) -> str:
    words = PROMPT_WORDS[i % len(PROMPT_WORDS) :] + PROMPT_WORDS[: i % len(PROMPT_WORDS)]
    return f"Story {i}: " + " ".join(words)


@dataclass
class Run:
    streams: int
    tokens: int
    seconds: float
    ttft: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def mean_ttft_ms(self) -> float:
        return 1000 * sum(self.ttft) / len(self.ttft)


# --------------------------------------------------------------------------- ours, in-process


async def bench_direct(
    model: Path, streams: list[int], max_tokens: int, threads: int, flash_attn: str = ""
) -> list[Run]:
    registry = PluginRegistry([ROOT / "backends"])
    registry.scan()
    cls = registry.resolve("llamacpp")
    backend = cls(InstanceContext("bench", 1, threads=threads))
    parameters = {"n_parallel": str(max(streams)), "n_ctx": str(max(streams) * 512)}
    if flash_attn:
        parameters["flash_attn"] = flash_attn
    await backend.load(ModelConfig(name="bench", parameters=parameters), model, Device("cpu"))
    params = GenerateParams(greedy=True, max_tokens=max_tokens)
    runs = []
    try:
        assert hasattr(backend, "generate")
        await one_direct(backend, WARM_UP, GenerateParams(greedy=True, max_tokens=4))
        for n in streams:
            start = time.perf_counter()
            results = await asyncio.gather(*(one_direct(backend, i, params, start) for i in range(n)))
            seconds = time.perf_counter() - start
            runs.append(Run(n, sum(r[0] for r in results), seconds, [r[1] for r in results]))
    finally:
        await backend.unload()
    return runs


async def one_direct(backend: object, i: int, params: GenerateParams, start: float = 0.0) -> tuple[int, float]:
    ttft = 0.0
    tokens = 0
    async for chunk in backend.generate(prompt(i), params):  # type: ignore[attr-defined]
        if not ttft:
            ttft = time.perf_counter() - (start or time.perf_counter())
        tokens = chunk.completion_tokens or tokens
    return tokens, ttft


# --------------------------------------------------------------------------- over HTTP


def stream_completion(
    port: int, model: str, i: int, max_tokens: int, start: float, endpoint: str
) -> tuple[int, float]:
    """One streaming completion; returns (text chunks received, time to the first)."""
    request: dict[str, object] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if endpoint == "chat":
        request["messages"] = [{"role": "user", "content": prompt(i)}]
    else:
        request["prompt"] = prompt(i)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    conn.request("POST", path, json.dumps(request), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    tokens, ttft = 0, 0.0
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        choices = json.loads(data).get("choices") or []
        text = choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content"))
        if text:
            # Both servers send one event per generated token here (ASCII vocabulary).
            tokens += 1
            if not ttft:
                ttft = time.perf_counter() - start
    conn.close()
    return tokens, ttft


def bench_http(port: int, model: str, streams: list[int], max_tokens: int, endpoint: str) -> list[Run]:
    stream_completion(port, model, WARM_UP, 4, time.perf_counter(), endpoint)
    runs = []
    for n in streams:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            start = time.perf_counter()
            futures = [
                pool.submit(stream_completion, port, model, i, max_tokens, start, endpoint) for i in range(n)
            ]
            results = [f.result() for f in futures]
        seconds = time.perf_counter() - start
        runs.append(Run(n, sum(r[0] for r in results), seconds, [r[1] for r in results]))
    return runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(port: int, proc: subprocess.Popen[bytes], path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server on port {port} not ready after {timeout}s")


@contextlib.contextmanager
def running_server(args: list[str], port: int, ready_path: str, log: Path) -> Iterator[int]:
    """A server process (its pid), ready to serve; its log's tail is printed when the body fails."""
    with log.open("wb") as out:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(port, proc, ready_path)
        yield proc.pid
    except Exception:
        print(f"--- {log} ---\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
        raise
    finally:
        proc.terminate()
        proc.wait(30)


def cpu_ns(pid: int) -> int:
    """CPU time of all threads of `pid` so far, in ns: schedstat, not /proc/<pid>/stat, whose
    10 ms ticks are too coarse for a measurement of a fraction of a second."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended since the listing
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total


def with_server(args: list[str], port: int, ready_path: str, log: Path, body: Callable[[], list[Run]]) -> list[Run]:
    with running_server(args, port, ready_path, log):
        return body()


class Server(NamedTuple):
    """A server to start: its command, port, readiness path, and the model name requests use."""

    command: list[str]
    port: int
    ready: str
    model: str


def daemon_server(model: Path, work: Path, parameters: dict[str, str], tag: str = "") -> Server:
    """`python -m daemon serve` on TCP with a repository serving `model` as `llm` (llamacpp
    backend, these parameters) under `work/repo{tag}`."""
    repo = work / f"repo{tag}"
    (repo / "llm" / "1").mkdir(parents=True, exist_ok=True)
    target = repo / "llm" / "1" / "model.gguf"
    if not target.exists():
        target.symlink_to(model.resolve())
    (repo / "llm" / "model.toml").write_text(
        'backend = "llamacpp"\n[parameters]\n' + "".join(f'{k} = "{v}"\n' for k, v in parameters.items())
    )
    port = free_port()
    command = [
        sys.executable, "-m", "daemon", "serve", "--socket", "none", "--http", f"127.0.0.1:{port}",
        "--model-repository", str(repo), "--state-dir", str(work / f"state{tag}"), "--log-level", "warning",
    ]
    return Server(command, port, "/v2/models/llm/ready", "llm")


def llama_cpp_server(model: Path, threads: int, n_ctx: int, *extra: str) -> Server:
    port = free_port()
    command = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads),
        "--n_threads_batch", str(threads), "--verbose", "False", *extra,
    ]
    return Server(command, port, "/v1/models", str(model))


def llama_server(binary: Path, model: Path, threads: int, slots: int, n_ctx: int, *extra: str) -> Server:
    port = free_port()
    command = [
        str(binary), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--threads", str(threads), "--threads-batch", str(threads),
        "--parallel", str(slots), "--ctx-size", str(n_ctx), "--no-webui", *extra,
    ]
    # /health answers 503 until the model is loaded, then 200.
    return Server(command, port, "/health", "llm")


# Same layout as our engine: one KV stream per slot, 512 tokens each.
SLOT_TOKENS = 512
# llama_cpp.server aborts the running request when a new one comes by default; let each finish
# (queue) instead, as the others do.
NO_INTERRUPT = ("--interrupt_requests", "False")


def throughput_parameters(args: argparse.Namespace, slots: int) -> dict[str, str]:
    parameters = {"n_parallel": str(slots), "n_ctx": str(slots * SLOT_TOKENS), "n_threads": str(args.threads)}
    if args.flash_attn:
        parameters["flash_attn"] = args.flash_attn
    return parameters


def bench_daemon(args: argparse.Namespace, model: Path, work: Path, streams: list[int]) -> list[Run]:
    server = daemon_server(model, work, throughput_parameters(args, max(streams)))
    return with_server(
        server.command, server.port, server.ready, work / "daemon.log",
        lambda: bench_http(server.port, server.model, streams, args.max_tokens, args.endpoint),
    )


def bench_llama_cpp_server(args: argparse.Namespace, model: Path, work: Path, streams: list[int]) -> list[Run]:
    server = llama_cpp_server(model, args.threads, 2048, *NO_INTERRUPT)
    return with_server(
        server.command, server.port, server.ready, work / "llama_cpp_server.log",
        lambda: bench_http(server.port, server.model, streams, args.max_tokens, args.endpoint),
    )


def bench_llama_server(args: argparse.Namespace, model: Path, work: Path, streams: list[int]) -> list[Run]:
    slots = max(streams)
    server = llama_server(args.llama_server, model, args.threads, slots, slots * SLOT_TOKENS, "--no-kv-unified")
    return with_server(
        server.command, server.port, server.ready, work / "llama_server.log",
        lambda: bench_http(server.port, server.model, streams, args.max_tokens, args.endpoint),
    )


def bench_interleaved(args: argparse.Namespace, model: Path, work: Path, streams: list[int]) -> None:
    """All HTTP servers up at once; rounds of every concurrency on each, in alternating order."""
    slots = max(streams)
    servers = {"ours (daemon)": daemon_server(model, work, throughput_parameters(args, slots))}
    if args.llama_server:
        servers["llama-server"] = llama_server(
            args.llama_server, model, args.threads, slots, slots * SLOT_TOKENS, "--no-kv-unified"
        )
    if not args.skip_server:
        servers["llama_cpp.server"] = llama_cpp_server(model, args.threads, 2048, *NO_INTERRUPT)
    runs: dict[tuple[str, int], list[Run]] = {(name, n): [] for name in servers for n in streams}
    # Server CPU (all threads) per generated token: unlike tokens/s, it barely moves with other
    # load on the machine, so it tells apart what the servers cost from how the host treated them.
    cpu: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    pids: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        for name, (command, port, ready, _) in servers.items():
            log = work / f"{name.split()[0].replace('.', '_').strip('()')}-interleaved.log"
            pids[name] = stack.enter_context(running_server(command, port, ready, log))
        order = list(servers)
        for r in range(args.interleave):
            for n in streams:
                for name in order if r % 2 == 0 else order[::-1]:
                    _, port, _, model_name = servers[name]
                    before = cpu_ns(pids[name])
                    measured = bench_http(port, model_name, [n], args.max_tokens, args.endpoint)
                    # bench_http's warm-up request (4 tokens) is in the CPU time: a few per mille.
                    cpu[(name, n)].append((cpu_ns(pids[name]) - before) / 1000 / max(1, measured[0].tokens))
                    runs[(name, n)] += measured
    print(f"{args.interleave} rounds, load average (1, 5, 15 min) at the end: "
          + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    for (name, n), measured in runs.items():
        rates = sorted(run.tokens_per_s for run in measured)
        ttfts = sorted(run.mean_ttft_ms for run in measured)
        per_token = sorted(cpu[(name, n)])
        print(f"{name:<18} streams={n:<2} median {rates[len(rates) // 2]:7.1f} tok/s "
              f"(min {rates[0]:.1f}, max {rates[-1]:.1f})  ttft median {ttfts[len(ttfts) // 2]:7.1f} ms  "
              f"server CPU {per_token[len(per_token) // 2]:6.0f} us/token")
    for baseline in ("llama-server", "llama_cpp.server"):
        if baseline not in servers:
            continue
        for n in streams:
            ours, theirs = runs[("ours (daemon)", n)], runs[(baseline, n)]
            ratios = sorted(o.tokens_per_s / t.tokens_per_s for o, t in zip(ours, theirs, strict=True))
            ttft = sorted(t.mean_ttft_ms / o.mean_ttft_ms for o, t in zip(ours, theirs, strict=True))
            cpus = sorted(o / t for o, t in zip(cpu[("ours (daemon)", n)], cpu[(baseline, n)], strict=True))
            print(f"ours (daemon) / {baseline:<16} streams={n:<2} tok/s: median of per-round ratios "
                  f"x{ratios[len(ratios) // 2]:5.2f} (range {ratios[0]:.2f}-{ratios[-1]:.2f})  "
                  f"ttft theirs/ours x{ttft[len(ttft) // 2]:5.2f}  CPU/token ours/theirs "
                  f"x{cpus[len(cpus) // 2]:5.2f}")


# --------------------------------------------------------------------------- prompt cache


@dataclass
class CacheRun:
    cold: list[float]
    repeat: list[float]
    turn2: list[float]


def chat_ttft(port: int, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
    """One streaming chat request: (seconds to the first content, the whole reply)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    ttft, parts = 0.0, []
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        for choice in json.loads(line[5:]).get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                ttft = ttft or time.perf_counter() - start
                parts.append(text)
    conn.close()
    return ttft, "".join(parts)


def long_message(round_: int, words: int = 400) -> str:
    """~4.8 tokens per word on the random model's vocabulary: ~1950 tokens."""
    return f"Conversation {round_}. " + " ".join(PROMPT_WORDS[(round_ + i) % len(PROMPT_WORDS)] for i in range(words))


def cache_conversation(port: int, model: str, round_: int, run: CacheRun) -> None:
    """One conversation: its first message cold, the same again, then its second turn."""
    first = [{"role": "user", "content": long_message(round_)}]
    cold, reply = chat_ttft(port, model, first, 16)
    repeat, _ = chat_ttft(port, model, first, 16)
    turn2 = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Tell me more."}]
    second, _ = chat_ttft(port, model, turn2, 16)
    run.cold.append(cold)
    run.repeat.append(repeat)
    run.turn2.append(second)


def bench_cache(args: argparse.Namespace, model: Path, work: Path) -> None:
    def median_ms(values: list[float]) -> float:
        return 1000 * sorted(values)[len(values) // 2]

    def paired(theirs: list[float], ours: list[float]) -> float:
        return sorted(t / o for t, o in zip(theirs, ours, strict=True))[len(ours) // 2]

    # One slot of 4096 tokens on every server.
    servers = {"ours (daemon)": daemon_server(
        model, work, {"n_parallel": "1", "n_ctx": "4096", "n_threads": str(args.threads)}, "-cache"
    )}
    if not args.skip_server:
        servers["llama_cpp.server"] = llama_cpp_server(model, args.threads, 4096)
    if args.llama_server:
        servers["llama-server"] = llama_server(args.llama_server, model, args.threads, 1, 4096)
    runs = {name: CacheRun([], [], []) for name in servers}
    with contextlib.ExitStack() as stack:
        for name, (command, port, ready, _) in servers.items():
            log = work / f"{name.split()[0].replace('.', '_')}-cache.log"
            stack.enter_context(running_server(command, port, ready, log))
        for _, port, _, model_name in servers.values():
            chat_ttft(port, model_name, [{"role": "user", "content": "warm up"}], 4)
        order = list(servers)
        for r in range(args.rounds):
            # Idle servers wait on the one running: alternate who goes first.
            for name in order if r % 2 == 0 else order[::-1]:
                _, port, _, model_name = servers[name]
                cache_conversation(port, model_name, r, runs[name])
    print("load average (1, 5, 15 min) at the end: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    for name, run in runs.items():
        print(f"{name:<18} ttft median of {args.rounds}: cold {median_ms(run.cold):7.1f} ms  "
              f"repeat {median_ms(run.repeat):7.1f} ms  turn 2 {median_ms(run.turn2):7.1f} ms")
    ours = runs["ours (daemon)"]
    for baseline in ("llama_cpp.server", "llama-server"):
        if baseline in runs:
            theirs = runs[baseline]
            print(f"ratio theirs/ours vs {baseline:<16} repeat x{median_ms(theirs.repeat) / median_ms(ours.repeat):5.2f}"
                  f"  turn 2 x{median_ms(theirs.turn2) / median_ms(ours.turn2):5.2f}  (goal >= 1)")
            # Each conversation's ratio, ours and theirs run back to back: less of the drift in
            # the machine's load between the two.
            print(f"  median of per-conversation ratios   repeat x{paired(theirs.repeat, ours.repeat):5.2f}"
                  f"  turn 2 x{paired(theirs.turn2, ours.turn2):5.2f}")


# --------------------------------------------------------------------------- main


def report(name: str, runs: list[Run]) -> None:
    for r in runs:
        print(
            f"{name:<18} streams={r.streams:<2} tokens={r.tokens:<5} {r.seconds:7.2f} s "
            f"{r.tokens_per_s:8.1f} tok/s  ttft {r.mean_ttft_ms:8.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF to use (default: a random 512x8 llama)")
    parser.add_argument("--dtype", choices=("f16", "f32", "q8_0"), default="f16", help="weights of the random model")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--skip-daemon", action="store_true")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--llama-server", type=Path, metavar="PATH", help="llama.cpp llama-server binary to compare to")
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), help="ours: the flash_attn parameter")
    parser.add_argument("--cache", action="store_true", help="measure the prompt cache (repeat, turn 2) instead")
    parser.add_argument("--rounds", type=int, default=3, help="conversations per server with --cache")
    parser.add_argument("--interleave", type=int, default=0, metavar="R",
                        help="HTTP servers side by side, R alternating rounds (no in-process run)")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    if args.cache:
        with tempfile.TemporaryDirectory(prefix="edged-bench-llm-cache-") as tmp:
            work = Path(tmp)
            model = args.model or write_tiny_llama(
                work / "bench.gguf", n_embd=512, n_layer=8, n_head=8, n_ff=1536, n_ctx=4096, dtype=args.dtype
            )
            print(f"model {model} ({model.stat().st_size / 2**20:.1f} MiB), {args.threads} threads, prompt cache")
            bench_cache(args, model, work)
        return

    with tempfile.TemporaryDirectory(prefix="edged-bench-llm-") as tmp:
        work = Path(tmp)
        model = args.model or write_tiny_llama(
            work / "bench.gguf", n_embd=512, n_layer=8, n_head=8, n_ff=1536, n_ctx=2048, dtype=args.dtype
        )
        print(f"model {model} ({model.stat().st_size / 2**20:.1f} MiB), {args.threads} threads, "
              f"{args.max_tokens} tokens per stream, greedy")
        if args.interleave:
            bench_interleaved(args, model, work, streams)
            return
        results: dict[str, list[Run]] = {}
        results["ours (direct)"] = asyncio.run(
            bench_direct(model, streams, args.max_tokens, args.threads, args.flash_attn or "")
        )
        report("ours (direct)", results["ours (direct)"])
        if not args.skip_daemon:
            results["ours (daemon)"] = bench_daemon(args, model, work, streams)
            report("ours (daemon)", results["ours (daemon)"])
        if not args.skip_server:
            results["llama_cpp.server"] = bench_llama_cpp_server(args, model, work, streams)
            report("llama_cpp.server", results["llama_cpp.server"])
        if args.llama_server:
            results["llama-server"] = bench_llama_server(args, model, work, streams)
            report("llama-server", results["llama-server"])
        for baseline in ("llama_cpp.server", "llama-server"):
            theirs = results.get(baseline, [])
            for name in ("ours (direct)", "ours (daemon)"):
                for ours, base in zip(results.get(name, []), theirs, strict=False):
                    print(
                        f"ratio {name:<14} / {baseline:<16} streams={ours.streams:<2} "
                        f"tok/s x{ours.tokens_per_s / base.tokens_per_s:5.2f}"
                        f"  ttft x{base.mean_ttft_ms / ours.mean_ttft_ms:5.2f} (theirs/ours)"
                    )


if __name__ == "__main__":
    main()
