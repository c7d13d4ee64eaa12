"""The real `tritonclient.http` client (and its asyncio twin) against the daemon over TCP."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKEN = "test-token-0123456789abcdef"
# Admin routes over TCP need the bearer token (docs/security.md); tritonclient passes headers.
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def daemon(start_daemon, simple_repo: Path, tmp_path: Path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    config = tmp_path / "edged.toml"
    config.write_text(f'[server]\ntoken-file = "{token}"\n')
    return start_daemon("--config", str(config), "--model-repository", str(simple_repo),
                        "--model-control-mode", "explicit", "--load-model", "*", http=True)


@pytest.fixture
def client(daemon):
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}")
    yield client
    client.close()


def _inputs(binary: bool, rows: int = 1) -> tuple[list, np.ndarray, np.ndarray]:
    a = np.arange(16 * rows, dtype=np.int32).reshape(rows, 16)
    b = np.ones((rows, 16), dtype=np.int32) * 7
    inputs = [httpclient.InferInput("INPUT0", [rows, 16], "INT32"),
              httpclient.InferInput("INPUT1", [rows, 16], "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs, a, b


def test_server_and_model_metadata(client) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["name"] == "edged"
    assert client.is_model_ready("simple")
    meta = client.get_model_metadata("simple")
    assert [i["name"] for i in meta["inputs"]] == ["INPUT0", "INPUT1"]
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 8
    assert config["input"][0]["data_type"] == "TYPE_INT32"  # Triton's spelling
    assert config["version_policy"] == {"latest": {"num_versions": 1}}


@pytest.mark.parametrize("model", ["simple", "simple_python"])
@pytest.mark.parametrize("binary", [False, True])
def test_infer(client, model: str, binary: bool) -> None:
    inputs, a, b = _inputs(binary, rows=2)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)]
    result = client.infer(model, inputs, outputs=outputs, request_id="42")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.get_response()["id"] == "42"


def test_infer_gzip_and_output_subset(client) -> None:
    inputs, a, b = _inputs(True)
    result = client.infer("simple", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT1")],
                          request_compression_algorithm="gzip", response_compression_algorithm="gzip")
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_async_infer_many(client) -> None:
    jobs = []
    expected = []
    for rows in (1, 2, 3, 1, 4, 2):
        inputs, a, b = _inputs(True, rows)
        jobs.append(client.async_infer("simple", inputs))
        expected.append(a + b)
    for job, want in zip(jobs, expected, strict=True):
        np.testing.assert_array_equal(job.get_result().as_numpy("OUTPUT0"), want)


def test_repository_and_stats(client) -> None:
    names = {m["name"] for m in client.get_model_repository_index()}
    assert {"simple", "simple_python"} <= names
    with pytest.raises(InferenceServerException, match=r"\[401\] missing or wrong bearer token"):
        client.unload_model("simple_python")
    with pytest.raises(InferenceServerException, match=r"\[401\] missing or wrong bearer token"):
        client.unload_model("simple_python", headers={"Authorization": "Bearer wrong"})
    client.unload_model("simple_python", headers=ADMIN)
    assert not client.is_model_ready("simple_python")
    client.load_model("simple_python", headers=ADMIN)
    assert client.is_model_ready("simple_python")
    # A load with a config override, in Triton's JSON layout, as the client sends it.
    config = client.get_model_config("simple_python")
    config["max_batch_size"] = 4
    client.load_model("simple_python", config=json.dumps(config), headers=ADMIN)
    assert client.get_model_config("simple_python")["max_batch_size"] == 4
    with pytest.raises(InferenceServerException, match="max_batch_sizee"):
        client.load_model("simple_python", config=json.dumps({**config, "max_batch_sizee": 1}), headers=ADMIN)
    assert client.is_model_ready("simple_python")
    inputs, _, _ = _inputs(True)
    client.infer("simple", inputs)
    stats = client.get_inference_statistics("simple")
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] >= 1


def test_errors_surface_as_exceptions(client) -> None:
    inputs, _, _ = _inputs(True)
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("missing", inputs)
    bad = [httpclient.InferInput("INPUT0", [1, 16], "FP32"), httpclient.InferInput("INPUT1", [1, 16], "FP32")]
    bad[0].set_data_from_numpy(np.zeros((1, 16), np.float32))
    bad[1].set_data_from_numpy(np.zeros((1, 16), np.float32))
    with pytest.raises(InferenceServerException, match="INPUT0"):
        client.infer("simple", bad)


def test_the_asyncio_client(daemon) -> None:
    """tritonclient.http.aio (aiohttp underneath): the same routes from an asyncio program."""
    import asyncio

    aio = pytest.importorskip("tritonclient.http.aio")

    async def session() -> None:
        async with aio.InferenceServerClient(url=f"127.0.0.1:{daemon.http_port}") as aclient:
            assert await aclient.is_server_live() and await aclient.is_model_ready("simple")
            assert (await aclient.get_model_metadata("simple"))["name"] == "simple"
            for binary in (False, True):
                inputs, a, b = _inputs(binary, rows=3)
                outputs = [aio.InferRequestedOutput("OUTPUT0", binary_data=binary)]
                results = await asyncio.gather(*(
                    aclient.infer("simple", inputs, outputs=outputs, request_compression_algorithm=algorithm)
                    for algorithm in (None, "gzip", "deflate")
                ))
                for result in results:
                    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            await aclient.unload_model("simple_python", headers=ADMIN)
            assert not await aclient.is_model_ready("simple_python")
            await aclient.load_model("simple_python", headers=ADMIN)
            assert await aclient.is_model_ready("simple_python")
            stats = await aclient.get_inference_statistics("simple")
            assert stats["model_stats"][0]["inference_stats"]["success"]["count"] >= 6
            with pytest.raises(InferenceServerException, match="unknown model"):
                await aclient.infer("missing", _inputs(True)[0])

    asyncio.run(session())

