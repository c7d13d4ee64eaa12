"""Build a TensorRT engine from an ONNX model, with the sidecar the daemon's selection reads.

Run it on the machine (or an identical GPU) that will serve the engine:

    python backends/tensorrt/build_engine.py model.onnx models/resnet/1 --max-batch 8

writes `models/resnet/1/model.plan` and `models/resnet/1/model.plan.json`:

    {"compute_capability": "9.0", "tensorrt_version": "10.3.0", "gpu_name": "NVIDIA H100 ...",
     "hardware_compatible": false, "version_compatible": false}

Inputs whose first dimension is dynamic get an optimization profile of batch 1..max-batch
(opt = --opt-batch, default max). Other dynamic dimensions need `--shape
NAME:MINxAxB,OPTxAxB,MAXxAxB`. The script needs only tensorrt and cuda-python, not the daemon.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

Shape = tuple[int, ...]


def parse_shape_option(text: str) -> tuple[str, tuple[Shape, Shape, Shape]]:
    """`x:1x3x224x224,4x3x224x224,8x3x224x224` -> ("x", (min, opt, max))."""
    name, sep, spec = text.rpartition(":")
    shapes = spec.split(",")
    if not sep or not name or len(shapes) != 3:
        raise ValueError(f"--shape {text!r}: expected NAME:MIN,OPT,MAX with shapes like 1x3x224x224")
    try:
        low, opt, high = (tuple(int(d) for d in shape.lower().split("x")) for shape in shapes)
    except ValueError:
        raise ValueError(f"--shape {text!r}: dimensions must be integers") from None
    if not len(low) == len(opt) == len(high):
        raise ValueError(f"--shape {text!r}: MIN, OPT and MAX must have the same rank")
    if any(not a <= b <= c for a, b, c in zip(low, opt, high, strict=True)):
        raise ValueError(f"--shape {text!r}: need MIN <= OPT <= MAX in every dimension")
    return name, (low, opt, high)


def profile_for(
    name: str,
    shape: Shape,
    max_batch: int,
    opt_batch: int,
    overrides: dict[str, tuple[Shape, Shape, Shape]],
) -> tuple[Shape, Shape, Shape] | None:
    """(min, opt, max) for one network input, or None when its shape is fully static."""
    if name in overrides:
        bounds = overrides[name]
        if len(bounds[0]) != len(shape):
            raise ValueError(f"--shape for input {name!r} has rank {len(bounds[0])}, the network's is {len(shape)}")
        return bounds
    if -1 not in shape:
        return None
    if -1 in shape[1:]:
        raise ValueError(
            f"input {name!r} has shape {list(shape)} with dynamic dimensions beyond the batch; "
            f"give them with --shape {name}:MIN,OPT,MAX"
        )
    if max_batch < 1:
        raise ValueError(f"input {name!r} has a dynamic batch dimension; give --max-batch >= 1")
    rest = shape[1:]
    tuned = min(opt_batch or max_batch, max_batch)
    return (1, *rest), (tuned, *rest), (max_batch, *rest)


def sidecar(
    compute_capability: str,
    tensorrt_version: str,
    gpu_name: str,
    *,
    hardware_compatible: bool = False,
    version_compatible: bool = False,
) -> dict[str, Any]:
    """The `model.plan.json` content (daemon.core.selection.EngineSidecar)."""
    return {
        "compute_capability": compute_capability,
        "tensorrt_version": tensorrt_version,
        "gpu_name": gpu_name,
        "hardware_compatible": hardware_compatible,
        "version_compatible": version_compatible,
    }


def _gpu(index: int) -> tuple[str, str]:
    """(name, "major.minor") of CUDA device `index`, made current for the builder."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        from cuda import cudart as rt
    (err,) = rt.cudaSetDevice(index)
    if err != rt.cudaError_t.cudaSuccess:
        raise SystemExit(f"cannot use CUDA device {index}: {rt.cudaGetErrorString(err)[1]!r}")
    err, props = rt.cudaGetDeviceProperties(index)
    if err != rt.cudaError_t.cudaSuccess:
        raise SystemExit(f"cannot query CUDA device {index}: {rt.cudaGetErrorString(err)[1]!r}")
    name = props.name
    if isinstance(name, bytes | bytearray):
        name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
    return str(name), f"{props.major}.{props.minor}"


def build(
    onnx_path: Path,
    out_dir: Path,
    *,
    max_batch: int = 8,
    opt_batch: int = 0,
    shapes: dict[str, tuple[Shape, Shape, Shape]] | None = None,
    workspace_mib: int = 1024,
    fp16: bool = False,
    hardware_compatible: bool = False,
    version_compatible: bool = False,
    device: int = 0,
) -> Path:
    """Build `out_dir/model.plan` (+ sidecar) from `onnx_path`; returns the plan's path."""
    import tensorrt as trt

    gpu_name, capability = _gpu(device)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode since TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SystemExit(f"TensorRT cannot parse {onnx_path}:\n{errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    if fp16:
        if not hasattr(trt.BuilderFlag, "FP16"):
            raise SystemExit("this TensorRT builds strongly typed networks only: export the ONNX model in FP16 instead")
        config.set_flag(trt.BuilderFlag.FP16)
    if hardware_compatible:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    if version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    profile = builder.create_optimization_profile()
    dynamic = False
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        bounds = profile_for(tensor.name, tuple(tensor.shape), max_batch, opt_batch, shapes or {})
        if bounds is not None:
            profile.set_shape(tensor.name, *bounds)
            dynamic = True
    if dynamic:
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SystemExit(f"TensorRT failed to build an engine from {onnx_path} (see the log above)")
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = out_dir / "model.plan"
    plan.write_bytes(bytes(memoryview(serialized)))
    content = sidecar(
        capability, trt.__version__, gpu_name,
        hardware_compatible=hardware_compatible, version_compatible=version_compatible,
    )
    plan.with_name(plan.name + ".json").write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("onnx", type=Path, help="the ONNX model")
    parser.add_argument("out_dir", type=Path, help="the model version directory to write model.plan into")
    parser.add_argument("--max-batch", type=int, default=8, help="largest batch of the profile (default 8)")
    parser.add_argument("--opt-batch", type=int, default=0, help="batch size to tune for (default: max)")
    parser.add_argument("--shape", action="append", default=[], metavar="NAME:MIN,OPT,MAX",
                        help="profile of an input with dynamic non-batch dimensions (repeatable)")
    parser.add_argument("--workspace", type=int, default=1024, help="builder workspace in MiB")
    parser.add_argument("--fp16", action="store_true", help="allow FP16 kernels (TensorRT 10 weakly typed networks)")
    parser.add_argument("--hardware-compatible", action="store_true",
                        help="run on every Ampere-or-newer GPU (slower than a per-GPU engine)")
    parser.add_argument("--version-compatible", action="store_true",
                        help="run on newer TensorRT of the same major version")
    parser.add_argument("--device", type=int, default=0, help="CUDA device to build on")
    args = parser.parse_args(argv)
    try:
        shapes = dict(parse_shape_option(text) for text in args.shape)
        plan = build(
            args.onnx, args.out_dir, max_batch=args.max_batch, opt_batch=args.opt_batch, shapes=shapes,
            workspace_mib=args.workspace, fp16=args.fp16, hardware_compatible=args.hardware_compatible,
            version_compatible=args.version_compatible, device=args.device,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {plan} and {plan.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
