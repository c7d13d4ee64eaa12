"""Requests that may get any number of responses (Triton's decoupled models).

A decoupled model answers 0..n times per request and says when it is done (the final flag).
`/infer` still goes through the model's scheduler and takes exactly one response; the generate
extension streams through here instead, straight to the instance with the fewest open streams
(decoupled models in Triton are not batched either: each request gets its own sender), except
for a model with `sequence_batching`, whose sequence batcher runs its streams too. An
ensemble's answers come from its runner (daemon.core.ensemble), one per set of outputs.
Closing the iterator early (the client went away) cancels the request in the backend.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from daemon.backend import ExecuteResult, InferRequest
from daemon.core.ensemble import EnsembleRunner
from daemon.core.sequence import SequenceBatcher
from daemon.core.stats import FailureReason
from daemon.core.validate import validate_request
from daemon.errors import EdgedError, QueueTimeout, Unavailable, Unsupported

if TYPE_CHECKING:
    from daemon.core.model import LoadedVersion


async def responses(
    model: LoadedVersion, request: InferRequest
) -> AsyncGenerator[ExecuteResult, None]:
    """Every response of `request`: a decoupled model's stream, else its one response.

    Errors the model attaches to a response come as EdgedError items (the stream may go on);
    a request that fails before any response (validation, queue full) raises.
    """
    if isinstance(model.scheduler, EnsembleRunner) and (
        model.cache is None or model.config.model_transaction_policy.decoupled
    ):
        # An ensemble answers once per set of outputs its steps complete (Triton's decoupled
        # ensembles). A step's failure ends it: its last response, as a model's own failure is.
        # (One with a response cache, which only an ensemble that is not decoupled has, answers
        # once, through its cache, as below.)
        validate_request(request, model.config)
        try:
            async with contextlib.aclosing(model.scheduler.stream(request)) as answers:
                async for answer in answers:
                    yield answer
        except (Unavailable, QueueTimeout):
            raise
        except EdgedError as exc:
            yield exc
        return
    if not model.config.model_transaction_policy.decoupled:
        # As Triton: a request refused before it ran (bad input, queue full or timed out)
        # raises; a failure of the model itself is its one response. Refused by validation,
        # it never reached the model: no statistics (Triton counts it nowhere either).
        validate_request(request, model.config)
        try:
            yield await model.infer(request)
        except (Unavailable, QueueTimeout):
            raise
        except EdgedError as exc:
            yield exc
        return
    async with contextlib.aclosing(stream(model, request)) as results:
        async for result in results:
            yield result


async def stream(
    model: LoadedVersion, request: InferRequest
) -> AsyncGenerator[ExecuteResult, None]:
    """A decoupled model's responses for one request, recorded in the model's statistics as
    Triton records them: one execution of the request's rows, no queue (nothing waits here)."""
    validate_request(request, model.config)  # refused before the model: no statistics
    if isinstance(model.scheduler, SequenceBatcher):
        # A stateful model's stream goes through its sequence batcher, as in Triton: the
        # control inputs and state, and iterative sequences (which it records itself).
        async with contextlib.aclosing(model.scheduler.submit_stream(request)) as results:
            async for result in results:
                yield result
        return
    if not model.instances:
        raise Unsupported(f"model '{model.name}' has no backend instances to stream from")
    instance = min(model.instances, key=lambda backend: backend.streams_active)
    limits = model.limits
    # The stream holds its instance's resources until its last response: it is one execution.
    ticket = (await limits.hold(instance))[0] if limits is not None else None
    started = time.monotonic_ns()
    outcome: FailureReason | None = "CANCELED"
    failed = False
    try:
        async with contextlib.aclosing(instance.execute_stream(request)) as results:
            async for result in results:
                failed = failed or isinstance(result, EdgedError)
                yield result
        outcome = "OTHER" if failed else None
    finally:
        if limits is not None:
            limits.release(ticket)
        elapsed = time.monotonic_ns() - started
        rows = request.batch_size() if model.config.max_batch_size > 0 else 1
        model.stats.record_execution(rows, elapsed)  # performed, whatever its outcome
        if outcome is None:
            model.stats.record_success(
                elapsed, rows, queue_ns=0, compute_input_ns=0, compute_infer_ns=elapsed, compute_output_ns=0,
                tally=request.tally,
            )
        else:
            model.stats.record_failure(elapsed, outcome)
