"""Decoupled, from its own thread: sends a response every 50 ms until request.is_cancelled(),
then writes "cancelled after N" to the file named by MARKER and sends the final flag. Gives up
after 30 s (writes "not cancelled"). The marker is written beside and renamed into place, so a
test that sees it exist reads it whole."""

import os
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            marker = Path(
                pb_utils.get_input_tensor_by_name(request, "MARKER").as_numpy()[0].decode()
            )
            threading.Thread(target=self._run, args=(request, marker), daemon=True).start()
        return None

    def _run(self, request, marker):
        sender = request.get_response_sender()
        deadline = time.monotonic() + 30
        sent = 0
        while not request.is_cancelled():
            if time.monotonic() > deadline:
                _write(marker, "not cancelled")
                break
            sender.send(
                pb_utils.InferenceResponse([pb_utils.Tensor("N", np.array([sent], dtype=np.int32))])
            )
            sent += 1
            time.sleep(0.05)
        else:
            _write(marker, f"cancelled after {sent}")
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _write(path, text):
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
