"""The TensorRT backend plugin.

Its CPU-side logic (datatypes, engine description checks, profile shapes, the compatibility
refusal, the engine build script's pure parts, the probe without TensorRT) runs everywhere.
The end-to-end tests build a real engine from an ONNX model and need TensorRT, cuda-python
and an NVIDIA GPU; they skip with the reason elsewhere.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import types
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from daemon.backend import (
    NUMPY_DTYPES,
    Backend,
    Device,
    InferRequest,
    InferResponse,
    InstanceContext,
)
from daemon.core.plugins import PluginRegistry, _ensure_package
from daemon.errors import BackendError, ConfigError, InvalidArgument, PluginError, Unsupported
from daemon.model_config import InstanceGroup, ModelConfig, TensorConfig

PLUGIN_DIR = Path(__file__).resolve().parents[2] / "backends" / "tensorrt"
HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def plugin_module(name: str) -> types.ModuleType:
    """A module of the plugin, imported under its private package the way the daemon does,
    without the registry's `requires` check (which refuses to import it without tensorrt)."""
    package = _ensure_package("tensorrt", PLUGIN_DIR)
    return importlib.import_module(f"{package.__name__}.{name}")


@pytest.fixture(scope="module")
def engine_io() -> types.ModuleType:
    return plugin_module("engine_io")


@pytest.fixture(scope="module")
def sidecar() -> types.ModuleType:
    return plugin_module("sidecar")


@pytest.fixture(scope="module")
def build_engine() -> types.ModuleType:
    return plugin_module("build_engine")


def io(engine_io: types.ModuleType, name: str, is_input: bool, shape: tuple[int, ...],
       profile: tuple[tuple[int, ...], ...] | None = None, datatype: str = "FP32") -> object:
    return engine_io.IoTensor(name, is_input, datatype, shape, profile)


@pytest.fixture
def dynamic_engine(engine_io: types.ModuleType) -> list[object]:
    """What describe_engine reports for x[-1,4] -> y[-1,3], z[-1,3] with batch 1..8."""
    return [
        io(engine_io, "x", True, (-1, 4), ((1, 4), (4, 4), (8, 4))),
        io(engine_io, "y", False, (-1, 3)),
        io(engine_io, "z", False, (-1, 3)),
    ]


# --------------------------------------------------------------------------- manifest and probe


def test_manifest_is_discovered(plugin_registry: PluginRegistry) -> None:
    manifest = plugin_registry.manifest("tensorrt")
    assert manifest.entrypoint == "backend:TensorRtBackend"
    assert manifest.artifacts == ["model.plan"]
    assert manifest.platforms == ["tensorrt_plan"]
    assert "tensorrt" in manifest.requires


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed here")
def test_registry_refuses_without_tensorrt(plugin_registry: PluginRegistry) -> None:
    with pytest.raises(PluginError, match="required Python module 'tensorrt' is not installed"):
        plugin_registry.resolve("tensorrt")


def test_probe_reports_why_it_cannot_run() -> None:
    backend = plugin_module("backend").TensorRtBackend
    assert issubclass(backend, Backend) and backend.name == "tensorrt"
    probe = backend.probe()
    if probe.available:
        pytest.skip(f"TensorRT {probe.runtime_version} runs here on {probe.devices}")
    if not HAS_TENSORRT:
        assert probe.reason.startswith("the TensorRT Python package is not installed")
    else:
        assert probe.reason  # TensorRT present, CUDA missing: the reason says which


# --------------------------------------------------------------------------- datatypes


def test_dtype_maps_agree_in_size(engine_io: types.ModuleType) -> None:
    for trt_name, kserve in engine_io.TRT_TO_KSERVE.items():
        assert engine_io.numpy_dtype(kserve).itemsize == engine_io.TRT_ITEMSIZE[trt_name], trt_name
        assert engine_io.KSERVE_TO_TRT[kserve] == trt_name
        assert kserve in NUMPY_DTYPES
    assert engine_io.numpy_dtype("FP16") == np.float16
    assert engine_io.numpy_dtype("BF16") == np.uint16  # bit patterns
    assert engine_io.kserve_datatype("HALF", "x") == "FP16"


