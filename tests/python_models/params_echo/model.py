"""Echoes INPUT0, and in PARAMS (JSON) the request's parameters and requested output names."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            seen = {
                "parameters": json.loads(request.parameters()),
                "requested": sorted(request.requested_output_names()),
                "raw": request.parameters(),
                "requested_type": type(request.requested_output_names()).__name__,
            }
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor(
                            "OUTPUT0",
                            pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy(),
                        ),
                        pb_utils.Tensor(
                            "PARAMS",
                            np.array([json.dumps(seen, sort_keys=True).encode()], dtype=np.object_),
                        ),
                    ]
                )
            )
        return responses
