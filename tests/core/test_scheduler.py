"""The tensor schedulers, driven with real asyncio and a real (tiny, numpy) tensor backend.

The backend below is a genuine `TensorBackend` subclass: it computes `x @ W + b` in numpy and
records what it was given. Gates (threading.Event) hold an instance busy so a test can decide
what is queued while it works, instead of racing against wall-clock time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from daemon.backend import (
    Capabilities,
    ExecuteResult,
    InferRequest,
    InferResponse,
    InstanceContext,
    TensorBackend,
)
from daemon.core.scheduler import (
    DynamicBatcher,
    InstanceScheduler,
    Scheduler,
    make_scheduler,
    ready_queue,
)
from daemon.core.stats import MetricsRegistry, ModelStats
from daemon.errors import BackendError, QueueTimeout, Unavailable
from daemon.model_config import ModelConfig, config_from_mapping


class Linear(TensorBackend):
    """y = x @ W + b with integer-valued float64 weights, so every result is exact."""

    name = "test-linear"

    def load_sync(self, config: ModelConfig, artifact: Path, device: str) -> None:
        rng = np.random.default_rng(7)
        self.weight = rng.integers(-5, 6, size=(4, 3)).astype(np.float64)
        self.bias = rng.integers(-5, 6, size=3).astype(np.float64)
        # Rows per runtime call, and the id (x[:, 0]) of every row, in execution order.
        self.batches: list[int] = []
        self.seen: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        # execute() calls that have returned their results to the scheduler.
        self.executed = 0
        # The asyncio task that called execute(), per call: the request's own task when it
        # ran directly, a scheduler worker's when it went through the queue.
        self.callers: list[asyncio.Task[Any] | None] = []

    def compute(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x @ self.weight + self.bias}

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        self.batches.append(int(x.shape[0]))
        self.seen.extend(int(v) for v in x[:, 0])
        self.entered.set()
        if not self.gate.wait(10):
            raise RuntimeError("test gate never opened")
        return self.compute(x)

    async def execute(self, batch: Sequence[InferRequest]) -> list[ExecuteResult]:
        self.callers.append(asyncio.current_task())
        results = await super().execute(batch)
        self.executed += 1
        return results

    def expected(self, x: np.ndarray) -> np.ndarray:
        return x @ self.weight + self.bias


class Scale(Linear):
    """Elementwise, so requests may differ in their non-batch dims."""

    def compute(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x * 3 - 1}


class Exploding(Linear):
    """execute() itself raises when a request carries NaN: a broken backend."""

    async def execute(self, batch: Sequence[InferRequest]) -> list[ExecuteResult]:
        if any(np.isnan(r.inputs["x"]).any() for r in batch):
            raise RuntimeError("boom")
        return await super().execute(batch)


class Interrupting(Linear):
    """execute() raises a BaseException that is no Exception (a model's KeyboardInterrupt or
    its own subclass): once, it ended the scheduler's worker task for good."""

    async def execute(self, batch: Sequence[InferRequest]) -> list[ExecuteResult]:
        if any(np.isnan(r.inputs["x"]).any() for r in batch):
            raise KeyboardInterrupt("boom")
        return await super().execute(batch)


class NoMerge(Linear):
    capabilities = Capabilities(dynamic_batching=False)


class Queued(Linear):
    """Declares what TensorBackend's execute does: its runtime calls queue on one thread."""

    capabilities = Capabilities(queued_execute=True)


class QueuedNoMerge(Linear):
    capabilities = Capabilities(dynamic_batching=False, queued_execute=True)


def make_config(max_batch_size: int = 8, batching: dict[str, Any] | None = None, width: int = 4) -> ModelConfig:
    dims = [width] if max_batch_size > 0 else [1, width]
    data: dict[str, Any] = {
        "name": "m",
        "max_batch_size": max_batch_size,
        "input": [{"name": "x", "data_type": "TYPE_FP64", "dims": dims}],
        "output": [{"name": "y", "data_type": "TYPE_FP64", "dims": [-1]}],
    }
    if batching is not None:
        data["dynamic_batching"] = batching
    return config_from_mapping(data, source="test")


def rows(ident: int, count: int = 1, width: int = 4, dtype: Any = np.float64) -> np.ndarray:
    """`count` random integer rows whose first column is `ident` (the backend logs it)."""
    x = np.random.default_rng(ident).integers(-9, 10, size=(count, width)).astype(dtype)
    x[:, 0] = ident
    return x


def req(ident: int, count: int = 1, **kwargs: Any) -> InferRequest:
    fields = {k: kwargs.pop(k) for k in ("priority", "timeout_us") if k in kwargs}
    return InferRequest({"x": rows(ident, count, **kwargs)}, **fields)