@pytest.mark.parametrize("trt_name", ["FP8", "INT4", "FP4", "E8M0"])
def test_in_engine_only_types_are_refused(engine_io: types.ModuleType, trt_name: str) -> None:
    with pytest.raises(Unsupported, match=f"engine tensor 'logits' has type {trt_name}"):
        engine_io.kserve_datatype(trt_name, "logits")


# --------------------------------------------------------------------------- config from the engine


def test_autocomplete_from_dynamic_batch_engine(engine_io: types.ModuleType, dynamic_engine: list[object]) -> None:
    assert engine_io.engine_max_batch(dynamic_engine) == 8
    config = engine_io.complete_config(ModelConfig(name="m"), dynamic_engine)
    assert config.max_batch_size == 8
    assert config.input == [TensorConfig(name="x", data_type="FP32", dims=[4])]
    assert [(t.name, t.dims) for t in config.output] == [("y", [3]), ("z", [3])]
    engine_io.check_config(config, dynamic_engine, "m")


def test_autocomplete_keeps_what_the_config_says(engine_io: types.ModuleType, dynamic_engine: list[object]) -> None:
    given = ModelConfig(name="m", max_batch_size=2)
    config = engine_io.complete_config(given, dynamic_engine)
    assert config.max_batch_size == 2
    assert config.input[0].dims == [4]


def test_autocomplete_static_engine_has_no_batch(engine_io: types.ModuleType) -> None:
    tensors = [io(engine_io, "x", True, (2, 4)), io(engine_io, "y", False, (2, 3), datatype="FP16")]
    assert engine_io.engine_max_batch(tensors) == 0
    config = engine_io.complete_config(ModelConfig(name="m"), tensors)
    assert config.max_batch_size == 0
    assert config.input[0].dims == [2, 4]
    assert config.output[0].data_type == "FP16"


