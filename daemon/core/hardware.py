"""What hardware the daemon runs on: CPU, memory, OpenVINO devices, NVIDIA GPUs.

`Hardware` probes each fact the first time something asks for it and caches it: asking for
NVIDIA GPUs loads NVML, asking for OpenVINO devices imports OpenVINO (+40 MiB), so a daemon
serving one ONNX model on a CPU never pays for either. Selection (daemon.core.selection) reads
what it needs; `edged hardware` / `GET /v2/hardware` show everything (`Hardware.info()`). Every source is optional: a missing
/proc/cpuinfo, OpenVINO, NVML library or NVIDIA driver leaves that part empty and adds a line
to `notes` — probing never raises, because a daemon that cannot describe its GPU must still
serve on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

log = logging.getLogger(__name__)

T = TypeVar("T")

# CPU features that change which runtime or kernel is fastest, in the spelling used by
# HardwareInfo.cpu.flags. "amx" stands for any of the Linux amx_* flags; "neon" for ARM's
# Advanced SIMD (`asimd` on aarch64, `neon` on 32-bit ARM).
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx", "neon")

# Current-generation NVIDIA datacenter GPUs, matched against one word of the NVML name
# ("NVIDIA A100-SXM4-80GB" -> "A100"). These are where a pre-built TensorRT engine is the
# preferred path (the seed's "pre-compiled engine" tier). Deliberately absent:
#   A10G        AWS's variant of the A10; the seed lists it with the GPUs that want a
#               portable runtime, and whole-word matching keeps it from matching "A10".
#   T4, V100    datacenter products of older generations (Turing, Volta); the seed lists them
#               with the portable-runtime GPUs, and newer TensorRT 10 releases drop Volta.
#   GeForce / RTX / Quadro / Jetson parts: consumer, workstation or embedded.
# A model can still opt into TensorRT on any NVIDIA GPU (backend: tensorrt, or tensorrt in
# backend_preference); see docs/selection.md.
DATACENTER_GPUS: dict[str, str] = {
    "A100": "Ampere (8.0)",
    "A800": "Ampere (8.0)",
    "A30": "Ampere (8.0)",
    "A40": "Ampere (8.6)",
    "A10": "Ampere (8.6)",
    "H100": "Hopper (9.0)",
    "H800": "Hopper (9.0)",
    "H200": "Hopper (9.0)",
    "H20": "Hopper (9.0)",
    "GH200": "Hopper (9.0)",
    "L4": "Ada (8.9)",
    "L40": "Ada (8.9)",
    "L40S": "Ada (8.9)",
    "B100": "Blackwell (10.0)",
    "B200": "Blackwell (10.0)",
    "GB200": "Blackwell (10.0)",
}

# /proc/cpuinfo "CPU implementer" codes of common ARM vendors.
_ARM_IMPLEMENTERS = {
    "0x41": "ARM",
    "0x4e": "NVIDIA",
    "0x51": "Qualcomm",
    "0x61": "Apple",
    "0xc0": "Ampere",
}


class CpuInfo(msgspec.Struct, forbid_unknown_fields=True):
    model: str = ""
    # "GenuineIntel", "AuthenticAMD", or the ARM implementer's name.
    vendor: str = ""
    architecture: str = ""
    # The subset of CPU_FLAGS_OF_INTEREST this CPU has.
    flags: list[str] = []
    logical_cores: int = 0
    physical_cores: int = 0

    @property
    def is_intel(self) -> bool:
        return self.vendor == "GenuineIntel"


class OpenVinoDevice(msgspec.Struct, forbid_unknown_fields=True):
    # OpenVINO's device name: "CPU", "GPU.0", "NPU".
    name: str
    full_name: str = ""


class NvidiaGpu(msgspec.Struct, forbid_unknown_fields=True):
    index: int
    name: str
    memory_total: int = 0
    # "major.minor", e.g. "9.0" for Hopper.
    compute_capability: str = ""
    datacenter: bool = False

    @property
    def sm(self) -> str:
        """`sm_90` spelling of the compute capability, as engine builds name it."""
        return "sm_" + self.compute_capability.replace(".", "")


class HardwareInfo(msgspec.Struct, forbid_unknown_fields=True):
    cpu: CpuInfo = msgspec.field(default_factory=CpuInfo)
    memory_total: int = 0
    openvino_devices: list[OpenVinoDevice] = []
    nvidia_gpus: list[NvidiaGpu] = []
    nvidia_driver: str = ""
    # Installed TensorRT version ("" when not importable); engines must match it.
    tensorrt_version: str = ""
    # Why a source gave nothing (no NVML, no driver, ...), for `edged hardware`.
    notes: list[str] = []
    summary: str = ""

    def datacenter_gpus(self) -> list[NvidiaGpu]:
        return [gpu for gpu in self.nvidia_gpus if gpu.datacenter]


# --------------------------------------------------------------------------- pure parts


def is_datacenter_gpu(name: str) -> bool:
    """Whether an NVML device name belongs to DATACENTER_GPUS (whole-word match)."""
    words = name.upper().replace("-", " ").replace("_", " ").split()
    return any(word in DATACENTER_GPUS for word in words)


def parse_cpuinfo(text: str) -> CpuInfo:
    """Model, vendor, flags of interest and physical cores from /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    cores: set[tuple[str, str]] = set()
    physical_id = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        fields.setdefault(key, value)
        if key == "physical id":
            physical_id = value
        elif key == "core id":
            cores.add((physical_id, value))
    model = next(
        (fields[k] for k in ("model name", "model", "hardware", "cpu model", "processor")
         if k in fields and not fields[k].isdigit()),
        "",
    )
    vendor = fields.get("vendor_id", "")
    if not vendor and "cpu implementer" in fields:
        code = fields["cpu implementer"].lower()
        vendor = _ARM_IMPLEMENTERS.get(code, f"implementer {code}")
    raw_flags = set((fields.get("flags") or fields.get("features") or "").split())
    flags: list[str] = [flag for flag in ("avx2", "avx512f", "avx512_bf16") if flag in raw_flags]
    if any(flag.startswith("amx") for flag in raw_flags):
        flags.append("amx")
    if raw_flags & {"asimd", "neon"}:
        flags.append("neon")
    return CpuInfo(model=model, vendor=vendor, flags=flags, physical_cores=len(cores))


