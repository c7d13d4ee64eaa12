"""The OpenVINO backend against the real OpenVINO runtime, with models built here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from cpu_limits import openvino_threads

from daemon.backend import Backend, Device, InferRequest, InferResponse, InstanceContext
from daemon.errors import BackendError, ConfigError, InvalidArgument
from daemon.model_config import ModelConfig, TensorConfig

ov = pytest.importorskip("openvino")
onnx = pytest.importorskip("onnx")

try:  # OpenVINO 2024+ exposes the opsets at top level; older releases under openvino.runtime
    from openvino import opset13 as ops
except ImportError:  # pragma: no cover - depends on the installed version
    from openvino.runtime import opset13 as ops

RNG = np.random.default_rng(7)
W = RNG.standard_normal((4, 3)).astype(np.float32)
B = RNG.standard_normal(3).astype(np.float32)


def reference(x: np.ndarray) -> dict[str, np.ndarray]:
    """What every model below computes: z = x @ W + B, y = relu(z)."""
    z = x @ W + B
    return {"y": np.maximum(z, 0), "z": z}


def build_ir(directory: Path, batch: int = -1) -> Path:
    """MatMul + Add + ReLU as OpenVINO IR; first dim dynamic when batch == -1."""
    x = ops.parameter([batch, 4], np.float32, name="x")
    x.output(0).get_tensor().set_names({"x"})
    z = ops.add(ops.matmul(x, ops.constant(W), False, False), ops.constant(B))
    z.output(0).get_tensor().set_names({"z"})
    y = ops.relu(z)
    y.output(0).get_tensor().set_names({"y"})
    model = ov.Model([y, z], [x], "mlp")
    path = directory / "model.xml"
    ov.save_model(model, str(path), compress_to_fp16=False)
    return path


def build_onnx(directory: Path) -> Path:
    """The same computation as build_ir, written with onnx.helper."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "B"], ["z"]),
            helper.make_node("Relu", ["z"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 3]),
        ],
        initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = directory / "model.onnx"
    onnx.save(model, str(path))
    return path


def config(max_batch_size: int = 8, **parameters: str) -> ModelConfig:
    return ModelConfig(
        name="mlp",
        backend="openvino",
        max_batch_size=max_batch_size,
        input=[TensorConfig(name="x", data_type="FP32", dims=[4])],
        output=[
            TensorConfig(name="y", data_type="FP32", dims=[3]),
            TensorConfig(name="z", data_type="FP32", dims=[3]),
        ],
        parameters=parameters,
    )


@pytest.fixture
def openvino_class(backend_class: Callable[[str], type[Backend]]) -> type[Backend]:
    return backend_class("openvino")


@pytest.fixture
async def make_backend(openvino_class: type[Backend]) -> Any:
    """Load a backend instance; every instance made is unloaded after the test."""
    made: list[Backend] = []

    async def make(
        artifact: Path,
        cfg: ModelConfig,
        device: Device | None = None,
        *,
        threads: int = 1,
        state_dir: Path | None = None,
    ) -> Any:
        context = InstanceContext(model_name=cfg.name, model_version=1, threads=threads, state_dir=state_dir)
        backend = openvino_class(context)
        made.append(backend)
        await backend.load(cfg, artifact, device or Device("cpu"))
        return backend

    yield make
    for backend in made:
        await backend.unload()


def outputs_of(result: object) -> dict[str, np.ndarray]:
    assert isinstance(result, InferResponse), result
    return result.outputs