async def settle() -> None:
    """Let every ready task run until it blocks (submits reach the queue)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def wait_thread_event(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 10), "the backend never started"


Harness = Callable[..., Awaitable[tuple[Scheduler, list[Linear], ModelStats]]]


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    """Build scheduler + loaded instances; at teardown open gates, stop and unload."""
    built: list[tuple[Scheduler, list[Linear]]] = []
    metrics = MetricsRegistry()

    async def build(
        config: ModelConfig, count: int = 1, cls: type[Linear] = Linear, overlap: bool = False
    ) -> tuple[Scheduler, list[Linear], ModelStats]:
        instances: list[Linear] = []
        for index in range(count):
            instance = cls(InstanceContext("m", 1, index, count))
            await instance.load(config, tmp_path, "CPU")
            instances.append(instance)
        stats = ModelStats("m", "1", metrics)
        scheduler = make_scheduler(config, instances, stats, overlap=overlap)
        await scheduler.start()
        built.append((scheduler, instances))
        return scheduler, instances, stats

    yield build
    for scheduler, instances in built:
        for instance in instances:
            instance.gate.set()
        await scheduler.stop(5)
        for instance in instances:
            await instance.unload()


async def occupy(scheduler: Scheduler, instance: Linear, ident: int = 100) -> asyncio.Task[InferResponse]:
    """Close the instance's gate and start one request on it, so later ones queue."""
    instance.gate.clear()
    instance.entered.clear()
    task = asyncio.create_task(scheduler.submit(req(ident)))
    await wait_thread_event(instance.entered)
    return task


async def runs_directly(scheduler: Scheduler, instance: Linear, ident: int) -> None:
    """A request sent to an idle instance runs in its own task, not a worker's."""
    task = asyncio.create_task(scheduler.submit(req(ident)))
    await task
    assert instance.callers[-1] is task


# ---------------------------------------------------------------------------- batching


async def test_batched_results_equal_per_request_results(harness: Harness) -> None:
    scheduler, (inst,), _ = await harness(make_config(8, {"max_queue_delay_microseconds": 200_000}))
    assert isinstance(scheduler, DynamicBatcher)
    requests = [req(i, n) for i, n in enumerate((1, 3, 2, 1, 1))]  # ragged, 8 rows in all

    alone = [await scheduler.submit(r) for r in requests]
    assert inst.batches == [1, 3, 2, 1, 1]
    inst.batches.clear()
    together = await asyncio.gather(*(scheduler.submit(r) for r in requests))

    assert inst.batches == [8]  # one execution, full at max_batch_size
    for request, one, many in zip(requests, alone, together, strict=True):
        x = request.inputs["x"]
        assert many.outputs["y"].shape == (x.shape[0], 3)
        np.testing.assert_array_equal(many.outputs["y"], one.outputs["y"])
        np.testing.assert_array_equal(many.outputs["y"], inst.expected(x))


async def test_max_batch_size_is_respected_with_ragged_requests(harness: Harness) -> None:
    scheduler, (inst,), _ = await harness(make_config(4, {"max_queue_delay_microseconds": 20_000}))
    sizes = [3, 2, 2, 1, 1, 4, 1, 2]
    requests = [req(i, n) for i, n in enumerate(sizes)]
    results = await asyncio.gather(*(scheduler.submit(r) for r in requests))
    assert all(b <= 4 for b in inst.batches), inst.batches
    assert sum(inst.batches) == sum(sizes)
    assert max(inst.batches) == 4
    for request, result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], inst.expected(request.inputs["x"]))


async def test_preferred_batch_size_dispatches_without_waiting_for_the_delay(harness: Harness) -> None:
    # A 60 s delay: only reaching the preferred size can send these four in time.
    config = make_config(8, {"preferred_batch_size": [4], "max_queue_delay_microseconds": 60_000_000})
    scheduler, (inst,), _ = await harness(config)
    requests = [req(i) for i in range(4)]
    results = await asyncio.wait_for(asyncio.gather(*(scheduler.submit(r) for r in requests)), 10)
    assert inst.batches == [4]
    for request, result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], inst.expected(request.inputs["x"]))


async def test_max_queue_delay_lets_a_batch_form(harness: Harness) -> None:
    scheduler, (inst,), stats = await harness(make_config(16, {"max_queue_delay_microseconds": 200_000}))
    requests = [req(i) for i in range(8)]
    results = await asyncio.gather(*(scheduler.submit(r) for r in requests))
    assert max(inst.batches) > 1
    assert sum(inst.batches) == 8
    for request, result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], inst.expected(request.inputs["x"]))
    assert stats.execution_count == len(inst.batches)