def summarize(info: HardwareInfo) -> str:
    """One line for logs and `edged hardware`: CPU, memory, accelerators."""
    cpu = info.cpu
    parts = [cpu.model or cpu.architecture or "unknown CPU"]
    if cpu.logical_cores:
        parts[0] += f" ({cpu.physical_cores or cpu.logical_cores} cores, {cpu.logical_cores} threads)"
    if cpu.flags:
        parts[0] += " [" + " ".join(cpu.flags) + "]"
    if info.memory_total:
        parts.append(f"{info.memory_total / 2**30:.1f} GiB RAM")
    intel = [d.name for d in info.openvino_devices if d.name.split(".")[0] in ("GPU", "NPU")]
    if intel:
        parts.append("OpenVINO " + ", ".join(intel))
    if info.nvidia_gpus:
        parts.extend(
            f"GPU {gpu.index}: {gpu.name} ({gpu.sm}, {'datacenter' if gpu.datacenter else 'other'})"
            for gpu in info.nvidia_gpus
        )
    else:
        parts.append("no GPU")
    return "; ".join(parts)


# --------------------------------------------------------------------------- probes


def _probe_cpu(notes: list[str]) -> CpuInfo:
    try:
        cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        notes.append(f"cpu: cannot read /proc/cpuinfo: {exc}")
        cpu = CpuInfo()
    cpu.architecture = platform.machine()
    cpu.logical_cores = os.cpu_count() or 0
    if not cpu.model:
        cpu.model = platform.processor()
    return cpu


def _probe_memory(notes: list[str]) -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError) as exc:
        notes.append(f"memory: sysconf failed: {exc}")
        return 0


def _probe_openvino(notes: list[str]) -> list[OpenVinoDevice]:
    if importlib.util.find_spec("openvino") is None:
        return []
    try:
        import openvino as ov

        core = ov.Core()
        devices: list[OpenVinoDevice] = []
        for name in core.available_devices:
            try:
                full_name = str(core.get_property(name, "FULL_DEVICE_NAME"))
            except Exception:  # a device can list itself yet fail property queries
                full_name = ""
            devices.append(OpenVinoDevice(name=name, full_name=full_name))
        return devices
    except Exception as exc:  # any runtime failure means "no OpenVINO devices", not a crash
        notes.append(f"openvino: device query failed: {type(exc).__name__}: {exc}")
        return []


