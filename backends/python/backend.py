"""Python backend: Triton-style `model.py` files, run inside the daemon.

Triton runs each Python model instance in a separate stub process and copies every tensor through
shared memory (the "11-20 ms per request" often quoted for it did not hold here: Triton 2.51 answered
a small request in 0.22-0.33 ms p50 over HTTP; see docs/performance.md). Here the user's
`TritonPythonModel` lives in the daemon process, is called on its instance's own thread, and sees the request arrays themselves.
`import triton_python_backend_utils as pb_utils` resolves to this plugin's compatible module
(`triton_python_backend_utils.py` next to this file), so existing Triton models load unchanged.

Each instance imports its `model.py` under a unique module name: two models that both ship a
`model.py` (or two instances of one model) never share module state, as with Triton's separate
processes. The whole batch is handed to `execute` as a list, like Triton; nothing is merged.

Decoupled models (and models whose `execute` returns None) answer through response senders:
the model's threads push responses into a per-request queue on the event loop. `/infer` takes
exactly one response per request; `execute_stream` (generate_stream) yields them all.
`auto_complete_config` runs in `autocomplete`, before any instance loads, and its result is
validated like a written config. BLS calls run other models through the registry's hook in the
instance context, on the daemon's event loop. Custom metrics (`pb_utils.MetricFamily`) go to the
daemon's /metrics through the context's metrics hook; an instance's families close when it
unloads, after `finalize`. The model loading API (`pb_utils.load_model`, ...) runs the
repository's control through the context's control hook, on the loop, while the model's thread
waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import logging
import platform
import re
import sys
import time
import types
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np

from daemon.backend import (
    OFF_LOOP_BYTES,
    RESCHEDULED,
    Backend,
    BackendError,
    Capabilities,
    ConfigError,
    Device,
    EdgedError,
    ExecuteResult,
    InferRequest,
    InferResponse,
    InstanceContext,
    InvalidArgument,
    ModelConfig,
    ModelControl,
    NotFound,
    Probe,
    ResponseQueue,
    ResponseSink,
    StepResult,
    Unavailable,
    Unsupported,
    config_from_triton_json,
    datatype_of,
    decoupled_infer_error,
    select_outputs,
    to_triton_json,
)

from . import triton_python_backend_utils as pb_utils

log = logging.getLogger(__name__)

ARTIFACT = "model.py"
SHIM_MODULE = "triton_python_backend_utils"
MODEL_CLASS = "TritonPythonModel"

# TritonError codes -> the daemon's error classes (and so HTTP statuses); the rest are 500.
# Triton 2.51 answers UNKNOWN, ALREADY_EXISTS and CANCELLED with 400 too (checked side by side:
# its HTTP frontend's default), so those are client errors here.
_ERROR_CLASSES: dict[int, type[EdgedError]] = {
    pb_utils.TritonError.NOT_FOUND: NotFound,
    pb_utils.TritonError.INVALID_ARG: InvalidArgument,
    pb_utils.TritonError.UNAVAILABLE: Unavailable,
    pb_utils.TritonError.UNSUPPORTED: Unsupported,
    pb_utils.TritonError.UNKNOWN: InvalidArgument,
    pb_utils.TritonError.ALREADY_EXISTS: InvalidArgument,
    pb_utils.TritonError.CANCELLED: InvalidArgument,
}


class PythonBackend(Backend):
    name: ClassVar[str] = "python"
    # dynamic_batching: the scheduler may hand several requests to one execute(); they reach the
    # user's code as a list (Triton's contract), never merged along dim 0; so requests whose
    # ragged inputs differ in shape may share one (ragged_batching "requests").
    capabilities: ClassVar[Capabilities] = Capabilities(
        dynamic_batching=True, decoupled=True, queued_execute=True, rescheduling=True, ragged_batching="requests"
    )

    def __init__(self, context: InstanceContext) -> None:
        super().__init__(context)
        self.model: Any = None
        self.model_path: Path | None = None
        # The model file's directory (pb_utils.get_model_dir), set by load_sync.
        self._model_dir = ""
        self._model_name = context.model_name
        self._instance_name = f"{context.model_name}_0_{context.instance_index}"  # set on load
        self._module_name = ""
        # What `requested_output_names()` reports when a client asks for no output: all of them.
        self._output_names: tuple[str, ...] = ()
        self._output_set: frozenset[str] = frozenset()
        self._decoupled = False
        # `sequence_batching { iterative_sequence: true }`: the model may reschedule requests.
        self._iterative = False
        self._bytes_outputs = True
        # The daemon's event loop: responses and BLS calls cross over to it from model threads.
        self._loop: asyncio.AbstractEventLoop | None = None
        self.streams_active = 0
        self._streams: set[_Stream] = set()
        self._no_streams = asyncio.Event()
        self._no_streams.set()
        # How long unload lets open streams finish before it cancels them, then how long the
        # models get to send their final flag before the streams are ended for them.
        self.stream_drain_seconds = 10.0
        self.stream_cancel_grace_seconds = 1.0
        # The model's own metric families (pb_utils.MetricFamily); named on load.
        self._metrics = pb_utils.MetricsScope(context.metrics, self._instance_name)
        # pb_utils.load_model and friends, for this instance's initialize and execute.
        self._control = _ModelControl(self)

    @classmethod
    def probe(cls) -> Probe:
        return Probe(
            available=True, devices=("CPU",), runtime_version=f"CPython {platform.python_version()}"
        )

    @classmethod
    def autocomplete(cls, config: ModelConfig, artifact: Path) -> ModelConfig:
        """Triton's `auto_complete_config(auto_complete_model_config)`, if the model has one:
        it gets the config in Triton's JSON layout, and what it returns is validated exactly like
        a written config (unknown fields, datatypes, dims), errors naming the model file."""
        model_name = config.name
        path = _artifact_file(artifact, config, model_name)
        where = f"python: model {model_name!r} ({path})"
        sys.modules[SHIM_MODULE] = pb_utils
        module_name = f"edged_python_autocomplete_{re.sub(r'[^0-9A-Za-z_]', '_', model_name)}_{id(config):x}"
        module = cls._import(module_name, path, where)
        try:
            model_class = getattr(module, MODEL_CLASS, None)
            complete = getattr(model_class, "auto_complete_config", None)
            if not callable(complete):
                return config
            # A `decoupled: false` is left out as unset: the model may still declare itself
            # decoupled (Triton's common case).
            layout = to_triton_json(config)
            given = pb_utils.ModelConfig(msgspec.json.encode(layout).decode())
            directory = pb_utils.MODEL_DIR.set(str(path.parent))
            try:
                result = complete(given)
            except BaseException as exc:
                raise BackendError(
                    f"{where}: auto_complete_config raised {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                pb_utils.MODEL_DIR.reset(directory)
            if not callable(getattr(result, "as_dict", None)):
                raise BackendError(
                    f"{where}: auto_complete_config function in model '{model_name}' must return "
                    f"a valid pb.ModelConfig object."
                )
            try:
                text = json.dumps(result.as_dict())
            except (TypeError, ValueError) as exc:
                raise BackendError(f"{where}: auto_complete_config: {exc}") from exc
        finally:
            sys.modules.pop(module_name, None)
        completed, warnings = config_from_triton_json(text, source=f"{where} auto_complete_config")
        for warning in warnings:
            log.warning("%s", warning)
        return completed

    # ------------------------------------------------------------------ lifecycle

    async def load(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        self._loop = asyncio.get_running_loop()
        await self.run_blocking(self.load_sync, config, artifact, device)

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        model_name = self._model_name = config.name or self.context.model_name
        environment = config.parameters.get("EXECUTION_ENV_PATH", "")
        if environment:
            # Triton runs such a model's stub in that (conda-pack) Python; here it would run
            # in the daemon's own, with other packages than the model was packed with.
            raise ConfigError(
                f"python: model {model_name!r}: parameters.EXECUTION_ENV_PATH ({environment}) asks "
                "for a Python environment of its own, which edged does not provide: it runs python "
                "models in the daemon's interpreter. Install the model's packages there and remove "
                "the parameter"
            )
        self._instance_name = instance_name(config, model_name, self.context.instance_index)
        path = _artifact_file(artifact, config, model_name)
        where = f"python: model {model_name!r} ({path})"
        # Set on every load (not only the first) so a replaced plugin's module wins.
        sys.modules[SHIM_MODULE] = pb_utils
        module_name = self._unique_module_name(model_name)
        self._metrics.instance = self._instance_name
        token = pb_utils.METRICS.set(self._metrics)
        control = pb_utils.MODEL_CONTROL.set(self._control)
        self._model_dir = str(path.parent)
        directory = pb_utils.MODEL_DIR.set(self._model_dir)
        try:
            model = self._create(module_name, path, where, lambda: triton_args(config, self.context, path, device))
        except BaseException:
            sys.modules.pop(module_name, None)
            self._metrics.close()  # a failed load leaves no series behind
            raise
        finally:
            pb_utils.MODEL_DIR.reset(directory)
            pb_utils.MODEL_CONTROL.reset(control)
            pb_utils.METRICS.reset(token)
        self.model = model
        self.model_path = path
        self._module_name = module_name
        self._output_names = tuple(t.name for t in config.output)
        self._output_set = frozenset(self._output_names)
        # Whether a response may carry BYTES (an output without a config entry may).
        self._bytes_outputs = not config.output or any(t.data_type == "BYTES" for t in config.output)
        self._decoupled = config.model_transaction_policy.decoupled
        self._iterative = config.sequence_batching is not None and config.sequence_batching.iterative_sequence

    def _create(self, module_name: str, path: Path, where: str, args: Callable[[], dict[str, Any]]) -> Any:
        """Import the model's file and make its initialized model object."""
        module = self._import(module_name, path, where)
        model_class = getattr(module, MODEL_CLASS, None)
        if not isinstance(model_class, type):
            raise BackendError(f"{where}: defines no class {MODEL_CLASS}")
        try:
            model = model_class()
            initialize = getattr(model, "initialize", None)
            if callable(initialize):
                initialize(args())
        except BaseException as exc:
            log.error("%s: initialize failed", where, exc_info=True)
            raise BackendError(f"{where}: initialize raised {type(exc).__name__}: {exc}") from exc
        if not callable(getattr(model, "execute", None)):
            raise BackendError(f"{where}: {MODEL_CLASS} has no execute(self, requests) method")
        return model

    async def unload(self) -> None:
        """Open streams first finish (bounded), then are cancelled (the model sees
        is_cancelled()), then ended; only then does `finalize` run."""
        if self._streams:
            await self._wait_streams(self.stream_drain_seconds)
            for stream in self._streams:
                stream.cancelled = True
            await self._wait_streams(self.stream_cancel_grace_seconds)
            for stream in list(self._streams):
                stream.end(Unavailable(f"model {self._model_name!r} was unloaded"))
        await super().unload()

    async def _wait_streams(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_streams.wait(), seconds)

    def unload_sync(self) -> None:
        model, self.model = self.model, None
        token = pb_utils.METRICS.set(self._metrics)
        directory = pb_utils.MODEL_DIR.set(self._model_dir)
        try:
            finalize = getattr(model, "finalize", None)
            if callable(finalize):
                finalize()
        except BaseException:
            # Unload must finish whatever the user's cleanup does; say what failed.
            log.exception("python: model %r: finalize failed", self._model_name)
        finally:
            pb_utils.MODEL_DIR.reset(directory)
            pb_utils.METRICS.reset(token)
            sys.modules.pop(self._module_name, None)
            # The instance's series leave /metrics with it (those another instance or a
            # reload's new version also holds stay).
            self._metrics.close()

    # ------------------------------------------------------------------ inference

    async def execute(self, batch: Sequence[InferRequest]) -> list[ExecuteResult]:
        # Without sinks nothing is RESCHEDULED or None: only responses and errors come back.
        return await self._execute(batch, None)  # type: ignore[return-value]

    async def execute_step(
        self, batch: Sequence[InferRequest], sinks: Sequence[ResponseSink | None]
    ) -> list[StepResult]:
        return await self._execute(batch, sinks)

    async def _execute(
        self, batch: Sequence[InferRequest], sinks: Sequence[ResponseSink | None] | None
    ) -> list[StepResult]:
        """`execute` (sinks None: the one response of each request) and `execute_step`."""
        started = time.perf_counter_ns()
        if sinks is None:
            streams = [_Stream(self._loop) for _ in batch]
        else:
            streams = [
                _Stream(self._loop) if sink is None else _SinkStream(self._loop, sink, request, self._result)
                for request, sink in zip(batch, sinks, strict=True)
            ]
        requests = [self._pb_request(r, s) for r, s in zip(batch, streams, strict=True)]
        prepared = time.perf_counter_ns()
        try:
            responses = await self.run_blocking(self._call_execute, requests)
        except EdgedError as exc:
            return [exc for _ in batch]
        except Exception as exc:  # includes "not loaded" after unload (executor shut down)
            error = BackendError(
                f"python: model {self._model_name!r}: execute failed: {type(exc).__name__}: {exc}"
            )
            return [error for _ in batch]
        if any(r._release_flags != pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL for r in requests):
            return await self._released(batch, streams, requests, responses, sinks is not None)
        if responses is None:
            # Answered through response senders (decoupled, or Triton's non-decoupled sender).
            return [
                None if isinstance(stream, _SinkStream) else await self._single(request, stream)
                for request, stream in zip(batch, streams, strict=True)
            ]
        if self._decoupled:
            error = BackendError(self._decoupled_return_error())
            return [error for _ in batch]
        if not isinstance(responses, list | tuple) or len(responses) != len(batch):
            return [self._count_error(responses, len(batch)) for _ in batch]
        ran = time.perf_counter_ns()
        if self._bytes_outputs and _large_bytes_outputs(responses):
            # Each BYTES element is converted in Python: for a large output, on the instance's
            # thread (small ones stay here: two threads running Python contend for the GIL).
            results = await self.run_blocking(self._results, batch, responses)
        else:
            results = self._results(batch, responses)
        # Triton's python backend splits its compute time so too: the requests handed to the
        # model (compute_input), `execute` (compute_infer), its responses read back (output).
        self.phase_ns = (prepared - started, time.perf_counter_ns() - ran)
        return list(results)

    def _count_error(self, responses: Any, count: int) -> BackendError:
        got = f"{len(responses)} item(s)" if isinstance(responses, list | tuple) else type(responses).__name__
        return BackendError(
            f"python: model {self._model_name!r}: execute returned {got} for {count} "
            "request(s); it must return one InferenceResponse per request"
        )

    async def _released(
        self,
        batch: Sequence[InferRequest],
        streams: Sequence[_Stream],
        requests: Sequence[pb_utils.InferenceRequest],
        responses: Any,
        stepped: bool,
    ) -> list[StepResult]:
        """A batch in which the model rescheduled requests (`set_release_flags`), as Triton
        2.51's python backend: a rescheduled request gets no response now (a non-decoupled
        model returns None for it) and runs again; only the sequence batcher of an iterative
        sequence model (`execute_step`) can run it again, so elsewhere it is an error (Triton
        leaves such a request unanswered: its client waits forever)."""
        again = [r._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE for r in requests]
        allowed = self._iterative and stepped
        refused = self._not_iterative()
        if responses is not None and not self._decoupled:
            if not isinstance(responses, list | tuple) or len(responses) != len(batch):
                return [self._count_error(responses, len(batch)) for _ in batch]
            for response, rescheduled in zip(responses, again, strict=True):
                if rescheduled and response is not None and allowed:
                    # Triton's text (its typo too), for the whole batch as there.
                    error = BackendError(
                        f"Failed to process the request(s) for model '{self._instance_name}', message: "
                        "Expected a None object in the execute function return list for reschduled "
                        f"request, found type '{type(response)}'."
                    )
                    return [error for _ in batch]
        elif responses is not None:
            error = BackendError(self._decoupled_return_error())
            return [error for _ in batch]
        results: list[StepResult] = []
        for index, (request, stream) in enumerate(zip(batch, streams, strict=True)):
            if again[index]:
                results.append(RESCHEDULED if allowed else refused)
            elif isinstance(stream, _SinkStream):
                results.append(None)
            elif responses is None:
                results.append(await self._single(request, stream))
            else:
                results.append(self._result(request, responses[index]))
        return results

    async def _single(self, request: InferRequest, stream: _Stream) -> ExecuteResult:
        """The one response `/infer` can carry, as Triton: any other count is an error."""
        results: list[ExecuteResult] = []
        async for response in stream.responses():
            results.append(self._result(request, response))
        if len(results) == 1:
            return results[0]
        if self._decoupled:
            # Triton refuses every decoupled model on HTTP infer (501, this text); edged serves
            # the single-response case and refuses the rest as Triton does.
            return decoupled_infer_error(self._model_name, len(results))
        return BackendError(f"expected a single response, got {len(results)}")

    async def execute_stream(self, request: InferRequest) -> AsyncGenerator[ExecuteResult, None]:
        stream = _Stream(self._loop)
        pb_request = self._pb_request(request, stream)
        self._streams.add(stream)
        self._no_streams.clear()
        self.streams_active = len(self._streams)
        finished = False
        try:
            task = asyncio.ensure_future(self.run_blocking(self._call_execute, [pb_request]))
            task.add_done_callback(lambda done: self._execute_returned(done, stream, pb_request))
            async for response in stream.responses():
                yield response if isinstance(response, EdgedError) else self._result(request, response)
            finished = True
        finally:
            if not finished:
                # The consumer went away (client disconnect): the model sees is_cancelled().
                stream.cancelled = True
            self._streams.discard(stream)
            self.streams_active = len(self._streams)
            if not self._streams:
                self._no_streams.set()

    def _execute_returned(
        self, done: asyncio.Future[Any], stream: _Stream, pb_request: pb_utils.InferenceRequest
    ) -> None:
        """On the loop, once `execute` returned for a streamed request: a raise or a returned
        response ends the stream; None leaves it to the response sender."""
        if done.cancelled():
            stream.end(BackendError(f"python: model {self._model_name!r}: execute was cancelled"))
            return
        exc = done.exception()
        if exc is not None:
            error = exc if isinstance(exc, EdgedError) else BackendError(
                f"python: model {self._model_name!r}: execute failed: {type(exc).__name__}: {exc}"
            )
            stream.end(error)
            return
        responses = done.result()
        if pb_request._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            # Only the sequence batcher runs a request again (`execute_step`).
            stream.end(self._not_iterative())
            return
        if responses is None:
            return
        if self._decoupled:
            stream.end(BackendError(self._decoupled_return_error()))
        elif isinstance(responses, list | tuple) and len(responses) == 1:
            stream.end(responses[0])
        else:
            stream.end(BackendError(
                f"python: model {self._model_name!r}: execute must return one InferenceResponse "
                "per request"
            ))

    def _not_iterative(self) -> BackendError:
        # Triton's words, and what the config lacks.
        return BackendError(
            "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the model is not "
            f"configured to handle such a flag (model '{self._model_name}' needs sequence_batching "
            "{ iterative_sequence: true })"
        )

    def _decoupled_return_error(self) -> str:
        return (
            f"python: model {self._model_name!r} is decoupled: execute must return None and send "
            "responses through request.get_response_sender()"
        )

    def _pb_request(self, request: InferRequest, stream: _Stream) -> pb_utils.InferenceRequest:
        pb_request = pb_utils.InferenceRequest(
            inputs=[pb_utils.Tensor._trusted(name, array) for name, array in request.inputs.items()],
            request_id=request.id,
            requested_output_names=request.requested_outputs or self._output_names,
            # Triton's spelling: compact, UTF-8 unescaped (a model may compare the text).
            parameters=json.dumps(request.parameters, separators=(",", ":"), ensure_ascii=False)
            if request.parameters else "{}",
            model_name=self._model_name,
            model_version=self.context.model_version,
            correlation_id=request.correlation_id,
            flags=request.flags,
            timeout=request.timeout_us,
        )
        pb_request._sender = pb_utils.InferenceResponseSender(stream.push, stream.is_cancelled)
        pb_request._is_cancelled = stream.is_cancelled
        return pb_request

    def _call_execute(self, requests: list[pb_utils.InferenceRequest]) -> Any:
        """Runs on the instance thread."""
        model = self.model
        if model is None:
            raise BackendError(f"python: model {self._model_name!r} is not loaded")
        token = pb_utils.BLS_EXECUTOR.set(self._bls)
        metrics = pb_utils.METRICS.set(self._metrics)
        control = pb_utils.MODEL_CONTROL.set(self._control)
        directory = pb_utils.MODEL_DIR.set(self._model_dir)
        try:
            result = model.execute(requests)
            if inspect.isawaitable(result):
                # Triton allows `async def execute`; give it an event loop on this thread so the
                # daemon's loop is never blocked by the model's code.
                result = asyncio.run(_wait(result))
        except BaseException as exc:
            log.warning("python: model %r: execute raised", self._model_name, exc_info=True)
            # Triton's words (without the traceback, which goes to the log).
            raise BackendError(
                f"Failed to process the request(s) for model '{self._instance_name}', message: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            pb_utils.MODEL_DIR.reset(directory)
            pb_utils.MODEL_CONTROL.reset(control)
            pb_utils.METRICS.reset(metrics)
            pb_utils.BLS_EXECUTOR.reset(token)
        return result

    # ------------------------------------------------------------------ BLS

    def _bls(self, pb_request: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        """Start a BLS request on the daemon's loop (called on a model thread): a concurrent
        future of the response, or for `decoupled` a ResponseIterator over the responses."""
        loop = self._loop
        hook = self.context.stream if decoupled else self.context.infer
        if hook is None or loop is None:
            raise pb_utils.TritonModelException(
                "BLS calls are not available: this instance runs outside the daemon's registry"
            )
        try:
            parameters = json.loads(pb_request.parameters())
            inputs = {t.name(): _output_array(t.as_numpy()) for t in pb_request.inputs()}
        except (EdgedError, TypeError, ValueError) as exc:
            raise pb_utils.TritonModelException(f"BLS request: {exc}") from exc
        if not isinstance(parameters, dict):
            raise pb_utils.TritonModelException("BLS request: parameters must be a JSON object")
        correlation_id, flags = pb_request.correlation_id(), pb_request.flags()
        if not (isinstance(correlation_id, str) or (type(correlation_id) is int and 0 <= correlation_id < 2**64)):
            raise pb_utils.TritonModelException(
                f"BLS request: correlation_id must be an unsigned 64-bit integer or a string, got {correlation_id!r}"
            )
        if type(flags) is not int or not 0 <= flags <= 3:
            raise pb_utils.TritonModelException(
                f"BLS request: flags must be TRITONSERVER_REQUEST_FLAG_SEQUENCE_START and/or _END, got {flags!r}"
            )
        request = InferRequest(
            inputs,
            id=pb_request.request_id(),
            requested_outputs=tuple(pb_request._requested),  # in the model's order
            parameters=parameters,
            timeout_us=pb_request.timeout(),
            # A model drives a sequence model through BLS as a client would (Triton does too).
            correlation_id=correlation_id,
            flags=flags,
        )
        name = pb_request.model_name()
        version = None if pb_request.model_version() < 0 else str(pb_request.model_version())
        if decoupled:
            assert self.context.stream is not None
            return _bls_iterator(self.context.stream(name, version, request), loop)
        assert self.context.infer is not None
        infer = self.context.infer

        async def call() -> pb_utils.InferenceResponse:
            try:
                return _pb_response(await infer(name, version, request))
            except EdgedError as exc:
                return _pb_response(exc)

        return asyncio.run_coroutine_threadsafe(call(), loop)

    def _results(self, batch: Sequence[InferRequest], responses: Sequence[Any]) -> list[ExecuteResult]:
        return [self._result(request, response) for request, response in zip(batch, responses, strict=True)]

    def _result(self, request: InferRequest, response: Any) -> ExecuteResult:
        """One user response -> the daemon's response or error (duck-typed: a model may hold
        classes from an older copy of the compatibility module after a plugin reload)."""
        name = self._model_name
        if not callable(getattr(response, "output_tensors", None)):
            return BackendError(
                f"python: model {name!r}: execute returned a {type(response).__name__} where an "
                "InferenceResponse was expected"
            )
        error = response.error() if callable(getattr(response, "error", None)) else None
        if error is not None:
            code = error.code() if callable(getattr(error, "code", None)) else 0
            message = error.message() if callable(getattr(error, "message", None)) else str(error)
            # The model's own message, as Triton passes it to the client.
            return _ERROR_CLASSES.get(code, BackendError)(str(message))
        outputs: dict[str, np.ndarray] = {}
        for tensor in response.output_tensors():
            try:
                outputs[tensor.name()] = _output_array(tensor.as_numpy())
            except (EdgedError, TypeError, ValueError) as exc:
                return BackendError(f"python: model {name!r}: output {tensor.name()!r}: {exc}")
        parameters = getattr(response, "_parameters", None)
        if request.requested_outputs:
            outputs = select_outputs(outputs, request.requested_outputs)
        elif not outputs.keys() <= self._output_set and self._output_set:
            # A request that names no output gets the config's, not whatever else the model
            # returns (Triton 2.51 drops the rest, checked side by side).
            outputs = select_outputs(outputs, self._output_names)
        return InferResponse(
            outputs,
            dict(parameters) if isinstance(parameters, dict) else {},
        )

    # ------------------------------------------------------------------ helpers

    def _unique_module_name(self, model_name: str) -> str:
        safe = re.sub(r"\W", "_", model_name)
        ctx = self.context
        # id(self) separates a reload of the same version (load-new-then-swap keeps both alive).
        return f"edged_python_model_{safe}_v{ctx.model_version}_i{ctx.instance_index}_{id(self):x}"

    @staticmethod
    def _import(module_name: str, path: Path, where: str) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise BackendError(f"{where}: cannot make an import spec")
        module = importlib.util.module_from_spec(spec)
        # In sys.modules while it runs, so dataclasses, pickle and typing can find it.
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:
            sys.modules.pop(module_name, None)
            log.error("%s: import failed", where, exc_info=True)
            raise BackendError(f"{where}: importing it raised {type(exc).__name__}: {exc}") from exc
        return module


class _ModelControl:
    """What `pb_utils.load_model`, `unload_model` and `is_model_ready` call, on a model's
    thread: the repository's control (the context's hook) runs on the daemon's loop, and the
    thread waits for it, as Triton's stub waits for its server."""

    def __init__(self, backend: PythonBackend) -> None:
        self._backend = backend

    @property
    def instance(self) -> str:
        return self._backend._instance_name

    def load(self, name: str, config_json: str | None, files: dict[str, bytes]) -> None:
        self._not_itself(name, "load")
        self._run(lambda control: control.load(name, config_json, files))

    def unload(self, name: str, dependents: bool) -> None:
        self._not_itself(name, "unload")
        self._run(lambda control: control.unload(name, dependents))

    def is_ready(self, name: str, version: str) -> bool:
        async def ready(control: ModelControl) -> bool:
            return control.is_ready(name, version)

        return bool(self._run(ready))

    def _not_itself(self, name: str, verb: str) -> None:
        # Its own reload or unload would wait for the request that asks for it to finish.
        if name == self._backend._model_name:
            raise InvalidArgument(f"model '{name}' cannot {verb} itself")

    def _run(self, call: Callable[[ModelControl], Awaitable[Any]]) -> Any:
        control, loop = self._backend.context.control, self._backend._loop
        if control is None or loop is None:
            raise Unavailable("model control is not available: this instance runs outside the daemon's repository")
        return asyncio.run_coroutine_threadsafe(_wait(call(control)), loop).result()


async def _wait(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class _Stream(ResponseQueue):
    """The responses of one request, on their way from model threads to the event loop
    (pb_utils responses, or EdgedErrors).

    Made for every request (a model may ask for its sender from a thread it starts after
    `execute` returned), so it is kept cheap: a ResponseQueue, not an asyncio.Queue and a
    threading.Event (7 us per request measured here)."""

    __slots__ = ("_loop", "cancelled")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        super().__init__()
        self._loop = loop
        # Set on the loop when the consumer goes away; read by model threads (a bool is atomic).
        self.cancelled = False

    def is_cancelled(self) -> bool:
        return self.cancelled

    def push(self, response: Any, flags: int) -> None:
        """The response sender's callback (any thread)."""
        final = bool(flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if self._loop is None:
            raise pb_utils.TritonModelException("the model is not loaded")
        try:
            self._loop.call_soon_threadsafe(self._put, response, final)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            self.cancelled = True

    def end(self, last: Any) -> None:
        """On the loop: a final item (a response or an EdgedError)."""
        self._put(last, True)

    def _put(self, response: Any, final: bool) -> None:
        self.put(response, final)


class _SinkStream(_Stream):
    """The responses of a request the sequence batcher runs (`execute_step`), delivered to its
    sink as they come: they outlive this execution when the request is rescheduled."""

    __slots__ = ("_convert", "_request", "_sink")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None,
        sink: ResponseSink,
        request: InferRequest,
        convert: Callable[[InferRequest, Any], ExecuteResult],
    ) -> None:
        super().__init__(loop)
        self._sink = sink
        self._request = request
        self._convert = convert

    def is_cancelled(self) -> bool:
        return self.cancelled or self._sink.cancelled

    def _put(self, response: Any, final: bool) -> None:
        if response is not None and not isinstance(response, EdgedError):
            response = self._convert(self._request, response)
        self._sink.send(response, final)


def _pb_response(result: ExecuteResult) -> pb_utils.InferenceResponse:
    """A daemon response or error as the pb_utils response a BLS caller gets."""
    if isinstance(result, EdgedError):
        return pb_utils.InferenceResponse(
            error=pb_utils.TritonError(result.message, _triton_code(result))
        )
    response = pb_utils.InferenceResponse(
        [pb_utils.Tensor._trusted(name, array) for name, array in result.outputs.items()]
    )
    # Set directly: another backend's response parameters may hold what a model may not set.
    response._parameters = dict(result.parameters)
    return response


def _bls_iterator(
    results: AsyncGenerator[ExecuteResult, None], loop: asyncio.AbstractEventLoop
) -> pb_utils.ResponseIterator:
    """Drive a decoupled BLS stream, which lives on the loop, from a model thread."""

    async def step() -> pb_utils.InferenceResponse | None:
        try:
            return _pb_response(await results.__anext__())
        except StopAsyncIteration:
            return None
        except EdgedError as exc:  # refused before it ran: one error response, then the end
            return _pb_response(exc)

    def next_item() -> pb_utils.InferenceResponse | None:
        return asyncio.run_coroutine_threadsafe(step(), loop).result()

    def cancel() -> None:
        # Not waited for: closing runs the callee's cleanup on the loop.
        asyncio.run_coroutine_threadsafe(results.aclose(), loop)

    return pb_utils.ResponseIterator(next_item, cancel)


def _triton_code(exc: EdgedError) -> int:
    for code, kind in _ERROR_CLASSES.items():
        if isinstance(exc, kind):
            return code
    return pb_utils.TritonError.INTERNAL


def _artifact_file(artifact: Path, config: ModelConfig, model_name: str) -> Path:
    path = artifact / (config.default_model_filename or ARTIFACT) if artifact.is_dir() else artifact
    if not path.is_file():
        raise BackendError(f"python: model {model_name!r}: {path} does not exist")
    return path


def _large_bytes_outputs(responses: Sequence[Any]) -> bool:
    """Whether the responses' BYTES outputs add up to OFF_LOOP_BYTES (a look only: anything
    unexpected is for `_result` to report)."""
    total = 0
    try:
        for response in responses:
            for tensor in response.output_tensors():
                array = tensor.as_numpy()
                if isinstance(array, np.ndarray) and array.dtype.kind in ("O", "S", "U"):
                    total += array.nbytes
    except Exception:
        return False
    return total >= OFF_LOOP_BYTES


def _output_array(value: Any) -> np.ndarray:
    """A model output as the daemon carries it: BYTES as an object array of bytes. Any other
    object becomes its text, as Triton's python backend serializes it (`1` is "1"; `bytes(1)`
    would be a zero byte)."""
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.dtype.kind in ("O", "S", "U"):
        out = np.empty(array.size, dtype=np.object_)
        # tolist() and an exact type test: a BYTES output may have a million elements (4.6x
        # faster than iterating the array itself; smaller outputs are read on the event loop).
        out[:] = [
            v if type(v) is bytes
            else bytes(v) if isinstance(v, (bytes, bytearray, memoryview))
            else str(v).encode("utf-8")
            for v in array.reshape(-1).tolist()
        ]
        return out.reshape(array.shape)
    datatype_of(array)  # raises InvalidArgument for dtypes KServe cannot carry (complex, ...)
    return array


def instance_name(config: ModelConfig, model_name: str, index: int) -> str:
    """Triton's name of the model's `index`-th instance: its group's name (`<model>_<group
    index>` when the config names none) and its place in the group, e.g. `simple_0_1`; without
    any group, `<model>_<index>`."""
    for number, group in enumerate(config.instance_group):
        if index < group.count:
            return f"{group.name or f'{model_name}_{number}'}_{index}"
        index -= group.count
    # No instance_group: Triton makes one group named after the model (2.51, checked side by side).
    return f"{model_name}_{index}"


def triton_args(
    config: ModelConfig, context: InstanceContext, path: Path, device: Device
) -> dict[str, str]:
    """Triton's `initialize(args)` dict; every value is a string, as in Triton."""
    model_name = config.name or context.model_name
    gpu = device.gpu
    return {
        "model_config": msgspec.json.encode(
            to_triton_json(config, model_name=model_name, count=context.instance_count, gpu=gpu, filename=path.name)
        ).decode(),
        "model_instance_kind": "CPU" if gpu is None else "GPU",
        "model_instance_name": instance_name(config, model_name, context.instance_index),
        "model_instance_device_id": "0" if gpu is None else str(gpu),
        # Triton's "repository" entry is the model's own directory (<repo>/<model>).
        "model_repository": str(path.parent.parent),
        "model_version": str(context.model_version),
        "model_name": model_name,
    }
