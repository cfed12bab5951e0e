# Set-up and entry points. Every target creates .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install bench figures clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,wandb,lint,ray,tau2,openenv,grammar,mcp]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 tests

lint: $(STAMP)
	$(BIN)/ruff check tether tests benchmarks examples
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/python examples/customer_service/demo.py

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_throughput.py

# README.md's measured table, every row re-measured on this commit (an hour or more; ARGS="--only NAME" for some)
figures: $(STAMP)
	$(BIN)/python benchmarks/figures.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
