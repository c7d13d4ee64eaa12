"""KServe v2 (Open Inference Protocol) HTTP wire codec, as Triton serves it.

Pure functions over bytes: no aiohttp, no I/O. Covers the JSON request/response bodies and
Triton's binary tensor data extension:

- A request body is a JSON header optionally followed by raw tensor bytes. The
  `Inference-Header-Content-Length` HTTP header gives the JSON length; each input whose
  `parameters.binary_data_size` is set takes that many bytes of the rest, in input order.
- `Inference-Header-Content-Length: 0` means there is no JSON at all: the whole body is the
  raw data of the model's only input (shape and datatype come from the model config).
- Binary data is little-endian, row-major, unpadded; BOOL is one byte 0/1; each BYTES element
  is a 4-byte little-endian length followed by that many bytes.
- Responses carry an output as JSON `data` unless the client asked for binary. As in Triton,
  an output listed in the request's `outputs` is binary iff its own `parameters.binary_data`
  is true; `parameters.binary_data_output` decides only for outputs the request does not list
  (all of them when `outputs` is absent). A raw request (header length 0) is answered in binary.

We are a superset of Triton in one respect: FP16 and BF16 travel in JSON too (Triton accepts
them only as binary); a number beyond the type's finite range is refused, not made infinite
(for FP32 too, which Triton makes infinite).
BF16 has no numpy dtype; it lives as uint16 bit patterns.

Every decode error is `InvalidArgument` whose message names the offending field.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, NoReturn, Protocol

import msgspec
import numpy as np
from mypy_extensions import mypyc_attr

from daemon.api.kserve_wire import (
    ErrorBody,
    InferRequestBody,
    InferResponseBody,
    Parameter,
    RequestInput,
    RequestOutput,
    ResponseOutput,
)
from daemon.backend import (
    DATATYPE_OF_DTYPE,
    NUMPY_DTYPES,
    REQUEST_FLAG_SEQUENCE_END,
    REQUEST_FLAG_SEQUENCE_START,
    InferRequest,
    InferResponse,
)
from daemon.core.labels import LabelCache
from daemon.core.shm import Lease
from daemon.errors import InvalidArgument
from daemon.model_config import ModelConfig, TensorConfig

# Triton's default request size cap.
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
# Bounds on what one request may decode into (issue 19 item 7): a 64 MiB body of empty BYTES
# elements is 16 M Python objects; these caps are checked from the shape, before allocating.
DEFAULT_MAX_TENSOR_ELEMENTS = 1 << 24
DEFAULT_MAX_DECODED_BYTES = 256 * 1024 * 1024
# What one decoded BYTES element costs beyond its payload: a pointer in the list it is split
# into, one in the object array, and a bytes object's header (CPython: 33 bytes).
BYTES_ELEMENT_OVERHEAD = 48
# numpy's NPY_MAXDIMS (64 in numpy 2; Triton has no smaller bound).
MAX_TENSOR_RANK = 64
# Triton (>= 2.58) rejects `data` nested this deep; deeper documents used to overflow stacks.
MAX_JSON_NESTING_DEPTH = 100
NESTING_MESSAGE = (
    f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_NESTING_DEPTH})"
)

# Wire byte order is little-endian whatever the host is; on little-endian hosts these are the
# native dtypes, so np.frombuffer is zero-copy and no byte swap happens.
_WIRE_DTYPES: Mapping[str, np.dtype[Any]] = MappingProxyType(
    {name: dt.newbyteorder("<") for name, dt in NUMPY_DTYPES.items() if name != "BYTES"}
)
_KNOWN_DATATYPES = ", ".join(sorted(NUMPY_DTYPES))
_INT_DATATYPES = frozenset(
    {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
)
# The range of each integer datatype, for JSON data (np.iinfo costs a microsecond a call).
_INT_RANGES: Mapping[str, tuple[int, int]] = MappingProxyType({
    name: (int(np.iinfo(NUMPY_DTYPES[name]).min), int(np.iinfo(NUMPY_DTYPES[name]).max))
    for name in _INT_DATATYPES
})
# JSON data of at most this many numbers is checked in Python, element by element: for a
# few numbers that costs less than numpy's passes over the array (each ~1-2 us of overhead).
_FEW_JSON_NUMBERS = 64
_JUST_INT = frozenset({int})
# Request-level parameters Triton reserves: they steer the transport, the scheduler or a
# sequence, and never reach the backend as parameters. The sequence ones are validated and,
# as Triton does for a model without a sequence batcher (edged has none), not used.
_RESERVED_REQUEST_PARAMETERS = frozenset({
    "binary_data_output", "priority", "timeout", "sequence_id", "sequence_start", "sequence_end",
})
_TRITON_PREFIX_MESSAGE = (
    "parameter keys starting with 'triton_' are reserved for Triton usage and should not be "
    "specified."
)
_U32 = struct.Struct("<I")
# Triton holds sequence_id, priority, timeout and classification as uint64 and refuses a larger
# JSON integer (with a 500); edged refuses it too (400) rather than carry a Python int along.
_UINT64_MAX = 2**64 - 1
# The largest finite value of each float datatype (BF16's is 0x7F7F): JSON numbers beyond
# them would round to infinity.
_FLOAT_MAX: Mapping[str, float] = MappingProxyType(
    {"FP16": 65504.0, "BF16": 3.3895313892515355e38, "FP32": 3.4028234663852886e38, "FP64": sys.float_info.max}
)
# Codec._plans: how many distinct binary headers are kept, and the longest header kept.
_PLANS = 256
_PLAN_HEADER_BYTES = 4096
# On little-endian hosts a native array already is in wire byte order.
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


# --------------------------------------------------------------------------- results


@dataclass(slots=True)
class DecodedInfer:
    """A decoded request plus what the response encoder needs to know about it."""

    request: InferRequest
    # Every output listed in the request's `outputs`: its own `binary_data` flag (false when
    # absent, as in Triton, whatever `binary_data_output` says).
    binary_outputs: dict[str, bool] = field(default_factory=dict)
    # The request's `parameters.binary_data_output`: the flag for outputs not listed above.
    binary_default: bool = False
    # Shared memory: outputs written into a region, and every region lease the request holds
    # (inputs are views of those mappings). `release()` once the response is encoded.
    shm_outputs: dict[str, Lease] = field(default_factory=dict)
    leases: list[Lease] = field(default_factory=list)
    # Outputs asked for as top-K classification: output name -> K.
    classification: dict[str, int] = field(default_factory=dict)

    def output_is_binary(self, name: str) -> bool:
        return self.binary_outputs.get(name, self.binary_default)

    def release(self) -> None:
        for lease in self.leases:
            lease.release()
        self.leases.clear()


@dataclass(frozen=True, slots=True)
class _BinaryInput:
    name: str
    datatype: str
    shape: list[int]
    count: int
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class _HeaderPlan:
    """What a binary request's JSON header decodes to, all but the tensor data: a request whose
    header has the same bytes (and whose body has the same length) decodes the same way, so its
    tensors are cut from its body along this plan without decoding and checking the header
    again (see `Codec.decode_infer_request`)."""

    inputs: tuple[_BinaryInput, ...]
    end: int  # the body's length the offsets were checked against
    # The request as decoded, without inputs: its parameters are copied for every request (a
    # backend may change them), and so are the output flags.
    request: InferRequest
    binary_outputs: dict[str, bool]
    binary_default: bool
    # The model config the inputs' datatypes were last checked against (plans are shared by
    # every model): the same config again needs no check (a lookup per input, per request).
    checked: ModelConfig | None

    def decode(self, body: bytes | memoryview) -> DecodedInfer:
        inputs: dict[str, np.ndarray] = {}
        for tensor in self.inputs:
            end = tensor.offset + tensor.size
            if tensor.datatype == "BYTES":
                array = _split_bytes(tensor.name, body, tensor.offset, end, tensor.count).reshape(tensor.shape)
            else:
                array = _fixed_from_binary(
                    tensor.name, tensor.datatype, body, tensor.offset, tensor.size, tensor.shape, tensor.count
                )
            inputs[tensor.name] = array
        seen = self.request
        request = InferRequest(
            inputs, seen.id, seen.requested_outputs, dict(seen.parameters), seen.priority,
            seen.timeout_us, seen.correlation_id, seen.flags,
        )
        return DecodedInfer(request, dict(self.binary_outputs), self.binary_default)


class SharedMemoryLookup(Protocol):
    """Where a request's `shared_memory_region` names are resolved (daemon.core.shm)."""

    def acquire(self, name: str, offset: int, byte_size: int) -> Lease: ...