def assert_matches(outputs: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(outputs) == sorted(expected)
    for name, value in expected.items():
        assert outputs[name].dtype == value.dtype
        np.testing.assert_allclose(outputs[name], value, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- plugin


def test_probe_lists_devices_and_version(openvino_class: type[Backend]) -> None:
    probe = openvino_class.probe()
    assert probe.available
    assert "CPU" in probe.devices
    assert probe.runtime_version == ov.get_version()


# ---------------------------------------------------------------------------- numbers


async def test_ir_outputs_equal_numpy(tmp_path: Path, make_backend: Any) -> None:
    backend = await make_backend(build_ir(tmp_path), config())
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    [result] = await backend.execute([InferRequest(inputs={"x": x})])
    assert_matches(outputs_of(result), reference(x))


async def test_onnx_gives_the_same_numbers_as_ir(tmp_path: Path, make_backend: Any) -> None:
    (tmp_path / "ir").mkdir()
    (tmp_path / "onnx").mkdir()
    ir = await make_backend(build_ir(tmp_path / "ir"), config())
    from_onnx = await make_backend(build_onnx(tmp_path / "onnx"), config())
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    [a] = await ir.execute([InferRequest(inputs={"x": x})])
    [b] = await from_onnx.execute([InferRequest(inputs={"x": x})])
    assert_matches(outputs_of(b), reference(x))
    assert_matches(outputs_of(b), outputs_of(a))


async def test_version_directory_prefers_ir(tmp_path: Path, make_backend: Any) -> None:
    build_ir(tmp_path)
    build_onnx(tmp_path)
    backend = await make_backend(tmp_path, config())
    assert backend.model_path == tmp_path / "model.xml"
    x = RNG.standard_normal((1, 4)).astype(np.float32)
    [result] = await backend.execute([InferRequest(inputs={"x": x})])
    assert_matches(outputs_of(result), reference(x))


async def test_merged_batch_equals_per_request_results(tmp_path: Path, make_backend: Any) -> None:
    # A static batch-1 IR: load must reshape it to a dynamic first dimension.
    backend = await make_backend(build_ir(tmp_path, batch=1), config(max_batch_size=8))
    xs = [RNG.standard_normal((rows, 4)).astype(np.float32) for rows in (1, 2, 5)]
    merged = await backend.execute([InferRequest(inputs={"x": x}) for x in xs])
    assert len(merged) == 3
    for x, result in zip(xs, merged, strict=True):
        [alone] = await backend.execute([InferRequest(inputs={"x": x})])
        assert outputs_of(result)["y"].shape == (len(x), 3)
        assert_matches(outputs_of(result), outputs_of(alone))
        assert_matches(outputs_of(result), reference(x))


async def test_batch_above_max_batch_size_is_an_error(tmp_path: Path, make_backend: Any) -> None:
    backend = await make_backend(build_ir(tmp_path), config(max_batch_size=4))
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    [result] = await backend.execute([InferRequest(inputs={"x": x})])
    assert isinstance(result, BackendError)


async def test_requested_outputs_only(tmp_path: Path, make_backend: Any) -> None:
    backend = await make_backend(build_ir(tmp_path), config())
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    [result] = await backend.execute([InferRequest(inputs={"x": x}, requested_outputs=("z",))])
    assert_matches(outputs_of(result), {"z": reference(x)["z"]})


async def test_outputs_are_copies_not_reused_buffers(tmp_path: Path, make_backend: Any) -> None:
    backend = await make_backend(build_ir(tmp_path), config())
    first_x = RNG.standard_normal((2, 4)).astype(np.float32)
    [first] = await backend.execute([InferRequest(inputs={"x": first_x})])
    kept = {name: array.copy() for name, array in outputs_of(first).items()}
    await backend.execute([InferRequest(inputs={"x": first_x + 10})])
    assert_matches(outputs_of(first), kept)


async def test_wrong_input_is_invalid_argument(tmp_path: Path, make_backend: Any) -> None:
    backend = await make_backend(build_ir(tmp_path), config())
    x = RNG.standard_normal((1, 4))
    [wrong_dtype] = await backend.execute([InferRequest(inputs={"x": x})])
    [unknown] = await backend.execute([InferRequest(inputs={"q": x.astype(np.float32)})])
    assert isinstance(wrong_dtype, InvalidArgument)
    assert "FP32" in wrong_dtype.message
    assert isinstance(unknown, InvalidArgument)
    assert "'q'" in unknown.message


async def test_missing_input_is_invalid_argument(tmp_path: Path, make_backend: Any) -> None:
    x = ops.parameter([-1, 2], np.float32, name="a")
    y = ops.parameter([-1, 2], np.float32, name="b")
    total = ops.add(x, y)
    total.output(0).get_tensor().set_names({"sum"})
    ov.save_model(ov.Model([total], [x, y], "add"), str(tmp_path / "model.xml"))
    backend = await make_backend(tmp_path / "model.xml", ModelConfig(name="add", max_batch_size=4))
    one = np.ones((1, 2), np.float32)
    [missing] = await backend.execute([InferRequest(inputs={"a": one})])
    assert isinstance(missing, InvalidArgument)
    assert "['b']" in missing.message
    [ok] = await backend.execute([InferRequest(inputs={"a": one, "b": one * 2})])
    np.testing.assert_array_equal(outputs_of(ok)["sum"], one * 3)


async def test_tensors_with_several_names(tmp_path: Path, make_backend: Any) -> None:
    # IRs converted from TensorFlow name tensors twice ("x" and "x:0"): any alias addresses the
    # tensor, and responses use the name the config chose.
    x = ops.parameter([-1, 2], np.float32, name="x")
    x.output(0).get_tensor().set_names({"x", "x:0"})
    y = ops.negative(x)
    y.output(0).get_tensor().set_names({"y", "y:0"})
    ov.save_model(ov.Model([y], [x], "neg"), str(tmp_path / "model.xml"))
    cfg = ModelConfig(
        name="neg",
        max_batch_size=4,
        input=[TensorConfig(name="x:0", data_type="FP32", dims=[2])],
        output=[TensorConfig(name="y:0", data_type="FP32", dims=[2])],
    )
    backend = await make_backend(tmp_path / "model.xml", cfg)
    value = np.array([[1.0, -2.0]], np.float32)
    [by_config_name] = await backend.execute([InferRequest(inputs={"x:0": value})])
    [by_alias] = await backend.execute([InferRequest(inputs={"x": value})])
    assert list(outputs_of(by_config_name)) == ["y:0"]
    np.testing.assert_array_equal(outputs_of(by_config_name)["y:0"], -value)
    np.testing.assert_array_equal(outputs_of(by_alias)["y:0"], -value)


async def test_bytes_tensors(tmp_path: Path, make_backend: Any) -> None:
    # Concat along dim 1 of a [batch, 1] string tensor: each row becomes [s, s].
    text = ops.parameter([-1, 1], ov.Type.string, name="text")
    text.output(0).get_tensor().set_names({"text"})
    twice = ops.concat([text, text], 1)
    twice.output(0).get_tensor().set_names({"twice"})
    ov.save_model(ov.Model([twice], [text], "twice"), str(tmp_path / "model.xml"))
    cfg = ModelConfig(
        name="twice",
        max_batch_size=8,
        input=[TensorConfig(name="text", data_type="BYTES", dims=[1])],
        output=[TensorConfig(name="twice", data_type="BYTES", dims=[2])],
    )
    backend = await make_backend(tmp_path / "model.xml", cfg)
    first = np.array([[b"hello"], ["\u00fcn\u00ef".encode()]], dtype=np.object_)
    second = np.array([[b""], [b"a\x00b"], [b"xyz"]], dtype=np.object_)
    results = await backend.execute([InferRequest(inputs={"text": first}), InferRequest(inputs={"text": second})])
    for values, result in zip((first, second), results, strict=True):
        twice_out = outputs_of(result)["twice"]
        assert twice_out.dtype == np.object_
        assert twice_out.tolist() == np.concatenate([values, values], axis=1).tolist()
        assert all(type(v) is bytes for v in twice_out.reshape(-1))


async def test_bf16_travels_as_uint16_bits(tmp_path: Path, make_backend: Any) -> None:
    half = ops.parameter([-1, 2], ov.Type.bf16, name="h")
    half.output(0).get_tensor().set_names({"h"})
    as_f32 = ops.convert(half, ov.Type.f32)
    as_f32.output(0).get_tensor().set_names({"f"})
    doubled = ops.convert(ops.multiply(as_f32, ops.constant(np.float32(2))), ov.Type.bf16)
    doubled.output(0).get_tensor().set_names({"d"})
    ov.save_model(ov.Model([as_f32, doubled], [half], "bf16"), str(tmp_path / "model.xml"))
    cfg = ModelConfig(name="bf16", max_batch_size=4)
    backend = await make_backend(tmp_path / "model.xml", cfg)
    values = np.array([[1.5, -2.25], [3.0, 100.0]], np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # exact: these values fit bf16
    [result] = await backend.execute([InferRequest(inputs={"h": bits})])
    out = outputs_of(result)
    np.testing.assert_array_equal(out["f"], values)
    assert out["d"].dtype == np.uint16
    np.testing.assert_array_equal((out["d"].astype(np.uint32) << 16).view(np.float32), values * 2)


# ---------------------------------------------------------------------------- autocomplete


def test_autocomplete_dynamic_batch_model(tmp_path: Path, openvino_class: type[Backend]) -> None:
    filled = openvino_class.autocomplete(ModelConfig(name="mlp"), build_ir(tmp_path))
    assert filled.max_batch_size == 8
    assert filled.input == [TensorConfig(name="x", data_type="FP32", dims=[4])]
    assert filled.output == [
        TensorConfig(name="y", data_type="FP32", dims=[3]),
        TensorConfig(name="z", data_type="FP32", dims=[3]),
    ]


def test_autocomplete_static_model_and_onnx(tmp_path: Path, openvino_class: type[Backend]) -> None:
    (tmp_path / "ir").mkdir()
    (tmp_path / "onnx").mkdir()
    static = openvino_class.autocomplete(ModelConfig(name="mlp"), build_ir(tmp_path / "ir", batch=2))
    assert static.max_batch_size == 0
    assert static.input == [TensorConfig(name="x", data_type="FP32", dims=[2, 4])]
    assert [t.dims for t in static.output] == [[2, 3], [2, 3]]
    from_onnx = openvino_class.autocomplete(ModelConfig(name="mlp"), build_onnx(tmp_path / "onnx"))
    assert from_onnx.max_batch_size == 8
    assert [(t.name, t.dims) for t in from_onnx.output] == [("y", [3]), ("z", [3])]


def test_autocomplete_keeps_what_config_gives(tmp_path: Path, openvino_class: type[Backend]) -> None:
    given = ModelConfig(name="mlp", max_batch_size=0, input=[TensorConfig(name="x", data_type="FP32", dims=[-1, 4])])
    filled = openvino_class.autocomplete(given, build_ir(tmp_path))
    assert filled.max_batch_size == 0
    assert filled.input == given.input
    assert [t.dims for t in filled.output] == [[-1, 3], [-1, 3]]


# ---------------------------------------------------------------------------- properties


@pytest.mark.parametrize("threads", [1, 2])
async def test_threads_and_streams_properties(tmp_path: Path, make_backend: Any, threads: int) -> None:
    backend = await make_backend(build_ir(tmp_path), config(), Device("cpu"), threads=threads)
    compiled = backend.compiled_model
    assert int(compiled.get_property("INFERENCE_NUM_THREADS")) == openvino_threads(threads)
    assert int(compiled.get_property("NUM_STREAMS")) == 1
    assert str(compiled.get_property("PERFORMANCE_HINT")) == "LATENCY"
    assert list(compiled.get_property("EXECUTION_DEVICES")) == ["CPU"]


async def test_config_parameters_reach_the_runtime(tmp_path: Path, make_backend: Any) -> None:
    cfg = config(performance_hint="throughput", num_streams="2")
    backend = await make_backend(build_ir(tmp_path), cfg, "", threads=2)
    compiled = backend.compiled_model
    assert str(compiled.get_property("PERFORMANCE_HINT")) == "THROUGHPUT"
    # Streams can't outnumber the threads OpenVINO allows on this machine.
    assert int(compiled.get_property("NUM_STREAMS")) == openvino_threads(2)


async def test_default_device_without_argument(tmp_path: Path, make_backend: Any) -> None:
    backend = await make_backend(build_ir(tmp_path), config(), Device())
    expected = "AUTO" if len(ov.Core().available_devices) > 1 else "CPU"
    assert backend.device == expected
    x = RNG.standard_normal((1, 4)).astype(np.float32)
    [result] = await backend.execute([InferRequest(inputs={"x": x})])
    assert_matches(outputs_of(result), reference(x))


async def test_device_from_config_parameter(tmp_path: Path, make_backend: Any) -> None:
    with pytest.raises(BackendError, match="NOPE"):
        await make_backend(build_ir(tmp_path), config(device="nope"), Device())
    backend = await make_backend(build_ir(tmp_path), config(device="auto"), Device())
    assert backend.device == "AUTO"
    assert list(backend.compiled_model.get_property("EXECUTION_DEVICES")) == ["CPU"]
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    [result] = await backend.execute([InferRequest(inputs={"x": x})])
    assert_matches(outputs_of(result), reference(x))


async def test_cache_dir_populated_when_state_dir_given(tmp_path: Path, make_backend: Any) -> None:
    state = tmp_path / "state"
    first = await make_backend(build_ir(tmp_path), config(), state_dir=state)
    assert first.compiled_model.get_property("LOADED_FROM_CACHE") is False
    cache = state / "ov_cache"
    assert cache.is_dir()
    assert any(path.is_file() and path.stat().st_size > 0 for path in cache.iterdir())
    # The next instance (or a reload) of the same model imports the compiled blob.
    second = await make_backend(tmp_path / "model.xml", config(), state_dir=state)
    assert second.compiled_model.get_property("LOADED_FROM_CACHE") is True


# ---------------------------------------------------------------------------- load errors


async def test_bad_device_names_the_device(tmp_path: Path, make_backend: Any) -> None:
    with pytest.raises(BackendError) as caught:
        await make_backend(build_ir(tmp_path), config(device="TPU.7"), Device())
    assert "TPU.7" in caught.value.message
    assert "mlp" in caught.value.message


async def test_corrupt_xml_is_a_backend_error(tmp_path: Path, make_backend: Any) -> None:
    path = build_ir(tmp_path)
    path.write_text(path.read_text()[:200])
    with pytest.raises(BackendError) as caught:
        await make_backend(path, config())
    assert str(path) in caught.value.message


async def test_missing_weights_is_a_backend_error(tmp_path: Path, make_backend: Any) -> None:
    path = build_ir(tmp_path)
    path.with_suffix(".bin").unlink()
    with pytest.raises(BackendError, match=r"model\.bin"):
        await make_backend(path, config())


async def test_config_naming_an_unknown_tensor_fails_at_load(tmp_path: Path, make_backend: Any) -> None:
    cfg = msgspec.structs.replace(config(), input=[TensorConfig(name="pixels", data_type="FP32", dims=[4])])
    with pytest.raises(ConfigError, match="pixels"):
        await make_backend(build_ir(tmp_path), cfg)


async def test_bad_performance_hint_is_a_config_error(tmp_path: Path, make_backend: Any) -> None:
    with pytest.raises(ConfigError, match="performance_hint"):
        await make_backend(build_ir(tmp_path), config(performance_hint="FASTEST"))
    with pytest.raises(ConfigError, match="parameter num_streams='1099511627776' must be an integer from 1 to 512"):
        await make_backend(build_ir(tmp_path), config(num_streams=str(2**40)))


# ---------------------------------------------------------------------------- precision
# OpenVINO's CPU plugin computes in bf16 by default on CPUs with AMX / avx512_bf16: these tests
# read the compiled model's own property, so they prove the default on whatever CPU runs them.


def cpu_capabilities() -> list[str]:
    return [str(c) for c in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]


def compiled_precision(backend: Any) -> str:
    return str(backend.compiled_model.get_property("INFERENCE_PRECISION_HINT").get_type_name())


CAPABILITY = {"bf16": "BF16", "f16": "FP16"}


@pytest.mark.parametrize("device", [Device("cpu"), Device()], ids=str)
async def test_default_precision_is_f32_on_every_cpu(tmp_path: Path, make_backend: Any, device: Device) -> None:
    backend = await make_backend(build_ir(tmp_path), config(), device)
    if backend.device == "CPU":
        assert compiled_precision(backend) == "f32"
    assert backend.describe()["inference_precision"] == "f32"
    assert backend.describe()["execution_devices"] == "CPU"
    x = np.random.default_rng(11).standard_normal((8, 4)).astype(np.float32)
    [result] = await backend.execute([InferRequest(inputs={"x": x})])
    assert_matches(outputs_of(result), reference(x))


async def test_default_precision_survives_the_compiled_blob_cache(tmp_path: Path, make_backend: Any) -> None:
    # A blob compiled with one precision must not be imported for a model asking another one.
    state = tmp_path / "state"
    path = build_ir(tmp_path)
    first = await make_backend(path, config(), state_dir=state)
    assert compiled_precision(first) == "f32"
    if "BF16" not in cpu_capabilities():
        return
    bf16 = await make_backend(path, config(inference_precision="bf16"), state_dir=state)
    assert compiled_precision(bf16) == "bf16"
    again = await make_backend(path, config(), state_dir=state)
    assert again.compiled_model.get_property("LOADED_FROM_CACHE") is True
    assert compiled_precision(again) == "f32"


@pytest.mark.parametrize("device", ["CPU", "AUTO"])
@pytest.mark.parametrize("precision", ["bf16", "f16"])
async def test_lower_precision_is_an_opt_in(
    tmp_path: Path, make_backend: Any, device: str, precision: str
) -> None:
    # Case does not matter. AUTO: OpenVINO's AUTO device, which does not expose the compiled
    # precision itself, so only the backend's check after compiling can catch a fallback.
    cfg = config(inference_precision=precision.upper(), device=device)
    if CAPABILITY[precision] not in cpu_capabilities():
        # Documented: a precision the CPU cannot compute in is a load error naming the
        # parameter (OpenVINO itself would silently compile something else).
        with pytest.raises(ConfigError, match=rf"inference_precision='{precision}'"):
            await make_backend(build_ir(tmp_path), cfg, Device())
        return
    backend = await make_backend(build_ir(tmp_path), cfg, Device())
    assert backend.describe()["inference_precision"] == precision
    if device == "CPU":
        assert compiled_precision(backend) == precision
    x = np.random.default_rng(11).standard_normal((8, 4)).astype(np.float32)
    [result] = await backend.execute([InferRequest(inputs={"x": x})])
    got, expected = outputs_of(result)["z"], reference(x)["z"]
    # The runtime really computes in the lower precision: not f32's numbers, but close to them.
    assert np.abs(got - expected).max() > 1e-4
    np.testing.assert_allclose(got, expected, rtol=5e-2, atol=5e-2)


async def test_explicit_f32_and_bad_precision(tmp_path: Path, make_backend: Any) -> None:
    backend = await make_backend(build_ir(tmp_path), config(inference_precision="f32"))
    assert compiled_precision(backend) == "f32"
    with pytest.raises(ConfigError, match=r"inference_precision='fp8'.*\['f32', 'bf16', 'f16'\]"):
        await make_backend(build_ir(tmp_path), config(inference_precision="fp8"))


@pytest.mark.parametrize("source", ["config.pbtxt", "model.toml"])
async def test_precision_and_hints_from_both_config_files(
    tmp_path: Path, make_backend: Any, source: str
) -> None:
    from daemon.core.layout import parse_model_toml
    from daemon.core.triton_config import parse_pbtxt

    precision = "bf16" if "BF16" in cpu_capabilities() else "f32"
    settings = {"inference_precision": precision, "performance_hint": "THROUGHPUT", "num_streams": "2"}
    if source == "model.toml":
        text = 'name = "mlp"\nmax_batch_size = 8\n[parameters]\n' + "".join(
            f'{key} = "{value}"\n' for key, value in settings.items()
        )
        parsed = parse_model_toml(text, source=source)
    else:
        text = 'name: "mlp"\nmax_batch_size: 8\n' + "".join(
            f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
            for key, value in settings.items()
        )
        parsed, _ = parse_pbtxt(text, source=source)
    cfg = msgspec.structs.replace(config(), parameters=parsed.parameters)
    backend = await make_backend(build_ir(tmp_path), cfg, Device("cpu"), threads=2)
    compiled = backend.compiled_model
    assert compiled_precision(backend) == precision
    assert str(compiled.get_property("PERFORMANCE_HINT")) == "THROUGHPUT"
    assert int(compiled.get_property("NUM_STREAMS")) == openvino_threads(2)
    assert backend.describe() == {
        "device": "CPU",
        "execution_devices": "CPU",
        "inference_precision": precision,
        "performance_hint": "THROUGHPUT",
    }


def onnx_reference_cases() -> list[Path]:
    """Real layers from onnx's own backend test data (PyTorch exports with reference outputs):
    1-3D, grouped, depthwise, dilated, strided and transposed convolutions, Linear, GEMMs."""
    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    converted = root / "pytorch-converted"
    cases = sorted(converted.glob("test_Conv*")) + sorted(converted.glob("test_Linear*"))
    operators = ("test_operator_conv", "test_operator_convtranspose", "test_operator_addmm", "test_operator_mm")
    cases += [root / "pytorch-operator" / name for name in operators]
    return [case for case in cases if (case / "model.onnx").is_file()]


@pytest.mark.parametrize("case", onnx_reference_cases(), ids=lambda case: case.name)
async def test_onnx_reference_outputs_on_any_cpu(
    case: Path, make_backend: Any, openvino_class: type[Backend]
) -> None:
    # With bf16 (OpenVINO's own default on AMX / avx512_bf16 CPUs) all but three of these miss
    # the reference by 1e-3 to 6e-3; with the default f32 every one matches at onnx's own
    # backend-test tolerances.
    from onnx import numpy_helper

    model = onnx.load(str(case / "model.onnx"))
    initializers = {tensor.name for tensor in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    data = case / "test_data_set_0"

    def tensors(kind: str) -> list[np.ndarray]:
        files = sorted(data.glob(f"{kind}_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
        return [numpy_helper.to_array(onnx.load_tensor(str(path))) for path in files]

    cfg = openvino_class.autocomplete(ModelConfig(name=case.name), case / "model.onnx")
    backend = await make_backend(case / "model.onnx", cfg, Device("cpu"))
    assert backend.describe()["inference_precision"] == "f32"
    [result] = await backend.execute([InferRequest(inputs=dict(zip(names, tensors("input"), strict=True)))])
    outputs = outputs_of(result)
    expected = tensors("output")
    assert len(outputs) == len(expected)
    for output, value in zip(model.graph.output, expected, strict=True):
        np.testing.assert_allclose(outputs[output.name], value, rtol=1e-3, atol=1e-7, err_msg=output.name)


def test_served_model_reports_its_compiled_precision(start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    # The case: an ONNX model without any config is auto-assigned to OpenVINO on a CPU
    # box, and must compute (and say it computes) in f32; a model.toml opts into bf16.
    import json

    repo = tmp_path / "repo"
    (repo / "plain" / "1").mkdir(parents=True)
    build_onnx(repo / "plain" / "1")
    lower = "bf16" if "BF16" in cpu_capabilities() else "f32"
    (repo / "lower" / "1").mkdir(parents=True)
    build_onnx(repo / "lower" / "1")
    (repo / "lower" / "model.toml").write_text(f'backend = "openvino"\n[parameters]\ninference_precision = "{lower}"\n')
    daemon = start_daemon("--model-repository", str(repo))

    plain = daemon.request("GET", "/v2/models/plain").json()
    assert plain["backend"] == "openvino", plain["selection"]
    assert plain["effective"]["inference_precision"] == "f32"
    assert daemon.request("GET", "/v2/models/lower").json()["effective"]["inference_precision"] == lower

    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    body = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": x.ravel().tolist()}]}
    reply = daemon.request("POST", "/v2/models/plain/infer", json.dumps(body), {"Content-Type": "application/json"})
    assert reply.status == 200, reply.body
    outputs = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in reply.json()["outputs"]}
    assert_matches(outputs, reference(x))
