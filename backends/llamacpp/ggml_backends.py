"""ggml's compute backends, loaded from llama-cpp-python's library directory.

On x86-64 the Makefile builds llama.cpp with its CPU code compiled once per x86 generation,
each variant a library that ggml scores against the running CPU (GGML_BACKEND_DL,
GGML_CPU_ALL_VARIANTS), and no backend linked in: until one is loaded llama.cpp has none and
loads no model. By itself ggml searches the directory compiled into it (the build machine's
venv), the executable's directory (python's, or edged's) and the working directory, none of
which holds the libraries inside the single executable, so the plugin names llama_cpp/lib.
A llama.cpp with its backends linked in (other architectures, a user's own build) has them
registered already, and loading is then a no-op.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

import llama_cpp.llama_cpp as llama

_LLAMA_LIBRARY = {"darwin": "libllama.dylib", "win32": "llama.dll"}.get(sys.platform, "libllama.so")


def library_dir() -> Path:
    """Where llama-cpp-python loads libllama from (its LLAMA_CPP_LIB_PATH override first)."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    return Path(override) if override else Path(llama.__file__).parent / "lib"


def load_backends() -> str:
    """Load ggml's backends once per process; return the CPU features llama.cpp runs with.

    Raises RuntimeError naming the directory when no CPU backend can be loaded from it.
    """
    # ggml's registry is process-wide, and two models may load at once on their own threads.
    # The lock lives on the llama_cpp module, as the log callback does: this plugin's modules
    # can be reloaded, the registry cannot.
    lock: threading.Lock = llama.__dict__.setdefault("_edged_backends_lock", threading.Lock())
    with lock:
        directory = library_dir()
        # ggml's functions through libllama, which llama_cpp has loaded from this path (the same
        # handle back), and whose dependencies dlsym searches: the libggml it uses. Opening
        # libggml.so itself could map a second copy with its own, empty registry (pip's wheels
        # hold libggml.so and libggml.so.0 as two files).
        ggml = ctypes.CDLL(str(directory / _LLAMA_LIBRARY))
        ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
        ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        if ggml.ggml_backend_reg_count() == 0:
            ggml.ggml_backend_load_all_from_path(os.fsencode(directory))
        if ggml.ggml_backend_reg_count() == 0:
            raise RuntimeError(
                f"llama.cpp found no CPU backend (libggml-cpu*) in {directory} that this CPU can run"
            )
    return cpu_features()


def cpu_features() -> str:
    """The CPU features the loaded CPU backend was compiled with, e.g. 'AVX2 FMA AVX512'."""
    # llama_print_system_info: "CPU : SSE3 = 1 | AVX2 = 1 | ... | REPACK = 1 |".
    info = (llama.llama_print_system_info() or b"").decode("utf-8", errors="replace")
    features = []
    for field in info.partition("CPU :")[2].split("|"):
        name, _, value = field.partition("=")
        if " : " in name:  # the next backend's section (CUDA : ...)
            break
        if value.strip() == "1":
            features.append(name.strip())
    return " ".join(features)