# --------------------------------------------------------------------------- codec


def _numpy_enc_hook(obj: Any) -> Any:
    # Backends may put numpy scalars or arrays into response parameters.
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__} as JSON")


# Compiled by mypyc (packaging/native.py); tests subclass it to see where each call runs.
@mypyc_attr(allow_interpreted_subclasses=True)
class Codec:
    """Holds the msgspec decoder/encoder, built once per daemon (never per request)."""

    def __init__(
        self,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_tensor_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS,
        max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
    ) -> None:
        self.max_request_bytes = max_request_bytes
        self.max_tensor_elements = max_tensor_elements
        self.max_decoded_bytes = max_decoded_bytes
        self._request_decoder = msgspec.json.Decoder(InferRequestBody)
        self._encoder = msgspec.json.Encoder(enc_hook=_numpy_enc_hook)
        # Classification labels by model directory (read by the transport, not by the codec).
        self.labels = LabelCache()
        # Binary requests' headers as decoded, by their bytes (clients send the same header
        # for every request of one shape): decoding and checking a header is most of a small
        # request's decode. Only what depends on nothing but those bytes and this codec's
        # limits is kept (no shared memory, no classification); bounded, oldest out first.
        self._plans: dict[bytes, _HeaderPlan] = {}
        # Large bodies are decoded on worker threads (daemon.api.infer): lookups are single
        # dict reads, but evicting the oldest plan iterates the dict, so writers take turns.
        self._plans_lock = threading.Lock()

    # ------------------------------------------------------------------ requests

    def decode_infer_request(
        self,
        body: bytes | memoryview,
        header_length: int | None,
        *,
        single_input: TensorConfig | None = None,
        max_batch_size: int = 0,
        config: ModelConfig | None = None,
        shm: SharedMemoryLookup | None = None,
    ) -> DecodedInfer:
        """Decode an infer request body.

        `header_length` is the `Inference-Header-Content-Length` header (None when absent).
        `single_input` is the model's input when it has exactly one; it is needed only for a
        raw body (`header_length == 0`), whose shape gets a leading batch of 1 when
        `max_batch_size > 0`, as in Triton. A `config` gives both (and names the model in
        errors). `shm` resolves `shared_memory_region` names; the result then holds leases on
        those regions, which the caller must `release()`.
        """
        if config is not None:
            single_input = config.input[0] if len(config.input) == 1 else None
            max_batch_size = config.max_batch_size
        if len(body) > self.max_request_bytes:
            raise InvalidArgument(oversized_message(len(body), self.max_request_bytes))
        has_header = header_length is not None
        if header_length is None:
            header_length = len(body)
        elif header_length < 0 or header_length > len(body):
            raise InvalidArgument(_header_range_message(len(body), str(header_length)))
        elif header_length == 0:
            return _decode_raw(body, single_input, max_batch_size, config)

        # A JSON-only body is decoded in place; a binary request's JSON header is short, and
        # slicing it off costs less than decoding through a memoryview.
        json_part = body if header_length == len(body) else body[:header_length]
        key: bytes | None = None
        if header_length < len(body) and header_length <= _PLAN_HEADER_BYTES:
            key = json_part if isinstance(json_part, bytes) else bytes(json_part)
            plan = self._plans.get(key)
            if plan is not None and plan.end == len(body):
                if plan.checked is not config:
                    for tensor in plan.inputs:
                        _check_datatype(tensor.name, tensor.datatype, config)
                    plan = replace(plan, checked=config)
                    with self._plans_lock:
                        self._plans[key] = plan
                return plan.decode(body)
        try:
            header = self._request_decoder.decode(json_part)
        except msgspec.DecodeError as exc:  # ValidationError included; its text has the path
            raise InvalidArgument(f"malformed JSON request header: {exc}") from None
        except RecursionError:  # msgspec recurses per nesting level
            raise InvalidArgument(NESTING_MESSAGE) from None

        decoded = DecodedInfer(InferRequest(inputs={}))
        try:
            self._decode_header(header, body, header_length, has_header, shm, config, decoded)
        except BaseException:
            decoded.release()  # a rejected request keeps no region leased
            raise
        if key is not None:
            self._remember(key, header, decoded, header_length, len(body), config)
        return decoded

    def _remember(
        self, key: bytes, header: InferRequestBody, decoded: DecodedInfer, offset: int, end: int,
        config: ModelConfig | None,
    ) -> None:
        """Keep the plan of a header that decoded without error, if it depends on nothing but
        its bytes: every input in the body (no JSON data, no shared memory), no shared memory
        or classification outputs."""
        if decoded.leases or decoded.shm_outputs or decoded.classification:
            return
        inputs = []
        for tensor in header.inputs:
            if tensor.data is not None or tensor.parameters is None:
                return
            size = tensor.parameters.get("binary_data_size")
            if type(size) is not int:
                return
            count = math.prod(tensor.shape)
            inputs.append(_BinaryInput(tensor.name, tensor.datatype, tensor.shape, count, offset, size))
            offset += size
        # Copies: the caller's request and flags go on to a backend, which may change them.
        request = replace(decoded.request, inputs={}, parameters=dict(decoded.request.parameters))
        plan = _HeaderPlan(tuple(inputs), end, request, dict(decoded.binary_outputs), decoded.binary_default, config)
        with self._plans_lock:
            if len(self._plans) >= _PLANS:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan

    def _decode_header(
        self,
        header: InferRequestBody,
        body: bytes | memoryview,
        header_length: int,
        has_header: bool,
        shm: SharedMemoryLookup | None,
        config: ModelConfig | None,
        decoded: DecodedInfer,
    ) -> None:
        inputs: dict[str, np.ndarray] = {}
        offset = header_length
        decoded_bytes = 0
        for tensor in header.inputs:
            if tensor.name in inputs:
                raise InvalidArgument(f"input {tensor.name!r} appears more than once")
            decoded_bytes += self._check_limits(tensor, decoded_bytes)
            if tensor.datatype in NUMPY_DTYPES:  # an unknown one has its own error, below
                _check_datatype(tensor.name, tensor.datatype, config)
            if tensor.parameters and "shared_memory_region" in tensor.parameters:
                inputs[tensor.name] = _decode_shm_input(tensor, shm, decoded.leases)
                continue
            array, offset = _decode_input(tensor, body, offset, has_header)
            inputs[tensor.name] = array
        if offset != len(body):
            raise InvalidArgument(
                f"{len(body) - offset} bytes after the JSON header are not claimed by any "
                "input's binary_data_size"
            )

        params: dict[str, Parameter] = {}
        binary_default = False
        priority = timeout_us = flags = 0
        correlation_id: int | str = 0
        if header.parameters:
            params = _request_parameters(header.parameters)
            binary_default = _bool_parameter(params, "binary_data_output")
            priority = _uint_parameter(params, "priority")
            timeout_us = _uint_parameter(params, "timeout")
            # Triton's sequence parameters become the request's correlation ID and flags,
            # which only the sequence batcher reads.
            correlation_id = params.get("sequence_id", 0)  # type: ignore[assignment]
            flags = (REQUEST_FLAG_SEQUENCE_START if params.get("sequence_start") else 0) | (
                REQUEST_FLAG_SEQUENCE_END if params.get("sequence_end") else 0
            )
            for key in _RESERVED_REQUEST_PARAMETERS:
                params.pop(key, None)

        requested: list[str] = []
        binary_outputs: dict[str, bool] = {}
        for out in header.outputs or ():
            # Triton keeps one entry per name: a repeated output is answered once.
            if out.name not in binary_outputs:
                requested.append(out.name)
            binary = False
            if out.parameters:
                _reject_unsupported(out.parameters, "output", out.name)
                binary = _bool_parameter(out.parameters, "binary_data")
                _decode_output_extensions(out, shm, decoded)
            binary_outputs[out.name] = binary

        decoded.request = InferRequest(
            inputs=inputs,
            id=header.id,
            requested_outputs=tuple(requested),
            parameters=params,
            priority=priority,
            timeout_us=timeout_us,
            correlation_id=correlation_id,
            flags=flags,
        )
        decoded.binary_outputs = binary_outputs
        decoded.binary_default = binary_default

    def _check_limits(self, tensor: RequestInput, so_far: int) -> int:
        """The bytes `tensor` will decode into, from its shape alone; raises when it is over
        the element cap or takes the request over the decoded-bytes cap."""
        name = tensor.name
        count = _check_shape(name, tensor.shape)
        if count > self.max_tensor_elements:
            raise InvalidArgument(
                f"input {name!r}: shape {tensor.shape} has {count} elements, more than the "
                f"{self.max_tensor_elements} allowed per tensor (server max-tensor-elements)"
            )
        dtype = _WIRE_DTYPES.get(tensor.datatype)
        if dtype is not None:
            size = count * dtype.itemsize
        else:  # BYTES (or an unknown datatype, rejected later with its own message)
            payload = (tensor.parameters or {}).get("binary_data_size", 0)
            size = count * BYTES_ELEMENT_OVERHEAD + (payload if type(payload) is int else 0)
        if so_far + size > self.max_decoded_bytes:
            raise InvalidArgument(
                f"input {name!r}: decoding the request's inputs would take {so_far + size} "
                f"bytes, more than the {self.max_decoded_bytes} allowed (server "
                "max-decoded-bytes); send fewer or smaller elements"
            )
        return size

    # ------------------------------------------------------------------ responses

    def encode_infer_response(
        self,
        model_name: str,
        model_version: str,
        decoded: DecodedInfer,
        response: InferResponse,
        config: ModelConfig | None = None,
        labels: Mapping[str, Sequence[str]] | None = None,
    ) -> tuple[bytes, int | None]:
        """Encode a response; returns the body and the JSON header length.

        The length is None when every output is JSON (a plain `application/json` body);
        otherwise the transport sends it as `Inference-Header-Content-Length`. `config` lets
        an output declared BF16 be labelled so (its numpy array is plain uint16) and tells
        whether dim 0 is the batch for classification; `labels` are the classification labels
        per output (from the config's `label_filename`). Shared memory outputs are written
        into their regions and carry no data in the body.
        """
        outputs: list[ResponseOutput] = []
        chunks: list[Any] = []
        for name, value in response.outputs.items():
            array = np.asarray(value)
            if not array.dtype.isnative:  # e.g. '>f4': the datatype lookup is by native dtype
                array = array.astype(array.dtype.newbyteorder("="))
            datatype = _output_datatype(name, array, config)
            if decoded.classification and name in decoded.classification:
                batching = config is not None and config.max_batch_size > 0
                array = _classify(name, array, datatype, decoded.classification[name], batching,
                                  (labels or {}).get(name))
                datatype = "BYTES"
            shape = list(array.shape)
            if decoded.shm_outputs and name in decoded.shm_outputs:
                _write_shm(name, array, datatype, decoded.shm_outputs[name])
                outputs.append(ResponseOutput(name, datatype, shape))
            elif decoded.output_is_binary(name):
                raw = _to_binary(array, datatype)
                chunks.append(raw)
                outputs.append(
                    ResponseOutput(name, datatype, shape, parameters={"binary_data_size": len(raw)})
                )
            else:
                outputs.append(
                    ResponseOutput(name, datatype, shape, data=_to_json(name, array, datatype))
                )
        header = self._encoder.encode(
            InferResponseBody(
                model_name=model_name,
                model_version=model_version,
                id=decoded.request.id,
                parameters=response.parameters or None,
                outputs=outputs,
            )
        )
        if not chunks:
            return header, None
        return b"".join([header, *chunks]), len(header)


