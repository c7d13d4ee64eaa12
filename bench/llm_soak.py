"""LLM serving under churn: concurrent streams, clients that leave mid-stream, model reloads.

    .venv/bin/python bench/llm_soak.py [--seconds 120] [--clients 8] [--slots 4]
                                       [--reload-secs 5] [--leave 0.2] [--max-tokens 24]
                                       [--on-demand]

A tiny random llama GGUF (tests/gguf_builder.py) served by the daemon of this checkout on
llama.cpp, in `poll` mode: every `--reload-secs` its file is replaced by an identical copy, so the
daemon loads a new version and swaps it in while generations run (the old one finishes what it
runs). First each prompt is answered alone, greedy, as the reference; then `--clients` threads
send the prompts (some share a long prefix, some are a chat's second turn: the prompt cache
serves them) through OpenAI's `/v1/completions` and `/v1/chat/completions` and Ollama's
`/api/generate` and `/api/chat`, streamed or whole, greedy, in random order; a fraction
`--leave` of the streams is dropped after a few chunks (the slot must be freed).
`--on-demand` makes the model on-demand with `keep_alive` 0: loaded by the request that needs
it, unloaded when the last one ends.

Checked: every answer that was read to its end is a 200 whose text is the reference's for its
prompt, token for token, ending for its length (a different text means batching,
caching or a reload changed greedy output); after the load no slot is busy, and every prompt
still gives its reference. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    ROOT,
    Endpoint,
    free_port,
    log_errors,
    machine,
    print_failures,
    stop_process,
    wait_until_ready,
)
from gguf_builder import write_tiny_llama  # a test fixture: common puts tests/ on the path

OPENING = "In the quiet town by the river, the old clockmaker kept a notebook of every clock he had mended, " * 3
QUESTIONS = ("what did he write first", "who came to the shop", "why did the bells stop", "where is the key")


def _prompts() -> list[tuple[str, Any]]:
    """(route, body without the sampling fields) per prompt: completions sharing a long opening,
    and chats of one and two turns (the second turn extends the first)."""
    prompts: list[tuple[str, Any]] = [("/v1/completions", {"prompt": OPENING + q}) for q in QUESTIONS]
    prompts.append(("/v1/completions", {"prompt": "A short one"}))
    first = [{"role": "user", "content": OPENING + QUESTIONS[0]}]
    prompts.append(("/v1/chat/completions", {"messages": first}))
    second = [*first, {"role": "assistant", "content": "He wrote the date."}, {"role": "user", "content": QUESTIONS[1]}]
    prompts.append(("/v1/chat/completions", {"messages": second}))
    prompts.append(("/api/generate", {"prompt": OPENING + QUESTIONS[2]}))
    prompts.append(("/api/chat", {"messages": second}))
    return prompts


def _ollama(route: str) -> bool:
    return route.startswith("/api/")


def _text(route: str, choice: dict[str, Any], streamed: bool) -> str:
    if route == "/api/generate":
        return str(choice.get("response") or "")
    if route == "/api/chat":
        return str((choice.get("message") or {}).get("content") or "")
    if route == "/v1/completions":
        return str(choice.get("text") or "")
    part = choice.get("delta" if streamed else "message") or {}
    return str(part.get("content") or "")


class Soak:
    def __init__(self, endpoint: Endpoint, max_tokens: int) -> None:
        self.endpoint = endpoint
        self.max_tokens = max_tokens
        self.prompts = _prompts()
        self.reference: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()

    def fail(self, kind: str) -> None:
        with self.lock:
            self.failures[kind] += 1

    def count(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] += 1

    def body(self, index: int, stream: bool) -> bytes:
        route, base = self.prompts[index]
        if _ollama(route):
            options = {"temperature": 0, "num_predict": self.max_tokens}
            return json.dumps({**base, "model": "tiny", "options": options, "stream": stream}).encode()
        body = {**base, "model": "tiny", "temperature": 0, "max_tokens": self.max_tokens, "stream": stream}
        return json.dumps(body).encode()

    def ask(self, index: int, stream: bool, leave_after: int | None = None) -> tuple[str, str] | None:
        """(text, finish_reason) of one answer read to its end; None after leaving early or on a
        failure (counted)."""
        route = self.prompts[index][0]
        conn = self.endpoint.connection(timeout=120)
        try:
            conn.request("POST", route, self.body(index, stream), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                self.fail(f"{route}: {response.status} {response.read()[:200]!r}")
                return None
            if _ollama(route):
                return self._ollama_answer(route, response, stream, leave_after)
            if not stream:
                answer = json.loads(response.read())
                if answer.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens"):
                    self.count("whole, prompt cached in part")
                choice = answer["choices"][0]
                return _text(route, choice, False), str(choice.get("finish_reason"))
            text, finish, chunks = "", "", 0
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    return text, finish
                event = json.loads(line[6:])
                if "error" in event:
                    self.fail(f"{route}: error event {event['error']}")
                    return None
                for choice in event.get("choices", []):
                    text += _text(route, choice, True)
                    finish = choice.get("finish_reason") or finish
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return None  # the connection closes below: the daemon must cancel it
            self.fail(f"{route}: the stream ended without [DONE]")
            return None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.fail(f"{route}: {type(exc).__name__}: {exc}")
            return None
        finally:
            conn.close()

    def _ollama_answer(
        self, route: str, response: http.client.HTTPResponse, stream: bool, leave_after: int | None
    ) -> tuple[str, str] | None:
        """Ollama's answers: one JSON object, or NDJSON lines up to the one with `done`."""
        if not stream:
            answer = json.loads(response.read())
            return _text(route, answer, False), str(answer.get("done_reason"))
        text, chunks = "", 0
        for line in response:
            if not line.strip():
                continue
            event = json.loads(line)
            if "error" in event:
                self.fail(f"{route}: error line {event['error']}")
                return None
            text += _text(route, event, True)
            if event.get("done"):
                return text, str(event.get("done_reason"))
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return None
        self.fail(f"{route}: the stream ended without done")
        return None

    def check(self, index: int, answer: tuple[str, str] | None, how: str) -> None:
        if answer is None:
            return
        text, finish = answer
        if text != self.reference[index]:
            self.fail(f"prompt {index} {how}: {text!r} is not the reference {self.reference[index]!r}")
        elif finish != "length":
            self.fail(f"prompt {index} {how}: finish_reason {finish!r}")
        else:
            self.count(how)

    def client(self, seed: int, leave: float) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            index = rng.randrange(len(self.prompts))
            stream = rng.random() < 0.6
            if stream and rng.random() < leave:
                self.ask(index, True, leave_after=rng.randint(1, 4))
                self.count("left mid-stream")
                continue
            self.check(index, self.ask(index, stream), "streamed" if stream else "whole")