def test_profile_max_is_the_smallest_across_inputs(engine_io: types.ModuleType) -> None:
    tensors = [
        io(engine_io, "a", True, (-1, 4), ((1, 4), (2, 4), (16, 4))),
        io(engine_io, "b", True, (-1, 2), ((1, 2), (2, 2), (6, 2))),
        io(engine_io, "y", False, (-1, 3)),
    ]
    assert engine_io.engine_max_batch(tensors) == 6


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ModelConfig(name="m", max_batch_size=16), "max_batch_size 16 exceeds the engine's optimization profile maximum 8"),
        (ModelConfig(name="m", max_batch_size=8, input=[TensorConfig(name="x", data_type="FP16", dims=[4])]),
         "input 'x' is FP16 in the config but FP32 in the engine"),
        (ModelConfig(name="m", max_batch_size=8, input=[TensorConfig(name="x", data_type="FP32", dims=[5])]),
         r"config dims \[5\] differ from the engine's \[4\]"),
        (ModelConfig(name="m", max_batch_size=8, input=[TensorConfig(name="x", data_type="FP32", dims=[1, 4])]),
         r"rank 2, the engine's \[4\] rank 1 \(without the batch dimension\)"),
        (ModelConfig(name="m", max_batch_size=8, output=[TensorConfig(name="x", data_type="FP32", dims=[4])]),
         r"the engine has no output 'x' \(outputs: \['y', 'z'\]\)"),
        (ModelConfig(name="m", max_batch_size=0, input=[TensorConfig(name="x", data_type="FP32", dims=[-1, 4])],
                     output=[TensorConfig(name="w", data_type="FP32", dims=[-1, 3])]),
         r"the engine has no output 'w'"),
    ],
)
def test_config_that_disagrees_with_the_engine_is_refused(
    engine_io: types.ModuleType, dynamic_engine: list[object], config: ModelConfig, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_io.check_config(config, dynamic_engine, "m")


def test_batching_an_engine_without_batch_dimension_is_refused(engine_io: types.ModuleType) -> None:
    tensors = [io(engine_io, "x", True, (2, 4)), io(engine_io, "y", False, (2, 3))]
    with pytest.raises(ConfigError, match="the engine has no dynamic batch dimension"):
        engine_io.check_config(ModelConfig(name="m", max_batch_size=4), tensors, "m")


def test_config_missing_an_engine_input_is_refused(engine_io: types.ModuleType) -> None:
    tensors = [io(engine_io, "a", True, (4,)), io(engine_io, "b", True, (4,)), io(engine_io, "y", False, (4,))]
    config = ModelConfig(name="m", input=[TensorConfig(name="a", data_type="FP32", dims=[4])])
    with pytest.raises(ConfigError, match=r"needs inputs \['b'\]"):
        engine_io.check_config(config, tensors, "m")


# --------------------------------------------------------------------------- request shapes


def test_request_shapes_against_the_profile(engine_io: types.ModuleType, dynamic_engine: list[object]) -> None:
    x = dynamic_engine[0]
    assert engine_io.shape_problem(x, (1, 4)) == ""
    assert engine_io.shape_problem(x, (8, 4)) == ""
    assert engine_io.shape_problem(x, (9, 4)) == "input 'x' dim 0 is 9, outside the engine's optimization profile range [1, 8]"
    assert engine_io.shape_problem(x, (0, 4)).endswith("range [1, 8]")
    assert engine_io.shape_problem(x, (2, 5)) == "input 'x' has shape [2, 5], the engine expects [-1, 4]"
    assert engine_io.shape_problem(x, (2,)) == "input 'x' has shape [2], the engine expects rank 2 [-1, 4]"


def test_check_input_refuses_wrong_dtype(engine_io: types.ModuleType, dynamic_engine: list[object]) -> None:
    x = dynamic_engine[0]
    engine_io.check_input(x, np.zeros((2, 4), np.float32))
    with pytest.raises(InvalidArgument, match="input 'x' is float64, the engine expects FP32"):
        engine_io.check_input(x, np.zeros((2, 4), np.float64))
    with pytest.raises(InvalidArgument, match="outside the engine's optimization profile"):
        engine_io.check_input(x, np.zeros((10, 4), np.float32))


def test_device_index(engine_io: types.ModuleType) -> None:
    plain = ModelConfig(name="m")
    assert engine_io.device_index(Device("gpu:nvidia", 1), plain, 0) == 1
    assert engine_io.device_index(Device(), plain, 3) == 0
    spread = ModelConfig(name="m", instance_group=[InstanceGroup(count=2, kind="KIND_GPU", gpus=[2, 3])])
    assert [engine_io.device_index(Device(), spread, i) for i in range(3)] == [2, 3, 2]
    with pytest.raises(Unsupported, match="tensorrt runs on NVIDIA GPUs only; device cpu"):
        engine_io.device_index(Device("cpu"), plain, 0)


# --------------------------------------------------------------------------- engine compatibility


def test_engine_for_another_gpu_is_refused_before_deserializing(engine_io: types.ModuleType, tmp_path: Path) -> None:
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"not an engine: never read when the sidecar already says no")
    (tmp_path / "model.plan.json").write_text(json.dumps(
        {"compute_capability": "8.0", "tensorrt_version": "10.3.0", "gpu_name": "NVIDIA A100-SXM4-80GB"}
    ))
    error = engine_io.compatibility_error("resnet", plan, "GPU 0 NVIDIA H100 80GB HBM3", "9.0", "10.3.0")
    assert isinstance(error, BackendError)
    assert error.message == (
        f"tensorrt: model 'resnet': {plan} cannot run here: engine built for sm_80 (NVIDIA A100-SXM4-80GB), "
        "but the GPU is sm_90 (GPU 0 NVIDIA H100 80GB HBM3). Rebuild it on this machine "
        "(backends/tensorrt/build_engine.py) or let another artifact's backend serve it"
    )
    version = engine_io.compatibility_error("resnet", plan, "GPU 0 NVIDIA A100", "8.0", "10.7.0")
    assert version is not None and "engine built with TensorRT 10.3.0, but TensorRT 10.7.0 is installed" in version.message
    assert engine_io.compatibility_error("resnet", plan, "GPU 0 NVIDIA A100", "8.0", "10.3.0") is None