async def test_default_batches_only_while_the_instance_is_busy(harness: Harness) -> None:
    # max_batch_size > 0 and no dynamic_batching block: delay 0, nothing waits for company.
    scheduler, (inst,), _ = await harness(make_config(8))
    assert isinstance(scheduler, DynamicBatcher)
    alone = await scheduler.submit(req(1))
    assert inst.batches == [1]
    np.testing.assert_array_equal(alone.outputs["y"], inst.expected(rows(1)))

    first = await occupy(scheduler, inst)
    queued = [asyncio.create_task(scheduler.submit(req(i))) for i in range(10, 15)]
    await settle()
    assert scheduler.pending() == 5
    inst.gate.set()
    await first
    await asyncio.gather(*queued)
    assert inst.batches == [1, 1, 5]


async def test_only_compatible_requests_share_a_batch(harness: Harness) -> None:
    scheduler, (inst,), _ = await harness(make_config(8, width=-1), cls=Scale)
    first = await occupy(scheduler, inst)
    shapes = [(1, 2), (2, 5), (1, 2), (1, 2)]
    requests = [InferRequest({"x": rows(10 + i, n, width=w)}) for i, (n, w) in enumerate(shapes)]
    requests.append(InferRequest({"x": rows(20, 1, width=2, dtype=np.float32)}))
    tasks = [asyncio.create_task(scheduler.submit(r)) for r in requests]
    await settle()
    inst.gate.set()
    await first
    results = await asyncio.gather(*tasks)
    # The three width-2 float64 requests merge (skipping the width-5 one); the float32 one
    # and the width-5 one each run alone.
    assert inst.batches == [1, 3, 2, 1]
    assert inst.seen[1:] == [10, 12, 13, 11, 11, 20]
    for request, result in zip(requests, results, strict=True):
        x = request.inputs["x"]
        np.testing.assert_array_equal(result.outputs["y"], x * 3 - 1)
        assert result.outputs["y"].dtype == x.dtype


async def test_reaching_max_batch_size_dispatches_a_waiting_batch_at_once(harness: Harness) -> None:
    # A 60 s delay: the batch former is asleep waiting for company when the last row arrives,
    # and only that arrival filling the batch can send it in time.
    scheduler, (inst,), _ = await harness(make_config(4, {"max_queue_delay_microseconds": 60_000_000}))
    requests = [req(i) for i in range(4)]
    tasks = []
    for request in requests[:3]:
        tasks.append(asyncio.create_task(scheduler.submit(request)))
        await settle()
    assert inst.batches == []  # three rows wait for company
    tasks.append(asyncio.create_task(scheduler.submit(requests[3])))
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert inst.batches == [4]
    for request, result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], inst.expected(request.inputs["x"]))


class CountingBatcher(DynamicBatcher):
    """Counts how often the batch former plans."""

    plans = 0

    def _plan(self, now_ns: int) -> tuple[list[Any] | None, int | None]:
        self.plans += 1
        return super()._plan(now_ns)


async def test_a_waiting_batch_is_replanned_only_when_an_arrival_can_complete_it(
    tmp_path: Path,
) -> None:
    # Re-planning the whole queue on every arrival made forming one batch O(queue^2).
    config = make_config(8, {"max_queue_delay_microseconds": 60_000_000})
    inst = Linear(InstanceContext("m", 1, 0, 1))
    await inst.load(config, tmp_path, "CPU")
    scheduler = CountingBatcher(config, [inst], ModelStats("m", "1"))
    await scheduler.start()
    try:
        tasks = []
        for i in range(7):
            tasks.append(asyncio.create_task(scheduler.submit(req(i))))
            await settle()
        # One plan when the first request arrived (it then waits out the delay); none since.
        assert scheduler.plans == 1
        assert scheduler.pending() == 7
        tasks.append(asyncio.create_task(scheduler.submit(req(7))))
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert scheduler.plans == 2
        assert inst.batches == [8]
    finally:
        await scheduler.stop(5)
        await inst.unload()


# ---------------------------------------------------------------------------- priorities and policies


async def test_higher_priority_is_served_first(harness: Harness) -> None:
    config = make_config(1, {"priority_levels": 2, "default_priority_level": 2})
    scheduler, (inst,), _ = await harness(config)
    first = await occupy(scheduler, inst, ident=100)
    tasks = [
        asyncio.create_task(scheduler.submit(req(1, priority=0))),  # 0 = default level (2)
        asyncio.create_task(scheduler.submit(req(2, priority=2))),
        asyncio.create_task(scheduler.submit(req(3, priority=1))),  # highest
        asyncio.create_task(scheduler.submit(req(4, priority=9))),  # out of range = default
    ]
    await settle()
    inst.gate.set()
    await first
    await asyncio.gather(*tasks)
    assert inst.seen == [100, 3, 1, 2, 4]


