# optlab: `make demo` shows it working, `make test` proves it. Both build .venv first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo serve test lint typecheck unit clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/optlab demo

serve: $(STAMP)
	$(BIN)/optlab serve

lint: $(STAMP)
	$(BIN)/ruff check service jobs optimizers tests benchmarks
	$(BIN)/ruff format --check service jobs optimizers tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy service jobs optimizers

# Tests spread over the cores (at most 4 workers: each loads torch and TensorFlow); tests that
# share one running service are kept on one worker (xdist_group).
test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadgroup

clean:
	rm -rf $(VENV) .optlab .pytest_cache .mypy_cache .ruff_cache
