"""llama-server's POST /completion (/completions) and /infill against the daemon serving tiny
GGUFs on llama.cpp, over its real socket. tests/fixtures/oracle/llama_completion.py compares
the same requests with llama-server's answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from gguf_builder import with_fim_tokens, write_tiny_llama

# Ids in the tiny vocabulary: <s> 1, </s> 2; the control tokens come last (379 on).
BOS, EOS = 1, 2
PRE, SUF, MID, REP, SEP = 379, 380, 381, 382, 383
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llm-repo")
    for name in ("tiny", "coder", "fim"):
        (path / name / "1").mkdir(parents=True)
        (path / name / "config.pbtxt").write_text('backend: "llamacpp"\n')
    controls = ("[FP]", "[FS]", "[FM]", "[FR]", "[FE]")  # names llama.cpp does not take for FIM
    source = write_tiny_llama(path / "tiny" / "1" / "model.gguf", seed=1, n_ctx=1024, control_tokens=controls)
    # Repository-level FIM tokens (Qwen 2.5 Coder's layout), and the three plain ones only.
    with_fim_tokens(source, path / "coder" / "1" / "model.gguf", PRE, SUF, MID, rep=REP, sep=SEP)
    with_fim_tokens(source, path / "fim" / "1" / "model.gguf", PRE, SUF, MID)
    # The same weights with other parameters.
    for name, parameters in (
        # One slot of 256 cells with llama-server's context shift.
        ("shift", (("n_ctx", "256"), ("n_parallel", "1"), ("context_shift", "true"))),
        # One slot that moves cached runs of 8 tokens or more (llama-server's --cache-reuse 8).
        ("reuse", (("n_parallel", "1"), ("cache_reuse", "8"), ("prefix_store_mib", "0"))),
    ):
        (path / name / "1").mkdir(parents=True)
        (path / name / "1" / "model.gguf").symlink_to(source)
        (path / name / "config.pbtxt").write_text('backend: "llamacpp"\n' + "".join(
            f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in parameters))
    return path


@pytest.fixture(scope="module")
def daemon(repo: Path, tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


def complete(daemon: Any, path: str = "/completion", **body: Any) -> Any:
    return daemon.post_ok(path, {"model": "tiny", "temperature": 0, **body})


def tokenize(daemon: Any, text: str, model: str = "tiny", **options: Any) -> list[int]:
    return daemon.post_ok("/tokenize", {"model": model, "content": text, **options})["tokens"]


def events(daemon: Any, path: str, body: dict[str, Any]) -> list[Any]:
    reply = daemon.post_json(path, {"model": "tiny", "temperature": 0, "stream": True, **body})
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"].startswith("text/event-stream")
    frames = reply.body.decode().split("\n\n")
    assert frames[-1] == ""  # every event ends with a blank line
    assert all(frame.startswith("data: ") for frame in frames[:-1])
    return [json.loads(frame[len("data: "):]) for frame in frames[:-1]]  # no [DONE]: not JSON


def test_samplers_order_has_its_effect(daemon: Any) -> None:
    """`samplers` as on the OpenAI routes: top-k 1 alone leaves the best token, whatever the
    temperature; the default order (its llama-server code string) samples at that temperature."""
    greedy = complete(daemon, prompt=PROMPT, n_predict=16)["content"]
    hot = {"prompt": PROMPT, "n_predict": 16, "temperature": 2.0, "seed": 5, "top_k": 1}
    got = complete(daemon, **hot, samplers="k")
    assert got["content"] == greedy and got["generation_settings"]["samplers"] == ["top_k"]
    wide = {**hot, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    assert complete(daemon, **wide, samplers="edskypmxt")["content"] == complete(daemon, **wide)["content"] != greedy


def test_greedy_text_is_the_openai_routes(daemon: Any) -> None:
    for path in ("/completion", "/completions"):
        got = complete(daemon, path, prompt=PROMPT, n_predict=16)
        openai = daemon.post_ok("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        assert got["content"] == openai["choices"][0]["text"] and got["content"]
        assert got["stop"] is True and got["stop_type"] == "limit" and got["stopping_word"] == ""
        assert got["tokens_predicted"] == 16 and got["truncated"] is False
        prompt = tokenize(daemon, PROMPT, add_special=True)
        assert got["tokens_evaluated"] == len(prompt) == openai["usage"]["prompt_tokens"]
        assert got["prompt"] == daemon.post_ok("/detokenize", {"model": "tiny", "tokens": prompt})["content"]
        assert got["model"] == "tiny" and got["tokens"] == []
        assert got["tokens_cached"] == len(prompt) + 15
        assert got["has_new_line"] == ("\n" in got["content"])
        timings = got["timings"]
        assert timings["predicted_n"] == 16 and timings["prompt_n"] + timings["cache_n"] == len(prompt)
        assert timings["predicted_ms"] >= 0 and timings["prompt_ms"] > 0
        settings = got["generation_settings"]
        assert settings["n_predict"] == 16 and settings["temperature"] == 0 and settings["repeat_last_n"] == 64
        assert settings["seed"] == 2**32 - 1 and settings["stream"] is False


def test_n_predict_and_return_tokens(daemon: Any) -> None:
    got = complete(daemon, prompt=PROMPT, n_predict=3, return_tokens=True)
    assert got["tokens_predicted"] == 3 and len(got["tokens"]) == 3 and got["stop_type"] == "limit"
    assert daemon.post_ok("/detokenize", {"model": "tiny", "tokens": got["tokens"]})["content"] == got["content"]
    longer = complete(daemon, prompt=PROMPT, n_predict=8)
    assert longer["content"].startswith(got["content"])
    # The OpenAI name means the same; -1 runs to the end of the context (1024 tokens here).
    assert complete(daemon, prompt=PROMPT, max_tokens=3)["content"] == got["content"]
    full = complete(daemon, prompt=PROMPT, n_predict=-1, ignore_eos=True)
    assert full["stop_type"] == "limit" and full["truncated"] is True
    assert full["tokens_cached"] == 1024  # the whole context: the last token sampled is not decoded


def test_stop_word(daemon: Any) -> None:
    text = complete(daemon, prompt=PROMPT, n_predict=16)["content"]
    word = text[5:8]
    got = complete(daemon, prompt=PROMPT, n_predict=16, stop=["never-there", word])
    assert got["content"] == text[: text.index(word)]
    assert got["stop_type"] == "word" and got["stopping_word"] == word
    assert got["tokens_predicted"] < 16


def test_eos(daemon: Any) -> None:
    # The end-of-sequence token made certain, in either of llama-server's logit_bias forms.
    for bias in ([[EOS, 100]], {str(EOS): 100}, [["never", -100], [EOS, 100]]):
        got = complete(daemon, prompt=PROMPT, n_predict=8, logit_bias=bias, return_tokens=True)
        assert got["stop_type"] == "eos" and got["content"] == "" and got["stopping_word"] == ""
        assert got["tokens"] == [EOS] and got["tokens_predicted"] == 1


def test_logit_bias_bans_a_token(daemon: Any) -> None:
    first = complete(daemon, prompt=PROMPT, n_predict=1, return_tokens=True)["tokens"][0]
    again = complete(daemon, prompt=PROMPT, n_predict=1, return_tokens=True, logit_bias=[[first, -100]])
    assert again["tokens"][0] != first
    assert again["generation_settings"]["logit_bias"] == [{"bias": -100.0, "token": first}]


def test_a_grammar_whose_every_token_is_banned_is_a_400_not_an_abort(daemon: Any) -> None:
    """logit_bias `false` on every token a grammar allows: the draw falls on a token the
    grammar rejects, and accepting it into the grammar threw a C++ exception through llama.cpp's
    C API, which ended the process (std::terminate)."""
    vocab = daemon.get_json("/v1/models/tiny")["meta"]["n_vocab"]
    banned = [[token, False] for token in range(vocab)]
    message = ("grammar: at output token 1 no token is left that the grammar allows (logit_bias bans them all, "
               "or none of the model's tokens continues the grammar)")
    for stream in (False, True):
        reply = daemon.post_json("/completion", {"model": "tiny", "prompt": PROMPT, "n_predict": 4, "stream": stream,
                                                 "temperature": 0.8, "grammar": 'root ::= "a"+', "logit_bias": banned})
        assert reply.status == 400 and reply.json()["error"]["message"] == message, reply.body
    # Banning all but one token leaves it, and a grammar of its text holds the output to it.
    [only] = daemon.post_ok("/tokenize", {"model": "tiny", "content": "a", "with_pieces": True})["tokens"][-1:]
    kept = [[token, False] for token in range(vocab) if token != only["id"]]
    done = complete(daemon, prompt=PROMPT, n_predict=3, grammar=f"root ::= {json.dumps(only['piece'])}+", logit_bias=kept)
    assert done["content"] == only["piece"] * 3, (only, done["content"])


def test_stream_frames_and_summary(daemon: Any) -> None:
    whole = complete(daemon, prompt=PROMPT, n_predict=10, return_tokens=True)
    frames = events(daemon, "/completion", {"prompt": PROMPT, "n_predict": 10})
    *parts, final = frames
    assert parts and all(p["stop"] is False and set(p) == {"index", "content", "tokens", "id_slot", "stop", "tokens_predicted", "tokens_evaluated"} for p in parts)
    assert "".join(p["content"] for p in parts) == whole["content"]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"]
    assert parts[-1]["tokens_predicted"] == 10 and parts[0]["tokens_evaluated"] == whole["tokens_evaluated"]
    assert final["stop"] is True and final["content"] == "" and final["tokens"] == []
    assert final["stop_type"] == "limit" and final["tokens_predicted"] == 10 and "timings" in final
    assert final["generation_settings"]["stream"] is True
    # A stop word ends the stream with its summary too.
    word = whole["content"][4:6]
    *parts, final = events(daemon, "/completion", {"prompt": PROMPT, "n_predict": 10, "stop": word})
    assert "".join(p["content"] for p in parts) == whole["content"][: whole["content"].index(word)]
    assert final["stop_type"] == "word" and final["stopping_word"] == word


def test_token_id_prompts(daemon: Any) -> None:
    text = complete(daemon, prompt=PROMPT, n_predict=8)["content"]
    ids = tokenize(daemon, PROMPT, add_special=True)
    assert complete(daemon, prompt=ids, n_predict=8)["content"] == text
    # Texts and ids mixed: a first text gets the BOS, a later one none (llama-server's).
    head, tail = "Once upon", " a time"
    mixed = complete(daemon, prompt=[BOS, *tokenize(daemon, head), tail], n_predict=8)
    assert mixed["tokens_evaluated"] == 1 + len(tokenize(daemon, head)) + len(tokenize(daemon, tail))
    mixed = complete(daemon, prompt=[head, 300], n_predict=2)
    assert mixed["tokens_evaluated"] == len(tokenize(daemon, head, add_special=True)) + 1


def test_prompts_and_completions_of_each(daemon: Any) -> None:
    # A list of prompts: one result each, in order, each what the prompt gets alone.
    prompts = ["Once upon", [BOS, *tokenize(daemon, " a time")], ["Hello", 300]]
    alone = [complete(daemon, prompt=p, n_predict=6) for p in prompts]
    got = complete(daemon, prompt=prompts, n_predict=6)
    assert [r["index"] for r in got] == [0, 1, 2]
    assert [r["content"] for r in got] == [r["content"] for r in alone]
    assert [r["prompt"] for r in got] == [r["prompt"] for r in alone]
    assert [r["tokens_evaluated"] for r in got] == [r["tokens_evaluated"] for r in alone]
    # n_cmpl completions of each prompt, index prompt * n_cmpl + i; with a seed, completion i
    # samples with seed + i (llama-server's child tasks).
    sampled = {"temperature": 1.5, "top_k": 0, "n_predict": 12}
    pair = daemon.post_ok("/completion", {"model": "tiny", "prompt": ["Once", "Hello"], "n_cmpl": 2, "seed": 7, **sampled})
    assert [r["index"] for r in pair] == [0, 1, 2, 3]
    for index, (prompt, seed) in enumerate([("Once", 7), ("Once", 8), ("Hello", 7), ("Hello", 8)]):
        single = daemon.post_ok("/completion", {"model": "tiny", "prompt": prompt, "seed": seed, **sampled})
        assert pair[index]["content"] == single["content"]
    assert pair[0]["content"] != pair[1]["content"]  # independent samples differ
    # `n` is its other name; one completion of one prompt stays an object.
    by_n = daemon.post_ok("/completion", {"model": "tiny", "prompt": "Once", "n": 2, "seed": 7, **sampled})
    assert [r["content"] for r in by_n] == [r["content"] for r in pair[:2]]
    assert isinstance(complete(daemon, prompt=["Once"], n_predict=2), dict)


def test_prompts_streamed(daemon: Any) -> None:
    prompts = ["Once upon", "Hello"]
    whole = complete(daemon, prompt=prompts, n_predict=6, n_cmpl=2)
    frames = events(daemon, "/completion", {"prompt": prompts, "n_predict": 6, "n_cmpl": 2})
    for index in range(4):
        mine = [f for f in frames if f["index"] == index]
        # Each generation's chunks, then its one summary last.
        assert [f["stop"] for f in mine] == [False] * (len(mine) - 1) + [True]
        assert "".join(f["content"] for f in mine) == whole[index]["content"]
        assert mine[-1]["tokens_predicted"] == whole[index]["tokens_predicted"]


def test_n_probs(daemon: Any) -> None:
    got = complete(daemon, prompt=PROMPT, n_predict=4, n_probs=3, return_tokens=True)
    probs = got["completion_probabilities"]
    assert [p["id"] for p in probs] == got["tokens"]
    assert all(set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"} and len(p["top_logprobs"]) == 3 for p in probs)
    # Greedy: the token is the most likely one.
    assert all(p["top_logprobs"][0]["id"] == p["id"] for p in probs)
    assert got["generation_settings"]["n_probs"] == 3


def test_post_sampling_probs(daemon: Any) -> None:
    """llama-server's probabilities after the sampler chain (`prob`, `top_probs`): with top-k 3
    (top-p and min-p off) at temperature 1, the softmax of the three best logits; greedy, the
    token alone at 1."""
    body = {"prompt": PROMPT, "n_predict": 6, "n_probs": 5, "return_tokens": True, "seed": 7, "top_p": 1.0, "min_p": 0.0}
    before = complete(daemon, **body, temperature=1.0, top_k=3)
    after = complete(daemon, **body, temperature=1.0, top_k=3, post_sampling_probs=True)
    assert after["tokens"] == before["tokens"]  # the same draws: only what is reported differs
    assert after["generation_settings"]["post_sampling_probs"] is True
    for pre, post in zip(before["completion_probabilities"], after["completion_probabilities"], strict=True):
        assert set(post) == {"id", "token", "bytes", "prob", "top_probs"} and post["id"] == pre["id"]
        best = pre["top_logprobs"][:3]
        weights = np.exp(np.array([t["logprob"] for t in best]))
        expected = weights / weights.sum()
        assert [t["id"] for t in post["top_probs"]] == [t["id"] for t in best]  # 3 kept, of 5 asked
        np.testing.assert_allclose([t["prob"] for t in post["top_probs"]], expected, rtol=1e-4)
        assert post["prob"] == next(t["prob"] for t in post["top_probs"] if t["id"] == post["id"])
    greedy = complete(daemon, **body, post_sampling_probs=True)
    for entry in greedy["completion_probabilities"]:
        assert entry["prob"] == 1.0
        assert entry["top_probs"] == [{"id": entry["id"], "token": entry["token"], "bytes": entry["bytes"], "prob": 1.0}]
    # Streamed, each event's entry is the whole answer's.
    frames = events(daemon, "/completion", {**body, "temperature": 1.0, "top_k": 3, "post_sampling_probs": True})
    streamed = [entry for frame in frames if "completion_probabilities" in frame for entry in frame["completion_probabilities"]]
    assert streamed == after["completion_probabilities"]


def test_a_mikupad_request(daemon: Any) -> None:
    """mikupad's /completion request with its defaults (as its mikupad.html builds it for a
    llama.cpp endpoint): penalize_nl false, n_probs 10 after sampling, banned tokens as
    llama-server's `false` bias (the end-of-generation token too, so that all 24 come on any
    machine's arithmetic), streamed."""
    banned = tokenize(daemon, "e")[-1]
    body = {
        "prompt": PROMPT, "temperature": 0.7, "repeat_penalty": 1.1, "repeat_last_n": 256, "penalize_nl": False,
        "ignore_eos": False, "presence_penalty": 0, "frequency_penalty": 0, "top_p": 0.95, "top_k": 40,
        "min_p": 0.05, "n_predict": 24, "n_probs": 10, "post_sampling_probs": True, "stream": True,
        "stop": ["</s>"], "logit_bias": [[banned, False], [EOS, False]], "cache_prompt": True, "seed": 1,
    }
    frames = events(daemon, "/completion", body)
    tokens = [t for frame in frames for t in frame.get("tokens", []) if not frame["stop"]]
    assert frames[-1]["stop"] and len(tokens) == 24 and banned not in tokens
    assert frames[-1]["generation_settings"]["logit_bias"] == [{"bias": False, "token": banned}, {"bias": False, "token": EOS}]
    for frame in frames[:-1]:
        (entry,) = frame["completion_probabilities"]
        assert 0 < entry["prob"] <= 1 and all(t["id"] != banned for t in entry["top_probs"])