async def test_full_queue_is_unavailable(harness: Harness) -> None:
    config = make_config(1, {"default_queue_policy": {"max_queue_size": 2}})
    scheduler, (inst,), stats = await harness(config)
    first = await occupy(scheduler, inst)
    queued = [asyncio.create_task(scheduler.submit(req(i))) for i in (1, 2)]
    await settle()
    assert scheduler.pending() == 2
    with pytest.raises(Unavailable) as caught:
        await scheduler.submit(req(3))
    assert caught.value.status == 503
    assert caught.value.message == (
        "[request id: <id_unknown>] Exceeds maximum queue size: the inference request queue for "
        "model 'm' is full (max_queue_size 2)"
    )
    inst.gate.set()
    await first
    await asyncio.gather(*queued)
    assert inst.seen == [100, 1, 2]
    assert stats.failures["REJECTED"] == 1


async def test_priority_queue_policy_applies_per_level(harness: Harness) -> None:
    config = make_config(1, {
        "priority_levels": 2,
        "default_priority_level": 2,
        "priority_queue_policy": {1: {"max_queue_size": 1}},
    })
    scheduler, (inst,), _ = await harness(config)
    first = await occupy(scheduler, inst)
    tasks = [asyncio.create_task(scheduler.submit(req(i, priority=1))) for i in (1, 2)]
    tasks += [asyncio.create_task(scheduler.submit(req(i, priority=2))) for i in (3, 4)]
    await settle()
    assert isinstance(tasks[1].exception(), Unavailable)  # level 1 holds one
    assert scheduler.pending() == 3  # level 2 is unbounded
    inst.gate.set()
    await first
    await asyncio.gather(tasks[0], tasks[2], tasks[3])


async def test_reject_timeout_fires_while_instances_are_busy(harness: Harness) -> None:
    config = make_config(1, {"default_queue_policy": {"default_timeout_microseconds": 50_000}})
    scheduler, (inst,), stats = await harness(config)
    first = await occupy(scheduler, inst)
    with pytest.raises(QueueTimeout) as caught:
        await asyncio.wait_for(scheduler.submit(req(1)), 10)
    # The instance is still blocked: the timer, not a freed instance, rejected it.
    assert not inst.gate.is_set()
    assert caught.value.status == 503
    assert "model 'm'" in caught.value.message
    assert "timed out in queue after 50000 us" in caught.value.message
    assert scheduler.pending() == 0
    inst.gate.set()
    await first
    assert inst.seen == [100]
    assert stats.failures["REJECTED"] == 1


async def test_delay_timeout_keeps_the_request_behind_fresh_ones(harness: Harness) -> None:
    config = make_config(1, {"default_queue_policy": {
        "default_timeout_microseconds": 300_000, "timeout_action": "DELAY",
    }})
    scheduler, (inst,), _ = await harness(config)
    first = await occupy(scheduler, inst)
    late = asyncio.create_task(scheduler.submit(req(1)))
    await asyncio.sleep(0.6)  # req 1 is now past its timeout
    fresh = asyncio.create_task(scheduler.submit(req(2)))
    await settle()
    inst.gate.set()
    await first
    late_result, fresh_result = await asyncio.gather(late, fresh)
    assert inst.seen == [100, 2, 1]
    np.testing.assert_array_equal(late_result.outputs["y"], inst.expected(rows(1)))
    np.testing.assert_array_equal(fresh_result.outputs["y"], inst.expected(rows(2)))


@pytest.mark.parametrize("allow", [True, False])
async def test_timeout_override(harness: Harness, allow: bool) -> None:
    config = make_config(1, {"default_queue_policy": {
        "default_timeout_microseconds": 60_000_000, "allow_timeout_override": allow,
    }})
    scheduler, (inst,), _ = await harness(config)
    first = await occupy(scheduler, inst)
    task = asyncio.create_task(scheduler.submit(req(1, timeout_us=50_000)))
    if allow:
        # Rejected by its own 50 ms timer while the instance is still blocked (however late a
        # loaded machine runs that timer).
        with pytest.raises(QueueTimeout):
            await asyncio.wait_for(asyncio.shield(task), 10)
        assert not inst.gate.is_set()
    else:
        await asyncio.sleep(0.3)
        assert not task.done()  # the request's own timeout is ignored
    inst.gate.set()
    await first
    if not allow:
        result = await task
        np.testing.assert_array_equal(result.outputs["y"], inst.expected(rows(1)))


# ---------------------------------------------------------------------------- instances and ordering


