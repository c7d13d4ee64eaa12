"""Bad input on every LLM route, by mutation: each field of a valid request (nested ones too)
set to values of the wrong kind, then a few fields at once, against a real daemon serving tiny
GGUF models over its Unix socket. Every answer is a 2xx or a 4xx; never a 5xx, a dropped
connection or a dead daemon.

What this found when it was written: Ollama's routes answered 500 for malformed JSON after a
field of the wrong type (the typed decode stops at the first, the null-stripping second read
raised), and a schema keyword holding an array or object raised a TypeError."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from gguf_builder import with_fim_tokens, write_tiny_llama

from support import DaemonProcess, start_daemon_process

LLAMA = ('backend: "llamacpp"\nparameters { key: "n_ctx" value { string_value: "1024" } }\n'
         'parameters { key: "n_parallel" value { string_value: "1" } }\n')

TOOL = {"type": "function", "function": {"name": "get_w", "description": "d", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, "x"]}, "minItems": 1}},
          "required": ["a"]}

# One valid request per route (each answered 200: checked below), written to reach deep code.
BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat tools": ("/v1/chat/completions", {
        "model": "tiny", "max_tokens": 2, "temperature": 0, "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_w"}}, "seed": 1, "stop": ["x"],
        "messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "get_w", "arguments": '{"city": "x"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}),
    "chat schema": ("/v1/chat/completions", {
        "model": "tiny", "max_tokens": 2, "messages": [*MESSAGES, {"role": "user", "content": [
            {"type": "text", "text": "more"}]}], "logprobs": True, "top_logprobs": 2, "stream": True,
        "stream_options": {"include_usage": True}, "logit_bias": {"5": 1}, "presence_penalty": 0.1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": SCHEMA}}}),
    "completions": ("/v1/completions", {
        "model": "tiny", "prompt": "hello", "max_tokens": 2, "echo": True, "logprobs": 2, "stop": "x", "n": 1}),
    "embeddings": ("/v1/embeddings", {"model": "embedder", "input": ["a", "b"], "encoding_format": "float"}),
    "responses": ("/v1/responses", {
        "model": "tiny", "max_output_tokens": 16, "instructions": "s",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
    "messages": ("/v1/messages", {
        "model": "tiny", "max_tokens": 2, "system": "s", "stop_sequences": ["x"],
        "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "t", "input_schema": {"type": "object"}}]}),
    "ollama chat": ("/api/chat", {
        "model": "tiny", "stream": False, "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
        "options": {"num_predict": 2, "temperature": 0, "seed": 1, "stop": ["x"], "top_k": 5}, "keep_alive": "5m"}),
    "ollama generate": ("/api/generate", {
        "model": "tiny", "prompt": "hi", "stream": True, "system": "s", "format": SCHEMA,
        "options": {"num_predict": 2, "num_ctx": 512}}),
    "ollama embed": ("/api/embed", {"model": "embedder", "input": ["a"], "truncate": True}),
    "completion": ("/completion", {
        "model": "tiny", "prompt": "hi", "n_predict": 2, "n_probs": 2, "grammar": 'root ::= "a" [b-c]*',
        "samplers": ["top_k", "temperature"], "cache_prompt": True}),
    "infill": ("/infill", {
        "model": "coder", "input_prefix": "a", "input_suffix": "b", "n_predict": 2,
        "input_extra": [{"filename": "a.py", "text": "x=1"}]}),
    "tokenize": ("/tokenize", {"model": "tiny", "content": "hi", "add_special": True, "with_pieces": True}),
    "apply-template": ("/apply-template", {"model": "tiny", "messages": MESSAGES}),
}

ODD: list[Any] = [None, True, 0, -1, 2**64, 1.5, "", "x", [], [None], [1, "a"], {}, {"a": 1},
                  [{"role": "user"}], {"type": "json_schema"}]
# Texts that are not JSON, spliced in as a field's value: after a field of the wrong type the
# decoders had already stopped, and a second read met them.
NOT_JSON = ["NaN", "Infinity", '"\\ud800"']


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    repo = tmp_path_factory.mktemp("llm-bad-input")
    for name, config in (
        ("tiny", LLAMA),
        ("embedder", 'backend: "llamacpp"\nparameters { key: "embedding" value { string_value: "true" } }\n'),
    ):
        (repo / name / "1").mkdir(parents=True)
        write_tiny_llama(repo / name / "1" / "model.gguf", seed=1, n_ctx=1024,
                         pooling=1 if name == "embedder" else None)
        (repo / name / "config.pbtxt").write_text(config)
    (repo / "coder" / "1").mkdir(parents=True)
    with_fim_tokens(repo / "tiny" / "1" / "model.gguf", repo / "coder" / "1" / "model.gguf", 300, 301, 302)
    (repo / "coder" / "config.pbtxt").write_text(LLAMA)
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo))
    yield process
    process.stop()


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if path:
        yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, (*path, index))


def _set(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    body = copy.deepcopy(body)
    where = body
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    return body


def _bodies(base: dict[str, Any], seed: int) -> Iterator[str]:
    paths = list(_paths(base))
    for path in paths:
        for value in ODD:
            yield json.dumps(_set(base, path, value))
    rng = random.Random(seed)
    for _ in range(40):
        body = base
        for _ in range(rng.randint(2, 4)):
            body = _set(body, rng.choice(list(_paths(body)) or paths), rng.choice(ODD))
        yield json.dumps(body)
        # The same, with the last top-level field's value replaced by text that is not JSON.
        if isinstance(body, dict) and body:
            last = list(body)[-1]
            yield json.dumps({**body, last: "SPLICE"}).replace('"SPLICE"', rng.choice(NOT_JSON))


@pytest.mark.parametrize("case", sorted(BASES))
def test_every_mutation_is_answered_below_500(daemon: DaemonProcess, case: str) -> None:
    path, base = BASES[case]
    reply = daemon.request("POST", path, json.dumps(base), {"Content-Type": "application/json"})
    assert reply.status == 200, reply.body[:300]  # the base reaches the route's deep code
    seen: dict[int, int] = {}
    for index, body in enumerate(_bodies(base, seed=len(case))):
        reply = daemon.request("POST", path, body, {"Content-Type": "application/json"})
        seen[reply.status] = seen.get(reply.status, 0) + 1
        assert reply.status < 500 and b"internal error" not in reply.body, (index, body[:300], reply.body[:300])
    assert seen.get(400, 0) > 0, seen  # the mutations reach the checks, not only a passing path
    assert daemon.request("POST", path, json.dumps(base), {"Content-Type": "application/json"}).status == 200

