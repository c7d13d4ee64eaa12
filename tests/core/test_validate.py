"""Request validation against a model config: names, datatypes, shapes, batch, outputs."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.backend import InferRequest
from daemon.core.validate import validate_request
from daemon.errors import InvalidArgument
from daemon.model_config import ModelConfig, TensorConfig


def batched_config() -> ModelConfig:
    return ModelConfig(
        name="m",
        max_batch_size=8,
        input=[
            TensorConfig(name="IMAGE", data_type="TYPE_FP32", dims=[3, -1]),
            TensorConfig(name="IDS", data_type="INT64", dims=[4]),
            TensorConfig(name="MASK", data_type="BOOL", dims=[4], optional=True),
        ],
        output=[TensorConfig(name="OUT", data_type="FP32", dims=[2])],
    )


def plain_config() -> ModelConfig:
    return ModelConfig(
        name="p",
        input=[
            TensorConfig(name="TEXT", data_type="TYPE_STRING", dims=[-1]),
            TensorConfig(name="HALF", data_type="BF16", dims=[2, 2]),
        ],
        output=[TensorConfig(name="OUT", data_type="BYTES", dims=[-1])],
    )


def batched_inputs(batch: int = 2, width: int = 5) -> dict[str, np.ndarray]:
    return {
        "IMAGE": np.zeros((batch, 3, width), np.float32),
        "IDS": np.zeros((batch, 4), np.int64),
    }


def plain_inputs() -> dict[str, np.ndarray]:
    return {
        "TEXT": np.array([b"a", b"bc", b""], dtype=object),
        "HALF": np.zeros((2, 2), np.uint16),
    }


def error_of(request: InferRequest, config: ModelConfig) -> str:
    with pytest.raises(InvalidArgument) as info:
        validate_request(request, config)
    return info.value.message


def test_valid_batched_request_with_wildcard_and_optional() -> None:
    for batch, width in ((1, 1), (8, 7)):
        validate_request(InferRequest(inputs=batched_inputs(batch, width)), batched_config())
    inputs = batched_inputs() | {"MASK": np.ones((2, 4), bool)}
    validate_request(InferRequest(inputs=inputs, requested_outputs=("OUT",)), batched_config())


def test_valid_unbatched_request_bytes_and_bf16() -> None:
    validate_request(
        InferRequest(inputs=plain_inputs(), requested_outputs=("OUT",)), plain_config()
    )


def test_unknown_input() -> None:
    inputs = batched_inputs() | {"EXTRA": np.zeros((2, 1), np.float32)}
    message = error_of(InferRequest(inputs=inputs), batched_config())
    assert message == "unexpected inference input 'EXTRA' for model 'm'"


def test_missing_required_input() -> None:
    inputs = batched_inputs()
    del inputs["IDS"]
    message = error_of(InferRequest(inputs=inputs), batched_config())
    assert message == "request for model 'm' is missing required input(s) ['IDS']; it has ['IMAGE']"


@pytest.mark.parametrize(
    ("name", "array", "message"),
    [
        (
            "IMAGE",
            np.zeros((2, 3, 5), np.float64),
            "inference input 'IMAGE' data-type is 'FP64', but model 'm' expects 'FP32'",
        ),
        (
            "IDS",
            np.zeros((2, 4), np.int32),
            "inference input 'IDS' data-type is 'INT32', but model 'm' expects 'INT64'",
        ),
        (
            "IDS",
            np.zeros((2, 4), object),
            "inference input 'IDS' data-type is 'BYTES', but model 'm' expects 'INT64'",
        ),
        (
            "IMAGE",
            np.zeros((2, 3, 5), np.complex64),
            "inference input 'IMAGE' data-type is 'numpy complex64', but model 'm' expects 'FP32'",
        ),
    ],
)
def test_datatype_mismatch(name: str, array: np.ndarray, message: str) -> None:
    inputs = batched_inputs() | {name: array}
    assert error_of(InferRequest(inputs=inputs), batched_config()) == message


def test_bytes_must_be_object_array() -> None:
    inputs = plain_inputs() | {"TEXT": np.array([b"a", b"b"])}
    message = error_of(InferRequest(inputs=inputs), plain_config())
    assert "inference input 'TEXT' data-type is 'numpy |S1" in message
    assert "expects 'BYTES'" in message
    inputs = plain_inputs() | {"HALF": np.zeros((2, 2), np.float16)}
    message = error_of(InferRequest(inputs=inputs), plain_config())
    assert message == "inference input 'HALF' data-type is 'FP16', but model 'p' expects 'BF16'"


# Triton's wording (compact dims) plus a short note for batching models.
NOTE = ". NOTE: the model's max_batch_size > 0 means each input shape starts with the batch dimension"


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        (
            "IDS",
            (2, 5),
            "unexpected shape for input 'IDS' for model 'm'. Expected [-1,4], got [2,5]" + NOTE,
        ),
        ("IDS", (4,), "unexpected shape for input 'IDS' for model 'm'. Expected [-1,4], got [4]" + NOTE),
        (
            "IMAGE",
            (2, 4, 5),
            "unexpected shape for input 'IMAGE' for model 'm'. Expected [-1,3,-1], got [2,4,5]" + NOTE,
        ),
        (
            "IMAGE",
            (2, 3, 5, 1),
            "unexpected shape for input 'IMAGE' for model 'm'. Expected [-1,3,-1], got [2,3,5,1]" + NOTE,
        ),
    ],
)
def test_shape_mismatch_batched(name: str, shape: tuple[int, ...], message: str) -> None:
    dtype = batched_inputs()[name].dtype
    inputs = batched_inputs() | {name: np.zeros(shape, dtype)}
    assert error_of(InferRequest(inputs=inputs), batched_config()) == message


def test_shape_mismatch_unbatched() -> None:
    inputs = plain_inputs() | {"HALF": np.zeros((1, 2, 2), np.uint16)}
    message = error_of(InferRequest(inputs=inputs), plain_config())
    assert (
        message == "unexpected shape for input 'HALF' for model 'p'. Expected [2,2], got [1,2,2]"
    )
    inputs = plain_inputs() | {"TEXT": np.array(b"x", dtype=object)}
    message = error_of(InferRequest(inputs=inputs), plain_config())
    assert message == "unexpected shape for input 'TEXT' for model 'p'. Expected [-1], got []"


def test_batch_size_out_of_range() -> None:
    message = error_of(InferRequest(inputs=batched_inputs(0)), batched_config())
    assert message == "input 'IMAGE' for model 'm': batch size 0 must be between 1 and max_batch_size 8"
    # Triton's wording for a batch over the limit.
    message = error_of(InferRequest(inputs=batched_inputs(9)), batched_config())
    assert message == "inference request batch-size must be <= 8 for 'm' (input 'IMAGE' has 9)"


def test_inputs_must_share_batch_size() -> None:
    inputs = batched_inputs(2) | {"IDS": np.zeros((3, 4), np.int64)}
    message = error_of(InferRequest(inputs=inputs), batched_config())
    assert message == "inputs 'IMAGE' and 'IDS' for model 'm' have different batch sizes 2 and 3"


def test_unknown_requested_output() -> None:
    request = InferRequest(inputs=batched_inputs(), requested_outputs=("OUT", "NOPE"))
    assert error_of(request, batched_config()) == "unexpected inference output 'NOPE' for model 'm'"


def test_config_without_outputs_accepts_any_requested_output() -> None:
    config = batched_config()
    config.output = []
    validate_request(InferRequest(inputs=batched_inputs(), requested_outputs=("ANY",)), config)
