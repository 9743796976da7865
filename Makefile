# One entry point for a fresh machine: every target sets up what it needs.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch that CI and the documented set-up use; GPU users install
# any torch in the range pyproject.toml allows.
TORCH  ?= torch==2.13.0

.PHONY: setup demo test lint clean bench

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/fsdp-interactive demo

lint: setup
	$(VENV)/bin/ruff check fsdp_interactive tests bench
	$(VENV)/bin/ruff format --check fsdp_interactive tests bench

# pytest's exit code 5 (nothing collected) is reported as a failure: this suite always has tests.
test: setup lint
	$(PY) -m pytest tests --durations=15 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Benchmarks against torchrun, raw ipyparallel, torch FSDP1 and fully_shard: rewrites
# docs/benchmarks.md (+ .png, .json). Smoke run: make bench BENCH_ARGS='--quick --out /tmp/bench'
bench: setup
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
