"""A decoupled "LLM": one response per word of the prompt when STREAM is true, else one.

Parameters: `COUNT` sends that many responses instead (0 = only the final flag), `FAIL_LAST`
makes the final response an error, `ERROR_AT` puts an error response at that index and goes
on, `LATE_SEND` tries to send after the final flag and keeps the error, which a later request
with `REPORT` gets back as its TEXT.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.config = json.loads(args["model_config"])
        assert self.config["model_transaction_policy"]["decoupled"] is True
        self.late_send_error = ""

    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            stream = bool(
                pb_utils.get_input_tensor_by_name(request, "STREAM").as_numpy().flatten()[0]
            )
            words = prompt.flatten()[0].decode().split()
            count = int(params.get("COUNT", len(words) if stream else 1))
            sender = request.get_response_sender()
            if params.get("REPORT"):
                text = np.array([[self.late_send_error.encode()]], dtype=np.object_)
                sender.send(
                    pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", text)]), flags=FINAL
                )
                continue
            for index in range(count):
                if index == params.get("ERROR_AT"):
                    sender.send(
                        pb_utils.InferenceResponse(error=pb_utils.TritonError(f"bad token {index}"))
                    )
                    continue
                word = words[index % len(words)] if words else ""
                text = np.array([[word.encode()]], dtype=np.object_)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", text)]))
            if params.get("FAIL_LAST"):
                error = pb_utils.TritonError("An Error Occurred", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            else:
                sender.send(flags=FINAL)
            if params.get("LATE_SEND"):
                try:
                    sender.send(pb_utils.InferenceResponse([]))
                except pb_utils.TritonModelException as exc:
                    self.late_send_error = str(exc)
        return None