@pytest.mark.parametrize("preserve", [True, False])
async def test_preserve_ordering_with_uneven_instances(harness: Harness, preserve: bool) -> None:
    config = make_config(4, {"preserve_ordering": preserve})
    scheduler, (slow, fast), _ = await harness(config, count=2)
    finished: list[int] = []
    slow.gate.clear()
    first = asyncio.create_task(scheduler.submit(req(1)))
    first.add_done_callback(lambda _: finished.append(1))
    await wait_thread_event(slow.entered)
    second = asyncio.create_task(scheduler.submit(req(2)))
    second.add_done_callback(lambda _: finished.append(2))
    await wait_thread_event(fast.entered)
    if preserve:
        # Wait on the fast instance having handed request 2's result back (not on a sleep long
        # enough on this machine): the scheduler must still hold it behind request 1.
        async with asyncio.timeout(10):
            while fast.executed == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        await settle()
        assert not second.done()
    else:
        await asyncio.wait_for(asyncio.shield(second), 10)
        assert not first.done()
    assert (slow.seen, fast.seen) == ([1], [2])
    slow.gate.set()
    await asyncio.gather(first, second)
    assert finished == ([1, 2] if preserve else [2, 1])
    np.testing.assert_array_equal(first.result().outputs["y"], slow.expected(rows(1)))
    np.testing.assert_array_equal(second.result().outputs["y"], fast.expected(rows(2)))


@pytest.mark.parametrize("cls", [Exploding, Interrupting])
async def test_execute_raising_fails_exactly_its_batch(harness: Harness, cls: type[Linear]) -> None:
    scheduler, (inst,), stats = await harness(make_config(4), cls=cls)
    first = await occupy(scheduler, inst)
    poison = rows(1)
    poison[0, 1] = np.nan
    doomed = [
        asyncio.create_task(scheduler.submit(InferRequest({"x": poison}))),
        asyncio.create_task(scheduler.submit(req(2))),
    ]
    await settle()
    inst.gate.set()
    ok = await first
    outcomes = await asyncio.gather(*doomed, return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, BackendError)
        assert "model 'm'" in outcome.message
        assert "boom" in outcome.message
    assert outcomes[0] is not outcomes[1]
    after = await scheduler.submit(req(3))
    np.testing.assert_array_equal(ok.outputs["y"], inst.expected(rows(100)))
    np.testing.assert_array_equal(after.outputs["y"], inst.expected(rows(3)))
    assert inst.seen == [100, 3]
    assert stats.failures["BACKEND"] == 2
    assert stats.success.count == 2
    # Three executions were performed, the one that raised included (Triton counts it too).
    assert stats.execution_count == 3 and sorted(stats.batch_stats) == [1, 2]


async def test_instances_run_concurrently(harness: Harness) -> None:
    barrier = threading.Barrier(2, timeout=10)

    class Meeting(Linear):
        def compute(self, x: np.ndarray) -> dict[str, np.ndarray]:
            barrier.wait()  # passes only when both instances are inside infer at once
            return super().compute(x)

    scheduler, instances, stats = await harness(make_config(0), count=2, cls=Meeting)
    assert isinstance(scheduler, InstanceScheduler)
    requests = [req(1), req(2)]
    results = await asyncio.wait_for(asyncio.gather(*(scheduler.submit(r) for r in requests)), 20)
    assert sorted(i.seen[0] for i in instances) == [1, 2]
    for request, result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], instances[0].expected(request.inputs["x"]))
    assert stats.execution_count == 2


async def test_instance_scheduler_never_merges(harness: Harness) -> None:
    config = make_config(8, {"max_queue_delay_microseconds": 100_000})
    scheduler, (inst,), _ = await harness(config, cls=NoMerge)
    assert isinstance(scheduler, InstanceScheduler)  # the backend can't take merged batches
    first = await occupy(scheduler, inst)
    tasks = [asyncio.create_task(scheduler.submit(req(i, 2))) for i in range(3)]
    await settle()
    inst.gate.set()
    await first
    results = await asyncio.gather(*tasks)
    assert inst.batches == [1, 2, 2, 2]
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.outputs["y"], inst.expected(rows(i, 2)))


# ---------------------------------------------------------------------------- stop and cancel


async def test_stop_drains_then_refuses(harness: Harness) -> None:
    scheduler, (inst,), _ = await harness(make_config(0))
    first = await occupy(scheduler, inst)
    queued = [asyncio.create_task(scheduler.submit(req(i))) for i in (1, 2)]
    await settle()
    stopping = asyncio.create_task(scheduler.stop(30))
    await settle()
    with pytest.raises(Unavailable):
        await scheduler.submit(req(3))
    assert not stopping.done()  # still draining the queued work
    inst.gate.set()
    await stopping
    for task, ident in zip([first, *queued], (100, 1, 2), strict=True):
        np.testing.assert_array_equal(task.result().outputs["y"], inst.expected(rows(ident)))
    with pytest.raises(Unavailable):
        await scheduler.submit(req(4))
    assert inst.seen == [100, 1, 2]


async def test_stop_fails_what_the_drain_timeout_leaves(harness: Harness) -> None:
    scheduler, (inst,), _ = await harness(make_config(0))
    first = await occupy(scheduler, inst)
    queued = asyncio.create_task(scheduler.submit(req(1)))
    await settle()
    await scheduler.stop(0.1)
    outcomes = await asyncio.gather(first, queued, return_exceptions=True)
    assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
    assert scheduler.pending() == 0


