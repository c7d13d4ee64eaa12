# Two entry points for a fresh machine: `make serve` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint clean

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

clean:
	rm -rf $(VENV) build dist
