"""FP32 identity; echoes the request's parameters and requested outputs as response parameters."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            params = json.loads(request.parameters())
            echoed = {f"echo_{key}": value for key, value in params.items()}
            echoed["requested"] = ",".join(request.requested_output_names())
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", tensor.as_numpy())], parameters=echoed
                )
            )
        return responses