def oversized_message(size: int, limit: int) -> str:
    """Triton's wording for a request over the size cap (clients and its QA tests match it)."""
    return (
        f"request size of {size} bytes exceeds the maximum allowed input size of {limit} bytes"
    )


def parse_header_length(value: str | None, body_size: int | None = None) -> int | None:
    """The `Inference-Header-Content-Length` header as Triton reads it (None when absent).

    Its range is checked only against a known `body_size`: without one (the transports read
    the header before the body) the decoder checks it, so that the error names the body's
    size as Triton's does, and a negative value here is no placement (see buffers.direct_read).
    """
    if value is None:
        return None
    # Digits only, around HTTP's optional whitespace: int() would also take "1_0", "+10",
    # other whitespace and non-ASCII digits, reading a value the client did not send. A minus
    # is kept so that a negative length gets Triton's range error (tests/compat).
    text = value.strip(" \t")
    digits = text[1:] if text.startswith("-") else text
    try:
        if not (digits.isascii() and digits.isdigit()):
            raise ValueError
        length = int(text)  # ValueError past 4300 digits
    except ValueError:
        raise InvalidArgument(
            f"Unable to parse Inference-Header-Content-Length, got: {value}"
        ) from None
    if body_size is not None and not 0 <= length <= body_size:
        raise InvalidArgument(_header_range_message(body_size, value))
    return length


