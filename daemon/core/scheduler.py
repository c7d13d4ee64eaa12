"""Schedulers for tensor models: a queue in front of a pool of backend instances.

Both schedulers share one queue (`_QueueScheduler`): Triton's priority levels, per-level queue
policies (max queue size, timeouts with REJECT or DELAY, per-request override), optional
in-order delivery, one asyncio worker per backend instance pulling work from the queue, and a
drain on stop. A request that finds nothing queued, an instance idle and no other work due in this
loop iteration, and that the plan would send alone right away, runs at once in the caller's task:
the worker hop (waking the worker, then waking the caller with the result) is two event-loop
iterations of a small request's latency.
With `overlap`, an instance whose backend queues calls on its thread
(`Capabilities.queued_execute`) takes a second execution while it runs one, when the plan sends
batches without waiting for company: its thread starts the next the moment the last ends,
instead of idling until the loop has taken the result and formed the next batch.
They differ only in how work leaves the queue:

- `DynamicBatcher` merges requests along dim 0 (Triton `dynamic_batching`).
- `InstanceScheduler` hands one request at a time to an instance.

Knows no HTTP: failures are `EdgedError`s whose `.status` the transport maps.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import enum
import gc
import heapq
import logging
import time
from collections import deque
from collections.abc import Hashable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from typing import Protocol

from mypy_extensions import mypyc_attr

from daemon.backend import Backend, ExecuteResult, InferRequest, InferResponse
from daemon.core.rate_limiter import InstanceLimits, Ticket
from daemon.core.sequence import SequenceBatcher
from daemon.core.stats import ComputePhases, FailureReason, ModelStats, compute_phases
from daemon.errors import (
    BackendError,
    ConfigError,
    EdgedError,
    InvalidArgument,
    QueueTimeout,
    Unavailable,
)
from daemon.model_config import DynamicBatching, ModelConfig, QueuePolicy

log = logging.getLogger(__name__)


class Scheduler(Protocol):
    """What the registry needs from a scheduler."""

    async def start(self) -> None: ...

    async def submit(self, request: InferRequest) -> InferResponse:
        """Queue one request and wait for its response; raises `EdgedError` subclasses."""
        ...

    async def stop(self, drain_timeout: float) -> None:
        """Refuse new work, finish queued and running work within `drain_timeout` seconds,
        then fail whatever is left with `Unavailable`."""
        ...

    def pending(self) -> int:
        """Requests waiting in the queue (not yet handed to an instance)."""
        ...


def make_scheduler(
    config: ModelConfig,
    instances: Sequence[Backend],
    stats: ModelStats,
    *,
    overlap: bool = False,
    limits: InstanceLimits | None = None,
) -> Scheduler:
    """Pick the scheduler for a loaded tensor model.

    - `DynamicBatcher` when the model batches (`max_batch_size > 0`) and its backend can take
      merged batches (`capabilities.dynamic_batching`).
    - `InstanceScheduler` otherwise (no batch dimension, or a backend that cannot merge).
    - `SequenceBatcher` (daemon.core.sequence) for a model with `sequence_batching`, whatever
      its batch dimension: it batches only requests of different sequences.

    A batching model whose config has no `dynamic_batching` block still gets a `DynamicBatcher`,
    with `max_queue_delay_microseconds: 0` and no preferred sizes. Unlike Triton (which then
    sends every request alone), this costs no latency: a request never waits for company, it
    is sent as soon as an instance is free; requests only merge when they arrive while every
    instance is busy, which is exactly when merging raises throughput.

    `limits`: the rate limiter's tickets of the instances it limits; each execution on one
    holds its resources while it runs.
    """
    if not instances:
        raise ConfigError(f"model '{config.name or stats.name}' has no backend instances")
    if config.sequence_batching is not None:
        return SequenceBatcher(config, instances, stats, limits=limits)
    merges = all(type(instance).capabilities.dynamic_batching for instance in instances)
    if config.max_batch_size > 0 and merges:
        return DynamicBatcher(config, instances, stats, overlap=overlap, limits=limits)
    return InstanceScheduler(config, instances, stats, overlap=overlap, limits=limits)


# ---------------------------------------------------------------------------- the queue


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class _Stage(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


# A request's compute phases until its batch has run (immutable: shared as the default).
_NOT_RUN = ComputePhases(0, 0, 0)


@dataclass(eq=False, slots=True)
class _Pending:
    """One accepted request on its way through the scheduler (hashed by identity)."""

    request: InferRequest
    future: asyncio.Future[InferResponse]
    seq: int
    level: int
    rows: int
    arrival_ns: int
    # Requests that may share a batch have equal keys (set when the request is queued).
    key: Hashable = None
    deadline_ns: int | None = None
    timeout_us: int = 0
    delay_on_timeout: bool = False
    stage: _Stage = _Stage.QUEUED
    # Timed out under DELAY: served after the level's other requests.
    delayed: bool = False
    queue_ns: int = 0
    compute: ComputePhases = _NOT_RUN


@dataclass(slots=True)
class _Level:
    """The queue of one priority level."""

    policy: QueuePolicy
    main: deque[_Pending] = field(default_factory=deque)
    delayed: deque[_Pending] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self.main) + len(self.delayed)

    def remove(self, item: _Pending) -> None:
        (self.delayed if item.delayed else self.main).remove(item)


# Compiled by mypyc (packaging/native.py); tests subclass the dynamic batcher to count its plans.
@mypyc_attr(allow_interpreted_subclasses=True)
class _QueueScheduler:
    """Priority queue + policies + instance workers + ordered delivery; subclasses decide
    which queued requests form the next execution (`_plan`)."""

    def __init__(
        self,
        config: ModelConfig,
        instances: Sequence[Backend],
        stats: ModelStats,
        *,
        overlap: bool = False,
        limits: InstanceLimits | None = None,
    ) -> None:
        if not instances:
            raise ConfigError(f"model '{config.name or stats.name}' has no backend instances")
        self.config = config
        self.limits = limits
        self.model = config.name or stats.name
        self.instances = list(instances)
        self.stats = stats
        batching = config.dynamic_batching or DynamicBatching()
        self.batching = batching
        self.preserve_ordering = batching.preserve_ordering
        # Level 1 is the highest priority; without priority levels everything is level 1.
        self.level_count = max(1, batching.priority_levels)
        default = batching.default_priority_level
        # Triton requires default_priority_level in [1, priority_levels]; a config that leaves
        # it 0 gets the lowest level rather than an error.
        self.default_level = default if 1 <= default <= self.level_count else self.level_count
        fallback = batching.default_queue_policy or QueuePolicy()
        self.levels = {
            level: _Level(batching.priority_queue_policy.get(level, fallback))
            for level in range(1, self.level_count + 1)
        }
        self._state = _State.NEW
        self._workers: list[asyncio.Task[None]] = []
        self._form_lock = asyncio.Lock()
        # The batch former, while it sleeps: a future to complete to wake it, and whether it
        # sleeps until a deadline (a batch waiting for company) rather than for any change.
        self._former: asyncio.Future[None] | None = None
        self._former_timed = False
        # A new arrival can complete a waiting batch only once this many rows are queued
        # (the smallest preferred size, else max_batch_size; see DynamicBatcher).
        self._wake_rows = 1
        self._drained = asyncio.Event()
        # Kept in step with the levels' deques, so that neither costs a walk per request.
        self._pending = 0
        self._pending_rows = 0
        self._running: set[_Pending] = set()
        # Executions in flight per instance (a worker's or a direct one); an instance takes
        # `depth` at once (see `overlap` in the module docstring), each on a worker of its own.
        # Measured with a python model, one instance, 8 clients: 1.27-1.33x the requests per
        # second of one at a time, and less CPU per request (its thread no longer sleeps
        # between executions).
        self.depth = 2 if overlap and self._sends_at_once() and all(
            type(instance).capabilities.queued_execute for instance in instances
        ) else 1
        self._in_flight: dict[Backend, int] = {}
        # When each instance's last execution returned: an execution that waited behind
        # another on the instance's thread counts that wait as queue time, not compute.
        self._returned_ns: dict[Backend, int] = {}
        # Workers parked until their instance can take an execution again.
        self._idle_waiters: dict[Backend, list[asyncio.Future[None]]] = {}
        # The instance of the worker that forms batches while it sleeps (see `_sleep`).
        self._former_instance: Backend | None = None
        # Direct executions in flight: the task that runs each (cancelled by a stop that times out).
        self._direct: dict[_Pending, asyncio.Task[object]] = {}
        self._next_seq = 0
        # preserve_ordering: finished requests wait here until every earlier one is delivered.
        self._held: dict[int, tuple[_Pending, ExecuteResult | None, FailureReason]] = {}
        self._deliver_seq = 0
        # Timeout timer: a heap of (deadline, seq, item) and one armed loop timer.
        self._deadlines: list[tuple[int, int, _Pending]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_ns = 0
        # The queue of callbacks due on the loop the workers run on (`ready_queue`), read at
        # `start`: a request runs directly only once the scheduler runs.
        self._ready: Sized | None = None

    # ------------------------------------------------------------------ public API

    async def start(self) -> None:
        if self._state is not _State.NEW:
            return
        self._state = _State.RUNNING
        self._ready = ready_queue(asyncio.get_running_loop())
        self._workers = [
            asyncio.create_task(self._worker(instance), name=f"scheduler-{self.model}-{index}.{lane}")
            for index, instance in enumerate(self.instances)
            for lane in range(self.depth)
        ]

    def pending(self) -> int:
        return self._pending

    async def submit(self, request: InferRequest) -> InferResponse:
        # Before the state check: a request that can never run is refused as such.
        rows = self._rows(request)
        if self._state not in (_State.NEW, _State.RUNNING):
            self.stats.record_failure(0, "REJECTED")
            raise Unavailable(f"model '{self.model}' is unloading and accepts no new inference requests")
        now = time.monotonic_ns()
        level_no = self._level_of(request)
        level = self.levels[level_no]
        policy = level.policy
        if policy.max_queue_size and len(level) >= policy.max_queue_size:
            self.stats.record_failure(0, "REJECTED")
            # Triton's text first (clients retry on it), then which queue and its bound.
            raise Unavailable(
                f"[request id: {request.id or '<id_unknown>'}] Exceeds maximum queue size: the "
                f"inference request queue for model '{self.model}' is full (max_queue_size "
                f"{policy.max_queue_size})"
            )
        loop = asyncio.get_running_loop()
        item = _Pending(
            request=request,
            future=loop.create_future(),
            seq=self._next_seq,
            level=level_no,
            rows=rows,
            arrival_ns=now,
        )
        self._next_seq += 1
        if (
            self._pending == 0
            and self._state is _State.RUNNING
            and self._sends_alone(item, now)
            and not self._others_ready()
        ):
            instance = self._idle_instance()
            if instance is not None:
                return await self._run_direct(instance, item, now)
        item.key = self._key(request)  # only a queued request is ever compared with others
        timeout_us = self._timeout_us(request, policy)
        if timeout_us:
            item.timeout_us = timeout_us
            item.deadline_ns = now + timeout_us * 1000
            item.delay_on_timeout = policy.timeout_action == "DELAY"
            heapq.heappush(self._deadlines, (item.deadline_ns, item.seq, item))
            self._arm_timer()
        level.main.append(item)
        self._pending += 1
        self._pending_rows += rows
        # A former waiting out the queue delay re-plans only when this arrival can complete
        # its batch; waking it on every arrival made forming one batch O(queue^2).
        self._queue_changed(wake=not self._former_timed or self._pending_rows >= self._wake_rows)
        try:
            return await item.future
        except asyncio.CancelledError:
            # The caller went away: a request still queued must not be run for nobody.
            if item.stage is _Stage.QUEUED:
                self.levels[item.level].remove(item)
                self._unqueued(item)
                self._queue_changed()
                self._complete(item, None, "CANCELED")
            raise

    async def stop(self, drain_timeout: float) -> None:
        if self._state is _State.STOPPED:
            return
        was_started = self._state is not _State.NEW
        self._state = _State.STOPPING
        self._wake_former()
        self._check_drained()
        if was_started:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), max(0.0, drain_timeout))
        self._state = _State.STOPPED
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        leftovers = sorted([*self._running, *self._queued()], key=lambda item: item.seq)
        for level in self.levels.values():
            level.main.clear()
            level.delayed.clear()
        self._pending = self._pending_rows = 0
        self._queue_changed()
        if leftovers:
            log.warning("model %s: %d request(s) failed: not finished within the drain timeout",
                        self.model, len(leftovers))
        for item in leftovers:
            self._complete(
                item,
                Unavailable(f"model '{self.model}' was unloaded before the request finished"),
                "REJECTED",
            )
        # A direct execution is cut like a worker's, after its request got the outcome above,
        # which its caller then raises (see `_run_direct`).
        for task in list(self._direct.values()):
            task.cancel()

    # ------------------------------------------------------------------ subclass hooks

    def _rows(self, request: InferRequest) -> int:
        """Rows `request` adds to a batch; raises when it cannot be accepted at all."""
        return request.batch_size() if self.config.max_batch_size > 0 else 1

    def _key(self, request: InferRequest) -> Hashable:
        return None

    def _plan(self, now_ns: int) -> tuple[list[_Pending] | None, int | None]:
        """Choose the next execution from a non-empty queue: (items, None) to send them now,
        or (None, wake_at_ns) to wait for more requests until that time (None = until woken)."""
        head = next(self._queued())
        return [head], None

    def _sends_alone(self, item: _Pending, now_ns: int) -> bool:
        """Would `_plan`, with `item` alone in the queue, send it now? (Then it may skip the queue.)"""
        return True

    def _sends_at_once(self) -> bool:
        """Does `_plan` send whatever is queued as soon as an instance takes it? Only then may an
        instance take a second execution: where a batch waits to grow, forming it early while the
        instance is still busy would send it smaller."""
        return True

    def _others_ready(self) -> bool:
        """Are other callbacks due in this loop iteration (e.g. the tasks of requests that
        arrived together with this one)? Then a request must not run directly: through the
        queue, the worker wakes after them and sends them all as one batch, as it always did.
        Where the loop's queue cannot be read, assume there are."""
        ready = self._ready
        return ready is None or len(ready) > 0

    # ------------------------------------------------------------------ queue helpers

    def _level_of(self, request: InferRequest) -> int:
        # Triton: priority 0 means the default level, and so does an out-of-range priority.
        priority = request.priority
        return priority if 1 <= priority <= self.level_count else self.default_level

    @staticmethod
    def _timeout_us(request: InferRequest, policy: QueuePolicy) -> int:
        timeout = policy.default_timeout_microseconds
        # Triton: an override may shorten the default timeout, never lengthen it.
        if policy.allow_timeout_override and request.timeout_us > 0:
            timeout = min(timeout, request.timeout_us) if timeout else request.timeout_us
        return timeout

    def _queued(self) -> Iterator[_Pending]:
        """Queued requests in service order: priority, then arrival, delayed ones last per level."""
        for number in sorted(self.levels):
            level = self.levels[number]
            yield from level.main
            yield from level.delayed

    def _unqueued(self, item: _Pending) -> None:
        """Account for `item` having left the levels' deques."""
        self._pending -= 1
        self._pending_rows -= item.rows

    def _queue_changed(self, wake: bool = True) -> None:
        self.stats.pending = self._pending
        if wake:
            self._wake_former()
        self._check_drained()

    def _wake_former(self) -> None:
        if self._former is not None:
            _set_done(self._former)
        if self._idle_waiters:
            # A worker parked by an execution that has ended may form in its place.
            for instance in [i for i in self._idle_waiters if not self._full(i)]:
                self._unpark(instance)

    def _check_drained(self) -> None:
        if self._state is not _State.RUNNING and not self._running and self._pending == 0:
            self._drained.set()

    def _take(self, items: list[_Pending], now_ns: int) -> None:
        main = self.levels[items[0].level].main
        if len(items) <= len(main) and all(a is b for a, b in zip(items, main, strict=False)):
            # The common case (one level, compatible requests): the batch is the head of
            # the queue, so pop it rather than rebuild the deques.
            for _ in items:
                main.popleft()
        else:
            taken = set(items)
            for number in {item.level for item in items}:
                level = self.levels[number]
                level.main = deque(i for i in level.main if i not in taken)
                level.delayed = deque(i for i in level.delayed if i not in taken)
        for item in items:
            item.stage = _Stage.RUNNING
            item.queue_ns = now_ns - item.arrival_ns
            self._unqueued(item)
        self._running.update(items)
        self._queue_changed(wake=False)

    # ------------------------------------------------------------------ timeouts

    def _expire(self, now_ns: int) -> None:
        """Apply the timeout action to every queued request whose deadline has passed."""
        changed = False
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            _, _, item = heapq.heappop(self._deadlines)
            if item.stage is not _Stage.QUEUED or item.delayed:
                continue
            level = self.levels[item.level]
            level.main.remove(item)
            changed = True
            if item.delay_on_timeout:
                item.delayed = True
                level.delayed.append(item)
            else:
                self._unqueued(item)
                self._complete(
                    item,
                    QueueTimeout(
                        f"inference request for model '{self.model}' timed out in queue "
                        f"after {item.timeout_us} us"
                    ),
                    "REJECTED",
                )
        if changed:
            self._queue_changed()

    def _arm_timer(self) -> None:
        """Keep one loop timer at the earliest deadline, so a timeout fires even while every
        instance is busy and nobody is forming a batch."""
        while self._deadlines and (
            self._deadlines[0][2].stage is not _Stage.QUEUED or self._deadlines[0][2].delayed
        ):
            heapq.heappop(self._deadlines)
        if not self._deadlines:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        earliest = self._deadlines[0][0]
        if self._timer is not None and self._timer_ns <= earliest:
            return
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0, earliest - time.monotonic_ns()) / 1e9
        self._timer_ns = earliest
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._expire(time.monotonic_ns())
        self._arm_timer()

    # ------------------------------------------------------------------ workers

    async def _worker(self, instance: Backend) -> None:
        while True:
            # One worker at a time forms a batch; the other free ones queue on the lock, so
            # the queue feeds whichever instance is free first.
            async with self._form_lock:
                items = await self._next_batch(instance)
            if items is None:
                return
            if not items:
                # Other executions fill this instance: wait for one outside the lock, so
                # that another idle instance's worker can form the next batch meanwhile.
                await self._until_idle(instance)
                continue
            try:
                await self._execute(instance, items)
            finally:
                self._release(instance)
            # Drop the batch before waiting for the next: its inputs may be views of a client's
            # shared memory region, which stays mapped while any view lives.
            del items

    async def _next_batch(self, instance: Backend) -> list[_Pending] | None:
        """The next batch for `instance` (counted in flight), None when stopped, [] when other
        executions (a direct one, or the other workers') fill the instance."""
        while True:
            if self._full(instance):
                return []
            now = time.monotonic_ns()
            self._expire(now)
            wake_at: int | None = None
            if self._pending:
                items, wake_at = self._plan(now)
                if items is not None:
                    self._take(items, now)
                    self._occupy(instance)
                    return items
            elif self._state is not _State.RUNNING:
                return None
            self._former_instance = instance
            try:
                await self._sleep(wake_at, now)
            finally:
                self._former_instance = None

    # ------------------------------------------------------------------ direct dispatch

    def _full(self, instance: Backend) -> bool:
        return self._in_flight.get(instance, 0) >= self.depth

    def _occupy(self, instance: Backend) -> None:
        """`instance` starts an execution (`_release` ends it)."""
        self._in_flight[instance] = self._in_flight.get(instance, 0) + 1

    def _unpark(self, instance: Backend) -> None:
        """Wake the workers parked until `instance` could take an execution (`_until_idle`)."""
        for waiter in self._idle_waiters.pop(instance):
            _set_done(waiter)

    def _idle_instance(self) -> Backend | None:
        """An instance with no execution in flight: the batch former's, which is the one the
        request would have gone to through the queue, else the first idle one. (A request
        never runs directly behind another execution: it would wait there, not in the queue.)"""
        in_flight = self._in_flight
        former = self._former_instance
        if former is not None and not in_flight.get(former):
            return former
        return next((i for i in self.instances if not in_flight.get(i)), None)

    async def _run_direct(self, instance: Backend, item: _Pending, now_ns: int) -> InferResponse:
        """Run `item` alone on idle `instance` in the caller's task, with the queue's
        bookkeeping (stats, ordered delivery, drain) as if a worker had taken it."""
        item.stage = _Stage.RUNNING
        item.queue_ns = now_ns - item.arrival_ns
        self._running.add(item)
        self._occupy(instance)
        task = asyncio.current_task()
        assert task is not None
        self._direct[item] = task
        try:
            await self._execute(instance, [item])
        except asyncio.CancelledError:
            if item.stage is _Stage.DONE and self._state is _State.STOPPED:
                # `stop` cut the execution after its drain timeout and failed the request, as it
                # does a worker's: the caller gets that outcome, not a cancellation.
                task.uncancel()
            else:
                # The caller went away mid-execution: like a stop, the backend call is cut.
                self._complete(item, None, "CANCELED")
                raise
        finally:
            del self._direct[item]
            self._release(instance)
        return await item.future

    def _release(self, instance: Backend) -> None:
        """`instance` finished an execution. Its parked workers go back to forming batches only
        when there is work (or a stop): with nothing queued, the next request runs directly
        anyway, and waking them for nothing is a loop iteration."""
        count = self._in_flight.get(instance, 0) - 1
        if count > 0:
            self._in_flight[instance] = count
        else:
            self._in_flight.pop(instance, None)
        if instance in self._idle_waiters and (self._pending or self._state is not _State.RUNNING):
            self._unpark(instance)

    async def _until_idle(self, instance: Backend) -> None:
        """Park until `instance` can take an execution and there is work for it (`_release`,
        `_wake_former`)."""
        if not self._full(instance):
            return
        waiter = asyncio.get_running_loop().create_future()
        waiters = self._idle_waiters.setdefault(instance, [])
        waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
                if not waiters and self._idle_waiters.get(instance) is waiters:
                    del self._idle_waiters[instance]

    async def _sleep(self, wake_at: int | None, now_ns: int) -> None:
        """Wait until `_wake_former` is called or, if given, until `wake_at` (monotonic ns).

        A bare future and timer: `asyncio.wait_for` costs a task per wait."""
        loop = asyncio.get_running_loop()
        former: asyncio.Future[None] = loop.create_future()
        timer = None
        if wake_at is not None:
            timer = loop.call_later(max(0, wake_at - now_ns) / 1e9, _set_done, former)
        self._former = former
        self._former_timed = wake_at is not None
        try:
            await former
        finally:
            self._former = None
            self._former_timed = False
            if timer is not None:
                timer.cancel()

    async def _execute(self, instance: Backend, items: list[_Pending]) -> None:
        requests = [item.request for item in items]
        limits = self.limits
        ticket: Ticket | None = None
        if limits is not None:
            ticket, waited = await limits.hold(instance)
            for item in items:
                item.queue_ns += waited
        instance.phase_ns = (0, 0)
        started = time.monotonic_ns()
        results: list[ExecuteResult]
        try:
            results = list(await instance.execute(requests))
            if len(results) != len(items):
                raise BackendError(
                    f"backend {instance.name!r} returned {len(results)} results for "
                    f"{len(items)} requests of model '{self.model}'"
                )
        except EdgedError as exc:
            results = [exc] * len(items)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # A broken backend fails this batch, never the scheduler: a KeyboardInterrupt or
            # a custom BaseException from a model's code ended this worker task for good.
            log.warning("model %s: backend %s raised while executing %d request(s): %r",
                        self.model, instance.name, len(items), exc)
            error = BackendError(
                f"backend {instance.name!r} failed to execute model '{self.model}': "
                f"{type(exc).__name__}: {exc}"
            )
            results = [error] * len(items)
        finally:
            if limits is not None:
                limits.release(ticket)
        returned = time.monotonic_ns()
        # Behind another execution on the instance's thread, this one began when that returned.
        began = max(started, self._returned_ns.get(instance, 0))
        self._returned_ns[instance] = returned
        phases = compute_phases(returned - began, instance.phase_ns)
        # Performed, whatever its outcome (Triton counts an execution that raised too).
        self.stats.record_execution(
            sum(item.rows for item in items), phases.infer_ns, phases.input_ns, phases.output_ns
        )
        for item, result in zip(items, results, strict=True):
            item.compute = phases
            item.queue_ns += began - started
            if not isinstance(result, InferResponse | EdgedError):
                result = BackendError(
                    f"backend {instance.name!r} returned {type(result).__name__} instead of a "
                    f"response for model '{self.model}'"
                )
            self._complete(item, result, "BACKEND")

    # ------------------------------------------------------------------ delivery

    def _complete(self, item: _Pending, outcome: ExecuteResult | None, reason: FailureReason) -> None:
        """`item` is finished (outcome None = cancelled); deliver it, in order if configured."""
        if item.stage is _Stage.DONE:
            return
        item.stage = _Stage.DONE
        self._running.discard(item)
        if not self.preserve_ordering:
            self._deliver(item, outcome, reason)
        else:
            self._held[item.seq] = (item, outcome, reason)
            while self._deliver_seq in self._held:
                held, held_outcome, held_reason = self._held.pop(self._deliver_seq)
                self._deliver_seq += 1
                self._deliver(held, held_outcome, held_reason)
        self._check_drained()

    def _deliver(self, item: _Pending, outcome: ExecuteResult | None, reason: FailureReason) -> None:
        duration = time.monotonic_ns() - item.arrival_ns
        if outcome is None or item.future.done():
            self.stats.record_failure(duration, "CANCELED")
            return
        if isinstance(outcome, InferResponse):
            self.stats.record_success(
                duration,
                item.rows,
                queue_ns=item.queue_ns,
                compute_input_ns=item.compute.input_ns,
                compute_infer_ns=item.compute.infer_ns,
                compute_output_ns=item.compute.output_ns,
                tally=item.request.tally,
            )
            item.future.set_result(outcome)
        else:
            self.stats.record_failure(duration, reason)
            item.future.set_exception(_fresh(outcome))


