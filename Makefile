# moe-jax: two commands on a fresh machine with Python 3.11.
#   make smoke   runs the main job on the embedded defaults
#   make test    runs the test suite (everything not marked slow)
# Also: make test-quick (the model and MoE tests, for the edit-test loop), make docs (the
# site, into site/), make lint, make bench, make test-slow.
# Each creates .venv from pyproject.toml when it is missing or older than pyproject.toml.

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

COMPILERS := $(VENV)/compilers
# The pins of pyproject.toml's compile-tpu / compile-gpu extras (one place).
extra = $(shell $(PYTHON) -c "import tomllib; print(' '.join(repr(p) for p in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['$(1)']))")

.PHONY: smoke test test-quick test-slow bench bench-compiled docs lint clean-venv compilers

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# TPU/GPU compilers for `moe-jax compile`, outside the venv's import path (see pyproject.toml).
$(COMPILERS)/tpu/.installed: pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet --upgrade --target $(COMPILERS)/tpu $(call extra,compile-tpu)
	touch $@

$(COMPILERS)/gpu/.installed: pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet --upgrade --no-deps --target $(COMPILERS)/gpu $(call extra,compile-gpu)
	touch $@

compilers: $(COMPILERS)/tpu/.installed $(COMPILERS)/gpu/.installed

smoke: $(STAMP)
	$(VENV)/bin/moe-jax smoke

test: $(STAMP) $(COMPILERS)/tpu/.installed
	$(PY) -m pytest -m "not slow" -n 2 --dist loadfile -q --timeout=600 --durations=30

# What a change to the model or the MoE layer needs (tests/models, tests/moe; not slow):
# about 2.5 minutes on a 2-core CPU. `make test` runs these and everything else.
test-quick: $(STAMP) $(COMPILERS)/tpu/.installed
	$(PY) -m pytest tests/models tests/moe -m "not slow" -n 2 --dist loadfile -q --timeout=600

test-slow: $(STAMP) compilers
	$(PY) -m pytest -m slow -q

# Rerun the CPU benchmarks here and regenerate benchmarks/RESULTS.md (tens of minutes);
# bench-compiled: the TPU/GPU compiled-target ones (needs the compilers).
bench: $(STAMP)
	$(PY) benchmarks/run_all.py

bench-compiled: $(STAMP) compilers
	$(PY) benchmarks/run_all.py --compiled

# ruff (lint, format) over the tree and mypy over moe_jax/, as configured in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The documentation site (README, docs/, API pages from docstrings) into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean-venv:
	rm -rf $(VENV)
