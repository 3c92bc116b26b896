# One command to set up and run the main job, one to set up and run the tests:
#   make repro     # venv + install + `dvc repro` (tiny preset, offline, CPU)
#   make test      # venv + install + lint + type check + all tests
# The torch build is chosen here, not in package metadata. For another build:
#   make repro TORCH_SPEC="torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export DVC_NO_ANALYTICS := 1

.PHONY: setup repro test lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC) -e ".[dev]"
	touch $@

repro: setup
	dvc repro

lint: setup
	ruff check src stages tests
	mypy

# One pytest worker per core and one more (at most 8), each at one torch thread, one
# file per worker, the files with slow tests handed out first (tests/conftest.py;
# xdist's own reordering by test count would hand them out last). About a sixth of
# the suite is waiting (stage processes starting, polls, kills at timed moments),
# which the extra worker fills. mypy (one core, ~25 s) checks beside the tests;
# either failing fails the target. docs/TESTING.md: timings.
test: setup
	ruff check src stages tests
	@mypy > $(VENV)/mypy.log 2>&1 & mypy_pid=$$!; \
	workers=$$(( $$(nproc) + 1 )); [ $$workers -le 8 ] || workers=8; \
	pytest -q --numprocesses $$workers --dist loadfile --no-loadscope-reorder \
	  --durations=15; tests=$$?; \
	wait $$mypy_pid; types=$$?; echo mypy; cat $(VENV)/mypy.log; \
	exit $$(( tests || types ))
