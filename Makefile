# optlab: `make demo` shows it working, `make test` proves it. Both build .venv first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo serve test lint typecheck unit clean lock system-packages bench

# Installs the versions in constraints.txt (the lock), as the Dockerfile does.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

# Rewrite the lock from a fresh venv (after changing dependencies in pyproject.toml); commit it.
lock:
	PYTHON=$(PYTHON) scripts/lock.sh constraints.txt

# What the tests need from the system (docker-compose, chromium): installed where we may, else named.
system-packages:
	scripts/system-packages.sh

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
# One CPU thread per training process, in the test processes and in the jobs their workers start
# (OPTLAB_JOB_THREADS): the suite already runs two test processes on two cores, and a second
# thread each only waits for a core (benchmarks/job_threads.py). Both, so that a job run in a test
# and the same job run by a worker round alike and compare bitwise.
test: $(STAMP) system-packages lint typecheck
	OMP_NUM_THREADS=1 OPTLAB_JOB_THREADS=1 $(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadgroup

# Figures, not tests (never part of `make test`): each benchmark prints its figures and one
# `BENCH <name> key=value ...` line per case; benchmarks/README.md has the latest, with commands.
# Needs PostgreSQL on 127.0.0.1:5432 (api, queue). About 15 minutes on the 2-core dev machine.
bench: $(STAMP)
	$(BIN)/python benchmarks/optimizer_step.py
	$(BIN)/python benchmarks/optimizer_step_keras.py
	$(BIN)/python benchmarks/tracking_overhead.py
	$(BIN)/python benchmarks/tracking_overhead_keras.py
	$(BIN)/python benchmarks/step_profile.py
	$(BIN)/python benchmarks/checkpoint_parts.py
	$(BIN)/python benchmarks/api.py
	$(BIN)/python benchmarks/queue_claims.py
	$(BIN)/python benchmarks/startup.py
	$(BIN)/python benchmarks/check_cost.py

clean:
	rm -rf $(VENV) .optlab .pytest_cache .mypy_cache .ruff_cache
