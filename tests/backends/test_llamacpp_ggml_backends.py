"""llama.cpp's CPU code is chosen for the CPU it runs on, from the plugin's own library directory.

The Makefile builds llama.cpp on x86-64 with one CPU library per x86 generation
(GGML_CPU_ALL_VARIANTS), none linked in, and deletes the AMX one (GCC 12 miscompiles it:
test_llamacpp_quantized.py). ggml scores each library against the running CPU, and
backends/llamacpp/ggml_backends.py loads them from the directory llama-cpp-python loads
libllama from, which in the single executable is none of the places ggml looks by itself.
The checks hold on any x86 CPU: what is expected is read from this machine's /proc/cpuinfo.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from backends.llamacpp.ggml_backends import library_dir
from support import REPO_BACKENDS

PLUGIN_MODULE = REPO_BACKENDS / "llamacpp" / "ggml_backends.py"

x86_linux = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not Path("/proc/cpuinfo").is_file(),
    reason="the CPU variants are built on x86-64 only (other architectures keep llama.cpp's default)",
)

# The plugin's loader, imported from its file in a fresh interpreter: which libraries a process
# maps depends on what it loaded first, so each check gets its own process.
CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("ggml_backends", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
features = module.load_backends()
mapped = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libggml-cpu" in line})
print(json.dumps({"features": features.split(), "mapped": mapped}))
"""


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def load_in_child(cwd: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(PLUGIN_MODULE)], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@x86_linux
def test_the_build_has_a_cpu_library_per_x86_generation_and_no_amx_one() -> None:
    names = {path.name for path in library_dir().glob("libggml-cpu*.so")}
    assert {"libggml-cpu-x64.so", "libggml-cpu-haswell.so", "libggml-cpu-skylakex.so", "libggml-cpu-zen4.so"} <= names, (
        f"llama-cpp-python was not built as the Makefile builds it (GGML_CPU_ALL_VARIANTS): {sorted(names)}"
    )
    assert "libggml-cpu-sapphirerapids.so" not in names
    assert "libggml-cpu.so" not in names  # no CPU code linked in, that would run the baseline only


@x86_linux
def test_the_cpu_library_loaded_is_the_best_this_cpu_runs(tmp_path: Path) -> None:
    flags = cpu_flags()
    result = load_in_child(tmp_path)
    features = set(result["features"])
    assert len(result["mapped"]) == 1, result["mapped"]  # one CPU library kept, the others unloaded
    # What the variants require (ggml's x86 cpu-feats): AVX2 comes with FMA, F16C and BMI2;
    # AVX-512 means F, CD, VL, DQ and BW.
    assert ("AVX2" in features) == ({"avx2", "fma", "f16c", "bmi2"} <= flags), (flags, features)
    assert ("AVX512" in features) == ({"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"} <= flags)
    if "AVX512" in features:
        assert ("AVX512_VNNI" in features) == ("avx512_vnni" in flags)
    assert "AMX_INT8" not in features


@x86_linux
def test_the_libraries_are_loaded_from_where_llama_cpp_python_loads_libllama(tmp_path: Path) -> None:
    """As in the single executable: a copy of the library directory, which ggml's own search
    (the directory compiled into it: this venv's; python's; the working directory) never sees."""
    copy = tmp_path / "lib"
    shutil.copytree(library_dir(), copy, symlinks=True)
    env = {"PATH": "/usr/bin:/bin", "LLAMA_CPP_LIB_PATH": str(copy)}
    result = load_in_child(tmp_path, env)
    assert [Path(path).parent for path in result["mapped"]] == [copy]


@x86_linux
def test_the_probe_names_the_cpu_features_of_the_library_it_loaded(
    backend_class: Callable[[str], type[Any]], tmp_path: Path
) -> None:
    probe = backend_class("llamacpp").probe()
    assert probe.available, probe.reason
    cpu = probe.runtime_version.partition("(cpu: ")[2].partition(";")[0]
    assert cpu.split() == load_in_child(tmp_path)["features"]
