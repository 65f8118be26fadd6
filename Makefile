# Every target does its own set-up: a fresh machine with Python 3.11 needs nothing else.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

VENV_NEXT := .venv-torch2.14
STAMP_NEXT := $(VENV_NEXT)/.installed

.PHONY: ops install demo test test-torch2.14 test-all lint unit clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 is pinned exactly (it is what CI tests).
	$(PY) -m pip install --quiet torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -e ".[dev]" torch==2.13.0
	$(MAKE) --no-print-directory ops VENV_PY=$(PY) VENV_DIR=$(VENV)
	touch $(STAMP)

# The second supported torch: 2.14.1 (a CUDA build that runs on the CPU here; pip takes
# it from this machine's disk). Used by test-torch2.14, which CI runs after test.
$(STAMP_NEXT): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 2; }
	$(PYTHON) -m venv $(VENV_NEXT)
	$(VENV_NEXT)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_NEXT)/bin/python -m pip install --quiet torch==2.14.1
	DS_BUILD_OPS=0 $(VENV_NEXT)/bin/python -m pip install --quiet -e ".[dev]" torch==2.14.1
	touch $(STAMP_NEXT)

install: $(STAMP)

# DeepSpeed (installed pure-Python, DS_BUILD_OPS=0) compiles its C++ ops on first use:
# the CPU communication op every engine loads, and FusedAdam (what the refusal tests build
# engines with). They are built once, into TORCH_EXTENSIONS_DIR under the venv (the tests
# use that folder), so no test waits for a compiler; the torch 2.14.1 venv, whose run
# leaves the framework tests out, starts no DeepSpeed engine and builds none. A build
# killed midway leaves a `lock` file that makes every later build wait forever: cleared
# first.
VENV_PY ?= $(PY)
VENV_DIR ?= $(VENV)
OPS ?= ShareMemCommBuilder FusedAdamBuilder
ops:
	find $(VENV_DIR)/torch_extensions -name lock -delete 2>/dev/null || true
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV_DIR))/torch_extensions $(VENV_PY) -c "import sys; from deepspeed.accelerator import get_accelerator as a; [a().create_op_builder(n).load(verbose=False) for n in sys.argv[1:]]" $(OPS)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks

# Two test processes (pytest-xdist), each taking whole files so that a file's shared
# multi-process fixtures start once, the heaviest files first (tests/conftest.py orders
# them; --no-loadscope-reorder keeps that order): on 2 cores (2026-11-28) about 28 minutes
# on torch 2.13.0 (1778 tests) and 13 on 2.14.1 (1583). TEST_WORKERS=1 runs them one at a
# time.
TEST_WORKERS ?= 2
PYTEST := -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

test: lint
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) $(PYTEST)

# The suite again on torch 2.14.1, less the tests marked primary_torch (tests/conftest.py:
# the framework integrations, the resume-test harness's own verdict tests, and the smoke
# tests of tools only the primary venv runs): the library's own suite.
test-torch2.14: $(STAMP_NEXT)
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV_NEXT))/torch_extensions $(VENV_NEXT)/bin/python \
		$(PYTEST) -m "not primary_torch"

test-all: test test-torch2.14

clean:
	rm -rf $(VENV) $(VENV_NEXT) build *.egg-info src/*.egg-info src/unbroken/format/*.so

# Benchmarks (20-30 minutes on 2 idle cores): benchmarks/save_restore.py is the one suite,
# every way to save and restore behind one contender API (benchmarks/contenders.py: ours
# sync, async_save=True and "overlap", raw DCP, torch.save, torch-checkpointing). Its CPU
# parts rewrite docs/benchmarks.md: single (ours vs the disk, torch.save and raw DCP at 0.3,
# 1.2 and 3 GB in one process and on 2 FSDP2 ranks, the issue 15 targets, the cost per GB)
# above the marker line, and one section each below it: peers (every contender side by
# side, restores in fresh processes), async (training blocked per async_save mode) and
# store (S3 on loopback vs local disk). Every part's raw figures go to
# docs/benchmarks.json, and `$(PY) benchmarks/save_restore.py --render docs/benchmarks.json
# --write-docs` renders the page again; its prose (the analysis of missed targets, the
# method, notes) is written by hand in the page, between `hand-written` markers that
# rendering keeps. The part device is the GPU page, docs/benchmarks-gpu.md: benchmarks/gpu.py
# on a machine with one GPU (`--render docs/benchmarks-gpu.json --write
# docs/benchmarks-gpu.md` renders it again). torch-checkpointing is the bench extra,
# installed with torch pinned so that pip never swaps the torch CI tests; without it its
# rows say "not installed".
# Smoke tests: --quick (tests/e2e/test_bench_smoke.py, test_gpu_bench_smoke.py).
STAMP_BENCH := $(VENV)/.installed-bench

$(STAMP_BENCH): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[dev,bench]" torch==2.13.0
	touch $(STAMP_BENCH)

.PHONY: bench
bench: $(STAMP_BENCH)
	$(PY) benchmarks/save_restore.py --batch 1 --write-docs --results docs/benchmarks.json

# Reader/writer races for a minute (the suite runs them for a few seconds) and the other
# concurrency and fault tests of docs/reliability.md, and 20 two-process accelerate runs that
# must each exit cleanly (the suite runs 5): the verdict must be zero false failures, whatever
# the timing. Prints each role's figures (race: {...}).
RACE_SECONDS ?= 60
.PHONY: reliability
reliability: $(STAMP)
	UNBROKEN_RACE_SECONDS=$(RACE_SECONDS) UNBROKEN_EXIT_RUNS=20 $(PY) -m pytest -q -s \
		tests/e2e/test_races.py tests/unit/test_concurrent_readers.py \
		tests/integrations/test_accelerate_exit.py \
		tests/cli/test_concurrent_readers.py tests/unit/test_resave_crash.py \
		tests/unit/test_disk_full.py tests/unit/test_unreadable.py

# Health-check rates (about 5 minutes on 2 idle cores, 10-16 when they are shared): trains
# three small scripts, measures false alarms on exact resumes and catches on buggy ones,
# prints the tables and regenerates docs/health-check.md (its prose that no measurement
# changes is written by hand in the page, between `hand-written` markers that it keeps).
# A smoke test: $(PY) benchmarks/health_check.py --quick
.PHONY: health-check
health-check: $(STAMP)
	$(PY) benchmarks/health_check.py --write-docs
