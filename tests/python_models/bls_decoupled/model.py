"""Decoupled BLS: streams mock_llm's words with exec(decoupled=True) and with
async_exec(decoupled=True), stops slow_stream with cancel() after 3 responses (slow_stream
writes MARKER when it sees the cancellation), and collects the error of a call to a model that
does not exist."""

import numpy as np
import triton_python_backend_utils as pb_utils


def words_of(responses):
    words = []
    for response in responses:
        if response.has_error():
            words.append(b"error: " + response.error().message().encode())
        elif response.output_tensors():
            words.append(pb_utils.get_output_tensor_by_name(response, "TEXT").as_numpy()[0][0])
    return words


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()[0]
            marker = pb_utils.get_input_tensor_by_name(request, "MARKER")

            def llm(model="mock_llm", prompt=prompt):
                return pb_utils.InferenceRequest(
                    model_name=model,
                    requested_output_names=["TEXT"],
                    inputs=[
                        pb_utils.Tensor("PROMPT", np.array([[prompt]], dtype=np.object_)),
                        pb_utils.Tensor("STREAM", np.array([[True]])),
                    ],
                )

            words = words_of(llm().exec(decoupled=True))
            async_words = words_of(await llm().async_exec(decoupled=True))
            errors = words_of(llm("no_such_model").exec(decoupled=True))

            slow = pb_utils.InferenceRequest(
                model_name="slow_stream", requested_output_names=["N"], inputs=[marker]
            ).exec(decoupled=True)
            received = 0
            for _ in slow:
                received += 1
                if received == 3:
                    slow.cancel()

            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("WORDS", np.array(words, dtype=np.object_)),
                        pb_utils.Tensor("ASYNC_WORDS", np.array(async_words, dtype=np.object_)),
                        pb_utils.Tensor("BEFORE_CANCEL", np.array([received], dtype=np.int32)),
                        pb_utils.Tensor("ERRORS", np.array(errors, dtype=np.object_)),
                    ]
                )
            )
        return responses
