# Two entry points for a fresh machine: `make serve` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint check clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# llama-cpp-python compiles llama.cpp here (about 10 minutes on 2 cores, once).
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/edged

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check daemon backends tests bench
	$(BIN)/mypy daemon backends

check: lint test

clean:
	rm -rf $(VENV) build dist
