"""daemon.api.infer: where a request's decode and encode run."""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from daemon.api.infer import InferEndpoint
from daemon.api.kserve_codec import Codec, DecodedInfer
from daemon.backend import OFF_LOOP_BYTES, InferRequest, InferResponse
from daemon.model_config import ModelConfig, TensorConfig


class RecordingCodec(Codec):
    """The real codec, noting the thread of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[tuple[str, bool]] = []

    def decode_infer_request(self, *args: Any, **kwargs: Any) -> DecodedInfer:
        self.threads.append(("decode", threading.current_thread() is threading.main_thread()))
        return super().decode_infer_request(*args, **kwargs)

    def encode_infer_response(self, *args: Any, **kwargs: Any) -> tuple[bytes, int | None]:
        self.threads.append(("encode", threading.current_thread() is threading.main_thread()))
        return super().encode_infer_response(*args, **kwargs)


class Doubling:
    """The part of a loaded version the endpoint uses: the config, the name, `infer`."""

    name = "m"
    version = 1
    config = ModelConfig(
        name="m",
        input=[TensorConfig(name="x", data_type="FP32", dims=[-1])],
        output=[TensorConfig(name="y", data_type="FP32", dims=[-1])],
    )

    async def infer(self, request: InferRequest) -> InferResponse:
        return InferResponse({"y": request.inputs["x"] * 2})


def body_of(values: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "shape": [len(values)], "datatype": "FP32",
                                   "data": values.tolist()}]}).encode()


async def test_large_bodies_and_outputs_are_coded_off_the_loop() -> None:
    codec = RecordingCodec()
    endpoint = InferEndpoint(None, codec, None, None)  # type: ignore[arg-type]  # unused here
    rng = np.random.default_rng(1)
    small, large = (rng.standard_normal(n).astype(np.float32) for n in (8, 100_000))
    assert len(body_of(small)) < OFF_LOOP_BYTES <= len(body_of(large))
    for values, on_loop in ((small, True), (large, False)):
        codec.threads.clear()
        payload, json_length = await endpoint.run(Doubling(), body_of(values), None, None, None)  # type: ignore[arg-type]
        assert json_length is None
        [output] = json.loads(payload)["outputs"]
        np.testing.assert_array_equal(np.asarray(output["data"], np.float32), values * 2)
        assert codec.threads == [("decode", on_loop), ("encode", on_loop)]
