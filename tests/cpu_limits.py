"""What a runtime allows on the machine running the tests, so no test assumes a core count."""

from __future__ import annotations

import functools


@functools.cache
def openvino_thread_cap() -> int:
    """The most CPU threads (and so streams) OpenVINO gives one compiled model here.

    OpenVINO caps INFERENCE_NUM_THREADS at the cores it may use (the process's affinity, minus
    hyper-threads under some hints): on a 1-core machine or container, asking for 2 gives 1.
    """
    import numpy as np
    import openvino as ov

    try:
        from openvino import opset13 as ops
    except ImportError:  # pragma: no cover - older OpenVINO
        from openvino.runtime import opset13 as ops

    x = ops.parameter([1, 1], np.float32, name="x")
    model = ov.Model([ops.relu(x)], [x], "cap")
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 1024, "PERFORMANCE_HINT": "LATENCY"})
    return int(compiled.get_property("INFERENCE_NUM_THREADS"))


def openvino_threads(requested: int) -> int:
    """What a model compiled with `requested` threads reports on this machine."""
    return min(requested, openvino_thread_cap())
