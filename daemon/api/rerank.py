"""llama-server's reranking route: `POST /rerank` (also `/reranking`, `/v1/rerank` and
`/v1/reranking`) for reranker models (a GGUF whose pooling is rank, loaded with
`embedding=true`; llama-server's `--rerank`).

Jina's and Cohere's request, `{model, query, documents, top_n?}`, answers
`{model, object: "list", usage, results: [{index, relevance_score}]}`, the results sorted by
score (highest first) and cut to `top_n`; `return_text: true` adds each result's
`document: {text}` (Jina's and Cohere's shape; llama-server reads return_text only in the
other form). TEI's request, with `texts` in place of `documents`, answers TEI's bare list
`[{index, score}]` (`text` added with `return_text`), as llama-server does.

As on llama-server's other routes here (daemon.api.llama_native), the body names the model;
what llama-server ignores or answers oddly (an unknown field, a field of the wrong type, both
`documents` and `texts`, `top_n` below 1, an empty query) is a 400 naming the field, and so is
a model that is no reranker (llama-server's 501 "This server does not support reranking").
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from daemon.api.openai import decode_with, generation_model, request_body
from daemon.errors import InvalidArgument

_json = msgspec.json.Encoder()


class RerankRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    query: str
    # Jina's and Cohere's name for the texts to rank, or TEI's (its response shape follows).
    documents: list[str] | None = None
    texts: list[str] | None = None
    # llama-server's default: every document.
    top_n: int | None = None
    return_text: bool = False


_RERANK = msgspec.json.Decoder(RerankRequest)


async def rerank(request: web.Request) -> web.Response:
    req = decode_with(_RERANK, await request_body(request))
    if req.documents is not None and req.texts is not None:
        raise InvalidArgument("documents, texts: give one of them (Jina's documents or TEI's texts)")
    tei = req.texts is not None
    field, documents = ("texts", req.texts) if tei else ("documents", req.documents)
    if not documents:
        raise InvalidArgument(f"{field}: required, a non-empty list of texts to rank against the query")
    if not req.query:
        raise InvalidArgument("query: must not be empty")
    if req.top_n is not None and req.top_n < 1:
        raise InvalidArgument(f"top_n: must be at least 1, got {req.top_n}")
    model = await generation_model(request, req.model)
    scores, tokens = await model.rerank(req.query, documents)
    # Stable: equal scores keep the documents' order.
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[: req.top_n]
    label = "score" if tei else "relevance_score"
    results: list[dict[str, object]] = []
    for index in order:
        result: dict[str, object] = {"index": index, label: scores[index]}
        if req.return_text:
            result |= {"text": documents[index]} if tei else {"document": {"text": documents[index]}}
        results.append(result)
    if tei:
        return _ok(results)
    return _ok({
        "model": model.name,
        "object": "list",
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    })


def _ok(payload: object) -> web.Response:
    return web.Response(body=_json.encode(payload), content_type="application/json")


def add_routes(app: web.Application) -> None:
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        app.router.add_post(path, rerank)
