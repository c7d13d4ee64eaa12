# Two entry points for a fresh machine: `make serve` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint image clean

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

lint: $(STAMP)
	$(BIN)/ruff check daemon backends tests bench packaging
	$(BIN)/mypy daemon backends

# OCI image (dist/oci/edged.oci.tar): PyInstaller onedir on a minimal Debian root, built with
# mmdebstrap + umoci, no registry pull. Needs root; minutes; not part of `make test`.
image: $(STAMP)
	bash packaging/build.sh
	bash packaging/oci/build-image.sh

clean:
	rm -rf $(VENV) build dist
