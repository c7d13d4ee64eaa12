"""The hardware probe on this machine, and the pure parsing/classification behind it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import msgspec
import pytest

from daemon.core.hardware import (
    CPU_FLAGS_OF_INTEREST,
    DATACENTER_GPUS,
    CpuInfo,
    HardwareInfo,
    NvidiaGpu,
    OpenVinoDevice,
    is_datacenter_gpu,
    parse_cpuinfo,
    probe_hardware,
    summarize,
    tensorrt_version,
)

# An NVIDIA driver exposes this node; without it NVML cannot find a GPU.
HAS_NVIDIA_DRIVER = Path("/dev/nvidiactl").exists()

INTEL_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 2
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 1
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
"""

AARCH64_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd0c

processor\t: 1
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics
CPU implementer\t: 0x41
"""

ARMV7_CPUINFO = """\
processor\t: 0
model name\t: ARMv7 Processor rev 4 (v7l)
Features\t: half thumb fastmult vfp edsp neon vfpv3 tls vfpv4
CPU implementer\t: 0x41
Hardware\t: BCM2835
"""


def test_probe_describes_this_machine() -> None:
    info = probe_hardware()
    assert info.cpu.logical_cores == os.cpu_count()
    assert 1 <= info.cpu.physical_cores <= info.cpu.logical_cores
    assert set(info.cpu.flags) <= set(CPU_FLAGS_OF_INTEREST)
    page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
    assert info.memory_total == page * pages
    assert info.summary == summarize(info)
    # The lead's `edged hardware` and GET /v2/hardware encode it with msgspec: round-trip it.
    assert msgspec.json.decode(msgspec.json.encode(info), type=HardwareInfo) == info


def test_cpu_flags_match_proc_cpuinfo() -> None:
    text = Path("/proc/cpuinfo").read_text()
    flags_line = next(line for line in text.splitlines() if line.startswith(("flags", "Features")))
    raw = set(flags_line.partition(":")[2].split())
    info = probe_hardware(openvino=False)
    assert ("avx2" in info.cpu.flags) == ("avx2" in raw)
    assert ("avx512f" in info.cpu.flags) == ("avx512f" in raw)


@pytest.mark.skipif(HAS_NVIDIA_DRIVER, reason="this machine has an NVIDIA driver")
def test_probe_says_no_gpu_without_a_driver() -> None:
    info = probe_hardware(openvino=False)
    assert info.nvidia_gpus == []
    assert info.summary.endswith("no GPU")
    # TensorRT is not even imported without a GPU.
    assert info.tensorrt_version == ""
    if importlib.util.find_spec("pynvml") is not None:
        # The NVML bindings are installed but find no library/driver: a note, not an exception.
        assert any(note.startswith("nvidia: NVML unavailable") for note in info.notes), info.notes
    else:
        assert any("nvidia-ml-py" in note for note in info.notes), info.notes


@pytest.mark.skipif(not HAS_NVIDIA_DRIVER, reason="needs an NVIDIA driver (/dev/nvidiactl)")
def test_probe_lists_nvidia_gpus() -> None:
    info = probe_hardware(openvino=False)
    assert info.nvidia_gpus, info.notes
    for gpu in info.nvidia_gpus:
        assert gpu.memory_total > 0
        assert gpu.datacenter == is_datacenter_gpu(gpu.name)
        major, _, minor = gpu.compute_capability.partition(".")
        assert major.isdigit() and minor.isdigit()


def test_openvino_devices_come_from_openvino() -> None:
    ov = pytest.importorskip("openvino")
    core = ov.Core()
    info = probe_hardware()
    assert [d.name for d in info.openvino_devices] == list(core.available_devices)
    for device in info.openvino_devices:
        assert device.full_name == core.get_property(device.name, "FULL_DEVICE_NAME")


def test_probe_without_openvino_lists_none() -> None:
    assert probe_hardware(openvino=False).openvino_devices == []


def test_tensorrt_version_empty_when_not_installed() -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here")
    assert tensorrt_version() == ""


def test_parse_intel_cpuinfo() -> None:
    cpu = parse_cpuinfo(INTEL_CPUINFO)
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu.vendor == "GenuineIntel"
    assert cpu.is_intel
    assert cpu.flags == ["avx2", "avx512f", "avx512_bf16", "amx"]
    # Processors 0 and 1 are hyperthreads of one core.
    assert cpu.physical_cores == 2


def test_parse_aarch64_cpuinfo() -> None:
    cpu = parse_cpuinfo(AARCH64_CPUINFO)
    assert cpu.vendor == "ARM"
    assert cpu.flags == ["neon"]
    assert not cpu.is_intel
    assert cpu.model == ""  # the probe falls back to platform.processor()


def test_parse_armv7_cpuinfo() -> None:
    cpu = parse_cpuinfo(ARMV7_CPUINFO)
    assert cpu.model == "ARMv7 Processor rev 4 (v7l)"
    assert cpu.flags == ["neon"]


def test_parse_empty_cpuinfo() -> None:
    assert parse_cpuinfo("") == CpuInfo()


@pytest.mark.parametrize(
    ("name", "datacenter"),
    [
        ("NVIDIA H100 80GB HBM3", True),
        ("NVIDIA H100 PCIe", True),
        ("NVIDIA H200", True),
        ("NVIDIA H20", True),
        ("NVIDIA GH200 480GB", True),
        ("NVIDIA A100-SXM4-80GB", True),
        ("NVIDIA A100 80GB PCIe", True),
        ("NVIDIA A30", True),
        ("NVIDIA A40", True),
        ("NVIDIA A10", True),
        ("NVIDIA L4", True),
        ("NVIDIA L40", True),
        ("NVIDIA L40S", True),
        ("NVIDIA B200", True),
        # A10G is AWS's A10 variant: whole-word matching keeps it out.
        ("NVIDIA A10G", False),
        ("Tesla T4", False),
        ("Tesla V100-SXM2-16GB", False),
        ("NVIDIA GeForce RTX 4090", False),
        ("NVIDIA RTX A6000", False),
        ("Orin (nvgpu)", False),
    ],
)
def test_datacenter_classification(name: str, datacenter: bool) -> None:
    assert is_datacenter_gpu(name) is datacenter


def test_datacenter_table_keys_are_single_upper_words() -> None:
    for key in DATACENTER_GPUS:
        assert key == key.upper() and " " not in key and "-" not in key


def test_summary_names_gpus_and_intel_accelerators() -> None:
    info = HardwareInfo(
        cpu=CpuInfo(model="Intel Core Ultra 7", vendor="GenuineIntel", flags=["avx2"], logical_cores=8, physical_cores=6),
        memory_total=16 * 2**30,
        openvino_devices=[OpenVinoDevice("CPU"), OpenVinoDevice("GPU.0"), OpenVinoDevice("NPU")],
        nvidia_gpus=[NvidiaGpu(0, "NVIDIA H100 80GB HBM3", 80 * 2**30, "9.0", True)],
    )
    assert summarize(info) == (
        "Intel Core Ultra 7 (6 cores, 8 threads) [avx2]; 16.0 GiB RAM; OpenVINO GPU.0, NPU; "
        "GPU 0: NVIDIA H100 80GB HBM3 (sm_90, datacenter)"
    )
    assert info.datacenter_gpus() == info.nvidia_gpus
