"""The Python backend running real Triton-style model.py files written here."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from model_builders import write_simple_repository

from daemon.backend import (
    OFF_LOOP_BYTES,
    Backend,
    Device,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from daemon.core.stats import MetricsRegistry
from daemon.errors import BackendError, ConfigError, InvalidArgument
from daemon.model_config import InstanceGroup, ModelConfig, TensorConfig
from support import METRICS_MODEL, metric_samples, x_to_y_model

ClassOf = Callable[[str], type[Backend]]
RNG = np.random.default_rng(11)


def simple_config(name: str = "simple_python") -> ModelConfig:
    def tensor(n: str) -> TensorConfig:
        return TensorConfig(name=n, data_type="INT32", dims=[16])

    return ModelConfig(
        name=name,
        backend="python",
        max_batch_size=8,
        input=[tensor("INPUT0"), tensor("INPUT1")],
        output=[tensor("OUTPUT0"), tensor("OUTPUT1")],
        parameters={"greeting": "hello"},
    )


def simple_inputs(rows: int) -> dict[str, np.ndarray]:
    return {
        "INPUT0": RNG.integers(-100, 100, (rows, 16), dtype=np.int32),
        "INPUT1": RNG.integers(-100, 100, (rows, 16), dtype=np.int32),
    }


def write_model(repo: Path, name: str, source: str) -> Path:
    """`<repo>/<name>/1/model.py`; returns the version directory."""
    version_dir = repo / name / "1"
    version_dir.mkdir(parents=True)
    (version_dir / "model.py").write_text(textwrap.dedent(source), encoding="utf-8")
    return version_dir


async def load(cls: type[Backend], config: ModelConfig, artifact: Path, index: int = 0) -> Backend:
    backend = cls(InstanceContext(config.name, 1, instance_index=index))
    await backend.load(config, artifact, Device("cpu"))
    return backend


def outputs_of(result: object) -> dict[str, np.ndarray]:
    assert isinstance(result, InferResponse), f"expected a response, got {result!r}"
    return result.outputs


# A model whose behaviour each request picks with its "mode" parameter.
MODES_MODEL = """
    import json

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.args = args
            self.calls = 0

        def execute(self, requests):
            self.calls += 1
            responses = []
            for request in requests:
                mode = json.loads(request.parameters()).get("mode", "ok")
                if mode == "raise":
                    raise ValueError("boom from model.py")
                if mode == "error":
                    responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("bad row")))
                    continue
                if mode == "invalid":
                    error = pb_utils.TritonError("negative", pb_utils.TritonError.INVALID_ARG)
                    responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                    continue
                x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUTPUT0", x * 2),
                    pb_utils.Tensor("OUTPUT1", np.array([[request.request_id()]], dtype=np.object_)),
                    pb_utils.Tensor("NAMES", np.array(sorted(request.requested_output_names()), dtype=np.str_)),
                ]))
            return responses
    """


def modes_config(name: str = "modes") -> ModelConfig:
    return ModelConfig(
        name=name,
        backend="python",
        max_batch_size=8,
        input=[TensorConfig(name="INPUT0", data_type="FP32", dims=[-1])],
        output=[
            TensorConfig(name="OUTPUT0", data_type="FP32", dims=[-1]),
            TensorConfig(name="OUTPUT1", data_type="BYTES", dims=[1]),
            TensorConfig(name="NAMES", data_type="BYTES", dims=[-1]),
        ],
    )


def modes_request(mode: str, request_id: str = "", rows: int = 1) -> InferRequest:
    x = RNG.standard_normal((rows, 4)).astype(np.float32)
    return InferRequest({"INPUT0": x}, id=request_id, parameters={"mode": mode})


# --------------------------------------------------------------------------- the demo model


async def test_simple_python_matches_numpy(backend_class: ClassOf, tmp_path: Path) -> None:
    write_simple_repository(tmp_path)
    backend = await load(backend_class("python"), simple_config(), tmp_path / "simple_python" / "1")
    requests = [InferRequest(simple_inputs(rows)) for rows in (1, 3, 2)]
    results = await backend.execute(requests)
    await backend.unload()
    for request, result in zip(requests, results, strict=True):
        out = outputs_of(result)
        a, b = request.inputs["INPUT0"], request.inputs["INPUT1"]
        assert out["OUTPUT0"].dtype == np.int32
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)


async def test_execute_reports_its_input_and_output_time_apart(backend_class: ClassOf, tmp_path: Path) -> None:
    """Triton's three compute phases: the requests handed to the model, `execute`, the
    responses read back. A model that sleeps 200 ms in `execute`: that time is none of the
    other two, which are each measured (> 0) and shorter than it (no tighter bound: a loaded
    machine can stall any step for milliseconds; timing goals live in bench/)."""
    version = write_model(tmp_path, "sleepy", """
        import time
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                time.sleep(0.2)
                return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
    """)
    backend = await load(backend_class("python"), simple_config("sleepy"), version)
    try:
        inputs = simple_inputs(2)
        results = await backend.execute([InferRequest(inputs, requested_outputs=("OUTPUT0",))] * 3)
        for result in results:
            np.testing.assert_array_equal(outputs_of(result)["OUTPUT0"], inputs["INPUT0"])
        input_ns, output_ns = backend.phase_ns
        assert 0 < input_ns < 200_000_000 and 0 < output_ns < 200_000_000
    finally:
        await backend.unload()


async def test_requested_outputs_are_selected(backend_class: ClassOf, tmp_path: Path) -> None:
    write_simple_repository(tmp_path)
    backend = await load(
        backend_class("python"), simple_config(), tmp_path / "simple_python" / "1" / "model.py"
    )
    inputs = simple_inputs(1)
    [result] = await backend.execute([InferRequest(inputs, requested_outputs=("OUTPUT1",))])
    await backend.unload()
    assert set(outputs_of(result)) == {"OUTPUT1"}


# --------------------------------------------------------------------------- errors


async def test_execute_raising_fails_that_batch_and_the_next_call_works(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    backend = await load(
        backend_class("python"), modes_config(), write_model(tmp_path, "modes", MODES_MODEL)
    )
    failed = await backend.execute([modes_request("ok"), modes_request("raise")])
    assert len(failed) == 2
    for error in failed:
        assert isinstance(error, BackendError)
        # Triton's words, naming the model instance (its group's name, its place in it).
        assert error.message == (
            "Failed to process the request(s) for model 'modes_0', message: "
            "ValueError: boom from model.py"
        )
    request = modes_request("ok", rows=3)
    [result] = await backend.execute([request])
    np.testing.assert_array_equal(outputs_of(result)["OUTPUT0"], request.inputs["INPUT0"] * 2)
    await backend.unload()


# A response's outputs are read back where their size says: BYTES elements are converted one
# by one, so OFF_LOOP_BYTES of them (8 bytes each as object pointers: 32 768) or more are read
# on the instance's thread, fewer on the loop.
# The model's response reports the thread that reads its outputs.
THREAD_MODEL = """
    import json
    import threading

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class Response(pb_utils.InferenceResponse):
        def __init__(self, count):
            super().__init__(output_tensors=[])
            self.count = count

        def output_tensors(self):
            name = threading.current_thread().name.encode()
            return [pb_utils.Tensor("OUTPUT0", np.array([name] * self.count, dtype=np.object_))]


    class TritonPythonModel:
        def execute(self, requests):
            return [Response(json.loads(r.parameters())["count"]) for r in requests]
