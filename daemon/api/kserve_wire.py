"""The KServe v2 infer request and response as msgspec decodes and encodes them.

Apart from their codec (daemon.api.kserve_codec) because mypyc compiles the codec and would
drop these classes' keywords (`forbid_unknown_fields`, `kw_only`, ...); a Struct gains nothing
from compiling."""

from __future__ import annotations

from typing import Any

import msgspec

# A KServe `$parameter` value.
Parameter = bool | int | float | str


class RequestInput(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Parameter] | None = None
    # Flat or nested (row-major) JSON array; absent when the tensor travels as binary.
    data: Any = None


class RequestOutput(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    name: str
    parameters: dict[str, Parameter] | None = None


class InferRequestBody(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    inputs: list[RequestInput]
    id: str = ""
    # Values are checked by `_request_parameters`, which words errors as Triton does.
    parameters: dict[str, Any] | None = None
    outputs: list[RequestOutput] | None = None
    # Triton's own protocol examples put these in the body; the URL is what counts, so they
    # are accepted and ignored rather than rejected as unknown fields.
    model_name: str = ""
    model_version: str = ""


class ResponseOutput(msgspec.Struct, omit_defaults=True, gc=False):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferResponseBody(msgspec.Struct, omit_defaults=True, kw_only=True, gc=False):
    model_name: str
    model_version: str
    id: str = ""
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class ErrorBody(msgspec.Struct):
    error: str