def test_engine_without_sidecar_is_left_to_tensorrt(engine_io: types.ModuleType, tmp_path: Path) -> None:
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"x")
    assert engine_io.compatibility_error("m", plan, "GPU 0 H100", "9.0", "10.3.0") is None
    (tmp_path / "model.plan.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model\.plan\.json"):
        engine_io.compatibility_error("m", plan, "GPU 0 H100", "9.0", "10.3.0")


# --------------------------------------------------------------------------- build_engine.py


def test_build_engine_profiles(build_engine: types.ModuleType) -> None:
    assert build_engine.profile_for("x", (2, 4), 8, 0, {}) is None
    assert build_engine.profile_for("x", (-1, 3, 224, 224), 8, 4, {}) == (
        (1, 3, 224, 224), (4, 3, 224, 224), (8, 3, 224, 224))
    assert build_engine.profile_for("x", (-1, 4), 8, 0, {}) == ((1, 4), (8, 4), (8, 4))
    with pytest.raises(ValueError, match="give them with --shape ids:MIN,OPT,MAX"):
        build_engine.profile_for("ids", (-1, -1), 8, 0, {})
    name, bounds = build_engine.parse_shape_option("ids:1x1,4x128,8x512")
    assert (name, bounds) == ("ids", ((1, 1), (4, 128), (8, 512)))
    assert build_engine.profile_for("ids", (-1, -1), 8, 0, {name: bounds}) == bounds
    with pytest.raises(ValueError, match="MIN <= OPT <= MAX"):
        build_engine.parse_shape_option("ids:4x1,1x1,8x1")
    with pytest.raises(ValueError, match="expected NAME:MIN,OPT,MAX"):
        build_engine.parse_shape_option("1x1,4x128,8x512")


def test_build_engine_sidecar_is_what_selection_reads(
    build_engine: types.ModuleType, sidecar: types.ModuleType
) -> None:
    content = build_engine.sidecar("9.0", "10.3.0.26", "NVIDIA H100 80GB HBM3", version_compatible=True)
    decoded = msgspec.json.decode(json.dumps(content), type=sidecar.EngineSidecar)
    assert decoded.version_compatible and not decoded.hardware_compatible
    assert sidecar.engine_mismatch(decoded, "9.0", "NVIDIA H100 80GB HBM3", "10.3.0.26") == ""


# --------------------------------------------------------------------------- on a GPU


