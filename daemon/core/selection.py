"""Hardware-aware backend selection: which plugins may serve a model version, best first.

Pure policy. The caller (the model registry) lists the version directory, probes the hardware
once, and passes a callable that says whether a backend can run here; `choose_backends`
returns the candidates in order of preference plus a human reason for every backend it
skipped. The registry loads the first candidate and falls back to the next on a load failure.
The only I/O here is reading a TensorRT engine's small `model.plan.json` sidecar.

Policy (docs/selection.md has the full table):

    config.backend set (not "" / "auto")  -> that backend only
    config.platform set                   -> the backend(s) whose manifest lists the platform
    otherwise (auto), every plugin with an artifact in the folder, ordered:
        tensorrt     model.plan + NVIDIA datacenter GPU + engine built for that GPU/TensorRT
        openvino     model.xml / model.onnx on any CPU (Intel CPU, GPU, NPU are its home)
        llamacpp     model.gguf, offloaded to an NVIDIA GPU when one is present
        onnxruntime  model.onnx
        python       model.py
        other plugins, by name
    config.backend_preference moves the named backends to the front, in its order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from daemon.core.hardware import HardwareInfo, NvidiaGpu
from daemon.core.plugins import PluginManifest
from daemon.errors import ConfigError
from daemon.model_config import ModelConfig

# Auto-mode order. Plugins not named here come after these, alphabetically.
POLICY_ORDER = ("tensorrt", "openvino", "llamacpp", "onnxruntime", "python")

# Backends that can use an NVIDIA GPU and get a "GPU:<index>" device hint for it.
GPU_BACKENDS = frozenset({"tensorrt", "llamacpp"})

SIDECAR_SUFFIX = ".json"

# Backend name -> None when usable here, else the reason it is not (the plugin's probe).
Availability = Callable[[str], str | None]


class EngineSidecar(msgspec.Struct, forbid_unknown_fields=True):
    """`model.plan.json`: what a TensorRT engine was built for (build_engine.py writes it).

    A plan runs only on the GPU architecture and TensorRT version that built it, unless it was
    built hardware-compatible (Ampere and newer) or version-compatible (newer TensorRT of the
    same major version).
    """

    compute_capability: str
    tensorrt_version: str
    gpu_name: str = ""
    hardware_compatible: bool = False
    version_compatible: bool = False

    def __post_init__(self) -> None:
        # Accept "sm_90" too, store "9.0"; ValueError lets msgspec name the field.
        major, minor = _parse_cc(self.compute_capability)
        self.compute_capability = f"{major}.{minor}"


@dataclass(frozen=True, slots=True)
class Candidate:
    backend: str
    artifact: Path
    reason: str
    # "" = the backend's own default; "CPU"; "GPU:<n>" = NVIDIA GPU n (NVML index).
    device: str = ""


@dataclass(slots=True)
class Selection:
    candidates: list[Candidate] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    # "explicit", "platform" or "auto": which rule chose the candidates.
    mode: str = "auto"

    def explain(self) -> dict[str, Any]:
        """JSON-ready account for model metadata (the registry adds the backend it loaded)."""
        return {
            "mode": self.mode,
            "candidates": [
                {"backend": c.backend, "artifact": c.artifact.name, "device": c.device, "reason": c.reason}
                for c in self.candidates
            ],
            "skipped": [{"backend": backend, "reason": reason} for backend, reason in self.skipped],
        }


# --------------------------------------------------------------------------- engines


def read_engine_sidecar(plan: Path) -> EngineSidecar | None:
    """The sidecar beside `plan` (model.plan -> model.plan.json), or None when there is none."""
    path = plan.with_name(plan.name + SIDECAR_SUFFIX)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    try:
        return msgspec.json.decode(data, type=EngineSidecar)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.strip().split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def _parse_cc(cc: str) -> tuple[int, int]:
    """"9.0", "sm_90" or "90" -> (9, 0)."""
    text = cc.strip().lower().removeprefix("sm_")
    major, dot, minor = text.partition(".")
    if not dot:  # "90" -> "9", "0"; "100" -> "10", "0"
        major, minor = text[:-1], text[-1:]
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"compute capability {cc!r} is not like '9.0' or 'sm_90'")
    return int(major), int(minor)


def engine_mismatch(
    sidecar: EngineSidecar, compute_capability: str, gpu_name: str, tensorrt_version: str
) -> str:
    """Why an engine cannot run on this GPU / TensorRT, or "" when it can.

    An empty `tensorrt_version` (TensorRT not installed) skips the version check: the backend's
    probe reports that problem in its own words.
    """
    built, present = _parse_cc(sidecar.compute_capability), _parse_cc(compute_capability)
    built_for = f"sm_{built[0]}{built[1]}" + (f" ({sidecar.gpu_name})" if sidecar.gpu_name else "")
    here = f"sm_{present[0]}{present[1]} ({gpu_name})"
    if sidecar.hardware_compatible:
        # Hardware-compatible engines (AMPERE_PLUS) run on every Ampere-or-newer GPU.
        if present < (8, 0):
            return f"engine built hardware-compatible for Ampere and newer, but the GPU is {here}"
    elif built != present:
        return f"engine built for {built_for}, but the GPU is {here}"
    if tensorrt_version:
        want, have = _version_tuple(sidecar.tensorrt_version), _version_tuple(tensorrt_version)
        if sidecar.version_compatible:
            if not want or not have or want[0] != have[0] or have < want:
                return (
                    f"engine built version-compatible with TensorRT {sidecar.tensorrt_version} "
                    f"(runs on the same major version, same or newer), but TensorRT {tensorrt_version} "
                    "is installed"
                )
        else:
            # Plans need the exact version that built them; compare the parts both spell out
            # ("10.3.0" written by one tool matches "10.3.0.26" reported by another).
            common = min(len(want), len(have))
            if common < 2 or want[:common] != have[:common]:
                return (
                    f"engine built with TensorRT {sidecar.tensorrt_version}, but TensorRT "
                    f"{tensorrt_version} is installed"
                )
    return ""


# --------------------------------------------------------------------------- policy


def _wants_cpu_only(config: ModelConfig) -> bool:
    groups = config.instance_group
    return bool(groups) and all(group.kind == "KIND_CPU" for group in groups)


def _usable_gpus(config: ModelConfig, hardware: HardwareInfo) -> list[NvidiaGpu]:
    """NVIDIA GPUs this model may use: all, or those its KIND_GPU instance groups list."""
    if _wants_cpu_only(config):
        return []
    listed = {index for group in config.instance_group if group.kind == "KIND_GPU" for index in group.gpus}
    return [gpu for gpu in hardware.nvidia_gpus if not listed or gpu.index in listed]


def _gpu_names(gpus: list[NvidiaGpu]) -> str:
    return ", ".join(f"GPU {gpu.index} {gpu.name}" for gpu in gpus) or "no GPU"


def _find_artifact(
    manifest: PluginManifest, artifacts: Mapping[str, Path], default_filename: str, *, named: bool
) -> tuple[Path | None, str]:
    """The file this plugin would load, or None and the reason there is none.

    `default_model_filename` (Triton's) renames the artifact. In auto mode it belongs to a
    plugin when it is one of the plugin's names or has the same suffix ("resnet.onnx" ~
    "model.onnx"); when the config names the backend (`named`), it is taken as is.
    """
    if default_filename:
        suffixes = {Path(name).suffix for name in manifest.artifacts}
        matches = default_filename in manifest.artifacts or Path(default_filename).suffix in suffixes
        if not named and not matches:
            return None, f"default_model_filename {default_filename!r} is not one of its artifacts {manifest.artifacts}"
        if default_filename not in artifacts:
            return None, f"default_model_filename {default_filename!r} is not in the version directory"
        return artifacts[default_filename], ""
    for name in manifest.artifacts:
        if name in artifacts:
            return artifacts[name], ""
    if not manifest.artifacts:
        return None, "its manifest names no artifacts"
    return None, "no " + " or ".join(manifest.artifacts) + " in the version directory"


def _rank(name: str) -> tuple[int, str]:
    return (POLICY_ORDER.index(name) if name in POLICY_ORDER else len(POLICY_ORDER), name)


def _gpu_device(backend: str, config: ModelConfig, hardware: HardwareInfo) -> str:
    if backend not in GPU_BACKENDS:
        return ""
    gpus = _usable_gpus(config, hardware)
    return f"GPU:{gpus[0].index}" if gpus else ("CPU" if backend == "llamacpp" else "")


def _chosen(
    names: list[str],
    manifests: Mapping[str, PluginManifest],
    config: ModelConfig,
    artifacts: Mapping[str, Path],
    hardware: HardwareInfo,
    available: Availability,
    why: str,
    selection: Selection,
) -> None:
    """Explicit/platform mode: the named backends, gated only by artifact and availability."""
    for name in names:
        artifact, problem = _find_artifact(
            manifests[name], artifacts, config.default_model_filename, named=True
        )
        if artifact is None:
            selection.skipped.append((name, problem))
            continue
        if (reason := available(name)) is not None:
            selection.skipped.append((name, reason))
            continue
        device = _gpu_device(name, config, hardware)
        selection.candidates.append(Candidate(name, artifact, why, device))


def _tensorrt_gate(
    plan: Path, config: ModelConfig, hardware: HardwareInfo, opted_in: bool
) -> tuple[str, str, str]:
    """(problem, reason, device) for TensorRT in auto mode; problem is "" when eligible."""
    if _wants_cpu_only(config):
        return "instance_group asks for KIND_CPU", "", ""
    gpus = _usable_gpus(config, hardware)
    eligible = gpus if opted_in else [gpu for gpu in gpus if gpu.datacenter]
    if not eligible:
        if opted_in:
            return f"no NVIDIA GPU (found: {_gpu_names(hardware.nvidia_gpus)})", "", ""
        hint = "; list tensorrt in backend_preference to use it anyway" if gpus else ""
        return f"no NVIDIA datacenter GPU (found: {_gpu_names(gpus)}){hint}", "", ""
    try:
        sidecar = read_engine_sidecar(plan)
    except ConfigError as exc:
        return f"unreadable engine sidecar: {exc.message}", "", ""
    if sidecar is None:
        return (
            f"{plan.name} has no {plan.name}{SIDECAR_SUFFIX} saying which GPU and TensorRT "
            "version built it (build_engine.py writes one)",
            "", "",
        )
    problems = []
    for gpu in eligible:
        problem = engine_mismatch(sidecar, gpu.compute_capability, gpu.name, hardware.tensorrt_version)
        if not problem:
            tier = "datacenter GPU" if gpu.datacenter else "GPU, opted in by backend_preference"
            reason = (
                f"engine for {gpu.sm}/TensorRT {sidecar.tensorrt_version} matches "
                f"GPU {gpu.index} {gpu.name} ({tier})"
            )
            return "", reason, f"GPU:{gpu.index}"
        problems.append(problem)
    return "; ".join(dict.fromkeys(problems)), "", ""


def _auto_reason(name: str, artifact: Path, hardware: HardwareInfo, device: str) -> str:
    cpu = hardware.cpu
    if name == "openvino":
        where = "Intel CPU" if cpu.is_intel else "CPU"
        if cpu.model:
            where += f" {cpu.model}"
        extra = [d.name for d in hardware.openvino_devices if d.name.split(".")[0] in ("GPU", "NPU")]
        return f"{artifact.name} on {where}" + (f" (also sees {', '.join(extra)})" if extra else "")
    if name == "llamacpp":
        if device.startswith("GPU:"):
            index = int(device.split(":")[1])
            gpu = next(g for g in hardware.nvidia_gpus if g.index == index)
            kind = "datacenter" if gpu.datacenter else "consumer/other"
            return f"{artifact.name}, GPU offload on GPU {gpu.index} {gpu.name} ({kind})"
        return f"{artifact.name} on CPU"
    return f"{artifact.name} found"


def choose_backends(
    config: ModelConfig,
    artifacts: Mapping[str, Path],
    manifests: list[PluginManifest],
    hardware: HardwareInfo,
    available: Availability,
) -> Selection:
    """Candidates to load `config` from `artifacts` (file name -> path in the version dir)."""
    by_name = {manifest.name: manifest for manifest in manifests}
    explicit = config.backend.strip().lower()
    if explicit not in ("", "auto"):
        selection = Selection(mode="explicit")
        if explicit not in by_name:
            selection.skipped.append((explicit, f"no backend plugin named {explicit!r} (known: {sorted(by_name)})"))
        else:
            _chosen([explicit], by_name, config, artifacts, hardware, available,
                    f"config.backend = {explicit!r}", selection)
        return selection
    if config.platform:
        selection = Selection(mode="platform")
        names = sorted((m.name for m in manifests if config.platform in m.platforms), key=_rank)
        if not names:
            known = sorted({p for m in manifests for p in m.platforms})
            selection.skipped.append(
                (config.platform, f"no backend plugin serves platform {config.platform!r} (known platforms: {known})")
            )
        _chosen(names, by_name, config, artifacts, hardware, available,
                f"config.platform = {config.platform!r}", selection)
        return selection

    selection = Selection(mode="auto")
    preference = [name.strip().lower() for name in config.backend_preference]
    preferred = {name: i for i, name in enumerate(preference)}
    order = sorted(by_name, key=lambda n: (preferred.get(n, len(preferred)), _rank(n)))
    for name in order:
        artifact, problem = _find_artifact(
            by_name[name], artifacts, config.default_model_filename, named=False
        )
        if artifact is None:
            selection.skipped.append((name, problem))
            continue
        if name == "tensorrt":
            problem, reason, device = _tensorrt_gate(artifact, config, hardware, "tensorrt" in preferred)
            if problem:
                selection.skipped.append((name, problem))
                continue
        else:
            device = _gpu_device(name, config, hardware)
            reason = _auto_reason(name, artifact, hardware, device)
        # Last: availability imports the plugin (and its runtime), the costliest check.
        if (unavailable := available(name)) is not None:
            selection.skipped.append((name, unavailable))
            continue
        if name in preferred:
            reason += f" (backend_preference #{preferred[name] + 1})"
        selection.candidates.append(Candidate(name, artifact, reason, device))
    return selection
