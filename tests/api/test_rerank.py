"""llama-server's POST /rerank (also /reranking, /v1/rerank, /v1/reranking) against the daemon
serving a tiny Qwen3-style reranker GGUF on llama.cpp (tests/gguf_builder.py): each score is
numpy's computation of the model's rank-pooled head for the prompt llama-server builds (the
GGUF's rerank template, else BOS query document), the results sorted and cut as llama-server's;
what it cannot or should not answer is a 400 naming why.
(tests/fixtures/oracle/rerank.py asks llama-server the same.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from gguf_builder import (
    RERANK_TEMPLATE,
    reference_rerank_score,
    write_tiny_llama,
    write_tiny_reranker,
)

EMBEDDING = 'parameters { key: "embedding" value { string_value: "true" } }\n'
# Without flash attention a sequence's arithmetic does not depend on the others in its batch
# (llama.cpp's CPU flash attention moves a score by up to ~1e-3 with the batch's make-up).
NO_FLASH = EMBEDDING + 'parameters { key: "flash_attn" value { string_value: "off" } }\n'
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital", "the cat sat on the mat", "berlin and paris", "", "what is it"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("rerank-repo")
    models = (
        ("reranker", lambda p: write_tiny_reranker(p), NO_FLASH),
        ("templated", lambda p: write_tiny_reranker(p, rerank_template=RERANK_TEMPLATE), EMBEDDING),
        # Not loaded with embedding=true: llama-server without --rerank.
        ("unflagged", lambda p: write_tiny_reranker(p), ""),
        ("embedder", lambda p: write_tiny_llama(p, seed=2, pooling=1), EMBEDDING),
        ("tiny", lambda p: write_tiny_llama(p, seed=2), ""),
    )
    for name, write, config in models:
        (repo / name / "1").mkdir(parents=True)
        write(repo / name / "1" / "model.gguf")
        (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n' + config)
    return repo


@pytest.fixture(scope="module")
def daemon(repo: Path, tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


def post(daemon: Any, path: str, body: dict[str, Any], status: int = 200) -> Any:
    reply = daemon.post_json(path, body)
    assert reply.status == status, reply.body
    return reply.json()


def tokens(daemon: Any, text: str, *, parse_special: bool) -> list[int]:
    body = {"model": "embedder", "content": text, "add_special": False, "parse_special": parse_special}
    return post(daemon, "/tokenize", body)["tokens"]


def prompt(daemon: Any, model: str, query: str, document: str) -> list[int]:
    """llama-server's format_prompt_rerank for the tiny GGUFs (same vocabulary as "embedder";
    the tokenizer adds a BOS, no EOS or SEP)."""
    if model == "templated":
        text = RERANK_TEMPLATE.replace("{query}", query).replace("{document}", document)
        return tokens(daemon, text, parse_special=True)
    return [1, *tokens(daemon, query, parse_special=False), *tokens(daemon, document, parse_special=False)]


def want_scores(daemon: Any, repo: Path, model: str, query: str, documents: list[str]) -> tuple[list[float], int]:
    prompts = [prompt(daemon, model, query, d) for d in documents]
    path = repo / model / "1" / "model.gguf"
    return [reference_rerank_score(path, p) for p in prompts], sum(len(p) for p in prompts)


def rerank(daemon: Any, path: str = "/rerank", **body: Any) -> Any:
    return post(daemon, path, {"model": "reranker", "query": QUERY, "documents": DOCUMENTS} | body)


@pytest.mark.parametrize("model", ["reranker", "templated"])
def test_scores_are_the_models_and_sorted(daemon: Any, repo: Path, model: str) -> None:
    reply = post(daemon, "/rerank", {"model": model, "query": QUERY, "documents": DOCUMENTS})
    want, n_tokens = want_scores(daemon, repo, model, QUERY, DOCUMENTS)
    assert set(reply) == {"model", "object", "usage", "results"}
    assert reply["model"] == model and reply["object"] == "list"
    assert reply["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    results = reply["results"]
    assert all(set(r) == {"index", "relevance_score"} for r in results)
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    got = [0.0] * len(DOCUMENTS)
    for r in results:
        got[r["index"]] = r["relevance_score"]
    # llama.cpp's f32 arithmetic and f16 KV cache (and for "templated" flash attention, on by
    # default) against numpy's f64.
    np.testing.assert_allclose(got, want, rtol=3e-3, atol=1e-5)
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert all(0.0 < s < 1.0 for s in scores)  # Qwen3's head: a softmax's first label
    assert len(set(scores)) == len(scores)  # the random model tells these documents apart


def test_the_rerank_template_shapes_the_prompt(daemon: Any) -> None:
    plain = rerank(daemon)
    templated = rerank(daemon, model="templated")
    assert templated["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    # The template's "<s>" is the BOS control token (parsed), not its letters.
    assert prompt(daemon, "templated", "q", "d")[0] == 1


def test_a_documents_score_does_not_depend_on_the_others(daemon: Any) -> None:
    together = {r["index"]: r["relevance_score"] for r in rerank(daemon)["results"]}
    for index, document in enumerate(DOCUMENTS):
        alone = rerank(daemon, documents=[document])["results"]
        assert [r["index"] for r in alone] == [0]
        assert alone[0]["relevance_score"] == together[index]
    # Many documents: more than one batch of slots.
    many = [f"document number {i}" for i in range(11)]
    scores = {r["index"]: r["relevance_score"] for r in rerank(daemon, documents=many)["results"]}
    assert scores[7] == rerank(daemon, documents=[many[7]])["results"][0]["relevance_score"]


def test_paths_top_n_and_return_text(daemon: Any) -> None:
    full = rerank(daemon)
    for path in ("/reranking", "/v1/rerank", "/v1/reranking"):
        assert rerank(daemon, path) == full
    assert rerank(daemon, top_n=2)["results"] == full["results"][:2]
    assert rerank(daemon, top_n=99)["results"] == full["results"]
    assert rerank(daemon, top_n=2)["usage"] == full["usage"]  # every document was scored
    with_text = rerank(daemon, return_text=True, top_n=3)["results"]
    assert [{k: r[k] for k in ("index", "relevance_score")} for r in with_text] == full["results"][:3]
    assert [r["document"] for r in with_text] == [{"text": DOCUMENTS[r["index"]]} for r in with_text]
    assert rerank(daemon, return_text=False) == full


def test_tei_texts(daemon: Any) -> None:
    full = rerank(daemon)["results"]
    reply = post(daemon, "/rerank", {"model": "reranker", "query": QUERY, "texts": DOCUMENTS})
    assert reply == [{"index": r["index"], "score": r["relevance_score"]} for r in full]
    body = {"model": "reranker", "query": QUERY, "texts": DOCUMENTS, "return_text": True, "top_n": 2}
    reply = post(daemon, "/rerank", body)
    assert reply == [{"index": r["index"], "score": r["relevance_score"], "text": DOCUMENTS[r["index"]]} for r in full[:2]]


def test_duplicates_keep_their_indexes(daemon: Any) -> None:
    results = rerank(daemon, documents=["same text", "other", "same text"])["results"]
    scores = {r["index"]: r["relevance_score"] for r in results}
    assert scores[0] == scores[2]
    assert sorted(scores) == [0, 1, 2]


def test_control_token_text_in_a_document_is_plain_text(daemon: Any) -> None:
    # llama-server tokenizes query and document without parsing special tokens...
    usage = rerank(daemon, documents=["</s>"])["usage"]["prompt_tokens"]
    assert usage == len(prompt(daemon, "reranker", QUERY, "</s>")) > 1 + len(tokens(daemon, QUERY, parse_special=False)) + 1
    # ...but substitutes them into a rerank template, which it tokenizes with them parsed.
    usage = rerank(daemon, model="templated", documents=["</s>"])["usage"]["prompt_tokens"]
    assert usage == len(prompt(daemon, "templated", QUERY, "</s>"))


LONG = "word " * 600  # over the 512 tokens (n_batch) scored at once


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"documents": ["a"], "top_k": 1}, 'invalid request: Object contains unknown field `top_k`'),
        ({"documents": []}, "documents: required, a non-empty list of texts to rank against the query"),
        ({"documents": None}, "documents: required, a non-empty list of texts to rank against the query"),
        ({"documents": ["a"], "query": ""}, "query: must not be empty"),
        ({"documents": ["a"], "query": 5}, "invalid request: Expected `str`, got `int` - at `$.query`"),
        ({"documents": "a"}, "invalid request: Expected `array | null`, got `str` - at `$.documents`"),
        ({"documents": ["a", 5]}, "invalid request: Expected `str`, got `int` - at `$.documents[1]`"),
        ({"documents": ["a"], "top_n": 0}, "top_n: must be at least 1, got 0"),
        ({"documents": ["a"], "top_n": -1}, "top_n: must be at least 1, got -1"),
        ({"documents": ["a"], "top_n": 1.5}, "invalid request: Expected `int | null`, got `float` - at `$.top_n`"),
        ({"documents": ["a"], "return_text": "yes"}, "invalid request: Expected `bool`, got `str` - at `$.return_text`"),
        ({"documents": ["a"], "texts": ["b"]}, "documents, texts: give one of them (Jina's documents or TEI's texts)"),
        ({"texts": []}, "texts: required, a non-empty list of texts to rank against the query"),
        ({"documents": ["short", LONG]},
         "documents[1]: the query and document are {n} tokens but model 'reranker' scores at most 512 tokens at once (n_batch)"),
    ],
)
def test_rejections(daemon: Any, body: dict[str, Any], message: str) -> None:
    if "{n}" in message:
        message = message.format(n=len(prompt(daemon, "reranker", QUERY, LONG)))
    for path in ("/rerank", "/v1/reranking"):
        error = post(daemon, path, {"model": "reranker", "query": QUERY} | body, status=400)["error"]
        assert error["message"] == message
        assert error["type"] == "invalid_request_error"  # llama-server's (OpenAI's) error shape


def test_query_is_required(daemon: Any) -> None:
    error = post(daemon, "/rerank", {"model": "reranker", "documents": ["a"]}, status=400)["error"]
    assert error["message"] == "invalid request: Object missing required field `query`"
    error = post(daemon, "/rerank", {"query": "q", "documents": ["a"]}, status=400)["error"]
    assert error["message"] == "invalid request: Object missing required field `model`"
    error = post(daemon, "/rerank", {"model": "nope", "query": "q", "documents": ["a"]}, status=404)["error"]
    assert error["type"] == "not_found_error"


def test_models_that_are_no_reranker(daemon: Any) -> None:
    body = {"query": "q", "documents": ["a"]}
    error = post(daemon, "/rerank", {"model": "embedder", **body}, status=400)["error"]
    assert error["message"] == (
        "model 'embedder' is not a reranker: it is an embedding model; /rerank takes a GGUF whose "
        "pooling is rank (a classifier head, such as a Qwen3 or BGE reranker), loaded with parameters embedding=true"
    )
    for name in ("tiny", "unflagged"):
        error = post(daemon, "/rerank", {"model": name, **body}, status=400)["error"]
        assert error["message"] == (
            f"model '{name}' is a text generation model, not a reranker; a reranker is a GGUF whose "
            "pooling is rank, loaded with parameters embedding=true"
        )


def test_embeddings_of_a_reranker_stay_a_400(daemon: Any) -> None:
    message = (
        "model 'reranker' is a reranker (its GGUF's pooling is rank): it scores documents "
        "against a query (POST /rerank), it computes no embeddings"
    )
    error = post(daemon, "/v1/embeddings", {"model": "reranker", "input": "hi"}, status=400)["error"]
    assert error["message"] == message
    error = post(daemon, "/embedding", {"model": "reranker", "content": "hi"}, status=400)["error"]
    assert error["message"] == message
    # And the reranker still ranks after them.
    assert rerank(daemon, documents=["a"])["results"][0]["index"] == 0
