"""The ONNX Runtime backend against the real onnxruntime, with models built here by tests/model_builders.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from model_builders import build_dtype_zoo_onnx, build_simple_onnx

from daemon.backend import (
    NUMPY_DTYPES,
    Backend,
    Device,
    InferRequest,
    InferResponse,
    InstanceContext,
    TensorBackend,
)
from daemon.errors import BackendError, ConfigError, InvalidArgument
from daemon.model_config import GraphOptimization, ModelConfig, Optimization, TensorConfig
from support import wait_until

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

ClassOf = Callable[[str], type[Backend]]
RNG = np.random.default_rng(3)


def simple_config(max_batch_size: int = 8) -> ModelConfig:
    def tensor(name: str) -> TensorConfig:
        return TensorConfig(name=name, data_type="INT32", dims=[16] if max_batch_size else [1, 16])

    return ModelConfig(
        name="simple",
        max_batch_size=max_batch_size,
        input=[tensor("INPUT0"), tensor("INPUT1")],
        output=[tensor("OUTPUT0"), tensor("OUTPUT1")],
    )


def simple_inputs(rows: int) -> dict[str, np.ndarray]:
    return {
        "INPUT0": RNG.integers(-1000, 1000, (rows, 16), dtype=np.int32),
        "INPUT1": RNG.integers(-1000, 1000, (rows, 16), dtype=np.int32),
    }


def outputs_of(result: object) -> dict[str, np.ndarray]:
    assert isinstance(result, InferResponse), f"expected a response, got {result!r}"
    return result.outputs


@pytest.fixture
def simple_onnx(tmp_path: Path) -> Path:
    path = tmp_path / "simple" / "1" / "model.onnx"
    build_simple_onnx(path)
    return path


@pytest.fixture
async def simple(backend_class: ClassOf, simple_onnx: Path) -> AsyncIterator[TensorBackend]:
    cls = backend_class("onnxruntime")
    backend = cls(InstanceContext("simple", 1))
    assert isinstance(backend, TensorBackend)
    await backend.load(simple_config(), simple_onnx, Device("cpu"))
    yield backend
    await backend.unload()


def test_probe_reports_version_and_cpu(backend_class: ClassOf) -> None:
    import onnxruntime as ort

    probe = backend_class("onnxruntime").probe()
    assert probe.available
    assert "CPU" in probe.devices
    assert probe.runtime_version.startswith(ort.__version__)
    assert "CPUExecutionProvider" in probe.runtime_version


async def test_simple_model_matches_numpy(simple: TensorBackend) -> None:
    inputs = simple_inputs(1)
    [result] = await simple.execute([InferRequest(inputs)])
    out = outputs_of(result)
    assert out["OUTPUT0"].dtype == np.int32
    np.testing.assert_array_equal(out["OUTPUT0"], inputs["INPUT0"] + inputs["INPUT1"])
    np.testing.assert_array_equal(out["OUTPUT1"], inputs["INPUT0"] - inputs["INPUT1"])


async def test_batched_execute_equals_per_request(simple: TensorBackend) -> None:
    requests = [InferRequest(simple_inputs(rows), id=str(rows)) for rows in (1, 3, 2)]
    batched = await simple.execute(requests)
    assert len(batched) == 3
    for request, result in zip(requests, batched, strict=True):
        [alone] = await simple.execute([request])
        out, expected = outputs_of(result), outputs_of(alone)
        assert out["OUTPUT0"].shape == (request.batch_size(), 16)
        for name in ("OUTPUT0", "OUTPUT1"):
            np.testing.assert_array_equal(out[name], expected[name])
        np.testing.assert_array_equal(
            out["OUTPUT1"], request.inputs["INPUT0"] - request.inputs["INPUT1"]
        )


async def test_requested_outputs_are_selected(simple: TensorBackend) -> None:
    inputs = simple_inputs(2)
    only_one, both = await simple.execute(
        [InferRequest(inputs, requested_outputs=("OUTPUT1",)), InferRequest(inputs)]
    )
    assert set(outputs_of(only_one)) == {"OUTPUT1"}
    np.testing.assert_array_equal(
        outputs_of(only_one)["OUTPUT1"], inputs["INPUT0"] - inputs["INPUT1"]
    )
    assert set(outputs_of(both)) == {"OUTPUT0", "OUTPUT1"}


async def test_config_listing_one_output_computes_only_it(
    backend_class: ClassOf, simple_onnx: Path
) -> None:
    config = msgspec.structs.replace(simple_config(), output=simple_config().output[:1])
    backend = backend_class("onnxruntime")(InstanceContext("simple", 1))
    await backend.load(config, simple_onnx, Device())
    inputs = simple_inputs(1)
    [result] = await backend.execute([InferRequest(inputs)])
    await backend.unload()
    assert set(outputs_of(result)) == {"OUTPUT0"}


async def test_wrong_input_dtype_is_invalid_argument(simple: TensorBackend) -> None:
    inputs = {k: v.astype(np.int64) for k, v in simple_inputs(1).items()}
    [result] = await simple.execute([InferRequest(inputs)])
    assert isinstance(result, InvalidArgument)
    assert "INPUT0" in result.message and "INT32" in result.message


async def test_missing_input_is_invalid_argument(simple: TensorBackend) -> None:
    [result] = await simple.execute([InferRequest({"INPUT0": simple_inputs(1)["INPUT0"]})])
    assert isinstance(result, InvalidArgument)
    assert "INPUT1" in result.message


async def test_thread_parameters_reach_the_session(
    backend_class: ClassOf, simple_onnx: Path
) -> None:
    cls = backend_class("onnxruntime")
    backend = cls(InstanceContext("simple", 1, threads=3))
    await backend.load(simple_config(), simple_onnx, Device("cpu"))
    options = backend.session.get_session_options()  # type: ignore[attr-defined]
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (3, 1)
    assert options.enable_mem_pattern
    await backend.unload()

    config = msgspec.structs.replace(
        simple_config(),
        parameters={
            "intra_op_thread_count": "2",
            "inter_op_thread_count": "2",
            "enable_mem_pattern": "false",
        },
    )
    backend = cls(InstanceContext("simple", 1, threads=3))
    await backend.load(config, simple_onnx, Device("cpu"))
    options = backend.session.get_session_options()  # type: ignore[attr-defined]
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (2, 2)
    assert not options.enable_mem_pattern
    await backend.unload()


async def test_bad_thread_parameter_is_config_error(
    backend_class: ClassOf, simple_onnx: Path
) -> None:
    config = msgspec.structs.replace(simple_config(), parameters={"intra_op_thread_count": "many"})
    backend = backend_class("onnxruntime")(InstanceContext("simple", 1))
    with pytest.raises(ConfigError, match="intra_op_thread_count"):
        await backend.load(config, simple_onnx, Device("cpu"))
    # Refused before ONNX Runtime sees it: 100 000 threads crashed the process (SIGSEGV).
    for key in ("intra_op_thread_count", "inter_op_thread_count"):
        config = msgspec.structs.replace(simple_config(), parameters={key: "100000"})
        with pytest.raises(ConfigError, match=f"parameter {key}='100000' must be an integer from 0 to 512"):
            await backend.load(config, simple_onnx, Device("cpu"))


async def test_gpu_without_cuda_provider_fails_to_load(
    backend_class: ClassOf, simple_onnx: Path
) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime build has the CUDA provider")
    backend = backend_class("onnxruntime")(InstanceContext("simple", 1))
    with pytest.raises(BackendError, match="CUDA"):
        await backend.load(simple_config(), simple_onnx, Device("gpu:nvidia", 0))


# --------------------------------------------------------------------------- autocomplete


def test_autocomplete_fills_inputs_outputs_and_batch(
    backend_class: ClassOf, simple_onnx: Path
) -> None:
    config = backend_class("onnxruntime").autocomplete(ModelConfig(name="simple"), simple_onnx)
    assert config.max_batch_size == 8
    assert [(t.name, t.data_type, t.dims) for t in config.input] == [
        ("INPUT0", "INT32", [16]),
        ("INPUT1", "INT32", [16]),
    ]
    assert [(t.name, t.data_type, t.dims) for t in config.output] == [
        ("OUTPUT0", "INT32", [16]),
        ("OUTPUT1", "INT32", [16]),
    ]


def test_autocomplete_of_a_directory_uses_model_onnx(
    backend_class: ClassOf, simple_onnx: Path
) -> None:
    config = backend_class("onnxruntime").autocomplete(
        ModelConfig(name="simple"), simple_onnx.parent
    )
    assert config.max_batch_size == 8
    assert [t.name for t in config.input] == ["INPUT0", "INPUT1"]


def test_autocomplete_keeps_fixed_batch_dims(backend_class: ClassOf, tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    build_simple_onnx(path, max_batch=False)
    config = backend_class("onnxruntime").autocomplete(ModelConfig(name="fixed"), path)
    assert config.max_batch_size == 0
    assert [t.dims for t in config.input + config.output] == [[1, 16]] * 4


def test_autocomplete_keeps_explicit_no_batching_when_inputs_given(
    backend_class: ClassOf, simple_onnx: Path
) -> None:
    given = ModelConfig(
        name="simple",
        input=[
            TensorConfig(name=n, data_type="INT32", dims=[-1, 16]) for n in ("INPUT0", "INPUT1")
        ],
    )
    config = backend_class("onnxruntime").autocomplete(given, simple_onnx)
    assert config.max_batch_size == 0
    assert config.input == given.input
    # Outputs filled with full dims, batch dimension included, since batching is off.
    assert [(t.name, t.dims) for t in config.output] == [
        ("OUTPUT0", [-1, 16]),
        ("OUTPUT1", [-1, 16]),
    ]


@pytest.mark.parametrize(
    ("tensor", "change", "expected"),
    [
        ("INPUT1", {"name": "INPUT9"}, "INPUT9"),
        ("INPUT1", {"data_type": "FP32"}, "INPUT1"),
        ("OUTPUT0", {"data_type": "INT64"}, "OUTPUT0"),
        ("OUTPUT1", {"dims": [8]}, "OUTPUT1"),
    ],
)
def test_mismatching_config_is_config_error_naming_the_tensor(
    backend_class: ClassOf, simple_onnx: Path, tensor: str, change: dict[str, object], expected: str
) -> None:
    config = simple_config()
    kind = "input" if tensor.startswith("INPUT") else "output"
    tensors = [
        msgspec.structs.replace(t, **change) if t.name == tensor else t
        for t in getattr(config, kind)
    ]
    config = msgspec.structs.replace(config, **{kind: tensors})
    with pytest.raises(ConfigError, match=expected):
        backend_class("onnxruntime").autocomplete(config, simple_onnx)


async def test_mismatching_config_fails_at_load_too(
    backend_class: ClassOf, simple_onnx: Path
) -> None:
    config = simple_config()
    config = msgspec.structs.replace(
        config, input=[config.input[0], TensorConfig(name="INPUT1", data_type="FP16", dims=[16])]
    )
    backend = backend_class("onnxruntime")(InstanceContext("simple", 1))
    with pytest.raises(ConfigError, match=r"INPUT1.*FP16"):
        await backend.load(config, simple_onnx, Device("cpu"))


def test_batching_a_fixed_batch_model_is_config_error(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    path = tmp_path / "model.onnx"
    build_simple_onnx(path, max_batch=False)
    config = msgspec.structs.replace(simple_config(), max_batch_size=4)
    with pytest.raises(ConfigError, match=r"INPUT0.*max_batch_size"):
        backend_class("onnxruntime").autocomplete(config, path)


# --------------------------------------------------------------------------- broken files


async def test_corrupt_model_is_backend_error_naming_model_and_file(
    backend_class: ClassOf, tmp_path: Path
) -> None:
    path = tmp_path / "broken" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"this is not a protobuf \x00\xff" * 10)
    cls = backend_class("onnxruntime")
    with pytest.raises(BackendError, match=r"'broken'.*model\.onnx"):
        cls.autocomplete(ModelConfig(name="broken"), path)
    backend = cls(InstanceContext("broken", 1))
    with pytest.raises(BackendError, match=r"'broken'.*model\.onnx"):
        await backend.load(msgspec.structs.replace(simple_config(), name="broken"), path, Device("cpu"))
    await backend.unload()


async def test_missing_model_file_is_backend_error(backend_class: ClassOf, tmp_path: Path) -> None:
    backend = backend_class("onnxruntime")(InstanceContext("gone", 1))
    with pytest.raises(BackendError, match=r"model\.onnx"):
        await backend.load(simple_config(), tmp_path, Device("cpu"))


# --------------------------------------------------------------------------- every datatype


def zoo_value(datatype: str, rows: int, cols: int) -> np.ndarray:
    if datatype == "BYTES":
        words = [f"w{i}-é".encode() for i in range(rows * cols)]
        words[0] = b""  # empty strings survive too
        array = np.empty(rows * cols, dtype=np.object_)
        array[:] = words
        return array.reshape(rows, cols)
    if datatype == "BOOL":
        return RNG.integers(0, 2, (rows, cols)).astype(np.bool_)
    dtype = NUMPY_DTYPES[datatype]
    if dtype.kind == "f":
        return RNG.standard_normal((rows, cols)).astype(dtype)
    info = np.iinfo(dtype)
    # The extremes catch sign or width mistakes in a codec.
    values = RNG.integers(info.min, info.max, (rows, cols), dtype=dtype, endpoint=True)
    values.flat[0], values.flat[-1] = info.min, info.max
    return values


async def test_dtype_zoo_round_trips_every_datatype(backend_class: ClassOf, tmp_path: Path) -> None:
    path = tmp_path / "zoo" / "1" / "model.onnx"
    names = build_dtype_zoo_onnx(path)
    cls = backend_class("onnxruntime")
    config = cls.autocomplete(ModelConfig(name="zoo"), path)
    assert config.max_batch_size == 8
    assert {t.data_type for t in config.input} == set(names)
    backend = cls(InstanceContext("zoo", 1))
    await backend.load(config, path, Device("cpu"))
    requests = [
        InferRequest({i: zoo_value(dt, rows, 3) for dt, (i, _) in names.items()}) for rows in (1, 2)
    ]
    results = await backend.execute(requests)
    await backend.unload()
    for request, result in zip(requests, results, strict=True):
        out = outputs_of(result)
        for datatype, (input_name, output_name) in names.items():
            sent, got = request.inputs[input_name], out[output_name]
            assert got.dtype == sent.dtype, datatype
            assert got.shape == sent.shape, datatype
            if datatype == "BYTES":
                assert got.tolist() == sent.tolist()
                assert all(isinstance(v, bytes) for v in got.flat)
            else:
                np.testing.assert_array_equal(got, sent, err_msg=datatype)


async def test_non_utf8_bytes_are_invalid_argument(backend_class: ClassOf, tmp_path: Path) -> None:
    path = tmp_path / "zoo.onnx"
    names = build_dtype_zoo_onnx(path)
    cls = backend_class("onnxruntime")
    backend = cls(InstanceContext("zoo", 1))
    await backend.load(cls.autocomplete(ModelConfig(name="zoo"), path), path, Device("cpu"))
    inputs = {i: zoo_value(dt, 1, 2) for dt, (i, _) in names.items()}
    inputs["INPUT_BYTES"] = np.array([[b"\xff\xfe", b"ok"]], dtype=np.object_)
    [result] = await backend.execute([InferRequest(inputs)])
    await backend.unload()
    assert isinstance(result, InvalidArgument)
    assert "INPUT_BYTES" in result.message and "UTF-8" in result.message


def test_failed_load_names_the_backend_once(start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    # The daemon prefixes a load failure with the backend that failed (there may be several
    # candidates); the backend's own message must not repeat its name.
    repo = tmp_path / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"this is not a protobuf \x00\xff" * 10)
    (repo / "broken" / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    daemon = start_daemon("--model-repository", str(repo), wait=False)
    reasons: dict[str, str] = {}

    def failed() -> bool:
        index = daemon.post_json("/v2/repository/index", {}).json()
        reasons.update({r["name"]: r.get("reason", "") for r in index if r.get("state") == "UNAVAILABLE"})
        return "broken" in reasons

    wait_until(failed, timeout=60)
    reason = reasons["broken"]
    assert "onnxruntime: cannot load model 'broken'" in reason, reason
    assert reason.count("onnxruntime:") == 1, reason


@pytest.mark.parametrize(("level", "expected"), [
    (None, "ORT_ENABLE_ALL"), (-1, "ORT_ENABLE_BASIC"), (1, "ORT_ENABLE_EXTENDED"), (2, "ORT_DISABLE_ALL"),
    (0, "ORT_ENABLE_ALL"), (7, "ORT_ENABLE_ALL"),
])
async def test_graph_optimization_level_is_tritons(
    backend_class: ClassOf, simple_onnx: Path, level: int | None, expected: str
) -> None:
    """`optimization { graph { level } }` as Triton's ONNX Runtime backend maps it: fusions may
    round differently, so a model that asks for fewer gets fewer."""
    optimization = None if level is None else Optimization(graph=GraphOptimization(level=level))
    config = msgspec.structs.replace(simple_config(), optimization=optimization)
    backend = backend_class("onnxruntime")(InstanceContext("simple", 1))
    await backend.load(config, simple_onnx, Device("cpu"))
    try:
        options = backend.session.get_session_options()  # type: ignore[attr-defined]
        assert options.graph_optimization_level == getattr(ort.GraphOptimizationLevel, expected)
        inputs = simple_inputs(2)
        outputs = outputs_of((await backend.execute([InferRequest(inputs)]))[0])
        np.testing.assert_array_equal(outputs["OUTPUT0"], inputs["INPUT0"] + inputs["INPUT1"])
    finally:
        await backend.unload()
