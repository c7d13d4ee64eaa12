# Two entry points for a fresh machine: `make serve` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# -cpu-variants: a .venv made before llama.cpp was built as below is made again once.
STAMP := $(VENV)/.installed-cpu-variants

.PHONY: serve test lint image clean compat

# llama.cpp on x86-64 is not compiled for the build machine's CPU (its default, -march=native):
# the executable built here runs on the fleet's other boxes. It is compiled once per x86 CPU
# generation instead (GGML_CPU_ALL_VARIANTS: x86-64 baseline, AVX2, AVX-512, AVX-512 with VNNI
# and BF16, ...), each variant a library that ggml scores against the running CPU when the
# llamacpp plugin loads it, so an AMD EPYC or Intel Xeon keeps its AVX-512 kernels (10-35 %
# faster than AVX2 alone on an EPYC: docs/performance.md). The AMX variant is deleted: GCC 12's
# AMX intrinsics crash every quantized model on an Intel Xeon with AMX
# (tests/backends/test_llamacpp_quantized.py), which then takes the AVX-512 one.
# GGML_BACKEND_DIR lets llama-cpp-python's own Llama and server find the variants in this venv;
# the plugin names the directory itself (the executable's copy). Other architectures keep
# llama.cpp's default. No wheel cache (a cached wheel keeps the flags it was built with), and
# rebuilt over one an older .venv holds; its dependencies come with the next line.
LLAMA_CPP := $(shell sed -n 's/.*"\(llama-cpp-python==[^"]*\)".*/\1/p' pyproject.toml | head -n 1)
ifeq ($(shell uname -m),x86_64)
# $$lib: the recipe's shell variable (a := value is not expanded again where it is used).
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_BACKEND_DIR=$$lib
LLAMA_NOT_SHIPPED := libggml-cpu-sapphirerapids.so
endif

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# llama-cpp-python compiles llama.cpp here (10-15 minutes on 2 cores, once).
	lib=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("platlib"))')/llama_cpp/lib && \
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
	$(BIN)/pip install --quiet --no-cache-dir --force-reinstall --no-deps '$(LLAMA_CPP)' && \
	rm -f $(addprefix "$$lib"/,$(LLAMA_NOT_SHIPPED))
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The infer hot path compiled to C with mypyc, in place (packaging/native.py says which modules
# and why); built again whenever one of their sources changed. `python packaging/native.py clean`
# goes back to plain Python.
NATIVE := build/native/built
$(NATIVE): $(STAMP) packaging/native.py $(shell $(PY) packaging/native.py sources)
	$(BIN)/python packaging/native.py build

serve: $(STAMP) $(NATIVE)
	$(BIN)/edged

test: $(STAMP) $(NATIVE)
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

compat: $(STAMP) $(NATIVE) $(ORACLE)/.installed
	EDGED_ORACLE=$(abspath $(ORACLE)) $(BIN)/python -m pytest -q tests/compat

lint: $(STAMP)
	$(BIN)/ruff check daemon backends tests bench packaging
	$(BIN)/mypy daemon backends

# OCI image (dist/oci/edged.oci.tar): PyInstaller onedir on a minimal Debian root, built with
# mmdebstrap + umoci, no registry pull. Needs root; minutes; not part of `make test`.
image: $(STAMP) $(NATIVE)
	bash packaging/build.sh
	bash packaging/oci/build-image.sh

clean:
	$(PY) packaging/native.py clean
	rm -rf $(VENV) $(ORACLE) build dist
