# One entry point for a fresh machine: every target sets up what it needs.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch that CI and the documented set-up use; GPU users install
# any torch in the range pyproject.toml allows.
TORCH  ?= torch==2.13.0

.PHONY: setup demo test test-stress lint docs clean bench bench-gpu gpu-check setup-torch test-torch \
	setup-system-python test-system-python

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev,hf,frameworks]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/fsdp-interactive demo

lint: setup
	$(VENV)/bin/ruff check fsdp_interactive tests bench docs
	$(VENV)/bin/ruff format --check fsdp_interactive tests bench docs

# The magic reference (docs/magics.md, from the magics' parsers) and the API reference
# (pdoc, from the docstrings, into out/docs/api/index.html); fails on a pdoc warning or a
# public name without a docstring. make test checks both (tests/docs/test_reference.py).
docs: setup
	$(PY) docs/reference.py

# pytest's exit code 5 (nothing collected) is reported as a failure: this suite always has tests.
test: setup lint
	$(PY) -m pytest tests --durations=15 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The tests marked `timing` (live output and bars, death and hang detection, breakpoints,
# interrupts, recovery and multi-host faults), STRESS_ROUNDS rounds beside a CPU hog of
# twice the cores that the runner starts and ends; prints each test's failures out of N
# (tests/stress.py; reports in out/stress). STRESS_ARGS='-- -k bar' narrows it. After each
# round, STRESS_STARTS pool starts and stops of 4 and of 8 ranks, cold and from a warmed
# forker (tests/start_loop.py), and the starts that failed out of those made.
STRESS_ROUNDS ?= 5
STRESS_STARTS ?= 5
test-stress: setup
	$(PY) -m tests.stress --rounds $(STRESS_ROUNDS) --starts $(STRESS_STARTS) $(STRESS_ARGS)

# The rank-side tests on another torch release, in its own virtualenv (.venv-torch-VERSION)
# with torch's PyPI wheel (a CUDA build; it runs on CPU). CI runs the lowest release
# pyproject.toml admits and the newest one installable here:
#   make test-torch TORCH_VERSION=2.9.1
# tests/test_torch_compat.py checks every private torch name the package uses; fsdp/,
# inspect/ and checkpoint/ run the code that uses them, and TORCH_POOL_TESTS start ranks
# that run torch.
TORCH_VERSION ?=
TORCH_VENV     = .venv-torch-$(TORCH_VERSION)
# Of tests/pool, the files whose ranks run torch code a release can change: the group's
# start and the forked engines, collectives and the flight recorder behind the
# diagnostics, the cell watch's generators, recovery (init deferral, snapshots, a wedged
# collective freed). Not the pool's snapshot root (test_snapshot_root.py: a folder's
# lifetime across restarts, deaths and a killed kernel, kept by processes, not by torch).
TORCH_POOL_TESTS = $(addprefix tests/pool/,test_pool_basics.py test_forked_engines.py \
	test_diagnostics.py test_cell_watch.py test_cuda_logic.py test_rank_threads.py \
	test_recovery.py test_recovery_slice.py test_recovery_trainer.py)
TORCH_TESTS   ?= tests/test_torch_compat.py tests/fsdp tests/inspect tests/checkpoint \
	$(TORCH_POOL_TESTS)
# Left to make test: what a torch release cannot change (the rest of tests/pool: the pool's
# processes, protocols and fault-injection loops; the tests marked timing: output, hang and
# death detection under load) and the world4 repeats of 2-rank tests (the same code paths,
# at twice the CPU time).
TORCH_SKIP    ?= -m "not timing and not world4"

setup-torch:
	@if [ -z "$(TORCH_VERSION)" ]; then echo "usage: make $@ TORCH_VERSION=2.9.1" >&2; exit 2; fi
	$(MAKE) --no-print-directory setup VENV=$(TORCH_VENV) TORCH=torch==$(TORCH_VERSION)
	$(TORCH_VENV)/bin/python -c 'import sys, torch; v = torch.__version__.split("+")[0]; \
	sys.exit(None if v == "$(TORCH_VERSION)" else f"$(TORCH_VENV) has torch {v}")'

test-torch: setup-torch
	$(TORCH_VENV)/bin/python -m pytest $(TORCH_TESTS) $(TORCH_SKIP) --durations=10 $(PYTEST_ARGS)

# The checkpoint, snapshot and recovery tests again on the distribution's own Python
# (Debian 12's /usr/bin/python3 is 3.11.2, whose enum pickling differs from the 3.11
# release .venv runs), in .venv-system-python: the package, torch's CPU build, pytest.
SYSTEM_PYTHON ?= /usr/bin/python3
SYSTEM_VENV    = .venv-system-python
# Every checkpoint load unpickles DCP metadata: the save/load, error and Stateful tests,
# every snapshot test, and the pool's snapshot root and recovery (the multi-rank FSDP1
# recipes and the CLI are left to the main lane: about 6 minutes in all on 2 cores).
SYSTEM_TESTS  ?= tests/checkpoint/test_metadata_unpickler.py tests/checkpoint/test_save_load.py \
	tests/checkpoint/test_errors.py tests/checkpoint/test_stateful.py \
	tests/checkpoint/test_snapshot_*.py tests/pool/test_snapshot_root.py \
	tests/pool/test_recovery.py

$(SYSTEM_VENV)/.installed: pyproject.toml
	$(SYSTEM_PYTHON) -m venv $(SYSTEM_VENV)
	$(SYSTEM_VENV)/bin/python -m pip install -q --upgrade pip
	$(SYSTEM_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(SYSTEM_VENV)/bin/python -m pip install -q -e . "pytest>=8" "pytest-timeout>=2.3"
	touch $@

setup-system-python: $(SYSTEM_VENV)/.installed

test-system-python: setup-system-python
	$(SYSTEM_VENV)/bin/python -c 'import sys; print("system Python", sys.version)'
	$(SYSTEM_VENV)/bin/python -m pytest $(SYSTEM_TESTS) --durations=10 $(PYTEST_ARGS)

# Benchmarks against torchrun, raw ipyparallel, torch FSDP1 and fully_shard: rewrites
# docs/benchmarks.md and its appendix (+ plots, .json). Smoke run: make bench BENCH_ARGS='--quick --out /tmp/bench'
bench: setup
	$(PY) -m bench $(BENCH_ARGS)

# On a host with 2+ CUDA devices: the GPU figure (merged into docs/benchmarks.*), then
# every CUDA-marked test.
bench-gpu: setup
	$(PY) -m bench --gpu $(BENCH_ARGS)
	$(PY) -m pytest -m cuda -q

# One CUDA GPU (an H100 or H200), a few minutes: the NCCL pool, FSDP on CUDA, checkpoints,
# the single-GPU bench figures and the CUDA-marked tests, one PASS/FAIL/SKIP line per
# check (bench/gpu_check.py). Without a GPU: says so and runs the checks that need none
# on CPU ranks (CI runs that dry run). GPU_CHECK_ARGS='--device 3' picks the device.
gpu-check: setup
	$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .venv-torch-* $(SYSTEM_VENV) .pytest_cache .ruff_cache
