# Two entry points for a fresh machine: `make serve` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# -portable: a .venv made before llama.cpp was built portable (see below) is made again once.
STAMP := $(VENV)/.installed-portable

.PHONY: serve test lint image clean compat

# llama.cpp is compiled for a portable x86-64 baseline (AVX2, FMA, F16C), not for the build
# machine's CPU (its default, -march=native): the executable built here runs on the fleet's
# other x86 boxes, and GCC 12's AMX intrinsics, which -march=native turns on on an Intel Xeon
# with AMX, crash every quantized model there (tests/backends/test_llamacpp_quantized.py).
# Other architectures keep llama.cpp's default. No wheel cache (a cached wheel keeps the flags
# it was built with), and rebuilt over one an older .venv holds; its dependencies come with
# the next line.
LLAMA_CPP := $(shell sed -n 's/.*"\(llama-cpp-python==[^"]*\)".*/\1/p' pyproject.toml | head -n 1)
LLAMA_CMAKE_ARGS := $(if $(filter x86_64,$(shell uname -m)),-DGGML_NATIVE=OFF)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# llama-cpp-python compiles llama.cpp here (about 10 minutes on 2 cores, once).
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet --no-cache-dir --force-reinstall --no-deps '$(LLAMA_CPP)'
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/edged

test: $(STAMP)
	$(BIN)/ruff check daemon backends tests bench packaging
	$(BIN)/mypy daemon backends
	$(BIN)/python -m pytest -q

# Differential test against real Triton 2.51 (tritonserver from the nvidia-pytriton wheel, CPU,
# python backend): same models, same requests, compared answers. Not part of `make test`.
ORACLE := .oracle-venv
$(ORACLE)/.installed:
	$(PY) -m venv $(ORACLE)
	# The wheel's python stub embeds the system libpython and needs numpy < 2.
	$(ORACLE)/bin/pip install --quiet nvidia-pytriton==0.7.0 'numpy<2'
	touch $@

compat: $(STAMP) $(ORACLE)/.installed
	EDGED_ORACLE=$(abspath $(ORACLE)) $(BIN)/python -m pytest -q tests/compat

lint: $(STAMP)
	$(BIN)/ruff check daemon backends tests bench packaging
	$(BIN)/mypy daemon backends

# OCI image (dist/oci/edged.oci.tar): PyInstaller onedir on a minimal Debian root, built with
# mmdebstrap + umoci, no registry pull. Needs root; minutes; not part of `make test`.
image: $(STAMP)
	bash packaging/build.sh
	bash packaging/oci/build-image.sh

clean:
	rm -rf $(VENV) $(ORACLE) build dist