"""


@pytest.mark.parametrize("count", [2, 70_000])
async def test_large_bytes_outputs_are_read_on_the_instance_thread(
    backend_class: ClassOf, tmp_path: Path, count: int
) -> None:
    config = ModelConfig(
        name="threads",
        backend="python",
        max_batch_size=0,
        input=[TensorConfig(name="INPUT0", data_type="INT32", dims=[1])],
        output=[TensorConfig(name="OUTPUT0", data_type="BYTES", dims=[-1])],
    )
    backend = await load(backend_class("python"), config, write_model(tmp_path, "threads", THREAD_MODEL))
    try:
        request = InferRequest({"INPUT0": np.zeros(1, np.int32)}, parameters={"count": count})
        [result] = await backend.execute([request])
    finally:
        await backend.unload()
    output = outputs_of(result)["OUTPUT0"]
    assert output.shape == (count,)
    assert set(output.tolist()) == {b"MainThread" if count * 8 < OFF_LOOP_BYTES else b"python-threads-0"}


async def test_response_error_fails_only_that_request(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    backend = await load(
        backend_class("python"), modes_config(), write_model(tmp_path, "modes", MODES_MODEL)
    )
    requests = [
        modes_request("ok", "a"),
        modes_request("error", "b"),
        modes_request("invalid", "c"),
    ]
    ok, error, invalid = await backend.execute(requests)
    await backend.unload()
    np.testing.assert_array_equal(outputs_of(ok)["OUTPUT0"], requests[0].inputs["INPUT0"] * 2)
    assert outputs_of(ok)["OUTPUT1"].tolist() == [[b"a"]]
    assert isinstance(error, BackendError) and "bad row" in error.message
    # The TritonError code picks the status: INVALID_ARG is a client error.
    assert isinstance(invalid, InvalidArgument) and "negative" in invalid.message


ERROR_CODE_MODEL = """
    import json

    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            return [
                pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "no", getattr(pb_utils.TritonError, json.loads(request.parameters())["mode"])
                ))
                for request in requests
            ]
    """


async def test_error_codes_give_tritons_statuses(backend_class: ClassOf, tmp_path: Path) -> None:
    """The status Triton 2.51 answers each TritonError code with (seen there, one by one)."""
    expected = {
        "UNKNOWN": 400, "INTERNAL": 500, "NOT_FOUND": 404, "INVALID_ARG": 400, "UNAVAILABLE": 503,
        "UNSUPPORTED": 501, "ALREADY_EXISTS": 400, "CANCELLED": 400,
    }
    backend = await load(
        backend_class("python"), modes_config(), write_model(tmp_path, "modes", ERROR_CODE_MODEL)
    )
    results = await backend.execute([modes_request(code) for code in expected])
    await backend.unload()
    assert {code: getattr(result, "status", None) for code, result in zip(expected, results, strict=True)} == expected


async def test_wrong_number_of_responses_fails_the_batch(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    source = """
        class TritonPythonModel:
            def execute(self, requests):
                return []
    """
    backend = await load(
        backend_class("python"), modes_config("short"), write_model(tmp_path, "short", source)
    )
    results = await backend.execute([modes_request("ok"), modes_request("ok")])
    await backend.unload()
    assert all(
        isinstance(r, BackendError) and "one InferenceResponse per request" in r.message
        for r in results
    )
    assert len(results) == 2


async def test_requested_output_names_default_to_all_outputs(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    backend = await load(
        backend_class("python"), modes_config(), write_model(tmp_path, "modes", MODES_MODEL)
    )
    everything, chosen = await backend.execute(
        [
            modes_request("ok"),
            InferRequest(modes_request("ok").inputs, requested_outputs=("NAMES", "OUTPUT0")),
        ]
    )
    await backend.unload()
    # str outputs come back as BYTES (object arrays of bytes), like every BYTES tensor.
    assert outputs_of(everything)["NAMES"].tolist() == [b"NAMES", b"OUTPUT0", b"OUTPUT1"]
    assert outputs_of(chosen)["NAMES"].tolist() == [b"NAMES", b"OUTPUT0"]
    assert set(outputs_of(chosen)) == {"NAMES", "OUTPUT0"}


UNDECLARED_OUTPUT_MODEL = """
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUTPUT0", x), pb_utils.Tensor("UNDECLARED", x)
                ]))
            return responses
    """


async def test_an_output_the_config_does_not_declare_is_sent_only_when_asked_for(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    """As Triton 2.51: a request naming no output gets the config's outputs, not every tensor
    the model returns; one that names the undeclared output gets it."""
    backend = await load(
        backend_class("python"), modes_config(), write_model(tmp_path, "modes", UNDECLARED_OUTPUT_MODEL)
    )
    default, named = await backend.execute(
        [modes_request("ok"), InferRequest(modes_request("ok").inputs, requested_outputs=("UNDECLARED",))]
    )
    await backend.unload()
    assert set(outputs_of(default)) == {"OUTPUT0"}
    assert set(outputs_of(named)) == {"UNDECLARED"}


OBJECT_OUTPUT_MODEL = """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            texts = np.array([1, 2.5, None, np.float32(0.5), b"x", bytearray(b"y"), "\u00e9"], dtype=np.object_)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("NAMES", texts)]) for _ in requests]
    """


async def test_objects_in_a_bytes_output_are_sent_as_their_text(backend_class: ClassOf, tmp_path: Path) -> None:
    """Triton's python backend writes an object that is not bytes as str(object) in UTF-8:
    models rely on it (an int label in a BYTES output), and bytes(1) would be a zero byte."""
    backend = await load(
        backend_class("python"), modes_config(), write_model(tmp_path, "modes", OBJECT_OUTPUT_MODEL)
    )
    [result] = await backend.execute([InferRequest(modes_request("ok").inputs, requested_outputs=("NAMES",))])
    await backend.unload()
    assert outputs_of(result)["NAMES"].tolist() == [b"1", b"2.5", b"None", b"0.5", b"x", b"y", "\u00e9".encode()]


async def test_unload_then_execute_fails_cleanly(backend_class: ClassOf, tmp_path: Path) -> None:
    backend = await load(
        backend_class("python"), modes_config(), write_model(tmp_path, "modes", MODES_MODEL)
    )
    await backend.unload()
    [result] = await backend.execute([modes_request("ok")])
    assert isinstance(result, BackendError) and "'modes'" in result.message


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import no_such_module_here\n", r"model\.py.*ModuleNotFoundError.*no_such_module_here"),
        ("def broken(:\n", r"model\.py.*SyntaxError"),
        ("class SomethingElse:\n    pass\n", r"model\.py.*no class TritonPythonModel"),
        (
            "class TritonPythonModel:\n    def initialize(self, args):\n        raise KeyError('weights')\n"
            "    def execute(self, requests):\n        return []\n",
            r"model\.py.*initialize raised KeyError",
        ),
    ],
)
async def test_broken_model_py_is_backend_error_naming_model_and_file(
    backend_class: ClassOf, tmp_path: Path, source: str, expected: str
) -> None:
    version_dir = write_model(tmp_path, "broken", source)
    backend = backend_class("python")(InstanceContext("broken", 1))
    with pytest.raises(BackendError, match=expected) as info:
        await backend.load(modes_config("broken"), version_dir, Device("cpu"))
    assert "'broken'" in info.value.message
    # A failed import leaves nothing behind in sys.modules.
    assert not [m for m in sys.modules if m.startswith("edged_python_model_broken")]


async def test_missing_model_py_is_backend_error(backend_class: ClassOf, tmp_path: Path) -> None:
    backend = backend_class("python")(InstanceContext("gone", 1))
    with pytest.raises(BackendError, match=r"'gone'.*model\.py"):
        await backend.load(modes_config("gone"), tmp_path, Device("cpu"))


# --------------------------------------------------------------------------- isolation, lifecycle


# Module state plus a pickle round trip of a class it defines: pickle finds the class through
# sys.modules[cls.__module__], so it breaks if two models' modules shared a name.
COUNTER_MODEL = """
    import pickle

    import numpy as np
    import triton_python_backend_utils as pb_utils

    LABEL = {label!r}
    CALLS = []


    class Label:
        def __init__(self, text):
            self.text = text


    class TritonPythonModel:
        def execute(self, requests):
            CALLS.append(len(requests))
            label = pickle.loads(pickle.dumps(Label(LABEL))).text
            return [
                pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUTPUT1", np.array([[label.encode()]], dtype=np.object_)),
                    pb_utils.Tensor("OUTPUT0", np.array([[float(len(CALLS))]], dtype=np.float32)),
                ])
                for _ in requests
            ]