def _header_range_message(body_size: int, value: str) -> str:
    return f"inference header size should be in range (0, {body_size}), got: {value}"


def encode_error(message: str) -> bytes:
    """The body of every KServe error response: `{"error": "..."}`."""
    return msgspec.json.encode(ErrorBody(message))


# --------------------------------------------------------------------------- request helpers


def _check_shape(name: str, shape: list[int]) -> int:
    """Element count of `shape`; rejects negative dims and more dims than numpy has."""
    if len(shape) > MAX_TENSOR_RANK:
        raise InvalidArgument(
            f"input {name!r}: shape has {len(shape)} dimensions, more than the "
            f"{MAX_TENSOR_RANK} allowed"
        )
    for dim in shape:
        if dim < 0:
            raise InvalidArgument(f"input {name!r}: shape {shape} has a negative dimension")
    return math.prod(shape)


def _reject_unsupported(params: Mapping[str, Parameter], kind: str, name: str) -> None:
    # Silently ignoring these would answer with the wrong data, so say so instead.
    for key in params:
        if key.startswith("shared_memory") and key not in _SHM_PARAMETERS:
            raise InvalidArgument(f"{kind} {name!r}: unknown shared memory parameter {key!r}")
        if key == "classification" and kind == "input":
            raise InvalidArgument(f"input {name!r}: 'classification' applies to outputs only")


def _decode_input(
    tensor: RequestInput, body: bytes | memoryview, offset: int, has_header: bool
) -> tuple[np.ndarray, int]:
    name = tensor.name
    datatype = tensor.datatype
    if datatype not in NUMPY_DTYPES:
        raise InvalidArgument(
            f"input {name!r}: unknown datatype {datatype!r}; expected one of {_KNOWN_DATATYPES}"
        )
    count = _check_shape(name, tensor.shape)
    size: int | None = None
    if tensor.parameters:
        _reject_unsupported(tensor.parameters, "input", name)
        _reject_stray_shm(tensor.parameters, "input", name)
        raw_size = tensor.parameters.get("binary_data_size")
        if raw_size is not None:
            if type(raw_size) is not int or raw_size < 0:
                raise InvalidArgument(
                    f"input {name!r}: binary_data_size must be a non-negative integer, "
                    f"got {raw_size!r}"
                )
            size = raw_size

    if size is None:
        if tensor.data is None:
            raise InvalidArgument(f"input {name!r}: has neither 'data' nor binary_data_size")
        return _from_json(name, datatype, tensor.data, tensor.shape, count), offset

    if tensor.data is not None:
        raise InvalidArgument(f"input {name!r}: has both 'data' and binary_data_size")
    if not has_header:
        raise InvalidArgument(
            f"input {name!r}: binary_data_size needs the Inference-Header-Content-Length "
            "header to tell where the JSON ends"
        )
    left = len(body) - offset
    if size > left:
        raise InvalidArgument(
            f"input {name!r}: binary_data_size {size} exceeds the {left} bytes left in the body"
        )
    end = offset + size
    if datatype == "BYTES":
        array = _split_bytes(name, body, offset, end, count).reshape(tensor.shape)
    else:
        array = _fixed_from_binary(name, datatype, body, offset, size, tensor.shape, count)
    return array, end


def _fixed_from_binary(
    name: str, datatype: str, body: bytes | memoryview, offset: int, size: int, shape: list[int], count: int
) -> np.ndarray:
    dtype = _WIRE_DTYPES[datatype]
    expected = count * dtype.itemsize
    if size != expected:
        raise InvalidArgument(
            f"input {name!r}: binary_data_size {size} does not match shape {shape} of "
            f"{datatype} ({expected} bytes expected)"
        )
    # A view of the body, so input arrays may be read-only (like Triton's const input
    # buffers). The JSON header has any length, so the view is often misaligned; runtimes
    # and numpy kernels want aligned data, which costs one copy: a bytes slice (its data is
    # malloc-aligned) is that copy at memcpy speed, where ndarray.copy() of a misaligned
    # array goes element by element.
    array = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    if not array.flags.aligned:
        array = np.frombuffer(body[offset : offset + size], dtype=dtype)
        if not array.flags.aligned:
            array = array.copy()
    array = array.reshape(shape)
    if datatype == "BOOL" and count and array.view(np.uint8).max() > 1:
        raise InvalidArgument(f"input {name!r}: BOOL bytes must be 0 or 1")
    return array


