# Two entry points for a fresh machine: `make serve` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint image clean compat

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# llama-cpp-python compiles llama.cpp here (about 10 minutes on 2 cores, once).
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
