"""Backend selection policy: the shipped plugins' manifests (rank, devices, artifacts), their
fit hooks (TensorRT's engine check), and injected hardware facts."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest

from daemon.backend import Backend, Device, Fit, FitRequest, TensorBackend
from daemon.core.hardware import CpuInfo, Hardware, HardwareInfo, NvidiaGpu, is_datacenter_gpu
from daemon.core.plugins import PluginManifest, PluginRegistry
from daemon.core.selection import Selection, choose_backends
from daemon.model_config import InstanceGroup, ModelConfig

REPO_BACKENDS = Path(__file__).resolve().parents[2] / "backends"

XEON = CpuInfo(model="Intel(R) Xeon(R) Platinum 8480+", vendor="GenuineIntel", flags=["avx2", "avx512f", "amx"],
               logical_cores=8, physical_cores=4, architecture="x86_64")
EPYC = CpuInfo(model="AMD EPYC", vendor="AuthenticAMD", flags=["avx2"], logical_cores=2, physical_cores=2)


def gpu(index: int, name: str, cc: str) -> NvidiaGpu:
    return NvidiaGpu(index, name, 80 * 2**30, cc, is_datacenter_gpu(name))


H100 = Hardware.fixed(HardwareInfo(cpu=XEON, nvidia_gpus=[gpu(0, "NVIDIA H100 80GB HBM3", "9.0")],
                                   tensorrt_version="10.3.0"))
RTX4090 = Hardware.fixed(HardwareInfo(cpu=EPYC, nvidia_gpus=[gpu(0, "NVIDIA GeForce RTX 4090", "8.9")],
                                      tensorrt_version="10.3.0"))
CPU_ONLY = Hardware.fixed(HardwareInfo(cpu=XEON))

Resolve = Callable[[str], "type[Backend] | str"]


class Plain(TensorBackend):
    """Stands in for plugins whose code selection never runs (they have no fit hook)."""


@pytest.fixture(scope="module")
def shipped() -> PluginRegistry:
    registry = PluginRegistry([REPO_BACKENDS])
    registry.scan()
    return registry


@pytest.fixture(scope="module")
def manifests(shipped: PluginRegistry) -> list[PluginManifest]:
    return shipped.manifests()


@pytest.fixture(scope="module")
def everything_available(shipped: PluginRegistry) -> Resolve:
    """Every plugin usable; TensorRT is its real class (its fit hook is what is tested),
    imported without the registry's `requires` check so no TensorRT install is needed."""
    trt = shipped._import(REPO_BACKENDS / "tensorrt", shipped.manifest("tensorrt"))
    return lambda name: trt if name == "tensorrt" else Plain


def unavailable(base: Resolve, **reasons: str) -> Resolve:
    return lambda name: reasons.get(name) or base(name)


PLUGINS = ("tensorrt", "openvino", "llamacpp", "onnxruntime", "python")


def version_dir(tmp_path: Path, *names: str, sidecar: dict[str, object] | None = None) -> dict[str, Path]:
    """A version directory holding `names` (selection reads none of them but the sidecar)."""
    directory = tmp_path / "model" / "1"
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_bytes(b"\0")
    if sidecar is not None:
        (directory / "model.plan.json").write_text(json.dumps(sidecar))
    return {path.name: path for path in directory.iterdir()}


def sm(cc: str, trt: str = "10.3.0", **extra: object) -> dict[str, object]:
    return {"compute_capability": cc, "tensorrt_version": trt, **extra}


def order(selection: Selection) -> list[str]:
    return [c.backend for c in selection.candidates]


def skipped(selection: Selection) -> dict[str, str]:
    return dict(selection.skipped)


# --------------------------------------------------------------------------- auto