def ready_queue(loop: asyncio.AbstractEventLoop) -> Sized | None:
    """The loop's queue of callbacks due in its current iteration (None: it cannot be read).

    Neither loop has a public accessor. asyncio's loop keeps the queue in `_ready`. uvloop's
    (the daemon's default) keeps it in an attribute of its compiled class that Python cannot
    name, and `getattr` found nothing there, so every request took the worker hop under it
    (measured: 5-8 % of one client's p50). The garbage collector's view of the loop shows the
    attribute's value: the one deque a uvloop 0.23 loop refers to (tests/core/test_scheduler.py
    checks that it is the queue). A loop that refers to no deque or to several: None."""
    ready = getattr(loop, "_ready", None)
    if isinstance(ready, deque):
        return ready
    held = [value for value in gc.get_referents(loop) if isinstance(value, deque)]
    return held[0] if len(held) == 1 else None


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _fresh(error: EdgedError) -> EdgedError:
    """A copy per request: one exception object raised in many tasks would share tracebacks."""
    try:
        return copy.copy(error)
    except Exception:
        return error


# ---------------------------------------------------------------------------- schedulers


class InstanceScheduler(_QueueScheduler):
    """One request per execution: models without a batch dimension, or backends that can't
    merge. Same queue, priorities, policies and instance pool as the dynamic batcher."""


