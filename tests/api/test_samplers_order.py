"""llama-server's `samplers` (the order of the sampler chain) on the OpenAI routes, against a
tiny GGUF on llama.cpp: the request's names and codes (daemon/api/sampling.sampler_order), and
the chain the engine builds from them (GenerateParams.samplers). The texts are compared with
each other, never with a capture (tests/fixtures/oracle/samplers.py compares with llama-server).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from daemon.api.sampling import sampler_order
from daemon.backend import DEFAULT_SAMPLERS
from daemon.errors import InvalidArgument

DEFAULT_NAMES = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
NAMES = "penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature, infill"
ALIASES = " (also spelt with '-' for '_' or without it, e.g. top-k or topk; nucleus, temp, typ)"
NO_ADAPTIVE = "it needs adaptive_target, which this server does not take"
CODES = (
    "e (penalties), d (dry), s (top_n_sigma), k (top_k), y (typ_p), p (top_p), m (min_p), x (xtc), "
    "t (temperature), i (infill)"
)


# ------------------------------------------------------------------ the request's value


def test_names_codes_and_aliases_as_llama_cpp_reads_them() -> None:
    assert sampler_order(None) == DEFAULT_SAMPLERS == tuple(DEFAULT_NAMES)
    assert sampler_order(DEFAULT_NAMES) == DEFAULT_SAMPLERS
    assert sampler_order("edskypmxt") == DEFAULT_SAMPLERS  # llama-server's --sampler-seq default
    # common_sampler_types_from_names: any case, '-' for '_' or neither, and three aliases.
    assert sampler_order(["Top-K", "TOPP", "nucleus", "temp", "typ", "typ-p", "Min-P", "topnsigma", "XTC"]) == (
        "top_k", "top_p", "top_p", "temperature", "typ_p", "typ_p", "min_p", "top_n_sigma", "xtc",
    )
    # Repeats stay (each runs again), the order is the list's.
    assert sampler_order("tkkt") == ("temperature", "top_k", "top_k", "temperature")
    assert sampler_order(["infill", "penalties", "dry"]) == ("infill", "penalties", "dry")
    # llama-server's own reading of an empty list or string: no sampler but the draw.
    assert sampler_order([]) == sampler_order("") == ()


@pytest.mark.parametrize(("value", "message"), [
    # llama.cpp only lowercases ASCII: the Kelvin sign is no 'k' there.
    (["top_k", "top_\u212a"], "samplers[1]: unknown sampler 'top_\u212a'; the samplers are " + NAMES),
    # "typical_p" is the field's name, not a sampler name (that is typ_p).
    (["typical_p"], "samplers[0]: unknown sampler 'typical_p'; the samplers are " + NAMES),
    (["k"], "samplers[0]: unknown sampler 'k'; the samplers are " + NAMES),
    ("kT", "samplers[1]: unknown sampler code 'T' in 'kT'; the codes are " + CODES),
])
def test_an_unknown_sampler_is_named(value: list[str] | str, message: str) -> None:
    """llama-server drops what it does not know (a log line only); here it is refused."""
    with pytest.raises(InvalidArgument) as raised:
        sampler_order(value)
    assert str(raised.value) == message + (ALIASES if isinstance(value, list) else "")


# ------------------------------------------------------------------ the chain, end to end


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("llama_cpp")
    from gguf_builder import write_tiny_llama

    from support import start_daemon_process

    repo = tmp_path_factory.mktemp("samplers-repo")
    (repo / "tiny" / "1").mkdir(parents=True)
    write_tiny_llama(repo / "tiny" / "1" / "model.gguf", seed=1, n_ctx=1024)
    (repo / "tiny" / "config.pbtxt").write_text(
        'backend: "llamacpp"\n'
        'parameters { key: "n_parallel" value { string_value: "2" } }\n'
        'parameters { key: "n_ctx" value { string_value: "2048" } }\n'
    )
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


def bad_request() -> type[Exception]:
    return pytest.importorskip("openai").BadRequestError


PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
SEEDS = range(6)


def texts(client: Any, extra: dict[str, Any], **fields: Any) -> list[str]:
    """One seeded completion per seed of SEEDS."""
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 1.2, **fields}
    return [
        client.completions.create(**request, seed=seed, extra_body=extra).choices[0].text for seed in SEEDS
    ]


def test_the_default_order_is_the_chain_without_the_field(client: Any) -> None:
    """The field absent, null, the default order as names or as codes: the same chain, seed for
    seed; with every sampler of the default order on, and greedy at temperature 0."""
    busy = {"repeat_penalty": 1.3, "presence_penalty": 0.5, "dry_multiplier": 0.8, "top_n_sigma": 2.0,
            "typical_p": 0.9, "top_p": 0.9, "min_p": 0.02, "xtc_probability": 0.5, "xtc_threshold": 0.1}
    for extra in ({}, busy):
        plain = texts(client, extra)
        assert len(set(plain)) > 1
        for order in (None, DEFAULT_NAMES, "edskypmxt"):
            assert texts(client, {**extra, "samplers": order}) == plain, (extra, order)
    greedy = texts(client, {}, temperature=0)
    assert len(set(greedy)) == 1
    assert texts(client, {"samplers": "edskypmxt"}, temperature=0) == greedy


def test_order_changes_the_text_only_where_it_must(client: Any) -> None:
    """The temperature rescales the logits without reordering them: before or after top-k it
    leaves the same candidates with the same probabilities, seed for seed. Top-p and min-p
    measure probabilities, which the temperature changes: before them or after, other texts."""
    assert texts(client, {"top_k": 5, "samplers": "kt"}) == texts(client, {"top_k": 5, "samplers": "tk"})
    top_p = {"top_k": 0, "min_p": 0, "top_p": 0.8}
    assert texts(client, {**top_p, "samplers": "pt"}) != texts(client, {**top_p, "samplers": "tp"})
    min_p = {"top_k": 0, "min_p": 0.1, "top_p": 1.0}
    assert texts(client, {**min_p, "samplers": "mt"}) != texts(client, {**min_p, "samplers": "tm"})


def test_top_k_1_first_is_greedy_whatever_follows(client: Any) -> None:
    greedy = texts(client, {}, temperature=0)[0]
    hot = {"top_k": 1, "min_p": 0, "top_p": 1.0, "xtc_probability": 1.0, "xtc_threshold": 0.0}
    for order in ("kt", "kxtpm", ["top_k", "temperature", "top_p", "typ_p", "xtc"]):
        assert set(texts(client, {**hot, "samplers": order}, temperature=2.0)) == {greedy}, order
    # top-k 1 last: the temperature and XTC (threshold 0: every token but the least likely
    # goes) come first, and the text is no longer the greedy one.
    assert greedy not in texts(client, {**hot, "samplers": "xtk"}, temperature=2.0)


def test_temperature_0_acts_where_temperature_stands(client: Any) -> None:
    """As in llama-server: temperature 0 keeps the best token left where "temperature" is
    listed (after top-k: the greedy text); not listed, it changes nothing. An empty list
    keeps no sampler at all: a draw from the model's own distribution, whatever the
    temperature."""
    greedy = texts(client, {}, temperature=0)
    assert texts(client, {"samplers": "kt"}, temperature=0) == greedy
    assert texts(client, {"samplers": ["temperature", "top_k"]}, temperature=0) == greedy
    unlisted = texts(client, {"samplers": ["top_k"]}, temperature=0)
    assert len(set(unlisted)) > 1 and unlisted == texts(client, {"samplers": ["top_k"]}, temperature=1.7)
    raw = texts(client, {"samplers": []}, temperature=0)
    assert len(set(raw)) > 1
    assert raw == texts(client, {"samplers": ""}, temperature=1.7) == texts(client, {"samplers": [], "top_k": 1})


def test_a_sampler_not_listed_does_not_run(client: Any) -> None:
    """The penalties run where "penalties" stands and nowhere else (llama-server's default
    list holds them; a list without them has none), as every other sampler."""
    repeat = {"repeat_penalty": 1.5, "repeat_last_n": 64}
    plain = texts(client, {"samplers": "kt"}, temperature=0)
    assert texts(client, {**repeat, "samplers": "kt"}, temperature=0) == plain
    penalised = texts(client, {**repeat, "samplers": "ekt"}, temperature=0)
    assert penalised != plain
    # After top-k the penalties pick among its 40 (here the same text); after the temperature
    # (0: only the best token is left) they change nothing.
    assert texts(client, {**repeat, "samplers": "ket"}, temperature=0) == penalised
    assert texts(client, {**repeat, "samplers": "kte"}, temperature=0) == plain
    assert texts(client, {"top_k": 1, "samplers": "t"}) == texts(client, {"samplers": "t"})


def test_mirostat_ignores_the_order(client: Any) -> None:
    """llama-server's Mirostat is the temperature, then Mirostat, whatever `samplers` says."""
    miro = {"mirostat": 2}
    assert texts(client, {**miro, "samplers": "k", "top_k": 1}) == texts(client, miro)