def test_datacenter_gpu_with_matching_engine_puts_tensorrt_first(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", sidecar=sm("9.0", gpu_name="NVIDIA H100 80GB HBM3"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    assert order(selection) == ["tensorrt", "openvino", "onnxruntime"]
    first = selection.candidates[0]
    assert first.artifact == files["model.plan"]
    assert first.device == Device("gpu:nvidia", 0)
    assert "sm_90" in first.reason and "NVIDIA H100 80GB HBM3" in first.reason
    assert selection.candidates[1].artifact == files["model.onnx"]
    assert selection.mode == "auto"


def test_consumer_gpu_skips_tensorrt_and_offloads_gguf(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", "model.gguf", sidecar=sm("8.9"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, RTX4090, everything_available)
    assert order(selection) == ["llamacpp"]
    assert selection.candidates[0].device == Device("gpu:nvidia", 0)
    assert selection.candidates[0].reason == "model.gguf on GPU 0 NVIDIA GeForce RTX 4090"
    assert skipped(selection)["tensorrt"] == (
        "no NVIDIA datacenter GPU (found: GPU 0 NVIDIA GeForce RTX 4090); "
        "list tensorrt in backend_preference to use it anyway"
    )


def test_cpu_only_prefers_openvino_then_onnxruntime(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", "model.xml", "model.gguf", sidecar=sm("9.0"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, CPU_ONLY, everything_available)
    assert order(selection) == ["openvino", "llamacpp", "onnxruntime"]
    # OpenVINO takes its IR over the ONNX file; ONNX Runtime the ONNX file.
    assert selection.candidates[0].artifact.name == "model.xml"
    assert selection.candidates[0].reason == (
        "model.xml on CPU Intel(R) Xeon(R) Platinum 8480+ or gpu:intel/npu (the runtime picks)"
    )
    assert selection.candidates[0].device == Device("auto")
    assert selection.candidates[1].device == Device("cpu")
    assert selection.candidates[2].artifact.name == "model.onnx"
    assert skipped(selection)["tensorrt"] == "it runs only on NVIDIA GPUs (usable here: none)"
    assert skipped(selection)["python"] == "no model.py in the version directory"


def test_mismatched_engine_is_skipped_with_both_sides_named(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", sidecar=sm("8.0", gpu_name="NVIDIA A100-SXM4-80GB"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    assert order(selection) == ["openvino", "onnxruntime"]
    assert skipped(selection)["tensorrt"] == (
        "engine built for sm_80 (NVIDIA A100-SXM4-80GB), but the GPU is sm_90 (NVIDIA H100 80GB HBM3)"
    )


def test_engine_from_other_tensorrt_version_is_skipped(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", sidecar=sm("9.0", trt="10.1.0"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    assert "tensorrt" not in order(selection)
    assert skipped(selection)["tensorrt"] == "engine built with TensorRT 10.1.0, but TensorRT 10.3.0 is installed"


def test_engine_without_sidecar_is_skipped(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx")
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    assert order(selection) == ["openvino", "onnxruntime"]
    assert "has no model.plan.json" in skipped(selection)["tensorrt"]


def test_unreadable_sidecar_is_skipped_with_the_decode_error(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", sidecar={"compute_capability": "9.0"})
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    assert selection.candidates == []
    reason = skipped(selection)["tensorrt"]
    assert reason.startswith("unreadable engine sidecar:") and "tensorrt_version" in reason


def test_unavailable_runtime_falls_through_with_its_reason(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.onnx")
    available = unavailable(everything_available, openvino="runtime not installed")
    selection = choose_backends(ModelConfig(name="m"), files, manifests, CPU_ONLY, available)
    assert order(selection) == ["onnxruntime"]
    assert skipped(selection)["openvino"] == "runtime not installed"


def test_backend_preference_reorders(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.onnx", "model.xml")
    config = ModelConfig(name="m", backend_preference=["onnxruntime"])
    selection = choose_backends(config, files, manifests, CPU_ONLY, everything_available)
    assert order(selection) == ["onnxruntime", "openvino"]
    assert selection.candidates[0].reason.endswith("(backend_preference #1)")


def test_backend_preference_opts_a_consumer_gpu_into_tensorrt(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", sidecar=sm("8.9"))
    config = ModelConfig(name="m", backend_preference=["tensorrt"])
    selection = choose_backends(config, files, manifests, RTX4090, everything_available)
    assert order(selection) == ["tensorrt", "openvino", "onnxruntime"]
    assert "opted in by backend_preference" in selection.candidates[0].reason


def test_kind_cpu_instances_keep_models_off_the_gpu(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", "model.gguf", sidecar=sm("9.0"))
    config = ModelConfig(name="m", instance_group=[InstanceGroup(kind="KIND_CPU")])
    selection = choose_backends(config, files, manifests, H100, everything_available)
    assert order(selection) == ["llamacpp"]
    assert selection.candidates[0].device == Device("cpu")
    assert skipped(selection)["tensorrt"] == "it runs only on NVIDIA GPUs and instance_group asks for KIND_CPU"


def test_instance_group_gpus_pick_the_device(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    hardware = Hardware.fixed(HardwareInfo(
        cpu=XEON,
        nvidia_gpus=[gpu(0, "NVIDIA A100-SXM4-80GB", "8.0"), gpu(1, "NVIDIA H100 80GB HBM3", "9.0")],
        tensorrt_version="10.3.0.26",
    ))
    files = version_dir(tmp_path, "model.plan", sidecar=sm("9.0"))
    auto = choose_backends(ModelConfig(name="m"), files, manifests, hardware, everything_available)
    # The engine matches the second GPU only.
    assert auto.candidates[0].device == Device("gpu:nvidia", 1)
    pinned = ModelConfig(name="m", instance_group=[InstanceGroup(kind="KIND_GPU", gpus=[0])])
    selection = choose_backends(pinned, files, manifests, hardware, everything_available)
    assert selection.candidates == []
    assert "but the GPU is sm_80" in skipped(selection)["tensorrt"]


def test_default_model_filename_matches_by_suffix(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "resnet.onnx")
    config = ModelConfig(name="m", default_model_filename="resnet.onnx")
    selection = choose_backends(config, files, manifests, CPU_ONLY, everything_available)
    assert order(selection) == ["openvino", "onnxruntime"]
    assert {c.artifact.name for c in selection.candidates} == {"resnet.onnx"}
    assert "is not one of its artifacts" in skipped(selection)["llamacpp"]


def test_nothing_loadable_explains_every_plugin(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "README.md")
    selection = choose_backends(ModelConfig(name="m"), files, manifests, CPU_ONLY, everything_available)
    assert selection.candidates == []
    assert sorted(skipped(selection)) == sorted(PLUGINS)


def test_unranked_plugins_come_after_ranked_ones(
    tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    extra = msgspec.convert(
        {"name": "aaa", "version": "1", "api-version": 1, "entrypoint": "b:B", "artifacts": ["model.onnx"]},
        PluginManifest,
    )
    files = version_dir(tmp_path, "model.onnx")
    selection = choose_backends(ModelConfig(name="m"), files, [extra, *manifests], CPU_ONLY, everything_available)
    assert order(selection) == ["openvino", "onnxruntime", "aaa"]


# --------------------------------------------------------------------------- explicit


def test_explicit_backend_is_the_only_candidate(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.onnx", "model.xml")
    selection = choose_backends(ModelConfig(name="m", backend="onnxruntime"), files, manifests, CPU_ONLY,
                                everything_available)
    assert order(selection) == ["onnxruntime"]
    assert selection.mode == "explicit"
    assert selection.candidates[0].reason.endswith("(config.backend = 'onnxruntime')")


def test_explicit_backend_auto_means_auto(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.onnx")
    selection = choose_backends(ModelConfig(name="m", backend="auto"), files, manifests, CPU_ONLY, everything_available)
    assert selection.mode == "auto"
    assert order(selection) == ["openvino", "onnxruntime"]


def test_explicit_tensorrt_bypasses_the_gpu_policy(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    # The user insists: the backend's own load-time check is the judge, not the policy.
    files = version_dir(tmp_path, "model.plan")
    selection = choose_backends(ModelConfig(name="m", backend="tensorrt"), files, manifests, RTX4090,
                                everything_available)
    assert order(selection) == ["tensorrt"]
    assert selection.candidates[0].device == Device("gpu:nvidia", 0)


def test_explicit_backend_takes_default_model_filename_as_is(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "weights.bin")
    config = ModelConfig(name="m", backend="python", default_model_filename="weights.bin")
    selection = choose_backends(config, files, manifests, CPU_ONLY, everything_available)
    assert selection.candidates[0].artifact == files["weights.bin"]


def test_explicit_backend_problems_are_reported(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.onnx")
    unknown = choose_backends(ModelConfig(name="m", backend="tflite"), files, manifests, CPU_ONLY, everything_available)
    assert unknown.candidates == []
    assert skipped(unknown)["tflite"].startswith("no backend plugin named 'tflite' (known: [")
    missing = choose_backends(ModelConfig(name="m", backend="llamacpp"), files, manifests, CPU_ONLY,
                              everything_available)
    assert skipped(missing) == {"llamacpp": "no model.gguf in the version directory"}
    down = choose_backends(ModelConfig(name="m", backend="onnxruntime"), files, manifests, CPU_ONLY,
                           unavailable(everything_available, onnxruntime="onnxruntime is not installed"))
    assert skipped(down) == {"onnxruntime": "onnxruntime is not installed"}


def test_platform_maps_through_manifests(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx")
    selection = choose_backends(ModelConfig(name="m", platform="onnxruntime_onnx"), files, manifests, H100,
                                everything_available)
    assert order(selection) == ["onnxruntime"]
    assert selection.mode == "platform"
    plan = choose_backends(ModelConfig(name="m", platform="tensorrt_plan"), files, manifests, H100,
                           everything_available)
    assert order(plan) == ["tensorrt"]
    unknown = choose_backends(ModelConfig(name="m", platform="tensorflow_savedmodel"), files, manifests, H100,
                              everything_available)
    assert unknown.candidates == []
    assert "no backend plugin serves platform 'tensorflow_savedmodel'" in skipped(unknown)["tensorflow_savedmodel"]


def test_explain_is_json(tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", sidecar=sm("8.0"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    explained = json.loads(msgspec.json.encode(selection.explain()))
    assert explained["mode"] == "auto"
    assert explained["candidates"][0] == {
        "backend": "openvino", "artifact": "model.onnx", "device": "auto",
        "reason": "model.onnx on CPU Intel(R) Xeon(R) Platinum 8480+ or gpu:intel/npu (the runtime picks)",
    }
    assert {"backend": "tensorrt", "reason": skipped(selection)["tensorrt"]} in explained["skipped"]


# --------------------------------------------------------------------------- the repository's plugins


def test_repository_tensorrt_manifest_drives_selection(tmp_path: Path) -> None:
    registry = PluginRegistry([REPO_BACKENDS])
    registry.scan()
    manifest = registry.manifest("tensorrt")
    assert manifest.artifacts == ["model.plan"]
    assert manifest.platforms == ["tensorrt_plan"]
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here: the availability reason differs")

    def available(name: str) -> type[Backend] | str:
        try:
            return registry.resolve(name)
        except Exception as exc:
            return str(exc)

    files = version_dir(tmp_path, "model.plan", sidecar=sm("9.0"))
    selection = choose_backends(ModelConfig(name="m", platform="tensorrt_plan"), files, registry.manifests(),
                                H100, available)
    assert selection.candidates == []
    assert "required Python module 'tensorrt' is not installed" in skipped(selection)["tensorrt"]


# --------------------------------------------------------------------------- a plugin's own rules


GPU_PLUGIN_BACKEND = '''
from pathlib import Path
from typing import ClassVar

from daemon.backend import Device, ModelConfig, TensorBackend


class GpuOnly(TensorBackend):
    name: ClassVar[str] = "gpuonly"
    loaded_on: ClassVar[list[str]] = []

    def load_sync(self, config: ModelConfig, artifact: Path, device: Device) -> None:
        GpuOnly.loaded_on.append(str(device))

    def infer(self, inputs):
        return {name: array * 2 for name, array in inputs.items()}
'''


def write_gpu_plugin(root: Path) -> Path:
    """A plugin that wants an NVIDIA GPU and outranks every shipped one, by its manifest alone."""
    directory = root / "gpuonly"
    directory.mkdir(parents=True)
    (directory / "manifest.toml").write_text(
        'name = "gpuonly"\nversion = "1.0.0"\napi-version = 1\nentrypoint = "backend:GpuOnly"\n'
        'artifacts = ["model.onnx"]\nrank = 100\ndevices = ["gpu:nvidia"]\n'
    )
    (directory / "backend.py").write_text(GPU_PLUGIN_BACKEND)
    return root


def test_a_dropped_in_gpu_plugin_outranks_openvino_by_its_manifest(tmp_path: Path) -> None:
    registry = PluginRegistry([REPO_BACKENDS, write_gpu_plugin(tmp_path / "plugins")])
    registry.scan()

    def resolve(name: str) -> type[Backend] | str:
        return registry.resolve(name) if name == "gpuonly" else Plain

    files = version_dir(tmp_path, "model.onnx")
    on_gpu = choose_backends(ModelConfig(name="m"), files, registry.manifests(), H100, resolve)
    assert order(on_gpu) == ["gpuonly", "openvino", "onnxruntime"]
    assert on_gpu.candidates[0].device == Device("gpu:nvidia", 0)
    assert on_gpu.candidates[0].reason == "model.onnx on GPU 0 NVIDIA H100 80GB HBM3"
    on_cpu = choose_backends(ModelConfig(name="m"), files, registry.manifests(), CPU_ONLY, resolve)
    assert order(on_cpu) == ["openvino", "onnxruntime"]
    assert skipped(on_cpu)["gpuonly"] == "it runs only on NVIDIA GPUs (usable here: none)"


async def test_a_dropped_in_gpu_plugin_serves_on_the_gpu_selection_gave_it(tmp_path: Path) -> None:
    import numpy as np

    from daemon.backend import InferRequest
    from daemon.core.registry import ModelRegistry
    from daemon.core.stats import MetricsRegistry

    plugins = PluginRegistry([REPO_BACKENDS, write_gpu_plugin(tmp_path / "plugins")])
    plugins.scan()
    registry = ModelRegistry(plugins, H100, MetricsRegistry(), tmp_path / "state")
    model_dir = tmp_path / "repo" / "m"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.onnx").write_bytes(b"not read by this plugin")
    (model_dir / "model.toml").write_text(
        'max_batch_size = 4\n[[input]]\nname = "X"\ndata_type = "FP32"\ndims = [2]\n'
        '[[output]]\nname = "X"\ndata_type = "FP32"\ndims = [2]\n'
    )
    try:
        await registry.load("m", model_dir)
        model = registry.get("m")
        assert model.backend == "gpuonly"
        assert model.selection["device"] == "gpu:nvidia:0"
        cls = plugins.resolve("gpuonly")
        assert cls.loaded_on == ["gpu:nvidia:0"]  # type: ignore[attr-defined]
        response = await model.infer(InferRequest({"X": np.ones((1, 2), np.float32)}))
        np.testing.assert_array_equal(response.outputs["X"], [[2.0, 2.0]])
    finally:
        await registry.close()


class _FitsNowhere(TensorBackend):
    name: ClassVar[str] = "python"

    @classmethod
    def fit(cls, request: FitRequest) -> Fit:
        return Fit(problem=f"{request.artifact.name} needs a unicorn")


def test_fit_hook_problems_are_reported_and_skipped(
    tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    files = version_dir(tmp_path, "model.py")
    resolve = lambda name: _FitsNowhere if name == "python" else everything_available(name)  # noqa: E731
    selection = choose_backends(ModelConfig(name="m"), files, manifests, CPU_ONLY, resolve)
    assert selection.candidates == []
    assert skipped(selection)["python"] == "model.py needs a unicorn"


def test_shipped_manifests_state_rank_devices_and_instances(manifests: list[PluginManifest]) -> None:
    by_name = {m.name: m for m in manifests}
    ranks = sorted(PLUGINS, key=lambda n: -by_name[n].rank)
    assert ranks == ["tensorrt", "openvino", "llamacpp", "onnxruntime", "python"]
    assert by_name["tensorrt"].devices == ["gpu:nvidia"]
    assert by_name["onnxruntime"].default_instances == 2
    assert {by_name[n].default_instances for n in PLUGINS if n != "onnxruntime"} == {1}


def _accelerated(*names: str, **fields: object) -> ModelConfig:
    from daemon.model_config import ExecutionAccelerator, ExecutionAccelerators, Optimization

    accelerators = ExecutionAccelerators([ExecutionAccelerator(name) for name in names])
    return ModelConfig(name="m", optimization=Optimization(execution_accelerators=accelerators), **fields)


@pytest.mark.parametrize("fields", [{"backend": "onnxruntime"}, {"platform": "onnxruntime_onnx"}, {}])
def test_the_openvino_accelerator_puts_the_openvino_plugin_first(
    tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve, fields: dict[str, str]
) -> None:
    files = version_dir(tmp_path, "model.onnx")
    selection = choose_backends(_accelerated("openvino", **fields), files, manifests, CPU_ONLY, everything_available)
    # ONNX Runtime stays as the fallback, as Triton's falls back to its CPU provider.
    assert order(selection) == ["openvino", "onnxruntime"]
    assert selection.candidates[0].artifact.name == "model.onnx"
    assert selection.candidates[0].reason.endswith("(cpu_execution_accelerator 'openvino')")
    unavailable_here = unavailable(everything_available, openvino="runtime not installed")
    selection = choose_backends(_accelerated("openvino", **fields), files, manifests, CPU_ONLY, unavailable_here)
    assert order(selection) == ["onnxruntime"]


def test_an_unknown_accelerator_fails_as_in_triton(
    tmp_path: Path, manifests: list[PluginManifest], everything_available: Resolve
) -> None:
    from daemon.errors import ConfigError

    files = version_dir(tmp_path, "model.onnx")
    with pytest.raises(ConfigError, match=r"^unknown Execution Accelerator 'tensorrt' is requested$"):
        choose_backends(_accelerated("openvino", "tensorrt", backend="onnxruntime"), files, manifests, CPU_ONLY,
                        everything_available)


def test_a_model_asking_for_openvino_is_served_by_it(tmp_path: Path, start_daemon: Callable[..., Any]) -> None:
    """Over the socket: the ONNX model of a Triton ONNX Runtime config with the openvino CPU
    accelerator runs on the openvino plugin, answers as numpy does and serves its config as
    Triton; an unknown accelerator fails the load with Triton's text."""
    pytest.importorskip("openvino")
    pytest.importorskip("onnx")
    import numpy as np
    from model_builders import _simple_tensors, build_simple_onnx

    repo = tmp_path / "repo"
    accelerators = "optimization { execution_accelerators { cpu_execution_accelerator : [ { name : \"%s\" } ] } }\n"
    for name, accelerator in (("fast", "openvino"), ("odd", "tensorrt")):
        build_simple_onnx(repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(
            'backend: "onnxruntime"\n' + _simple_tensors(8) + accelerators % accelerator
        )
    daemon = start_daemon("--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "fast")
    selection = daemon.get_json("/v2/models/fast")["selection"]
    assert selection["backend"] == "openvino"
    assert selection["candidates"][0]["reason"].endswith("(cpu_execution_accelerator 'openvino')")
    assert [c["backend"] for c in selection["candidates"]] == ["openvino", "onnxruntime"]
    a, b = np.arange(16, dtype=np.int32), np.full(16, 3, dtype=np.int32)
    body = {"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": v.tolist()}
                       for n, v in (("INPUT0", a), ("INPUT1", b))]}
    outputs = {o["name"]: o["data"] for o in daemon.post_ok("/v2/models/fast/infer", body)["outputs"]}
    assert outputs == {"OUTPUT0": (a + b).tolist(), "OUTPUT1": (a - b).tolist()}
    assert daemon.get_json("/v2/models/fast/config")["optimization"] == {"execution_accelerators": {
        "gpu_execution_accelerator": [], "cpu_execution_accelerator": [{"name": "openvino", "parameters": {}}]}}
    reply = daemon.request("POST", "/v2/repository/models/odd/load", "{}")
    assert reply.status == 400
    assert "unknown Execution Accelerator 'tensorrt' is requested" in reply.json()["error"]