def _split_bytes(name: str, body: bytes | memoryview, start: int, end: int, count: int) -> np.ndarray:
    """BYTES elements from `body[start:end]`: each a u32 LE length, then that many bytes."""
    # One copy of the section, then slices of it: a slice of bytes is bytes (a memoryview's
    # would need another copy each) and cannot run past the section. The loop checks nothing;
    # whatever does not add up (a truncated prefix, a length past the end, too many or too few
    # elements) is found once after it, and `_split_bytes_checked` says where.
    data = bytes(body[start:end])
    if count > len(data) // 4:  # cannot hold that many length prefixes: allocate nothing
        _split_bytes_checked(name, data, count)
    items: list[bytes] = [b""] * count
    unpack = _U32.unpack_from
    pos = 0
    try:
        for index in range(count):
            (length,) = unpack(data, pos)
            pos += 4
            items[index] = data[pos : pos + length]
            pos += length
    except struct.error:
        pos = -1
    if pos != len(data):
        _split_bytes_checked(name, data, count)
    return _object_array(items)


def _split_bytes_checked(name: str, data: bytes, count: int) -> NoReturn:
    """Raise the error of BYTES `data` that did not split into `count` elements."""
    pos = elements = 0
    end = len(data)
    while pos < end:
        left = end - pos
        if left < 4:
            raise InvalidArgument(
                f"input {name!r}: BYTES element {elements} has a truncated length prefix "
                f"({left} bytes left)"
            )
        (length,) = _U32.unpack_from(data, pos)
        pos += 4
        left -= 4
        if length > left:
            raise InvalidArgument(
                f"input {name!r}: BYTES element {elements} length prefix {length} exceeds "
                f"remaining {left} bytes"
            )
        pos += length
        elements += 1
    raise InvalidArgument(
        f"input {name!r}: expected {count} BYTES elements, got {elements} in {end} bytes of "
        "binary data"
    )


def _object_array(items: list[Any]) -> np.ndarray:
    # np.array(list_of_bytes, dtype=object) would be fine too, but this never guesses a shape
    # from the elements.
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


def _flatten(data: Any) -> list[Any]:
    """Row-major flattening of (even raggedly) nested JSON arrays, at most
    MAX_JSON_NESTING_DEPTH - 1 arrays deep, as Triton reads `data`."""
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) >= MAX_JSON_NESTING_DEPTH - 1:
                    raise InvalidArgument(NESTING_MESSAGE)
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _check_depth(data: list[Any]) -> None:
    """Reject `data` nested too deep along its first elements. A regular array is as deep
    everywhere; a ragged one goes through `_flatten`, which checks every branch."""
    depth = 1
    item: Any = data
    while item and isinstance(item[0], list):
        item = item[0]
        depth += 1
        if depth >= MAX_JSON_NESTING_DEPTH:
            raise InvalidArgument(NESTING_MESSAGE)


def _from_json(name: str, datatype: str, data: Any, shape: list[int], count: int) -> np.ndarray:
    if isinstance(data, list) and len(data) > count:
        # Already more elements than the shape holds: refuse before copying them.
        raise InvalidArgument(
            f"input {name!r}: expected {count} elements for shape {shape}, got at least "
            f"{len(data)}"
        )
    if datatype == "BYTES":
        flat = _flatten(data)
        encoded: list[bytes] = []
        for i, item in enumerate(flat):
            if type(item) is not str:
                raise InvalidArgument(
                    f"input {name!r}: BYTES element {i} must be a JSON string, got "
                    f"{type(item).__name__}"
                )
            encoded.append(item.encode())
        values = _object_array(encoded)
    else:
        if (
            datatype in _INT_DATATYPES
            and type(data) is list
            and 0 < len(data) == count <= _FEW_JSON_NUMBERS
            and set(map(type, data)) == _JUST_INT
        ):
            # The common small case, a flat list of JSON integers, in one step: numpy checks
            # each against the datatype's range as it fills the array (2.8 us less per tensor
            # of 16). Out of range: the general path below, which words the error.
            try:
                return np.array(data, dtype=NUMPY_DTYPES[datatype]).reshape(shape)
            except OverflowError:
                pass
        if isinstance(data, list) and data and isinstance(data[0], list):
            _check_depth(data)
        try:
            values = np.asarray(data)
        except ValueError:
            # Ragged nesting: Triton just walks the elements in order, so do the same. The
            # checks below read the numbers from the flattened list: the nested one may begin
            # with a number and hide lists (and booleans) further on.
            data = _flatten(data)
            values = np.asarray(data)
        values = _convert_json_numbers(name, datatype, data, values)
    if values.size != count:
        raise InvalidArgument(
            f"input {name!r}: expected {count} elements for shape {shape}, got {values.size}"
        )
    return values.reshape(shape)


def _flat(data: Any) -> list[Any]:
    return data if isinstance(data, list) and data and not isinstance(data[0], list) else _flatten(data)


def _has_bool(data: Any, values: np.ndarray, few: list[Any] | None) -> bool:
    """Whether JSON `data` (numbers, maybe nested) holds a boolean. numpy made each one 0 or
    1, so only data holding those values is scanned (a C-speed pass over the types), unless
    there are `few` (the numbers, flat)."""
    if few is not None:
        return bool in set(map(type, few))
    if not ((values == 0) | (values == 1)).any():
        return False
    return bool in set(map(type, _flat(data)))