# Compiled by mypyc (packaging/native.py); tests subclass it to count its plans.
@mypyc_attr(allow_interpreted_subclasses=True)
class DynamicBatcher(_QueueScheduler):
    """Triton's dynamic batcher: merge queued requests along dim 0 into one execution.

    A batch is headed by the first request in service order and takes the following
    compatible requests (same input names, dtypes and non-batch dims), ragged row counts
    allowed, up to `max_batch_size` rows. It is sent when it is full, when it reaches a
    preferred size (the largest one reachable), or when its oldest request has waited
    `max_queue_delay_microseconds`; with no delay it is sent as soon as an instance is free.
    """

    def __init__(
        self,
        config: ModelConfig,
        instances: Sequence[Backend],
        stats: ModelStats,
        *,
        overlap: bool = False,
        limits: InstanceLimits | None = None,
    ) -> None:
        if config.max_batch_size <= 0:
            raise ConfigError(
                f"model '{config.name or stats.name}': dynamic batching needs max_batch_size > 0"
            )
        super().__init__(config, instances, stats, overlap=overlap, limits=limits)
        self.max_rows = config.max_batch_size
        self.preferred = frozenset(s for s in self.batching.preferred_batch_size if 0 < s <= self.max_rows)
        self.delay_ns = self.batching.max_queue_delay_microseconds * 1000
        # `_plan` sends before the delay only at a preferred size or at max_batch_size, and
        # a batch has at most as many rows as are queued: below this, waking it is useless.
        self._wake_rows = min(self.preferred, default=self.max_rows)
        # Inputs whose shapes may differ within a batch (Triton's allow_ragged_batch).
        self._ragged = frozenset(config.ragged_inputs())

    def _rows(self, request: InferRequest) -> int:
        rows = request.batch_size()
        if rows > self.max_rows:
            self.stats.record_failure(0, "OTHER")
            raise InvalidArgument(
                f"inference request batch size {rows} for model '{self.model}' exceeds "
                f"max_batch_size {self.max_rows}"
            )
        return rows

    def _key(self, request: InferRequest) -> Hashable:
        parts = []
        rows = None
        for name in sorted(request.inputs):
            array = request.inputs[name]
            if array.ndim == 0 or (rows is not None and array.shape[0] != rows):
                # Can't be merged safely; a key equal only to itself makes it run alone.
                return object()
            rows = array.shape[0]
            parts.append((name, array.dtype.str, array.shape[1:] if name not in self._ragged else None))
        return tuple(parts)

    def _sends_at_once(self) -> bool:
        return self.batching.max_queue_delay_microseconds == 0

    def _sends_alone(self, item: _Pending, now_ns: int) -> bool:
        # `_plan` with only `item` queued: full, at a preferred size, or no delay to wait out.
        return (
            item.rows >= self.max_rows
            or item.rows in self.preferred
            or now_ns >= item.arrival_ns + self.delay_ns
        )

    def _plan(self, now_ns: int) -> tuple[list[_Pending] | None, int | None]:
        queued = self._queued()
        head = next(queued)
        batch = [head]
        rows = head.rows
        preferred_len = 1 if rows in self.preferred else 0
        for item in queued:
            if rows >= self.max_rows:
                break
            if item.key != head.key:
                continue
            if rows + item.rows > self.max_rows:
                # Stop rather than skip it: a large request must not be overtaken forever.
                break
            batch.append(item)
            rows += item.rows
            if rows in self.preferred:
                preferred_len = len(batch)
        if rows >= self.max_rows:
            return batch, None
        if preferred_len:
            return batch[:preferred_len], None
        wake_at = head.arrival_ns + self.delay_ns
        if self._state is not _State.RUNNING or now_ns >= wake_at:
            return batch, None
        return None, wake_at
