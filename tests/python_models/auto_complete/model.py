"""No config.pbtxt: the model describes itself in auto_complete_config (add/subtract of two
FP32 vectors, batching up to 4, dynamic batching on). `AUTOCOMPLETE_MODE` in the environment
of the test selects a broken variant."""

import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        mode = os.environ.get("EDGED_TEST_AUTOCOMPLETE", "")
        config = auto_complete_model_config.as_dict()
        existing = {t["name"] for t in config["input"]}
        for name in ("INPUT0", "INPUT1"):
            if name not in existing:
                auto_complete_model_config.add_input(
                    {"name": name, "data_type": "TYPE_FP32", "dims": [4]}
                )
        auto_complete_model_config.add_output(
            {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}
        )
        auto_complete_model_config.add_output(
            {
                "name": "OUTPUT1",
                "data_type": "TYPE_NOT_A_TYPE" if mode == "bad_type" else "TYPE_FP32",
                "dims": [4],
            }
        )
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        auto_complete_model_config.set_model_transaction_policy({"decoupled": False})
        if mode == "raise":
            auto_complete_model_config.add_input(
                {"name": "INPUT0", "data_type": "TYPE_INT8", "dims": [4]}
            )
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]
                )
            )
        return responses