def _convert_json_numbers(name: str, datatype: str, data: Any, values: np.ndarray) -> np.ndarray:
    kind = values.dtype.kind
    few: list[Any] | None = None
    if values.size == 0:
        pass  # np.asarray([]) is float64; an empty tensor fits any datatype
    elif datatype == "BOOL":
        if kind != "b":
            raise InvalidArgument(f"input {name!r}: BOOL data must be JSON true/false")
    else:
        # A few numbers are checked over the JSON list itself (flattened once), not with numpy.
        few = _flat(data) if values.size <= _FEW_JSON_NUMBERS else None
        if kind in "iuf" and _has_bool(data, values, few):
            # numpy reads true as 1: a silent change of value. Triton wants numbers here too.
            raise InvalidArgument(
                f"input {name!r}: {datatype} data must be JSON numbers, got a JSON boolean"
            )
        if datatype in _INT_DATATYPES:
            dtype = NUMPY_DTYPES[datatype]
            low, high = _INT_RANGES[datatype]
            if kind in "iu":
                least, most = (min(few), max(few)) if few is not None else (int(values.min()), int(values.max()))
                if low <= least and most <= high:
                    return values.astype(dtype, copy=False)
            # numpy infers float64 (lossy) when ints above 2^63 meet negative ones or int64 ones,
            # and object for ints beyond 64 bits: look at the JSON values themselves.
            if kind in "fO":
                flat = few if few is not None else _flatten(data)
                if all(type(item) is int for item in flat):
                    try:
                        return np.array(flat, dtype=dtype)
                    except OverflowError:
                        pass
            raise InvalidArgument(
                f"input {name!r}: {datatype} data must be JSON integers in [{low}, {high}]"
            )
        if kind == "O":
            # numpy keeps integers past 64 bits as Python objects: as a float datatype's data
            # they are numbers like any other (Triton reads them as doubles).
            values = _big_integers_as_floats(name, datatype, few if few is not None else _flatten(data), values)
        elif kind not in "iuf":  # a float datatype: JSON integers are numbers too
            raise InvalidArgument(f"input {name!r}: {datatype} data must be JSON numbers")

    if datatype == "FP16" or datatype == "BF16" or datatype == "FP32":
        largest = _FLOAT_MAX[datatype]
        if datatype != "BF16" and few is not None and -largest <= min(few) and max(few) <= largest:
            # No number here can round to infinity: narrowed without numpy's error state,
            # whose setting and restoring costs more than the rest (4.8 -> 0.5 us for 16).
            return values.astype(np.float16 if datatype == "FP16" else np.float32, copy=False)
        return _narrow_float(name, datatype, values)
    return values.astype(NUMPY_DTYPES[datatype], copy=False)


def _big_integers_as_floats(name: str, datatype: str, flat: list[Any], values: np.ndarray) -> np.ndarray:
    if not all(type(item) is int or type(item) is float for item in flat):
        raise InvalidArgument(f"input {name!r}: {datatype} data must be JSON numbers")
    floats: list[float] = []
    for index, item in enumerate(flat):
        try:
            floats.append(float(item))
        except OverflowError:
            raise _out_of_range(name, datatype, index, f"an integer of {int(item).bit_length()} bits") from None
    return np.array(floats, dtype=np.float64).reshape(values.shape)


def _narrow_float(name: str, datatype: str, values: np.ndarray) -> np.ndarray:
    """JSON numbers as FP32 or FP16, or as BF16 bit patterns. A finite number past the type's
    largest would round to infinity, a silent change of value: it is refused. (Triton refuses
    FP16 and BF16 JSON data altogether and makes 1e300 an FP32 infinity; JSON itself has no
    infinities, msgspec refuses 1e400.)"""
    narrowed: np.ndarray
    infinite: np.ndarray
    with np.errstate(over="ignore"):  # overflow is found below, from the result
        if datatype != "BF16":
            narrowed = values.astype(np.float16 if datatype == "FP16" else np.float32, copy=False)
            infinite = np.isinf(narrowed)
        else:
            narrowed = _float32_to_bf16(values.astype(np.float32))
            infinite = (narrowed & np.uint16(0x7FFF)) == np.uint16(0x7F80)
    if infinite.any():
        index = int(np.flatnonzero(infinite)[0])
        raise _out_of_range(name, datatype, index, repr(values.ravel()[index].item()))
    return narrowed


def _out_of_range(name: str, datatype: str, index: int, shown: str) -> InvalidArgument:
    largest = _FLOAT_MAX[datatype]
    return InvalidArgument(
        f"input {name!r}: {datatype} data element {index} ({shown}) is outside the {datatype} range "
        f"[{-largest:g}, {largest:g}]"
    )


def _float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even); return the uint16 bit patterns."""
    bits = values.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    out = rounded.astype(np.uint16)
    # Rounding can carry a NaN's mantissa into the exponent; keep NaNs quiet NaNs.
    nan = np.isnan(values)
    if nan.any():
        out[nan] = (bits[nan] >> 16).astype(np.uint16) | np.uint16(0x0040)
    return out


# Error texts start as Triton's do ("Unable to parse 'key'"); what follows says what we expected.


def _bool_parameter(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if type(value) is not bool:
        raise InvalidArgument(f"Unable to parse '{key}': expected a boolean, got {value!r}")
    return value


def _uint_parameter(params: Mapping[str, Any], key: str) -> int:
    value = params.get(key, 0)
    if type(value) is not int or value < 0:
        raise InvalidArgument(
            f"Unable to parse '{key}': expected a non-negative integer, got {_shown(value)}"
        )
    if value > _UINT64_MAX:
        raise InvalidArgument(f"Unable to parse '{key}': {_too_large(value)}")
    return value


def _too_large(value: int) -> str:
    return f"expected at most {_UINT64_MAX} (uint64), got {_shown(value)}"


def _shown(value: Any) -> str:
    """`value` for an error message. A JSON integer may have thousands of digits (repr refuses
    past 4300), which would bury the message."""
    if type(value) is int and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def _request_parameters(raw: Mapping[str, Any]) -> dict[str, Parameter]:
    """Validate request-level parameters the way Triton's HTTP frontend does."""
    params: dict[str, Parameter] = {}
    for key, value in raw.items():
        if key == "sequence_id":
            # An unsigned integer or a string correlation id.
            if not (type(value) is str or (type(value) is int and value >= 0)):
                raise InvalidArgument(
                    "Unable to parse 'sequence_id': expected a non-negative integer or a "
                    f"string, got {_shown(value)}"
                )
            if type(value) is int and value > _UINT64_MAX:
                raise InvalidArgument(f"Unable to parse 'sequence_id': {_too_large(value)}")
        elif key in ("sequence_start", "sequence_end"):
            _bool_parameter(raw, key)
        elif key.startswith("triton_"):
            raise InvalidArgument(_TRITON_PREFIX_MESSAGE)
        elif key not in _RESERVED_REQUEST_PARAMETERS and not isinstance(
            value, (bool, int, float, str)
        ):
            raise InvalidArgument(
                f"parameter '{key}' has invalid type. It should be either 'int', 'bool', "
                "or 'string'."
            )
        params[key] = value
    return params