"""


async def test_two_models_with_model_py_do_not_collide(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    cls = backend_class("python")
    first = await load(
        cls,
        modes_config("first"),
        write_model(tmp_path, "first", COUNTER_MODEL.format(label="one")),
    )
    second = await load(
        cls,
        modes_config("second"),
        write_model(tmp_path, "second", COUNTER_MODEL.format(label="two")),
    )
    # A second instance of the first model gets its own module state too, like Triton's processes.
    first_b = await load(cls, modes_config("first"), tmp_path / "first" / "1", index=1)
    request = modes_request("ok")
    for _ in range(3):
        await first.execute([request])
    [a] = await first.execute([request])
    [b] = await second.execute([request])
    [c] = await first_b.execute([request])
    # Unloading one model leaves the other's module in place.
    await first.unload()
    [d] = await second.execute([request])
    await second.unload()
    await first_b.unload()
    assert outputs_of(d)["OUTPUT1"].tolist() == [[b"two"]]
    assert outputs_of(a)["OUTPUT1"].tolist() == [[b"one"]]
    assert outputs_of(b)["OUTPUT1"].tolist() == [[b"two"]]
    assert outputs_of(c)["OUTPUT1"].tolist() == [[b"one"]]
    assert [outputs_of(r)["OUTPUT0"].item() for r in (a, b, c)] == [4.0, 1.0, 1.0]
    assert not [
        m
        for m in sys.modules
        if m.startswith(("edged_python_model_first", "edged_python_model_second"))
    ]


async def test_batch_reaches_execute_as_one_list(backend_class: ClassOf, tmp_path: Path) -> None:
    backend = await load(
        backend_class("python"),
        modes_config("batch"),
        write_model(tmp_path, "batch", COUNTER_MODEL.format(label="x")),
    )
    results = await backend.execute([modes_request("ok") for _ in range(3)])
    module = sys.modules[type(backend.model).__module__]  # type: ignore[attr-defined]
    calls = list(module.CALLS)
    await backend.unload()
    assert len(results) == 3
    assert calls == [3]


def test_instance_names_are_tritons(backend_class: ClassOf) -> None:
    """`<group name>_<place in the group>`, a group unnamed in the config being
    `<model>_<group index>`: what Triton 2.51 passes as model_instance_name and puts in its
    errors (seen there with these groups)."""
    instance_name = sys.modules[backend_class("python").__module__].instance_name
    config = modes_config("names")
    config.instance_group = [InstanceGroup(count=2), InstanceGroup(count=1, name="extra")]
    assert [instance_name(config, "names", i) for i in range(3)] == ["names_0_0", "names_0_1", "extra_0"]
    # No groups: Triton 2.51 makes one named after the model ('modes', served in its config).
    assert instance_name(modes_config(), "modes", 1) == "modes_1"


async def test_initialize_gets_triton_args(backend_class: ClassOf, tmp_path: Path) -> None:
    version_dir = write_model(tmp_path, "modes", MODES_MODEL)
    cls = backend_class("python")
    config = modes_config()
    config.parameters = {"greeting": "hello"}
    backend = cls(InstanceContext("modes", 1, instance_index=1))
    await backend.load(config, version_dir, Device("cpu"))
    args = backend.model.args  # type: ignore[attr-defined]
    await backend.unload()
    assert args["model_name"] == "modes"
    assert args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_name"] == "modes_1"  # no instance_group: one group named after the model
    assert args["model_instance_device_id"] == "0"
    assert Path(args["model_repository"]) == tmp_path / "modes"
    model_config = json.loads(args["model_config"])
    assert model_config["name"] == "modes"
    assert model_config["max_batch_size"] == 8
    assert [t["data_type"] for t in model_config["input"]] == ["TYPE_FP32"]
    assert [t["data_type"] for t in model_config["output"]] == [
        "TYPE_FP32",
        "TYPE_STRING",
        "TYPE_STRING",
    ]
    assert model_config["output"][0]["dims"] == [-1]
    assert model_config["parameters"] == {"greeting": {"string_value": "hello"}}
    assert "dynamic_batching" not in model_config


@pytest.mark.parametrize(("device", "kind", "device_id", "gpus"), [
    (Device("cpu"), "CPU", "0", []),
    (Device("gpu:nvidia", 1), "GPU", "1", [1]),
])
async def test_triton_args_name_the_instances_device(
    backend_class: ClassOf, tmp_path: Path, device: Device, kind: str, device_id: str, gpus: list[int]
) -> None:
    """What Triton gives an instance placed on a GPU (its kind, device id and the default
    group of the served config) or on the CPU; the python backend itself runs on the CPU."""
    backend = backend_class("python")(InstanceContext("modes", 1, instance_count=2))
    await backend.load(modes_config(), write_model(tmp_path, "modes", MODES_MODEL), device)
    args = backend.model.args  # type: ignore[attr-defined]
    await backend.unload()
    assert (args["model_instance_kind"], args["model_instance_device_id"]) == (kind, device_id)
    group = json.loads(args["model_config"])["instance_group"]
    assert group == [{"name": "modes", "kind": f"KIND_{kind}", "count": 2, "gpus": gpus, "host_policy": "",
                      "secondary_devices": [], "profile": [], "passive": False}]


async def test_finalize_is_called_on_unload(backend_class: ClassOf, tmp_path: Path) -> None:
    source = """
        from pathlib import Path


        class TritonPythonModel:
            def initialize(self, args):
                self.marker = Path(args["model_repository"]) / "finalized"

            def execute(self, requests):
                return []

            def finalize(self):
                self.marker.write_text("bye")
    """
    backend = await load(
        backend_class("python"), modes_config("fin"), write_model(tmp_path, "fin", source)
    )
    assert not (tmp_path / "fin" / "finalized").exists()
    await backend.unload()
    assert (tmp_path / "fin" / "finalized").read_text() == "bye"


async def test_async_execute_runs(backend_class: ClassOf, tmp_path: Path) -> None:
    source = """
        import asyncio

        import triton_python_backend_utils as pb_utils


        class TritonPythonModel:
            async def execute(self, requests):
                await asyncio.sleep(0)
                return [
                    pb_utils.InferenceResponse([
                        pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + 1)
                    ])
                    for r in requests
                ]
    """
    backend = await load(
        backend_class("python"), modes_config("aio"), write_model(tmp_path, "aio", source)
    )
    request = modes_request("ok", rows=2)
    [result] = await backend.execute([request])
    await backend.unload()
    np.testing.assert_array_equal(outputs_of(result)["OUTPUT0"], request.inputs["INPUT0"] + 1)


# --------------------------------------------------------------------------- the pb_utils module


async def test_pb_utils_helpers(backend_class: ClassOf, tmp_path: Path) -> None:
    backend = await load(
        backend_class("python"), modes_config(), write_model(tmp_path, "modes", MODES_MODEL)
    )
    pb_utils = sys.modules["triton_python_backend_utils"]
    config = json.loads(backend.model.args["model_config"])  # type: ignore[attr-defined]
    await backend.unload()
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert (
        pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "OUTPUT1")["data_type"]
        )
        is np.object_
    )
    assert pb_utils.get_input_config_by_name(config, "INPUT0")["dims"] == [-1]
    assert pb_utils.get_output_config_by_name(config, "NOPE") is None
    # Triton's TRITONSERVER_DataType codes (tests/compat checks these against Triton's module).
    assert [pb_utils.numpy_to_triton_type(t) for t in (np.bool_, np.int16, np.float32, np.object_, np.str_)] == [
        1, 7, 11, 13, None
    ]
    assert pb_utils.triton_to_numpy_type(11) is np.float32 and pb_utils.triton_to_numpy_type(14) is None
    texts = np.array([b"a\x00", "\u00e9", 3], dtype=np.object_)
    packed = pb_utils.serialize_byte_tensor(texts)
    assert packed == b"\x02\0\0\0a\x00" + b"\x02\0\0\0\xc3\xa9" + b"\x01\0\0\x003"
    assert pb_utils.deserialize_bytes_tensor(packed).tolist() == [b"a\x00", "\u00e9".encode(), b"3"]
    with pytest.raises(pb_utils.TritonModelException, match="runs past the end"):
        pb_utils.deserialize_bytes_tensor(packed[:-1])
    numbers = np.arange(6, dtype=np.float32).reshape(2, 3)
    shared = pb_utils.Tensor.from_dlpack("D", pb_utils.Tensor("N", numbers).to_dlpack()).as_numpy()
    assert np.shares_memory(shared, numbers) and shared.tolist() == numbers.tolist()
    with pytest.raises(pb_utils.TritonModelException, match="cannot be shared through DLPack"):
        pb_utils.Tensor("S", texts).to_dlpack()
    request = pb_utils.InferenceRequest(model_name="m", preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU))
    request.set_flags(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
    assert request.flags() == 2
    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    # No OpenTelemetry context to hand on (Triton's answer without one).
    assert request.trace().get_context() is None
    assert isinstance(request.trace(), pb_utils.InferenceTrace)
    with pytest.raises(pb_utils.TritonModelException, match="set_release_flags: unknown flags 3"):
        request.set_release_flags(3)
    # Tensors as Triton makes them (checked side by side): C order, and no dtype Triton lacks.
    strided = pb_utils.Tensor("T", numbers.T).as_numpy()
    assert strided.flags.c_contiguous and strided.tolist() == numbers.T.tolist()
    assert np.shares_memory(pb_utils.Tensor("C", numbers).as_numpy(), numbers)
    for unsupported in (np.zeros(2, np.complex64), np.array(["2020-01-01"], "datetime64[D]")):
        with pytest.raises(pb_utils.TritonModelException, match="NumPy dtype is not supported"):
            pb_utils.Tensor("X", unsupported)
    with pytest.raises(TypeError, match="must be a numpy array, got None"):
        pb_utils.Tensor("X", None)
    tensor = pb_utils.Tensor("T", np.arange(3))
    response = pb_utils.InferenceResponse(output_tensors=[tensor])
    assert pb_utils.get_output_tensor_by_name(response, "T") is tensor
    assert tensor.name() == "T" and tensor.as_numpy().tolist() == [0, 1, 2]
    assert not response.has_error() and response.error() is None
    failed = pb_utils.InferenceResponse(error=pb_utils.TritonError("no"))
    assert failed.has_error() and failed.error().message() == "no"
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.triton_string_to_numpy("TYPE_COMPLEX")


# --------------------------------------------------------------------------- custom metrics

def metrics_config(name: str) -> ModelConfig:
    """support.x_to_y_model's config."""
    return ModelConfig(
        name=name,
        backend="python",
        input=[TensorConfig(name="X", data_type="FP32", dims=[1])],
        output=[TensorConfig(name="Y", data_type="BYTES", dims=[1])],
    )


