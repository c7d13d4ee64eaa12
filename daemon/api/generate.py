"""Triton's generate extension for tensor models (`/v2/models/{m}[/versions/{v}]/generate` and
`generate_stream`), decoupled or not.

As in Triton's HTTP server: every key of the JSON body (and of its `parameters` object) that
names a model input becomes that input, its dtype from the config and its shape spread over
the input's dims (fixed dims first, the innermost variable dim takes the rest); every other key
becomes a request parameter (string, number or boolean). Each response becomes one JSON object:
`id` (when given), `model_name`, `model_version`, the response's parameters and every output
(one element as a scalar, more as a flat list), keys sorted as Triton writes them. `generate` needs exactly one response;
`generate_stream` sends each as a Server-Sent Event, errors after the first as `{"error": ...}`
events. Generation (LLM) backends keep their own schema in `daemon.api.openai`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from daemon.api.body import read_body
from daemon.api.infer import large_outputs
from daemon.api.kserve_codec import float_list
from daemon.api.leases import use
from daemon.api.state import daemon_of
from daemon.backend import NUMPY_DTYPES, OFF_LOOP_BYTES, ExecuteResult, InferRequest, InferResponse
from daemon.core import decoupled
from daemon.core.model import LoadedVersion
from daemon.errors import BackendError, EdgedError, InvalidArgument, Unavailable
from daemon.model_config import ModelConfig, TensorConfig

_json = msgspec.json.Encoder()
_INTEGER_KINDS = ("i", "u")
_NOT_IN_JSON = ("FP16", "BF16")


def tensor_model(request: web.Request) -> LoadedVersion | None:
    """The addressed model when it is a tensor model (None for generation backends), entered
    for the request (its body is read after)."""
    model = daemon_of(request).registry.get(
        request.match_info["model"], request.match_info.get("version")
    )
    return None if model.generator is not None else use(request, model)


async def handle(request: web.Request, model: LoadedVersion, stream: bool) -> web.StreamResponse:
    daemon = daemon_of(request)
    if not daemon.accepting:
        raise Unavailable("server is shutting down")
    body = await read_body(request, daemon.config.server.max_request_bytes)
    if len(body) >= OFF_LOOP_BYTES:  # megabytes of JSON: not on the event loop
        infer_request = await asyncio.to_thread(_request_of, body, model.config)
    else:
        infer_request = _request_of(body, model.config)
    results = decoupled.responses(model, infer_request)
    async with contextlib.aclosing(results):
        if not stream:
            collected = [result async for result in results]
            if len(collected) != 1:
                raise BackendError(
                    "generate expects model to produce exactly 1 response, use generate stream "
                    "for model that generates various number of responses"
                )
            only = collected[0]
            if isinstance(only, EdgedError):
                raise only
            if large_outputs(only.outputs):
                payload = await asyncio.to_thread(_encoded, model, infer_request.id, only)
            else:
                payload = _encoded(model, infer_request.id, only)
            return web.Response(body=payload, content_type="application/json")
        response: web.StreamResponse | None = None
        async for result in results:
            if response is None:
                # The first response sets the status (an error's own status, as Triton); errors
                # before inference began were raised and answered as plain JSON.
                status = result.status if isinstance(result, EdgedError) else 200
                response = await _start_sse(request, status)
            await response.write(
                b"data: " + _json.encode(_event(model, infer_request.id, result)) + b"\n\n"
            )
        if response is None:  # the model sent only the final flag
            response = await _start_sse(request, 200)
        await response.write_eof()
        return response


async def _start_sse(request: web.Request, status: int) -> web.StreamResponse:
    response = web.StreamResponse(
        status=status,
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"},
    )
    await response.prepare(request)
    return response


def _event(model: LoadedVersion, request_id: str, result: ExecuteResult) -> dict[str, Any]:
    if isinstance(result, EdgedError):
        return {"error": result.message}
    try:
        return to_json(model, request_id, result)
    except EdgedError as exc:
        return {"error": exc.message}


def _request_of(body: bytes, config: ModelConfig) -> InferRequest:
    return to_request(_decode(body), config)


def _encoded(model: LoadedVersion, request_id: str, response: InferResponse) -> bytes:
    return _json.encode(to_json(model, request_id, response))


def _decode(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument("the generate request body must be a JSON object")
    return data


# ---------------------------------------------------------------------------- request


def to_request(body: dict[str, Any], config: ModelConfig) -> InferRequest:
    """The generate body as an inference request for `config`'s model."""
    inputs: dict[str, np.ndarray] = {}
    parameters: dict[str, Any] = {}
    request_id = body.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("'id' must be a string")

    def put(key: str, value: Any) -> None:
        tensor = config.input_by_name(key)
        if tensor is None:
            parameters[key] = _parameter(key, value)
        elif key in inputs:
            raise InvalidArgument(
                f"Converting keyword: 'parameters': input '{key}' already exists in request"
            )
        else:
            inputs[key] = _tensor(value, tensor, config.max_batch_size)

    for key, value in body.items():
        if key == "id":
            continue
        if key == "parameters":
            if config.input_by_name(key) is not None:
                raise InvalidArgument(
                    "Keyword 'parameters' for nested schema also given as input tensor name"
                )
            if not isinstance(value, dict):
                raise InvalidArgument("Expected JSON object for keyword: 'parameters'")
            for name, item in value.items():
                put(name, item)
        else:
            put(key, value)
    return InferRequest(inputs, id=request_id, parameters=parameters)