def _decode_raw(
    body: bytes | memoryview, single_input: TensorConfig | None, max_batch_size: int,
    config: ModelConfig | None,
) -> DecodedInfer:
    """`Inference-Header-Content-Length: 0`: the body is the model's only input, raw.

    Like Triton, the shape is the configured dims (behind a batch of 1 for batching models);
    one -1 dim may be deduced from the body size. A BYTES input must have exactly one element,
    which is the whole body.
    """
    # Error texts: Triton's (its QA tests match them).
    if single_input is None:
        got = (
            f"got {len(config.input)} inputs in '{config.name}' model configuration"
            if config is not None
            else "the model does not have exactly 1 input"
        )
        raise InvalidArgument(f"Raw request must only have 1 input (found 1) to be deduced but {got}")
    name = single_input.name
    datatype = single_input.data_type
    shape = ([1] if max_batch_size > 0 else []) + list(single_input.dims)
    wildcards = [i for i, dim in enumerate(shape) if dim == -1]
    if len(wildcards) > 1:
        raise InvalidArgument(
            f"The shape of the raw input '{name}' can not be deduced because there are more "
            "than one variable-sized dimension"
        )
    if datatype == "BYTES":
        if wildcards or math.prod(shape) != 1:
            raise InvalidArgument(
                f"For BYTE datatype raw input '{name}', the model must have input shape [1]"
            )
        array = _object_array([bytes(body)]).reshape(shape)
    else:
        itemsize = _WIRE_DTYPES[datatype].itemsize
        if wildcards:
            known = math.prod(d for d in shape if d != -1) * itemsize
            if known == 0 or len(body) % known:
                raise InvalidArgument(
                    f"raw input {name!r}: a {len(body)}-byte body does not fit shape {shape} "
                    f"of {datatype}"
                )
            shape[wildcards[0]] = len(body) // known
        array = _fixed_from_binary(name, datatype, body, 0, len(body), shape, math.prod(shape))
    # Triton answers a raw request in binary: its client has no JSON header to read.
    return DecodedInfer(InferRequest(inputs={name: array}), binary_default=True)


def _check_datatype(name: str, datatype: str, config: ModelConfig | None) -> None:
    """Refuse an input whose datatype is not the model's, naming the datatype the client sent
    (Triton's wording). daemon.core.validate checks decoded arrays, which cannot tell BF16 from
    UINT16 (both uint16): it would call a BF16 input "UINT16", and pass one either way."""
    if config is None:
        return
    tensor = config.input_by_name(name)
    if tensor is not None and tensor.data_type != datatype:
        raise InvalidArgument(
            f"inference input {name!r} data-type is {datatype!r}, but model {config.name!r} "
            f"expects {tensor.data_type!r}"
        )


# --------------------------------------------------------------------------- response helpers


def _output_datatype(name: str, array: np.ndarray, config: ModelConfig | None) -> str:
    if array.dtype.kind in "OSU":
        return "BYTES"
    datatype = DATATYPE_OF_DTYPE.get(array.dtype)
    if datatype is None:
        raise InvalidArgument(f"output {name!r}: unsupported numpy dtype {array.dtype}")
    # BF16 travels as uint16: only the config can tell which of the two it is.
    if datatype == "UINT16" and config is not None:
        tensor = config.output_by_name(name)
        if tensor is not None and tensor.data_type == "BF16":
            return "BF16"
    return datatype