def busy_slots(endpoint: Endpoint) -> int | None:
    conn = endpoint.connection(timeout=30)
    try:
        conn.request("GET", "/slots?model=tiny")
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            return None
        return sum(1 for slot in json.loads(data) if slot.get("is_processing"))
    finally:
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--reload-secs", type=float, default=5.0)
    parser.add_argument("--leave", type=float, default=0.2, help="fraction of streams dropped early")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--on-demand", action="store_true", help="the model on-demand with keep_alive 0")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        model_dir = tmp / "repo" / "tiny"
        (model_dir / "1").mkdir(parents=True)
        original = write_tiny_llama(tmp / "tiny.gguf", seed=1, n_ctx=4096)
        shutil.copyfile(original, model_dir / "1" / "model.gguf")
        (model_dir / "config.pbtxt").write_text(
            'backend: "llamacpp"\n'
            f'parameters {{ key: "n_parallel" value: {{ string_value: "{args.slots}" }} }}\n'
            'parameters { key: "n_ctx" value: { string_value: "4096" } }\n'
            + ('parameters { key: "load" value: { string_value: "on-demand" } }\n'
               'parameters { key: "keep_alive" value: { string_value: "0" } }\n' if args.on_demand else "")
        )
        port = free_port()
        log_path = tmp / "daemon.log"
        command = [
            sys.executable, "-m", "daemon", "serve", "--socket", str(tmp / "edged.sock"),
            "--http", f"127.0.0.1:{port}", "--state-dir", str(tmp / "state"),
            "--model-repository", str(tmp / "repo"), "--model-control-mode", "poll",
            "--repository-poll-secs", "0.5",
        ]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        endpoint = Endpoint(port=port, pid=proc.pid)
        reloads = 0
        try:
            wait_until_ready(endpoint, "/v2/health/ready" if args.on_demand else "/v2/models/tiny/ready", proc,
                             what="daemon")
            soak = Soak(endpoint, args.max_tokens)
            for index in range(len(soak.prompts)):
                answer = soak.ask(index, False)
                if answer is None:
                    raise SystemExit(f"the reference answer to prompt {index} failed: {dict(soak.failures)}")
                soak.reference.append(answer[0])
            clients = [
                threading.Thread(target=soak.client, args=(seed, args.leave), daemon=True) for seed in range(args.clients)
            ]
            for thread in clients:
                thread.start()
            started = time.monotonic()
            while time.monotonic() - started < args.seconds:
                time.sleep(args.reload_secs)
                # The same weights, a new file: the poller sees a change and reloads.
                scratch_copy = model_dir / "1" / "model.gguf.new"
                shutil.copyfile(original, scratch_copy)
                os.replace(scratch_copy, model_dir / "1" / "model.gguf")
                reloads += 1
            soak.stop.set()
            for thread in clients:
                thread.join(300)
            time.sleep(2 * 0.5 + 1)  # the last replacement polled and swapped in
            busy = busy_slots(endpoint)
            if busy != 0:
                soak.fail(f"{busy} slot(s) still busy after the load")
            for index in range(len(soak.prompts)):
                soak.check(index, soak.ask(index, True), "after the load")
            alive = proc.poll() is None
        finally:
            stop_process(proc)
        log_text = log_path.read_text(errors="replace")

    loads = log_text.count("model tiny: ready (versions") - 1
    errors = log_errors(log_text)
    if not alive:
        soak.fail("the daemon exited")
    print(f"# {machine()}")
    print(f"# {args.seconds:.0f} s, {args.clients} clients, {args.slots} slots, {args.max_tokens} tokens per answer, "
          f"the file replaced every {args.reload_secs} s ({reloads} times; {loads} loads after the first)")
    for kind, count in sorted(soak.counts.items()):
        print(f"{kind:30s} {count:6d}")
    print(f"failed {sum(soak.failures.values())}, {len(errors)} error lines in the daemon's log")
    print_failures(soak.failures, errors)
    return 1 if soak.failures or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
