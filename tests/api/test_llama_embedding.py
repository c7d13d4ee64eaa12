"""llama-server's native POST /embedding (also /embeddings) against the daemon serving tiny
embedding GGUFs on llama.cpp: the vectors are /v1/embeddings' for the same tokens, renormalised
as `embd_normalize` asks; what edged cannot answer as llama-server does is a 400.
(tests/fixtures/oracle/llama_native.py asks llama-server the same.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from gguf_builder import write_tiny_llama

EMBEDDING = 'parameters { key: "embedding" value { string_value: "true" } }\n'


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    from support import start_daemon_process

    repo = tmp_path_factory.mktemp("embed-repo")
    # "unpooled" names no pooling in its GGUF: llama-server would embed it token by token.
    # "meaned" is that GGUF with the config's pooling mean: llama-server's --pooling mean.
    mean = EMBEDDING + 'parameters { key: "pooling" value { string_value: "mean" } }\n'
    models = (("embedder", 1, EMBEDDING), ("unpooled", None, EMBEDDING), ("meaned", None, mean), ("tiny", None, ""))
    for name, pooling, config in models:
        (repo / name / "1").mkdir(parents=True)
        write_tiny_llama(repo / name / "1" / "model.gguf", seed=2, pooling=pooling)
        (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n' + config)
    process = start_daemon_process(tmp_path_factory.mktemp("edged"), "--model-repository", str(repo), http=True)
    yield process
    process.stop()


def native(daemon: Any, content: Any, path: str = "/embedding", **options: Any) -> list[np.ndarray]:
    """The vectors /embedding answers, checking its shape: one pooled vector per prompt."""
    reply = daemon.post_ok(path, {"model": "embedder", "content": content, **options})
    assert [item["index"] for item in reply] == list(range(len(reply)))
    assert all(set(item) == {"index", "embedding"} and len(item["embedding"]) == 1 for item in reply)
    return [np.asarray(item["embedding"][0]) for item in reply]


def openai(daemon: Any, inputs: list[Any]) -> list[np.ndarray]:
    reply = daemon.post_ok("/v1/embeddings", {"model": "embedder", "input": inputs, "encoding_format": "float"})
    return [np.asarray(item["embedding"]) for item in reply["data"]]


def ids(daemon: Any, content: Any) -> list[int]:
    """The embedder's tokens for a prompt, as llama-server's /embedding tokenizes it (the BOS
    before a first text)."""
    return daemon.post_ok("/tokenize", {"model": "embedder", "content": content, "add_special": True})["tokens"]


def assert_vectors(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == (64,)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_text_is_the_v1_embeddings_vector(daemon: Any) -> None:
    want = openai(daemon, ["hello world"])
    assert_vectors(native(daemon, "hello world"), want)
    assert_vectors(native(daemon, "hello world", path="/embeddings"), want)  # the same handler
    reply = daemon.post_ok("/embedding", {"model": "embedder", "input": "hello world"})  # its other name
    assert_vectors([np.asarray(reply[0]["embedding"][0])], want)
    assert_vectors(native(daemon, "hello world", encoding_format="float"), want)
    assert np.isclose(np.linalg.norm(want[0]), 1.0)  # Euclidean, the default


def test_lists_of_prompts_and_token_ids(daemon: Any) -> None:
    texts = ["one", "two words", "three little words"]
    assert_vectors(native(daemon, texts), openai(daemon, texts))
    # A list holding an id is one prompt: texts and ids in order, the BOS before a first text only.
    mixed = ["hello", 300, " world"]
    assert len(native(daemon, mixed)) == 1
    assert_vectors(native(daemon, mixed), openai(daemon, [ids(daemon, mixed)]))
    assert_vectors(native(daemon, [300, "hello"]), openai(daemon, [ids(daemon, [300, "hello"])]))
    # Ids alone are embedded as they are: no BOS added.
    assert_vectors(native(daemon, ids(daemon, "hello world")), openai(daemon, ["hello world"]))
    assert_vectors(native(daemon, [300, 301]), openai(daemon, [[300, 301]]))
    # A list of prompts: texts, id lists and mixed lists side by side.
    prompts = ["one", [1, 300, 301], ["two", 5]]
    want = openai(daemon, ["one", [1, 300, 301], ids(daemon, ["two", 5])])
    assert_vectors(native(daemon, prompts), want)


@pytest.mark.parametrize("norm", [0, 1, 3, 7, 40])
def test_embd_normalize(daemon: Any, norm: int) -> None:
    texts = ["hello world", "two words"]
    for got, unit in zip(native(daemon, texts, embd_normalize=norm), openai(daemon, texts), strict=True):
        if norm == 0:
            # Scaled so that the largest magnitude is 32760 (llama-server's int16 range).
            want = unit * 32760.0 / np.max(np.abs(unit))
            assert np.isclose(np.max(np.abs(got)), 32760.0)
        else:
            want = unit / np.linalg.norm(unit, ord=norm)
            assert np.isclose(np.linalg.norm(got, ord=norm), 1.0)
        np.testing.assert_allclose(got, want, rtol=1e-9)


def test_embd_normalize_2_is_the_default(daemon: Any) -> None:
    assert_vectors(native(daemon, "hello", embd_normalize=2), native(daemon, "hello"))


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"content": "x", "embd_normalize": -1}, "embd_normalize"),  # raw vectors: not kept by the engine
        ({"content": "x", "embd_normalize": -3}, "embd_normalize"),
        ({"content": "x", "embd_normalize": 2.5}, "embd_normalize"),
        ({"content": "x", "encoding_format": "base64"}, "encoding_format"),  # llama-server ignores it here
        ({"content": "x", "input": "y"}, "input, content"),
        ({}, "content"),
        ({"content": []}, "content"),
        ({"input": []}, "input"),
        ({"content": [5, [6]]}, "content[1]"),
        ({"content": [{"prompt_string": "x"}]}, "content"),
        ({"content": "x", "n_predict": 3}, "n_predict"),  # an unknown field
        ({"content": [[1, 99999]]}, "content[0][1]: token id 99999 is out of range"),  # outside the vocabulary
        ({"input": [[1, 99999]]}, "input[0][1]: token id 99999 is out of range"),
    ],
)
def test_errors(daemon: Any, body: dict[str, Any], named: str) -> None:
    for path in ("/embedding", "/embeddings"):
        error = daemon.post_ok(path, {"model": "embedder", **body}, status=400)["error"]
        assert named in error["message"]
        assert error["type"] == "invalid_request_error"  # llama-server's (OpenAI's) error shape


def test_models_it_cannot_serve(daemon: Any) -> None:
    # No pooling: llama-server answers one vector per token, edged averages them; a 400 here...
    error = daemon.post_ok("/embedding", {"model": "unpooled", "content": "hi"}, status=400)["error"]
    assert "names no pooling" in error["message"]
    # ...and with the pooling named in its config the same GGUF is served: the vector
    # /v1/embeddings averages for it without.
    averaged = daemon.post_ok("/v1/embeddings", {"model": "unpooled", "input": "hi"})["data"][0]["embedding"]
    served = daemon.post_ok("/embedding", {"model": "meaned", "content": "hi"})
    np.testing.assert_allclose(served[0]["embedding"][0], averaged, rtol=1e-6, atol=1e-7)
    error = daemon.post_ok("/embedding", {"model": "tiny", "content": "hi"}, status=400)["error"]
    assert "embedding=true" in error["message"]
    assert daemon.post_ok("/embedding", {"model": "nope", "content": "hi"}, status=404)["error"]["type"] == "not_found_error"
    assert "model" in daemon.post_ok("/embedding", {"content": "hi"}, status=400)["error"]["message"]


def llamacpp_metrics(daemon: Any, model: str) -> dict[str, float]:
    text = daemon.request("GET", "/metrics").body.decode()
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llamacpp:") and f'{{model="{model}",version="1"}}' in line
    }


def test_llama_server_counters_count_embedding_decodes(daemon: Any) -> None:
    """As llama-server's: each input is a prompt decoded in a slot of its own."""
    before = llamacpp_metrics(daemon, "embedder")
    texts = ["one two three", "four", "five six seven eight nine"]
    reply = daemon.post_ok("/v1/embeddings", {"model": "embedder", "input": texts})
    after = llamacpp_metrics(daemon, "embedder")
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == reply["usage"]["prompt_tokens"]
    # The three fit the default four slots and one batch: one decode.
    assert after["llamacpp:n_decode_total"] - before["llamacpp:n_decode_total"] == 1
    assert after["llamacpp:n_tokens_max"] >= max(len(ids(daemon, text)) for text in texts)
    assert after["llamacpp:prompt_seconds_total"] > before["llamacpp:prompt_seconds_total"]
    assert after["llamacpp:tokens_predicted_total"] == before["llamacpp:tokens_predicted_total"]