def test_the_chat_route_and_a_grammar(client: Any) -> None:
    """The chat route takes the field too; a grammar (here json_object's) still holds with
    no truncating sampler at all."""
    messages = [{"role": "user", "content": "Hi"}]
    greedy = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    ordered = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=1.5, seed=1,
        extra_body={"samplers": "kt", "top_k": 1},
    )
    assert ordered.choices[0].message.content == greedy.choices[0].message.content
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, seed=seed, response_format={"type": "json_object"},
            extra_body={"samplers": ["temperature"]},
        )
        assert reply.choices[0].message.content.startswith("{")


def test_infill_runs_where_listed_and_not_with_a_grammar(client: Any) -> None:
    """llama.cpp's fill-in-the-middle sampler may end the output itself (an end-of-text token
    when no token stands out), whatever a grammar or ignore_eos allow: with them, a 400."""
    assert len(texts(client, {"samplers": "kti"})) == len(SEEDS)
    message = "samplers: infill cannot be used together with grammar, json_schema, tool_calls or ignore_eos"
    with pytest.raises(bad_request(), match=re.escape(message)):
        client.completions.create(
            model="tiny", prompt="x", max_tokens=2, extra_body={"samplers": "ki", "ignore_eos": True}
        )
    with pytest.raises(bad_request(), match=re.escape(message)):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
            response_format={"type": "json_object"}, extra_body={"samplers": ["infill"]},
        )


