"""Hardware-aware backend selection: which plugins may serve a model version, best first.

Pure policy over plugin manifests; it knows no backend by name. The loader lists the version
directory and passes a `resolve` callable (imports a plugin, or says why it cannot run here);
`choose_backends` returns the candidates in order of preference plus a human reason for every
plugin it skipped. The loader loads the first candidate and falls back to the next on failure.
Runs on a worker thread: resolving imports plugin code, and facts like NVIDIA GPUs are probed
on first read.

Policy (docs/selection.md has the whole story):

    config.backend set (not "" / "auto")  -> that backend only
    config.platform set                   -> the plugins whose manifest lists the platform
    otherwise (auto), every plugin with one of its artifacts in the version directory, by
        config.backend_preference (in its order), then manifest `rank` (highest first), then name
    a CPU execution accelerator in `optimization` (Triton's ONNX Runtime "openvino") puts the
        plugins whose manifest lists it before those; an unknown one fails the load
    each must then pass, in order of cost:
        its manifest's device kinds  (a GPU-only plugin is skipped without such a GPU)
        its probe                    (runtime importable and usable here)
        its optional fit() hook      (checks that need code, e.g. engine <-> GPU)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.backend import Backend, Device, FitRequest
from daemon.core.hardware import Hardware, NvidiaGpu
from daemon.core.plugins import PluginManifest
from daemon.errors import ConfigError
from daemon.model_config import ModelConfig

# Backend name -> its class, or the reason it cannot run here.
Resolve = Callable[[str], "type[Backend] | str"]


@dataclass(frozen=True, slots=True)
class Candidate:
    backend: str
    artifact: Path
    reason: str
    device: Device = field(default_factory=Device)


@dataclass(slots=True)
class Selection:
    candidates: list[Candidate] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    # "explicit", "platform" or "auto": which rule chose the candidates.
    mode: str = "auto"

    def explain(self) -> dict[str, Any]:
        """JSON-ready account for model metadata (the loader adds the backend it loaded)."""
        return {
            "mode": self.mode,
            "candidates": [
                {"backend": c.backend, "artifact": c.artifact.name, "device": str(c.device), "reason": c.reason}
                for c in self.candidates
            ],
            "skipped": [{"backend": backend, "reason": reason} for backend, reason in self.skipped],
        }


def _wants_cpu_only(config: ModelConfig) -> bool:
    groups = config.instance_group
    return bool(groups) and all(group.kind == "KIND_CPU" for group in groups)


def usable_gpus(config: ModelConfig, hardware: Hardware) -> list[NvidiaGpu]:
    """NVIDIA GPUs this model may use: all, or those its KIND_GPU instance groups list."""
    if _wants_cpu_only(config):
        return []
    listed = {index for group in config.instance_group if group.kind == "KIND_GPU" for index in group.gpus}
    return [gpu for gpu in hardware.nvidia_gpus if not listed or gpu.index in listed]


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


def _device(manifest: PluginManifest, config: ModelConfig, hardware: Hardware) -> tuple[Device | None, str]:
    """The device the manifest's kinds give on this machine, or None and why there is none.

    NVML is consulted only for plugins that list gpu:nvidia; a plugin that can also run on the
    CPU falls back to it. Plugins with several non-NVIDIA kinds get `auto`: the runtime picks
    (OpenVINO's AUTO plugin does this better than we could from outside).
    """
    kinds = manifest.devices
    if "gpu:nvidia" in kinds:
        gpus = usable_gpus(config, hardware)
        if gpus:
            return Device("gpu:nvidia", gpus[0].index), ""
    if "cpu" in kinds:
        return (Device("auto") if len(set(kinds) - {"cpu", "gpu:nvidia"}) else Device("cpu")), ""
    others = [k for k in kinds if k != "gpu:nvidia"]
    if others:
        # An Intel GPU / NPU without a CPU fallback: only the runtime can tell if one is here.
        return Device("auto"), ""
    if _wants_cpu_only(config):
        return None, "it runs only on NVIDIA GPUs and instance_group asks for KIND_CPU"
    found = ", ".join(f"GPU {g.index} {g.name}" for g in hardware.nvidia_gpus) or "none"
    return None, f"it runs only on NVIDIA GPUs (usable here: {found})"


def _where(device: Device, manifest: PluginManifest, hardware: Hardware) -> str:
    if device.kind == "gpu:nvidia":
        gpu = next((g for g in hardware.nvidia_gpus if g.index == device.index), None)
        return f"GPU {device.index} {gpu.name}" if gpu else f"GPU {device.index}"
    cpu = "CPU " + (hardware.cpu.model or hardware.cpu.architecture or "")
    if device.kind == "cpu":
        return cpu.strip()
    if device.kind == "auto":
        others = [k for k in manifest.devices if k not in ("cpu", "gpu:nvidia")]
        return (cpu.strip() + " or " if "cpu" in manifest.devices else "") + (
            f"{'/'.join(others)} (the runtime picks)"
        )
    return str(device)


def _consider(
    manifest: PluginManifest,
    config: ModelConfig,
    artifacts: Mapping[str, Path],
    hardware: Hardware,
    resolve: Resolve,
    *,
    requested: bool,
    why: str,
    selection: Selection,
) -> None:
    name = manifest.name
    artifact, problem = _find_artifact(manifest, artifacts, config.default_model_filename, named=requested)
    if artifact is None:
        selection.skipped.append((name, problem))
        return
    device, problem = _device(manifest, config, hardware)
    if device is None:
        selection.skipped.append((name, problem))
        return
    # Resolving imports the plugin (and its runtime): the costliest check, after the cheap ones.
    cls = resolve(name)
    if isinstance(cls, str):
        selection.skipped.append((name, cls))
        return
    gpus = usable_gpus(config, hardware) if "gpu:nvidia" in manifest.devices else []
    try:
        fit = cls.fit(FitRequest(config, artifact, hardware, device, requested, gpus))
    except Exception as exc:  # a plugin's hook failing is that plugin's problem only
        selection.skipped.append((name, f"fit check failed: {type(exc).__name__}: {exc}"))
        return
    if fit.problem:
        selection.skipped.append((name, fit.problem))
        return
    device = fit.device or device
    reason = fit.reason or f"{artifact.name} on {_where(device, manifest, hardware)}"
    selection.candidates.append(Candidate(name, artifact, f"{reason} ({why})" if why else reason, device))


def choose_backends(
    config: ModelConfig,
    artifacts: Mapping[str, Path],
    manifests: list[PluginManifest],
    hardware: Hardware,
    resolve: Resolve,
) -> Selection:
    """Candidates to load `config` from `artifacts` (file name -> path in the version dir)."""
    by_name = {manifest.name: manifest for manifest in manifests}

    def by_rank(name: str) -> tuple[int, str]:
        return (-by_name[name].rank, name)

    accelerators = config.optimization.cpu_accelerators() if config.optimization else []
    for accelerator in accelerators:
        if not any(accelerator in m.accelerators for m in manifests):
            # Triton's ONNX Runtime backend's text: it fails the load.
            raise ConfigError(f"unknown Execution Accelerator '{accelerator}' is requested")

    def accelerated(selection: Selection) -> Selection:
        """The plugins standing in for the config's accelerators go first (Triton's ONNX
        Runtime runs such a model through that runtime); the rest follow as chosen."""
        if accelerators:
            rest = list(selection.candidates)
            selection.candidates.clear()
            skipped = {backend for backend, _ in selection.skipped}
            for manifest in sorted(manifests, key=lambda m: by_rank(m.name)):
                asked = [a for a in accelerators if a in manifest.accelerators]
                if asked and manifest.name not in skipped:
                    _consider(manifest, config, artifacts, hardware, resolve, requested=True,
                              why=f"cpu_execution_accelerator {asked[0]!r}", selection=selection)
            chosen = {c.backend for c in selection.candidates}
            selection.candidates.extend(c for c in rest if c.backend not in chosen)
        return selection

    explicit = config.backend.strip().lower()
    if explicit not in ("", "auto"):
        selection = Selection(mode="explicit")
        if explicit not in by_name:
            selection.skipped.append((explicit, f"no backend plugin named {explicit!r} (known: {sorted(by_name)})"))
        else:
            _consider(by_name[explicit], config, artifacts, hardware, resolve, requested=True,
                      why=f"config.backend = {explicit!r}", selection=selection)
        return accelerated(selection)
    if config.platform:
        selection = Selection(mode="platform")
        names = sorted((m.name for m in manifests if config.platform in m.platforms), key=by_rank)
        if not names:
            known = sorted({p for m in manifests for p in m.platforms})
            selection.skipped.append(
                (config.platform, f"no backend plugin serves platform {config.platform!r} (known platforms: {known})")
            )
        for name in names:
            _consider(by_name[name], config, artifacts, hardware, resolve, requested=True,
                      why=f"config.platform = {config.platform!r}", selection=selection)
        return accelerated(selection)

    selection = Selection(mode="auto")
    preference = [name.strip().lower() for name in config.backend_preference]
    preferred = {name: i for i, name in enumerate(preference)}
    order = sorted(by_name, key=lambda n: (preferred.get(n, len(preferred)), *by_rank(n)))
    for name in order:
        why = f"backend_preference #{preferred[name] + 1}" if name in preferred else ""
        _consider(by_name[name], config, artifacts, hardware, resolve, requested=name in preferred,
                  why=why, selection=selection)
    return accelerated(selection)