async def test_custom_metrics_answer_as_tritons(backend_class: ClassOf, tmp_path: Path) -> None:
    """What support.METRICS_MODEL reads back and its misuse raise, with the texts Triton 2.51
    gave for the same calls (tests/compat compares the rest live)."""
    metrics = MetricsRegistry()
    backend = backend_class("python")(InstanceContext("metrics", 1, metrics=metrics.custom))
    x_to_y_model(tmp_path, "metrics", METRICS_MODEL, "TYPE_STRING dims: [ 1 ]")
    await backend.load(metrics_config("metrics"), tmp_path / "metrics" / "1", Device("cpu"))
    request = InferRequest({"X": np.array([0.5], dtype=np.float32)}, parameters={"misuse": True})
    report = json.loads(outputs_of((await backend.execute([request]))[0])["Y"][0])
    misuse = report["misuse"]

    def failed(verb: str, message: str) -> list[str]:
        return ["TritonModelException", f"{verb}: Failed to process the request for model 'metrics_0', message: {message}"]

    assert report["values"] == [2.5, 2.5, 0.0, 0.25, 2.5]
    assert report["kinds"] == [0, 1, 2, "<MetricKind.COUNTER: 0>", "MetricKind.GAUGE", "MetricKind", False, "Metric"]
    assert report["family_attrs"] == ["COUNTER", "GAUGE", "HISTOGRAM", "Metric"]
    assert report["metric_attrs"] == ["increment", "observe", "set", "value"]
    assert misuse["counter_neg"] == failed(
        "Failed to increment metric value",
        "TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically by non-negative values.",
    )
    assert misuse["counter_set"] == failed("Failed to set metric value", "TRITONSERVER_METRIC_KIND_COUNTER does not support Set")
    assert misuse["gauge_observe"] == failed(
        "Failed to observe metric value", "TRITONSERVER_METRIC_KIND_GAUGE does not support Observe"
    )
    assert misuse["hist_value"] == failed("Failed to get metric value", "TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Value")
    assert misuse["no_buckets"] == ["TritonModelException", "Failed to create metric. Missing required buckets."]
    assert misuse["tuple_buckets"] == ["TritonModelException", "Failed to create metric. Buckets must be a list."]
    assert misuse["counter_buckets"] == ["TritonModelException", "Failed to create metric. Unexpected buckets found."]
    assert misuse["labels_list"] == ["TritonModelException", "Failed to create metric. Labels must be a dictionary."]
    assert misuse["unsorted"] == failed("Error when creating Metric", "Bucket Boundaries must be strictly sorted")
    assert misuse["label_name"] == failed("Error when creating Metric", "Invalid label name")
    assert misuse["kind_clash"] == failed("Error when creating MetricFamily", "Family name already exists with different type")
    assert misuse["bad_name"] == failed("Error when creating MetricFamily", "Invalid metric name")
    assert misuse["text_value"][0] == misuse["int_kind"][0] == "TypeError"
    assert misuse["dropped"] == [
        "TritonModelException",
        "Failed to get metric value: Invalid metric operation as the corresponding 'MetricFamily' has been "
        "deleted. The 'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have been deleted.",
    ]
    assert misuse["thread"][0] == "TritonModelException"
    assert "initialize, execute or finalize" in misuse["thread"][1]

    samples = metric_samples(metrics.render().decode(), ("model_", "dropped", "elsewhere"))
    model = (("model", "metrics"),)
    assert samples == {
        "model_requests": {(("kind", "a"), *model): 2.5, (): 0.0},
        "model_last": {model: 0.25},
        "model_kept": {(("k", "1"),): 3.0},
        "model_sizes_bucket": {
            (("le", "1.0"), *model): 2.0, (("le", "5.0"), *model): 3.0, (("le", "+Inf"), *model): 4.0,
            (("le", "+Inf"), ("only", "inf")): 1.0,
        },
        "model_sizes_count": {model: 4.0, (("only", "inf"),): 1.0},
        "model_sizes_sum": {model: 12.0, (("only", "inf"),): 0.5},
    }
    await backend.unload()
    # finalize could still use its metrics; then the instance's series left with it.
    assert metric_samples(metrics.render().decode(), ("model_",)) == {}