@pytest.mark.parametrize(("samplers", "message"), [
    (["top_k", "bogus"], "samplers[1]: unknown sampler 'bogus'; the samplers are " + NAMES + ALIASES),
    ("kz", "samplers[1]: unknown sampler code 'z' in 'kz'; the codes are " + CODES),
    (["adaptive-p"], "samplers[0]: 'adaptive-p' (adaptive-p) is not offered: " + NO_ADAPTIVE),
    ("mta", "samplers[2]: 'a' (adaptive-p) is not offered: " + NO_ADAPTIVE),
    (7, "Expected `str | array | null`, got `int` - at `$.samplers`"),
    (["top_k", 1], "Expected `str`, got `int` - at `$.samplers[1]`"),
])
def test_a_bad_samplers_value_is_a_400(client: Any, samplers: Any, message: str) -> None:
    for create, fields in (
        (client.completions.create, {"prompt": "x"}),
        (client.chat.completions.create, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        with pytest.raises(bad_request(), match=re.escape(message)):
            create(model="tiny", max_tokens=1, **fields, extra_body={"samplers": samplers})


def test_mirostat_still_checks_the_names(client: Any) -> None:
    with pytest.raises(bad_request(), match=re.escape("samplers[0]: unknown sampler 'top';")):
        client.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"mirostat": 2, "samplers": ["top"]}
        )


def test_top_p_0_keeps_the_best_token(client: Any) -> None:
    """top_p 0 keeps the min_keep best tokens (one), as llama.cpp's top-p does in llama-server's
    chain: the text at any temperature is the greedy one. It was taken as "top-p off"."""
    greedy = texts(client, {}, temperature=0)
    assert texts(client, {}, top_p=0.0) == greedy
    assert texts(client, {}, top_p=0.0, temperature=2.0) == greedy != texts(client, {}, temperature=2.0)