def test_a_grammar_rejects_rather_than_masks(daemon: Any) -> None:
    """llama-server's rejection sampling: with a seed, a grammar changes nothing while the
    chain's own draw is a token it allows; only a rejected token is drawn again among the
    allowed ones. A grammar allowing just the characters of the first tokens the free output
    drew keeps those tokens (a grammar masking every step changes the distribution, so the
    draws, from the first token on)."""
    # A flat distribution, nothing cut from it: masking moves every draw.
    body = {"prompt": PROMPT, "n_predict": 16, "seed": 42, "temperature": 2.0, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0, "return_tokens": True}
    free = complete(daemon, **body)
    pieces = [daemon.post_ok("/detokenize", {"model": "tiny", "tokens": [t]})["content"] for t in free["tokens"]]
    assert "".join(pieces) == free["content"]
    kept = 4
    allowed = "".join(f"\\x{ord(c):02x}" for c in sorted(set("".join(pieces[:kept]))))
    held = complete(daemon, **body, grammar=f"root ::= [{allowed}]*")
    assert held["tokens"][:kept] == free["tokens"][:kept], (held["content"], free["content"])
    assert set(held["content"]) <= set("".join(pieces[:kept]))


def test_grammar_and_json_schema(daemon: Any) -> None:
    got = complete(daemon, prompt=PROMPT, n_predict=20, grammar='root ::= "yes" | "no"')
    assert got["content"] in ("yes", "no") and got["stop_type"] == "eos"
    got = complete(daemon, prompt=PROMPT, n_predict=64, json_schema={"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    if got["stop_type"] == "eos":
        assert isinstance(json.loads(got["content"])["a"], bool)


def test_infill_repository_layout(daemon: Any) -> None:
    body = {"model": "coder", "input_prefix": "def f(x):\n", "input_suffix": "\n    return y\n",
            "input_extra": [{"filename": "a.py", "text": "import os\n"}], "prompt": "    y",
            "n_predict": 4, "temperature": 0}
    got = daemon.post_ok("/infill", body)

    def text(value: str) -> list[int]:
        return tokenize(daemon, value, "coder", parse_special=False)

    # llama-server's format_prompt_infill: the extra files before the BOS, the prompt after the prefix.
    expected = [REP, *text("myproject\n"), SEP, *text("a.py\n"), *text("import os\n"), SEP, *text("filename\n"),
                BOS, PRE, *text("def f(x):\n"), *text("    y"), SUF, *text("\n    return y\n"), MID]
    assert got["tokens_evaluated"] == len(expected)
    assert got["prompt"] == daemon.post_ok("/detokenize", {"model": "coder", "tokens": expected})["content"]
    assert got["tokens_predicted"] == 4
    # Only the three plain FIM tokens: no repository part, the files between snippet markers.
    got = daemon.post_ok("/infill", {**body, "model": "fim"})
    expected = [*text("\n\n--- snippet ---\n\n"), *text("import os\n"),
                BOS, PRE, *text("def f(x):\n"), *text("    y"), SUF, *text("\n    return y\n"), MID]
    assert got["prompt"] == daemon.post_ok("/detokenize", {"model": "fim", "tokens": expected})["content"]
    frames = events(daemon, "/infill", {**body, "model": "fim"})
    assert frames[-1]["stop"] is True and frames[-1]["tokens_evaluated"] == len(expected)


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/completion", {"prompt": "x", "samplers": ["top_k", "bogus"]}, "samplers[1]: unknown sampler 'bogus'"),
    ("/completion", {"prompt": "x", "n": 2, "n_cmpl": 3}, "n_cmpl and n disagree"),
    ("/completion", {"prompt": "x", "n_cmpl": 0}, "n_cmpl must be >= 1"),
    ("/completion", {"prompt": "x", "n": 500}, "n: 500 choices are more than"),
    ("/completion", {"prompt": []}, "prompt: must not be empty"),
    ("/completion", {"prompt": ["a", []]}, "prompt[1]: no tokens"),
    ("/completion", {"prompt": "x", "id_slot": 99}, "(-1: any), got 99"),
    ("/completion", {"prompt": "x", "id_slot": -2}, "(-1: any), got -2"),
    ("/completion", {"prompt": "x", "n_keep": 4}, "n_keep"),
    ("/completion", {"prompt": "x", "penalize_nl": True}, "penalize_nl: llama.cpp no longer has it"),
    ("/completion", {"prompt": "x", "n_indent": -1}, "n_indent must be >= 0, got -1"),
    ("/completion", {"prompt": "x", "t_max_predict_ms": -2}, "t_max_predict_ms must be -1 (no limit) or >= 0, got -2"),
    ("/completion", {"prompt": "x", "response_fields": "content"}, "Expected `array | null`, got `str` - at `$.response_fields`"),
    ("/completion", {"prompt": "x", "response_fields": [1]}, "Expected `str`, got `int` - at `$.response_fields[0]`"),
    ("/completion", {"prompt": "x", "timings_per_token": 1}, "Expected `bool`, got `int` - at `$.timings_per_token`"),
    ("/completion", {"prompt": "x", "return_progress": "yes"}, "Expected `bool`, got `str` - at `$.return_progress`"),
    ("/completion", {}, "prompt"),
    ("/completion", {"prompt": [1, [2]]}, "prompt[1]"),
    ("/completion", {"prompt": "x", "n_predict": -2}, "n_predict"),
    ("/completion", {"prompt": "x", "n_predict": 3, "max_tokens": 4}, "disagree"),
    ("/completion", {"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {}}, "json_schema"),
    # A reference into a keyword's value is no schema (it was a 500 from the converter).
    ("/completion", {"prompt": "x", "json_schema": {"properties": {"a": {"$ref": "#/$defs/x/type"}}, "$defs": {"x": {"type": "string"}}}},
     "json_schema: cannot be turned into a grammar: $ref '#/$defs/x/type' points at \"string\", which is not a schema"),
    ("/completion", {"prompt": "x", "logit_bias": [[5, True]]}, "logit_bias[5]: true is not a bias"),
    ("/completion", {"prompt": "x", "logit_bias": {"a": 101}}, "logit_bias"),
    ("/completion", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/completion", {"prompt": "x", "n_probs": 21}, "n_probs"),
    ("/completion", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/completion", {"prompt": [99999]}, "99999"),
    # Two bytes of "€": the answer's `prompt` echo cannot be that text (llama-server: U+FFFD).
    ("/completion", {"prompt": [229, 133]}, "prompt: the tokens' bytes are not UTF-8 text"),
    ("/infill", {"input_suffix": "x"}, "input_prefix"),
    ("/infill", {"input_prefix": "x"}, "input_suffix"),
    ("/infill", {"input_prefix": "x", "input_suffix": "y", "input_extra": [{"filename": "a"}]}, "text"),
    ("/infill", {"input_prefix": "x", "input_suffix": "y"}, "fill-in-the-middle"),  # tiny has no FIM tokens
])
def test_what_is_refused(daemon: Any, path: str, body: dict[str, Any], field: str) -> None:
    error = daemon.post_ok(path, {"model": "tiny", **body}, 400)["error"]
    assert field in error["message"] and error["type"] == "invalid_request_error"


def test_context_shift(daemon: Any) -> None:
    """A model with context_shift goes on past its slot's 256 cells, as llama-server with
    --context-shift (token for token against it: docs/llama-server.md); `truncated` says a
    shift happened, `tokens_cached` counts the cells the slot keeps: the prompt and the first
    token here (n_keep -1 and the BOS llama-server adds to it), none that a shift moved."""
    prompt = [1] + [300] * 249
    out = complete(daemon, model="shift", prompt=prompt, n_predict=30, n_keep=-1)
    assert out["tokens_predicted"] == 30 and out["stop_type"] == "limit" and out["truncated"] is True
    assert out["tokens_cached"] == 251
    assert (out["generation_settings"]["n_keep"], out["generation_settings"]["n_discard"]) == (-1, 0)
    chat = daemon.post_ok("/v1/chat/completions", {"model": "shift", "messages": [{"role": "user", "content": "hi " * 60}],
                                                  "max_tokens": 120, "temperature": 0, "n_discard": 8})
    assert chat["usage"]["completion_tokens"] == 120 and chat["choices"][0]["finish_reason"] == "length"
    for body, message in (({"n_keep": 3}, "n_keep: model 'tiny' has no context shift"),
                          ({"n_discard": 3}, "n_discard: model 'tiny' has no context shift"),
                          ({"n_keep": -2}, "n_keep must be -1 (the prompt) or between 0 and"),
                          ({"n_discard": -1}, "n_discard must be between 0 and")):
        for path, extra in (("/completion", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            error = daemon.post_ok(path, {"model": "tiny", **extra, **body}, 400)["error"]
            assert message in error["message"], (path, body, error)
    assert complete(daemon, prompt="x", n_predict=2, n_keep=0)["tokens_predicted"] == 2
    # Ollama's routes shift as Ollama does (num_keep, not n_keep; tests/api/test_ollama.py),
    # whatever the model's context_shift: with their `shift: false` the reply ends at the
    # slot's end on this model too.
    reply = daemon.post_json("/api/generate", {"model": "shift", "prompt": "x " * 120, "raw": True, "stream": False,
                                               "shift": False, "options": {"num_predict": 100}})
    assert reply.status == 200 and reply.json()["done_reason"] == "length", reply.body
    assert reply.json()["eval_count"] < 100 and reply.json()["prompt_eval_count"] + reply.json()["eval_count"] <= 257


def test_cache_reuse(daemon: Any) -> None:
    """llama-server's --cache-reuse (the model's cache_reuse) and a request's n_cache_reuse:
    runs of the slot's cells the next prompt has again are moved, not decoded (`cache_n`),
    on the native and the OpenAI routes; what they write is checked against numpy in
    tests/backends/test_llamacpp_cache_reuse.py."""
    start, dropped, kept = [1, 300, 301, 320, 330], [270, 280, 290], list(range(310, 322))
    first, second = start + dropped + kept, start + kept + [331, 332]

    def cached(path: str, **body: Any) -> int:
        complete(daemon, "/completion", model="reuse", prompt=first, n_predict=0)
        out = complete(daemon, path, model="reuse", prompt=second, **body)
        return out["timings"]["cache_n"] if path == "/completion" else out["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("/completion", n_predict=2) == len(start + kept)
    assert cached("/completion", n_predict=2, n_cache_reuse=0) == len(start)
    assert cached("/completion", n_predict=2, n_cache_reuse=13) == len(start)  # the run is 12
    assert cached("/v1/completions", max_tokens=2) == len(start + kept)
    assert cached("/v1/completions", max_tokens=2, cache_prompt=False) == 0
    # Off by default, as llama-server's: the request asks for it on another model (whose
    # host-RAM store is on: other runs each time, so that it never holds the better match).
    complete(daemon, "/completion", model="shift", prompt=first, n_predict=0)
    out = complete(daemon, "/completion", model="shift", prompt=second, n_predict=2)
    assert out["timings"]["cache_n"] == len(start)
    other = list(range(340, 352))
    complete(daemon, "/completion", model="shift", prompt=start + dropped + other, n_predict=0)
    out = complete(daemon, "/completion", model="shift", prompt=start + other + [333], n_predict=2, n_cache_reuse=4)
    assert out["timings"]["cache_n"] == len(start + other)
    for path in ("/completion", "/v1/completions"):
        error = daemon.post_ok(path, {"model": "reuse", "prompt": "x", "n_cache_reuse": -1}, 400)["error"]
        assert error["message"] == "n_cache_reuse must be >= 0, got -1"


def test_model_is_required_and_known(daemon: Any) -> None:
    assert "model" in daemon.post_ok("/completion", {"prompt": "x"}, 400)["error"]["message"]
    daemon.post_ok("/completion", {"model": "nope", "prompt": "x"}, 404)


# The code-completion fields. NL: the tiny vocabulary's byte token for "\n" (byte b is 3 + b).
NL = 3 + 10
INDENTED = 'root ::= "a\\n    b\\n  c\\nd"'  # a grammar: the output is exactly that text


def test_n_indent_stops_at_a_line_indented_less(daemon: Any) -> None:
    """llama-server's n_indent: a line with fewer spaces than n_indent ends the output; the
    whole answer cuts it after its indentation, stop_type limit (not truncated)."""
    free = complete(daemon, prompt=PROMPT, n_predict=32, grammar=INDENTED, return_tokens=True)
    assert free["content"] == "a\n    b\n  c\nd" and free["stop_type"] == "eos"
    got = complete(daemon, prompt=PROMPT, n_predict=32, grammar=INDENTED, n_indent=2, return_tokens=True)
    assert got["content"] == "a\n    b\n  c\n" and got["stop_type"] == "limit" and got["truncated"] is False
    # Every token up to the one that showed the line's first character is counted and listed.
    assert got["tokens"] == free["tokens"][: got["tokens_predicted"]] and got["has_new_line"] is True
    deeper = complete(daemon, prompt=PROMPT, n_predict=32, grammar=INDENTED, n_indent=5)
    assert deeper["content"] == "a\n    " and deeper["stop_type"] == "limit"
    assert complete(daemon, prompt=PROMPT, n_predict=32, grammar=INDENTED, n_indent=0)["content"] == free["content"]
    # Streamed, the events sent the line before the stop was known (as llama-server's).
    *parts, final = events(daemon, "/completion", {"prompt": PROMPT, "n_predict": 32, "grammar": INDENTED, "n_indent": 5})
    assert "".join(p["content"] for p in parts).startswith("a\n    b") and final["stop_type"] == "limit"
    # An empty line is no indentation either: newlines alone stop at the third token.
    got = complete(daemon, prompt=PROMPT, n_predict=16, logit_bias=[[NL, 60]], n_indent=1, return_tokens=True)
    assert got["tokens"] == [NL] * 3 and got["content"] == "\n" and got["stop_type"] == "limit"


def test_n_indent_in_infill(daemon: Any) -> None:
    body = {"model": "coder", "input_prefix": "def f(x):\n", "input_suffix": "\n", "n_predict": 32,
            "temperature": 0, "grammar": INDENTED, "n_indent": 2}
    got = daemon.post_ok("/infill", body)
    assert got["content"] == "a\n    b\n  c\n" and got["stop_type"] == "limit"


def test_t_max_predict_ms_stops_at_a_newline(daemon: Any) -> None:
    """After t_max_predict_ms since the first token, a token that sends a newline ends the
    output (stop_type limit); without a newline the output runs on."""
    lines = complete(daemon, prompt=PROMPT, n_predict=400, logit_bias=[[NL, 60]], t_max_predict_ms=1)
    assert lines["stop_type"] == "limit" and lines["truncated"] is False
    assert 2 <= lines["tokens_predicted"] < 400 and lines["content"] == "\n" * lines["tokens_predicted"]
    assert complete(daemon, prompt=PROMPT, n_predict=400, logit_bias=[[NL, 60]])["tokens_predicted"] == 400
    # No newline: nothing stops it before n_predict, however long it takes.
    flat = complete(daemon, prompt=PROMPT, n_predict=200, logit_bias=[[NL, -100]], ignore_eos=True, t_max_predict_ms=1)
    assert flat["tokens_predicted"] == 200 and flat["stop_type"] == "limit" and "\n" not in flat["content"]
    # A generous limit is never reached.
    assert complete(daemon, prompt=PROMPT, n_predict=50, logit_bias=[[NL, 60]], t_max_predict_ms=600_000)["tokens_predicted"] == 50


def test_timings_per_token(daemon: Any) -> None:
    body = {"prompt": PROMPT, "n_predict": 6}
    plain = events(daemon, "/completion", body)
    assert all("timings" not in p for p in plain[:-1]) and "timings" in plain[-1]
    *parts, final = events(daemon, "/completion", {**body, "timings_per_token": True})
    assert parts and all(p["timings"]["predicted_n"] == p["tokens_predicted"] for p in parts)
    assert all(p["timings"]["prompt_n"] + p["timings"]["cache_n"] == p["tokens_evaluated"] for p in parts)
    assert final["timings"]["predicted_n"] == 6 and final["generation_settings"]["timings_per_token"] is True


def test_return_progress(daemon: Any) -> None:
    """Streamed, prompt_progress events before the first token: one as the slot starts (what
    its cache held), one after each decode of the prompt (batches of 512 here)."""
    prompt = [BOS, *[300 + i % 50 for i in range(699)]]  # 700 tokens: two decodes
    frames = events(daemon, "/completion", {"prompt": prompt, "n_predict": 3, "return_progress": True, "cache_prompt": False})
    progress = [f["prompt_progress"] for f in frames if "prompt_progress" in f]
    assert [(p["total"], p["cache"], p["processed"]) for p in progress] == [(700, 0, 0), (700, 0, 512), (700, 0, 700)]
    assert all(p["time_ms"] >= 0 for p in progress)
    assert all("prompt_progress" in f for f in frames[: len(progress)])  # before the tokens
    firsts = frames[: len(progress)]
    assert all(f["content"] == "" and f["tokens_predicted"] == 0 and f["tokens_evaluated"] == 700 for f in firsts)
    assert "".join(f["content"] for f in frames) == complete(daemon, prompt=prompt, n_predict=3)["content"]
    # Again: the cache held all but the last token.
    frames = events(daemon, "/completion", {"prompt": prompt, "n_predict": 3, "return_progress": True})
    progress = [f["prompt_progress"] for f in frames if "prompt_progress" in f]
    assert [(p["cache"], p["processed"]) for p in progress] == [(699, 699), (699, 700)]
    # Without the field, or whole: none.
    assert not any("prompt_progress" in f for f in events(daemon, "/completion", {"prompt": prompt, "n_predict": 3}))
    assert "prompt_progress" not in complete(daemon, prompt=prompt, n_predict=3, return_progress=True)


def test_n_predict_0_evaluates_the_prompt_into_the_cache(daemon: Any) -> None:
    """llama-server's n_predict 0: nothing is generated, but the prompt is evaluated into a
    slot's cache (editors such as llama.vim send these to have the context ready before they
    ask for a completion in it)."""
    prompt = [BOS, *[310 + (i * 7) % 37 for i in range(299)]]
    warm = complete(daemon, prompt=prompt, n_predict=0)
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["stop_type"] == "limit"
    assert warm["tokens_evaluated"] == 300 and warm["timings"]["prompt_n"] + warm["timings"]["cache_n"] == 300
    assert warm["timings"]["prompt_n"] > 290  # decoded now, not found
    after = complete(daemon, prompt=prompt, n_predict=2)
    assert after["timings"]["cache_n"] == 299  # all but the last token came from the warm-up
    # Streamed, with its progress as for any prompt, and no token.
    other = [BOS, *[320 + (i * 5) % 23 for i in range(199)]]
    frames = events(daemon, "/completion", {"prompt": other, "n_predict": 0, "return_progress": True, "cache_prompt": False})
    progress = [f["prompt_progress"] for f in frames if "prompt_progress" in f]
    assert [(p["total"], p["processed"]) for p in progress] == [(200, 0), (200, 200)]
    assert "".join(f["content"] for f in frames) == "" and frames[-1]["stop"] is True
    assert frames[-1]["tokens_predicted"] == 0


def test_response_fields(daemon: Any) -> None:
    fields = ["content", "generation_settings/n_predict", "timings/nope", "stop_type", "nope", "tokens_predicted/x"]
    got = complete(daemon, prompt=PROMPT, n_predict=4, response_fields=fields)
    assert got == {"content": complete(daemon, prompt=PROMPT, n_predict=4)["content"],
                   "generation_settings/n_predict": 4, "stop_type": "limit"}
    # Each of several, and the stream's summary (its token events stay whole).
    assert complete(daemon, prompt=["a", "b"], n_predict=2, response_fields=["index"]) == [{"index": 0}, {"index": 1}]
    *parts, final = events(daemon, "/completion", {"prompt": PROMPT, "n_predict": 4, "response_fields": ["stop", "timings/predicted_n"]})
    assert final == {"stop": True, "timings/predicted_n": 4} and all(p["stop"] is False for p in parts)
