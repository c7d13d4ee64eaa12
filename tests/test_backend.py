"""`Backend.run_blocking`: the instance's own thread, driven with real threads and asyncio."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import threading
import time
import weakref

import msgspec
import numpy as np
import pytest

import daemon.backend
from daemon.backend import (
    NUMPY_DTYPES,
    Backend,
    BackendError,
    InferRequest,
    InferResponse,
    InstanceContext,
    RaggedPlan,
    TensorBackend,
    _InstanceThread,
    datatype_of,
)
from daemon.errors import InvalidArgument
from daemon.model_config import ModelConfig, TensorConfig


class Plain(Backend):
    name = "plain"


class Doubling(TensorBackend):
    name = "doubling"

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": inputs["x"] * 2, "rows": np.arange(len(inputs["x"]))}


def instance(index: int = 0) -> Backend:
    return Plain(InstanceContext("m", 1, instance_index=index))


async def test_calls_run_in_order_on_one_thread_of_their_own() -> None:
    backend = instance()
    seen: list[tuple[int, str]] = []

    def work(n: int, *, scale: int) -> int:
        seen.append((n, threading.current_thread().name))
        return n * scale

    try:
        # Far more calls than one wake-up each: the thread drains whatever is queued.
        results = await asyncio.gather(*(backend.run_blocking(work, n, scale=3) for n in range(500)))
    finally:
        await backend.unload()
    assert results == [n * 3 for n in range(500)]
    assert [n for n, _ in seen] == list(range(500))
    names = {name for _, name in seen}
    assert names == {"plain-m-0"}
    assert threading.current_thread().name not in names


async def test_errors_reach_the_caller() -> None:
    backend = instance()

    def fail() -> None:
        raise ValueError("bad input")

    def leave() -> None:
        raise SystemExit(3)

    def interrupt() -> None:
        raise KeyboardInterrupt("from a plugin")

    try:
        with pytest.raises(ValueError, match="bad input"):
            await backend.run_blocking(fail)
        # Re-raised on the event loop these would end the daemon: the caller gets an error.
        with pytest.raises(BackendError, match="leave raised SystemExit: 3"):
            await backend.run_blocking(leave)
        with pytest.raises(BackendError, match="interrupt raised KeyboardInterrupt: from a plugin"):
            await backend.run_blocking(interrupt)
        assert await backend.run_blocking(lambda: 7) == 7  # the thread lives on
    finally:
        await backend.unload()


async def test_a_call_cancelled_before_it_starts_never_runs() -> None:
    backend = instance()
    gate = threading.Event()
    entered = threading.Event()
    ran: list[str] = []

    def hold() -> str:
        entered.set()
        gate.wait(10)
        return "held"

    try:
        first = asyncio.create_task(backend.run_blocking(hold))
        assert await asyncio.to_thread(entered.wait, 10)
        second = asyncio.create_task(backend.run_blocking(ran.append, "second"))
        await asyncio.sleep(0)
        second.cancel()
        gate.set()
        assert await first == "held"
        with pytest.raises(asyncio.CancelledError):
            await second
        assert await backend.run_blocking(ran.append, "third") is None
    finally:
        gate.set()
        await backend.unload()
    assert ran == ["third"]


async def test_instances_run_in_parallel_and_unload_ends_the_thread() -> None:
    first, second = instance(0), instance(1)
    barrier = threading.Barrier(2, timeout=10)

    def meet() -> str:
        barrier.wait()  # passes only if both calls run at the same moment
        return threading.current_thread().name

    names = await asyncio.gather(first.run_blocking(meet), second.run_blocking(meet))
    assert names == ["plain-m-0", "plain-m-1"]
    threads = [t for t in threading.enumerate() if t.name in names]
    await first.unload()
    await second.unload()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="after shutdown"):
        await first.run_blocking(lambda: None)


async def test_the_thread_keeps_no_reference_to_a_finished_call() -> None:
    # A call's arguments may be views of a client's shared memory region, which stays mapped
    # while any view lives: once the call returned, the idle thread must hold none of them.
    backend = instance()

    class Payload:
        pass

    payload = Payload()
    gone = weakref.ref(payload)
    try:
        assert await backend.run_blocking(id, payload) == id(payload)
        del payload
        gc.collect()
        assert gone() is None
    finally:
        await backend.unload()


def test_shutdown_wakes_the_thread_before_it_can_close_the_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    # The race CI hit: the thread finishes its last call right after shutdown queued the end
    # marker, takes the marker and closes the pipe before shutdown's wake-up write. Here the
    # write itself lets the running call finish and gives the thread time to get that far.
    instance = _InstanceThread("race")
    release = threading.Event()
    finished = threading.Event()

    def last_call() -> None:
        release.wait(5)
        finished.set()

    instance.submit(last_call)
    real_write = os.write

    def write_after_the_call_finished(fd: int, data: bytes) -> int:
        release.set()
        finished.wait(5)
        time.sleep(0.05)  # the thread, unhindered, would now take the marker and close the pipe
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write_after_the_call_finished)
    instance.shutdown()  # raised OSError (EBADF) when the thread closed the pipe unlocked
    monkeypatch.setattr(os, "write", real_write)
    deadline = time.monotonic() + 5
    while any(thread.name == "race" for thread in threading.enumerate()):
        assert time.monotonic() < deadline, "the thread did not end after shutdown"
        time.sleep(0.01)


@pytest.mark.parametrize("width", [3, 40_000])
async def test_a_large_batch_is_merged_on_the_instance_thread(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    # Merging copies every request's input: for megabytes the event loop must not wait for it;
    # a small batch is merged on the loop (cheaper than contending for the GIL). Either way
    # each request gets its own rows back, as if it had run alone.
    merged_on: list[str] = []
    merge = daemon.backend.merge_batch

    def recording_merge(batch: object) -> object:
        merged_on.append(threading.current_thread().name)
        return merge(batch)  # type: ignore[arg-type]

    monkeypatch.setattr(daemon.backend, "merge_batch", recording_merge)
    backend = Doubling(InstanceContext("m", 1))
    backend.config = ModelConfig(
        name="m",
        max_batch_size=8,
        input=[TensorConfig(name="x", data_type="FP32", dims=[width])],
        output=[TensorConfig(name="y", data_type="FP32", dims=[width])],
    )
    rng = np.random.default_rng(5)
    batch = [
        InferRequest({"x": rng.standard_normal((rows, width)).astype(np.float32)}, requested_outputs=selected)
        for rows, selected in ((1, ()), (3, ("y",)), (2, ("rows",)))
    ]
    large = sum(r.inputs["x"].nbytes for r in batch) >= daemon.backend.OFF_LOOP_BYTES
    assert large == (width > 3)
    try:
        results = await backend.execute(batch)
    finally:
        await backend.unload()
    assert merged_on == ["doubling-m-0" if large else threading.current_thread().name]
    assert all(isinstance(result, InferResponse) for result in results)
    first, second, third = (result.outputs for result in results if isinstance(result, InferResponse))
    np.testing.assert_array_equal(first["y"], batch[0].inputs["x"] * 2)
    assert first["rows"].tolist() == [0]
    assert set(second) == {"y"}
    np.testing.assert_array_equal(second["y"], batch[1].inputs["x"] * 2)
    assert set(third) == {"rows"} and third["rows"].tolist() == [4, 5]
    input_ns, output_ns = backend.phase_ns
    assert input_ns > 0 and output_ns > 0


# ---------------------------------------------------------------------------- ragged batching


def _ragged_config(kind: str, data_type: str = "INT32") -> ModelConfig:
    return msgspec.convert({
        "name": "m", "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "FP32", "dims": [-1, -1], "allow_ragged_batch": True},
                  {"name": "w", "data_type": "FP32", "dims": [2]}],
        "output": [{"name": "y", "data_type": "FP32", "dims": [-1, -1]},
                   {"name": "z", "data_type": "FP32", "dims": [2]}],
        "batch_input": [{"kind": kind, "target_name": ["b", "b2"], "data_type": data_type, "source_input": ["x"]}],
        "batch_output": [{"target_name": ["y"], "source_input": ["x"]}],
    }, ModelConfig)


# Triton's example (model_config.proto): a request of two rows of shape [3, 1] and one of one
# row of shape [2, 2]: 6 and 4 elements.
RAGGED_BATCH = [
    InferRequest({"x": np.arange(6, dtype=np.float32).reshape(2, 3, 1), "w": np.ones((2, 2), np.float32)}),
    InferRequest({"x": np.arange(4, dtype=np.float32).reshape(1, 2, 2), "w": np.zeros((1, 2), np.float32)}),
]


@pytest.mark.parametrize(("kind", "data_type", "value"), [
    ("BATCH_ELEMENT_COUNT", "INT32", np.array([6, 4], np.int32)),
    ("BATCH_ELEMENT_COUNT", "FP32", np.array([6, 4], np.float32)),
    ("BATCH_ACCUMULATED_ELEMENT_COUNT", "INT32", np.array([6, 10], np.int32)),
    ("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", "INT32", np.array([0, 6, 10], np.int32)),
    ("BATCH_MAX_ELEMENT_COUNT_AS_SHAPE", "FP32", np.zeros(6, np.float32)),
    ("BATCH_ITEM_SHAPE", "INT32", np.array([[3, 1], [3, 1], [2, 2]], np.int32)),
    ("BATCH_ITEM_SHAPE_FLATTEN", "FP32", np.array([3, 1, 3, 1, 2, 2], np.float32)),
])
def test_ragged_merge_makes_tritons_batch_inputs(kind: str, data_type: str, value: np.ndarray) -> None:
    plan = RaggedPlan.of(_ragged_config(kind, data_type))
    assert plan is not None
    merged, sizes = plan.merge(RAGGED_BATCH)
    assert sizes == [2, 1]
    # The ragged input end to end in one dimension; the other along its batch dimension.
    np.testing.assert_array_equal(merged["x"], np.concatenate([np.arange(6), np.arange(4)]).astype(np.float32))
    assert merged["w"].shape == (3, 2)
    for target in ("b", "b2"):  # every target name gets it
        assert merged[target].dtype == value.dtype and merged[target].shape == value.shape
        np.testing.assert_array_equal(merged[target], value)


def test_ragged_split_scatters_by_the_source_shape_and_checks_sizes() -> None:
    plan = RaggedPlan.of(_ragged_config("BATCH_ELEMENT_COUNT"))
    assert plan is not None
    flat = np.arange(10, dtype=np.float32)
    first, second = plan.split({"y": flat * 3, "z": np.arange(6, dtype=np.float32).reshape(3, 2)}, RAGGED_BATCH, [2, 1])
    assert first["y"].shape == (2, 3, 1) and first["y"].ravel().tolist() == (flat[:6] * 3).tolist()
    assert second["y"].shape == (1, 2, 2) and second["y"].ravel().tolist() == (flat[6:] * 3).tolist()
    assert first["z"].tolist() == [[0, 1], [2, 3]] and second["z"].tolist() == [[4, 5]]
    with pytest.raises(BackendError, match="batch output 'y' has 9 elements, fewer than the batch's shapes of input 'x' need"):
        plan.split({"y": flat[:9], "z": np.zeros((3, 2), np.float32)}, RAGGED_BATCH, [2, 1])
    # Rows, not requests: an output of one row per request would hand them each other's.
    with pytest.raises(BackendError, match=r"output 'z' has shape \[2, 2\], but the batch it answers has 3 rows"):
        plan.split({"y": flat, "z": np.zeros((2, 2), np.float32)}, RAGGED_BATCH, [2, 1])


def test_a_config_without_ragged_batching_has_no_plan() -> None:
    assert RaggedPlan.of(ModelConfig(name="m", max_batch_size=4, input=[TensorConfig("x", "FP32", [2])])) is None


class Summing(TensorBackend):
    """A broken batched model: one row for the whole batch."""

    name = "summing"

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": inputs["x"].sum(axis=0, keepdims=True)}


async def test_a_merged_batch_answered_with_other_rows_fails_every_request() -> None:
    backend = Summing(InstanceContext("m", 1))
    backend.config = ModelConfig(name="m", max_batch_size=8, input=[TensorConfig("x", "FP32", [2])],
                                 output=[TensorConfig("y", "FP32", [2])])
    batch = [InferRequest({"x": np.ones((rows, 2), np.float32)}) for rows in (1, 2)]
    try:
        results = await backend.execute(batch)
    finally:
        await backend.unload()
    assert [str(r) for r in results] == [
        "output 'y' has shape [1, 2], but the batch it answers has 3 rows: a batched model must return one row "
        "per input row"] * 2


@pytest.mark.parametrize("datatype", sorted(set(NUMPY_DTYPES) - {"BF16", "BYTES"}))
def test_each_fixed_size_datatype_is_read_back_from_its_dtype(datatype: str) -> None:
    assert datatype_of(np.zeros(2, NUMPY_DTYPES[datatype])) == datatype
    # Another spelling of the same dtype (numpy's type character) is the same datatype.
    assert datatype_of(np.zeros(2, NUMPY_DTYPES[datatype].char)) == datatype


def test_text_and_objects_are_bytes_and_uint16_is_not_bf16() -> None:
    for dtype in (object, "S3", "U2"):
        assert datatype_of(np.zeros(2, dtype)) == "BYTES"
    assert datatype_of(np.zeros(2, np.uint16)) == "UINT16"  # BF16 travels as uint16 bits


@pytest.mark.parametrize("dtype", [np.complex64, np.dtype(">i4") if np.little_endian else np.dtype("<i4"), "V4", "M8[s]"])
def test_a_dtype_kserve_cannot_carry_is_refused_by_name(dtype: object) -> None:
    array = np.zeros(2, dtype)  # type: ignore[call-overload]
    with pytest.raises(InvalidArgument, match=f"unsupported numpy dtype {re.escape(str(array.dtype))}"):
        datatype_of(array)
