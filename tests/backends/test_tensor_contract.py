"""One contract suite for every tensor backend, run against the real runtimes.

Each backend gets the same ONNX MLP built by tests/model_builders.py, under the artifact name it accepts, and
must give numpy's numbers, batch without changing any request's result, run two instances at the
same time on their own threads with the thread budget the daemon gave them, and fail cleanly once
unloaded. To add a backend: append its name to BACKENDS, its artifact name to ARTIFACT_FOR, and
how to read its per-instance thread setting back from a loaded instance to THREADS_OF.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cpu_limits import openvino_threads
from model_builders import build_mlp_onnx, mlp_reference

from daemon.backend import (
    Backend,
    Device,
    InferRequest,
    InferResponse,
    InstanceContext,
    TensorBackend,
)
from daemon.errors import EdgedError
from daemon.model_config import ModelConfig

pytest.importorskip("onnx")

ClassOf = Callable[[str], type[Backend]]

BACKENDS = ["onnxruntime", "openvino"]

# The file name each backend loads the ONNX model from.
ARTIFACT_FOR: dict[str, str] = {"onnxruntime": "model.onnx", "openvino": "model.onnx"}

# How many CPU threads a loaded instance's runtime was configured with.
THREADS_OF: dict[str, Callable[[Any], int]] = {
    "onnxruntime": lambda b: int(b.session.get_session_options().intra_op_num_threads),
    "openvino": lambda b: int(b.compiled_model.get_property("INFERENCE_NUM_THREADS")),
}

WIDTH, DEPTH = 16, 3


def mlp_model(
    tmp_path: Path, backend_name: str
) -> tuple[Path, list[tuple[np.ndarray, np.ndarray]]]:
    artifact = tmp_path / "mlp" / "1" / ARTIFACT_FOR[backend_name]
    weights = build_mlp_onnx(artifact, WIDTH, DEPTH, seed=5)
    return artifact, weights


async def loaded(
    cls: type[Backend], artifact: Path, *, index: int = 0, count: int = 1, threads: int = 1
) -> TensorBackend:
    config = cls.autocomplete(ModelConfig(name="mlp"), artifact)
    assert config.max_batch_size > 0, "an MLP with a dynamic first dimension must batch"
    backend = cls(
        InstanceContext("mlp", 1, instance_index=index, instance_count=count, threads=threads)
    )
    assert isinstance(backend, TensorBackend)
    await backend.load(config, artifact, Device("cpu"))
    return backend


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, WIDTH)).astype(np.float32)


def output_of(result: object) -> np.ndarray:
    assert isinstance(result, InferResponse), f"expected a response, got {result!r}"
    return result.outputs["OUTPUT0"]


def assert_matches(
    got: np.ndarray, x: np.ndarray, weights: list[tuple[np.ndarray, np.ndarray]]
) -> None:
    assert got.dtype == np.float32
    assert got.shape == x.shape
    # atol only for entries that land near zero, where a relative tolerance means nothing.
    np.testing.assert_allclose(got, mlp_reference(x, weights), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend_name", BACKENDS)
async def test_mlp_matches_numpy(backend_class: ClassOf, tmp_path: Path, backend_name: str) -> None:
    artifact, weights = mlp_model(tmp_path, backend_name)
    backend = await loaded(backend_class(backend_name), artifact)
    x = rows(5, seed=1)
    [result] = await backend.execute([InferRequest({"INPUT0": x})])
    await backend.unload()
    assert_matches(output_of(result), x, weights)


@pytest.mark.parametrize("backend_name", BACKENDS)
async def test_batched_equals_unbatched_per_request(
    backend_class: ClassOf, tmp_path: Path, backend_name: str
) -> None:
    artifact, weights = mlp_model(tmp_path, backend_name)
    backend = await loaded(backend_class(backend_name), artifact)
    requests = [InferRequest({"INPUT0": rows(n, seed=n)}, id=str(n)) for n in (1, 4, 2)]
    batched = await backend.execute(requests)
    alone = [(await backend.execute([r]))[0] for r in requests]
    await backend.unload()
    assert len(batched) == len(requests)
    for request, together, single in zip(requests, batched, alone, strict=True):
        x = request.inputs["INPUT0"]
        assert_matches(output_of(together), x, weights)
        np.testing.assert_allclose(output_of(together), output_of(single), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend_name", BACKENDS)
async def test_instances_use_their_threads_and_run_concurrently(
    backend_class: ClassOf, tmp_path: Path, backend_name: str
) -> None:
    artifact, weights = mlp_model(tmp_path, backend_name)
    cls = backend_class(backend_name)
    first = await loaded(cls, artifact, index=0, count=2, threads=1)
    second = await loaded(cls, artifact, index=1, count=2, threads=2)
    assert THREADS_OF[backend_name](first) == 1
    # OpenVINO caps the threads at the cores this machine has (1 in a 1-core container).
    assert THREADS_OF[backend_name](second) == (2 if backend_name != "openvino" else openvino_threads(2))

    # Each instance's work waits at a barrier for the other's: it passes only if both instances'
    # run_blocking calls are running at the same moment, on two different threads.
    barrier = threading.Barrier(2, timeout=20)
    x = rows(3, seed=9)

    def infer_together(backend: TensorBackend) -> tuple[str, np.ndarray]:
        barrier.wait()
        return threading.current_thread().name, backend.infer({"INPUT0": x})["OUTPUT0"]

    try:
        (thread_a, out_a), (thread_b, out_b) = await asyncio.gather(
            first.run_blocking(infer_together, first), second.run_blocking(infer_together, second)
        )
    finally:
        await first.unload()
        await second.unload()
    assert thread_a != thread_b
    assert threading.current_thread().name not in (thread_a, thread_b)
    assert_matches(out_a, x, weights)
    assert_matches(out_b, x, weights)


@pytest.mark.parametrize("backend_name", BACKENDS)
async def test_unload_then_execute_fails_cleanly(
    backend_class: ClassOf, tmp_path: Path, backend_name: str
) -> None:
    artifact, _ = mlp_model(tmp_path, backend_name)
    backend = await loaded(backend_class(backend_name), artifact)
    await backend.unload()
    requests = [
        InferRequest({"INPUT0": rows(1, seed=2)}),
        InferRequest({"INPUT0": rows(2, seed=3)}),
    ]
    # One error per request, not an exception out of execute and not a hang.
    results = await asyncio.wait_for(backend.execute(requests), timeout=20)
    assert len(results) == 2
    for result in results:
        assert isinstance(result, EdgedError)
        assert "mlp" in result.message