def _parameter(key: str, value: Any) -> str | int | float | bool:
    if isinstance(value, str | bool | int | float):
        return value
    # Triton's words (it accepts doubles too, without saying so).
    raise InvalidArgument(
        f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'."
    )


def _values(value: Any, name: str) -> list[Any]:
    """A scalar or a flat list, as Triton reads generate values (it has no nested shapes)."""
    if not isinstance(value, list):
        return [value]
    if any(isinstance(item, list | dict) for item in value):
        raise InvalidArgument(
            f"input '{name}': generate takes a value or a flat list of values, not nested lists"
        )
    return value


def _tensor(value: Any, tensor: TensorConfig, max_batch_size: int) -> np.ndarray:
    name, datatype = tensor.name, tensor.data_type
    if datatype in _NOT_IN_JSON:
        raise InvalidArgument(f"input '{name}' has datatype {datatype}, which JSON cannot carry")
    flat = _values(value, name)
    dtype = NUMPY_DTYPES[datatype]
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise InvalidArgument(f"input '{name}' is BYTES: its values must be strings")
        array = np.empty(len(flat), dtype=np.object_)
        array[:] = [v.encode("utf-8") for v in flat]
    else:
        if datatype == "BOOL":
            ok = all(isinstance(v, bool) for v in flat)
        elif dtype.kind in _INTEGER_KINDS:
            ok = all(isinstance(v, int) and not isinstance(v, bool) for v in flat)
        else:
            ok = all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat)
        if not ok:
            raise InvalidArgument(f"input '{name}' expects {datatype} values, got {value!r:.80}")
        try:
            array = np.array(flat, dtype=dtype)
        except OverflowError:
            raise InvalidArgument(
                f"input '{name}': a value is out of range for {datatype}"
            ) from None
    return array.reshape(_shape(name, len(flat), tensor.dims, max_batch_size))


def _shape(name: str, count: int, dims: list[int], max_batch_size: int) -> list[int]:
    """Spread `count` elements over the input's shape as Triton does: fixed dims divide it,
    the innermost variable dim takes what is left, other variable dims are 1."""
    shape = [-1, *dims] if max_batch_size > 0 else list(dims)
    left = count
    for dim in shape:
        if dim != -1:
            if dim == 0 or left % dim:
                raise InvalidArgument(
                    f"The schema can not convert input '{name}' to tensor with proper shape"
                )
            left //= dim
    for index in range(len(shape) - 1, -1, -1):
        if shape[index] == -1:
            shape[index], left = left, 1
    if left != 1 and count:
        raise InvalidArgument(
            f"The schema can not convert input '{name}' to tensor with proper shape"
        )
    return shape


# ---------------------------------------------------------------------------- response


def to_json(model: LoadedVersion, request_id: str, response: InferResponse) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    if request_id:
        payload["id"] = request_id
    payload["model_name"] = model.name
    payload["model_version"] = str(model.version)
    for key, value in response.parameters.items():
        if not isinstance(value, str | bool | int | float):
            raise BackendError(f"response parameter '{key}' is not a string, number or boolean")
        payload[key] = value
    for name, array in response.outputs.items():
        tensor = model.config.output_by_name(name)
        if tensor is not None and tensor.data_type in _NOT_IN_JSON:
            raise BackendError(f"output '{name}' is {tensor.data_type}, which JSON cannot carry")
        payload[name] = _output_value(name, array)
    # Triton writes the keys in sorted order (it collects them in a std::map); so do we.
    return dict(sorted(payload.items()))


def _output_value(name: str, array: np.ndarray) -> Any:
    flat = array.reshape(-1)
    if array.dtype.kind in ("O", "S", "U"):
        try:
            values: list[Any] = [
                v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in flat
            ]
        except UnicodeDecodeError:
            raise BackendError(
                f"output '{name}' holds bytes that are not UTF-8 text; request it from /infer as binary data"
            ) from None
    else:
        values = float_list(flat)  # NaN / Inf as Triton writes them, never null
    return values[0] if len(values) == 1 else values