def build_onnx(path: Path, w: np.ndarray, b: np.ndarray) -> None:
    """y = relu(x @ w + b), z = x @ w + b, with a dynamic batch dimension."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["z"]),
            helper.make_node("Relu", ["z"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))


@pytest.fixture
def gpu_plan(tmp_path: Path, backend_class: Callable[[str], type[Backend]],
             build_engine: types.ModuleType) -> tuple[type[Backend], Path, np.ndarray, np.ndarray]:
    """A real engine built here; skips (via backend_class) without TensorRT and a GPU."""
    cls = backend_class("tensorrt")
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    build_onnx(tmp_path / "model.onnx", w, b)
    plan = build_engine.build(tmp_path / "model.onnx", tmp_path / "1", max_batch=8, opt_batch=4, workspace_mib=256)
    return cls, plan, w, b


async def test_engine_runs_on_the_gpu(gpu_plan: tuple[type[Backend], Path, np.ndarray, np.ndarray]) -> None:
    cls, plan, w, b = gpu_plan
    config = cls.autocomplete(ModelConfig(name="mlp"), plan)
    assert config.max_batch_size == 8
    assert [t.name for t in config.input] == ["x"]
    backend = cls(InstanceContext("mlp", 1))
    await backend.load(config, plan, Device("gpu:nvidia", 0))
    try:
        x1 = np.arange(8, dtype=np.float32).reshape(2, 4) / 7
        x2 = -np.ones((3, 4), np.float32)
        results = await backend.execute([InferRequest({"x": x1}), InferRequest({"x": x2}, requested_outputs=("y",))])
        for result, x in zip(results, (x1, x2), strict=True):
            assert isinstance(result, InferResponse)
            z = x @ w + b
            np.testing.assert_allclose(result.outputs["y"], np.maximum(z, 0), rtol=1e-3, atol=1e-3)
        first = results[0]
        assert isinstance(first, InferResponse) and set(first.outputs) == {"y", "z"}
        assert isinstance(results[1], InferResponse) and set(results[1].outputs) == {"y"}
        too_big = await backend.execute([InferRequest({"x": np.zeros((9, 4), np.float32)})])
        assert isinstance(too_big[0], InvalidArgument)
    finally:
        await backend.unload()


async def test_mismatched_sidecar_refuses_on_the_gpu(
    gpu_plan: tuple[type[Backend], Path, np.ndarray, np.ndarray],
) -> None:
    cls, plan, _, _ = gpu_plan
    sidecar_path = plan.with_name("model.plan.json")
    content = json.loads(sidecar_path.read_text())
    content["compute_capability"] = "7.0" if content["compute_capability"] != "7.0" else "8.0"
    sidecar_path.write_text(json.dumps(content))
    backend = cls(InstanceContext("mlp", 1))
    with pytest.raises(BackendError, match="cannot run here: engine built for sm_"):
        await backend.load(ModelConfig(name="mlp", max_batch_size=8), plan, Device("gpu:nvidia", 0))
    await backend.unload()


# --------------------------------------------------------------------------- engine sidecars


def _sm(cc: str, trt: str = "10.3.0", **extra: object) -> dict[str, object]:
    return {"compute_capability": cc, "tensorrt_version": trt, **extra}


def test_sidecar_reads_and_normalizes(tmp_path: Path, sidecar: types.ModuleType) -> None:
    plan = tmp_path / "model.plan"
    assert sidecar.read_engine_sidecar(plan) is None
    (tmp_path / "model.plan.json").write_text(json.dumps(_sm("sm_90")))
    assert sidecar.read_engine_sidecar(plan) == sidecar.EngineSidecar(compute_capability="9.0", tensorrt_version="10.3.0")
    (tmp_path / "model.plan.json").write_text(json.dumps(_sm("ninety")))
    with pytest.raises(ConfigError, match=r"model\.plan\.json.*is not like '9\.0'"):
        sidecar.read_engine_sidecar(plan)
    (tmp_path / "model.plan.json").write_text(json.dumps({**_sm("9.0"), "builder": "trtexec"}))
    with pytest.raises(ConfigError, match="unknown field `builder`"):
        sidecar.read_engine_sidecar(plan)


def test_engine_mismatch_rules(sidecar: types.ModuleType) -> None:
    exact = sidecar.EngineSidecar("9.0", "10.3.0")
    assert sidecar.engine_mismatch(exact, "9.0", "H100", "10.3.0.26") == ""
    assert sidecar.engine_mismatch(exact, "9.0", "H100", "") == ""  # TensorRT absent: the probe says so
    assert sidecar.engine_mismatch(exact, "10.0", "B200", "10.3.0") == "engine built for sm_90, but the GPU is sm_100 (B200)"
    assert "TensorRT 10.4.0 is installed" in sidecar.engine_mismatch(exact, "9.0", "H100", "10.4.0")
    portable = sidecar.EngineSidecar("8.0", "10.3.0", hardware_compatible=True)
    assert sidecar.engine_mismatch(portable, "8.9", "L40S", "10.3.0") == ""
    assert "Ampere and newer" in sidecar.engine_mismatch(portable, "7.5", "T4", "10.3.0")
    forward = sidecar.EngineSidecar("9.0", "10.3.0", version_compatible=True)
    assert sidecar.engine_mismatch(forward, "9.0", "H100", "10.8.0") == ""
    assert "version-compatible" in sidecar.engine_mismatch(forward, "9.0", "H100", "10.2.0")
    assert "version-compatible" in sidecar.engine_mismatch(forward, "9.0", "H100", "11.0.0")