async def test_cancelled_request_leaves_the_queue(harness: Harness) -> None:
    scheduler, (inst,), stats = await harness(make_config(4))
    first = await occupy(scheduler, inst)
    gone = asyncio.create_task(scheduler.submit(req(1)))
    kept = asyncio.create_task(scheduler.submit(req(2)))
    await settle()
    assert scheduler.pending() == 2
    assert stats.pending == 2
    gone.cancel()
    await settle()
    assert gone.cancelled()
    assert scheduler.pending() == 1
    inst.gate.set()
    await first
    await kept
    assert inst.seen == [100, 2]
    assert stats.failures["CANCELED"] == 1


# ---------------------------------------------------------------------------- direct dispatch
# A request that finds nothing queued and an instance idle, and that the plan would send alone
# at once, runs in its caller's task (no worker hop); everything else goes through the queue.


@pytest.mark.parametrize("batching", [True, False])
async def test_idle_request_runs_in_its_own_task_with_the_same_stats(harness: Harness, batching: bool) -> None:
    scheduler, (inst,), stats = await harness(make_config(8 if batching else 0))
    assert isinstance(scheduler, DynamicBatcher if batching else InstanceScheduler)
    request = req(1)
    task = asyncio.create_task(scheduler.submit(request))
    result = await task
    assert inst.callers == [task]
    np.testing.assert_array_equal(result.outputs["y"], inst.expected(request.inputs["x"]))

    doc = stats.to_triton_json("m", "1")
    assert (doc["inference_count"], doc["execution_count"]) == (1, 1)
    inference = doc["inference_stats"]
    for phase in ("success", "queue", "compute_infer"):
        assert inference[phase]["count"] == 1, phase
    assert inference["compute_infer"]["ns"] > 0
    assert inference["fail"] == {"count": 0, "ns": 0}
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in doc["batch_stats"]] == [(1, 1)]
    assert stats.pending == 0


async def test_requests_arriving_during_a_direct_execution_queue_and_batch(harness: Harness) -> None:
    scheduler, (inst,), stats = await harness(make_config(8))
    first = await occupy(scheduler, inst)
    assert inst.callers == [first]
    later = [asyncio.create_task(scheduler.submit(req(i))) for i in (1, 2, 3)]
    await settle()
    assert scheduler.pending() == 3
    assert inst.batches == [1]  # the busy instance is not given a second execution
    inst.gate.set()
    results = await asyncio.gather(first, *later)
    assert inst.batches == [1, 3]
    assert inst.callers[1] not in (first, *later)  # the worker ran the batch
    for ident, result in zip((100, 1, 2, 3), results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], inst.expected(rows(ident)))
    assert stats.execution_count == 2
    # And once idle again, the next request runs directly again.
    await runs_directly(scheduler, inst, 4)


async def test_requests_arriving_together_still_share_one_batch(harness: Harness) -> None:
    # Their tasks are due in the same loop iteration: none runs directly, the worker wakes
    # after all of them and sends one batch, as with no direct dispatch at all.
    scheduler, (inst,), stats = await harness(make_config(8))
    requests = [req(i) for i in range(4)]
    tasks = [asyncio.create_task(scheduler.submit(r)) for r in requests]
    results = await asyncio.gather(*tasks)
    assert inst.batches == [4]
    assert inst.callers[0] not in tasks
    assert stats.execution_count == 1
    for request, result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], inst.expected(request.inputs["x"]))


async def test_ready_queue_is_the_loops_queue_of_due_callbacks() -> None:
    # Under both loops (tests/core/conftest.py); the direct-dispatch tests around this one
    # show what the scheduler does with it.
    loop = asyncio.get_running_loop()
    ready = ready_queue(loop)
    assert ready is not None
    assert len(ready) == 0
    loop.call_soon(lambda: None)
    task = asyncio.ensure_future(asyncio.sleep(0))
    assert len(ready) == 2
    await task
    assert len(ready) == 0


async def test_a_request_that_must_wait_for_company_goes_through_the_queue(harness: Harness) -> None:
    scheduler, (inst,), _ = await harness(make_config(8, {"max_queue_delay_microseconds": 20_000}))
    task = asyncio.create_task(scheduler.submit(req(1)))
    await task
    assert inst.callers and inst.callers[0] is not task
    # At a preferred size there is nothing to wait for: it runs directly.
    scheduler, (inst,), _ = await harness(
        make_config(8, {"max_queue_delay_microseconds": 60_000_000, "preferred_batch_size": [2]})
    )
    task = asyncio.create_task(scheduler.submit(req(2, 2)))
    await asyncio.wait_for(task, 10)
    assert inst.callers == [task]