def _as_bytes(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    return str(item).encode()


def _to_binary(array: np.ndarray, datatype: str) -> bytes | memoryview | np.ndarray:
    """Wire bytes of an output: a buffer `b"".join` takes without another copy."""
    if datatype == "BYTES":
        parts: list[bytes] = []
        for item in array.ravel().tolist():
            data = _as_bytes(item)
            parts.append(_U32.pack(len(data)))
            parts.append(data)
        return b"".join(parts)
    if _LITTLE_ENDIAN_HOST and array.dtype.isnative:
        if array.flags.c_contiguous and array.size:
            return array.data.cast("B")  # the array's own bytes, as cheap as it gets
        wire = np.ascontiguousarray(array)
    else:
        wire = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return wire.reshape(-1).view(np.uint8)


def _to_json(name: str, array: np.ndarray, datatype: str) -> list[Any]:
    if datatype == "BYTES":
        try:
            return [
                item.decode() if isinstance(item, bytes) else str(item)
                for item in array.ravel().tolist()
            ]
        except UnicodeDecodeError as exc:
            # A JSON string cannot hold these bytes; replacing them would corrupt the data.
            # (Triton 2.51 writes them raw and so sends invalid JSON.)
            raise InvalidArgument(
                f"output '{name}' holds BYTES that are not valid UTF-8 ({exc.reason} at byte "
                f"{exc.start}), which JSON cannot carry: request it in binary with "
                f'"parameters": {{"binary_data": true}} on the output (or '
                f'"binary_data_output": true on the request)'
            ) from None
    if datatype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return float_list(array)


def float_list(array: np.ndarray) -> list[Any]:
    """`array.ravel().tolist()`, with NaN and infinities as values msgspec writes as the
    literals NaN, Infinity and -Infinity. msgspec alone would write null, a silent change of
    value; Triton 2.51 writes these literals (not strict JSON), which its clients read back
    (Python's json and rapidjson accept them)."""
    result: list[Any] = array.ravel().tolist()
    if array.dtype.kind == "f":
        finite = np.isfinite(array)
        if not finite.all():
            for i in np.flatnonzero(~finite).tolist():
                value = result[i]
                result[i] = _NAN if value != value else _INF if value > 0 else _NEG_INF
    return result


_NAN = msgspec.Raw(b"NaN")
_INF = msgspec.Raw(b"Infinity")
_NEG_INF = msgspec.Raw(b"-Infinity")


# --------------------------------------------------------------------------- shared memory

_SHM_PARAMETERS = frozenset({"shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"})


def _reject_stray_shm(params: Mapping[str, Parameter], kind: str, name: str) -> None:
    for key in ("shared_memory_byte_size", "shared_memory_offset"):
        if key in params:
            raise InvalidArgument(f"{kind} {name!r}: {key!r} needs 'shared_memory_region'")


def _shm_window(params: Mapping[str, Parameter], kind: str, name: str) -> tuple[str, int, int]:
    """(region, offset, byte_size) from a tensor's shared memory parameters."""
    region = params["shared_memory_region"]
    if type(region) is not str or not region:
        raise InvalidArgument(
            f"{kind} {name!r}: 'shared_memory_region' must be a region name, got {region!r}"
        )
    size = params.get("shared_memory_byte_size")
    if size is None:
        raise InvalidArgument(f"{kind} {name!r}: 'shared_memory_region' needs 'shared_memory_byte_size'")
    offset = params.get("shared_memory_offset", 0)
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if type(value) is not int or value < 0:
            raise InvalidArgument(
                f"{kind} {name!r}: {key!r} must be a non-negative integer, got {value!r}"
            )
    assert isinstance(size, int) and isinstance(offset, int)
    return region, offset, size


def _decode_shm_input(
    tensor: RequestInput, shm: SharedMemoryLookup | None, leases: list[Lease]
) -> np.ndarray:
    """An input read in place from a registered region: a read-only view, no copy."""
    name = tensor.name
    params = tensor.parameters or {}
    if tensor.data is not None or "binary_data_size" in params:
        given = " 'data'" if tensor.data is not None else ""
        given += " 'binary_data_size'" if "binary_data_size" in params else ""
        raise InvalidArgument(
            f"input {name!r}: Input must set only one of the following fields: 'data', "
            "'binary_data_size' in 'parameters', 'shared_memory_region' in 'parameters'. "
            f"But set{given} 'shared_memory_region'"
        )
    _reject_unsupported(params, "input", name)
    region, offset, size = _shm_window(params, "input", name)
    datatype = tensor.datatype
    if datatype not in NUMPY_DTYPES:
        raise InvalidArgument(
            f"input {name!r}: unknown datatype {datatype!r}; expected one of {_KNOWN_DATATYPES}"
        )
    count = _check_shape(name, tensor.shape)
    if datatype != "BYTES":
        expected = count * _WIRE_DTYPES[datatype].itemsize
        if size != expected:
            raise InvalidArgument(
                f"input {name!r}: shared_memory_byte_size {size} does not match shape "
                f"{tensor.shape} of {datatype} ({expected} bytes expected)"
            )
    if shm is None:
        raise InvalidArgument(f"input {name!r}: shared memory is not available on this endpoint")
    lease = shm.acquire(region, offset, size)
    leases.append(lease)
    buffer, start = lease.buffer, lease.start
    if datatype == "BYTES":  # parsed element by element into bytes objects anyway
        return _split_bytes(name, buffer[start : start + size], 0, size, count).reshape(tensor.shape)
    array = np.frombuffer(buffer, dtype=_WIRE_DTYPES[datatype], count=count, offset=start)
    if not array.flags.aligned:  # an offset the dtype does not divide: runtimes want aligned data
        array = array.copy()
    # The client's memory: a backend must not write into it (Triton's inputs are const too).
    array.flags.writeable = False
    array = array.reshape(tensor.shape)
    if datatype == "BOOL" and count and array.view(np.uint8).max() > 1:
        raise InvalidArgument(f"input {name!r}: BOOL bytes must be 0 or 1")
    return array


def _decode_output_extensions(
    out: RequestOutput, shm: SharedMemoryLookup | None, decoded: DecodedInfer
) -> None:
    """An output's `classification` and `shared_memory_*` parameters (Triton's rules)."""
    params = out.parameters or {}
    name = out.name
    if "classification" in params:
        count = params["classification"]
        if type(count) is not int or count < 0:
            raise InvalidArgument(
                f"output {name!r}: 'classification' must be a non-negative integer, got "
                f"{_shown(count)}"
            )
        if count > _UINT64_MAX:
            raise InvalidArgument(f"output {name!r}: 'classification' {_too_large(count)}")
        if count:
            decoded.classification[name] = count
    if "shared_memory_region" not in params:
        _reject_stray_shm(params, "output", name)
        return
    if "classification" in params:
        raise InvalidArgument(
            f"output {name!r}: Output can't set both 'shared_memory_region' and 'classification'"
        )
    if params.get("binary_data") is True:
        raise InvalidArgument(
            f"output {name!r}: Output can't set both 'shared_memory_region' and 'binary_data'"
        )
    region, offset, size = _shm_window(params, "output", name)
    if shm is None:
        raise InvalidArgument(f"output {name!r}: shared memory is not available on this endpoint")
    lease = shm.acquire(region, offset, size)
    decoded.leases.append(lease)
    decoded.shm_outputs[name] = lease


def _write_shm(name: str, array: np.ndarray, datatype: str, lease: Lease) -> None:
    """Write an output's wire bytes into its region (Triton's layout, as for binary data)."""
    raw = _to_binary(array, datatype)
    size = len(raw) if isinstance(raw, bytes) else raw.nbytes
    if size > lease.byte_size:
        raise InvalidArgument(
            f"shared memory size specified with the request for output '{name}' "
            f"({lease.byte_size} bytes) should be at least {size} bytes to hold the results"
        )
    if size:
        lease.check_size()  # the object may have shrunk while the model ran
        target = np.frombuffer(lease.buffer, dtype=np.uint8, count=size, offset=lease.start)
        np.copyto(target, np.frombuffer(raw, dtype=np.uint8))


# --------------------------------------------------------------------------- classification

# Triton's bound on the elements one classification may sort.
_MAX_CLASSIFICATION_ELEMENTS = 1_000_000
_CLASSIFIABLE = frozenset(
    {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"}
)


def _classify(
    name: str,
    array: np.ndarray,
    datatype: str,
    count: int,
    batching: bool,
    labels: Sequence[str] | None,
) -> np.ndarray:
    """Top-`count` entries per batch item as BYTES "score:index[:label]", as Triton formats them.

    Scores print like C++ `std::to_string` (`%f` for floats, plain integers otherwise); ties keep
    the lower index first; shape is [batch, k] for a batching model, else [k].
    """
    if datatype not in _CLASSIFIABLE:
        raise InvalidArgument(
            f"output {name!r}: class result not available for output due to unsupported type "
            f"'{datatype}'"
        )
    rows = array.reshape(array.shape[0], -1) if batching and array.ndim > 0 else array.reshape(1, -1)
    if rows.shape[1] > _MAX_CLASSIFICATION_ELEMENTS:
        raise InvalidArgument(f"output {name!r}: classification output tensor too large")
    floating = array.dtype.kind == "f"
    k = min(count, rows.shape[1])
    items: list[bytes] = []
    for row in rows:
        # Stable descending order: sort the reversed row ascending, then reverse.
        order = (len(row) - 1 - np.argsort(row[::-1], kind="stable"))[::-1][:k]
        for index in order.tolist():
            score = row[index]
            text = f"{float(score):f}:{index}" if floating else f"{int(score)}:{index}"
            if labels is not None and index < len(labels):
                text += ":" + labels[index]
            items.append(text.encode())
    shape = (rows.shape[0], k) if batching and array.ndim > 0 else (k,)
    return _object_array(items).reshape(shape)
