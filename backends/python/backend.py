"""Python backend: Triton-style `model.py` files, run inside the daemon.

Triton runs each Python model instance in a separate stub process and copies every tensor through
shared memory, which costs 11-20 ms per request. Here the user's `TritonPythonModel` lives in the
daemon process, is called on its instance's own thread, and sees the request arrays themselves.
`import triton_python_backend_utils as pb_utils` resolves to this plugin's compatible module
(`triton_python_backend_utils.py` next to this file), so existing Triton models load unchanged.

Each instance imports its `model.py` under a unique module name: two models that both ship a
`model.py` (or two instances of one model) never share module state, as with Triton's separate
processes. The whole batch is handed to `execute` as a list, like Triton; nothing is merged.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import logging
import platform
import re
import sys
import types
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np

from daemon.backend import (
    Backend,
    Capabilities,
    Device,
    ExecuteResult,
    InferRequest,
    InferResponse,
    InstanceContext,
    Probe,
    datatype_of,
    select_outputs,
)
from daemon.errors import (
    BackendError,
    EdgedError,
    InvalidArgument,
    NotFound,
    Unavailable,
    Unsupported,
)
from daemon.model_config import ModelConfig, to_triton_json

from . import triton_python_backend_utils as pb_utils

log = logging.getLogger(__name__)

ARTIFACT = "model.py"
SHIM_MODULE = "triton_python_backend_utils"
MODEL_CLASS = "TritonPythonModel"

# TritonError codes -> the daemon's error classes (and so HTTP statuses); the rest are 500.
_ERROR_CLASSES: dict[int, type[EdgedError]] = {
    pb_utils.TritonError.NOT_FOUND: NotFound,
    pb_utils.TritonError.INVALID_ARG: InvalidArgument,
    pb_utils.TritonError.UNAVAILABLE: Unavailable,
    pb_utils.TritonError.UNSUPPORTED: Unsupported,
}


class PythonBackend(Backend):
    name: ClassVar[str] = "python"
    # dynamic_batching: the scheduler may hand several requests to one execute(); they reach the
    # user's code as a list (Triton's contract), never merged along dim 0.
    capabilities: ClassVar[Capabilities] = Capabilities(dynamic_batching=True)

    def __init__(self, context: InstanceContext) -> None:
        super().__init__(context)
        self.model: Any = None
        self.model_path: Path | None = None
        self._model_name = context.model_name
        self._module_name = ""
        # What `requested_output_names()` reports when a client asks for no output: all of them.
        self._output_names: tuple[str, ...] = ()

    @classmethod
    def probe(cls) -> Probe:
        return Probe(
            available=True, devices=("CPU",), runtime_version=f"CPython {platform.python_version()}"
        )

    # ------------------------------------------------------------------ lifecycle

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        model_name = self._model_name = config.name or self.context.model_name
        path = _artifact_file(artifact, config, model_name)
        where = f"python: model {model_name!r} ({path})"
        # Set on every load (not only the first) so a replaced plugin's module wins.
        sys.modules[SHIM_MODULE] = pb_utils
        module_name = self._unique_module_name(model_name)
        module = self._import(module_name, path, where)
        model_class = getattr(module, MODEL_CLASS, None)
        if not isinstance(model_class, type):
            sys.modules.pop(module_name, None)
            raise BackendError(f"{where}: defines no class {MODEL_CLASS}")
        try:
            model = model_class()
            initialize = getattr(model, "initialize", None)
            if callable(initialize):
                initialize(triton_args(config, self.context, path, str(device)))
        except (Exception, SystemExit) as exc:
            sys.modules.pop(module_name, None)
            log.error("%s: initialize failed", where, exc_info=True)
            raise BackendError(f"{where}: initialize raised {type(exc).__name__}: {exc}") from exc
        if not callable(getattr(model, "execute", None)):
            sys.modules.pop(module_name, None)
            raise BackendError(f"{where}: {MODEL_CLASS} has no execute(self, requests) method")
        self.model = model
        self.model_path = path
        self._module_name = module_name
        self._output_names = tuple(t.name for t in config.output)

    def unload_sync(self) -> None:
        model, self.model = self.model, None
        try:
            finalize = getattr(model, "finalize", None)
            if callable(finalize):
                finalize()
        except (Exception, SystemExit):
            # Unload must finish whatever the user's cleanup does; say what failed.
            log.exception("python: model %r: finalize failed", self._model_name)
        finally:
            sys.modules.pop(self._module_name, None)

    # ------------------------------------------------------------------ inference

    async def execute(self, batch: Sequence[InferRequest]) -> list[ExecuteResult]:
        requests = [
            pb_utils.InferenceRequest(
                inputs=[pb_utils.Tensor(name, array) for name, array in request.inputs.items()],
                request_id=request.id,
                requested_output_names=request.requested_outputs or self._output_names,
                parameters=json.dumps(request.parameters),
                model_name=self._model_name,
            )
            for request in batch
        ]
        try:
            responses = await self.run_blocking(self._call_execute, requests)
        except EdgedError as exc:
            return [exc for _ in batch]
        except Exception as exc:  # includes "not loaded" after unload (executor shut down)
            error = BackendError(
                f"python: model {self._model_name!r}: execute failed: {type(exc).__name__}: {exc}"
            )
            return [error for _ in batch]
        if not isinstance(responses, list | tuple) or len(responses) != len(batch):
            got = (
                f"{len(responses)} item(s)"
                if isinstance(responses, list | tuple)
                else type(responses).__name__
            )
            error = BackendError(
                f"python: model {self._model_name!r}: execute returned {got} for {len(batch)} "
                "request(s); it must return one InferenceResponse per request"
            )
            return [error for _ in batch]
        return [
            self._result(request, response)
            for request, response in zip(batch, responses, strict=True)
        ]

    def _call_execute(self, requests: list[pb_utils.InferenceRequest]) -> Any:
        """Runs on the instance thread."""
        model = self.model
        if model is None:
            raise BackendError(f"python: model {self._model_name!r} is not loaded")
        try:
            result = model.execute(requests)
            if inspect.isawaitable(result):
                # Triton allows `async def execute`; give it an event loop on this thread so the
                # daemon's loop is never blocked by the model's code.
                result = asyncio.run(_wait(result))
        except (Exception, SystemExit) as exc:
            log.warning("python: model %r: execute raised", self._model_name, exc_info=True)
            raise BackendError(
                f"python: model {self._model_name!r}: execute raised {type(exc).__name__}: {exc}"
            ) from exc
        return result

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
            return _ERROR_CLASSES.get(code, BackendError)(f"model {name!r}: {message}")
        outputs: dict[str, np.ndarray] = {}
        for tensor in response.output_tensors():
            try:
                outputs[tensor.name()] = _output_array(tensor.as_numpy())
            except (EdgedError, TypeError, ValueError) as exc:
                return BackendError(f"python: model {name!r}: output {tensor.name()!r}: {exc}")
        return InferResponse(select_outputs(outputs, request.requested_outputs))

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
        except (Exception, SystemExit) as exc:
            sys.modules.pop(module_name, None)
            log.error("%s: import failed", where, exc_info=True)
            raise BackendError(f"{where}: importing it raised {type(exc).__name__}: {exc}") from exc
        return module


async def _wait(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _artifact_file(artifact: Path, config: ModelConfig, model_name: str) -> Path:
    path = artifact / (config.default_model_filename or ARTIFACT) if artifact.is_dir() else artifact
    if not path.is_file():
        raise BackendError(f"python: model {model_name!r}: {path} does not exist")
    return path


def _output_array(value: Any) -> np.ndarray:
    """A model output as the daemon carries it: BYTES as an object array of bytes."""
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.dtype.kind in ("O", "S", "U"):
        out = np.empty(array.size, dtype=np.object_)
        out[:] = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in array.reshape(-1)]
        return out.reshape(array.shape)
    datatype_of(array)  # raises InvalidArgument for dtypes KServe cannot carry (complex, ...)
    return array


def triton_args(
    config: ModelConfig, context: InstanceContext, path: Path, device: str
) -> dict[str, str]:
    """Triton's `initialize(args)` dict; every value is a string, as in Triton."""
    model_name = config.name or context.model_name
    match = re.search(r"(\d+)$", device)
    return {
        "model_config": msgspec.json.encode(to_triton_json(config)).decode(),
        "model_instance_kind": "GPU" if device.upper().startswith("GPU") else "CPU",
        "model_instance_name": f"{model_name}_{context.instance_index}",
        "model_instance_device_id": match.group(1) if match else "0",
        # Triton's "repository" entry is the model's own directory (<repo>/<model>).
        "model_repository": str(path.parent.parent),
        "model_version": str(context.model_version),
        "model_name": model_name,
    }