def _text(value: Any) -> str:
    # Older pynvml releases return bytes, newer ones str.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _probe_nvidia(notes: list[str]) -> tuple[list[NvidiaGpu], str]:
    """GPUs and driver version via NVML; ([], "") when pynvml or the driver is missing."""
    try:
        import pynvml
    except ImportError:
        notes.append("nvidia: NVML bindings not installed (pip install nvidia-ml-py)")
        return [], ""
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        notes.append(f"nvidia: NVML unavailable: {exc}")
        return [], ""
    gpus: list[NvidiaGpu] = []
    driver = ""
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = _text(pynvml.nvmlDeviceGetName(handle))
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            except Exception as exc:  # one broken GPU (fallen off the bus) must not hide the rest
                notes.append(f"nvidia: GPU {index}: {exc}")
                continue
            gpus.append(
                NvidiaGpu(
                    index=index,
                    name=name,
                    memory_total=memory,
                    compute_capability=f"{major}.{minor}",
                    datacenter=is_datacenter_gpu(name),
                )
            )
    except Exception as exc:
        notes.append(f"nvidia: NVML query failed: {exc}")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return gpus, driver


def tensorrt_version() -> str:
    """The importable TensorRT's version, or "" (importing it is the only reliable source:
    the pip distribution name varies between tensorrt, tensorrt-cu12, tensorrt-cu13...)."""
    if importlib.util.find_spec("tensorrt") is None:
        return ""
    try:
        import tensorrt

        return str(tensorrt.__version__)
    except Exception as exc:  # present but broken (missing libnvinfer): treat as absent
        log.warning("tensorrt is installed but does not import: %s", exc)
        return ""


class Hardware:
    """This machine's facts, each probed on first use, cached, and never raising.

    Thread-safe: selection asks from worker threads. Attribute names are HardwareInfo's, so
    code reading facts does not care whether they came from a probe or a fixed snapshot.
    """

    def __init__(self, *, openvino: bool = True) -> None:
        self._openvino = openvino
        self._lock = threading.RLock()
        self._facts: dict[str, Any] = {}
        self._notes: list[str] = []

    @classmethod
    def fixed(cls, info: HardwareInfo) -> Hardware:
        """Facts given rather than probed (tests, and machines described by a file)."""
        hardware = cls()
        hardware._facts = {
            "cpu": info.cpu,
            "memory_total": info.memory_total,
            "openvino_devices": info.openvino_devices,
            "nvidia": (info.nvidia_gpus, info.nvidia_driver),
            "tensorrt_version": info.tensorrt_version,
        }
        hardware._notes = list(info.notes)
        return hardware

    def _fact(self, key: str, probe: Callable[[list[str]], T]) -> T:
        with self._lock:
            if key not in self._facts:
                self._facts[key] = probe(self._notes)
            return self._facts[key]

    @property
    def cpu(self) -> CpuInfo:
        return self._fact("cpu", _probe_cpu)

    @property
    def memory_total(self) -> int:
        return self._fact("memory_total", _probe_memory)

    @property
    def openvino_devices(self) -> list[OpenVinoDevice]:
        if not self._openvino:
            return []
        return self._fact("openvino_devices", _probe_openvino)

    @property
    def nvidia_gpus(self) -> list[NvidiaGpu]:
        return self._fact("nvidia", _probe_nvidia)[0]

    @property
    def nvidia_driver(self) -> str:
        return self._fact("nvidia", _probe_nvidia)[1]

    @property
    def tensorrt_version(self) -> str:
        # TensorRT only matters with an NVIDIA GPU; without one its import is never paid.
        return self._fact(
            "tensorrt_version", lambda notes: tensorrt_version() if self.nvidia_gpus else ""
        )

    @property
    def notes(self) -> list[str]:
        with self._lock:
            return list(self._notes)

    def datacenter_gpus(self) -> list[NvidiaGpu]:
        return [gpu for gpu in self.nvidia_gpus if gpu.datacenter]

    def info(self) -> HardwareInfo:
        """Every fact (probing what was not probed yet): blocking, call off the event loop."""
        info = HardwareInfo(
            cpu=self.cpu,
            memory_total=self.memory_total,
            openvino_devices=self.openvino_devices,
            nvidia_gpus=self.nvidia_gpus,
            nvidia_driver=self.nvidia_driver,
            tensorrt_version=self.tensorrt_version,
        )
        info.notes = self.notes
        info.summary = summarize(info)
        return info


def probe_hardware(*, openvino: bool = True) -> HardwareInfo:
    """Describe this machine now, every fact. Never raises; see `notes`."""
    return Hardware(openvino=openvino).info()
