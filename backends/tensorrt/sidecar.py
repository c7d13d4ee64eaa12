"""`model.plan.json`, the sidecar saying which GPU and TensorRT version built an engine, and
the check whether an engine can run on a given GPU (pure: no TensorRT, no CUDA needed)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from daemon.backend import ConfigError

SIDECAR_SUFFIX = ".json"


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
