"""`Backend.run_blocking`: the instance's own thread, driven with real threads and asyncio."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import weakref

import numpy as np
import pytest

import daemon.backend
from daemon.backend import (
    Backend,
    BackendError,
    InferRequest,
    InferResponse,
    InstanceContext,
    TensorBackend,
    _InstanceThread,
)
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
