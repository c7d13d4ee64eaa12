"""Backend selection policy with injected hardware and manifests read by the plugin registry."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import msgspec
import pytest

from daemon.core.hardware import CpuInfo, HardwareInfo, NvidiaGpu, is_datacenter_gpu
from daemon.core.plugins import PluginManifest, PluginRegistry
from daemon.core.selection import (
    Availability,
    EngineSidecar,
    Selection,
    choose_backends,
    engine_mismatch,
    read_engine_sidecar,
)
from daemon.errors import ConfigError
from daemon.model_config import InstanceGroup, ModelConfig

REPO_BACKENDS = Path(__file__).resolve().parents[2] / "backends"

# The plugins whose relative order the policy fixes; written as real manifest.toml files.
PLUGINS: dict[str, tuple[list[str], list[str]]] = {
    "tensorrt": (["model.plan"], ["tensorrt_plan"]),
    "openvino": (["model.xml", "model.onnx"], ["openvino"]),
    "llamacpp": (["model.gguf"], []),
    "onnxruntime": (["model.onnx"], ["onnxruntime_onnx"]),
    "python": (["model.py"], ["python"]),
}

XEON = CpuInfo(model="Intel(R) Xeon(R) Platinum 8480+", vendor="GenuineIntel", flags=["avx2", "avx512f", "amx"],
               logical_cores=8, physical_cores=4, architecture="x86_64")
EPYC = CpuInfo(model="AMD EPYC", vendor="AuthenticAMD", flags=["avx2"], logical_cores=2, physical_cores=2)


def gpu(index: int, name: str, cc: str) -> NvidiaGpu:
    return NvidiaGpu(index, name, 80 * 2**30, cc, is_datacenter_gpu(name))


H100 = HardwareInfo(cpu=XEON, nvidia_gpus=[gpu(0, "NVIDIA H100 80GB HBM3", "9.0")], tensorrt_version="10.3.0")
RTX4090 = HardwareInfo(cpu=EPYC, nvidia_gpus=[gpu(0, "NVIDIA GeForce RTX 4090", "8.9")], tensorrt_version="10.3.0")
CPU_ONLY = HardwareInfo(cpu=XEON)


def everything_available(name: str) -> str | None:
    return None


def unavailable(**reasons: str) -> Availability:
    return lambda name: reasons.get(name)


@pytest.fixture
def manifests(tmp_path: Path) -> list[PluginManifest]:
    root = tmp_path / "backends"
    for name, (artifacts, platforms) in PLUGINS.items():
        directory = root / name
        directory.mkdir(parents=True)
        (directory / "manifest.toml").write_text(
            f'name = "{name}"\nversion = "1.0.0"\napi-version = 1\nentrypoint = "backend:B"\n'
            f"artifacts = {json.dumps(artifacts)}\nplatforms = {json.dumps(platforms)}\n"
        )
    registry = PluginRegistry([root])
    assert sorted(registry.scan().added) == sorted(PLUGINS)
    return registry.manifests()


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


def test_datacenter_gpu_with_matching_engine_puts_tensorrt_first(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", sidecar=sm("9.0", gpu_name="NVIDIA H100 80GB HBM3"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    assert order(selection) == ["tensorrt", "openvino", "onnxruntime"]
    first = selection.candidates[0]
    assert first.artifact == files["model.plan"]
    assert first.device == "GPU:0"
    assert "sm_90" in first.reason and "NVIDIA H100 80GB HBM3" in first.reason
    assert selection.candidates[1].artifact == files["model.onnx"]
    assert selection.mode == "auto"


def test_consumer_gpu_skips_tensorrt_and_offloads_gguf(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.plan", "model.gguf", sidecar=sm("8.9"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, RTX4090, everything_available)
    assert order(selection) == ["llamacpp"]
    assert selection.candidates[0].device == "GPU:0"
    assert "GPU offload on GPU 0 NVIDIA GeForce RTX 4090" in selection.candidates[0].reason
    assert skipped(selection)["tensorrt"] == (
        "no NVIDIA datacenter GPU (found: GPU 0 NVIDIA GeForce RTX 4090); "
        "list tensorrt in backend_preference to use it anyway"
    )


def test_cpu_only_prefers_openvino_then_onnxruntime(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", "model.xml", "model.gguf", sidecar=sm("9.0"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, CPU_ONLY, everything_available)
    assert order(selection) == ["openvino", "llamacpp", "onnxruntime"]
    # OpenVINO takes its IR over the ONNX file; ONNX Runtime the ONNX file.
    assert selection.candidates[0].artifact.name == "model.xml"
    assert selection.candidates[0].reason.startswith("model.xml on Intel CPU")
    assert selection.candidates[1].device == "CPU"
    assert selection.candidates[2].artifact.name == "model.onnx"
    assert skipped(selection)["tensorrt"] == "no NVIDIA datacenter GPU (found: no GPU)"
    assert skipped(selection)["python"] == "no model.py in the version directory"


def test_mismatched_engine_is_skipped_with_both_sides_named(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", sidecar=sm("8.0", gpu_name="NVIDIA A100-SXM4-80GB"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    assert order(selection) == ["openvino", "onnxruntime"]
    assert skipped(selection)["tensorrt"] == (
        "engine built for sm_80 (NVIDIA A100-SXM4-80GB), but the GPU is sm_90 (NVIDIA H100 80GB HBM3)"
    )


def test_engine_from_other_tensorrt_version_is_skipped(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", sidecar=sm("9.0", trt="10.1.0"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    assert "tensorrt" not in order(selection)
    assert skipped(selection)["tensorrt"] == "engine built with TensorRT 10.1.0, but TensorRT 10.3.0 is installed"


def test_engine_without_sidecar_is_skipped(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx")
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    assert order(selection) == ["openvino", "onnxruntime"]
    assert "has no model.plan.json" in skipped(selection)["tensorrt"]


def test_unreadable_sidecar_is_skipped_with_the_decode_error(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.plan", sidecar={"compute_capability": "9.0"})
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    assert selection.candidates == []
    reason = skipped(selection)["tensorrt"]
    assert reason.startswith("unreadable engine sidecar:") and "tensorrt_version" in reason


def test_unavailable_runtime_falls_through_with_its_reason(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.onnx")
    available = unavailable(openvino="runtime not installed")
    selection = choose_backends(ModelConfig(name="m"), files, manifests, CPU_ONLY, available)
    assert order(selection) == ["onnxruntime"]
    assert skipped(selection)["openvino"] == "runtime not installed"


def test_backend_preference_reorders(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.onnx", "model.xml")
    config = ModelConfig(name="m", backend_preference=["onnxruntime"])
    selection = choose_backends(config, files, manifests, CPU_ONLY, everything_available)
    assert order(selection) == ["onnxruntime", "openvino"]
    assert selection.candidates[0].reason.endswith("(backend_preference #1)")


def test_backend_preference_opts_a_consumer_gpu_into_tensorrt(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", sidecar=sm("8.9"))
    config = ModelConfig(name="m", backend_preference=["tensorrt"])
    selection = choose_backends(config, files, manifests, RTX4090, everything_available)
    assert order(selection) == ["tensorrt", "openvino", "onnxruntime"]
    assert "opted in by backend_preference" in selection.candidates[0].reason


def test_kind_cpu_instances_keep_models_off_the_gpu(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.plan", "model.gguf", sidecar=sm("9.0"))
    config = ModelConfig(name="m", instance_group=[InstanceGroup(kind="KIND_CPU")])
    selection = choose_backends(config, files, manifests, H100, everything_available)
    assert order(selection) == ["llamacpp"]
    assert selection.candidates[0].device == "CPU"
    assert skipped(selection)["tensorrt"] == "instance_group asks for KIND_CPU"


def test_instance_group_gpus_pick_the_device(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    hardware = HardwareInfo(
        cpu=XEON,
        nvidia_gpus=[gpu(0, "NVIDIA A100-SXM4-80GB", "8.0"), gpu(1, "NVIDIA H100 80GB HBM3", "9.0")],
        tensorrt_version="10.3.0.26",
    )
    files = version_dir(tmp_path, "model.plan", sidecar=sm("9.0"))
    auto = choose_backends(ModelConfig(name="m"), files, manifests, hardware, everything_available)
    # The engine matches the second GPU only.
    assert auto.candidates[0].device == "GPU:1"
    pinned = ModelConfig(name="m", instance_group=[InstanceGroup(kind="KIND_GPU", gpus=[0])])
    selection = choose_backends(pinned, files, manifests, hardware, everything_available)
    assert selection.candidates == []
    assert "but the GPU is sm_80" in skipped(selection)["tensorrt"]


def test_default_model_filename_matches_by_suffix(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "resnet.onnx")
    config = ModelConfig(name="m", default_model_filename="resnet.onnx")
    selection = choose_backends(config, files, manifests, CPU_ONLY, everything_available)
    assert order(selection) == ["openvino", "onnxruntime"]
    assert {c.artifact.name for c in selection.candidates} == {"resnet.onnx"}
    assert "is not one of its artifacts" in skipped(selection)["llamacpp"]


def test_nothing_loadable_explains_every_plugin(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "README.md")
    selection = choose_backends(ModelConfig(name="m"), files, manifests, CPU_ONLY, everything_available)
    assert selection.candidates == []
    assert sorted(skipped(selection)) == sorted(PLUGINS)


def test_unknown_plugins_come_after_the_policy_order(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    extra = msgspec.convert(
        {"name": "aaa", "version": "1", "api-version": 1, "entrypoint": "b:B", "artifacts": ["model.onnx"]},
        PluginManifest,
    )
    files = version_dir(tmp_path, "model.onnx")
    selection = choose_backends(ModelConfig(name="m"), files, [extra, *manifests], CPU_ONLY, everything_available)
    assert order(selection) == ["openvino", "onnxruntime", "aaa"]


# --------------------------------------------------------------------------- explicit


def test_explicit_backend_is_the_only_candidate(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.onnx", "model.xml")
    selection = choose_backends(ModelConfig(name="m", backend="onnxruntime"), files, manifests, CPU_ONLY,
                                everything_available)
    assert order(selection) == ["onnxruntime"]
    assert selection.mode == "explicit"
    assert selection.candidates[0].reason == "config.backend = 'onnxruntime'"


def test_explicit_backend_auto_means_auto(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.onnx")
    selection = choose_backends(ModelConfig(name="m", backend="auto"), files, manifests, CPU_ONLY, everything_available)
    assert selection.mode == "auto"
    assert order(selection) == ["openvino", "onnxruntime"]


def test_explicit_tensorrt_bypasses_the_gpu_policy(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    # The user insists: the backend's own load-time check is the judge, not the policy.
    files = version_dir(tmp_path, "model.plan")
    selection = choose_backends(ModelConfig(name="m", backend="tensorrt"), files, manifests, RTX4090,
                                everything_available)
    assert order(selection) == ["tensorrt"]
    assert selection.candidates[0].device == "GPU:0"


def test_explicit_backend_takes_default_model_filename_as_is(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "weights.bin")
    config = ModelConfig(name="m", backend="python", default_model_filename="weights.bin")
    selection = choose_backends(config, files, manifests, CPU_ONLY, everything_available)
    assert selection.candidates[0].artifact == files["weights.bin"]


def test_explicit_backend_problems_are_reported(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.onnx")
    unknown = choose_backends(ModelConfig(name="m", backend="tflite"), files, manifests, CPU_ONLY, everything_available)
    assert unknown.candidates == []
    assert skipped(unknown)["tflite"].startswith("no backend plugin named 'tflite' (known: [")
    missing = choose_backends(ModelConfig(name="m", backend="llamacpp"), files, manifests, CPU_ONLY,
                              everything_available)
    assert skipped(missing) == {"llamacpp": "no model.gguf in the version directory"}
    down = choose_backends(ModelConfig(name="m", backend="onnxruntime"), files, manifests, CPU_ONLY,
                           unavailable(onnxruntime="onnxruntime is not installed"))
    assert skipped(down) == {"onnxruntime": "onnxruntime is not installed"}


def test_platform_maps_through_manifests(tmp_path: Path, manifests: list[PluginManifest]) -> None:
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


def test_explain_is_json(tmp_path: Path, manifests: list[PluginManifest]) -> None:
    files = version_dir(tmp_path, "model.plan", "model.onnx", sidecar=sm("8.0"))
    selection = choose_backends(ModelConfig(name="m"), files, manifests, H100, everything_available)
    explained = json.loads(msgspec.json.encode(selection.explain()))
    assert explained["mode"] == "auto"
    assert explained["candidates"][0] == {
        "backend": "openvino", "artifact": "model.onnx", "device": "",
        "reason": "model.onnx on Intel CPU Intel(R) Xeon(R) Platinum 8480+",
    }
    assert {"backend": "tensorrt", "reason": skipped(selection)["tensorrt"]} in explained["skipped"]


# --------------------------------------------------------------------------- engines


def test_sidecar_reads_and_normalizes(tmp_path: Path) -> None:
    plan = tmp_path / "model.plan"
    assert read_engine_sidecar(plan) is None
    (tmp_path / "model.plan.json").write_text(json.dumps(sm("sm_90")))
    assert read_engine_sidecar(plan) == EngineSidecar(compute_capability="9.0", tensorrt_version="10.3.0")
    (tmp_path / "model.plan.json").write_text(json.dumps(sm("ninety")))
    with pytest.raises(ConfigError, match=r"model\.plan\.json.*is not like '9\.0'"):
        read_engine_sidecar(plan)
    (tmp_path / "model.plan.json").write_text(json.dumps({**sm("9.0"), "builder": "trtexec"}))
    with pytest.raises(ConfigError, match="unknown field `builder`"):
        read_engine_sidecar(plan)


def test_engine_mismatch_rules() -> None:
    exact = EngineSidecar("9.0", "10.3.0")
    assert engine_mismatch(exact, "9.0", "H100", "10.3.0.26") == ""
    assert engine_mismatch(exact, "9.0", "H100", "") == ""  # TensorRT absent: the probe says so
    assert engine_mismatch(exact, "10.0", "B200", "10.3.0") == "engine built for sm_90, but the GPU is sm_100 (B200)"
    assert "TensorRT 10.4.0 is installed" in engine_mismatch(exact, "9.0", "H100", "10.4.0")
    portable = EngineSidecar("8.0", "10.3.0", hardware_compatible=True)
    assert engine_mismatch(portable, "8.9", "L40S", "10.3.0") == ""
    assert "Ampere and newer" in engine_mismatch(portable, "7.5", "T4", "10.3.0")
    forward = EngineSidecar("9.0", "10.3.0", version_compatible=True)
    assert engine_mismatch(forward, "9.0", "H100", "10.8.0") == ""
    assert "version-compatible" in engine_mismatch(forward, "9.0", "H100", "10.2.0")
    assert "version-compatible" in engine_mismatch(forward, "9.0", "H100", "11.0.0")


# --------------------------------------------------------------------------- the repository's plugins


def test_repository_tensorrt_manifest_drives_selection(tmp_path: Path) -> None:
    registry = PluginRegistry([REPO_BACKENDS])
    registry.scan()
    manifest = registry.manifest("tensorrt")
    assert manifest.artifacts == ["model.plan"]
    assert manifest.platforms == ["tensorrt_plan"]
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here: the availability reason differs")

    def available(name: str) -> str | None:
        try:
            registry.resolve(name)
        except Exception as exc:
            return str(exc)
        return None

    files = version_dir(tmp_path, "model.plan", sidecar=sm("9.0"))
    selection = choose_backends(ModelConfig(name="m", platform="tensorrt_plan"), files, registry.manifests(),
                                H100, available)
    assert selection.candidates == []
    assert "required Python module 'tensorrt' is not installed" in skipped(selection)["tensorrt"]