async def test_a_failed_initialize_leaves_no_metrics(backend_class: ClassOf, tmp_path: Path) -> None:
    metrics = MetricsRegistry()
    backend = backend_class("python")(InstanceContext("fails", 1, metrics=metrics.custom))
    x_to_y_model(tmp_path, "fails", METRICS_MODEL, "TYPE_STRING dims: [ 1 ]")
    with pytest.raises(BackendError, match="initialize gives up"):
        await backend.load(metrics_config("fails"), tmp_path / "fails" / "1", Device("cpu"))
    assert "model_requests" not in metrics.render().decode()
    # The name is free again, for any kind.
    metrics.custom.family("model_requests", "", "gauge")


async def test_a_family_made_per_request_piles_nothing_up(backend_class: ClassOf, tmp_path: Path) -> None:
    source = """
        import numpy as np
        import triton_python_backend_utils as pb_utils


        class TritonPythonModel:
            def execute(self, requests):
                family = pb_utils.MetricFamily("per_request", "", pb_utils.MetricFamily.COUNTER)
                family.Metric(labels={"n": "1"}).increment(1)
                out = np.array([b"x"], dtype=np.object_)
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT1", out)]) for _ in requests]
    """
    metrics = MetricsRegistry()
    backend = backend_class("python")(InstanceContext("per", 1, metrics=metrics.custom))
    await backend.load(modes_config("per"), write_model(tmp_path, "per", source), Device("cpu"))
    for _ in range(50):
        outputs_of((await backend.execute([modes_request("ok")]))[0])
    # Each request's family went with it: nothing exported, nothing kept for the unload.
    assert "per_request" not in metrics.render().decode()
    assert len(backend._metrics.opened) == 0  # type: ignore[attr-defined]
    await backend.unload()


