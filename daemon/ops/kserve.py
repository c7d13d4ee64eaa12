"""Running as a KServe serving runtime: KServe's model-server arguments and its `/mnt/models`.

KServe starts the container named `kserve-container` with the arguments the ServingRuntime
declares (ours: `deploy/kserve/servingruntime.yaml`), after its storage initializer has copied
the InferenceService's `storageUri` into `/mnt/models`. That directory may be a Triton-style
repository, one model directory (`config.pbtxt` and/or version directories), or the bare
artifact(s) of a single model (`model.onnx`, `phi.gguf`, `net.xml` + `net.bin`, ...). The last
two are turned into a one-model repository of symlinks under the state directory, named after
`--model_name`: the rest of the daemon only ever sees Triton's layout.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import msgspec

from daemon.config import DaemonConfig, state_dir
from daemon.core.layout import CONFIG_FILES, list_versions, scan_repository
from daemon.errors import ConfigError

# Artifact suffix -> the file name backends look for in a version directory (their manifests).
_ARTIFACTS = {".onnx": "model.onnx", ".gguf": "model.gguf", ".xml": "model.xml",
              ".plan": "model.plan", ".engine": "model.plan", ".py": "model.py"}
# Files that travel with an artifact under the same stem (OpenVINO's weights).
_COMPANIONS = {".xml": ".bin"}


def add_kserve_flags(parser: argparse.ArgumentParser) -> None:
    """KServe's model-server flags (underscore spelling, as KServe's own servers take them)."""
    group = parser.add_argument_group("KServe serving runtime")
    group.add_argument("--model_name", metavar="NAME",
                       help="the InferenceService's model name ({{.Name}} in the ServingRuntime)")
    group.add_argument("--model_dir", metavar="DIR",
                       help="where KServe put the model (/mnt/models): a repository, a model "
                            "directory, or a single model's file(s)")
    group.add_argument("--http_port", type=int, metavar="PORT",
                       help="listen on 0.0.0.0:PORT (KServe: 8080)")


def apply_kserve_flags(config: DaemonConfig, args: argparse.Namespace) -> DaemonConfig:
    """The config with KServe's flags applied (unchanged when none was given)."""
    name, model_dir, port = (getattr(args, k, None) for k in ("model_name", "model_dir", "http_port"))
    if name is None and model_dir is None and port is None:
        return config
    raw = msgspec.to_builtins(config)
    if port is not None:
        if not 0 < port < 65536:
            raise ConfigError(f"--http_port must be 1..65535, got {port}")
        raw.setdefault("server", {})["http"] = f"0.0.0.0:{port}"
    if model_dir is not None:
        repo = kserve_repository(Path(model_dir), name, state_dir(config) / "kserve-repository")
        models = raw.setdefault("models", {})
        models["repository"] = [str(repo)]
        models["control-mode"] = "none"
        models.pop("load", None)
    elif name is not None:
        raise ConfigError("--model_name needs --model_dir (where KServe mounted the model)")
    return msgspec.convert(raw, DaemonConfig)


def kserve_repository(model_dir: Path, name: str | None, work: Path) -> Path:
    """A Triton-layout repository serving what KServe put at `model_dir` (see the module doc).
    `work` is emptied and refilled when a one-model repository has to be made."""
    if not model_dir.exists():
        raise ConfigError(f"--model_dir {model_dir} does not exist")
    if model_dir.is_dir():
        found = scan_repository(model_dir)
        if found and not _is_model_dir(model_dir):
            if name is not None and name not in found:
                raise ConfigError(f"--model_name {name!r} is not a model of the repository "
                                  f"{model_dir} (it has: {', '.join(found)})")
            return model_dir
    if not name:
        raise ConfigError(f"--model_name is required: {model_dir} holds a single model, "
                          "not a repository, and the name is what clients address")
    if "/" in name or name.startswith("."):
        raise ConfigError(f"--model_name {name!r} is not a valid model name")
    if work.exists():
        shutil.rmtree(work)
    target = work / name
    if model_dir.is_dir() and _is_model_dir(model_dir):
        work.mkdir(parents=True)
        target.symlink_to(model_dir.resolve(), target_is_directory=True)
        return work
    files = [model_dir] if model_dir.is_file() else sorted(
        p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    links = _artifact_links(files, model_dir)
    (target / "1").mkdir(parents=True)
    for config_name in CONFIG_FILES:  # a config next to bare artifacts still applies
        if model_dir.is_dir() and (model_dir / config_name).is_file():
            (target / config_name).symlink_to((model_dir / config_name).resolve())
    for link, source in links.items():
        (target / "1" / link).symlink_to(source.resolve())
    return work


def _is_model_dir(path: Path) -> bool:
    return any((path / n).is_file() for n in CONFIG_FILES) or bool(list_versions(path))


def _artifact_links(files: list[Path], where: Path) -> dict[str, Path]:
    """Version-directory name -> source file for every model artifact among `files`."""
    links: dict[str, Path] = {}
    by_name = {f.name: f for f in files}
    for f in files:
        canonical = _ARTIFACTS.get(f.suffix.lower())
        if canonical is None:
            continue
        if canonical in links:
            raise ConfigError(f"{where} holds more than one {f.suffix} model ({links[canonical].name}, "
                              f"{f.name}); KServe's model_dir must hold a single model")
        links[canonical] = f
        companion = _COMPANIONS.get(f.suffix.lower())
        if companion is not None:
            weights = by_name.get(f.stem + companion)
            if weights is None:
                raise ConfigError(f"{f} needs its weights file {f.stem + companion} beside it")
            links["model" + companion] = weights
    if not links:
        names = ", ".join(sorted(by_name)) or "nothing"
        raise ConfigError(f"no model artifact in {where} (found: {names}); expected one of "
                          f"{', '.join(sorted(_ARTIFACTS))}")
    return links