async def test_direct_executions_use_every_idle_instance(harness: Harness) -> None:
    scheduler, (one, two), _ = await harness(make_config(8), count=2)
    first = await occupy(scheduler, one, 1)
    second = await occupy(scheduler, two, 2)
    assert (one.callers, two.callers) == ([first], [second])
    third = asyncio.create_task(scheduler.submit(req(3)))
    await settle()
    assert scheduler.pending() == 1  # both busy: it queues
    two.gate.set()
    await second
    await third
    assert two.batches == [1, 1] and one.batches == [1]
    one.gate.set()
    np.testing.assert_array_equal((await first).outputs["y"], one.expected(rows(1)))


async def test_cancelled_direct_request(harness: Harness) -> None:
    """The caller of a direct execution goes away: the backend call is cut as a stop cuts a
    worker's (so no execution is counted), the request counts as CANCELED, and the instance
    serves the next request (the runtime thread finishes the cut call first)."""
    scheduler, (inst,), stats = await harness(make_config(8))
    gone = await occupy(scheduler, inst)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert stats.failures["CANCELED"] == 1
    nxt = asyncio.create_task(scheduler.submit(req(5)))
    await settle()
    inst.gate.set()
    np.testing.assert_array_equal((await asyncio.wait_for(nxt, 10)).outputs["y"], inst.expected(rows(5)))
    assert inst.seen == [100, 5]
    assert stats.execution_count == 1


async def test_stop_timeout_fails_a_direct_execution_as_unavailable(harness: Harness) -> None:
    scheduler, (inst,), stats = await harness(make_config(8))
    first = await occupy(scheduler, inst)
    assert inst.callers == [first]
    await scheduler.stop(0.05)
    with pytest.raises(Unavailable, match="unloaded before the request finished"):
        await first
    assert stats.failures["REJECTED"] == 1
    assert not first.cancelled()


# ---------------------------------------------------------------------------- statistics


async def test_stats_and_metrics_follow_executions(harness: Harness) -> None:
    scheduler, (inst,), stats = await harness(make_config(8))
    first = await occupy(scheduler, inst)
    tasks = [asyncio.create_task(scheduler.submit(req(i, n))) for i, n in enumerate((1, 1, 1, 2))]
    await settle()
    assert stats.pending == 4
    inst.gate.set()
    await first
    await asyncio.gather(*tasks)
    assert inst.batches == [1, 5]

    doc = stats.to_triton_json("m", "1")
    assert doc["inference_count"] == 6
    assert doc["execution_count"] == 2
    inference = doc["inference_stats"]
    assert inference["success"]["count"] == 5
    assert inference["queue"]["count"] == 5
    assert inference["compute_infer"]["count"] == 5
    assert inference["fail"] == {"count": 0, "ns": 0}
    assert inference["queue"]["ns"] > 0
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in doc["batch_stats"]] == [(1, 1), (5, 1)]
    # Compute is split as Triton splits it: merging the batch's inputs and splitting its
    # outputs are compute_input and compute_output; one request alone has neither.
    single, merged = doc["batch_stats"]
    assert single["compute_input"]["ns"] == single["compute_output"]["ns"] == 0
    assert merged["compute_input"]["ns"] > 0 and merged["compute_output"]["ns"] > 0
    assert inference["compute_input"]["ns"] == merged["compute_input"]["ns"] * 4  # its 4 requests
    assert stats.pending == 0

    metrics = MetricsRegistry()
    exported = ModelStats("m", "1", metrics)
    exported.record_success(1_000, 6)
    text = metrics.render().decode()
    assert 'nv_inference_count{model="m",version="1"} 6.0' in text


# ---------------------------------------------------------------------------- overlap


async def test_a_busy_instance_takes_a_second_execution_queued_on_its_thread(harness: Harness) -> None:
    scheduler, (inst,), stats = await harness(make_config(8), cls=Queued, overlap=True)
    assert scheduler.depth == 2
    first = await occupy(scheduler, inst)
    second = [asyncio.create_task(scheduler.submit(req(i))) for i in (1, 2, 3)]
    await settle()
    # Taken at once as one execution, which waits on the instance's thread behind the first.
    assert scheduler.pending() == 0
    assert inst.batches == [1]
    third = [asyncio.create_task(scheduler.submit(req(i))) for i in (4, 5)]
    await settle()
    assert scheduler.pending() == 2  # two in flight fill the instance
    inst.gate.set()
    results = await asyncio.gather(first, *second, *third)
    assert inst.batches == [1, 3, 2]
    assert inst.seen == [100, 1, 2, 3, 4, 5]
    for ident, result in zip((100, 1, 2, 3, 4, 5), results, strict=True):
        np.testing.assert_array_equal(result.outputs["y"], inst.expected(rows(ident)))
    assert stats.execution_count == 3
    await runs_directly(scheduler, inst, 6)  # idle again