async def test_a_model_packed_with_its_own_python_is_refused(backend_class: ClassOf, tmp_path: Path) -> None:
    """Triton's EXECUTION_ENV_PATH (a conda-pack environment for the model's stub) cannot be
    honoured in-process: the load says so instead of running the model on other packages."""
    source = """
        class TritonPythonModel:
            def execute(self, requests):
                return []
    """
    config = modes_config("packed")
    artifact = write_model(tmp_path, "packed", source)
    backend = await load(backend_class("python"), config, artifact)  # loads without the parameter
    await backend.unload()
    config.parameters = {"EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env.tar.gz"}
    with pytest.raises(ConfigError, match=r"parameters\.EXECUTION_ENV_PATH \(\$\$TRITON_MODEL_DIRECTORY/env\.tar\.gz\) asks "
                       "for a Python environment of its own"):
        await load(backend_class("python"), config, artifact)


MODEL_DIR_MODEL = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.at_init = pb_utils.get_model_dir()

    def execute(self, requests):
        seen = []
        def elsewhere():
            try:
                seen.append(pb_utils.get_model_dir())
            except pb_utils.TritonModelException as exc:
                seen.append(str(exc))
        thread = threading.Thread(target=elsewhere)
        thread.start(); thread.join()
        dirs = np.array([self.at_init, pb_utils.get_model_dir(), seen[0]], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", dirs)]) for _ in requests]

    def finalize(self):
        with open(pb_utils.get_model_dir() + "/finalized", "w") as f:
            f.write("yes")
"""


async def test_get_model_dir_is_the_model_files_directory(backend_class: ClassOf, tmp_path: Path) -> None:
    """Triton's pb_utils.get_model_dir(): `<repository>/<model>/<version>` (side by side in
    tests/compat), in initialize, execute and finalize; not in a thread the model starts."""
    version_dir = write_model(tmp_path, "dirs", MODEL_DIR_MODEL)
    config = ModelConfig(name="dirs", backend="python", input=[TensorConfig("X", "FP32", [1])],
                         output=[TensorConfig("Y", "BYTES", [3])])
    other = write_model(tmp_path, "other", MODEL_DIR_MODEL)
    backend = await load(backend_class("python"), config, version_dir)
    second = await load(backend_class("python"), ModelConfig(name="other", backend="python", input=config.input,
                                                             output=config.output), other)
    try:
        for instance, where in ((backend, version_dir), (second, other)):
            result = (await instance.execute([InferRequest({"X": np.ones(1, np.float32)})]))[0]
            first, during, thread = outputs_of(result)["Y"].tolist()
            assert first == during == str(where).encode()
            assert b"not in a thread the model starts" in thread
    finally:
        await backend.unload()
        await second.unload()
    assert (version_dir / "finalized").read_text() == "yes" and (other / "finalized").exists()
