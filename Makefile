# Every target does its own set-up: a fresh machine with Python 3.11 needs nothing else.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint unit clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 is pinned exactly (it is what CI tests).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks

test: lint
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# Save/restore benchmarks (4-7 minutes on 2 cores): prints the tables and regenerates
# docs/benchmarks.md. A smoke test: $(PY) benchmarks/save_restore.py --quick
.PHONY: bench
bench: $(STAMP)
	$(PY) benchmarks/save_restore.py --write-docs

# Health-check rates (about 5 minutes on 2 idle cores, 10-16 when they are shared): trains
# three small scripts, measures false alarms on exact resumes and catches on buggy ones,
# prints the tables and regenerates docs/health-check.md.
# A smoke test: $(PY) benchmarks/health_check.py --quick
.PHONY: health-check
health-check: $(STAMP)
	$(PY) benchmarks/health_check.py --write-docs
