# The two commands a new user runs: `make demo` and `make test`. Each makes .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU torch from this machine's local wheel: an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
CUPY_EXTRA ?= cu12

.PHONY: venv demo test gpu-check bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,$(CUPY_EXTRA)]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m nvfp4_mla demo

# Lint, format, types, then the tests (GPU tests skip with their reason on a machine without one).
test: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q

# On a GPU machine, with an interpreter that already has torch and CuPy (GPU_PYTHON, default
# python3; nothing is installed), from the source tree: all GPU tests, the sanitizers and the
# benchmarks, logs under $$OUT (or ./gpu-logs); fails when any step fails.
GPU_PYTHON ?= python3

gpu-check:
	GPU_PYTHON=$(GPU_PYTHON) bash benchmarks/gpu_check.sh

# Results under bench-results/<gpu>/ (never over docs/).
bench:
	PYTHONPATH=src $(GPU_PYTHON) -m nvfp4_mla bench

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