async def test_a_lone_request_behind_a_running_execution_goes_through_a_worker(harness: Harness) -> None:
    # Run directly, it would wait on the instance's thread in its own task, with nothing
    # for the queue's policies (timeouts, priorities) to act on; as queued work it is a
    # worker's second execution.
    scheduler, (inst,), _ = await harness(make_config(8), cls=Queued, overlap=True)
    first = await occupy(scheduler, inst)
    lone = asyncio.create_task(scheduler.submit(req(1)))
    # Not `settle()`: its sleep(0) leaves this task ready, which sends `lone` to the queue
    # anyway (arrivals in one loop iteration batch together). A timer leaves nothing ready.
    await asyncio.sleep(0.01)
    await settle()
    assert len(inst.callers) == 2 and inst.callers[1] is not lone
    inst.gate.set()
    await asyncio.gather(first, lone)
    np.testing.assert_array_equal(lone.result().outputs["y"], inst.expected(rows(1)))


async def test_an_execution_queued_behind_another_counts_its_wait_as_queue_time(harness: Harness) -> None:
    scheduler, (inst,), stats = await harness(make_config(8), cls=Queued, overlap=True)
    first = await occupy(scheduler, inst)
    behind = asyncio.create_task(scheduler.submit(req(1)))
    await settle()
    assert scheduler.pending() == 0  # submitted to the thread, which is held by `first`
    held = 1.0
    await asyncio.sleep(held)
    inst.gate.set()
    await asyncio.gather(first, behind)
    doc = stats.to_triton_json("m", "1")
    # Two executions of one request each; `first` computed for `held` seconds. The request
    # behind it waited that long too, as queue time; its own compute is a numpy product.
    inference = doc["inference_stats"]
    assert inference["compute_infer"]["count"] == 2
    assert inference["queue"]["ns"] >= held * 1e9
    # Both computes together: `first`'s held second and a little, not two seconds.
    assert held * 1e9 <= inference["compute_infer"]["ns"] < 2 * held * 1e9


@pytest.mark.parametrize(
    ("config", "cls", "overlap"),
    [
        (make_config(8), Queued, False),  # not asked for (the daemon has HTTP workers)
        (make_config(8), Linear, True),  # a backend that did not declare queued_execute
        (make_config(8, {"max_queue_delay_microseconds": 100_000}), Queued, True),  # batches wait to grow
    ],
)
async def test_one_execution_per_instance_unless_overlap_is_safe_and_useful(
    harness: Harness, config: ModelConfig, cls: type[Linear], overlap: bool
) -> None:
    scheduler, (inst,), _ = await harness(config, cls=cls, overlap=overlap)
    assert scheduler.depth == 1
    first = await occupy(scheduler, inst)
    queued = [asyncio.create_task(scheduler.submit(req(i))) for i in (1, 2, 3)]
    await settle()
    assert scheduler.pending() == 3
    inst.gate.set()
    await asyncio.gather(first, *queued)
    assert inst.batches == [1, 3]


async def test_overlapped_executions_keep_order_and_drain_on_stop(harness: Harness) -> None:
    scheduler, (inst,), _ = await harness(make_config(0), cls=QueuedNoMerge, overlap=True)
    assert isinstance(scheduler, InstanceScheduler) and scheduler.depth == 2
    first = await occupy(scheduler, inst)
    queued = [asyncio.create_task(scheduler.submit(req(i))) for i in (1, 2, 3)]
    await settle()
    assert scheduler.pending() == 2  # one of them queued on the thread, one request each
    stopping = asyncio.create_task(scheduler.stop(30))
    await settle()
    assert not stopping.done()
    inst.gate.set()
    await stopping
    for task, ident in zip([first, *queued], (100, 1, 2, 3), strict=True):
        np.testing.assert_array_equal(task.result().outputs["y"], inst.expected(rows(ident)))
    assert inst.seen == [100, 1, 2, 3]
    assert inst.batches == [1, 1, 1, 1]


async def test_stop_fails_both_overlapped_executions_after_the_drain_timeout(harness: Harness) -> None:
    scheduler, (inst,), _ = await harness(make_config(8), cls=Queued, overlap=True)
    first = await occupy(scheduler, inst)
    behind = asyncio.create_task(scheduler.submit(req(1)))
    queued = asyncio.create_task(scheduler.submit(req(2)))
    await settle()
    await scheduler.stop(0.1)
    outcomes = await asyncio.gather(first, behind, queued, return_exceptions=True)
    assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
    assert scheduler.pending() == 0


async def test_make_scheduler_requires_instances() -> None:
    from daemon.errors import ConfigError

    with pytest.raises(ConfigError):
        make_scheduler(make_config(8), [], ModelStats("m", "1"))
