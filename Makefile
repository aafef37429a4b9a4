# moe-jax: two commands on a fresh machine with Python 3.11.
#   make smoke   runs the main job on the embedded defaults
#   make test    runs the test suite (everything not marked slow)
# Each creates .venv from pyproject.toml when it is missing or older than pyproject.toml.

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: smoke test test-slow bench clean-venv

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

smoke: $(STAMP)
	$(VENV)/bin/moe-jax smoke

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -n 2 --dist loadfile -q

test-slow: $(STAMP)
	$(PY) -m pytest -m slow -q

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean-venv:
	rm -rf $(VENV)
