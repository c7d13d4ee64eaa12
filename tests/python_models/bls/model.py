"""BLS: calls the model named by MODEL_NAME with INPUT0, once with exec() and twice at once
with async_exec(); OUTPUT0 is exec's answer, ASYNC0 the sum of the two async answers. A failed
call's error becomes this request's error."""

import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")

            def call(name=name, x=x, request=request):
                return pb_utils.InferenceRequest(
                    model_name=name,
                    requested_output_names=["OUTPUT0"],
                    inputs=[x],
                    parameters={"from": "bls"},
                    trace=request.trace(),
                )

            first = call().exec()
            if first.has_error():
                responses.append(pb_utils.InferenceResponse(error=first.error()))
                continue
            second, third = await asyncio.gather(call().async_exec(), call().async_exec())
            out = pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy()
            both = sum(
                pb_utils.get_output_tensor_by_name(r, "OUTPUT0").as_numpy() for r in (second, third)
            )
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", out), pb_utils.Tensor("ASYNC0", both)]
                )
            )
        return responses
